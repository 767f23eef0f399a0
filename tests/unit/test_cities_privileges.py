"""Workers under ``--cities`` give up root (launch/privileges.py): the
prefix for the user who ran sudo and for real root, from a fake environment;
the state file does not keep it; and, when this runs as root with setpriv,
what a child started through the prefix really holds (/proc/self/status) and
that it kept the pid it was started with."""

from __future__ import annotations

import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvrelay.launch import cities
from kvrelay.launch.privileges import (
    CAP_FLAGS,
    PrivilegeError,
    WorkerDrop,
    target_ids,
    unreadable,
    unwritable,
    worker_drop,
)

SETPRIV = "/usr/bin/setpriv"
ALICE = pwd.struct_passwd(("alice", "x", 1000, 1000, "", "/home/alice", "/bin/sh"))


def which(name: str) -> str | None:
    return {"setpriv": SETPRIV, "env": "/usr/bin/env"}.get(name)


def getpwuid(uid: int) -> pwd.struct_passwd:
    if uid == 1000:
        return ALICE
    raise KeyError(uid)


def getpwnam(name: str) -> pwd.struct_passwd:
    if name == "alice":
        return ALICE
    raise KeyError(name)


def drop(environ: dict[str, str], user: str | None = None) -> WorkerDrop:
    return worker_drop(environ, user, which=which, getpwnam=getpwnam, getpwuid=getpwuid)


def test_sudo_by_a_user_drops_to_that_user_with_its_groups_and_home():
    d = drop({"SUDO_UID": "1000", "SUDO_GID": "1000", "SUDO_USER": "alice"})
    assert (d.uid, d.gid, d.keeps_root_uid) == (1000, 1000, False)
    assert d.prefix == (SETPRIV, "--reuid=1000", "--regid=1000", "--init-groups", *CAP_FLAGS, "--",
                        "/usr/bin/env", "HOME=/home/alice", "USER=alice", "LOGNAME=alice")


def test_a_uid_unknown_to_passwd_gets_no_groups_and_its_gid_from_sudo():
    d = drop({"SUDO_UID": "4242", "SUDO_GID": "4243"})
    assert d.prefix == (SETPRIV, "--reuid=4242", "--regid=4243", "--clear-groups", *CAP_FLAGS, "--")


@pytest.mark.parametrize("environ", [{}, {"SUDO_UID": "0", "SUDO_GID": "0"}, {"SUDO_UID": ""}])
def test_real_root_keeps_uid_0_without_any_capability(environ):
    d = drop(environ)
    assert (d.uid, d.gid, d.keeps_root_uid) == (0, 0, True)
    assert d.prefix == (SETPRIV, "--bounding-set=-all", "--inh-caps=-all", "--ambient-caps=-all",
                        "--no-new-privs", "--")


def test_a_dedicated_account_wins_over_sudo():
    assert target_ids({"SUDO_UID": "4242", "SUDO_GID": "4242"}, "alice", getpwnam, getpwuid) == (1000, 1000)
    assert target_ids({}, "1000", getpwnam, getpwuid) == (1000, 1000)
    with pytest.raises(PrivilegeError, match="no such account"):
        target_ids({}, "mallory", getpwnam, getpwuid)


def test_sudo_uid_without_gid_takes_the_gid_from_passwd_and_rejects_garbage():
    assert target_ids({"SUDO_UID": "1000"}, None, getpwnam, getpwuid) == (1000, 1000)
    with pytest.raises(PrivilegeError, match="SUDO_GID"):
        target_ids({"SUDO_UID": "4242"}, None, getpwnam, getpwuid)
    with pytest.raises(PrivilegeError, match="not a numeric id"):
        target_ids({"SUDO_UID": "1000; rm"}, None, getpwnam, getpwuid)


def test_without_setpriv_it_refuses_and_names_the_package():
    with pytest.raises(PrivilegeError, match="util-linux"):
        worker_drop({}, which=lambda _: None)


def _state(d: WorkerDrop | None) -> cities.CitiesState:
    st = cities.CitiesState("kvx", "10.9.0.0/16", "kvx-br", "10.9.0.1", drop=d)
    st.sites.append(cities.SiteNet("toronto", "kvx-toronto", "10.9.0.10", "10.9.1.1", "10.9.1.0/24", "kvx-v0"))
    return st


def test_exec_prefix_enters_the_namespace_as_root_then_drops(tmp_path: Path):
    d = drop({"SUDO_UID": "1000", "SUDO_GID": "1000"})
    st = _state(d)
    assert st.exec_prefix("toronto") == ["ip", "netns", "exec", "kvx-toronto", *d.prefix]
    cities._save(st, tmp_path)  # whom serve drops to is not part of what up saved
    assert "drop" not in (tmp_path / "cities.json").read_text()
    back = cities.load_state(tmp_path)
    assert back.drop is None and back.sites == st.sites


