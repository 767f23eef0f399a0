"""The limit a protected KV transfer is measured against: raw sockets that do
the same cipher work as kvrelay's record layer and nothing else (the same
AEAD, the same 1 MiB pieces sealed with ``encrypt_into`` straight from the
source buffer and opened with ``decrypt_into`` straight into the
destination; under ``integrity`` the same tag over each piece, sent beside
it). Both ends share one fixed key: this is a measurement, not a protocol.

Sender side here (:func:`push`); the receiving process is this module,
``python -m kvrelay.benchmarks.kv_limit NBYTES STREAMS ROUNDS [MODE] [host=ADDR]``:
it accepts STREAMS connections, then for each of ROUNDS receives on each its
share of NBYTES as MODE sends it and answers one byte; it prints "ENDPOINT
host:port" first. It imports neither torch nor the engine, so it starts in a
tenth of the time benchmarks/kv_peer.py takes."""

from __future__ import annotations

import socket
import sys
import threading

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


def raw_receiver(host: str, nbytes: int, streams: int, rounds: int, mode: str = PLAIN) -> None:
    """The receiving end of :func:`push` (see the module's docstring)."""
    srv = socket.create_server((host, 0), backlog=64)
    print("ENDPOINT", f"{host}:{srv.getsockname()[1]}", flush=True)
    buf = memoryview(bytearray(nbytes))
    share = nbytes // streams
    conns = [srv.accept()[0] for _ in range(streams)]  # warm connections, as ours are
    for c in conns:
        c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def serve(i: int, c: socket.socket) -> None:
        end = nbytes if i == streams - 1 else (i + 1) * share
        for _ in range(rounds):
            pull(c, buf[i * share:end], mode, i)
            c.sendall(b"k")

    ts = [threading.Thread(target=serve, args=(i, c)) for i, c in enumerate(conns)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for c in conns:
        c.close()


def main(argv: list[str]) -> None:
    hosts = [a.split("=", 1)[1] for a in argv if a.startswith("host=")]
    args = [a for a in argv if not a.startswith("host=")]
    raw_receiver(hosts[-1] if hosts else "127.0.0.1", int(args[0]), int(args[1]), int(args[2]), *args[3:4])


if __name__ == "__main__":
    main(sys.argv[1:])
