"""Settings of a KV sender or receiver, whatever its transport (tcp, nixl, local)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.kvtransfer.base import Credentials, KVCodec
from kvrelay.kvtransfer.protection import Protection


@dataclass(slots=True)
class TransferConfig:
    """One worker's KV transfer settings; every transport reads the same ones."""

    secret: bytes = b""
    """Deployment secret both ends prove they hold (mixed into every connection's keys)."""
    credentials: Credentials | None = None
    """This end's certificate, and what it accepts of peers' (None: secret only, tls off)."""
    streams: int = 4
    """Parallel connections per peer."""
    socket_buffer_bytes: int | None = None
    """SO_SNDBUF/SO_RCVBUF; size it to the link's bandwidth-delay product
    (None or 0: the kernel autotunes)."""
    connect_timeout_s: float = 5.0
    """Deadline for connecting and for the handshake."""
    protection: Protection = Protection.AEAD
    """Sender: what it asks on links whose target names none. Receiver: what
    it requires of every sender when ``required_protection`` is None."""
    required_protection: Callable[[str | None], Protection] | None = None
    """Receiver: the protection the link from a sender's site requires (the
    site its certificate names; None without certificates)."""
    offer_memory: bool = False
    """Sender: offer receivers to pull from this sender's KV memory (its NIXL
    registration, or its KV cache's shared-memory file on the same host), so
    only frame headers cross the socket. The nixl and local senders always
    offer; a tcp sender does when this is set and its cache has an shm_path."""
    codec: KVCodec = KVCodec.NONE
    """Sender: the KV codec of its blocks frames on links whose target names none
    (kvtransfer/coded.py); a coded connection never offers memory to pull."""
    stall_timeout_s: float = 30.0
    """Sender: the kernel drops a connection whose sent bytes stay unacknowledged
    this long (TCP_USER_TIMEOUT: a frozen receiver, a link that went down), so
    its transfers fail and a new connection replaces it, instead of blocking."""
    max_pending_handshakes: int = 4096
    """Receiver: connections in their handshake at once (each holds a file
    descriptor until it authenticates or its deadline passes); more are closed
    on accept. A worker sizes it to its file-descriptor budget (runtime/fds.py)."""
    max_pending_per_source: int = 64
    """Receiver: of those, at most this many from one address."""
    corrupt_first: int = 0
    """Fault injection: the first N transfers of a sender carry one flipped
    sealed byte (as an on-path attacker would flip) or pulled-run MAC the
    receiver must catch."""

    def required(self, site: str | None) -> Protection:
        """Receiver: the protection a sender from ``site`` must use."""
        return self.protection if self.required_protection is None else self.required_protection(site)

    def check_authenticating(self) -> None:
        """ValueError when neither a secret nor credentials could authenticate a peer."""
        if not self.secret and self.credentials is None:
            raise ValueError("KV transfer needs a deployment secret or certificates to authenticate peers")

    def __post_init__(self) -> None:
        self.protection = Protection.parse(self.protection)
        self.codec = KVCodec.parse(self.codec)
        if not isinstance(self.secret, bytes):
            raise ValueError(f"secret must be bytes, got {type(self.secret).__name__}")
        if not 1 <= self.streams <= 64:
            raise ValueError(f"streams must be in [1, 64], got {self.streams}")
        if self.socket_buffer_bytes is not None and self.socket_buffer_bytes < 0:
            raise ValueError(f"socket_buffer_bytes must be >= 0 or None, got {self.socket_buffer_bytes}")
        if not self.connect_timeout_s > 0:
            raise ValueError(f"connect_timeout_s must be > 0, got {self.connect_timeout_s}")
        if not self.stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {self.stall_timeout_s}")
        if not 1 <= self.max_pending_per_source <= self.max_pending_handshakes:
            raise ValueError(f"need 1 <= max_pending_per_source ({self.max_pending_per_source}) <= "
                             f"max_pending_handshakes ({self.max_pending_handshakes})")
        if self.corrupt_first < 0:
            raise ValueError(f"corrupt_first must be >= 0, got {self.corrupt_first}")
