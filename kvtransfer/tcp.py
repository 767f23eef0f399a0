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

import dataclasses
import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

import crc32c
import torch
from kvrelay.v1 import kv_wire_pb2 as pb

from engine.kv_cache import KVCache
from kvtransfer.base import (
    KVBytes,
    KVReceiver,
    KVSender,
    SendHandle,
    TransferHandle,
    TransferResult,
    TransferState,
    TransferTarget,
    coalesce,
)
from kvtransfer.wire import (
    SHM_NAME,
    PayloadCipher,
    ProtocolError,
    client_handshake,
    host_id,
    recv_exact_into,
    recv_frame,
    recv_views,
    send_frame,
    send_views,
    server_handshake,
    tune_socket,
)

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

    stall_timeout_s: float = 30.0
    """Sender: the kernel drops a connection whose sent bytes stay unacknowledged
    this long (TCP_USER_TIMEOUT: a frozen receiver, a link that went down), so
    its transfers fail and a new connection replaces it, instead of blocking."""
    corrupt_first: int = 0
    """Fault injection: the first N transfers of a sender carry one flipped
    byte (plaintext payloads) or checksum (shared memory) the receiver must catch."""

    def __post_init__(self) -> None:
        if not 1 <= self.streams <= 64:
            raise ValueError(f"streams must be in [1, 64], got {self.streams}")


def _block_crcs(views: list[memoryview], block_bytes: int) -> list[int]:
    # gil_release_mode=1: other transport threads run while a block is summed.
    f = crc32c.crc32c
    return [f(v[i:i + block_bytes], 0, 1) for v in views for i in range(0, len(v), block_bytes)]


STICKY_BYTES = 4 << 20
"""A transfer keeps using the stream that carried its previous layer while
that stream has less than this queued (so small transfers merge into few
frames); beyond it, the next layer goes to the least-loaded stream."""


INLINE_VERIFY_BYTES = 1 << 20
"""Frames up to this size are verified on the receiving thread (a thread
hop costs more than summing them); larger ones on the verifier thread."""


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
    acked: bool = False
    writers: dict = field(default_factory=dict)
    """Connections writing into this reservation's blocks now (conn -> count)."""
    cond: threading.Condition = field(default_factory=threading.Condition)

    def enter(self, conn: _Conn) -> bool:
        """A connection starts writing into the blocks; False once failed."""
        with self.cond:
            if self.handle.poll() is TransferState.FAILED:
                return False
            self.writers[conn] = self.writers.get(conn, 0) + 1
            return True

    def leave(self, conn: _Conn) -> None:
        with self.cond:
            self.writers[conn] -= 1
            if not self.writers[conn]:
                del self.writers[conn]
            self.cond.notify_all()


