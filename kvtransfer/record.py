"""Records: every frame after the handshake, sealed under the connection's
keys (the layout is in proto/kvrelay/v1/kv_wire.proto).

A record is a 24-byte prefix (header bytes, payload bytes, sequence
number, section bytes), the sealed header (a KVFrame), then the payload, if
any, in consecutive pieces (:func:`piece_sizes`: growing from 64 KiB to
:data:`PIECE`, cut at section boundaries), each followed by its tag.
The prefix is the header's associated data; nonces are (sequence, piece),
so every byte is bound to its place in this connection's stream. With
``aead`` a piece is encrypted from the KV memory it lies in and decrypted
straight into the reserved blocks; with ``integrity`` it crosses as it is
and its tag is a MAC (the AEAD over no plaintext, the piece as associated
data). A piece that spans runs of blocks is staged."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator, Sequence

from cryptography.exceptions import InvalidTag

from kvrelay.kvtransfer.protection import Cipher, Protection
from kvrelay.kvtransfer.wire import ProtocolError, decode_frame, recv_exact_into
from kvrelay.v1 import kv_wire_pb2 as pb

PREFIX = struct.Struct("<IQQI")
"""Sealed header bytes, payload bytes, sequence number, section bytes."""
TAG = 16
PIECE = 1 << 20
"""Most plaintext bytes per sealed piece of a payload."""
FIRST_PIECE = 64 << 10
"""The first piece of a payload of at most 2 PIECE; each next one doubles,
up to PIECE. Small first pieces let the receiver open one while the sender
seals the next (a one-block transfer is 720 KiB); larger payloads start at
PIECE (their frames pipeline with each other), keeping cipher calls few."""
ALIGN = 256 << 10
"""Sections (the K or V of one layer of a frame's blocks: the same size at
both ends) at least this large are cut on their own boundaries, so a piece
lies in one run of blocks at each end and is sealed and opened in place."""
MAX_HEADER = 1 << 20
"""Largest header a record may announce (an authenticated peer's, so it
bounds what an on-path attacker can make us allocate)."""
MAX_PAYLOAD = 1 << 40
PULLED = 1 << 31
"""Piece numbers from here up name the tags of pulled runs (kvtransfer/memory.py
``paired_runs``), so their nonces never meet a payload piece's."""


class RecordError(ProtocolError):
    """A record was altered, replayed, reordered, dropped or foreign."""

    def __init__(self, message: str, transfer_id: str = "") -> None:
        super().__init__(message)
        self.transfer_id = transfer_id
        """The transfer a genuine but misplaced (replayed, reordered) frame names; "" when unknown."""


def piece_sizes(total: int, section: int = 0) -> Iterator[int]:
    """The plaintext size of each piece of a ``total``-byte payload made of
    sections of ``section`` bytes (both ends cut the byte stream the same
    way, whatever their runs of blocks)."""
    size, aligned = FIRST_PIECE if total <= 2 * PIECE else PIECE, section >= ALIGN
    left = section
    while total > 0:
        k = min(size, total, left) if aligned else min(size, total)
        yield k
        total -= k
        left = left - k or section
        size = min(PIECE, size * 2)


def sealed_bytes(plain_bytes: int, section: int = 0) -> int:
    """Wire bytes of a payload of ``plain_bytes``."""
    return plain_bytes + TAG * sum(1 for _ in piece_sizes(plain_bytes, section))


def _nonce(seq: int, piece: int) -> bytes:
    return seq.to_bytes(8, "big") + piece.to_bytes(4, "big")


def pieces(views: list[memoryview], section: int = 0) -> Iterator[list[memoryview]]:
    """Each piece of a payload (:func:`piece_sizes`) as the slices of ``views`` it covers."""
    sizes = piece_sizes(sum(len(v) for v in views), section)
    segs, room = [], next(sizes, 0)
    for v in views:
        off = 0
        while off < len(v):
            k = min(room, len(v) - off)
            segs.append(v[off:off + k])
            off += k
            room -= k
            if not room:
                yield segs
                segs, room = [], next(sizes, 0)


def sendmsg_all(sock: socket.socket, views: list[memoryview]) -> None:
    """Sends a few buffers with vectored writes until all went."""
    while views:
        n = sock.sendmsg(views)
        while n and views:
            if n >= len(views[0]):
                n -= len(views[0])
                views = views[1:]
            else:
                views[0] = views[0][n:]
                n = 0


