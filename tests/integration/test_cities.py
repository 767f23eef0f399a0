"""WAN emulation (`kvrelay cities`): two sites in their own network
namespaces, joined by an emulated link (tbf for the rate, the user-space
delay line for the delay). Measured with real TCP; then a real cluster runs
across it. Needs root, iproute2 and /dev/net/tun (CI runs as root)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest

from kvrelay.cli.main import main
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.launch import cities
from kvrelay.launch.linkprobe import measure_link, measure_rtt, measure_throughput
from kvrelay.launch.local import LocalCluster
from kvrelay.runtime.config import parse_config
from kvrelay.v1 import inference_pb2 as ipb
from kvrelay.v1 import inference_pb2_grpc as igrpc
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import wait_until, worker_stats, workers

RTT_MS, GBPS = 20.0, 0.5
RTT_FLOOR_MS = RTT_MS - 5.0
"""The least RTT the link may show: the delay line forwards a packet up to 2 ms
ahead of its deadline (its wake-up allowance, launch/delayline.py), each way."""
PREFIX, SUBNET = "kvtc", "10.216.0.0/16"

CONFIG = {
    "router": {"port": 0, "placement": {"policy": "least_loaded", "colocate_below_tokens": 0},
               "liveness": {"heartbeat_interval_s": 0.25, "link_probe_timeout_s": 0.5}},
    "sites": [{"name": "toronto", "jurisdiction": "CA-ON", "prefill": {"replicas": 1}, "decode": {"replicas": 0}},
              {"name": "montreal", "jurisdiction": "CA-QC", "prefill": {"replicas": 0}, "decode": {"replicas": 1}}],
    "links": [{"between": ["toronto", "montreal"], "rtt_ms": RTT_MS, "gbps": GBPS, "transport": "tcp"}],
    "workers": {"threads": 1},
    "cache": {"memory_gib": 0.25},
}

serial = pytest.mark.serial  # link rates and heartbeats across the emulated cities: measured alone
needs_root = pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/dev/net/tun").exists() or not shutil.which("tc"),
    reason="WAN emulation needs root, /dev/net/tun and iproute2's tc")


def _purge(prefix: str) -> None:
    """Removes what an earlier, interrupted run of these tests left behind."""
    for ns in _netns_names():
        if ns.startswith(f"{prefix}-"):
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
    for dev in Path("/sys/class/net").glob(f"{prefix}-*"):
        subprocess.run(["ip", "link", "del", dev.name], capture_output=True)


@pytest.fixture(scope="module")
def emulated(tmp_path_factory):
    _purge(PREFIX)
    state_dir = tmp_path_factory.mktemp("cities")
    st = cities.up(parse_config(CONFIG), state_dir, SUBNET, PREFIX)
    yield st, state_dir
    assert cities.down(state_dir) == []


def _netns_names() -> list[str]:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()


@needs_root
@serial
def test_link_has_the_configured_rtt_and_rate(emulated):
    """The link delays and shapes, in both directions. Bounds that hold on a
    busy CI machine (load only adds delay and takes throughput): the RTT is
    never below the configured one (but for the delay line's wake-up
    allowance) and not far above it; the rate never exceeds the configured
    one (plus the measurement's margin), lies far below what the same sockets
    move without the link in this run, and stays above a generous floor.
    Exact figures are benchmarks' business (`kvrelay cities check`,
    benchmarks/RESULTS.md)."""
    st, _ = emulated
    tor, mtl = st.site("toronto"), st.site("montreal")
    unshaped = measure_throughput(tor.netns, tor.netns, tor.site_addr, seconds=1.5, warmup_s=0.5) * 8 / 1e9
    ceiling = GBPS * 1.2
    assert unshaped >= 2 * ceiling, unshaped  # else the ceiling below would not show any shaping
    for src, dst in ((tor, mtl), (mtl, tor)):
        m = measure_link(src.netns, dst.netns, dst.site_addr, seconds=3.0)
        assert m.rtt_min_ms >= RTT_FLOOR_MS, m  # the delay line never delivers (much) early
        assert m.rtt_min_ms <= 2 * RTT_MS and m.rtt_ms <= 3 * RTT_MS, m
        assert 0.2 * GBPS <= m.gbps <= ceiling, (m, unshaped)


@needs_root
@serial
def test_cut_link_drops_everything_until_restored(emulated):
    st, state_dir = emulated
    tor, mtl = st.site("toronto"), st.site("montreal")
    cities.link_signal(state_dir, "toronto", "montreal", cut=True)
    try:
        with pytest.raises(OSError):  # the connection attempt times out: packets vanish
            measure_rtt(tor.netns, mtl.netns, mtl.site_addr, samples=3, timeout_s=1.0)
        assert cities.load_state(state_dir).link("toronto", "montreal").cut
    finally:
        cities.link_signal(state_dir, "toronto", "montreal", cut=False)
    rtts = measure_rtt(tor.netns, mtl.netns, mtl.site_addr, samples=5)
    assert min(rtts) * 1e3 >= RTT_FLOOR_MS


@needs_root
def test_cities_with_no_link_cannot_reach_each_other(tmp_path):
    cfg = dict(CONFIG, links=[])
    st = cities.up(parse_config(cfg), tmp_path, "10.217.0.0/16", "kvtn")
    try:
        with pytest.raises(OSError):
            measure_rtt(st.site("toronto").netns, st.site("montreal").netns, st.site("montreal").site_addr,
                        samples=1, timeout_s=1.0)
    finally:
        assert cities.down(tmp_path) == []
    assert not [n for n in _netns_names() if n.startswith("kvtn-")]
    assert not Path("/sys/class/net/kvtn-br").exists()


@needs_root
def test_down_treats_what_is_already_gone_as_removed(tmp_path):
    """Teardown is idempotent: a namespace or device already gone (removed by
    hand, or a veth that vanished with its peer's namespace between the check
    and the delete) counts as removed; what remains is still reported."""
    _purge("kvtd")
    st = cities.up(parse_config(CONFIG), tmp_path, "10.218.0.0/16", "kvtd")
    subprocess.run(["ip", "netns", "delete", st.site("montreal").netns], check=True)  # its veth goes too
    subprocess.run(["ip", "link", "del", st.site("toronto").veth_root], check=True)
    assert cities.down(tmp_path) == []
    assert cities.load_state(tmp_path) is None and cities.down(tmp_path) == []
    assert not [n for n in _netns_names() if n.startswith("kvtd-")]
    assert not list(Path("/sys/class/net").glob("kvtd-*"))
    # the race itself: listed when checked, gone when deleted
    assert cities._remove(["ip", "link", "del", "kvtd-v9"], lambda: True, "device kvtd-v9") is None
    # a real failure is a problem: the device is still there afterwards
    fails = ["sh", "-c", "echo 'RTNETLINK answers: Operation not permitted' >&2; exit 2"]
    assert cities._remove(fails, lambda: True, "device x") == "device x: RTNETLINK answers: Operation not permitted"


@pytest.fixture(scope="module")
def cities_cluster(emulated, smollm_path):
    """The cluster of CONFIG in the emulated cities, for the tests below (each leaves its link up)."""
    lc = LocalCluster(parse_config(CONFIG), smollm_path, cities=emulated[0])
    lc.start()
    try:
        yield lc
    finally:
        lc.stop()


@needs_root
@serial
@pytest.mark.model
def test_cluster_across_the_emulated_link(cities_cluster, reference_engine):
    lc = cities_cluster
    # a probe slower than link_probe_timeout_s marks the link down (a loaded machine can starve
    # the delay line) and a request placed then is colocated in Montreal: send on an up link
    assert wait_until(lambda: _link(lc).up, 30, 0.05), _link(lc).down_reason
    prompt = list(range(1000, 1600))  # 600 tokens: ~27 MiB of KV over a 0.5 Gbit/s, 20 ms link
    with lc.channel() as ch:
        msgs = list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=prompt), max_tokens=6, ignore_eos=True), timeout=120))
    pl = msgs[-1].finish.placement
    assert (pl.prefill_site, pl.decode_site, pl.link) == ("toronto", "montreal", "montreal-toronto")
    assert pl.kv_bytes > 20 << 20
    # the transfer's tail (end of prefill to the receiver's ack) includes at least one RTT
    assert pl.kv_transfer_ms >= RTT_MS
    tokens = [t for m in msgs for t in m.token_ids]
    want = reference_engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    assert tokens == want


@needs_root
@serial
@pytest.mark.model
def test_the_router_measures_a_link_that_slowed_down(emulated, cities_cluster):
    """The link, configured at 0.5 Gbit/s, is shaped down to 0.05 while the cluster runs: the transfers
    that cross it are link-bound, each at the shaped rate, and within ten of them (the issue's goal)
    the rate placement uses is the shaped one, taken from the transfers (router.placement.link_rates:
    an average over at least 2; earlier tests' transfers may have measured the faster link first).
    `kvrelay status` shows configured vs measured, each placement the rate it used and where it came
    from. Bounds that hold on a loaded machine: a shaped link is never faster than its shaping (plus
    tbf's burst), and load only slows it; and a prefill making KV seven times faster than the link (400
    tokens in about 0.4 s) stays faster than it on a loaded machine, so the link sets the pace."""
    _, state_dir = emulated
    lc, shaped = cities_cluster, 0.05

    def tracked(lk: wpb.LinkStatus) -> bool:
        return lk.rate_source == "measured" and 0.3 * shaped <= lk.placement_gbps <= 1.15 * shaped

    cities.set_link_rate(state_dir, "toronto", "montreal", shaped)
    try:
        assert wait_until(lambda: _link(lc).up, 30, 0.05), _link(lc).down_reason
        placed: list[ipb.Placement] = []
        while len(placed) < 10 and not tracked(_link(lc)):  # 400 tokens: ~18 MB of KV, ~2.9 s at 0.05 Gbit/s
            prompt = list(range(5000 + 400 * len(placed), 5400 + 400 * len(placed)))
            placed.append(_generate(lc, prompt, 2)[-1].finish.placement)
        lk = _link(lc)
        assert tracked(lk), (lk, placed)
        for p in placed:
            assert p.link == "montreal-toronto" and p.link_bound, p
            assert 0.3 * shaped <= p.link_measured_gbps <= 1.15 * shaped, p
        assert (lk.gbps, lk.rtt_ms, lk.measured_gbps) == (GBPS, RTT_MS, lk.placement_gbps), lk
        assert lk.rate_samples >= 2 and RTT_FLOOR_MS <= lk.measured_rtt_ms <= 2 * RTT_MS, lk
        after = _generate(lc, list(range(9000, 9400)), 2)[-1].finish.placement
        assert (after.link_rate_source, after.link_gbps) == ("measured", lk.placement_gbps), after
    finally:
        cities.set_link_rate(state_dir, "toronto", "montreal", GBPS)


def _link(lc: LocalCluster) -> wpb.LinkStatus:
    with lc.channel(operator=True) as ch:
        links = wgrpc.RegistryStub(ch).ListWorkers(wpb.ListWorkersRequest(), timeout=10).links
    return next(lk for lk in links if lk.name == "montreal-toronto")


def _generate(lc: LocalCluster, prompt: list[int], max_tokens: int) -> list[ipb.GenerateResponse]:
    with lc.channel() as ch:
        return list(igrpc.InferenceStub(ch).Generate(ipb.GenerateRequest(
            token_ids=ipb.TokenIds(ids=prompt), max_tokens=max_tokens, ignore_eos=True), timeout=120))


@needs_root
@serial
@pytest.mark.model
def test_link_cut_is_detected_within_a_heartbeat_and_avoided(emulated, cities_cluster, reference_engine):
    """Cutting the only link while a prompt's KV crosses it: the workers' probes
    report it down, the router re-places the request at once (the decode worker
    computes the prompt itself; the output is unchanged), new requests avoid the
    link while it is down and use it again once it is restored."""
    _, state_dir = emulated
    liveness = CONFIG["router"]["liveness"]
    hb, probe = liveness["heartbeat_interval_s"], liveness["link_probe_timeout_s"]
    prompt = list(range(2000, 3500))  # 1,500 tokens: ~70 MiB of KV, seconds on a 0.5 Gbit/s link
    want = reference_engine.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    lc = cities_cluster
    cut = False
    try:
        assert wait_until(lambda: _link(lc).up, 30, 0.05), _link(lc).down_reason
        out: dict = {}
        t = threading.Thread(target=lambda: out.update(msgs=_generate(lc, prompt, 6)))
        t.start()
        assert wait_until(lambda: worker_stats(lc, "montreal/decode/0").kv_bytes_received > 0, 60, 0.05)
        cities.link_signal(state_dir, "toronto", "montreal", cut=True)
        cut, t_cut = True, time.monotonic()
        assert wait_until(lambda: not _link(lc).up, 10, 0.05)
        detected_s = time.monotonic() - t_cut
        # one heartbeat interval until the next probe starts, plus its timeout; on a busy
        # machine a late heartbeat may cost a second round, plus scheduling and polling slack;
        # still well before the worker timeout, and the reason below says a probe found it
        assert detected_s <= 2 * (hb + probe) + 1.0, detected_s
        down = _link(lc)
        assert "could not reach" in down.down_reason and "no answer" in down.down_reason
        t.join(120)
        fin = out["msgs"][-1].finish
        assert [tok for m in out["msgs"] for tok in m.token_ids] == want
        assert fin.placement.retries == 1 and fin.placement.colocated, fin.placement
        assert fin.placement.decode_site == "montreal"

        while_down = _generate(lc, list(range(3000, 3600)), 4)[-1].finish.placement
        assert while_down.colocated and while_down.retries == 0, while_down

        cities.link_signal(state_dir, "toronto", "montreal", cut=False)
        cut = False
        assert wait_until(lambda: _link(lc).up, 10, 0.05)
        # and the router hears from the prefill worker again (its heartbeats crossed the cut link too:
        # until one arrives, placement has no prefill worker and computes at the decode worker)
        assert wait_until(lambda: workers(lc)["toronto/prefill/0"].healthy, 30, 0.05)
        # once restored the link carries KV again, from the first request on: the connections the cut
        # left stuck were retired when their transfer failed (kvtransfer/channel.py)
        msgs = _generate(lc, list(range(4000, 4600)), 4)
        assert sum(len(m.token_ids) for m in msgs) == 4
        placed = msgs[-1].finish.placement
        assert (placed.prefill_site, placed.decode_site, placed.retries) == ("toronto", "montreal", 0), placed
    finally:
        if cut:
            cities.link_signal(state_dir, "toronto", "montreal", cut=False)


def test_plan_addresses_and_names():
    st = cities.plan(parse_config(CONFIG), "10.50.0.0/16", "ab")
    assert st.gateway == "10.50.0.1" and st.bridge == "ab-br"
    assert [(s.netns, s.site_addr, s.mgmt_addr) for s in st.sites] == [
        ("ab-toronto", "10.50.1.1", "10.50.0.10"), ("ab-montreal", "10.50.2.1", "10.50.0.11")]
    link = st.link("montreal", "toronto")
    assert (link.dev_a, link.dev_b, link.rtt_ms, link.gbps) == ("wan1", "wan0", RTT_MS, GBPS)
    assert st.matches(parse_config(CONFIG)) is None
    other = dict(CONFIG, links=[dict(CONFIG["links"][0], rtt_ms=60)])
    assert "links differ" in st.matches(parse_config(other))


@pytest.mark.parametrize("subnet,prefix,match", [
    ("10.50.0.0/24", "kvr", "/16 or larger"), ("nonsense", "kvr", "--subnet 'nonsense'"),
    ("10.50.0.0/16", "toolong", "1-5 letters"), ("10.50.0.0/16", "a-b", "1-5 letters")])
def test_plan_refuses_bad_subnets_and_prefixes(subnet, prefix, match):
    with pytest.raises(cities.CitiesError, match=match):
        cities.plan(parse_config(CONFIG), subnet, prefix)


def test_without_root_the_command_says_so(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    cfg = tmp_path / "c.yaml"
    cfg.write_text("sites: [{name: a}, {name: b}]\nlinks: [{between: [a, b], rtt_ms: 9, gbps: 1}]\n")
    assert main(["cities", "up", "--config", str(cfg), "--state-dir", str(tmp_path / "s")]) == 2
    assert "needs root" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_status_and_down_with_nothing_up(tmp_path, capsys):
    assert main(["cities", "status", "--state-dir", str(tmp_path)]) == 1
    assert main(["cities", "down", "--state-dir", str(tmp_path)]) == 0
    assert "no emulated cities are up" in capsys.readouterr().out


@needs_root
@pytest.mark.model
@pytest.mark.slow  # 41 s; CI brings up the same namespaces, links and cluster in the serial tests above
def test_demo_runs_three_cities_and_cleans_up(tmp_path, capsys):
    assert main(["demo", "--requests", "4", "--out", str(tmp_path / "demo")]) == 0
    out = capsys.readouterr().out
    assert "Toronto, Montreal and Vancouver in their own namespaces" in out and "TTFT" in out
    assert (tmp_path / "demo" / "report.json").exists() and str(tmp_path / "demo") in out
    assert not [n for n in _netns_names() if n.startswith("kvdm-")]
