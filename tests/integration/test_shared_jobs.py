"""The routers' shared job store (router/core/shared_jobs.py) against a real PostgreSQL
primary and streaming standby (launch/postgres.py), each connection TLS with a
certificate from the cluster CA: two routers never take the same request, a result is
stored once and only by the request's holder, a dead router's requests are taken back
and run elsewhere, and the standby holds what the primary committed."""

from __future__ import annotations

import socket
import ssl
import struct
import threading
import time
from pathlib import Path

import pytest
from cryptography import x509

from kvrelay.launch.credentials import ClusterCredentials
from kvrelay.launch.postgres import PostgresCluster
from kvrelay.launch.postgres import installed as postgres_installed
from kvrelay.launch.renewal import CertKeeper
from kvrelay.router.core.jobs_store import DONE, JOB_DONE, StoredLimits, StoreLimitExceeded
from kvrelay.router.core.shared_jobs import JobStoreUnavailable, SharedJobStore, conninfo
from kvrelay.runtime.addresses import free_port
from kvrelay.runtime.config import TLSSection
from kvrelay.runtime.pki import CertRole, Identity, write_private
from tests.integration.helpers import wait_until

pytestmark = pytest.mark.skipif(not postgres_installed(),
                                reason="PostgreSQL is not installed (make postgres, as root: postgresql-15)")


@pytest.fixture(scope="module")
def pg(tmp_path_factory):
    creds = ClusterCredentials.for_config(TLSSection(), tmp_path_factory.mktemp("ca"))
    assert creds is not None
    keeper = CertKeeper(creds, tmp_path_factory.mktemp("tls"))  # the launcher's: it renews the servers' certificates
    cluster = PostgresCluster(1, creds, "montreal", keeper=keeper)
    cluster.start()
    yield cluster, creds, tmp_path_factory.mktemp("clients")
    cluster.stop()


def store(pg, holder: str, role: CertRole = CertRole.ROUTER, endpoints: list[str] | None = None) -> SharedJobStore:
    """A router's store, connecting with a certificate of ``role`` named ``holder``."""
    return store_and_serial(pg, holder, role, endpoints)[0]


def store_and_serial(pg, holder: str, role: CertRole = CertRole.ROUTER,
                     endpoints: list[str] | None = None) -> tuple[SharedJobStore, int]:
    """:func:`store`, and the serial of the certificate it connects with."""
    cluster, creds, folder = pg
    mat = creds.material(Identity("montreal", role, holder))
    assert mat.cert_pem is not None
    serial = x509.load_pem_x509_certificate(mat.cert_pem).serial_number
    files = tuple(str(folder / f"{holder}-{role}.{k}") for k in ("ca", "crt", "key"))
    for path, pem in zip(files, (mat.ca_pem, mat.cert_pem, mat.key_pem), strict=True):
        write_private(Path(path), pem)
    eps = endpoints or cluster.endpoints
    return SharedJobStore(conninfo(eps, "kvrelay", "kvrelay", files), holder, ", ".join(eps), timeout_s=3.0), serial


