"""TCP KV transport: our own, zero-copy, several streams per peer.

Sender: per receiver endpoint a pool of ``streams`` authenticated
connections, each with a writer thread (frames + ``sendall`` straight from
the KV tensor's memory, one call per run of consecutive blocks) and a
reader thread (acknowledgements). Layers go round-robin over the streams.

Receiver: a listener thread, and per connection a thread that checks the
handshake, then ``recv_into``s each run of blocks straight into the
reserved blocks' memory and verifies every block's CRC32C. Bytes for a
transfer that is unknown or was cancelled are read into scratch memory and
dropped: a freed reservation is never written.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import crc32c
import torch

from engine.kv_cache import KVCache
from kvrelay.v1 import kv_wire_pb2 as pb
from kvtransfer.base import (KVReceiver, KVSender, SendHandle, TransferHandle, TransferResult, TransferState,
                             TransferTarget, coalesce, KVBytes)
from kvtransfer.wire import (SHM_NAME, PayloadCipher, ProtocolError, client_handshake, host_id, recv_exact_into,
                             recv_frame, send_frame, server_handshake, tune_socket)

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TcpConfig:
    secret: bytes = b""
    """Deployment secret both ends prove they hold (HMAC challenge-response)."""
    streams: int = 4
    """Parallel connections per peer."""
    socket_buffer_bytes: int | None = None
    """SO_SNDBUF/SO_RCVBUF; size it to the link's bandwidth-delay product."""
    connect_timeout_s: float = 5.0
    """Deadline for connecting and for the handshake."""
    encrypt: bool = False
    """Sender: encrypt KV payloads (AES-256-GCM) on links that leave a site.
    Receiver: refuse senders that do not."""
    shared_memory: bool = False
    """Local transport: offer receivers on this host the sender's shared-memory
    KV (its cache must have an shm_path); they copy from it, so only frame
    headers cross the socket."""

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= 64:
            raise ValueError(f"streams must be in [1, 64], got {self.streams}")


def _block_crcs(view: memoryview, block_bytes: int) -> list[int]:
    # gil_release_mode=1: other transport threads run while a block is summed.
    return [crc32c.crc32c(view[i:i + block_bytes], 0, 1) for i in range(0, len(view), block_bytes)]


# ---------------------------------------------------------------- receiver
@dataclass(slots=True)
class _Incoming:
    handle: TransferHandle
    block_ids: list[int]
    need: int
    landed: set = field(default_factory=set)
    nbytes: int = 0
    started: float = 0.0
    done: pb.KVDone | None = None
    done_conn: _Conn | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)


class _Conn:
    """One accepted connection; ``send`` may be called from other threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.transfers: set[str] = set()
        self.peer_kv: KVCache | None = None
        """The sender's shared-memory KV, when it offered it (local transport)."""
        self.cipher = None
        """PayloadCipher when the sender encrypts its payloads."""

    def send(self, frame: pb.KVFrame) -> None:
        with self.lock:
            try:
                send_frame(self.sock, frame)
            except OSError:
                pass


