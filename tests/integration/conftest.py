"""The integration tests' shared fixtures: the default cluster (router,
prefill and decode worker processes on loopback serving the embedded
SmolLM2-135M-Instruct), started once for the whole session and used by the
modules whose tests leave it as they found it, and the reference engine.
A module that needs another configuration, or changes its cluster (kills a
worker, restarts the router), starts its own under a name of its own; a
module that asserts plumbing rather than language or speed serves
``plumbing_model`` (tests/conftest.py), a random model with SmolLM2's tokens.
Helpers are in tests/integration/helpers.py."""

from __future__ import annotations

import pytest

from kvrelay.engine.config import CacheConfig, EngineConfig
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.v1 import inference_pb2_grpc as igrpc
from tests.integration.helpers import CLUSTER_YAML, running_cluster


@pytest.fixture(scope="session")
def shared_cluster(smollm_path):
    """The default cluster (CLUSTER_YAML), for tests that do not change it."""
    with running_cluster(CLUSTER_YAML, smollm_path) as lc:
        yield lc


@pytest.fixture(scope="session")
def shared_stub(shared_cluster):
    """The public gRPC API of :func:`shared_cluster`, as its local tenant."""
    with shared_cluster.channel() as ch:
        yield igrpc.InferenceStub(ch)


@pytest.fixture(scope="session")
def reference_engine(smollm_path):
    """The same model in this process: what every greedy output is compared with."""
    return LLMEngine(EngineConfig(model_path=smollm_path, cache=CacheConfig(num_blocks=512)))


@pytest.fixture(scope="session")
def plumbing_reference(plumbing_model):
    """The reference engine of the tests whose clusters serve ``plumbing_model``."""
    return LLMEngine(EngineConfig(model_path=plumbing_model, cache=CacheConfig(num_blocks=512)))


def _ray_head(cluster_cls):
    """A Ray cluster with its head node. Ray gives its raylet a fixed 30 s to register with the GCS
    and raises a bare Exception past it, which a busy 2-core machine can meet: that is Ray's start,
    not the behaviour under test, so it is tried once more (its processes die with this one's exit)."""
    for attempt in (1, 2):
        try:
            return cluster_cls(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        except Exception as exc:  # Ray raises exactly Exception for this
            if attempt == 2 or "timed out during startup" not in str(exc):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="session")
def ray_two_sites():
    """A Ray cluster (this process connected to it) with a node for montreal and one for toronto,
    each offering its site's resource; yields the nodes by site. Shared by the Ray tests (Ray's
    start is ~10 s); shut down at the session's end."""
    sites = ("montreal", "toronto")
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    rc = _ray_head(Cluster)
    nodes = {s: rc.add_node(num_cpus=1, resources={f"site:{s}": 4}) for s in sites}
    ray.init(address=rc.address, log_to_driver=False)
    try:
        rc.wait_for_nodes()
        yield nodes
    finally:
        ray.shutdown()
        rc.shutdown()