class _Direction:
    """One direction of one connection: its AEAD, protection, next sequence number."""

    def __init__(self, cipher: Cipher, key: bytes, protection: Protection) -> None:
        self.aead = cipher.aead(key)
        self.encrypt = protection is Protection.AEAD
        self.seq = 0
        self.sealed = memoryview(bytearray(PIECE + TAG))
        self.plain = memoryview(bytearray(PIECE))

    def pulled_tags(self, seq: int, views: list[memoryview]) -> list[bytes]:
        """The tag (a MAC under this direction's key) of each view of blocks
        that the receiver pulls for record ``seq``."""
        return [self.aead.encrypt(_nonce(seq, PULLED | j), b"", v) for j, v in enumerate(views)]

    def stage(self, segs: list[memoryview]) -> memoryview:
        """One contiguous piece: the only slice, or the slices copied together."""
        if len(segs) == 1:
            return segs[0]
        pos = 0
        for seg in segs:
            self.plain[pos:pos + len(seg)] = seg
            pos += len(seg)
        return self.plain[:pos]


class RecordWriter(_Direction):
    """Seals and sends records; one thread at a time (the caller's lock)."""

    def __init__(self, sock: socket.socket | None, cipher: Cipher, key: bytes, protection: Protection) -> None:
        """``sock`` None: a writer that only seals (:meth:`seal`)."""
        super().__init__(cipher, key, protection)
        self.sock = sock

    def tag_pulled(self, views: list[memoryview]) -> bytes:
        """Tags of the blocks the next record lets the receiver pull, concatenated."""
        return b"".join(self.pulled_tags(self.seq, views))

    def seal(self, frame: pb.KVFrame, payload_bytes: int = 0, section: int = 0) -> tuple[int, bytes]:
        """The next record's sequence number and its prefix and sealed header."""
        header = frame.SerializeToString()
        seq, self.seq = self.seq, self.seq + 1
        prefix = PREFIX.pack(len(header) + TAG, payload_bytes, seq, section)
        if self.encrypt:
            return seq, prefix + self.aead.encrypt(_nonce(seq, 0), header, prefix)
        return seq, prefix + header + self.aead.encrypt(_nonce(seq, 0), b"", prefix + header)

    def send(self, frame: pb.KVFrame, views: Sequence[memoryview] = (), tamper: bool = False, section: int = 0
             ) -> None:
        """Sends ``frame`` and the payload ``views`` (read in place: KV memory)
        in sections of ``section`` bytes. ``tamper`` (fault injection) flips
        one sealed payload byte, as an on-path attacker would."""
        sock = self.sock
        if sock is None:
            raise RuntimeError("this writer has no socket: it only seals")
        views = [v for v in views if len(v)]
        seq, head = self.seal(frame, sum(len(v) for v in views), section)
        sock.sendall(head)
        for i, segs in enumerate(pieces(views, section), 1):
            plain = self.stage(segs)
            n = len(plain)
            if self.encrypt:
                self.aead.encrypt_into(_nonce(seq, i), plain, None, self.sealed[:n + TAG])
                if tamper and i == 1:
                    self.sealed[0] ^= 0xFF
                sock.sendall(self.sealed[:n + TAG])
            else:
                tag = bytearray(self.aead.encrypt(_nonce(seq, i), b"", plain))
                if tamper and i == 1:
                    tag[0] ^= 0xFF
                sendmsg_all(sock, [plain, memoryview(tag)])


