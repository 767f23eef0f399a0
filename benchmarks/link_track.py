"""``kvrelay bench link-track``: how fast the router's estimate of a link
follows a change of the link (issue 35's goal: within 10 transfers).

Two cities, prefill in Toronto and decode in Montreal, joined by an emulated
WAN link (`kvrelay cities`, root) whose config says ``--configured-mbps``
while tbf shapes it to each rate of ``--rates`` in turn. One request at a
time, each a prompt of ``--prompt-tokens`` fresh tokens (no prefix cache),
its KV crossing the link; after each, the link's figures from the router
(ListWorkers: what `kvrelay status` shows). Per phase: the transfers until
the rate placement uses is within 10% of the shaped one, each transfer's
own rate and whether it was link-bound."""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvrelay.launch import cities
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc

LINK = "montreal-toronto"
TRACKED = 0.10
"""A phase is tracked once the rate placement uses is within this share of the shaped rate."""


@dataclass(slots=True)
class Transfer:
    """One request's transfer and the link's figures right after it."""

    mbps: float
    """This transfer's own rate on the wire (Mbit/s)."""
    bound: bool
    kv_bytes: int
    ttft_ms: float
    placement_mbps: float
    """The rate placement uses for the link after it ..."""
    source: str
    """... and where it comes from."""


@dataclass(slots=True)
class Phase:
    shaped_mbps: float
    transfers: list[Transfer] = field(default_factory=list)

    @property
    def to_track(self) -> int | None:
        """Transfers until the rate in use was within TRACKED of the shaped one (None: not in this phase)."""
        return next((i + 1 for i, t in enumerate(self.transfers)
                     if t.source != "configured" and abs(t.placement_mbps / self.shaped_mbps - 1) <= TRACKED), None)


def config(configured_mbps: float, rtt_ms: float) -> dict:
    return {"router": {"port": 0, "placement": {"policy": "round_robin", "colocate_below_tokens": 1},
                       "liveness": {"heartbeat_interval_s": 0.25, "link_probe_timeout_s": 2.0}},
            "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1},
                       "decode": {"replicas": 0}},
                      {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0},
                       "decode": {"replicas": 1}}],
            "links": [{"between": ["toronto", "montreal"], "rtt_ms": rtt_ms, "gbps": configured_mbps / 1e3,
                       "transport": "tcp"}],
            "workers": {"threads": 1}, "cache": {"memory_gib": 0.5}}


def _link(lc: LocalCluster) -> wpb.LinkStatus:
    with lc.channel(operator=True) as ch:
        links = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10).links
    return next(lk for lk in links if lk.name == LINK)


def _one(lc: LocalCluster, prompt: list[int]) -> Transfer:
    with lc.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=prompt), max_tokens=2, ignore_eos=True), timeout=300))
    p = msgs[-1].finish.placement
    if p.link != LINK:
        raise RuntimeError(f"the request did not cross {LINK}: {p}")
    lk = _link(lc)
    return Transfer(p.link_measured_gbps * 1e3, p.link_bound, p.kv_bytes, p.ttft_ms, lk.placement_gbps * 1e3,
                    lk.rate_source)


def run(model_path: Path, rates_mbps: list[float], per_phase: int, prompt_tokens: int, configured_mbps: float,
        rtt_ms: float) -> list[Phase]:
    """Brings the cities and the cluster up, runs the phases, tears down."""
    cfg = parse_config(config(configured_mbps, rtt_ms))
    state_dir = Path(tempfile.mkdtemp(prefix="kvrelay-link-track-"))
    st = cities.up(cfg, state_dir, subnet="10.220.0.0/16", prefix="kvlt")
    phases: list[Phase] = []
    try:
        lc = LocalCluster(cfg, model_path, cities=st)
        try:
            lc.start()
            first = 1000
            for mbps in rates_mbps:
                cities.set_link_rate(state_dir, "toronto", "montreal", mbps / 1e3)
                phase = Phase(mbps)
                phases.append(phase)
                for _ in range(per_phase):
                    phase.transfers.append(_one(lc, list(range(first, first + prompt_tokens))))
                    first += prompt_tokens
                    print(f"  {mbps:g} Mbit/s: transfer {len(phase.transfers)}: "
                          f"{phase.transfers[-1].mbps:.1f} Mbit/s, bound {phase.transfers[-1].bound}, "
                          f"placement uses {phase.transfers[-1].placement_mbps:.1f} "
                          f"({phase.transfers[-1].source})", flush=True)
        finally:
            lc.stop()
    finally:
        cities.down(state_dir)
    return phases


def summary(phases: list[Phase]) -> dict:
    """Per phase: the shaped rate, transfers to track, and its transfers' rates (the --json fields)."""
    return {"phases": [{"shaped_mbps": ph.shaped_mbps, "transfers_to_track": ph.to_track,
                        "bound": sum(t.bound for t in ph.transfers), "transfers": len(ph.transfers),
                        "median_transfer_mbps": sorted(t.mbps for t in ph.transfers)[len(ph.transfers) // 2],
                        "last_placement_mbps": ph.transfers[-1].placement_mbps,
                        "rows": [asdict(t) for t in ph.transfers]} for ph in phases]}


def write(phases: list[Phase], out: Path, meta: dict) -> str:
    """Writes link-track.json and returns the summary text."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"meta": meta, **summary(phases)}
    (out / "link-track.json").write_text(json.dumps(data, indent=2))
    lines = ["SHAPED MBIT/S  TRANSFERS TO TRACK  LINK-BOUND  MEDIAN TRANSFER MBIT/S  PLACEMENT USES AT THE END"]
    for ph in data["phases"]:
        lines.append(f"{ph['shaped_mbps']:>13g}  {ph['transfers_to_track']!s:>17}  "
                     f"{ph['bound']:>4}/{ph['transfers']:<5}  {ph['median_transfer_mbps']:>22.1f}  "
                     f"{ph['last_placement_mbps']:.1f}")
    return "\n".join(lines)
