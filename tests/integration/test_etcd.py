"""The etcd client (runtime/etcd.py) against a real 3-member etcd on loopback
(launch/etcd.py: Debian's etcd-server, each member's certificate from a
cluster CA, clients admitted only with one from the same CA): keys, leases,
watches, a member lost, and the errors a wrong endpoint or a foreign CA gets."""

from __future__ import annotations

import asyncio
import shutil

import pytest

from kvrelay.launch.credentials import ClusterCredentials
from kvrelay.launch.etcd import EtcdCluster
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.config import TLSSection
from kvrelay.runtime.etcd import EtcdClient, EtcdError, prefix_end
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.runtime.rpc import Dialer

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="etcd is not installed (make etcd, as root: Debian's etcd-server)")

ROUTER = Identity("montreal", CertRole.ROUTER, "qc")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("etcd")
    creds = ClusterCredentials.for_config(TLSSection(), folder / "ca")
    assert creds is not None
    cluster = EtcdCluster(3, folder / "members", creds, "montreal")
    dialer = Dialer(creds.material(ROUTER))
    cluster.start(dialer)
    yield cluster, dialer, folder
    cluster.stop()


def run(coro):
    return asyncio.run(coro)


def test_prefix_end_covers_exactly_the_prefix():
    assert prefix_end("/kvrelay/") == b"/kvrelay0"
    assert prefix_end("a\xff") == b"a\xc3\xc0"  # UTF-8 c3 bf: its last byte + 1
    assert prefix_end("") == b"\0"


def test_keys_leases_and_a_watch_on_a_real_cluster(etcd):
    cluster, dialer, _ = etcd

    async def scenario():
        client = EtcdClient(cluster.endpoints, dialer, timeout_s=5.0)
        try:
            assert (await client.connect()).leader
            seen: list = []

            async def watch(start: int):
                async for batch in client.watch("/t1/", start):
                    seen.extend(batch)

            _, rev = await client.get_prefix("/t1/")
            watching = asyncio.create_task(watch(rev + 1))
            lease = await client.grant(2)
            await client.put("/t1/leased", b"x", lease)
            assert await client.create("/t1/once", b"1")
            assert not await client.create("/t1/once", b"2")  # exists: the transaction leaves it
            assert (await client.get("/t1/once")).value == b"1"
            assert await client.keepalive(lease) > 0
            entries, _ = await client.get_prefix("/t1/")
            assert sorted(e.key for e in entries) == ["/t1/leased", "/t1/once"]
            assert await client.delete("/t1/once") == 1
            for _ in range(60):  # the lease is not renewed: its key goes with it
                if await client.get("/t1/leased") is None:
                    break
                await asyncio.sleep(0.1)
            assert await client.get("/t1/leased") is None
            assert await client.keepalive(lease) <= 0
            await asyncio.sleep(0.3)
            watching.cancel()
            changes = [(c.key, c.value) for c in seen]
            assert ("/t1/leased", b"x") in changes and ("/t1/once", b"1") in changes
            assert ("/t1/once", None) in changes and ("/t1/leased", None) in changes  # deleted, and expired
        finally:
            await client.close()

    run(scenario())


def test_a_lost_member_does_not_stop_the_client(etcd):
    cluster, dialer, _ = etcd

    async def scenario():
        client = EtcdClient(cluster.endpoints, dialer, timeout_s=5.0)
        try:
            await client.connect()
            cluster.kill(0)
            await client.put("/t2/k", b"v")  # the first endpoint is gone: the next one answers
            assert (await client.get("/t2/k")).value == b"v"
            states = dict(await client.member_status())
            assert states[cluster.endpoints[0]] != "ok"
            assert [states[e] for e in cluster.endpoints[1:]] == ["ok", "ok"]
        finally:
            await client.close()
            cluster.restart(0)

    run(scenario())


def test_an_unreachable_endpoint_is_named(etcd):
    _, dialer, _ = etcd
    nobody = f"127.0.0.1:{free_port()}"

    async def scenario():
        client = EtcdClient([nobody], dialer, timeout_s=1.0)
        try:
            await client.connect()
        finally:
            await client.close()

    with pytest.raises(EtcdError, match=f"could not reach etcd within 1 s: etcd: {nobody}: UNAVAILABLE"):
        run(scenario())


def test_a_certificate_from_another_ca_is_refused(etcd):
    cluster, _, folder = etcd
    other = ClusterCredentials.for_config(TLSSection(), folder / "other-ca")
    assert other is not None

    async def scenario():
        client = EtcdClient(cluster.endpoints[1:], Dialer(other.material(ROUTER)), timeout_s=3.0)
        try:
            await client.connect()
        finally:
            await client.close()

    with pytest.raises(EtcdError, match="TLS refused"):
        run(scenario())
