"""Roles and the rules of the topology: which link joins two sites, its
name, and what it asks of a KV transfer (transport, encryption). The router,
the workers and the launchers all read the topology through this module."""

from __future__ import annotations

from enum import StrEnum

from kvrelay.v1 import worker_pb2 as wpb

from runtime.config import ClusterConfig, LinkSection

LOCAL_LINK = "local"
"""Name of the network inside a site."""


class Role(StrEnum):
    """What a worker does; its value is the config's and the CLI's word for it."""

    PREFILL = "prefill"
    DECODE = "decode"

    @property
    def proto(self) -> int:
        """The role as ``worker.proto`` spells it."""
        return wpb.ROLE_PREFILL if self is Role.PREFILL else wpb.ROLE_DECODE

    @classmethod
    def of(cls, proto_role: int) -> Role:
        """The role of a ``WorkerInfo.role``; ValueError for an unknown one."""
        if proto_role == wpb.ROLE_PREFILL:
            return cls.PREFILL
        if proto_role == wpb.ROLE_DECODE:
            return cls.DECODE
        raise ValueError(f"role must be prefill or decode, got {proto_role}")


def link_name(a: str, b: str) -> str:
    """The name of the link between sites ``a`` and ``b`` ("local" within one site)."""
    return LOCAL_LINK if a == b else "-".join(sorted((a, b)))


class Topology:
    """Sites and links of one cluster config, looked up by site names."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self.jurisdiction = {s.name: s.jurisdiction for s in cfg.sites}
        """Site name -> jurisdiction."""
        self._links = {frozenset(link.between): link for link in cfg.links}

    def link(self, a: str, b: str) -> LinkSection | None:
        """The link between two sites (``local_link`` within one); None: they never exchange KV."""
        return self.cfg.local_link if a == b else self._links.get(frozenset((a, b)))

    def encrypts(self, link: LinkSection) -> bool:
        """A link's encryption: its own setting, else ``kv.encrypt``."""
        return self.cfg.kv.encrypt if link.encrypt is None else link.encrypt

    def transport(self, link: LinkSection, sender_transport: str = "") -> str:
        """The transport a transfer over ``link`` uses: the link's own setting,
        else the sender's kind (else ``kv.transport``)."""
        return link.transport or sender_transport or self.cfg.kv.transport
