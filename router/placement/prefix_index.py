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

from collections.abc import Iterable, Iterator, Mapping, Sequence

import numpy as np


class PrefixMatch(Mapping[str, int]):
    """One lookup's answer: worker id -> leading blocks of the prompt it holds
    (workers holding none are absent). Kept as the index's bit positions and
    their depths (numpy): one worker's depth is read by its bit, and the
    whole answer is named only when iterated."""

    __slots__ = ("_bit_of", "_by_bit", "_known", "_named", "bits", "depth", "ids")

    def __init__(self, bits: np.ndarray, depth: np.ndarray, ids: list[str | None],
                 bit_of: Mapping[str, int]) -> None:
        self.bits, self.depth = bits, depth
        """Bit positions of the holders, and how many leading blocks each holds."""
        self.ids = ids
        """Bit -> worker id, as the index had them (only appended to after)."""
        self._known = len(ids)
        """Bits at or past this were given to workers that joined after the answer."""
        self._bit_of = bit_of
        """The index's worker id -> bit (live: checked against ``ids``)."""
        self._by_bit: np.ndarray | None = None
        self._named: dict[str, int] | None = None

    def __getitem__(self, worker_id: str) -> int:
        if self._named is not None:
            return self._named[worker_id]
        bit = self._bit_of.get(worker_id)
        if bit is None or bit >= len(self.ids) or self.ids[bit] != worker_id:
            return self._dict()[worker_id]  # the index has moved on since: name the whole answer
        if bit >= self._known:
            raise KeyError(worker_id)  # it joined after the answer: it holds nothing in it
        if self._by_bit is None:
            self._by_bit = np.zeros(self._known, np.int64)
            self._by_bit[self.bits] = self.depth
        depth = int(self._by_bit[bit])
        if not depth:
            raise KeyError(worker_id)
        return depth

    def _dict(self) -> dict[str, int]:
        if self._named is None:
            ids = self.ids
            self._named = {ids[b]: d for b, d in zip(self.bits.tolist(), self.depth.tolist())}
        return self._named

    def __iter__(self) -> Iterator[str]:
        return iter(self._dict())

    def __len__(self) -> int:
        return len(self.bits)

    def __bool__(self) -> bool:
        return len(self.bits) > 0

    def __repr__(self) -> str:
        return f"PrefixMatch({self._dict()!r})"


EMPTY_MATCH = PrefixMatch(np.zeros(0, np.int64), np.zeros(0, np.int64), [], {})


class PrefixIndex:
    def __init__(self) -> None:
        self._holders: dict[int, int] = {}
        """Block hash -> bitmask of the workers holding it."""
        self._by_worker: dict[str, set[int]] = {}
        self._bit: dict[str, int] = {}
        self.ids: list[str | None] = []
        """Bit -> worker id (None: free). Replaced, not changed in place, when a
        bit is freed or reused, so a PrefixMatch's copy stays right."""
        self._free: list[int] = []

    def _bit_of(self, worker_id: str) -> int:
        bit = self._bit.get(worker_id)
        if bit is None:
            if self._free:
                bit = self._free.pop()
                self.ids = self.ids.copy()
                self.ids[bit] = worker_id
            else:
                bit = len(self.ids)
                self.ids.append(worker_id)  # earlier matches never name a bit this new
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
        self.ids = self.ids.copy()
        self.ids[bit] = None
        self._free.append(bit)

    def blocks_of(self, worker_id: str) -> int:
        return len(self._by_worker.get(worker_id, ()))

    def leading_blocks(self, hashes: Sequence[int]) -> PrefixMatch:
        """Worker id -> number of leading blocks of ``hashes`` it holds
        (workers holding none are absent): one AND per block, and each
        worker that drops out along the prompt is touched once."""
        if not hashes:
            return EMPTY_MATCH
        holders = self._holders
        alive = holders.get(hashes[0], 0)
        if not alive:
            return EMPTY_MATCH
        bits: list[int] = []
        depth: list[int] = []
        i = len(hashes)
        for j in range(1, len(hashes)):
            held = holders.get(hashes[j], 0)
            if not held:
                i = j
                break
            kept = alive & held
            if kept != alive:  # some holders stop here (an AND and a compare: no inverted copy)
                _name(alive ^ kept, j, bits, depth)
                alive = kept
                if not alive:
                    break
        _name(alive, i, bits, depth)
        return PrefixMatch(np.array(bits, np.int64), np.array(depth, np.int64), self.ids, self._bit)


def _name(mask: int, depth: int, bits: list[int], depths: list[int]) -> None:
    """Appends the position of every bit set in ``mask``, with ``depth``: a
    few bits one by one from the top (no copy for the last), many at C speed."""
    k = mask.bit_count()
    if k > _MANY_BITS:
        raw = np.frombuffer(mask.to_bytes((mask.bit_length() + 7) // 8, "little"), np.uint8)
        bits.extend(np.flatnonzero(np.unpackbits(raw, bitorder="little")).tolist())
    else:
        for _ in range(k - 1):
            top = mask.bit_length() - 1
            bits.append(top)
            mask ^= 1 << top
        bits.append(mask.bit_length() - 1)
    depths.extend([depth] * k)


_MANY_BITS = 24
"""Above this many holders dropping at once, their bits are found with numpy."""
