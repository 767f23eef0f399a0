"""Choosing a KV transport backend and building its two sides."""

from __future__ import annotations

import logging
from pathlib import Path

from engine.kv_cache import KVCache
from kvtransfer.base import KVReceiver, KVSender
from kvtransfer.local import LocalKVSender
from kvtransfer.nixl import NixlKVReceiver, NixlKVSender, nixl_available
from kvtransfer.tcp import TcpConfig, TcpKVReceiver, TcpKVSender

log = logging.getLogger(__name__)

IMPLEMENTED = ("tcp", "local", "nixl")


def host_has_rdma(sysfs: Path = Path("/sys/class/infiniband")) -> bool:
    return sysfs.is_dir() and any(sysfs.iterdir())


def choose_transport(requested: str) -> str:
    """``auto`` -> nixl where the host has RDMA devices and the nixl backend
    exists, else tcp. Logs the choice and why."""
    if requested != "auto":
        chosen, why = requested, "configured"
    elif host_has_rdma() and nixl_available():
        chosen, why = "nixl", "RDMA devices present"
    else:
        chosen, why = "tcp", ("no RDMA devices" if not host_has_rdma() else "nixl does not import")
    if chosen not in IMPLEMENTED:
        raise ValueError(f"KV transport {chosen!r} is not implemented yet")
    log.info("KV transport: %s (%s)", chosen, why)
    return chosen


def make_sender(name: str, cache: KVCache, cfg: TcpConfig) -> KVSender:
    return {"tcp": TcpKVSender, "local": LocalKVSender, "nixl": NixlKVSender}[name](cache, cfg)


def make_receiver(name: str, cache: KVCache, host: str, cfg: TcpConfig) -> KVReceiver:
    """The TCP receiver serves tcp and local senders; the NIXL one all three."""
    return {"tcp": TcpKVReceiver, "local": TcpKVReceiver, "nixl": NixlKVReceiver}[name](cache, host, cfg)
