"""Revoked serials followed from the config file (runtime/revocations.py): a change
replaces the shared set every holder of the material sees; a config that does
not load changes nothing."""

from __future__ import annotations

import asyncio

import yaml

from kvrelay.runtime.revocations import follow_revocations, reload_revocations
from kvrelay.runtime.tls import RevokedSerials, TLSMaterial


def test_a_change_reaches_every_holder_and_a_broken_config_changes_nothing(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"tls": {"revoked_serials": ["0a"]}}))
    material = TLSMaterial(b"ca", revoked=RevokedSerials(frozenset({0x0A})))
    copy = TLSMaterial(b"ca", b"cert", b"key", None, material.revoked)  # another holder, the same set
    path.write_text(yaml.safe_dump({"tls": {"revoked_serials": ["0b", "0c"]}}))
    assert reload_revocations(path, material.revoked) == (frozenset({0x0B, 0x0C}), frozenset({0x0A}))
    assert 0x0B in copy.revoked and 0x0A not in copy.revoked and len(copy.revoked) == 2
    path.write_text("tls: {revoked_serials: [zz-not-hex]}\n")
    assert reload_revocations(path, material.revoked) is None
    assert material.revoked.serials == frozenset({0x0B, 0x0C})


def test_following_the_file_tells_each_change_and_stops_when_asked(tmp_path):
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump({"tls": {"revoked_serials": []}}))
    revoked, seen = RevokedSerials(), []

    async def scenario() -> None:
        stop = asyncio.Event()
        task = asyncio.create_task(follow_revocations(str(path), revoked, stop, lambda a, r: seen.append((a, r)),
                                                      poll_s=0.05))
        await asyncio.sleep(0.2)
        path.write_text(yaml.safe_dump({"tls": {"revoked_serials": ["ff"]}}))
        for _ in range(100):
            if seen:
                break
            await asyncio.sleep(0.05)
        stop.set()
        await asyncio.wait_for(task, 5)
    asyncio.run(scenario())
    assert seen == [(frozenset({0xFF}), frozenset())] and 0xFF in revoked
