"""The router's global prefix index: which worker holds which KV blocks.

Workers publish their prefix-cache changes (block hashes stored and
removed, chained so that a hash names its whole prefix) with every
heartbeat, or a full snapshot when the router may have missed some. The
index answers "how many leading blocks of this prompt does each worker
hold" in one pass over the prompt's hashes, whatever the number of workers.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, set[str]] = {}
        self._by_worker: dict[str, set[int]] = {}

    def apply(self, worker_id: str, stored: Iterable[int], removed: Iterable[int], snapshot: bool = False) -> None:
        """Applies a worker's changes; a snapshot replaces what it held."""
        if snapshot:
            self.remove_worker(worker_id)
        mine = self._by_worker.setdefault(worker_id, set())
        for h in removed:
            if h in mine:
                mine.discard(h)
                holders = self._holders[h]
                holders.discard(worker_id)
                if not holders:
                    del self._holders[h]
        for h in stored:
            if h not in mine:
                mine.add(h)
                self._holders.setdefault(h, set()).add(worker_id)

    def remove_worker(self, worker_id: str) -> None:
        for h in self._by_worker.pop(worker_id, ()):
            holders = self._holders[h]
            holders.discard(worker_id)
            if not holders:
                del self._holders[h]

    def blocks_of(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def leading_blocks(self, hashes: Sequence[int]) -> dict[str, int]:
        """Worker id -> number of leading blocks of ``hashes`` it holds
        (workers holding none are absent)."""
        counts: dict[str, int] = {}
        if not hashes:
            return counts
        alive = self._holders.get(hashes[0])
        if not alive:
            return counts
        alive = set(alive)
        i = 1
        for i in range(1, len(hashes)):
            holders = self._holders.get(hashes[i])
            if holders is None:
                break
            if not alive <= holders:
                for w in alive - holders:
                    counts[w] = i
                alive &= holders
                if not alive:
                    return counts
        else:
            i = len(hashes)
        for w in alive:
            counts[w] = i
        return counts
