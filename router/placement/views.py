"""What placement reads: a snapshot of the workers and links (ClusterView).

The workers' changing fields (health, load, free blocks, measured speeds)
live in numpy columns, one row per worker, so a policy can score ten
thousand workers in a few vector operations; a ``WorkerView`` is a handle
on its row that reads and writes those columns, so callers keep using
attributes (``w.inflight += 1``). A WorkerView made alone owns a one-row
table; a ClusterView adopts its workers into one shared table, and whoever
keeps the view (the simulator, the registry) updates rows in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from kvrelay.router.placement.prefix_index import PrefixMatch
from kvrelay.runtime.roles import Role

_COLUMNS: dict[str, tuple[type, object]] = {
    "healthy": (bool, np.bool_), "draining": (bool, np.bool_), "inflight": (int, np.int64),
    "max_inflight": (int, np.int64), "queued_prefill_tokens": (int, np.int64), "running": (int, np.int64),
    "waiting": (int, np.int64), "free_blocks": (int, np.int64), "prefill_tokens_per_s": (float, np.float64),
    "decode_step_s": (float, np.float64), "heard_at": (float, np.float64)}
"""Column name -> (Python type read back, numpy dtype)."""


class Columns:
    """The workers' changing fields, one numpy array per field."""

    healthy: np.ndarray
    draining: np.ndarray
    inflight: np.ndarray
    max_inflight: np.ndarray
    queued_prefill_tokens: np.ndarray
    running: np.ndarray
    waiting: np.ndarray
    free_blocks: np.ndarray
    prefill_tokens_per_s: np.ndarray
    decode_step_s: np.ndarray
    heard_at: np.ndarray

    def __init__(self, n: int) -> None:
        for name, (_, dtype) in _COLUMNS.items():
            setattr(self, name, np.zeros(n, dtype))

    def __len__(self) -> int:
        return len(self.inflight)


class _Column:
    """A WorkerView attribute stored in its table's column."""

    __slots__ = ("kind", "name")

    def __set_name__(self, owner, name: str) -> None:
        self.name, self.kind = name, _COLUMNS[name][0]

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        return self.kind(getattr(obj._cols, self.name)[obj._row])

    def __set__(self, obj, value) -> None:
        getattr(obj._cols, self.name)[obj._row] = value


class WorkerView:
    """What placement knows about one worker (from registration and heartbeats)."""

    __slots__ = ("_cols", "_row", "block_size", "layout", "role", "site", "tenants", "worker_id")

    healthy = _Column()
    draining = _Column()
    inflight = _Column()
    """Requests the router has on this worker now."""
    max_inflight = _Column()
    queued_prefill_tokens = _Column()
    running = _Column()
    waiting = _Column()
    free_blocks = _Column()
    prefill_tokens_per_s = _Column()
    """Measured; 0 = not yet (the view's default applies)."""
    decode_step_s = _Column()
    heard_at = _Column()
    """Monotonic time of its last heartbeat (the registry's health clock; 0 = unused)."""

    def __init__(self, worker_id: str, role: Role, site: str, healthy: bool = True, draining: bool = False,
                 inflight: int = 0, max_inflight: int = 64, queued_prefill_tokens: int = 0, running: int = 0,
                 waiting: int = 0, free_blocks: int = 1 << 30, prefill_tokens_per_s: float = 0.0,
                 decode_step_s: float = 0.0, tenants: frozenset[str] = frozenset(), layout: str = "",
                 block_size: int = 0) -> None:
        self.worker_id, self.role, self.site = worker_id, role, site
        self.block_size = block_size
        """Tokens per block of its KV cache (its ``free_blocks``' unit); 0 = the view's block size."""
        self.layout = layout
        """Its KV layout's compatibility hash: a prefill and a decode worker pair only when
        theirs are equal ("" for every worker of a view where all are alike, e.g. the simulator's)."""
        self.tenants = tenants
        """Its pool is dedicated to these tenants; empty: shared by every tenant."""
        self._cols, self._row = Columns(1), 0
        for name, value in (("healthy", healthy), ("draining", draining), ("inflight", inflight),
                            ("max_inflight", max_inflight), ("queued_prefill_tokens", queued_prefill_tokens),
                            ("running", running), ("waiting", waiting), ("free_blocks", free_blocks),
                            ("prefill_tokens_per_s", prefill_tokens_per_s), ("decode_step_s", decode_step_s)):
            setattr(self, name, value)

    def serves(self, tenant: str) -> bool:
        """Its pool takes ``tenant``'s requests."""
        return not self.tenants or tenant in self.tenants

    @property
    def load(self) -> int:
        return self.inflight + self.waiting

    def __repr__(self) -> str:
        return f"WorkerView({self.worker_id!r}, {self.role!s}, {self.site!r}, inflight={self.inflight})"