class TcpKVReceiver(KVReceiver):
    name = "tcp"

    def __init__(self, cache: KVCache, host: str = "127.0.0.1", cfg: TcpConfig | None = None) -> None:
        self.cache = cache
        self.mem = KVBytes(cache)
        self.cfg = cfg or TcpConfig()
        self.layout_hash = cache.layout.compat_hash()
        self._expected: dict[str, _Incoming] = {}
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._listener = socket.create_server((host, 0), backlog=128)
        self.endpoint = f"{host}:{self._listener.getsockname()[1]}"
        self.bytes_received = 0
        self.refused = 0
        """Connections refused at the handshake."""
        self._conns: set[socket.socket] = set()
        self._peers: dict[str, KVCache] = {}
        threading.Thread(target=self._accept_loop, name="kv-accept", daemon=True).start()

    def expect(self, transfer_id: str, block_ids: list[int]) -> TransferHandle:
        h = TransferHandle(transfer_id)
        h.advance(TransferState.WAITING)
        layers = self.cache.layout.num_layers
        with self._lock:
            self._expected[transfer_id] = _Incoming(h, list(block_ids), 2 * layers * len(block_ids),
                                                    started=time.perf_counter())
        return h

    def cancel(self, transfer_id: str) -> None:
        with self._lock:
            inc = self._expected.pop(transfer_id, None)
        if inc is not None:
            with inc.lock:  # waits for a write into its blocks to end
                inc.handle.fail("cancelled by the receiver")

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for s in list(self._conns):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="kv-recv", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        self._conns.add(sock)
        try:
            tune_socket(sock, self.cfg.socket_buffer_bytes)
            sock.settimeout(self.cfg.connect_timeout_s)
            try:
                conn.peer_kv, conn.cipher = server_handshake(sock, self.cfg.secret, self.layout_hash, self,
                                                             self.cfg.encrypt)
            except (ProtocolError, OSError) as exc:  # incl. a sender that hung up on our proof
                self.refused += 1
                log.warning("refused KV connection: %s", exc)
                return
            sock.settimeout(None)
            while not self._closed.is_set():
                frame = recv_frame(sock)
                kind = frame.WhichOneof("body")
                if kind == "blocks":
                    self._on_blocks(conn, frame.blocks)
                elif kind == "done":
                    self._on_done(conn, frame.done)
                else:
                    raise ProtocolError(f"unexpected {kind!r} frame")
        except (OSError, ConnectionError, ProtocolError) as exc:
            for tid in list(conn.transfers):
                inc = self._expected.get(tid)
                if inc is not None:
                    inc.handle.fail(f"sender connection lost ({exc})")
        finally:
            self._conns.discard(sock)
            sock.close()

    # -- PeerAttacher: senders whose memory we pull from ---------------------
    nixl = None
    """A NixlAgent when this receiver can READ from NIXL senders."""

    def can_attach(self, hello: pb.KVHello) -> bool:
        if hello.nixl_metadata:
            return self.nixl is not None
        return bool(hello.shm_path and hello.host_id == host_id() and SHM_NAME.fullmatch(hello.shm_path)
                    and os.path.exists(hello.shm_path))

    def attach(self, hello: pb.KVHello) -> object:
        if hello.nixl_metadata:
            return self.nixl.add_peer(hello.nixl_metadata, hello.kv_base_address, hello.kv_device_id,
                                      hello.shm_num_blocks)
        with self._lock:
            peer = self._peers.get(hello.shm_path)
            if peer is None or peer.num_blocks != hello.shm_num_blocks:
                peer = KVCache.attach(self.cache.layout, hello.shm_num_blocks, hello.shm_path)
                self._peers[hello.shm_path] = peer
            return peer

    def _discard(self, conn: _Conn, n: int) -> None:
        """Reads and drops a payload that must not land in any block."""
        self._drain(conn.sock, n)
        if conn.cipher is not None and n:
            conn.cipher.skip()

    def _drain(self, sock: socket.socket, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            recv_exact_into(sock, scratch[:k])
            n -= k

    def _on_blocks(self, conn: _Conn, hdr: pb.KVBlocks) -> None:
        layout = self.cache.layout
        inc = self._expected.get(hdr.transfer_id)
        bad = ""
        runs = max(1, hdr.num_layers) * 2 * hdr.count
        pulled = len(hdr.src_blocks) > 0
        payload = 0 if pulled else runs * layout.block_bytes + (PayloadCipher.TAG if conn.cipher else 0)
        if hdr.payload_bytes != payload or len(hdr.crc32c) != runs:
            raise ProtocolError(f"blocks frame of {hdr.payload_bytes} bytes for {hdr.count} blocks "
                                f"x {hdr.num_layers} layers")
        if pulled and (conn.peer_kv is None or len(hdr.src_blocks) != hdr.count
                       or max(hdr.src_blocks) >= conn.peer_kv.num_blocks):
            raise ProtocolError("shared-memory blocks frame without a valid shared KV mapping")
        layers = range(hdr.layer, hdr.layer + max(1, hdr.num_layers))
        if inc is not None and (layers.stop > layout.num_layers or hdr.count == 0
                                or hdr.first + hdr.count > len(inc.block_ids)):
            bad = f"blocks [{hdr.first}, {hdr.first + hdr.count}) of layers {layers.start}-{layers.stop - 1} " \
                  "outside the reservation or the model"
        if inc is None or bad:
            self._discard(conn, hdr.payload_bytes)
            if inc is not None:
                inc.handle.fail(bad)
            return
        conn.transfers.add(hdr.transfer_id)
        dest = inc.block_ids[hdr.first:hdr.first + hdr.count]
        with inc.lock:
            if inc.handle.poll() is TransferState.FAILED:
                self._discard(conn, hdr.payload_bytes)
                return
            inc.handle.advance(TransferState.TRANSFERRING)
            crcs = []
            dest_runs = coalesce(dest)
            plain = None
            if pulled:
                self._pull(conn.peer_kv, layers, list(hdr.src_blocks), dest)
            elif conn.cipher is not None:  # decrypt first, then place the plaintext
                sealed = bytearray(hdr.payload_bytes)
                recv_exact_into(conn.sock, memoryview(sealed))
                plain = memoryview(conn.cipher.open(bytes(sealed)))
            pos = 0
            for layer in layers:
                for kind in (0, 1):
                    for _, first_id, n in dest_runs:
                        view = self.mem.run(layer, kind, first_id, n)
                        if plain is not None:
                            view[:] = plain[pos:pos + len(view)]
                            pos += len(view)
                        elif not pulled:
                            recv_exact_into(conn.sock, view)
                        crcs += _block_crcs(view, layout.block_bytes)
            bad = [i for i, (a, b) in enumerate(zip(crcs, hdr.crc32c)) if a != b]
            if bad:
                bad_blocks = sorted({dest[i % hdr.count] for i in bad})
                inc.handle.fail(f"checksum mismatch in layers {layers.start}-{layers.stop - 1} of "
                                f"{len(bad_blocks)} block(s)", bad_blocks)
                return
            for layer in layers:
                for kind in (0, 1):
                    for i in range(hdr.first, hdr.first + hdr.count):
                        inc.landed.add((layer, kind, i))
            inc.nbytes += hdr.payload_bytes
            self.bytes_received += hdr.payload_bytes
        self._maybe_complete(hdr.transfer_id, inc)

    def _pull(self, peer: object, layers: range, src: list[int], dest: list[int]) -> None:
        """Copies the sender's blocks into ours: NIXL READ, or one memcpy from
        a same-host sender's shared KV."""
        if not isinstance(peer, KVCache):
            try:
                self.nixl.read(peer, layers, src, dest, self.cfg.connect_timeout_s * 6)
            except RuntimeError as exc:
                raise ProtocolError(str(exc)) from None
            return
        s = torch.tensor(src, dtype=torch.long)
        d = torch.tensor(dest, dtype=torch.long)
        for layer in layers:
            for kind in (0, 1):
                self.cache.kv[layer, kind].index_copy_(0, d, peer.kv[layer, kind].index_select(0, s))

    def _on_done(self, conn: _Conn, done: pb.KVDone) -> None:
        inc = self._expected.get(done.transfer_id)
        if inc is None:
            conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=done.transfer_id, ok=False,
                                                       reason="no such reservation (expired or cancelled)")))
            return
        inc.done, inc.done_conn = done, conn
        self._maybe_complete(done.transfer_id, inc)

    def _maybe_complete(self, tid: str, inc: _Incoming) -> None:
        if inc.done is None:
            return
        state = inc.handle.poll()
        if state is not TransferState.FAILED and len(inc.landed) < inc.need:
            return
        if state is not TransferState.FAILED:
            inc.handle.complete(TransferResult(inc.done.first_token_id, inc.done.first_logprob, inc.nbytes,
                                               time.perf_counter() - inc.started))
        err = inc.handle.failure()
        inc.done_conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=tid, ok=err is None,
                                                            reason=err.reason if err else "")))


