"""The chaos replay's comparison (benchmarks/chaos.py): a request the fault-free run
did not complete has no output to compare, so it is not counted as different."""

from __future__ import annotations

from kvrelay.benchmarks.chaos import compare, comparison_markdown
from kvrelay.benchmarks.metrics import RequestRecord


def _record(index: int, tokens: list[int], ok: bool = True) -> RequestRecord:
    return RequestRecord(index, 0.0, 0.0, 8, 4, token_times=[0.5, 0.6] if ok else [], end_s=1.0 if ok else None,
                         error=None if ok else "RESOURCE_EXHAUSTED: shed", token_ids=tokens if ok else [])


def test_outputs_are_compared_only_where_the_fault_free_run_completed():
    base = [_record(0, [1, 2]), _record(1, [3, 4], ok=False), _record(2, [5, 6])]
    chaos = [_record(0, [1, 2]), _record(1, [3, 4]), _record(2, [5, 7])]
    result = compare(base, chaos, [])
    assert result["outputs_differ"] == [2] and result["baseline_failed"] == [1] and result["lost"] == []
    text = comparison_markdown(result | {"router_counters": None})
    assert "outputs different from the fault-free run: 1 (indexes [2]); not compared: 1 the fault-free run" in text
