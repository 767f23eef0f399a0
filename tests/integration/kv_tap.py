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
