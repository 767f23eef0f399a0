"""Workers of ``kvrelay serve --cities`` without root.

Only the emulation needs root: namespaces, veths, TUN devices, tc, and the
``ip netns exec`` that puts a worker into its site's namespace. The worker
itself then gives root up before Python starts::

    ip netns exec <ns> setpriv <flags> -- [env HOME=.. USER=.. LOGNAME=..] python -m <worker> ...

util-linux's ``setpriv`` (like ``ip netns exec`` and ``env``) execs in
place, so the worker keeps the pid the launcher started: its signals reach
the worker, and the worker's own PR_SET_PDEATHSIG (set after the drop, which
would clear it) still ties it to the launcher.

Whom the workers run as comes from the environment the caller passes in
(this module never reads ``os.environ``):

- a dedicated account, when the caller names one;
- else the user who ran ``sudo`` (SUDO_UID/SUDO_GID, unless that is uid 0):
  that uid and gid, the user's supplementary groups (none when passwd does
  not know the uid), and that user's HOME, USER and LOGNAME;
- else (really root, e.g. CI whose files under /root nobody else may read)
  uid 0 with no capabilities: empty bounding, inheritable and ambient sets
  and no_new_privs, so the worker cannot change network settings, load
  modules, trace or signal others' processes, or read other users' files.
  It still owns root's files, though: a dedicated account isolates more.

Without setpriv this refuses (PrivilegeError) instead of running workers as root."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

CAP_FLAGS = ("--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all", "--no-new-privs")
"""No capability now or after any exec, and no setuid-binary way back."""


class PrivilegeError(RuntimeError):
    """The workers cannot be made unprivileged; the message says why."""


@dataclass(frozen=True, slots=True)
class WorkerDrop:
    """How the workers give up root: as whom, and the command prefix that does it."""

    uid: int
    gid: int
    prefix: tuple[str, ...]
    """Goes between ``ip netns exec <ns>`` and the worker's ``python -m ...``."""

    @property
    def keeps_root_uid(self) -> bool:
        """True when workers stay uid 0 (without capabilities): they read what root owns."""
        return self.uid == 0


def _number(environ: Mapping[str, str], key: str) -> int | None:
    raw = environ.get(key, "").strip()
    if not raw:
        return None
    if not raw.isdigit():
        raise PrivilegeError(f"{key}={raw!r} is not a numeric id")
    return int(raw)


def _account(user: str, getpwnam: Callable[[str], pwd.struct_passwd],
             getpwuid: Callable[[int], pwd.struct_passwd]) -> pwd.struct_passwd:
    """The passwd entry of ``user`` (a name or a numeric uid)."""
    try:
        return getpwuid(int(user)) if user.isdigit() else getpwnam(user)
    except KeyError:
        raise PrivilegeError(f"worker user {user!r}: no such account") from None


def target_ids(environ: Mapping[str, str], user: str | None = None,
               getpwnam: Callable[[str], pwd.struct_passwd] = pwd.getpwnam,
               getpwuid: Callable[[int], pwd.struct_passwd] = pwd.getpwuid) -> tuple[int, int]:
    """(uid, gid) the workers run as: ``user`` when given, else the invoking
    user of sudo (SUDO_UID/SUDO_GID), else (0, 0). The only place that reads
    the environment for this, and only from ``environ``."""
    if user:
        pw = _account(user, getpwnam, getpwuid)
        return pw.pw_uid, pw.pw_gid
    uid = _number(environ, "SUDO_UID")
    if not uid:  # not under sudo, or sudo by root itself
        return 0, 0
    gid = _number(environ, "SUDO_GID")
    if gid is None:
        try:
            gid = getpwuid(uid).pw_gid
        except KeyError:
            raise PrivilegeError(f"SUDO_UID={uid} without SUDO_GID, and passwd does not know uid {uid}") from None
    return uid, gid


