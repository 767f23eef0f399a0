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

from dataclasses import dataclass, field

import numpy as np

from runtime.topology import Role

_COLUMNS: dict[str, tuple[type, object]] = {
    "healthy": (bool, np.bool_), "draining": (bool, np.bool_), "inflight": (int, np.int64),
    "max_inflight": (int, np.int64), "queued_prefill_tokens": (int, np.int64), "running": (int, np.int64),
    "waiting": (int, np.int64), "free_blocks": (int, np.int64), "prefill_tokens_per_s": (float, np.float64),
    "decode_step_s": (float, np.float64)}
"""Column name -> (Python type read back, numpy dtype)."""


class Columns:
    """The workers' changing fields, one numpy array per field."""

    def __init__(self, n: int) -> None:
        for name, (_, dtype) in _COLUMNS.items():
            setattr(self, name, np.zeros(n, dtype))

    def __len__(self) -> int:
        return len(self.inflight)


class _Column:
    """A WorkerView attribute stored in its table's column."""

    __slots__ = ("name", "kind")

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

    __slots__ = ("worker_id", "role", "site", "tenants", "_cols", "_row")

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

    def __init__(self, worker_id: str, role: Role, site: str, healthy: bool = True, draining: bool = False,
                 inflight: int = 0, max_inflight: int = 64, queued_prefill_tokens: int = 0, running: int = 0,
                 waiting: int = 0, free_blocks: int = 1 << 30, prefill_tokens_per_s: float = 0.0,
                 decode_step_s: float = 0.0, tenants: frozenset[str] = frozenset()) -> None:
        self.worker_id, self.role, self.site = worker_id, role, site
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


@dataclass(slots=True)
class LinkView:
    rtt_ms: float
    gbps: float
    up: bool = True
    name: str = ""
    """e.g. "toronto-montreal"; "" within a site."""


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

    def __post_init__(self) -> None:
        self.table = Table(self.workers)

    def link(self, a: str, b: str) -> LinkView | None:
        """The usable link between sites ``a`` and ``b`` (None: none, or down)."""
        link = self.local_link if a == b else self.links.get(frozenset((a, b)))
        return link if link is not None and link.up else None

    def throughput(self, w: WorkerView) -> float:
        return w.prefill_tokens_per_s or self.default_prefill_tokens_per_s


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
        self.row: dict[str, int] = {}
        for i, w in enumerate(workers):
            for name in _COLUMNS:
                getattr(self.cols, name)[i] = getattr(w._cols, name)[w._row]
            w._cols, w._row = self.cols, i
            self.site[i] = site_code.setdefault(w.site, len(site_code))
            self.prefill[i], self.decode[i] = w.role == Role.PREFILL, w.role == Role.DECODE
            self.dedicated[i] = bool(w.tenants)
            self.row[w.worker_id] = i
        self.sites = list(site_code)
        self.workers = workers
        self._serves: dict[str, np.ndarray] = {}

    def serves(self, tenant: str) -> np.ndarray:
        """Rows whose pool takes ``tenant``'s requests."""
        mask = self._serves.get(tenant)
        if mask is None:
            mask = ~self.dedicated | np.array([tenant in w.tenants for w in self.workers], np.bool_)
            self._serves[tenant] = mask
        return mask
