"""KV transfer over an emulated WAN link against the link's own TCP rate
(``kvrelay bench kv --wan``, as root): ``kvrelay cities`` brings up two
sites joined by a 1 Gbit/s, 60 ms link (namespaces, TUN delay line, tbf);
our transfer (aead, the default) and a plain raw TCP transfer of the same
bytes with the same streams run alternately from site a to a receiver in
site b, so both meet the same link and the same machine load.

    python -m kvrelay.benchmarks.kv_wan child NETNS_B HOST_B MIB STREAMS REPEAT
        (inside site a's namespace) prints one JSON line: ours_s, raw_s
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from kvrelay.benchmarks import kv_bench
from kvrelay.benchmarks.kv_bench import KVBenchResult
from kvrelay.launch import cities
from kvrelay.runtime.config import parse_config

WAN = {"sites": [{"name": "a"}, {"name": "b"}], "links": [{"between": ["a", "b"], "rtt_ms": 60, "gbps": 1}]}
PREFIX = "kvb"


def wan_link_ratio(mib: int = 128, streams: int = 4, repeat: int = 3) -> dict:
    """Ours and the link's TCP rate, GB/s, and their ratio (root: kvrelay cities)."""
    cities.check_privileges()
    with tempfile.TemporaryDirectory() as state:
        st = cities.up(parse_config(WAN), Path(state), prefix=PREFIX)
        try:
            a, b = st.site("a"), st.site("b")
            cmd = ["ip", "netns", "exec", a.netns, sys.executable, "-m", "kvrelay.benchmarks.kv_wan", "child", b.netns,
                   b.site_addr, str(mib), str(streams), str(repeat)]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
        finally:
            cities.down(Path(state))
    if out.returncode:
        raise RuntimeError(f"WAN measurement failed: {out.stderr[-800:]}")
    res = json.loads(out.stdout.strip().splitlines()[-1])
    nbytes = res["nbytes"]
    ours, link = nbytes / statistics.median(res["ours_s"]) / 1e9, nbytes / statistics.median(res["raw_s"]) / 1e9
    return {"wan_size_mib": round(nbytes / 2**20, 2), "wan_streams": streams, "wan_ours_gbps": round(ours, 4),
            "wan_link_tcp_gbps": round(link, 4), "wan_link_ratio": round(ours / link, 3)}


def add_wan(res: KVBenchResult) -> None:
    """Adds the WAN link's figures to ``res``."""
    link = wan_link_ratio()
    res.extra |= link
    res.wan_link_ratio = link["wan_link_ratio"]


def _child(netns_b: str, host_b: str, mib: int, streams: int, repeat: int) -> None:
    kv_bench.PEER_NETNS, kv_bench.PEER_HOST = netns_b, host_b
    n = max(1, round(mib * 2**20 / kv_bench.PER_BLOCK))
    nbytes = n * kv_bench.PER_BLOCK
    ours_s, raw_s = [], []
    for _ in range(repeat):
        ours_s += kv_bench.ours(n, streams, 1)
        raw_s += kv_bench.raw(nbytes, streams, 1)
    print(json.dumps({"nbytes": nbytes, "ours_s": ours_s, "raw_s": raw_s}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "child":
        _child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
