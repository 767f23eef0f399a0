"""vLLM's prefix-cache events as kvrelay's: the router's prefix index keys
blocks by kvrelay's chained, tenant-salted hashes (engine/hashing.py) of
``cache.block_size`` tokens, so prefix-aware placement works on vLLM pools
once each of vLLM's blocks is named by the kvrelay hashes of its sub-blocks.

:class:`PrefixEvents` takes the place of vLLM's event publisher in the
worker's process (it gets every ``KVEventBatch`` of its scheduler): a
stored block is hashed from its tokens, chained to its parent's last
kvrelay hash, under the salt its first block carried; a removed block
takes its sub-blocks out; ``AllBlocksCleared`` empties everything. vLLM's
block size must be a multiple of the router's (128 and 16 by default); a
block of another size is not reported (its tokens stay unknown to the
index, which costs only a cache hit)."""

from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.block_pool import KVEvents
from kvrelay.engine.hashing import BlockHash, hash_block


@dataclass(slots=True, frozen=True)
class _Block:
    """One vLLM block as kvrelay's index knows it."""

    subs: tuple[BlockHash, ...]
    """kvrelay hashes of its sub-blocks, in order."""
    salt: str


class PrefixEvents:
    """A vLLM event publisher (``publish``, ``shutdown``) that keeps kvrelay's view of the cache."""

    def __init__(self, index_block_size: int, salts: dict[str, str]) -> None:
        """``salts``: vLLM's cache_salt -> kvrelay's salt (the engine passes a digest to vLLM)."""
        self.index_block_size = index_block_size
        self.salts = salts
        self._blocks: dict[int, _Block] = {}
        self._stored: list[BlockHash] = []
        self._removed: list[BlockHash] = []

    def publish(self, batch) -> None:
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "BlockStored":
                self._store(ev)
            elif kind == "BlockRemoved":
                for h in ev.block_hashes:
                    gone = self._blocks.pop(h, None)
                    if gone is not None:
                        self._removed.extend(gone.subs)
            elif kind == "AllBlocksCleared":
                self._removed.extend(s for b in self._blocks.values() for s in b.subs)
                self._blocks.clear()

    def _store(self, ev) -> None:
        kb = self.index_block_size
        if ev.block_size % kb:
            return
        if ev.parent_block_hash is None:
            parent, salt = None, self._salt(ev.extra_keys[0] if ev.extra_keys else None)
        else:
            up = self._blocks.get(ev.parent_block_hash)
            if up is None:  # stored before this publisher saw its parent: unknown chain
                return
            parent, salt = up.subs[-1], up.salt
        for i, vhash in enumerate(ev.block_hashes):
            tokens = ev.token_ids[i * ev.block_size:(i + 1) * ev.block_size]
            subs = []
            for j in range(0, ev.block_size, kb):
                parent = hash_block(parent, tokens[j:j + kb], salt)
                subs.append(parent)
            self._blocks[vhash] = _Block(tuple(subs), salt)
            self._stored.extend(subs)

    def _salt(self, keys) -> str:
        """kvrelay's salt of a first block, from the extra keys vLLM hashed it with."""
        for k in keys or ():
            if isinstance(k, str) and k in self.salts:
                return self.salts[k]
        return ""

    def shutdown(self) -> None:
        pass

    def drain(self, snapshot: bool = False) -> KVEvents:
        """Changes since the last drain, or (``snapshot``) every block held now."""
        if snapshot:
            self._stored, self._removed = [], []
            return KVEvents(stored=[s for b in self._blocks.values() for s in b.subs])
        out = KVEvents(stored=self._stored, removed=self._removed)
        self._stored, self._removed = [], []
        return out