class _Conn:
    """One accepted connection; ``send`` may be called from other threads."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.transfers: set[str] = set()
        self.peer_kv: KVCache | None = None
        """The sender's shared-memory KV, when it offered it (local transport)."""
        self.cipher: PayloadCipher | None = None
        """When the sender encrypts its payloads."""
        self.verify: queue.SimpleQueue = queue.SimpleQueue()
        """Frames whose bytes landed, for the verifier thread to checksum."""

    def send(self, frame: pb.KVFrame) -> None:
        with self.lock:
            try:
                send_frame(self.sock, frame)
            except OSError:
                pass

    def abort(self) -> None:
        """Makes a receive blocked on this connection return at once."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
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
        self._conns: set[_Conn] = set()
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
        """Fails the transfer and returns once nothing writes into its blocks
        any more: a connection still writing is cut after a short grace."""
        with self._lock:
            inc = self._expected.pop(transfer_id, None)
        if inc is None:
            return
        inc.handle.fail("cancelled by the receiver")
        with inc.cond:
            if inc.cond.wait_for(lambda: not inc.writers, 1.0):
                return
            for conn in inc.writers:
                conn.abort()
            inc.cond.wait_for(lambda: not inc.writers, self.cfg.connect_timeout_s)

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        for conn in list(self._conns):
            conn.abort()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(sock,), name="kv-recv", daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = _Conn(sock)
        self._conns.add(conn)
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
            threading.Thread(target=self._verify_loop, args=(conn,), name="kv-verify", daemon=True).start()
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
                    self._maybe_complete(tid, inc)
        finally:
            conn.verify.put(None)
            self._conns.discard(conn)
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
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            recv_exact_into(conn.sock, scratch[:k])
            n -= k
        if conn.cipher is not None:
            conn.cipher.next_frame()

    def _on_blocks(self, conn: _Conn, hdr: pb.KVBlocks) -> None:
        layout = self.cache.layout
        inc = self._expected.get(hdr.transfer_id)
        runs = max(1, hdr.num_layers) * 2 * hdr.count
        layers = range(hdr.layer, hdr.layer + max(1, hdr.num_layers))
        pulled = len(hdr.src_blocks) > 0
        sealed = conn.cipher is not None and not pulled
        if pulled and (conn.peer_kv is None or len(hdr.src_blocks) != hdr.count
                       or max(hdr.src_blocks) >= conn.peer_kv.num_blocks):
            raise ProtocolError("shared-memory blocks frame without a valid shared KV mapping")
        bad = ""
        if inc is not None and (layers.stop > layout.num_layers or hdr.count == 0
                                or hdr.first + hdr.count > len(inc.block_ids)):
            bad = f"blocks [{hdr.first}, {hdr.first + hdr.count}) of layers {layers.start}-{layers.stop - 1} " \
                  "outside the reservation or the model"
        views: list[memoryview] = []
        dest: list[int] = []
        if inc is not None and not bad:
            dest = inc.block_ids[hdr.first:hdr.first + hdr.count]
            dest_runs = coalesce(dest)
            views = [self.mem.run(layer, kind, first_id, n) for layer in layers for kind in (0, 1)
                     for _, first_id, n in dest_runs]
        if pulled:
            payload = 0
        elif sealed:
            payload = PayloadCipher.sealed_bytes(runs * layout.block_bytes)
        else:
            payload = runs * layout.block_bytes
        if hdr.payload_bytes != payload or len(hdr.crc32c) != (0 if sealed else runs):
            raise ProtocolError(f"blocks frame of {hdr.payload_bytes} bytes and {len(hdr.crc32c)} checksums "
                                f"for {hdr.count} blocks x {hdr.num_layers} layers")
        if inc is None or bad or not inc.enter(conn):
            self._discard(conn, hdr.payload_bytes)
            if inc is not None and bad:
                inc.handle.fail(bad)
                self._maybe_complete(hdr.transfer_id, inc)
            return
        conn.transfers.add(hdr.transfer_id)
        try:
            inc.handle.advance(TransferState.TRANSFERRING)
            if pulled:
                self._pull(conn.peer_kv, layers, list(hdr.src_blocks), dest)
            elif sealed:
                conn.cipher.recv_sealed(conn.sock, views)
            else:
                recv_views(conn.sock, views)
        finally:
            inc.leave(conn)
        if sealed:  # the AEAD tags authenticated every byte
            self._land(inc, hdr, layers)
        elif hdr.payload_bytes <= INLINE_VERIFY_BYTES:
            self._verify(inc, hdr, layers, views, dest)
        else:
            conn.verify.put((inc, hdr, layers, views, dest))

    def _verify_loop(self, conn: _Conn) -> None:
        """Checksums landed frames off the receiving thread, so the next
        frame's bytes arrive while this one is summed."""
        for item in iter(conn.verify.get, None):
            self._verify(*item)

    def _verify(self, inc: _Incoming, hdr: pb.KVBlocks, layers: range, views: list[memoryview],
                dest: list[int]) -> None:
        crcs = _block_crcs(views, self.cache.layout.block_bytes)
        bad = [i for i, (a, b) in enumerate(zip(crcs, hdr.crc32c)) if a != b]
        if bad:
            bad_blocks = sorted({dest[i % hdr.count] for i in bad})
            inc.handle.fail(f"checksum mismatch in layers {layers.start}-{layers.stop - 1} of "
                            f"{len(bad_blocks)} block(s)", bad_blocks)
            self._maybe_complete(hdr.transfer_id, inc)
        else:
            self._land(inc, hdr, layers)

    def _land(self, inc: _Incoming, hdr: pb.KVBlocks, layers: range) -> None:
        with inc.cond:
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
        """Answers the sender's done once every block landed, or the transfer failed."""
        with inc.cond:
            if inc.done is None or inc.acked:
                return
            state = inc.handle.poll()
            if state is not TransferState.FAILED and len(inc.landed) < inc.need:
                return
            inc.acked = True
        if state is not TransferState.FAILED:
            inc.handle.complete(TransferResult(inc.done.first_token_id, inc.done.first_logprob, inc.nbytes,
                                               time.perf_counter() - inc.started))
            with self._lock:  # done: later frames for it are dropped unread
                if self._expected.get(tid) is inc:
                    del self._expected[tid]
        err = inc.handle.failure()
        inc.done_conn.send(pb.KVFrame(done_ack=pb.KVDoneAck(transfer_id=tid, ok=err is None,
                                                            reason=err.reason if err else "")))