# ------------------------------------------------------------------ sender
class _Stream:
    """One authenticated connection to a peer, with writer and reader threads."""

    def __init__(self, pool: _PeerPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.shared = False
        """The receiver copies from our shared-memory KV (local transport)."""
        self.cipher = None
        """PayloadCipher when this connection encrypts."""
        self.inflight: set[str] = set()
        threading.Thread(target=self._write_loop, name=f"kv-send-{index}", daemon=True).start()

    def _connect(self) -> None:
        cfg = self.pool.cfg
        host, _, port = self.pool.endpoint.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s)
        tune_socket(sock, cfg.socket_buffer_bytes)
        self.shared, self.cipher = client_handshake(sock, cfg.secret, self.pool.layout_hash, self.pool.offer(),
                                                    cfg.encrypt)
        sock.settimeout(None)
        self.sock = sock
        threading.Thread(target=self._read_loop, args=(sock,), name=f"kv-ack-{self.index}", daemon=True).start()

    def _broken(self, reason: str) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass
        for tid in list(self.inflight):
            h = self.pool.handles.get(tid)
            if h is not None:
                h.fail(reason)
        self.inflight.clear()

    def _batches(self):
        """Yields queued items, merging runs of "blocks" items of one transfer
        for the same blocks and consecutive layers into one multi-layer item."""
        while True:
            items = [self.q.get()]
            while True:
                try:
                    items.append(self.q.get_nowait())
                except queue.Empty:
                    break
            merged: list = []
            for it in items:
                prev = merged[-1] if merged else None
                if (it is not None and prev is not None and it[0] == prev[0] == "blocks" and it[1] is prev[1]
                        and it[3] == prev[3] and it[4] == prev[4] and it[2] == prev[2] + prev[5]):
                    merged[-1] = (*prev[:5], prev[5] + 1)
                else:
                    merged.append(it if it is None or it[0] != "blocks" else (*it, 1))
            yield from merged

    def _write_loop(self) -> None:
        mem = self.pool.mem
        bb = mem.block_bytes
        for item in self._batches():
            if item is None:
                self._broken("sender closed")
                return
            h = item[1]
            if not h.enter():
                continue
            self.inflight.add(h.transfer_id)
            try:
                if self.sock is None:
                    self._connect()
                if item[0] == "blocks":
                    _, _, layer, src, first, num_layers = item
                    runs = coalesce(src)
                    views = [mem.run(lyr, kind, b, n) for lyr in range(layer, layer + num_layers)
                             for kind in (0, 1) for _, b, n in runs]
                    crcs = [c for v in views for c in _block_crcs(v, bb)]
                    nbytes = num_layers * 2 * len(src) * bb
                    sealed = None
                    if self.cipher is not None and not self.shared:
                        sealed = self.cipher.seal(b"".join(views))
                    wire_bytes = 0 if self.shared else (len(sealed) if sealed is not None else nbytes)
                    send_frame(self.sock, pb.KVFrame(blocks=pb.KVBlocks(
                        transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first,
                        count=len(src), payload_bytes=wire_bytes, crc32c=crcs,
                        src_blocks=src if self.shared else [])))
                    if sealed is not None:
                        self.sock.sendall(sealed)
                    elif not self.shared:
                        for v in views:
                            self.sock.sendall(v)
                    h.add_bytes(nbytes)
                else:
                    _, _, token, logprob = item
                    send_frame(self.sock, pb.KVFrame(done=pb.KVDone(
                        transfer_id=h.transfer_id, first_token_id=token, first_logprob=logprob)))
            except ProtocolError as exc:
                self._broken(f"handshake with {self.pool.endpoint} failed: {exc}")
            except OSError as exc:
                self._broken(f"connection to {self.pool.endpoint} failed: {exc}")
            finally:
                h.leave()

    def _read_loop(self, sock: socket.socket) -> None:
        try:
            while True:
                frame = recv_frame(sock)
                if frame.WhichOneof("body") != "done_ack":
                    raise ProtocolError("unexpected frame from receiver")
                ack = frame.done_ack
                h = self.pool.handles.pop(ack.transfer_id, None)
                for s in self.pool.streams:
                    s.inflight.discard(ack.transfer_id)
                if h is None:
                    continue
                if ack.ok:
                    h.complete(TransferResult(h.first_token, h.first_logprob, h.nbytes,
                                              time.perf_counter() - h.started))
                else:
                    h.fail(f"receiver rejected the transfer: {ack.reason}")
        except (OSError, ConnectionError, ProtocolError) as exc:
            if self.sock is sock:
                self._broken(f"connection to {self.pool.endpoint} lost ({exc})")


