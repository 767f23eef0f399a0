"""Which addresses stay on this machine: the rule behind every "loopback
only" in the config (plaintext, anonymous access, /metrics) and the dialer's
plaintext check; and a free port to start a server on. Its own module so that the client commands can ask it
without loading the config's validation."""

from __future__ import annotations

import ipaddress
import socket


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (127.0.0.0/8, ::1) or ``localhost``;
    a name such as ``127.example.net`` is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on at ``host`` now (the kernel's pick; a process started next binds it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
