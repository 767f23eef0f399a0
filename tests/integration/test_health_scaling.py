"""What the Kubernetes deployment needs of kvrelay's processes: probe
endpoints (runtime/health.py) over a real socket, pools sized by an
orchestrator (router.pools.scaling: external), and workers named after their pods."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kvrelay.router.cluster.pools import PoolManager
from kvrelay.router.cluster.registry import WorkerRegistry
from kvrelay.router.frontends.admin import external_scaling_hint
from kvrelay.runtime.config import ConfigError, ScalingOwner, parse_config
from kvrelay.runtime.health import HealthChecks, serve_health
from kvrelay.runtime.roles import Role
from kvrelay.runtime.worker import WorkerStatus, parse_args
from kvrelay.v1 import worker_pb2 as wpb
from tests.probes import probe


def _get(port: int, path: str) -> tuple[int, dict]:
    return probe(port, path, timeout_s=30.0)


def test_probes_answer_live_ready_and_a_stuck_loop():
    async def run():
        loop = asyncio.get_running_loop()
        status = WorkerStatus()
        engine = {"problem": None}
        server = serve_health("127.0.0.1", 0, HealthChecks(loop, lambda: engine["problem"], status.not_ready))
        try:
            got = [await asyncio.to_thread(_get, server.port, p) for p in ("/livez", "/readyz")]
            status.registered = True
            got.append(await asyncio.to_thread(_get, server.port, "/readyz"))
            status.draining = True
            got.append(await asyncio.to_thread(_get, server.port, "/readyz"))
            engine["problem"] = "the engine thread died"
            got.append(await asyncio.to_thread(_get, server.port, "/livez"))
            got.append(await asyncio.to_thread(_get, server.port, "/metrics"))
            # the loop blocked (no await) until the probe has answered: not live
            out = []
            t = threading.Thread(target=lambda: out.append(_get(server.port, "/livez")))
            t.start()
            t.join(60)  # blocks this loop while the probe waits for it
            got.append(out[0])
            return got
        finally:
            server.close()
    live, not_registered, ready, draining, dead, other, stuck = asyncio.run(run())
    assert live == (200, {"status": "ok"})
    assert not_registered == (503, {"status": "fail", "reason": "not registered with the router"})
    assert ready == (200, {"status": "ok"})
    assert draining[0] == 503 and draining[1]["reason"].startswith("draining")
    assert dead == (503, {"status": "fail", "reason": "the engine thread died"})
    assert other[0] == 404
    assert stuck[0] == 503 and "event loop did not answer" in stuck[1]["reason"]


def test_a_taken_probe_port_is_a_clear_exit():
    async def run():
        first = serve_health("127.0.0.1", 0, HealthChecks(asyncio.get_running_loop(), lambda: None, lambda: None))
        try:
            with pytest.raises(SystemExit, match=f"health: cannot listen on 127.0.0.1:{first.port}"):
                serve_health("127.0.0.1", first.port, HealthChecks(asyncio.get_running_loop(), lambda: None,
                                                                   lambda: None))
        finally:
            first.close()
    asyncio.run(run())
    assert serve_health("127.0.0.1", None, None) is None  # off by default


@pytest.mark.parametrize("raw, message", [
    ({"health": {"worker_port": -2}}, "health.worker_port: must be a port"),
    ({"health": {"router_port": 70000}}, "health.router_port: must be <= 65535"),
    ({"router": {"pools": {"scaling": "kubernetes"}}}, "router.pools.scaling: must be kvrelay or external"),
])
def test_config_refuses(raw, message):
    with pytest.raises(ConfigError, match=message):
        parse_config(raw)


def _pools(scaling: str):
    cfg = parse_config({"router": {"pools": {"scaling": scaling}}, "sites": [{"name": "t", "decode": {"replicas": 1}}]})
    reg = WorkerRegistry(cfg)
    return cfg, reg, PoolManager(cfg, reg)


async def _register(reg: WorkerRegistry, n: int) -> None:
    for i in range(n):
        await reg.register(wpb.WorkerInfo(worker_id=f"t/decode/pod-{i}", role=Role.DECODE.proto, site="t",
                                          address=f"127.0.0.1:{1000 + i}"))


def test_external_scaling_keeps_every_worker_the_orchestrator_runs():
    async def run(scaling):
        _, reg, pools = _pools(scaling)
        try:
            await _register(reg, 3)
            drained = pools.trim("t", Role.DECODE)
            return drained, pools.status("t", Role.DECODE)
        finally:
            await reg.close()
    drained, status = asyncio.run(run("external"))
    assert drained == [] and status.desired == 3 and status.active == 3
    # the router's own pools (launchers) drain the excess instead
    drained, status = asyncio.run(run("kvrelay"))
    assert len(drained) == 2 and status.desired == 1


def test_drain_under_external_scaling_is_a_graceful_restart():
    async def run():
        _, reg, pools = _pools("external")
        try:
            await _register(reg, 2)
            return pools.drain("t/decode/pod-0"), pools.desired[("t", "decode")]
        finally:
            await reg.close()
    status, desired = asyncio.run(run())
    assert status.draining == 1 and status.desired == 1 and desired == 1  # the config's size is untouched


def test_scale_refusal_says_what_to_change():
    from kvrelay.v1 import admin_pb2 as apb
    hint = external_scaling_hint(apb.ScaleRequest(site="montreal", role="decode", replicas=3))
    assert "router.pools.scaling: external" in hint and "helm upgrade" in hint and "kubectl scale" in hint
    assert parse_config({}).router.pools.scaling is ScalingOwner.KVRELAY  # the local default keeps kvrelay scale


def test_a_worker_takes_its_pod_name():
    args = parse_args(Role.DECODE, ["--model-path", "m", "--router", "r:1", "--site", "s",
                                    "--name", "kvrelay-s-decode-7d9f8c6b5d-x2b4q"])
    assert args.index == "kvrelay-s-decode-7d9f8c6b5d-x2b4q"
    assert parse_args(Role.DECODE, ["--model-path", "m", "--router", "r:1", "--site", "s"]).index == 0
    for bad in ("Pod-A", "-x", "a" * 64, "a/b"):
        with pytest.raises(SystemExit):
            parse_args(Role.DECODE, ["--model-path", "m", "--router", "r:1", "--site", "s", "--name", bad])
    with pytest.raises(SystemExit):  # one or the other
        parse_args(Role.DECODE, ["--model-path", "m", "--router", "r:1", "--site", "s", "--name", "a",
                                 "--index", "1"])
