"""Choosing a KV transport backend and building its two sides."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from kvrelay.engine.kv_cache import KVCache
from kvrelay.kvtransfer.base import AUTO, KVReceiver, KVSender, Transport
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.local import LocalKVSender
from kvrelay.kvtransfer.nixl import NixlKVReceiver, NixlKVSender, nixl_available
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender

log = logging.getLogger(__name__)

IMPLEMENTED = (Transport.TCP, Transport.LOCAL, Transport.NIXL)

SENDERS: dict[Transport, Callable[[KVCache, TransferConfig], KVSender]] = {
    Transport.TCP: TcpKVSender, Transport.LOCAL: LocalKVSender, Transport.NIXL: NixlKVSender}
RECEIVERS: dict[Transport, Callable[[KVCache, str, TransferConfig], KVReceiver]] = {
    Transport.TCP: TcpKVReceiver, Transport.LOCAL: TcpKVReceiver, Transport.NIXL: NixlKVReceiver}
"""The TCP receiver serves tcp and local senders; the NIXL one all three."""


def host_has_rdma(sysfs: Path = Path("/sys/class/infiniband")) -> bool:
    return sysfs.is_dir() and any(sysfs.iterdir())


def choose_transport(requested: str) -> Transport:
    """``auto`` -> nixl where the host has RDMA devices and the nixl backend
    exists, else tcp. Logs the choice and why."""
    if requested != AUTO:
        chosen, why = requested, "configured"
    elif host_has_rdma() and nixl_available():
        chosen, why = Transport.NIXL, "RDMA devices present"
    else:
        chosen, why = Transport.TCP, ("no RDMA devices" if not host_has_rdma() else "nixl does not import")
    if chosen not in IMPLEMENTED:
        raise ValueError(f"KV transport {chosen!r} is not implemented yet")
    log.info("KV transport: %s (%s)", chosen, why)
    return Transport(chosen)


def make_sender(name: Transport, cache: KVCache, cfg: TransferConfig) -> KVSender:
    return SENDERS[name](cache, cfg)


def make_receiver(name: Transport, cache: KVCache, host: str, cfg: TransferConfig) -> KVReceiver:
    """The TCP receiver serves tcp and local senders; the NIXL one all three."""
    return RECEIVERS[name](cache, host, cfg)