class _PeerPool:
    def __init__(self, endpoint: str, cache: KVCache, cfg: TcpConfig, nixl=None) -> None:
        self.endpoint = endpoint
        self.cache = cache
        self.mem = KVBytes(cache)
        self.cfg = cfg
        self.nixl = nixl
        self.layout_hash = cache.layout.compat_hash()
        self.handles: dict[str, _TcpSendHandle] = {}
        self.streams = [_Stream(self, i) for i in range(cfg.streams)]

    def offer(self) -> pb.KVHello | None:
        """What lets the receiver pull from us instead of reading bytes."""
        if not self.cfg.shared_memory:
            return None
        if self.nixl is not None:
            return pb.KVHello(nixl_metadata=self.nixl.metadata, kv_base_address=self.nixl.base_address,
                              kv_device_id=self.nixl.device_id, shm_num_blocks=self.cache.num_blocks)
        if self.cache.shm_path:
            return pb.KVHello(host_id=host_id(), shm_path=self.cache.shm_path, shm_num_blocks=self.cache.num_blocks)
        return None

    def close(self) -> None:
        for s in self.streams:
            s.q.put(None)


class _TcpSendHandle(SendHandle):
    def __init__(self, pool: _PeerPool, target: TransferTarget) -> None:
        super().__init__(target.transfer_id)
        self.pool = pool
        self.target = target
        self.nbytes = 0
        self.started = time.perf_counter()
        self.first_token = 0
        self.first_logprob = 0.0
        self._busy = threading.Condition()
        self._readers = 0
        self.advance(TransferState.WAITING)

    def add_bytes(self, n: int) -> None:
        with self._busy:
            self.nbytes += n

    def enter(self) -> bool:
        """A stream thread starts an item; False when the transfer already failed."""
        with self._busy:
            if self.poll() is TransferState.FAILED:
                return False
            self._readers += 1
            return True

    def leave(self) -> None:
        with self._busy:
            self._readers -= 1
            self._busy.notify_all()

    def quiesce(self, timeout_s: float) -> bool:
        with self._busy:
            return self._busy.wait_for(lambda: self._readers == 0, timeout_s)

    def send_layer(self, layer: int, src_blocks: list[int], first: int) -> None:
        if not src_blocks:
            return
        if first + len(src_blocks) > len(self.target.block_ids):
            self.fail(f"layer {layer}: blocks [{first}, {first + len(src_blocks)}) beyond the target's "
                      f"{len(self.target.block_ids)}")
            return
        self.advance(TransferState.TRANSFERRING)
        streams = self.pool.streams
        streams[layer % len(streams)].q.put(("blocks", self, layer, list(src_blocks), first))

    def finish(self, first_token_id: int, first_logprob: float) -> None:
        self.first_token, self.first_logprob = first_token_id, first_logprob
        self.pool.streams[0].q.put(("done", self, first_token_id, first_logprob))


class TcpKVSender(KVSender):
    name = "tcp"
    nixl = None
    """A NixlAgent when receivers should READ our KV over NIXL."""

    def __init__(self, cache: KVCache, cfg: TcpConfig | None = None) -> None:
        self.cache = cache
        self.cfg = cfg or TcpConfig()
        self._pools: dict[str, _PeerPool] = {}
        self._lock = threading.Lock()

    def open(self, target: TransferTarget) -> SendHandle:
        with self._lock:
            pool = self._pools.get(target.endpoint)
            if pool is None:
                pool = self._pools[target.endpoint] = _PeerPool(target.endpoint, self.cache, self.cfg, self.nixl)
        h = _TcpSendHandle(pool, target)
        if target.layout_hash != pool.layout_hash:
            h.fail("KV layout of the target differs from this sender's")
            return h
        pool.handles[target.transfer_id] = h
        h.add_done_callback(lambda done: pool.handles.pop(done.transfer_id, None))
        return h

    def close(self) -> None:
        with self._lock:
            for pool in self._pools.values():
                pool.close()
            self._pools.clear()
