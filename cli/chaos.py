"""`kvrelay bench replay --chaos RATE`: the same requests twice, each time
on a freshly started cluster: once without faults, once while
benchmarks/chaos.py kills and restarts workers, cuts emulated links (with
--cities) and restarts the router. Then request by request: nothing lost,
every output identical (the replay is greedy), and what recovery cost."""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from kvrelay.benchmarks.chaos import (
    Chaos,
    ChaosConfig,
    compare,
    comparison_markdown,
    router_counters,
)
from kvrelay.benchmarks.replay import build_report, replay, write_report
from kvrelay.cli.replay_run import replay_config, replay_prompts, run_meta
from kvrelay.launch.local import LocalCluster

CLIENT_RETRIES = 50
"""Times the replay client sends a request again after UNAVAILABLE (the
router restarting): what any client of a service that restarts must do."""


def run_chaos(args: argparse.Namespace, reqs, cfg, model_path: Path, cities) -> int:

    rcfg = replay_config(args)
    rcfg.retries = CLIENT_RETRIES
    ccfg = ChaosConfig(args.chaos, seed=args.chaos_seed, link_down_s=args.chaos_link_down)
    out = Path(args.out)
    meta: dict
    prompts, meta, runs = None, {}, {}
    for name in ("baseline", "chaos"):
        cluster = LocalCluster(cfg, model_path, cities=cities)
        cluster.start()
        address = cluster.addresses  # several routers: requests go to each in turn, and move on when one dies
        chaos = counters = None
        try:
            if prompts is None:
                got = replay_prompts(args, reqs, address, cluster.client_dialer)
                if isinstance(got, int):
                    return got
                prompts, meta = got
            run = meta | run_meta(reqs, address, cluster) | {"run": name}
            if name == "chaos":
                chaos = Chaos(cluster, ccfg, args.state_dir if cities is not None else None)
                chaos.start()
            records, samples = asyncio.run(replay(address, prompts, rcfg, cluster.client_dialer,
                                                  cluster.operator_dialer))
            counters = router_counters(cluster.metrics_address)
        finally:
            faults = chaos.stop() if chaos is not None else []
            cluster.stop()
        write_report(build_report(records, samples, rcfg, run), out / name)
        runs[name] = (records, faults, counters)
    result = compare(runs["baseline"][0], *runs["chaos"][:2])
    result["router_counters"] = runs["chaos"][2]
    result["chaos"] = {"rate_per_min": ccfg.rate_per_min, "seed": ccfg.seed, "link_down_s": ccfg.link_down_s,
                       "wan_emulation": cities is not None}
    (out / "chaos.json").write_text(json.dumps(result, indent=2))
    text = comparison_markdown(result)
    (out / "chaos.md").write_text(text)
    print(text)
    print(f"reports: {out / 'baseline'}, {out / 'chaos'}")
    return 0 if not result["lost"] and not result["outputs_differ"] and not result["baseline_failed"] else 1


def add_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--chaos", type=float, metavar="RATE",
                   help="faults per minute: replay once without faults, then again on a fresh cluster while "
                        "killing workers, cutting links (--cities) and restarting the router; compare")
    p.add_argument("--chaos-seed", type=int, default=0, help="seed of the fault schedule")
    p.add_argument("--chaos-link-down", type=float, default=3.0, help="seconds a cut link stays down")