# ------------------------------------------------------------------ sender
class _Stream:
    """One authenticated connection to a peer. A prepare thread merges
    queued layers into frames and checksums them while the writer thread
    sends the previous frame; a reader thread takes acknowledgements."""

    def __init__(self, pool: _PeerPool, index: int) -> None:
        self.pool = pool
        self.index = index
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.ready: queue.SimpleQueue = queue.SimpleQueue()
        self.queued = 0
        """Bytes queued on this stream and not sent yet."""
        self._qlock = threading.Lock()
        self.sock: socket.socket | None = None
        self.shared = False
        """The receiver copies from our shared-memory KV (local transport)."""
        self.cipher: PayloadCipher | None = None
        """When this connection encrypts."""
        self.inflight: set[str] = set()
        threading.Thread(target=self._prepare_loop, name=f"kv-prep-{index}", daemon=True).start()
        threading.Thread(target=self._write_loop, name=f"kv-send-{index}", daemon=True).start()

    def put(self, item: tuple | None, nbytes: int = 0) -> None:
        with self._qlock:
            self.queued += nbytes
        self.q.put(item)

    def _sent(self, nbytes: int) -> None:
        with self._qlock:
            self.queued -= nbytes

    def _connect(self) -> None:
        cfg = self.pool.cfg
        host, _, port = self.pool.endpoint.rpartition(":")
        sock = socket.create_connection((host, int(port)), timeout=cfg.connect_timeout_s)
        tune_socket(sock, cfg.socket_buffer_bytes)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, max(1, int(cfg.stall_timeout_s * 1e3)))
        self.shared, self.cipher = client_handshake(sock, cfg.secret, self.pool.layout_hash, self.pool.offer(),
                                                    cfg.encrypt, cfg.socket_buffer_bytes)
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

    def _prepare_loop(self) -> None:
        mem = self.pool.mem
        bb = mem.block_bytes
        for item in self._batches():
            if item is None:
                self.ready.put(None)
                return
            h = item[1]
            nbytes = item[5] * 2 * len(item[3]) * bb if item[0] == "blocks" else 0
            if not h.enter():
                self._sent(nbytes)
                continue
            views = crcs = None
            if item[0] == "blocks":
                _, _, layer, src, _, num_layers = item
                runs = coalesce(src)
                views = [mem.run(lyr, kind, b, n) for lyr in range(layer, layer + num_layers)
                         for kind in (0, 1) for _, b, n in runs]
                if not self.pool.cfg.encrypt:
                    crcs = _block_crcs(views, bb)
            self.ready.put((item, nbytes, views, crcs))

    def _write_loop(self) -> None:
        for prepared in iter(self.ready.get, None):
            item, nbytes, views, crcs = prepared
            h = item[1]
            try:
                if h.poll() is TransferState.FAILED:
                    continue
                self.inflight.add(h.transfer_id)
                if self.sock is None:
                    self._connect()
                if item[0] == "blocks":
                    self._send_blocks(h, item, views, crcs, nbytes)
                else:
                    _, _, token, logprob = item
                    send_frame(self.sock, pb.KVFrame(done=pb.KVDone(
                        transfer_id=h.transfer_id, first_token_id=token, first_logprob=logprob)))
            except ProtocolError as exc:
                self._broken(f"handshake with {self.pool.endpoint} failed: {exc}")
            except OSError as exc:
                self._broken(f"connection to {self.pool.endpoint} failed: {exc}")
            except Exception as exc:  # a bug: fail these transfers now rather than leave them to their leases
                log.exception("KV send thread for %s failed", self.pool.endpoint)
                self._broken(f"sender error: {exc!r}")
            finally:
                h.leave()
                self._sent(nbytes)
        self._broken("sender closed")

    def _send_blocks(self, h: _TcpSendHandle, item: tuple, views: list[memoryview], crcs: list[int] | None,
                     nbytes: int) -> None:
        _, _, layer, src, first, num_layers = item
        cipher = None if self.shared else self.cipher
        if cipher is not None:
            crcs, wire_bytes = [], PayloadCipher.sealed_bytes(nbytes)
        else:
            if crcs is None:  # encryption was configured, but the receiver pulls
                crcs = _block_crcs(views, self.pool.mem.block_bytes)
            wire_bytes = 0 if self.shared else nbytes
            if h.corrupt:  # fault injection: what arrives no longer matches its checksums
                h.corrupt = False
                if self.shared:
                    crcs = [crcs[0] ^ 1, *crcs[1:]]
                else:
                    flipped = bytearray(views[0])
                    flipped[0] ^= 0xFF
                    views = [memoryview(flipped), *views[1:]]
        send_frame(self.sock, pb.KVFrame(blocks=pb.KVBlocks(
            transfer_id=h.transfer_id, layer=layer, num_layers=num_layers, first=first, count=len(src),
            payload_bytes=wire_bytes, crc32c=crcs, src_blocks=src if self.shared else [])))
        if cipher is not None:
            cipher.send_sealed(self.sock, views)
        elif not self.shared:
            send_views(self.sock, views)
        h.add_bytes(nbytes)

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

    def pick(self, previous: _Stream | None) -> _Stream:
        """The stream for a transfer's next layer (see STICKY_BYTES)."""
        if previous is not None and previous.queued < STICKY_BYTES:
            return previous
        return min(self.streams, key=lambda s: s.queued)

    def close(self) -> None:
        for s in self.streams:
            s.put(None)


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
        self._stream: _Stream | None = None
        self.corrupt = False
        """Fault injection: flip a byte of this transfer's first frame."""
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
        self._stream = self.pool.pick(self._stream)
        self._stream.put(("blocks", self, layer, list(src_blocks), first),
                         2 * len(src_blocks) * self.pool.mem.block_bytes)

    def finish(self, first_token_id: int, first_logprob: float) -> None:
        self.first_token, self.first_logprob = first_token_id, first_logprob
        (self._stream or self.pool.streams[0]).put(("done", self, first_token_id, first_logprob))


