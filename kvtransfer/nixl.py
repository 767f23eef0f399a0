"""NIXL transport: KV moves by NIXL (UCX backend: RDMA where the host has it,
shared memory or TCP otherwise) from the prefill worker's registered KV
tensor (DRAM on CPU, VRAM on CUDA) into the decode worker's.

The decode worker READs: it learns the sender's agent metadata and KV
address from the sender's sealed offer, after both ends authenticated
(kvtransfer/handshake.py), and each blocks frame names the sender's blocks
and carries a MAC of each run; the receiver pulls them into the
reservation it still holds, under the reservation's lock, then checks the
MACs. Only on integrity links: the bytes cross the fabric unencrypted. We
read rather than let the prefill worker WRITE because a one-sided write
cannot know that the reservation was not freed (lease expired, request
cancelled) and handed to another request in the meantime;
with READ, the side that owns the memory decides. Metadata travels over our
own channel (no NIXL listener thread).

Hosts without RDMA devices need ``UCX_MODULES=^ib`` in the environment of
every process that creates an agent (set by the worker entry point), or
processes can crash at exit.
"""

from __future__ import annotations

import dataclasses
import threading
import time
import uuid
from dataclasses import dataclass

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import Transport
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.local import SharedMemoryAttacher
from kvrelay.kvtransfer.memory import paired_runs
from kvrelay.kvtransfer.receiver import ChannelReceiver
from kvrelay.kvtransfer.sender import ChannelSender
from kvrelay.kvtransfer.wire import ProtocolError
from kvrelay.v1 import kv_wire_pb2 as pb


def nixl_available() -> bool:
    try:
        from nixl._api import nixl_agent  # noqa: F401
    except ImportError:
        return False
    return True


PROGRESS_DELAY_US = 500
"""Pause of NIXL's progress thread between polls. The Python binding (1.5)
hard-codes 0, a busy loop that costs a whole core per agent (measured: 2.0 s
of CPU per 2 s idle) and halves a 2-core worker's compute."""

_config_lock = threading.Lock()


def make_agent(nixl_agent, nixl_agent_config, name: str):
    """An agent (UCX backend, progress thread) whose progress thread sleeps
    PROGRESS_DELAY_US between polls: the binding's config class is swapped,
    for this construction only, for one that keeps the delay from being zeroed."""
    import nixl._api as api

    base = api.nixlBind.nixlAgentConfig
    prop = base.pthrDelay

    class _DelayedConfig(base):  # type: ignore[misc,valid-type]  # a class of nixl's untyped binding
        @property
        def pthrDelay(self):
            return prop.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, value):
            prop.__set__(self, max(value, PROGRESS_DELAY_US))

    with _config_lock:
        api.nixlBind.nixlAgentConfig = _DelayedConfig
        try:
            return nixl_agent(name, nixl_agent_config(True, False, 0, backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgentConfig = base


@dataclass(slots=True)
class NixlPeer:
    """A sender's KV as the receiver's agent sees it."""

    agent_name: str
    base_address: int
    device_id: int
    num_blocks: int


class NixlAgent:
    """One NIXL agent per worker, with the worker's KV tensor registered."""

    def __init__(self, cache: KVCache, name: str | None = None) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.cache = cache
        self.name = name or f"kvrelay-{uuid.uuid4().hex[:12]}"
        self.agent = make_agent(nixl_agent, nixl_agent_config, self.name)
        self.registration = self.agent.register_memory(cache.kv)
        self.mem_type = "VRAM" if cache.kv.is_cuda else "DRAM"
        self.device_id = (cache.kv.device.index or 0) if cache.kv.is_cuda else 0
        self._peers: dict[bytes, str] = {}

    def close(self) -> None:
        self.agent.deregister_memory(self.registration)

    @property
    def metadata(self) -> bytes:
        return self.agent.get_agent_metadata()

    @property
    def base_address(self) -> int:
        return self.cache.kv.data_ptr()

    def offer(self) -> pb.KVOffer:
        """MemoryOffer: what lets a receiver's agent READ our registered KV
        (sent sealed, only to a receiver that proved itself)."""
        return pb.KVOffer(nixl_metadata=self.metadata, kv_base_address=self.base_address,
                          kv_device_id=self.device_id, num_blocks=self.cache.num_blocks)

    def add_peer(self, metadata: bytes, base_address: int, device_id: int, num_blocks: int) -> NixlPeer:
        name = self._peers.get(metadata)
        if name is None:
            name = self.agent.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[metadata] = name
        return NixlPeer(name, base_address, device_id, num_blocks)

    def read(self, peer: NixlPeer, layers: range, src: list[int], dest: list[int], timeout_s: float) -> None:
        """READs K and V of ``layers`` for the sender's ``src`` blocks into our
        ``dest`` blocks; raises RuntimeError on a NIXL error or the deadline."""
        bb, kinds = self.cache.layout.block_bytes, self.cache.layout.kinds
        local, remote = [], []
        base = self.base_address
        for layer in layers:
            for kind in range(kinds):
                for s, d, n in paired_runs(src, dest):
                    local.append((base + self.cache.block_offset(layer, kind, d), n * bb, self.device_id))
                    r_off = ((layer * kinds + kind) * peer.num_blocks + s) * bb
                    remote.append((peer.base_address + r_off, n * bb, peer.device_id))
        agent = self.agent
        handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local, self.mem_type),
                                       agent.get_xfer_descs(remote, self.mem_type), peer.agent_name)
        try:
            state = agent.transfer(handle)
            deadline = time.monotonic() + timeout_s
            while state not in ("DONE", "ERR"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"NIXL read not done within {timeout_s:.0f} s")
                time.sleep(0.0002)  # leave the core to UCX's progress thread
                state = agent.check_xfer_state(handle)
            if state == "ERR":
                raise RuntimeError("NIXL read failed")
        finally:
            agent.release_xfer_handle(handle)


