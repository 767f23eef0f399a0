"""Command functions imported when their command runs, so that the light
commands (generate, status, job, usage, audit, the operators') start without
torch or the engine: `kvrelay generate --help` does not pay for `kvrelay bench`."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True, slots=True)
class Lazy:
    """``module:name``, a command function (``args -> exit code``) imported on its first call."""

    module: str
    name: str

    def __call__(self, args: argparse.Namespace) -> int:
        func: Callable[[argparse.Namespace], int] = getattr(importlib.import_module(self.module), self.name)
        return func(args)


def local(name: str) -> Lazy:
    """A function of cli/local.py (the commands that run a model or a cluster here)."""
    return Lazy("kvrelay.cli.local", name)


def compute(name: str) -> Lazy:
    """A function of cli/compute.py (the commands that run torch in this process)."""
    return Lazy("kvrelay.cli.compute", name)


def command_module(name: str) -> ModuleType:
    """The cli module ``name`` (cli/<name>.py), imported when a command it parses is used."""
    return importlib.import_module(f"kvrelay.cli.{name}")
