"""The rules of the topology: which link joins two sites, its
name, and what it asks of a KV transfer (transport, protection). The router,
the workers and the launchers all read the topology through this module."""

from __future__ import annotations

from kvrelay.kvtransfer.base import AUTO, KVCodec  # the router reads the codec names here (it imports no kvtransfer)
from kvrelay.kvtransfer.protection import Protection
from kvrelay.runtime.config import ClusterConfig, LinkCodec, LinkSection

LOCAL_LINK = "local"


def link_kv_fraction(codec: LinkCodec, auto_codecs: list[KVCodec], element_bytes: int, block_size: int) -> float:
    """Bytes that cross a link of ``codec`` per byte of KV (``element_bytes`` per element); under ``auto``
    the fewest its choices can send (the choice is made per request: router/placement/codec_choice.py)."""
    codecs = auto_codecs if codec == AUTO else [KVCodec(codec)]
    return min(c.wire_fraction(element_bytes, block_size) for c in codecs)
"""Name of the network inside a site."""


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

    def protection(self, link: LinkSection) -> Protection:
        """A link's KV protection: its own setting, else ``kv.protection``."""
        return self.cfg.kv.protection if link.protection is None else link.protection

    def lossy_ok(self, tenant: str = "") -> bool:
        """Whether ``tenant``'s KV may cross links under a lossy codec (its ``kv_lossy``; yes for one not
        configured)."""
        entry = self.cfg.tenant(tenant) if tenant else None
        return entry is None or entry.kv_lossy

    def codec(self, link: LinkSection, tenant: str = "") -> LinkCodec:
        """The KV codec of a transfer over ``link`` for ``tenant``: the link's (``auto``: placement chooses
        per request among :meth:`auto_codecs`), or none where the tenant forbids lossy codecs
        (``kv_lossy: false``)."""
        return link.kv_codec if self.lossy_ok(tenant) else KVCodec.NONE

    def auto_codecs(self) -> list[KVCodec]:
        """The codecs ``auto`` chooses among (``kv.auto_codecs``)."""
        return [KVCodec(c) for c in self.cfg.kv.auto_codecs]

    def fraction(self, codec: KVCodec) -> float:
        """Bytes that cross a link per byte of KV under ``codec`` (the builtin engine's cache: the model's
        dtype and the cache's block size; a codec never crosses a link to a vLLM pool: runtime/config.py)."""
        return codec.wire_fraction(self._element_bytes(), self.cfg.cache.block_size)

    def _element_bytes(self) -> int:
        """Bytes of one element of the builtin engine's cache: float32, or bfloat16 and float16."""
        return 4 if self.cfg.model.dtype == "float32" else 2

    def kv_fraction(self, link: LinkSection) -> float:
        """What placement prices ``link`` at (:func:`link_kv_fraction` at the model's dtype)."""
        return link_kv_fraction(link.kv_codec, self.auto_codecs(), self._element_bytes(), self.cfg.cache.block_size)

    def required_protection(self, site: str, peer_site: str | None) -> Protection:
        """What a receiver at ``site`` requires of a sender at ``peer_site``
        (the site its certificate names): the link's protection; without a
        certificate (peer_site None), the strongest of any link into ``site``."""
        if peer_site is not None:
            link = self.link(site, peer_site)
            return self.protection(link) if link is not None else Protection.AEAD
        links = [self.cfg.local_link, *(lk for lk in self.cfg.links if site in lk.between)]
        return max((self.protection(lk) for lk in links), key=lambda p: p.strength)

    def transport(self, link: LinkSection, sender_transport: str = "") -> str:
        """The transport a transfer over ``link`` uses: the link's own setting,
        else the sender's kind (else ``kv.transport``)."""
        return link.transport or sender_transport or self.cfg.kv.transport
