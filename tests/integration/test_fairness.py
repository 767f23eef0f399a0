"""While tenant lab-a's batch job saturates the cluster (more of its requests
than the decode worker admits, the rest queued at the router), tenant
lab-b's interactive time to first token stays near its idle value, and the
job still progresses. The bound is generous (a loaded 2-core CI machine);
the measured figures are in benchmarks/RESULTS.md (`kvrelay bench fairness`)."""

from __future__ import annotations

import copy

import pytest

from kvrelay.benchmarks.fairness import FAIRNESS_CLUSTER, FairnessConfig, fairness_on
from tests.integration.helpers import running_cluster

pytestmark = [pytest.mark.model, pytest.mark.serial]


def test_a_flooding_batch_job_does_not_starve_interactive_requests(smollm_path):
    with running_cluster(copy.deepcopy(FAIRNESS_CLUSTER), smollm_path, reconcile=False) as lc:
        report = fairness_on(lc, FairnessConfig(interactive=6, job_requests=120, job_output_tokens=16))
    s = report.summary()
    assert s["job_finished_meanwhile"] > 0  # shared, not handed over
    # measured 2.7x on an idle machine; without the reserve and engine priorities it was 5-9x
    assert s["p90_ratio"] < 8, s
