"""`kvrelay` commands of the WAN emulation (cities up/down/status/check/cut/
restore/shape, bench cities, demo) and the --cities flag of serve and bench replay."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvrelay.cli.common import table
from kvrelay.cli.lazy import local
from kvrelay.launch import cities
from kvrelay.launch.cities import (
    DEFAULT_PREFIX,
    DEFAULT_STATE_DIR,
    DEFAULT_SUBNET,
    CitiesError,
    down,
    link_alive,
    link_signal,
    load_state,
    set_link_rate,
)
from kvrelay.launch.linkprobe import measure_link
from kvrelay.runtime.config import load_config


def cmd_cities_up(args: argparse.Namespace) -> int:

    st = cities.up(load_config(args.config), args.state_dir, args.subnet, args.prefix)
    print(f"kvrelay: {len(st.sites)} sites in namespaces, {len(st.links)} emulated links; "
          f"router address inside the emulation: {st.gateway}")
    print_cities(st)
    print("\nnext: kvrelay cities check   |   kvrelay serve --config FILE --cities   |   kvrelay cities down")
    return 0


def print_cities(st) -> None:

    table([("SITE", "NAMESPACE", "SITE ADDRESS", "MGMT ADDRESS")] +
           [(s.name, s.netns, s.site_addr, s.mgmt_addr) for s in st.sites])
    print()
    table([("LINK", "RTT MS", "GBPS", "DELAY LINE", "STATE")] +
           [(f"{lk.a}-{lk.b}", f"{lk.rtt_ms:g}", f"{lk.gbps:g}", str(lk.pid),
             "CUT" if lk.cut else "up" if link_alive(lk) else "DOWN (delay line gone)") for lk in st.links])


def cmd_cities_status(args: argparse.Namespace) -> int:

    st = load_state(args.state_dir)
    if st is None:
        print("kvrelay: no emulated cities are up")
        return 1
    print_cities(st)
    return 0


def cmd_cities_down(args: argparse.Namespace) -> int:

    if load_state(args.state_dir) is None:
        print("kvrelay: no emulated cities are up")
        return 0
    problems = down(args.state_dir)
    for p in problems:
        print(f"kvrelay: could not remove {p}", file=sys.stderr)
    print("kvrelay: cities down" if not problems else "kvrelay: some parts remain (see above)")
    return 1 if problems else 0


def cmd_cities_check(args: argparse.Namespace) -> int:
    """Measures every emulated link both ways against its configured RTT and rate."""

    st = load_state(args.state_dir)
    if st is None:
        raise CitiesError("no emulated cities are up (run: kvrelay cities up --config FILE)")
    rows = [("LINK", "RTT MS (SET)", "RTT MS", "GBPS (SET)", "GBPS", "OK")]
    ok_all = True
    for lk in st.links:
        for src, dst in ((lk.a, lk.b), (lk.b, lk.a)):
            m = measure_link(st.site(src).netns, st.site(dst).netns, st.site(dst).site_addr, args.seconds)
            ok = abs(m.rtt_ms - lk.rtt_ms) <= 0.1 * lk.rtt_ms and abs(m.gbps - lk.gbps) <= 0.15 * lk.gbps
            ok_all &= ok
            rows.append((f"{src}->{dst}", f"{lk.rtt_ms:g}", f"{m.rtt_ms:.2f}", f"{lk.gbps:g}", f"{m.gbps:.3f}",
                         "yes" if ok else "NO"))
    table(rows)
    print("\n(OK: RTT within 10% and one TCP stream's rate within 15% of the configured figures)")
    return 0 if ok_all else 1


def cmd_cities_cut(args: argparse.Namespace) -> int:

    a, b = args.link
    link_signal(args.state_dir, a, b, cut=args.cities_command == "cut")
    print(f"kvrelay: link {a}-{b} {'cut' if args.cities_command == 'cut' else 'restored'}")
    return 0


def cmd_cities_shape(args: argparse.Namespace) -> int:

    a, b = args.link
    set_link_rate(args.state_dir, a, b, args.gbps)
    print(f"kvrelay: link {a}-{b} now shaped to {args.gbps:g} Gbit/s")
    return 0


def cities_flag(p: argparse.ArgumentParser) -> None:

    p.add_argument("--cities", action="store_true", help="run each site's workers in its namespace of the "
                   "emulation `kvrelay cities up` made (needs root)")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help=argparse.SUPPRESS)


def cities_for(args: argparse.Namespace):
    """The `kvrelay cities up` emulation when --cities was given, else None."""
    if not getattr(args, "cities", False):
        return None

    st = load_state(args.state_dir)
    if st is None:
        raise ValueError("--cities: no emulated cities are up (run: kvrelay cities up --config FILE)")
    return st


def add_link_track(bench) -> None:
    """`kvrelay bench link-track` (benchmarks/link_track.py)."""
    lt = bench.add_parser("link-track", help="how fast the router's measured rate of an emulated link follows "
                                             "changes of its shaped rate (root)")
    lt.add_argument("--rates", default="200,50,200", help="the link's shaped rates in turn, Mbit/s")
    lt.add_argument("--per-phase", type=int, default=10, help="requests (transfers) per rate")
    lt.add_argument("--prompt-tokens", type=int, default=500, help="each request's prompt (fresh tokens)")
    lt.add_argument("--configured-mbps", type=float, default=1000.0, help="the link's rate in the config")
    lt.add_argument("--rtt-ms", type=float, default=20.0, help="the link's RTT")
    lt.add_argument("--out", required=True, help="directory for link-track.json")
    lt.add_argument("--json", help="also write the summary to this file")
    lt.set_defaults(func=local("cmd_bench_link_track"))


def add_parsers(sub, bench) -> None:

    bc = bench.add_parser("cities", help="one trace slice against colocated, same-city, 60 ms-away and "
                                         "three-city deployments (emulated WAN when root)")
    bc.add_argument("--trace", type=Path, default=None, help="trace file (default: the shipped Azure code slice)")
    bc.add_argument("--format", choices=["azure", "mooncake"])
    bc.add_argument("--limit", type=int, default=40)
    bc.add_argument("--speedup", type=float, default=1.0)
    bc.add_argument("--length-scale", type=float, default=0.1)
    bc.add_argument("--slo-ttft", type=float, default=2.0)
    bc.add_argument("--slo-tpot", type=float, default=0.5)
    bc.add_argument("--seed", type=int, default=0)
    bc.add_argument("--only", help="comma-separated scenario names")
    bc.add_argument("--no-progress", action="store_true")
    bc.add_argument("--out", required=True)
    bc.add_argument("--codecs", action="store_true", help="compare the KV codecs (none, int8, fp8, int4) on one "
                    "slow link instead: prefill in Toronto, decode in Vancouver, long prompts only")
    bc.add_argument("--link-mbps", type=float, help="--codecs: the link's rate, Mbit/s (default 200)")
    bc.add_argument("--link-rtt-ms", type=float, help="--codecs: the link's RTT, ms (default 30)")
    bc.add_argument("--prompt-tokens", help="--codecs: the prompts' length range, LO-HI tokens after "
                                            "--length-scale (default 2000-8000)")
    bc.add_argument("--gap-s", type=float, help="--codecs: seconds between arrivals (default 20)")
    bc.set_defaults(func=local("cmd_bench_cities"))

    add_link_track(bench)

    ci = sub.add_parser("cities", help="emulate the config's sites as cities joined by WAN links (root)")
    cis = ci.add_subparsers(dest="cities_command", required=True)
    cu = cis.add_parser("up", help="a network namespace per site, links with the configured RTT and rate")
    cu.add_argument("--config", required=True, help="cluster config YAML with sites and links")
    cu.add_argument("--subnet", default=DEFAULT_SUBNET, help="IPv4 /16 the emulation takes addresses from")
    cu.add_argument("--prefix", default=DEFAULT_PREFIX, help="namespace and interface name prefix (1-5 characters)")
    cu.set_defaults(func=cmd_cities_up)
    cd = cis.add_parser("down", help="remove the namespaces, links and delay lines")
    cd.set_defaults(func=cmd_cities_down)
    cs = cis.add_parser("status", help="sites, addresses and links of the running emulation")
    cs.set_defaults(func=cmd_cities_status)
    cc = cis.add_parser("check", help="measure every link's RTT and TCP rate against the configured ones")
    cc.add_argument("--seconds", type=float, default=4.0, help="bulk transfer time per direction")
    cc.set_defaults(func=cmd_cities_check)
    for verb, text in (("cut", "drop every packet on a link (fault injection)"), ("restore", "undo cut")):
        cx = cis.add_parser(verb, help=text)
        cx.add_argument("link", nargs=2, metavar="SITE", help="the link's two sites")
        cx.set_defaults(func=cmd_cities_cut)
    sh = cis.add_parser("shape", help="change a link's rate while the emulation runs (its RTT stays)")
    sh.add_argument("link", nargs=2, metavar="SITE", help="the link's two sites")
    sh.add_argument("--gbps", type=float, required=True, help="the new rate, Gbit/s")
    sh.set_defaults(func=cmd_cities_shape)
    for c in (cu, cd, cs, cc, sh, *[cis.choices[v] for v in ("cut", "restore")]):
        c.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help="where the emulation's "
                       "state and delay-line logs live (default: %(default)s)")

    dm = sub.add_parser("demo", help="three cities over emulated WAN links, a short trace replay, the summary")
    dm.add_argument("--requests", type=int, default=20, help="requests of the Azure code trace to replay")
    dm.add_argument("--slo-ttft", type=float, default=10.0, help="TTFT objective, seconds")
    dm.add_argument("--slo-tpot", type=float, default=1.0, help="TPOT objective, seconds")
    dm.add_argument("--out", help="report directory (default: a new temporary one)")
    dm.set_defaults(func=local("cmd_demo"))