class LinkView:
    """A link between two sites as placement sees it. Any change to a link
    (it goes down or up) bumps ``LinkView.epoch``, so views can cache what
    they derive from their links."""

    __slots__ = ("gbps", "inflight", "kv_fraction", "name", "rtt_ms", "up")
    epoch = 0
    """Changes whenever any LinkView is built or changed."""

    def __init__(self, rtt_ms: float, gbps: float, up: bool = True, name: str = "", kv_fraction: float = 1.0
                 ) -> None:
        self.rtt_ms, self.gbps, self.up = rtt_ms, gbps, up
        self.name = name
        """e.g. "toronto-montreal"; "" within a site."""
        self.kv_fraction = kv_fraction
        """Bytes that cross it per byte of KV: its codec's (kvtransfer/base.py ``KVCodec.wire_fraction``), 1 for
        none; a request whose tenant forbids lossy codecs moves every byte."""
        self.inflight = 0
        """Transfers crossing it now (router/placement/link_estimate.py counts them between sites; 0 within
        one): a new transfer shares the link with them."""

    def kv_gbps(self, coded: bool) -> float:
        """The rate at which a new transfer's KV would cross it, counting cache bytes: its share of the
        link beside those in flight, at the link's own bytes or its codec's fewer."""
        share = self.gbps / (1 + self.inflight)
        return share / self.kv_fraction if coded else share

    def __setattr__(self, attr: str, value) -> None:
        object.__setattr__(self, attr, value)
        LinkView.epoch += 1

    def __eq__(self, other) -> bool:
        return isinstance(other, LinkView) and (self.rtt_ms, self.gbps, self.up, self.name, self.kv_fraction) == \
            (other.rtt_ms, other.gbps, other.up, other.name, other.kv_fraction)

    __hash__ = None  # type: ignore[assignment]  # mypy rejects the standard idiom for unhashable (__eq__ by value)

    def __repr__(self) -> str:
        return f"LinkView(rtt_ms={self.rtt_ms}, gbps={self.gbps}, up={self.up}, name={self.name!r})"


@dataclass(slots=True)
class ClusterView:
    """A snapshot of the cluster for one decision (or one kept up to date in place)."""

    workers: list[WorkerView]
    jurisdiction: dict[str, str]
    """Site -> jurisdiction."""
    links: dict[frozenset, LinkView] = field(default_factory=dict)
    """Between two sites, keyed by frozenset({a, b})."""
    local_link: LinkView = field(default_factory=lambda: LinkView(0.2, 10.0))
    block_size: int = 16
    kv_block_bytes: int = 0
    """Bytes of one block's KV over all layers (K and V)."""
    num_layers: int = 1
    default_prefill_tokens_per_s: float = 1000.0
    colocate_below_tokens: int = 32
    herd_tolerance: float = 0.05
    max_prefill_queue_s: float = float("inf")
    """A prefill worker with more queued work than this takes no new prompt: the
    decode worker's reservation would outlive its lease while the prompt waits."""
    table: Table = field(init=False)
    """The workers' columns and static codes (built from ``workers``)."""
    _links_at: tuple = field(init=False, default=(), repr=False)
    _links_cached: dict = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        self.table = Table(self.workers)

    def link_matrix(self, coded: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(Gbit/s of KV, RTT ms) between every two of the table's sites (in its site
        order); NaN where no usable link. ``coded``: the rate counts the cache's bytes
        under each link's codec (LinkView.kv_gbps). Rebuilt only when a link changed."""
        at = (LinkView.epoch, len(self.links))
        if self._links_at != at:
            self._links_cached = {c: _link_matrix(self, self.table.sites, c) for c in (False, True)}
            self._links_at = at
        return self._links_cached[coded]

    def link(self, a: str, b: str) -> LinkView | None:
        """The usable link between sites ``a`` and ``b`` (None: none, or down)."""
        link = self.local_link if a == b else self.links.get(frozenset((a, b)))
        return link if link is not None and link.up else None

    def throughput(self, w: WorkerView) -> float:
        return w.prefill_tokens_per_s or self.default_prefill_tokens_per_s


