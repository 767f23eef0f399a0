"""A man in the middle of a KV connection, on loopback: a proxy between a
real sender and a real receiver that understands the record framing
(kvtransfer/record.py) and flips a header byte, flips a payload byte, swaps
two frames, replays one, drops one, or cuts the connection. Every case must
fail the transfer, naming what was wrong, with none of its blocks counted
as landed; a clean connection afterwards delivers the same KV exactly."""

from __future__ import annotations

import socket
import struct
import threading

import pytest
import torch

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.protection import Protection
from kvrelay.kvtransfer.record import PREFIX, sealed_bytes
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from tests.integration.kv_tap import Tap, pump

LAYOUT = KVLayout("m", "float32", 2, 4, 64, 16)  # 16 KiB per (layer, K/V, block)
BLOCKS = 4


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return bytes(out)


class RecordProxy:
    """Forwards one connection; tampers with sender-to-receiver record ``at``
    (0 is the sender's sealed offer, 1.. its blocks and done frames)."""

    def __init__(self, target: str, mode: str, at: int = 1) -> None:
        self.target, self.mode, self.at = target, mode, at
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.tampered = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        client, _ = self.listener.accept()
        host, port = self.target.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        back = threading.Thread(target=pump, args=(server, client), daemon=True)
        back.start()
        try:
            self._pump(client, server)
        except OSError:
            pass
        finally:  # truncate cuts both ways; otherwise what the receiver says still reaches the sender
            _shut(server, socket.SHUT_RDWR if self.mode == "truncate" else socket.SHUT_WR)
            back.join(10)
            _shut(client, socket.SHUT_RDWR)
            client.close()
            server.close()

    @staticmethod
    def _record(sock: socket.socket) -> bytes:
        prefix = _read(sock, PREFIX.size)
        hlen, plen, _, section = PREFIX.unpack(prefix)
        return prefix + _read(sock, hlen + (sealed_bytes(plen, section) if plen else 0))

    def _pump(self, client: socket.socket, server: socket.socket) -> None:
        for _ in range(2):  # hello and auth: plaintext handshake frames
            head = _read(client, 4)
            server.sendall(head + _read(client, struct.unpack("<I", head)[0]))
        index, held = 0, None
        while True:
            rec = self._record(client)
            out = self._tamper(index, rec, held)
            if self.mode == "swap" and index == self.at:
                held = rec
            else:
                for r in out:
                    server.sendall(r)
                if self.mode == "truncate" and index == self.at:
                    return
            index += 1

    def _tamper(self, index: int, rec: bytes, held: bytes | None) -> list[bytes]:
        """The records to forward in place of record ``index``."""
        mode, at = self.mode, self.at
        if index == at:
            self.tampered.set()
        if mode == "flip-header" and index == at:
            return [_flip(rec, PREFIX.size + 3)]
        if mode == "flip-payload" and index == at:
            hlen = PREFIX.unpack(rec[:PREFIX.size])[0]
            return [_flip(rec, PREFIX.size + hlen + 100)]
        if mode == "replay" and index == at:
            return [rec, rec]
        if mode == "drop" and index == at:
            return []
        if mode == "swap" and index == at + 1:
            return [rec, held]
        if mode == "truncate" and index == at:
            hlen = PREFIX.unpack(rec[:PREFIX.size])[0]
            return [rec[:PREFIX.size + hlen + 5000]]  # the header and part of the payload, then the cut
        return [rec]


def _shut(sock: socket.socket, how: int) -> None:
    try:
        sock.shutdown(how)
    except OSError:
        pass


def _flip(rec: bytes, offset: int) -> bytes:
    b = bytearray(rec)
    b[offset] ^= 0x01
    return bytes(b)


def _cache(seed: int | None) -> KVCache:
    cache = KVCache(LAYOUT, 2 * BLOCKS)
    if seed is not None:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return cache


def _send(tx: TcpKVSender, endpoint: str, tid: str):
    """One frame per (layer, block): different blocks are never merged into one frame."""
    h = tx.open(TransferTarget(endpoint, tid, tuple(range(BLOCKS)), LAYOUT.compat_hash()))
    for layer in range(LAYOUT.num_layers):
        for b in range(BLOCKS):
            h.send_layer(layer, [b], b)
    h.finish(5, -0.25)
    return h


CASES = {
    "flip-header": "header failed authentication",
    "flip-payload": "payload failed authentication",
    "swap": "out of order",
    "replay": "replayed",
    "drop": "out of order",
    "truncate": "truncated",
}


@pytest.mark.parametrize("protection", list(Protection))
@pytest.mark.parametrize("mode", list(CASES))
def test_tampering_fails_the_transfer_and_lands_nothing(mode, protection):
    src, dst = _cache(1), _cache(None)
    cfg = TransferConfig(secret=SECRET, streams=1, protection=protection)
    rx = TcpKVReceiver(dst, cfg=cfg)
    proxy = RecordProxy(rx.endpoint, mode)
    tx = TcpKVSender(src, cfg)
    try:
        rh = rx.expect("t", list(range(BLOCKS)))
        h = _send(tx, proxy.endpoint, "t")
        assert h.wait(20) is TransferState.FAILED, f"{mode}: the transfer completed"
        assert proxy.tampered.is_set()
        assert rh.poll() is not TransferState.DONE  # the receiver never accepted it
        # what was wrong reaches the sender (the receiver tells it, unless the link is cut) or
        # fails the receiver's side (when it knew the transfer before the bad record)
        reasons = h.failure().reason + " | " + (rh.failure().reason if rh.poll() is TransferState.FAILED else "")
        assert CASES[mode] in reasons, reasons
        assert rx.bytes_received < 2 * LAYOUT.num_layers * BLOCKS * LAYOUT.block_bytes  # not all of it landed
        rx.cancel("t")
        # the usual recovery: the same KV again, on a clean connection, arrives exactly
        rh = rx.expect("t2", list(range(BLOCKS, 2 * BLOCKS)))
        h = _send(tx, rx.endpoint, "t2")
        assert rh.wait(20) is TransferState.DONE and h.wait(20) is TransferState.DONE, (rh.failure(), h.failure())
        assert rh.result().first_token_id == 5
        assert torch.equal(dst.kv[:, :, BLOCKS:], src.kv[:, :, :BLOCKS])
    finally:
        tx.close()
        rx.close()


def test_integrity_mode_leaves_kv_readable_and_aead_does_not():
    """What an eavesdropper on the link sees: the KV bytes themselves under
    integrity, none of them under aead."""
    src = _cache(2)
    needle = bytes(src.kv[0, 0, 0].numpy().tobytes()[:64])
    for protection, visible in ((Protection.INTEGRITY, True), (Protection.AEAD, False)):
        dst = _cache(None)
        cfg = TransferConfig(secret=SECRET, streams=1, protection=protection)
        rx = TcpKVReceiver(dst, cfg=cfg)
        proxy = Tap(rx.endpoint)
        tx = TcpKVSender(src, cfg)
        try:
            rh = rx.expect("t", list(range(BLOCKS)))
            h = _send(tx, proxy.endpoint, "t")
            assert rh.wait(20) is TransferState.DONE and h.wait(20) is TransferState.DONE
            assert (needle in proxy.seen) is visible, protection
        finally:
            tx.close()
            rx.close()
