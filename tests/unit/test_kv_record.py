"""The record layer and key schedule of the KV transport on a socket pair,
for both ciphers and both protections: what is sealed opens exactly; a
flipped bit, a replay, the other direction's key or another handshake's key
do not; piece boundaries are the same at both ends whatever their runs."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from kvrelay.kvtransfer.protection import (
    Cipher,
    KeyShare,
    Protection,
    choose_cipher,
    transcript_1,
)
from kvrelay.kvtransfer.record import (
    ALIGN,
    FIRST_PIECE,
    PIECE,
    RecordError,
    RecordReader,
    RecordWriter,
    piece_sizes,
)
from kvrelay.v1 import kv_wire_pb2 as pb


def _pair(cipher: Cipher, protection: Protection, key: bytes, rkey: bytes | None = None):
    a, b = socket.socketpair()
    return RecordWriter(a, cipher, key, protection), RecordReader(b, cipher, rkey or key, protection), a, b


def _views(data: bytearray, cuts: list[int]) -> list[memoryview]:
    mv, out, prev = memoryview(data), [], 0
    for c in [*cuts, len(data)]:
        out.append(mv[prev:c])
        prev = c
    return out


@pytest.mark.parametrize("protection", list(Protection))
@pytest.mark.parametrize("cipher", list(Cipher))
@pytest.mark.parametrize("size, section", [(1, 0), (700 << 10, 12 << 10), (3 * PIECE + 5, 0), (5 << 20, 1 << 20)])
def test_sealed_payloads_open_exactly_whatever_the_runs(cipher, protection, size, section):
    key = os.urandom(32)
    w, r, a, b = _pair(cipher, protection, key)
    src = bytearray(os.urandom(size))
    dst = bytearray(size)
    sender = threading.Thread(target=w.send, args=(pb.KVFrame(done=pb.KVDone(transfer_id="t", first_token_id=3)),
                                                   _views(src, [size // 3]), False, section))
    sender.start()
    frame, plen = r.recv()
    assert frame.done.first_token_id == 3 and plen == size
    r.recv_payload(_views(dst, [size // 7, size // 2]), section)  # other runs than the sender's
    sender.join()
    assert dst == src
    a.close()
    b.close()


@pytest.mark.parametrize("protection", list(Protection))
def test_a_flipped_bit_a_replay_and_a_wrong_key_fail(protection):
    key = os.urandom(32)
    frame = pb.KVFrame(done=pb.KVDone(transfer_id="t", first_token_id=9))
    sealer = RecordWriter(None, Cipher.AES_256_GCM, key, protection)
    first, second = sealer.seal(frame)[1], sealer.seal(frame)[1]
    cases = [(bytes([first[0]]) + first[1:30] + bytes([first[30] ^ 1]) + first[31:], "failed authentication"),
             (first + first, "replayed"),
             (second, "out of order")]
    for wire, reason in cases:
        a, b = socket.socketpair()
        r = RecordReader(b, Cipher.AES_256_GCM, key, protection)
        a.sendall(wire)
        with pytest.raises(RecordError, match=reason):
            r.recv()
            r.recv()
        a.close()
        b.close()
    a, b = socket.socketpair()
    a.sendall(first)
    with pytest.raises(RecordError, match="failed authentication"):
        RecordReader(b, Cipher.AES_256_GCM, os.urandom(32), protection).recv()  # another connection's key


def test_integrity_leaves_the_header_readable_and_aead_does_not():
    key = os.urandom(32)
    frame = pb.KVFrame(done=pb.KVDone(transfer_id="secret-transfer-id"))
    assert b"secret-transfer-id" in RecordWriter(None, Cipher.AES_256_GCM, key, Protection.INTEGRITY).seal(frame)[1]
    assert b"secret-transfer-id" not in RecordWriter(None, Cipher.AES_256_GCM, key, Protection.AEAD).seal(frame)[1]


def test_key_schedule_separates_directions_connections_and_secrets():
    s, r = KeyShare(), KeyShare()
    th = transcript_1(b"hello", b"answer")
    ks, kr = s.keys(r.public, b"x" * 32, th), r.keys(s.public, b"x" * 32, th)
    assert ks == kr  # both ends derive the same keys
    assert len({ks.to_receiver, ks.to_sender, ks.receiver_mac, ks.sender_mac}) == 4
    assert s.keys(r.public, b"y" * 32, th) != ks  # the secret is in them
    assert s.keys(r.public, b"x" * 32, transcript_1(b"hello", b"other")) != ks  # and the whole transcript
    assert KeyShare().keys(r.public, b"x" * 32, th) != ks  # and a fresh share per connection
    with pytest.raises(ValueError):
        s.keys(b"short", b"", th)


def test_piece_schedule_and_cipher_choice():
    assert list(piece_sizes(2 * PIECE)) == [FIRST_PIECE, 2 * FIRST_PIECE, 4 * FIRST_PIECE, 8 * FIRST_PIECE,
                                             PIECE, PIECE - 15 * FIRST_PIECE]
    assert list(piece_sizes(3 * PIECE + 5)) == [PIECE, PIECE, PIECE, 5]  # large payloads start whole
    # sections of at least ALIGN are never crossed, so each piece lies in one run at both ends
    sizes, section = list(piece_sizes(6 * ALIGN, ALIGN + 1000)), ALIGN + 1000
    ends, pos = set(), 0
    for k in sizes:
        assert pos // section == (pos + k - 1) // section
        pos += k
        ends.add(pos)
    assert sum(sizes) == 6 * ALIGN
    assert choose_cipher(["chacha20-poly1305"]) is Cipher.CHACHA20_POLY1305
    assert choose_cipher(["rot13"]) is None
