"""A tap for KV-transport tests: forwards one connection unchanged and
records every byte the sender sent (what an eavesdropper on the link sees)."""

from __future__ import annotations

import socket
import threading


def pump(a: socket.socket, b: socket.socket) -> None:
    """Copies ``a`` to ``b`` until ``a`` closes; then closes ``b``."""
    try:
        while data := a.recv(65536):
            b.sendall(data)
    except OSError:
        pass
    b.close()


class Tap:
    """Listens on loopback; the first connection is forwarded to ``target``."""

    def __init__(self, target: str) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target, self.seen = target, bytearray()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        client, _ = self.listener.accept()
        host, port = self.target.rsplit(":", 1)
        server = socket.create_connection((host, int(port)))
        threading.Thread(target=pump, args=(server, client), daemon=True).start()
        try:
            while data := client.recv(65536):
                self.seen += data
                server.sendall(data)
        except OSError:
            pass
        server.close()


class CuttableLink:
    """A link between a KV sender and a receiver that can be cut and restored,
    as TCP sees a WAN link come back: connections opened before the cut stay
    dead after the restore (what a connection deep in its retransmission
    backoff, or one whose state a middlebox lost, is for its sender: its
    bytes stop being taken), new ones pass. Listens on loopback and forwards
    each connection to ``target``. Its side of each connection keeps a fixed
    receive buffer of ``RCVBUF`` bytes (as a WAN path's window bounds what is
    in flight): with the kernel's autotuning a cut link could swallow up to
    ``net.ipv4.tcp_rmem``'s maximum (32 MiB on some hosts) before the sender
    blocks."""

    RCVBUF = 1 << 18

    def __init__(self, target: str) -> None:
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.RCVBUF)  # accepted ones inherit it
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.endpoint = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.target = target
        self.connections = 0
        self._generation = 0
        """Bumped by each cut: a connection of an older generation no longer forwards."""
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._generation += 1

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            host, port = self.target.rsplit(":", 1)
            server = socket.create_connection((host, int(port)))
            born = self._generation
            for a, b in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(a, b, born), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket, born: int) -> None:
        """Copies ``a`` to ``b`` while no cut came after the connection opened;
        after one it stops reading (the sender's buffers fill, its sends block)."""
        try:
            while self._generation == born and (data := a.recv(65536)):
                b.sendall(data)
            while self._generation != born and not self._closed.wait(0.1):
                pass  # dead, not closed: a cut link says nothing
        except OSError:
            pass
        b.close()

    def close(self) -> None:
        self._closed.set()
        self.listener.close()
