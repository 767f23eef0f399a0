"""Settings of a KV sender or receiver, whatever its transport (tcp, nixl, local)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class TransferConfig:
    """One worker's KV transfer settings; every transport reads the same ones."""

    secret: bytes = b""
    """Deployment secret both ends prove they hold (HMAC challenge-response)."""
    streams: int = 4
    """Parallel connections per peer."""
    socket_buffer_bytes: int | None = None
    """SO_SNDBUF/SO_RCVBUF; size it to the link's bandwidth-delay product
    (None or 0: the kernel autotunes)."""
    connect_timeout_s: float = 5.0
    """Deadline for connecting and for the handshake."""
    encrypt: bool = False
    """Sender: encrypt KV payloads (AES-256-GCM) on links that leave a site.
    Receiver: refuse senders that do not."""
    offer_memory: bool = False
    """Sender: offer receivers to pull from this sender's KV memory (its NIXL
    registration, or its KV cache's shared-memory file on the same host), so
    only frame headers cross the socket. The nixl and local senders always
    offer; a tcp sender does when this is set and its cache has an shm_path."""
    stall_timeout_s: float = 30.0
    """Sender: the kernel drops a connection whose sent bytes stay unacknowledged
    this long (TCP_USER_TIMEOUT: a frozen receiver, a link that went down), so
    its transfers fail and a new connection replaces it, instead of blocking."""
    corrupt_first: int = 0
    """Fault injection: the first N transfers of a sender carry one flipped
    byte (plaintext payloads) or checksum (shared memory) the receiver must catch."""

    def __post_init__(self) -> None:
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
        if self.corrupt_first < 0:
            raise ValueError(f"corrupt_first must be >= 0, got {self.corrupt_first}")