def test_exec_prefix_without_setpriv_is_a_cities_error(monkeypatch):
    monkeypatch.setattr(cities, "worker_drop", lambda environ: worker_drop(environ, which=lambda _: None))
    with pytest.raises(cities.CitiesError, match="util-linux"):
        _state(None).exec_prefix("toronto")


def test_sharing_leaves_root_files_alone_and_gives_the_workers_group_read(tmp_path: Path):
    f = tmp_path / "cluster.yaml"
    f.write_text("x")
    f.chmod(0o600)
    _state(drop({})).share_with_workers(f)  # workers keep uid 0: they read it as it is
    assert stat.S_IMODE(f.stat().st_mode) == 0o600
    gid = 65534 if os.geteuid() == 0 else os.getgid()  # only root may give a file to another group
    _state(WorkerDrop(1000, gid, ())).share_with_workers(f)
    assert (stat.S_IMODE(f.stat().st_mode), f.stat().st_gid) == (0o640, gid)


# -- the real thing: only as root, with setpriv -----------------------------------

needs_root_setpriv = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                        reason="dropping privileges for real needs root and setpriv")

PROBE = ("import os\n"
         "print('pid', os.getpid())\n"
         "print(open('/proc/self/status').read())\n")


def _status(prefix: tuple[str, ...], python: str) -> tuple[dict[str, str], int]:
    """The child's /proc/self/status fields, and whether its pid is the one Popen started."""
    proc = subprocess.Popen([*prefix, python, "-I", "-S", "-c", PROBE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    lines = out.splitlines()
    fields = dict(line.split(":", 1) for line in lines[1:] if ":" in line)
    return {k: v.strip() for k, v in fields.items()}, int(lines[0].split()[1]) == proc.pid


def _python_for(uid: int) -> str:
    """An interpreter ``uid`` may run: this one when others can reach it, else the system's."""
    exe, real = Path(sys.executable).absolute(), Path(sys.executable).resolve()
    reachable = all(d.stat().st_mode & stat.S_IXOTH for d in (*exe.parents, *real.parents))
    if reachable and real.stat().st_mode & stat.S_IXOTH:
        return sys.executable
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    pytest.skip(f"uid {uid} can run no Python interpreter here")


@needs_root_setpriv
def test_root_case_child_has_no_capabilities_and_no_new_privs():
    d = worker_drop({})
    fields, same_pid = _status(d.prefix, sys.executable)
    assert fields["Uid"].split() == ["0"] * 4
    for cap in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(fields[cap], 16) == 0, cap
    assert fields["NoNewPrivs"] == "1"
    assert same_pid  # setpriv execs in place


@needs_root_setpriv
def test_user_case_child_runs_as_nobody_without_capabilities():
    d = worker_drop({"SUDO_UID": "65534", "SUDO_GID": "65534"})
    fields, same_pid = _status(d.prefix, _python_for(65534))
    assert fields["Uid"].split() == ["65534"] * 4
    assert fields["Gid"].split() == ["65534"] * 4
    assert int(fields["CapEff"], 16) == 0 and int(fields["CapBnd"], 16) == 0
    assert fields["NoNewPrivs"] == "1"
    assert same_pid


@needs_root_setpriv
def test_unreadable_names_what_the_workers_cannot_read(tmp_path: Path):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    public = Path("/usr")
    d = worker_drop({"SUDO_UID": "65534", "SUDO_GID": "65534"})
    python = _python_for(65534)
    assert unreadable(d, python, [public, private]) == [str(private)]
    assert unreadable(d, "/nonexistent/python", [public]) == ["/nonexistent/python"]


@needs_root_setpriv
def test_unwritable_names_the_records_an_unprivileged_router_cannot_write():
    """What the launcher checks before it starts the router as the invoking user of sudo."""
    base = Path(tempfile.mkdtemp(prefix="kvrelay-records-"))  # not under pytest's folders: 65534 reaches it
    try:
        base.chmod(0o755)
        roots = base / "roots"  # the launcher's (root's) own folder
        roots.mkdir(mode=0o700)
        mine = base / "mine"  # a folder of that user's, with one record in it that root made earlier
        mine.mkdir()
        os.chown(mine, 65534, 65534)
        (mine / "usage.sqlite").write_bytes(b"")
        d = worker_drop({"SUDO_UID": "65534", "SUDO_GID": "65534"})
        paths = [roots / "jobs.sqlite", mine / "audit" / "audit.jsonl", mine / "usage.sqlite", mine / "new.sqlite"]
        assert unwritable(d, _python_for(65534), paths) == [str(roots / "jobs.sqlite"), str(mine / "usage.sqlite")]
    finally:
        shutil.rmtree(base)