def setpriv_prefix(uid: int, gid: int, setpriv: str, account: pwd.struct_passwd | None = None,
                   env: str = "env") -> tuple[str, ...]:
    """The prefix that runs a program as ``uid``/``gid`` (uid 0: as root
    without capabilities). ``account``: the passwd entry of ``uid``, for its
    groups and HOME/USER/LOGNAME (None: no supplementary groups, environment as is)."""
    if uid == 0:
        return (setpriv, *CAP_FLAGS, "--")
    ids = (f"--reuid={uid}", f"--regid={gid}", "--init-groups" if account is not None else "--clear-groups")
    prefix = (setpriv, *ids, *CAP_FLAGS, "--")
    if account is None:
        return prefix
    return (*prefix, env, f"HOME={account.pw_dir}", f"USER={account.pw_name}", f"LOGNAME={account.pw_name}")


def worker_drop(environ: Mapping[str, str], user: str | None = None,
                which: Callable[[str], str | None] = shutil.which,
                getpwnam: Callable[[str], pwd.struct_passwd] = pwd.getpwnam,
                getpwuid: Callable[[int], pwd.struct_passwd] = pwd.getpwuid) -> WorkerDrop:
    """How the workers give up root, given the launcher's environment
    (``environ``) and an optional dedicated account (``user``, name or uid).
    PrivilegeError when setpriv (util-linux) is missing."""
    uid, gid = target_ids(environ, user, getpwnam, getpwuid)
    setpriv = which("setpriv")
    if setpriv is None:
        raise PrivilegeError("setpriv is not installed, and workers will not run as root "
                             "(Debian: apt-get install util-linux)")
    account = None
    if uid != 0:
        try:
            account = getpwuid(uid)
        except KeyError:
            account = None
    env = which("env") or "env"
    return WorkerDrop(uid, gid, setpriv_prefix(uid, gid, setpriv, account, env))


def share_with_workers(path: Path, drop: WorkerDrop) -> None:
    """Lets the workers read ``path`` (a folder or file root made for them,
    e.g. the launcher's config) without making it anyone else's: its group
    becomes the workers' gid, folders 0750, files 0640; the owner stays root,
    so a worker cannot change what the root launcher writes there later.
    Nothing to do when the workers keep uid 0."""
    if drop.keeps_root_uid:
        return
    path = Path(path)
    os.chown(path, -1, drop.gid, follow_symlinks=False)
    os.chmod(path, 0o750 if stat.S_ISDIR(path.lstat().st_mode) else 0o640)


_ACCESS_PROBE = ("import os, sys\n"
                 "for p in sys.argv[1:]:\n"
                 "    if not os.access(p, os.R_OK | (os.X_OK if os.path.isdir(p) else 0)):\n"
                 "        print(p)\n")


_WRITE_PROBE = ("import os, sys\n"
                "for p in sys.argv[1:]:\n"
                "    d = os.path.dirname(os.path.abspath(p))\n"
                "    while not os.path.exists(d):\n"
                "        d = os.path.dirname(d)\n"
                "    here = os.access(d, os.W_OK | os.X_OK)\n"
                "    if not here or (os.path.exists(p) and not os.access(p, os.R_OK | os.W_OK)):\n"
                "        print(p)\n")


def _probe(drop: WorkerDrop, python: str, script: str, paths: Sequence[str | Path], what: str,
           timeout_s: float) -> list[str]:
    """The lines ``script`` prints run as ``drop`` over ``paths``; ``[python]`` when it cannot start."""
    try:
        res = subprocess.run([*drop.prefix, python, "-I", "-S", "-c", script, *map(str, paths)],
                             capture_output=True, text=True, timeout=timeout_s)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PrivilegeError(f"could not check what {what}: {exc}") from None
    if res.returncode != 0:
        return [python]
    return res.stdout.splitlines()


def unreadable(drop: WorkerDrop, python: str, paths: Sequence[str | Path], timeout_s: float = 30.0) -> list[str]:
    """Those of ``paths`` that a worker (``python`` run through ``drop``)
    cannot read; ``[python]`` when it cannot even start that interpreter."""
    return _probe(drop, python, _ACCESS_PROBE, paths, "the workers can read", timeout_s)


def unwritable(drop: WorkerDrop, python: str, paths: Sequence[str | Path], timeout_s: float = 30.0) -> list[str]:
    """Those of ``paths`` (files a process creates, appends to or keeps a
    SQLite journal beside) that ``python`` run through ``drop`` could not
    write: the file itself where it exists, and the nearest folder of it
    that exists; ``[python]`` when it cannot even start that interpreter."""
    return _probe(drop, python, _WRITE_PROBE, paths, "the router can write", timeout_s)
