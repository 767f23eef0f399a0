"""A worker's file-descriptor budget: how many KV handshakes it may hold open
at once without running out of descriptors for what it must keep serving
(gRPC, its authenticated KV connections, the model's files)."""

from __future__ import annotations

import resource

RESERVE = 512
"""Descriptors kept for everything but pending KV handshakes."""
MAX_HANDSHAKES = 4096
"""The most pending handshakes a receiver holds, however many descriptors it has."""
MIN_HANDSHAKES = 16


def raise_open_files_limit() -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit; returns the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = (1 << 20) if hard == resource.RLIM_INFINITY else hard
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):  # a container may forbid it: keep what we have
            pass
    return soft


def handshake_budget(open_files: int) -> int:
    """Pending KV handshakes a process with ``open_files`` descriptors may hold:
    half of what the reserve leaves, within [MIN_HANDSHAKES, MAX_HANDSHAKES]."""
    return max(MIN_HANDSHAKES, min(MAX_HANDSHAKES, (open_files - RESERVE) // 2))
