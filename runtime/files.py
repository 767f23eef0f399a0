"""Files only this user may read: secrets, keys, tokens, and the databases
that hold prompts, results and usage. One place for the modes, so no writer
forgets one."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path

SQLITE_SIDE_FILES = ("", "-wal", "-shm")
"""A SQLite database and the side files WAL mode makes (with the database's mode)."""


def file_stamp(path: Path) -> tuple[int, int, int] | None:
    """What tells that a file changed (its time, size and inode, through symbolic links: a
    Kubernetes ConfigMap's or Secret's file is one that the kubelet swaps); None: it is missing."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_mtime_ns, st.st_size, st.st_ino


async def polls(stop: asyncio.Event, interval_s: float) -> AsyncIterator[None]:
    """Yields every ``interval_s`` until ``stop`` is set (what a follower of a file looks at it by)."""
    while True:
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
            return
        except TimeoutError:
            yield


def private_folder(folder: Path) -> None:
    """Makes ``folder`` (and its parents) if missing; one made here is 0700 (whatever the umask)."""
    if not folder.exists():
        folder.mkdir(parents=True, mode=0o700, exist_ok=True)
        os.chmod(folder, 0o700)  # mkdir's mode is cut by the umask


def write_private(path: Path, data: bytes) -> None:
    """Writes ``data`` to ``path`` readable by this user only (folder 0700 if made
    here), through a temporary file renamed into place. The temporary file is new
    (``mkstemp``: a random name, O_EXCL, mode 0600, no link followed): one planted
    beside ``path`` by someone who can write the folder is never written through."""
    private_folder(path.parent)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def create_private(path: Path) -> None:
    """Creates ``path`` empty if missing, mode 0600 in any case (folder 0700 if made
    here): SQLite takes an empty file as a new database and keeps its mode."""
    private_folder(path.parent)
    os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    os.chmod(path, 0o600)


def private_sqlite_sides(path: Path) -> None:
    """The database at ``path`` and the side files SQLite made beside it: 0600."""
    for side in SQLITE_SIDE_FILES:
        with contextlib.suppress(FileNotFoundError):
            os.chmod(f"{path}{side}", 0o600)
