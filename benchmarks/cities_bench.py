"""``kvrelay bench cities``: one trace slice replayed against several
deployments of the three-city example, each over emulated WAN links when
run as root, so an operator can see what placing pools in one city or
another costs:

- colocated: two decode workers in Toronto, each computing its own prompts;
- same city: prefill and decode workers both in Toronto (disaggregated over
  the site's local network);
- 60 ms away: prefill in Toronto, decode in Vancouver (Toronto-Vancouver link);
- three cities with the cost_model policy, and the same with round_robin.

Every deployment has the same trace slice, seed and length scale; each runs
in a fresh cluster (and fresh namespaces) so no cache carries over.

``--codecs`` compares instead the KV codecs (kvtransfer/codecs.py) on one
link slow enough to be the bottleneck: prefill in Toronto, decode in
Vancouver, the link shaped to ``--link-mbps`` and ``--link-rtt-ms``, one
deployment per codec (none, int8, fp8, int4, and auto among none, int8 and
int4: router/placement/codec_choice.py), on a slice of long prompts
(:func:`long_slice`) sent far enough apart that none waits for another."""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

from kvrelay.benchmarks.replay import ReplayConfig, build_report, replay, write_report
from kvrelay.benchmarks.traces import ScaledRequest, TraceRequest
from kvrelay.launch import cities
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "three-cities.yaml"


@dataclass(slots=True)
class Scenario:
    name: str
    what: str
    config: dict


def _pools(prefill: int, decode: int) -> dict:
    return {"prefill": {"replicas": prefill}, "decode": {"replicas": decode}}


def scenarios(example: dict) -> list[Scenario]:
    """The deployments compared, derived from the three-city example (same
    model, cache, threads, link figures)."""
    site = {s["name"]: s for s in example["sites"]}
    link = {frozenset(lk["between"]): lk for lk in example["links"]}
    tor_van = link[frozenset(("toronto", "vancouver"))]
    forced = {"policy": "least_loaded", "colocate_below_tokens": 0}  # always disaggregated

    def variant(sites: list[dict], links: list[dict], placement: dict) -> dict:
        cfg = copy.deepcopy(example)
        cfg["sites"], cfg["links"] = sites, links
        router = cfg.get("router", {})
        cfg["router"] = {**router, "placement": {**router.get("placement", {}), **placement}, "port": 0}
        return cfg

    tor = lambda p, d: {**site["toronto"], **_pools(p, d)}  # noqa: E731
    van = lambda p, d: {**site["vancouver"], **_pools(p, d)}  # noqa: E731
    return [
        Scenario("colocated", "2 decode workers in Toronto, each prefills its own prompts",
                 variant([tor(0, 2)], [], {"policy": "least_loaded"})),
        Scenario("same-city", "prefill and decode in Toronto (local network)",
                 variant([tor(1, 1)], [], forced)),
        Scenario("decode-60ms", f"prefill in Toronto, decode in Vancouver ({tor_van['rtt_ms']:g} ms, "
                                f"{tor_van['gbps']:g} Gbit/s)",
                 variant([tor(1, 0), van(0, 1)], [tor_van], forced)),
        Scenario("3cities-cost_model", "the three-city example, cost_model placement",
                 variant(example["sites"], example["links"], {"policy": "cost_model"})),
        Scenario("3cities-round_robin", "the three-city example, round_robin placement",
                 variant(example["sites"], example["links"], {"policy": "round_robin"})),
    ]


CODECS = ("none", "int8", "fp8", "int4", "auto")
AUTO_CODECS = ["none", "int8", "int4"]
"""What the ``auto`` deployment chooses among (fp8 sends int8's bytes with more loss: benchmarks/RESULTS.md)."""


def codec_scenarios(example: dict, mbps: float, rtt_ms: float) -> list[Scenario]:
    """One deployment per KV codec: prefill in Toronto, decode in Vancouver, over one link of ``mbps`` Mbit/s
    and ``rtt_ms`` (bytes over tcp: a coded link never pulls)."""
    site = {s["name"]: s for s in example["sites"]}
    out = []
    for codec in CODECS:
        cfg = copy.deepcopy(example)
        cfg["sites"] = [{**site["toronto"], **_pools(1, 0)}, {**site["vancouver"], **_pools(0, 1)}]
        cfg["links"] = [{"between": ["toronto", "vancouver"], "rtt_ms": rtt_ms, "gbps": mbps / 1000,
                         "transport": "tcp", "kv_codec": codec}]
        cfg["kv"] = {**cfg.get("kv", {}), "auto_codecs": AUTO_CODECS}
        router = cfg.get("router", {})
        cfg["router"] = {**router, "port": 0, "placement": {**router.get("placement", {}), "policy": "least_loaded",
                                                            "colocate_below_tokens": 0}}
        out.append(Scenario(f"codec-{codec}", f"prefill Toronto, decode Vancouver, {mbps:g} Mbit/s and "
                                              f"{rtt_ms:g} ms, KV codec {codec}", cfg))
    return out


