"""The KV transport interface: receivers expect KV into reserved blocks,
senders push a request's blocks layer by layer; both sides report an
ordered transfer state and failures as data. Interfaces and data only: the
handle implementation and ``wait_async`` are in kvtransfer/handles.py.

Call order, sender side (prefill worker)::

    handle = sender.open(target)             # CONNECTING -> WAITING
    handle.send_layer(layer, src_blocks)      # any number of times, any thread,
                                              # never blocks (TRANSFERRING)
    handle.finish(first_token, logprob)       # after the last layer
    handle.wait(timeout) / await wait_async(handle, timeout)  # DONE or FAILED

Receiver side (decode worker)::

    handle = receiver.expect(transfer_id, block_ids)   # WAITING
    ... the sender writes into those blocks ...
    await wait_async(handle, lease)                     # DONE (result) or FAILED
    receiver.cancel(transfer_id)                        # always, when done with it
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, Protocol

from kvrelay.kvtransfer.errors import KVTransferError
from kvrelay.v1 import kv_wire_pb2 as pb

TransferId = str
BlockId = int


class KVCodec(enum.StrEnum):
    """How a run of KV crosses a link: the cache's own bytes (none), or fewer, lossy."""

    NONE = "none"
    INT8 = "int8"
    FP8 = "fp8"
    INT4 = "int4"

    @classmethod
    def parse(cls, name: str) -> KVCodec:
        """The codec named ``name`` ("" is none); ValueError naming it when unknown."""
        try:
            return cls(name or cls.NONE)
        except ValueError:
            raise ValueError(f"unknown KV codec {name!r} (known: {', '.join(cls)})") from None

    @property
    def lossy(self) -> bool:
        """Whether a run decodes to other values than it had (every codec but none)."""
        return self is not KVCodec.NONE

    def wire_fraction(self, element_bytes: int, block_size: int) -> float:
        """Bytes that cross a link per byte of a cache of ``element_bytes`` per element and ``block_size``
        tokens per block, for long runs (kvtransfer/codecs.py's layout: values, then scales)."""
        if self is KVCodec.NONE:
            return 1.0
        if self is KVCodec.INT4:
            return (0.5 + 2 / INT4_GROUP) / element_bytes
        return (1 + 4 / (SCALE_BLOCKS * block_size)) / element_bytes


SCALE_BLOCKS = 8
"""Blocks of a run whose int8 and fp8 values share a scale per head and channel (a run's last group may be
shorter)."""
INT4_GROUP = 32
"""Channels of a head that share an int4 scale (head_dim must be a multiple)."""


class Transport(enum.StrEnum):
    """The KV transports kvtransfer implements (the config's and the wire's word for each)."""

    TCP = "tcp"
    """Bytes over sockets, our own framing (kvtransfer/tcp.py)."""
    NIXL = "nixl"
    """The receiver READs the sender's registered memory through a NIXL agent (kvtransfer/nixl.py)."""
    LOCAL = "local"
    """Same host: the receiver copies from the sender's shared memory (kvtransfer/local.py)."""


AUTO: Final = "auto"
"""``kv.transport: auto``: nixl where the host has RDMA devices and NIXL imports, else tcp."""


class TransferState(enum.IntEnum):
    """Ordered: a transfer only moves forward, except to FAILED from anywhere."""

    FAILED = 0
    CONNECTING = 1
    WAITING = 2
    TRANSFERRING = 3
    DONE = 4


@dataclass(slots=True, frozen=True)
class TransferTarget:
    """Where a sender writes: the receiver's endpoint and reserved blocks."""

    endpoint: str
    transfer_id: TransferId
    block_ids: tuple[BlockId, ...]
    """Destination blocks; ``send_layer``'s ``first`` indexes into them."""
    layout_hash: str
    socket_buffer_bytes: int | None = None
    """Per link: socket buffers (the link's bandwidth-delay product); None = the sender's config."""
    protection: str | None = None
    """Per link: aead or integrity (kvtransfer.protection.Protection); None = the sender's config."""
    pull: bool | None = None
    """Per link: offer the receiver to pull (shared memory, NIXL); False = bytes over TCP."""
    receiver: str | None = None
    """The receiver's identity (``site/role/name``) its certificate must name;
    None = any receiver the sender's credentials accept."""
    codec: str | None = None
    """Per link and request: the KV codec (none, int8, fp8, int4: kvtransfer/codecs.py); None = the sender's config."""
    traceparent: str = ""
    """The sender's transfer span (W3C traceparent), sent with the last frame so
    that the receiver's span can link to it; "" = not traced."""


@dataclass(slots=True, frozen=True)
class TransferResult:
    """What a completed transfer delivered besides the KV itself."""

    first_token_id: int
    first_logprob: float
    nbytes: int
    seconds: float
    sender_traceparent: str = ""
    """The sender's transfer span as its last frame named it (unchecked: a peer's word)."""
    wire_s: float = 0.0
    """Sender: from its first byte written to the receiver's ack (0: not measured, as when the receiver pulls)."""
    link_bound: bool = False
    """Sender: the network set the pace, not the producer or the receiver: the connections that carried it
    were held back by the network (busy, not limited by the receiver's window) for nearly all of its time
    on the wire (kvtransfer/channel.py LINK_BOUND_SHARE)."""
    rtt_s: float = 0.0
    """Sender: the connection's least round trip as its TCP measured it (0: unknown)."""
    busy_s: float = 0.0
    """Sender: of its time on the wire less a round trip, how long the network held its connections back
    (0: unknown; at most that time). The router's rate from these figures: router/placement/link_estimate.py
    ``LinkSample.of``."""