class NixlSource:
    """MemorySource: a NIXL sender's registered KV, READ through our agent."""

    def __init__(self, agent: NixlAgent, peer: NixlPeer, timeout_s: float) -> None:
        self.agent = agent
        self.peer = peer
        self.timeout_s = timeout_s

    @property
    def num_blocks(self) -> int:
        return self.peer.num_blocks

    def pull(self, layers: range, src: list[int], dest: list[int]) -> None:
        try:
            self.agent.read(self.peer, layers, src, dest, self.timeout_s)
        except RuntimeError as exc:
            raise ProtocolError(str(exc)) from None


class NixlAttacher:
    """PeerAttacher (kvtransfer/handshake.py): connects our agent to senders that
    offer NIXL metadata; each READ may take up to ``timeout_s``."""

    same_host = False
    """NIXL bytes cross the fabric unencrypted: only integrity links pull (aead ones get sealed bytes)."""

    def __init__(self, agent: NixlAgent, timeout_s: float) -> None:
        self.agent = agent
        self.timeout_s = timeout_s

    def can_attach(self, offer: pb.KVOffer) -> bool:
        return bool(offer.nixl_metadata)

    def attach(self, offer: pb.KVOffer) -> NixlSource:
        peer = self.agent.add_peer(offer.nixl_metadata, offer.kv_base_address, offer.kv_device_id,
                                   offer.num_blocks)
        return NixlSource(self.agent, peer, self.timeout_s)


class NixlKVSender(ChannelSender):
    """Offers its registered KV to receivers; frames then carry block ids only."""

    name = Transport.NIXL

    def __init__(self, cache: KVCache, cfg: TransferConfig | None = None) -> None:
        self.nixl = NixlAgent(cache)
        super().__init__(cache, dataclasses.replace(cfg or TransferConfig(), offer_memory=True), self.nixl)

    def close(self) -> None:
        super().close()
        self.nixl.close()


class NixlKVReceiver(ChannelReceiver):
    """A receiver with an agent: pulls from NIXL senders, and still accepts
    bytes from tcp senders and shared memory from local ones."""

    name = Transport.NIXL

    def __init__(self, cache: KVCache, host: str = "127.0.0.1", cfg: TransferConfig | None = None) -> None:
        cfg = cfg or TransferConfig()
        self.nixl = NixlAgent(cache)
        super().__init__(cache, host, cfg, (NixlAttacher(self.nixl, cfg.connect_timeout_s * 6),
                                            SharedMemoryAttacher(cache)))

    def close(self) -> None:
        super().close()
        self.nixl.close()
