"""The router's global prefix index: which worker holds which KV blocks.

Workers publish their prefix-cache changes (block hashes stored and
removed, chained so that a hash names its whole prefix) with every
heartbeat, or a full snapshot when the router may have missed some. The
index answers "how many leading blocks of this prompt does each worker
hold" in one pass over the prompt's hashes.

Each worker has a bit; each block hash maps to the bitmask of its holders
(a Python int), so one step of the pass is one AND over N/64 machine words
whatever the number of holders, and only the workers that drop out along
the prompt are touched one by one (each once).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        """Block hash -> bitmask of the workers holding it."""
        self._by_worker: dict[str, set[int]] = {}
        self._bit: dict[str, int] = {}
        self._ids: list[str | None] = []
        """Bit -> worker id (None: free)."""
        self._free: list[int] = []

    def _bit_of(self, worker_id: str) -> int:
        bit = self._bit.get(worker_id)
        if bit is None:
            bit = self._free.pop() if self._free else len(self._ids)
            if bit == len(self._ids):
                self._ids.append(worker_id)
            else:
                self._ids[bit] = worker_id
            self._bit[worker_id] = bit
        return bit

    def apply(self, worker_id: str, stored: Iterable[int], removed: Iterable[int], snapshot: bool = False) -> None:
        """Applies a worker's changes; a snapshot replaces what it held."""
        if snapshot:
            self.remove_worker(worker_id)
        mine = self._by_worker.setdefault(worker_id, set())
        mask = 1 << self._bit_of(worker_id)
        holders = self._holders
        for h in removed:
            if h in mine:
                mine.discard(h)
                left = holders[h] & ~mask
                if left:
                    holders[h] = left
                else:
                    del holders[h]
        for h in stored:
            if h not in mine:
                mine.add(h)
                holders[h] = holders.get(h, 0) | mask

    def remove_worker(self, worker_id: str) -> None:
        bit = self._bit.pop(worker_id, None)
        hashes = self._by_worker.pop(worker_id, ())
        if bit is None:
            return
        mask = ~(1 << bit)
        for h in hashes:
            left = self._holders[h] & mask
            if left:
                self._holders[h] = left
            else:
                del self._holders[h]
        self._ids[bit] = None
        self._free.append(bit)

    def blocks_of(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def _name(self, bits: int, depth: int, counts: dict[str, int]) -> None:
        """Records ``depth`` for every worker whose bit is set in ``bits``."""
        ids = self._ids
        while bits:
            low = bits & -bits
            counts[ids[low.bit_length() - 1]] = depth
            bits ^= low

    def leading_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``hashes`` it holds
        (workers holding none are absent)."""
        counts: dict[str, int] = {}
        if not hashes:
            return counts
        holders = self._holders
        alive = holders.get(hashes[0], 0)
        if not alive:
            return counts
        i = len(hashes)
        for j in range(1, len(hashes)):
            held = holders.get(hashes[j], 0)
            if not held:
                i = j
                break
            gone = alive & ~held
            if gone:
                self._name(gone, j, counts)
                alive &= held
                if not alive:
                    return counts
        self._name(alive, i, counts)
        return counts
