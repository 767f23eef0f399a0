"""The pool of KV blocks of one worker: reference counts, a free queue in
eviction order, and the prefix cache (block hash -> block).

A block with reference count 0 sits in the free queue. If it holds a cached
(hashed) block it stays findable by hash until it is reused for something
else (evicted), least recently freed first. Blocks are identified by their
index into the KV tensors (``BlockId``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvrelay.engine.errors import OutOfBlocksError
from kvrelay.engine.hashing import BlockHash

BlockId = int


@dataclass(slots=True)
class KVEvents:
    """Prefix-cache changes since the last drain, for the router's index."""

    stored: list[BlockHash] = field(default_factory=list)
    removed: list[BlockHash] = field(default_factory=list)


class FreeBlockQueue:
    """Free blocks in eviction order (front = next to reuse).

    Blocks never handed out are the range ``[fresh, end)`` ahead of every
    recycled block (which is where a queue filled with all ids in order
    would have them), so a pool's memory grows with the blocks it has used,
    not with its size: a simulator can hold thousands of large pools."""

    __slots__ = ("_end", "_fresh", "_q")

    def __init__(self, num_blocks: int) -> None:
        self._q: OrderedDict[BlockId, None] = OrderedDict()
        self._fresh = 0
        self._end = num_blocks

    def __len__(self) -> int:
        return len(self._q) + self._end - self._fresh

    def __contains__(self, block_id: BlockId) -> bool:
        return block_id in self._q or self._fresh <= block_id < self._end

    @property
    def used(self) -> int:
        """Blocks ever handed out (ids below this)."""
        return self._fresh

    def pop_front(self) -> BlockId:
        if self._fresh < self._end:
            self._fresh += 1
            return self._fresh - 1
        return self._q.popitem(last=False)[0]

    def push_back(self, block_id: BlockId) -> None:
        self._q[block_id] = None

    def remove(self, block_id: BlockId) -> None:
        """Takes a recycled block out of the queue (one never handed out has no hash to be found by)."""
        del self._q[block_id]


class BlockHashMap:
    """Block hash -> block id for cached full blocks, and the reverse."""

    __slots__ = ("_by_block", "_by_hash")

    def __init__(self) -> None:
        self._by_hash: dict[BlockHash, BlockId] = {}
        self._by_block: dict[BlockId, BlockHash] = {}

    def __len__(self) -> int:
        return len(self._by_hash)

    def get(self, h: BlockHash) -> BlockId | None:
        return self._by_hash.get(h)

    def put(self, h: BlockHash, block_id: BlockId) -> bool:
        """Registers ``block_id`` under ``h``; False when either is taken."""
        if h in self._by_hash or block_id in self._by_block:
            return False
        self._by_hash[h] = block_id
        self._by_block[block_id] = h
        return True

    def pop_block(self, block_id: BlockId) -> BlockHash | None:
        h = self._by_block.pop(block_id, None)
        if h is not None:
            del self._by_hash[h]
        return h


class BlockPool:
    """Reference-counted KV blocks with a prefix cache.

    Call order for a request: ``match_prefix`` (takes references on cached
    blocks) -> ``allocate`` for the rest -> ``cache_block`` as blocks fill up ->
    ``free`` on every block when the request ends or is preempted.
    """

    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self._ref: list[int] = []
        """Reference count of each block handed out so far (grows with FreeBlockQueue.used)."""
        self._free = FreeBlockQueue(num_blocks)
        self._cached = BlockHashMap()
        self._events = KVEvents()
        self.prefix_hits = 0
        """Blocks served from the prefix cache since start."""
        self.prefix_queries = 0
        """Blocks looked up in the prefix cache since start."""

    # -- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks that ``allocate`` can hand out (free, cached or not)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block_id: BlockId) -> int:
        return self._ref[block_id] if block_id < len(self._ref) else 0

    def num_cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """Leading blocks of ``hashes`` present in the cache (no references taken)."""
        n = 0
        for h in hashes:
            if self._cached.get(h) is None:
                break
            n += 1
        return n

    # -- mutation ------------------------------------------------------------
    def match_prefix(self, hashes: Sequence[BlockHash]) -> list[BlockId]:
        """Takes a reference on the cached blocks of the longest cached prefix."""
        if not self.enable_prefix_caching:
            return []
        self.prefix_queries += len(hashes)
        out: list[BlockId] = []
        for h in hashes:
            b = self._cached.get(h)
            if b is None:
                break
            self._take(b)
            out.append(b)
        self.prefix_hits += len(out)
        return out

    def allocate(self, n: int) -> list[BlockId]:
        """``n`` fresh blocks with reference count 1, evicting cached ones.

        Raises:
            OutOfBlocksError: fewer than ``n`` blocks are free (nothing changes).
        """
        if n > len(self._free):
            raise OutOfBlocksError(f"need {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            b = self._free.pop_front()
            if b == len(self._ref):
                self._ref.append(0)
            evicted = self._cached.pop_block(b)
            if evicted is not None:
                self._events.removed.append(evicted)
            self._ref[b] = 1
            out.append(b)
        return out

    def cache_block(self, block_id: BlockId, h: BlockHash) -> None:
        """Makes a full, written block findable by its hash (idempotent)."""
        if self.enable_prefix_caching and self._cached.put(h, block_id):
            self._events.stored.append(h)

    def free(self, block_ids: Iterable[BlockId]) -> None:
        """Drops one reference per block. Pass a request's blocks in order:
        they are queued tail first, so a prefix outlives its suffix."""
        for b in reversed(list(block_ids)):
            if b >= len(self._ref) or self._ref[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than taken")
            self._ref[b] -= 1
            if self._ref[b] == 0:
                self._free.push_back(b)

    def cached_hashes(self) -> list[BlockHash]:
        """Every block hash the prefix cache holds now."""
        return list(self._cached._by_hash)

    def drain_events(self) -> KVEvents:
        """Returns and clears the stored/removed hashes since the last call."""
        ev, self._events = self._events, KVEvents()
        return ev

    def _take(self, b: BlockId) -> None:
        if self._ref[b] == 0:
            self._free.remove(b)
        self._ref[b] += 1
