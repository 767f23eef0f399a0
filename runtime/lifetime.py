"""Process lifetime: kvrelay's child processes end with their launcher."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Asks the kernel for SIGTERM when the process that started this one
    exits (PR_SET_PDEATHSIG), so a launcher that dies leaves no orphans.
    Called by each child itself, first thing: a ``preexec_fn`` would run
    between fork and exec of a multi-threaded launcher, which is unsafe."""
    parent = os.getppid()
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        return
    if os.getppid() != parent:  # the launcher died before we asked
        sys.exit(1)