def test_two_routers_never_take_the_same_request(pg):
    a, b = store(pg, "a"), store(pg, "b")
    job = a.submit("race", [f"r{i}".encode() for i in range(200)], "t1").id
    taken: dict[str, list[int]] = {"a": [], "b": []}

    def take(s: SharedJobStore, name: str) -> None:
        while rows := s.claim(7):
            taken[name] += [idx for j, idx, _, _ in rows if j == job]

    threads = [threading.Thread(target=take, args=(s, n)) for s, n in ((a, "a"), (b, "b"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert sorted(taken["a"] + taken["b"]) == list(range(200))  # every request once, none twice
    assert taken["a"] and taken["b"]  # both took some
    for s, name in ((a, "a"), (b, "b")):
        for idx in taken[name]:
            assert s.finish(job, idx, b"out", True)
    assert b.get(job).state == JOB_DONE
    assert [seq for seq, _, _ in a.results_after(job, 0)] == list(range(1, 201))  # numbered once each, no gap


def test_a_dead_routers_requests_run_elsewhere_and_its_late_results_are_refused(pg):
    a, b = store(pg, "a2"), store(pg, "b2")
    job = a.submit("takeover", [b"x", b"y"], "t2").id
    held = a.claim(2)
    assert [idx for _, idx, _, _ in held] == [0, 1]
    assert not b.finish(job, 0, b"b's", True)  # not b's to store
    assert b.reclaim({"a2", "b2"}, 0.0) == 0  # a2 is live: its requests stay its own
    time.sleep(0.05)
    assert b.reclaim({"b2"}, 60.0) == 0  # taken too recently: a router not known yet keeps them
    assert b.reclaim({"b2"}, 0.0) == 2  # a2's lease ended: they are pending again
    assert sorted(idx for j, idx, _, _ in b.claim(5) if j == job) == [0, 1]
    assert b.finish(job, 0, b"by b", True) and b.finish(job, 1, b"by b", True)
    assert not a.finish(job, 0, b"late, by a", True)  # a2 came back from the dead: nothing stored twice
    assert [r for _, _, r in a.results(job)] == [b"by b", b"by b"]
    assert a.get(job).completed == 2


def test_a_restarted_router_resumes_what_it_held(pg):
    a = store(pg, "a3")
    job = a.submit("restart", [b"x", b"y", b"z"], "t3").id
    a.claim(2)
    a.close()
    again = store(pg, "a3")
    assert again.resume() == 2
    assert len([r for r in again.claim(10) if r[0] == job]) == 3


def test_a_tenants_stored_job_limit_holds_across_routers(pg):
    a, b = store(pg, "a4"), store(pg, "b4")
    limits = StoredLimits(jobs=3, bytes=1 << 20)
    outcomes: list[str] = []

    def submit(s: SharedJobStore) -> None:
        for _ in range(3):
            try:
                s.submit("j", [b"x"], "limited", limits)
                outcomes.append("stored")
            except StoreLimitExceeded as exc:
                outcomes.append(str(exc))

    threads = [threading.Thread(target=submit, args=(s,)) for s in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert outcomes.count("stored") == 3  # six tries at two routers: three stored, never four
    assert all("max_stored_jobs" in o for o in outcomes if o != "stored")
    assert a.holdings("limited") == (3, 3)


def test_the_standby_holds_the_results(pg):
    cluster = pg[0]
    a = store(pg, "a5")
    job = a.submit("replicated", [b"p"], "t5").id
    assert (job, 0) in {(j, idx) for j, idx, _, _ in a.claim(1000)}  # (other tests' jobs wait too)
    assert a.finish(job, 0, b"kept twice", True)
    query = f"SELECT count(*) FROM items WHERE job = '{job}' AND status = {DONE}"
    assert wait_until(lambda: cluster.replayed(1, query) == "1", 10)


def test_a_certificate_that_is_not_a_routers_is_refused(pg):
    with pytest.raises(JobStoreUnavailable, match="certificate authentication failed"):
        store(pg, "0", role=CertRole.PREFILL)


def test_an_unreachable_database_is_named(pg):
    endpoint = f"127.0.0.1:{free_port()}"
    with pytest.raises(JobStoreUnavailable, match=f"jobs database \\({endpoint}\\) cannot be reached"):
        store(pg, "a6", endpoints=[endpoint])


def _served_serial(endpoint: str, ca_pem: bytes) -> int:
    """The certificate a PostgreSQL server presents (its SSLRequest first, as libpq sends it)."""
    host, port = endpoint.rsplit(":", 1)
    ctx = ssl.create_default_context(cadata=ca_pem.decode())
    ctx.check_hostname = False
    with socket.create_connection((host, int(port)), timeout=5) as raw:
        raw.sendall(struct.pack("!ii", 8, 80877103))
        assert raw.recv(1) == b"S"
        with ctx.wrap_socket(raw) as conn:
            der = conn.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


def test_servers_present_their_renewed_certificates_after_a_reload_not_a_restart(pg):
    """The launcher's keeper renews each server's files and tells it to read them again (pg_ctl reload)."""
    cluster, creds, _ = pg
    keeper = cluster.keeper
    assert keeper is not None
    names = [f"postgres/{s.name}" for s in cluster.servers]
    assert [_served_serial(e, creds.ca_pem) for e in cluster.endpoints] == [keeper.kept[n].serial for n in names]
    pids = [(s.data / "postmaster.pid").read_text().split()[0] for s in cluster.servers]
    assert sorted(keeper.renew_due(now=time.time() + 365 * 86400)) == sorted(names)
    renewed = [keeper.kept[n].serial for n in names]
    assert wait_until(lambda: [_served_serial(e, creds.ca_pem) for e in cluster.endpoints] == renewed, 10)
    assert [(s.data / "postmaster.pid").read_text().split()[0] for s in cluster.servers] == pids
    job = store(pg, "renewed").submit("after", [b"r0"], "t1").id
    assert job


def test_a_revoked_router_certificate_loses_the_jobs_database(pg):
    """Issue 56, finding 3: PostgreSQL had no revocation list, so a revoked router certificate kept the
    routers' database role (every prompt and result). Now each server has the launcher's crl.pem (re-read
    on the reload the keeper asks for): once the serial is revoked, a new connection with it is refused,
    and the session it had open is ended (the launcher ends those of serials newly revoked); another
    router's certificate goes on."""
    cluster, creds, _ = pg
    keeper = cluster.keeper
    assert keeper is not None
    held, serial = store_and_serial(pg, "stolen")
    other = store(pg, "honest")
    job = held.submit("before", [b"r0"], "t-revoked").id  # its database role, before the revocation
    try:
        creds.revoked = frozenset({serial})
        assert keeper.revoked_changed() == []
        assert wait_until(lambda: _refused(pg, "stolen"), 10)  # the reload is asynchronous
        assert cluster.cut_revoked(creds.revoked) >= 1
        with pytest.raises(JobStoreUnavailable):
            held.get(job)  # its open session was ended; connecting again is refused
        assert other.get(job) is not None
    finally:
        creds.revoked = frozenset()
        keeper.revoked_changed()
    assert wait_until(lambda: not _refused(pg, "stolen"), 10)  # unrevoked: the same certificate is let in again


def _refused(pg, holder: str) -> bool:
    """A new connection with the certificate files :func:`store` last wrote for ``holder`` is refused."""
    cluster, _, folder = pg
    files = tuple(str(folder / f"{holder}-{CertRole.ROUTER}.{k}") for k in ("ca", "crt", "key"))
    eps = cluster.endpoints
    try:
        s = SharedJobStore(conninfo(eps, "kvrelay", "kvrelay", files), holder, ", ".join(eps), timeout_s=3.0)
    except JobStoreUnavailable:
        return True
    s.close()
    return False
