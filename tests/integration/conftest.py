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
