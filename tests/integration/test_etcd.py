"""The etcd client (runtime/etcd.py) against a real 3-member etcd on loopback
(launch/etcd.py: Debian's etcd-server, each member's certificate from a
cluster CA, clients admitted only with one from the same CA): keys, leases,
watches, a member lost, and the errors a wrong endpoint or a foreign CA gets."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import ssl
import time

import pytest
from cryptography import x509

from kvrelay.launch.credentials import ClusterCredentials
from kvrelay.launch.etcd import EtcdCluster
from kvrelay.launch.renewal import CertKeeper
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.config import TLSSection
from kvrelay.runtime.etcd import EtcdClient, EtcdError, prefix_end
from kvrelay.runtime.pki import CertRole, Identity, cert_info, load_cert
from kvrelay.runtime.rpc import Dialer
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.skipif(shutil.which("etcd") is None,
                                reason="etcd is not installed (make etcd, as root: Debian's etcd-server)")

ROUTER = Identity("montreal", CertRole.ROUTER, "qc")


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    folder = tmp_path_factory.mktemp("etcd")
    creds = ClusterCredentials.for_config(TLSSection(), folder / "ca")
    assert creds is not None
    keeper = CertKeeper(creds, folder / "tls")  # the launcher's: it renews the members' certificates
    cluster = EtcdCluster(3, folder / "members", creds, "montreal", keeper=keeper)
    dialer = Dialer(creds.material(ROUTER))
    cluster.start(dialer)
    yield cluster, dialer, folder, keeper
    cluster.stop()


def run(coro):
    return asyncio.run(coro)


def test_prefix_end_covers_exactly_the_prefix():
    assert prefix_end("/kvrelay/") == b"/kvrelay0"
    assert prefix_end("a\xff") == b"a\xc3\xc0"  # UTF-8 c3 bf: its last byte + 1
    assert prefix_end("") == b"\0"


def test_keys_leases_and_a_watch_on_a_real_cluster(etcd):
    cluster, dialer, _, _ = etcd

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
    cluster, dialer, _, _ = etcd

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
    _, dialer, _, _ = etcd
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
    cluster, _, folder, _ = etcd
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


def test_a_watch_whose_member_hangs_is_given_up_and_taken_up_at_the_next(etcd):
    """A member that stops answering with its connection open (SIGSTOP): the watch on it asks for progress
    after quiet_s of silence, gets no answer within timeout_s and ends naming why; watched again, on the next
    member, it sees the change made meanwhile. A quiet but healthy member answers and the watch stays."""
    cluster, dialer, _, _ = etcd
    hung = cluster.members[0].proc
    assert hung is not None

    async def scenario():
        client = EtcdClient(cluster.endpoints, dialer, timeout_s=3.0, quiet_s=0.5)
        writer = EtcdClient(cluster.endpoints[1:], dialer, timeout_s=5.0)
        try:
            await client.connect()  # the first member answers: watches start there
            _, rev = await client.get_prefix("/t5/")
            watch = client.watch("/t5/", rev + 1)
            assert await anext(watch) == []  # created
            waiting = asyncio.ensure_future(anext(watch))
            await asyncio.sleep(2.0)  # quiet for four quiet_s: each progress request answered
            assert not waiting.done()
            os.kill(hung.pid, signal.SIGSTOP)
            try:
                await writer.put("/t5/k", b"v")
                with pytest.raises(EtcdError, match="no answer to a progress request within 3 s"):
                    await asyncio.wait_for(waiting, 30)
                again = client.watch("/t5/", rev + 1)
                seen: list[str] = []
                while not seen:
                    seen = [c.key for c in await asyncio.wait_for(anext(again), 30)]
                assert seen == ["/t5/k"]
                await again.aclose()
            finally:
                os.kill(hung.pid, signal.SIGCONT)
            await watch.aclose()
        finally:
            await client.close()
            await writer.close()

    run(scenario())


def _served_serial(endpoint: str, ca_pem: bytes) -> int:
    host, port = endpoint.rsplit(":", 1)
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    ctx.check_hostname = False
    with socket.create_connection((host, int(port)), timeout=5) as raw, ctx.wrap_socket(raw) as conn:
        der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_members_present_their_renewed_certificates_without_a_restart(etcd):
    """The launcher's keeper renews each member's files; etcd reads them at its next handshake."""
    cluster, dialer, _, keeper = etcd
    ca = keeper.creds.ca_pem
    assert [_served_serial(e, ca) for e in cluster.endpoints] == [keeper.kept[f"etcd/m{i}"].serial for i in range(3)]
    pids = [m.proc.pid for m in cluster.members if m.proc is not None]
    assert sorted(keeper.renew_due(now=time.time() + 365 * 86400)) == ["etcd/m0", "etcd/m1", "etcd/m2"]
    renewed = [keeper.kept[f"etcd/m{i}"].serial for i in range(3)]
    assert wait_until(lambda: [_served_serial(e, ca) for e in cluster.endpoints] == renewed, 10)
    assert [m.proc.pid for m in cluster.members if m.proc is not None] == pids

    async def scenario():
        client = EtcdClient(cluster.endpoints, dialer, timeout_s=5.0)
        try:
            await client.put("/renewed/k", b"v")
            assert (await client.get("/renewed/k")).value == b"v"
        finally:
            await client.close()
    run(scenario())


def test_a_revoked_certificate_is_refused_by_etcd_and_loses_its_open_connection(etcd):
    """Issue 56, finding 3: etcd had no revocation list, so a revoked router certificate kept reaching
    it. Now every member reads the launcher's crl.pem at each handshake: once a serial is revoked (the
    keeper rewrites the list), a new connection with it is refused, and the members restarted one at
    a time (the launcher does so for serials newly revoked) end the one it had open; another router's
    certificate goes on."""
    cluster, dialer, _, keeper = etcd
    creds = keeper.creds
    stolen = creds.material(Identity("montreal", CertRole.ROUTER, "stolen"))
    assert stolen.cert_pem is not None
    serial = cert_info(load_cert(stolen.cert_pem, "stolen")).serial

    async def scenario() -> tuple[str, str, str]:
        held = EtcdClient(cluster.endpoints, Dialer(stolen), timeout_s=3.0)
        others = EtcdClient(cluster.endpoints, dialer, timeout_s=5.0)
        try:
            await held.put("/revoked/before", b"1")  # connected, and allowed, before the revocation
            creds.revoked = frozenset({serial})
            assert keeper.revoked_changed() == []
            fresh = EtcdClient(cluster.endpoints, Dialer(stolen), timeout_s=3.0)
            try:
                await fresh.put("/revoked/fresh", b"1")
                refused_new = "written"
            except EtcdError as exc:
                refused_new = str(exc)
            finally:
                await fresh.close()
            await asyncio.to_thread(cluster.cut_connections, dialer)
            try:
                await held.put("/revoked/after", b"1")
                refused_held = "written"
            except EtcdError as exc:
                refused_held = str(exc)
            await others.put("/revoked/other", b"1")
            return refused_new, refused_held, (await others.get("/revoked/other")).value.decode()
        finally:
            creds.revoked = frozenset()
            keeper.revoked_changed()
            await held.close()
            await others.close()

    refused_new, refused_held, other = run(scenario())
    assert "UNAVAILABLE" in refused_new or "TLS refused" in refused_new, refused_new
    assert refused_held != "written", "the revoked certificate's open connection went on"
    assert other == "1"
