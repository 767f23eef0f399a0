"""Files only their owner may read (runtime/files.py), against someone who can write the folder:
issue 56, finding 7. The old temporary file had a fixed name (``<name>.tmp``) opened without
O_EXCL or O_NOFOLLOW, so a link planted there made a credential's bytes land in the attacker's
file, and a planted file readable by all kept its mode when renamed into place."""

from __future__ import annotations

import stat
from pathlib import Path

from kvrelay.runtime.files import write_private

SECRET = b"-----BEGIN PRIVATE KEY-----\nnot for anyone else\n"


def test_a_link_planted_as_the_temporary_file_is_never_written_through(tmp_path: Path):
    folder, theirs = tmp_path / "creds", tmp_path / "attacker-reads-this"
    folder.mkdir()
    theirs.write_bytes(b"")
    (folder / "router.key.tmp").symlink_to(theirs)
    write_private(folder / "router.key", SECRET)
    assert theirs.read_bytes() == b"", "the secret was written through the planted link"
    assert (folder / "router.key").read_bytes() == SECRET and not (folder / "router.key").is_symlink()
    assert stat.S_IMODE((folder / "router.key").stat().st_mode) == 0o600


def test_a_planted_file_readable_by_all_never_becomes_the_secret(tmp_path: Path):
    folder = tmp_path / "creds"
    folder.mkdir()
    planted = folder / "router.key.tmp"
    planted.write_bytes(b"")
    planted.chmod(0o644)
    write_private(folder / "router.key", SECRET)
    assert stat.S_IMODE((folder / "router.key").stat().st_mode) == 0o600
    assert planted.read_bytes() == b""  # left as it was, not renamed into place
    assert sorted(p.name for p in folder.iterdir()) == ["router.key", "router.key.tmp"]  # none of its own left