def long_slice(reqs: list[TraceRequest], scale: float, lo: int, hi: int, limit: int, gap_s: float
               ) -> list[TraceRequest]:
    """The first ``limit`` requests whose scaled prompt has ``lo``-``hi`` tokens, re-timed ``gap_s`` apart."""
    picked = [r for r in reqs if lo <= round(r.input_tokens * scale) <= hi][:limit]
    return [dataclasses.replace(r, arrival_s=i * gap_s) for i, r in enumerate(picked)]


def run_scenario(sc: Scenario, model_path: Path, prompts: list[ScaledRequest], rcfg: ReplayConfig,
                 emulate: bool, out: Path, meta: dict) -> dict:
    """Brings up (namespaces and) a cluster for one scenario, replays, tears down."""
    cfg = parse_config(sc.config)
    state_dir = Path(tempfile.mkdtemp(prefix="kvrelay-bench-cities-"))
    st = cities.up(cfg, state_dir, subnet="10.218.0.0/16", prefix="kvbc") if emulate else None
    try:
        lc = LocalCluster(cfg, model_path, cities=st)
        try:
            address = lc.start()
            records, samples = asyncio.run(replay(address, prompts, rcfg, lc.client_dialer, lc.operator_dialer))
        finally:
            lc.stop()
    finally:
        if st is not None:
            cities.down(state_dir)
    report = build_report(records, samples, rcfg, {**meta, "scenario": sc.name, "what": sc.what,
                                                   "policy": cfg.router.placement.policy, "wan_emulation": emulate,
                                                   "config": cfg.to_dict(), "router": address})
    write_report(report, out / sc.name)
    return report


def summary_row(name: str, what: str, report: dict) -> dict:
    s = report["summary"]
    recs = report["requests"]
    coloc = sum(1 for r in recs if (r.get("placement") or {}).get("colocated")) / max(1, len(recs))
    tails = [(r.get("placement") or {}).get("kv_transfer_ms", 0.0) for r in recs if r.get("placement")]
    return {"scenario": name, "what": what, "completed": s["completed"], "failed": s["failed"],
            "ttft_mean_ms": s["ttft_ms"]["mean"], "ttft_p50_ms": s["ttft_ms"]["p50"],
            "ttft_p99_ms": s["ttft_ms"]["p99"], "tpot_p50_ms": s["tpot_ms"]["p50"],
            "tpot_p99_ms": s["tpot_ms"]["p99"], "e2e_p50_ms": s["e2e_ms"]["p50"],
            "throughput_tok_s": s["total_token_throughput_tps"], "slo_attainment": s["slo_attainment"],
            "kv_mib": sum(row["kv_bytes"] for row in report["per_link"].values()) / 2**20,
            "colocated_fraction": coloc, "kv_tail_ms_mean": sum(tails) / max(1, len(tails))}


def format_rows(rows: list[dict]) -> str:
    head = ("| scenario | TTFT mean / p50 / p99 ms | TPOT p50 / p99 ms | E2E p50 ms | tok/s | SLO met | "
            "KV MiB moved | exposed KV tail, mean ms | colocated | failed |\n|---|---|---|---|---|---|---|---|---|---|")
    body = [f"| {r['scenario']} | {r['ttft_mean_ms']:.0f} / {r['ttft_p50_ms']:.0f} / {r['ttft_p99_ms']:.0f} | "
            f"{r['tpot_p50_ms']:.0f} / {r['tpot_p99_ms']:.0f} | {r['e2e_p50_ms']:.0f} | "
            f"{r['throughput_tok_s']:.0f} | {r['slo_attainment']:.0%} | {r['kv_mib']:.0f} | "
            f"{r['kv_tail_ms_mean']:.0f} | {r['colocated_fraction']:.0%} | {r['failed']} |" for r in rows]
    return "\n".join([head, *body])


def load_example() -> dict:
    return yaml.safe_load(EXAMPLE.read_text())


def write_summary(rows: list[dict], out: Path, meta: dict) -> str:
    table = format_rows(rows)
    (out / "summary.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    (out / "summary.md").write_text(table + "\n")
    return table
