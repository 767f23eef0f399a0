"""The limit a protected KV transfer is measured against: raw sockets that do
the same cipher work as kvrelay's record layer and nothing else (the same
AEAD, the same 1 MiB pieces sealed with ``encrypt_into`` straight from the
source buffer and opened with ``decrypt_into`` straight into the
destination; under ``integrity`` the same tag over each piece, sent beside
it). Both ends share one fixed key: this is a measurement, not a protocol.

Sender side here (:func:`push`); the receiving process is
``python -m kvrelay.benchmarks.kv_peer raw-receiver NBYTES STREAMS ROUNDS MODE``."""

from __future__ import annotations

import socket

from kvrelay.kvtransfer.protection import Protection, preferred_ciphers
from kvrelay.kvtransfer.record import PIECE, TAG, sendmsg_all
from kvrelay.kvtransfer.wire import recv_exact_into

PLAIN = "plain"
"""Mode of the plain raw socket (no cipher work)."""
KEY = bytes(range(32))


def _aead():
    return preferred_ciphers()[0].aead(KEY)


def _nonce(stream: int, piece: int) -> bytes:
    return stream.to_bytes(4, "big") + piece.to_bytes(8, "big")


def push(sock: socket.socket, view: memoryview, mode: str, stream: int) -> None:
    """Sends ``view`` as ``mode`` does (plain, aead or integrity)."""
    if mode == PLAIN:
        sock.sendall(view)
        return
    aead, sealed = _aead(), memoryview(bytearray(PIECE + TAG))
    for i, off in enumerate(range(0, len(view), PIECE)):
        piece = view[off:off + PIECE]
        if mode == Protection.AEAD:
            n = aead.encrypt_into(_nonce(stream, i), piece, None, sealed[:len(piece) + TAG])
            sock.sendall(sealed[:n])
        else:
            tag = aead.encrypt(_nonce(stream, i), b"", piece)
            sendmsg_all(sock, [piece, memoryview(tag)])


def pull(sock: socket.socket, view: memoryview, mode: str, stream: int) -> None:
    """Receives into ``view`` what :func:`push` sent, checking every tag."""
    if mode == PLAIN:
        recv_exact_into(sock, view)
        return
    aead, sealed = _aead(), memoryview(bytearray(PIECE + TAG))
    for i, off in enumerate(range(0, len(view), PIECE)):
        piece = view[off:off + PIECE]
        n = len(piece)
        if mode == Protection.AEAD:
            recv_exact_into(sock, sealed[:n + TAG])
            aead.decrypt_into(_nonce(stream, i), sealed[:n + TAG], None, piece)
        else:
            recv_exact_into(sock, piece)
            recv_exact_into(sock, sealed[:TAG])
            aead.decrypt(_nonce(stream, i), bytes(sealed[:TAG]), piece)
