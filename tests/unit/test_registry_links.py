"""Link health from the workers' probes (router/cluster/registry.py): a link goes down
on a failed probe and up on a successful one, and a probe that was already
running when the link changed cannot undo that change."""

from __future__ import annotations

import asyncio
import time

from kvrelay.router.cluster.registry import WorkerRegistry
from kvrelay.runtime.config import parse_config
from kvrelay.runtime.roles import Role
from kvrelay.v1 import worker_pb2 as wpb

CONFIG = {"sites": [{"name": "toronto"}, {"name": "montreal"}],
          "links": [{"between": ["toronto", "montreal"], "rtt_ms": 20, "gbps": 1}]}


def _beat(reg: WorkerRegistry, worker_id: str, *reports: wpb.LinkReport) -> wpb.HeartbeatResponse:
    return reg.heartbeat(wpb.HeartbeatRequest(load=wpb.WorkerLoad(worker_id=worker_id), links=reports))


def _report(site: str, reachable: bool) -> wpb.LinkReport:
    return wpb.LinkReport(site=site, reachable=reachable, error="" if reachable else "no answer within 0.5 s")


async def _run() -> None:
    reg = WorkerRegistry(parse_config(CONFIG))
    await reg.register(wpb.WorkerInfo(worker_id="toronto/prefill/0", role=Role.PREFILL.proto, site="toronto",
                                      address="127.0.0.1:1"))
    await reg.register(wpb.WorkerInfo(worker_id="montreal/decode/0", role=Role.DECODE.proto, site="montreal",
                                      address="127.0.0.1:2"))
    link = reg.links[frozenset(("toronto", "montreal"))]
    down = reg.link_down_event("toronto", "montreal")
    try:
        # each side probes the other; heartbeats name the targets
        assert [t.site for t in _beat(reg, "montreal/decode/0").probes] == ["toronto"]
        _beat(reg, "toronto/prefill/0")
        time.sleep(0.01)
        _beat(reg, "montreal/decode/0", _report("toronto", False))  # the link is cut
        assert not link.up and down.is_set()
        assert "montreal/decode/0 could not reach toronto" in reg.link_health[frozenset(("toronto", "montreal"))].reason
        # toronto's probe was already running when montreal's report marked the link down: its
        # success predates the cut as far as the router can tell, so it does not bring the link back
        _beat(reg, "toronto/prefill/0", _report("montreal", True))
        assert not link.up
        time.sleep(0.01)
        _beat(reg, "toronto/prefill/0", _report("montreal", True))  # started after the change: restored
        assert link.up and not reg.link_down_event("toronto", "montreal").is_set()
        # montreal's probe, started while the link was still cut, reports late: ignored
        _beat(reg, "montreal/decode/0", _report("toronto", False))
        assert link.up
        time.sleep(0.01)
        _beat(reg, "montreal/decode/0", _report("toronto", False))  # a fresh failure counts again
        assert not link.up
    finally:
        await reg.close()


def test_stale_probes_cannot_undo_a_link_change():
    asyncio.run(_run())


async def _queue_as_placement_sees_it() -> list[int]:
    reg = WorkerRegistry(parse_config(CONFIG))
    wid = "toronto/prefill/0"
    await reg.register(wpb.WorkerInfo(worker_id=wid, role=Role.PREFILL.proto, site="toronto", address="127.0.0.1:1"))
    reg.view()  # the placement view: the record writes through to its row
    rec = reg.workers[wid]
    seen = []

    def beat(queued: int) -> None:
        reg.heartbeat(wpb.HeartbeatRequest(load=wpb.WorkerLoad(worker_id=wid, queued_prefill_tokens=queued)))
        seen.append(rec.row.queued_prefill_tokens)

    try:
        beat(1000)
        rec.pending_prefill_tokens += 500  # this router sends a prompt: counted at once
        seen.append(rec.row.queued_prefill_tokens)
        beat(1500)  # the worker's next heartbeat has it queued: not counted twice
        rec.pending_prefill_tokens -= 500  # its first token came back: gone at once, not a heartbeat later
        seen.append(rec.row.queued_prefill_tokens)
        rec.pending_prefill_tokens += 300
        rec.pending_prefill_tokens -= 300  # sent and prefilled between two heartbeats
        seen.append(rec.row.queued_prefill_tokens)
        beat(0)
    finally:
        await reg.close()
    return seen


def test_placement_sees_the_heartbeats_queue_plus_this_routers_changes_since():
    assert asyncio.run(_queue_as_placement_sees_it()) == [1000, 1500, 1500, 1000, 1000, 0]