class TransferHandle(ABC):
    """Thread-safe state of one transfer (either side)."""

    transfer_id: TransferId

    @abstractmethod
    def poll(self) -> TransferState: ...

    @abstractmethod
    def failure(self) -> KVTransferError | None:
        """Why it FAILED; None otherwise."""

    @abstractmethod
    def result(self) -> TransferResult | None:
        """What it delivered once DONE; None otherwise."""

    @abstractmethod
    def fail(self, reason: str, blocks: list[BlockId] | None = None) -> None:
        """FAILED from any state but DONE; the first reason wins."""

    @abstractmethod
    def add_done_callback(self, cb: Callable[[TransferHandle], object]) -> None:
        """Calls ``cb(handle)`` once DONE or FAILED (at once if already so)."""

    @abstractmethod
    def wait(self, timeout_s: float) -> TransferState:
        """Blocks until DONE or FAILED; on timeout the transfer FAILS."""


class SendHandle(TransferHandle):
    """Sender side of one transfer."""

    @abstractmethod
    def send_layer(self, layer: int, src_blocks: list[BlockId], first: int) -> None:
        """Queues K and V of ``layer`` for ``src_blocks`` (this worker's
        block ids) into target blocks ``[first, first + len(src_blocks))``."""

    @abstractmethod
    def finish(self, first_token_id: int, first_logprob: float) -> None:
        """Declares every block sent; the receiver completes with this token."""

    @abstractmethod
    def quiesce(self, timeout_s: float) -> bool:
        """Waits until no thread reads this transfer's source blocks any more
        (call before freeing them after a failure); False on timeout."""


class KVSender(ABC):
    """Sender side of a transport, bound to this worker's KV cache."""

    name: Transport

    @abstractmethod
    def open(self, target: TransferTarget) -> SendHandle: ...

    @abstractmethod
    def close(self) -> None: ...


class KVReceiver(ABC):
    """Receiver side of a transport, bound to this worker's KV cache."""

    name: Transport
    endpoint: str
    bytes_received: int = 0
    """KV bytes landed since start."""

    @abstractmethod
    def expect(self, transfer_id: TransferId, block_ids: list[BlockId], sender: str = "") -> TransferHandle:
        """Reserves ``block_ids`` for the transfer ``transfer_id``; ``sender``
        (``site/prefill/index``): only a sender whose certificate names it may write
        them ("" or no certificates in use: any authenticated sender)."""

    @abstractmethod
    def cancel(self, transfer_id: TransferId) -> None:
        """Forgets a transfer; bytes that still arrive for it are discarded."""

    @abstractmethod
    def close(self) -> None: ...


class MemoryOffer(Protocol):
    """Sender side of pulling: how a sender lets receivers read its KV memory
    themselves (kvtransfer/local.py: shared memory; kvtransfer/nixl.py: NIXL)."""

    def offer(self) -> pb.KVOffer:
        """What locates this sender's KV memory; sent sealed, only to a
        receiver that has proved itself."""


@dataclass(frozen=True, slots=True)
class PeerId:
    """Who a KV peer proved to be: what its certificate names."""

    site: str
    role: str
    name: str

    @property
    def path(self) -> str:
        return f"{self.site}/{self.role}/{self.name}"

    def __str__(self) -> str:
        return f"kvrelay://{self.path}"


class Credentials(Protocol):
    """A KV endpoint's certificate and what it accepts of peers' ones
    (runtime/kvcreds.py implements it from the cluster PKI)."""

    @property
    def certificate(self) -> bytes:
        """Our certificate, DER."""

    def sign(self, message: bytes) -> bytes:
        """Signs with our certificate's key."""

    def identify(self, certificate: bytes) -> PeerId:
        """Who a peer's certificate (DER) names; it must be valid now, issued
        by the cluster CA, not revoked and of a role we accept. ValueError
        saying what failed otherwise."""

    def verify_signature(self, certificate: bytes, message: bytes, signature: bytes) -> None:
        """ValueError unless ``signature`` is by the key of ``certificate`` over ``message``."""

    def pinned(self) -> Credentials:
        """These credentials as they are now, for one handshake: the certificate it presents
        and the key it signs with stay a pair even if the process renews them meanwhile."""


class MemorySource(Protocol):
    """Receiver side of pulling: a sender's KV memory, attached in the
    handshake (kvtransfer.wire.PeerAttacher), that the receiver copies from."""

    @property
    def num_blocks(self) -> int:
        """Blocks of the sender's KV cache (frames must name blocks below it)."""

    def pull(self, layers: range, src: list[BlockId], dest: list[BlockId]) -> None:
        """Copies K and V of ``layers`` for the sender's ``src`` blocks into the
        receiver's ``dest`` blocks. Raises kvtransfer.wire.ProtocolError when the
        copy fails (the connection is then dropped and its transfers fail)."""
