"""Who may move KV, and how it must be protected, decided by certificates
from a real cluster CA (runtime/pki.py) in the KV handshake: a receiver
enforces the link its sender's certificate names, whatever the sender asks;
a sender talks only to the decode worker the router named; wrong roles,
revoked and foreign certificates are refused before any KV byte moves; an
unauthenticated peer never learns where a sender's memory is."""

from __future__ import annotations

import dataclasses
import socket
import threading

import pytest
import torch

from kvrelay.benchmarks.gate_bench import captured_hello
from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.handshake import SenderHello
from kvrelay.kvtransfer.nixl import NixlKVSender, nixl_available
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from kvrelay.kvtransfer.wire import frame_bytes, recv_frame
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.kvcreds import CertCredentials
from kvrelay.runtime.pki import CertRole, Identity, issue, new_ca
from kvrelay.runtime.roles import Role
from kvrelay.runtime.tls import TLSMaterial
from kvrelay.runtime.worker import kv_transfer_config
from kvrelay.v1 import kv_wire_pb2 as pb
from tests.integration.helpers import wait_until
from tests.integration.kv_tap import Tap

LAYOUT = KVLayout("m", "float32", 2, 2, 16, 4)
CA = new_ca()
CFG = parse_config({
    "sites": [{"name": "a"}, {"name": "b"}, {"name": "c"}],
    "kv": {"protection": "integrity"},  # the default of links that name none: here, inside a site
    "links": [{"between": ["a", "b"], "protection": "aead"}, {"between": ["a", "c"]}],
})


def material(site: str, role: CertRole, name: str = "0", ca=CA, revoked: frozenset[int] = frozenset()
             ) -> TLSMaterial:
    cert, key = issue(ca, Identity(site, role, name))
    return TLSMaterial(CA.pem, cert, key, Identity(site, role, name), revoked)