class RecordReader(_Direction):
    """Receives and opens records; one thread (the connection's)."""

    def __init__(self, sock: socket.socket, cipher: Cipher, key: bytes, protection: Protection) -> None:
        super().__init__(cipher, key, protection)
        self.sock = sock
        self._payload: tuple[int, int, int] | None = None
        """(sequence, bytes, section bytes) of the payload that follows the last header."""
        self._prefix = memoryview(bytearray(PREFIX.size))
        self.last_seq = -1
        """Sequence number of the last record opened."""

    def recv(self) -> tuple[pb.KVFrame, int]:
        """The next frame and the payload bytes that follow it (read them with
        :meth:`recv_payload` or :meth:`skip_payload` before the next frame).
        RecordError naming what is wrong with a record that does not open."""
        if self._payload is not None:
            raise ProtocolError("the previous record's payload was not read")
        try:
            recv_exact_into(self.sock, self._prefix)
        except ConnectionError:
            raise ConnectionError("connection closed (truncated: no more records)") from None
        hlen, plen, seq, section = PREFIX.unpack(self._prefix)
        if not TAG <= hlen <= MAX_HEADER + TAG or plen > MAX_PAYLOAD:
            raise RecordError(f"record announces a {hlen}-byte header and {plen}-byte payload "
                              "(altered in flight)")
        body = bytearray(hlen)
        self._recv(memoryview(body), "mid-record")
        prefix = bytes(self._prefix)
        try:
            if self.encrypt:
                header = self.aead.decrypt(_nonce(seq, 0), bytes(body), prefix)
            else:
                header = bytes(body[:-TAG])
                self.aead.decrypt(_nonce(seq, 0), bytes(body[-TAG:]), prefix + header)
        except InvalidTag:
            raise RecordError(f"KV frame header failed authentication (record {seq}: altered in flight, "
                              "or not from this connection)") from None
        frame = decode_frame(header)
        if seq != self.seq:
            body = frame.WhichOneof("body")
            tid = getattr(frame, body).transfer_id if body in ("blocks", "done") else ""
            if seq < self.seq:
                raise RecordError(f"replayed KV frame (record {seq} again; {self.seq} expected)", tid)
            raise RecordError(f"KV frame out of order: record {seq} arrived where {self.seq} was expected "
                              "(a frame was dropped or reordered in flight)", tid)
        self.seq += 1
        self.last_seq = seq
        if plen:
            self._payload = (seq, plen, section)
        return frame, plen

    def _recv(self, view: memoryview, where: str) -> None:
        try:
            recv_exact_into(self.sock, view)
        except ConnectionError:
            raise ConnectionError(f"connection closed {where} (truncated in flight)") from None

    def recv_payload(self, views: list[memoryview], section: int) -> None:
        """Opens the pending payload into ``views`` (exactly its size, in
        sections of ``section`` bytes). RecordError when a piece fails (its
        bytes may already be in ``views``: the caller fails the transfer that
        owns them and uses none of it)."""
        seq, plen, sent_section = self._take_payload()
        if sum(len(v) for v in views) != plen or sent_section != section:
            raise ProtocolError(f"payload of {plen} bytes in sections of {sent_section} for "
                                f"{sum(len(v) for v in views)} bytes of blocks in sections of {section}")
        for i, segs in enumerate(pieces([v for v in views if len(v)], section), 1):
            n = sum(len(s) for s in segs)
            if self.encrypt:
                self._recv(self.sealed[:n + TAG], "mid-payload")
                out = segs[0] if len(segs) == 1 else self.plain[:n]
                self._open(seq, i, lambda o=out: self.aead.decrypt_into(_nonce(seq, i), self.sealed[:n + TAG],  # noqa: B023 (called before the loop moves on)
                                                                        None, o))
            else:
                out = segs[0] if len(segs) == 1 else self.plain[:n]
                self._recv(out, "mid-payload")
                self._recv(self.sealed[:TAG], "mid-payload")
                self._open(seq, i, lambda o=out: self.aead.decrypt(_nonce(seq, i), bytes(self.sealed[:TAG]), o))  # noqa: B023 (called before the loop moves on)
            if len(segs) > 1:
                pos = 0
                for s in segs:
                    s[:] = self.plain[pos:pos + len(s)]
                    pos += len(s)

    def _open(self, seq: int, piece: int, check) -> None:
        try:
            check()
        except InvalidTag:
            raise RecordError(f"KV payload failed authentication (record {seq}, piece {piece}: "
                              "altered in flight)") from None

    def bad_pulled(self, seq: int, views: list[memoryview], tags: bytes) -> list[int]:
        """Indices of ``views`` (pulled for record ``seq``) whose tag in ``tags`` does not match."""
        if len(tags) != TAG * len(views):
            return list(range(len(views)))
        return [j for j, (want, v) in enumerate(zip(self._tags(tags), views))
                if not self._verifies(seq, j, want, v)]

    @staticmethod
    def _tags(tags: bytes) -> list[bytes]:
        return [tags[i:i + TAG] for i in range(0, len(tags), TAG)]

    def _verifies(self, seq: int, j: int, tag: bytes, view: memoryview) -> bool:
        try:
            self.aead.decrypt(_nonce(seq, PULLED | j), tag, view)
            return True
        except InvalidTag:
            return False

    def skip_payload(self) -> None:
        """Reads the pending payload (if any) into scratch memory, still
        checking every tag, and drops it."""
        if self._payload is None:
            return
        seq, plen, section = self._payload
        views = [self.plain[:k] for k in piece_sizes(plen, section)]
        self._payload = None
        for i, view in enumerate(views, 1):
            n = len(view)
            self._recv(self.sealed[:n + TAG], "mid-payload")
            sealed = self.sealed[:n + TAG]
            if self.encrypt:
                self._open(seq, i, lambda: self.aead.decrypt_into(_nonce(seq, i), sealed, None, view))  # noqa: B023 (called before the loop moves on)
            else:
                self._open(seq, i, lambda: self.aead.decrypt(_nonce(seq, i), bytes(sealed[n:]), sealed[:n]))  # noqa: B023 (called before the loop moves on)

    def _take_payload(self) -> tuple[int, int, int]:
        if self._payload is None:
            raise ProtocolError("no payload follows the last record")
        p, self._payload = self._payload, None
        return p