class TcpKVSender(KVSender):
    name = "tcp"
    nixl = None
    """A NixlAgent when receivers should READ our KV over NIXL."""

    def __init__(self, cache: KVCache, cfg: TcpConfig | None = None) -> None:
        self.cache = cache
        self.cfg = cfg or TcpConfig()
        self._pools: dict[str, _PeerPool] = {}
        self._lock = threading.Lock()
        self._corrupt_left = self.cfg.corrupt_first

    def open(self, target: TransferTarget) -> SendHandle:
        """Starts a transfer. Connections are pooled per receiver and per link
        setting (socket buffers, encryption, pulling)."""
        cfg = self.cfg
        if target.socket_buffer_bytes is not None or target.encrypt is not None or target.pull is False:
            cfg = dataclasses.replace(
                cfg, socket_buffer_bytes=target.socket_buffer_bytes or cfg.socket_buffer_bytes,
                encrypt=cfg.encrypt if target.encrypt is None else target.encrypt,
                shared_memory=cfg.shared_memory and target.pull is not False)
        key = (target.endpoint, cfg.socket_buffer_bytes, cfg.encrypt, cfg.shared_memory)
        with self._lock:
            pool = self._pools.get(key)
            if pool is None:
                pool = self._pools[key] = _PeerPool(target.endpoint, self.cache, cfg, self.nixl)
        h = _TcpSendHandle(pool, target)
        with self._lock:
            if self._corrupt_left > 0:
                self._corrupt_left -= 1
                h.corrupt = True
                log.warning("fault injection: corrupting transfer %s", target.transfer_id)
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