def cache(seed: int | None) -> KVCache:
    c = KVCache(LAYOUT, 8)
    if seed is not None:
        c.kv.copy_(torch.randn(c.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return c


def receiver_at(site: str, dst: KVCache, **tls) -> TcpKVReceiver:
    """A decode worker's receiver at ``site``, configured as the worker entry point does."""
    cfg = kv_transfer_config(CFG, Role.DECODE, site, SECRET, material(site, CertRole.DECODE, **tls))
    return TcpKVReceiver(dst, cfg=cfg)


def send(src: KVCache, endpoint: str, cfg: TransferConfig, protection: str | None = None,
         receiver: str | None = None):
    tx = TcpKVSender(src, cfg)
    try:
        h = tx.open(TransferTarget(endpoint, "t", (2, 3), LAYOUT.compat_hash(), protection=protection,
                                   receiver=receiver))
        for layer in range(LAYOUT.num_layers):
            h.send_layer(layer, [0, 1], 0)
        h.finish(3, 0.0)
        h.wait(20)
        return h
    finally:
        tx.close()


def prefill_cfg(site: str, role: CertRole = CertRole.PREFILL, **kw) -> TransferConfig:
    if role is CertRole.PREFILL:
        return kv_transfer_config(CFG, Role.PREFILL, site, SECRET, material(site, role, **kw))
    return TransferConfig(secret=SECRET, credentials=CertCredentials(material(site, role, **kw), (CertRole.DECODE,)))


def test_the_receiver_enforces_the_link_its_senders_certificate_names():
    src, dst = cache(1), cache(None)
    rx = receiver_at("a", dst)
    try:
        # from b, over a link declared aead: an integrity-only sender is refused (kv.protection says integrity)
        h = send(src, rx.endpoint, prefill_cfg("b"), protection="integrity")
        assert h.poll() is TransferState.FAILED
        assert "link from site b requires aead protection; the sender offered integrity" in h.failure().reason
        assert not dst.kv.any()
        # the same sender encrypting is accepted
        rh = rx.expect("t", [2, 3])
        assert send(src, rx.endpoint, prefill_cfg("b"), protection="aead").poll() is TransferState.DONE
        assert rh.wait(5) is TransferState.DONE and torch.equal(dst.kv[:, :, [2, 3]], src.kv[:, :, [0, 1]])
        rx.cancel("t")
        # from c (a link that names none: kv.protection) and within a, integrity is what the operator allowed
        for site in ("c", "a"):
            rh = rx.expect("t", [2, 3])
            h = send(src, rx.endpoint, prefill_cfg(site), protection="integrity")
            assert h.poll() is TransferState.DONE and rh.wait(5) is TransferState.DONE, (site, h.failure())
            rx.cancel("t")
    finally:
        rx.close()


def test_a_reservation_takes_kv_only_from_the_sender_it_names():
    """The attack of finding 6 (issue 33): another prefill worker, holding a real prefill certificate and
    the secret, writes blocks and a first token into a pending reservation: refused, nothing written,
    the reservation still waiting; the sender the router named then lands its KV."""
    dst = cache(None)
    rx = receiver_at("a", dst)
    try:
        rh = rx.expect("t", [2, 3], sender="a/prefill/0")
        intruder = send(cache(7), rx.endpoint, prefill_cfg("a", name="1"), protection="integrity")
        assert intruder.poll() is TransferState.FAILED
        assert "the reservation is for another sender" in intruder.failure().reason
        assert rh.poll() is TransferState.WAITING and rx.wrong_sender >= 1
        assert not dst.kv.any()
        src = cache(1)
        h = send(src, rx.endpoint, prefill_cfg("a"), protection="integrity")
        assert h.poll() is TransferState.DONE, h.failure()
        assert rh.wait(5) is TransferState.DONE and torch.equal(dst.kv[:, :, [2, 3]], src.kv[:, :, [0, 1]])
    finally:
        rx.close()


def test_a_lost_connection_fails_only_the_transfer_it_carried():
    """A connection that ends after its transfer is done (here: its sender closes late, as on a busy
    machine) must not fail a later transfer of the same id, which another connection will carry (a
    retried request): the receiver remembers which expectation each connection carried blocks for."""
    src, dst = cache(1), cache(None)
    rx = receiver_at("a", dst)
    tx = TcpKVSender(src, prefill_cfg("c"))
    try:
        rh = rx.expect("t", [2, 3])
        h = tx.open(TransferTarget(rx.endpoint, "t", (2, 3), LAYOUT.compat_hash(), protection="integrity"))
        for layer in range(LAYOUT.num_layers):
            h.send_layer(layer, [0, 1], 0)
        h.finish(3, 0.0)
        assert h.wait(20) is TransferState.DONE and rh.wait(5) is TransferState.DONE
        rx.cancel("t")
        again = rx.expect("t", [2, 3])
        tx.close()  # the first transfer's connection ends only now
        assert wait_until(lambda: rx.connections == 0, 20)
        assert again.poll() is not TransferState.FAILED, again.failure()
        assert send(src, rx.endpoint, prefill_cfg("a"), protection="integrity").poll() is TransferState.DONE
        assert again.wait(5) is TransferState.DONE
    finally:
        tx.close()
        rx.close()


def test_a_pooled_connection_does_not_keep_the_transfers_it_carried():
    """A connection carries transfer after transfer; each one it remembers (to fail it if the
    connection is lost) is forgotten once it ends, so a long-lived connection holds none of them."""
    src, dst = cache(1), cache(None)
    rx = receiver_at("a", dst)
    tx = TcpKVSender(src, prefill_cfg("c"))
    try:
        for i in range(20):
            rh = rx.expect(f"t{i}", [2, 3])
            h = tx.open(TransferTarget(rx.endpoint, f"t{i}", (2, 3), LAYOUT.compat_hash(), protection="integrity"))
            for layer in range(LAYOUT.num_layers):
                h.send_layer(layer, [0, 1], 0)
            h.finish(3, 0.0)
            assert h.wait(20) is TransferState.DONE and rh.wait(5) is TransferState.DONE
        assert rx.connections == 1  # one pooled connection carried all twenty
        assert [len(c.transfers) for c in rx._conns] == [0]
    finally:
        tx.close()
        rx.close()


@pytest.mark.parametrize("case, reason", [
    ("decode-role sender", "is a decode; only a prefill may do this"),
    ("revoked", "is revoked"),
    ("foreign CA", "not issued by the cluster CA"),
])
def test_senders_with_the_wrong_certificate_are_refused_before_any_byte(case, reason):
    src, dst = cache(1), cache(None)
    if case == "decode-role sender":
        cfg = prefill_cfg("a", CertRole.DECODE)
    elif case == "foreign CA":
        cfg = prefill_cfg("a", ca=new_ca())
    else:
        cfg = prefill_cfg("a")
    revoked = frozenset({_serial(cfg)}) if case == "revoked" else frozenset()
    rx = TcpKVReceiver(dst, cfg=kv_transfer_config(CFG, Role.DECODE, "a", SECRET,
                                                    material("a", CertRole.DECODE, revoked=revoked)))
    try:
        rh = rx.expect("t", [2, 3])
        h = send(src, rx.endpoint, cfg)
        assert h.poll() is TransferState.FAILED and reason in h.failure().reason, h.failure()
        assert rh.poll() is TransferState.WAITING and not dst.kv.any()
        assert wait_until(lambda: rx.refused == 1, 5)  # counted after the refusal went out
    finally:
        rx.close()


def _serial(cfg: TransferConfig) -> int:
    from cryptography import x509

    return x509.load_der_x509_certificate(cfg.credentials.certificate).serial_number


def test_a_sender_talks_only_to_the_decode_worker_the_router_named():
    src, dst = cache(1), cache(None)
    rx = receiver_at("a", dst, name="1")
    try:
        h = send(src, rx.endpoint, prefill_cfg("a"), receiver="a/decode/0")
        assert h.poll() is TransferState.FAILED
        assert "the receiver is kvrelay://a/decode/1, not kvrelay://a/decode/0" in h.failure().reason
        rh = rx.expect("t", [2, 3])
        assert send(src, rx.endpoint, prefill_cfg("a"), receiver="a/decode/1").poll() is TransferState.DONE
        assert rh.wait(5) is TransferState.DONE
    finally:
        rx.close()


class _Recorder:
    """A silent listener that records every byte connecting senders send and
    answers nothing (a fake receiver without the secret or certificate)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.seen = bytearray()
        self.done = threading.Event()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while not self.done.is_set():
            conn, _ = self.listener.accept()
            conn.settimeout(2.0)
            try:
                while data := conn.recv(65536):
                    self.seen += data
            except OSError:
                pass
            conn.close()


@pytest.mark.skipif(not nixl_available(), reason="NIXL is not installed")
def test_an_unauthenticated_peer_learns_no_nixl_metadata_or_memory_address():
    """A NIXL sender pointed at a peer that cannot prove itself (a silent
    listener; a real receiver with the wrong secret behind a tap): the
    bytes it received hold neither the agent metadata nor the KV address."""
    src = cache(1)
    tx = NixlKVSender(src, TransferConfig(secret=SECRET, streams=1, connect_timeout_s=2.0))
    secrets = [tx.nixl.metadata, tx.nixl.base_address.to_bytes(8, "little"),
               tx.nixl.base_address.to_bytes(8, "big")]
    silent = _Recorder()
    wrong = TcpKVReceiver(cache(None), cfg=TransferConfig(secret=b"s" * 32))
    tap = Tap(wrong.endpoint)
    try:
        for endpoint in (silent.endpoint, tap.endpoint):
            h = tx.open(TransferTarget(endpoint, f"t-{endpoint}", (2, 3), LAYOUT.compat_hash()))
            h.send_layer(0, [0, 1], 0)
            h.finish(3, 0.0)
            assert h.wait(20) is TransferState.FAILED
        assert "authentication" in h.failure().reason
        for seen in (silent.seen, tap.seen):
            assert len(seen) > 0
            assert not any(s in seen for s in secrets)
            assert len(seen) < 4096  # a hello and nothing after it: the proofs failed
    finally:
        silent.done.set()
        tx.close()
        wrong.close()


def hello_answer(endpoint: str, wire: bytes, source: str) -> pb.KVHelloAnswer:
    host, port = endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0)) as sock:
        sock.sendall(wire)
        return pb.KVHelloAnswer.FromString(recv_frame(sock)[0].hello_ack.answer)


def test_a_flood_of_idle_and_replayed_hellos_from_one_address_leaves_real_transfers_passing():
    """The attack of finding 2 (issue 33), against a receiver whose gate holds 128 handshakes:
    one address (127.0.0.2) opens 200 connections and holds them idle, which before filled the
    whole gate; another (127.0.0.3) replays a real sender's hello 30 times and sends one with a
    forged stamp. The idle ones hold 64 places at most, the replays and the forgery are refused
    at the cost of a MAC (no certificate check, key exchange or signature), and a real sender
    (127.0.0.1) moves its KV meanwhile."""
    src, dst = cache(1), cache(None)
    cfg = kv_transfer_config(CFG, Role.DECODE, "a", SECRET, material("a", CertRole.DECODE))
    rx = TcpKVReceiver(dst, cfg=dataclasses.replace(cfg, max_pending_handshakes=128, connect_timeout_s=60.0))
    host, port = rx.endpoint.rsplit(":", 1)
    idle: list[socket.socket] = []
    try:
        for _ in range(200):
            idle.append(socket.create_connection((host, int(port)), timeout=10, source_address=("127.0.0.2", 0)))
        assert wait_until(lambda: rx.gate.pending == 64, 10), rx.gate.pending  # the rest closed on accept
        wire = captured_hello(SenderHello(SECRET, LAYOUT.compat_hash(), prefill_cfg("a").credentials,
                                          Protection.INTEGRITY))
        assert hello_answer(rx.endpoint, wire, "127.0.0.3").accepted  # the first time, it is new
        replies = [hello_answer(rx.endpoint, wire, "127.0.0.3") for _ in range(30)]
        assert all(not a.accepted and "replayed hello" in a.reason for a in replies), {a.reason for a in replies}
        frame = pb.KVFrame.FromString(wire[4:])
        frame.hello.sent_unix_ms += 1  # anything changed breaks the stamp, which only the secret makes
        forged = hello_answer(rx.endpoint, frame_bytes(frame.SerializeToString()), "127.0.0.3")
        assert not forged.accepted and forged.reason.startswith("hello failed authentication: not stamped")
        rh = rx.expect("t", [2, 3])
        h = send(src, rx.endpoint, prefill_cfg("a"), protection="integrity")
        assert h.poll() is TransferState.DONE, h.failure()
        assert rh.wait(5) is TransferState.DONE and torch.equal(dst.kv[:, :, [2, 3]], src.kv[:, :, [0, 1]])
    finally:
        for sock in idle:
            sock.close()
        rx.close()