def _link_matrix(view: ClusterView, sites: list[str], coded: bool) -> tuple[np.ndarray, np.ndarray]:
    code = {s: i for i, s in enumerate(sites)}
    n = len(sites)
    gbps, rtt = np.full((n, n), np.nan), np.full((n, n), np.nan)
    if view.local_link.up:
        np.fill_diagonal(gbps, view.local_link.kv_gbps(coded))
        np.fill_diagonal(rtt, view.local_link.rtt_ms)
    for key, link in view.links.items():
        if link.up and len(key) == 2:
            a, b = (code.get(s) for s in key)
            if a is not None and b is not None:
                gbps[a, b] = gbps[b, a] = link.kv_gbps(coded)
                rtt[a, b] = rtt[b, a] = link.rtt_ms
    return gbps, rtt


class Table:
    """The workers of a view as columns: their changing fields (shared with
    their WorkerViews) and static codes (role, site, dedicated pools)."""

    def __init__(self, workers: list[WorkerView]) -> None:
        n = len(workers)
        self.cols = Columns(n)
        self.sites: list[str] = []
        site_code: dict[str, int] = {}
        self.site = np.zeros(n, np.int64)
        self.prefill = np.zeros(n, np.bool_)
        self.decode = np.zeros(n, np.bool_)
        self.dedicated = np.zeros(n, np.bool_)
        self.layout = np.zeros(n, np.int64)
        """Each row's KV layout, coded: equal codes may exchange KV."""
        self.block_size = np.array([w.block_size for w in workers], np.int64)
        """Each row's tokens per block (0: the view's)."""
        self.own_block_sizes = bool(self.block_size.any())
        """Some row counts its blocks in a size of its own (a vLLM pool's)."""
        layout_code: dict[str, int] = {}
        self.row: dict[str, int] = {}
        for i, w in enumerate(workers):
            for name in _COLUMNS:
                getattr(self.cols, name)[i] = getattr(w._cols, name)[w._row]
            w._cols, w._row = self.cols, i
            self.site[i] = site_code.setdefault(w.site, len(site_code))
            self.prefill[i], self.decode[i] = w.role == Role.PREFILL, w.role == Role.DECODE
            self.dedicated[i] = bool(w.tenants)
            self.layout[i] = layout_code.setdefault(w.layout, len(layout_code))
            self.row[w.worker_id] = i
        self.sites = list(site_code)
        self.num_layouts = len(layout_code)
        self.workers = workers
        self.by_name = np.array(sorted(range(n), key=lambda i: workers[i].worker_id), np.int64)
        """Rows in worker-id order."""
        self._serves: dict[str, np.ndarray] = {}
        self._bits_of: list | None = None
        self._bit_row = np.zeros(0, np.int64)

    def cached(self, match: Mapping[str, int]) -> np.ndarray:
        """Leading prompt blocks each row holds, from a prefix-index answer
        (a PrefixMatch is mapped by its bit positions, without naming anyone)."""
        out = np.zeros(len(self.workers), np.int64)
        if not match:
            return out
        if isinstance(match, PrefixMatch):
            rows, depth = self._rows_of_bits(match.ids)[match.bits], match.depth
        else:
            rows = np.fromiter((self.row.get(w, -1) for w in match), np.int64, len(match))
            depth = np.fromiter(match.values(), np.int64, len(match))
        known = rows >= 0
        out[rows[known]] = depth[known]
        return out

    def _rows_of_bits(self, ids: list[str | None]) -> np.ndarray:
        """Index bit -> row (-1: not in this view), rebuilt when the index's
        bits change (it replaces its id list then, or appends to it)."""
        if self._bits_of is not ids or len(self._bit_row) != len(ids):
            self._bit_row = np.fromiter((-1 if w is None else self.row.get(w, -1) for w in ids), np.int64, len(ids))
            self._bits_of = ids
        return self._bit_row

    def serves(self, tenant: str) -> np.ndarray:
        """Rows whose pool takes ``tenant``'s requests."""
        mask = self._serves.get(tenant)
        if mask is None:
            mask = ~self.dedicated | np.array([tenant in w.tenants for w in self.workers], np.bool_)
            self._serves[tenant] = mask
        return mask
