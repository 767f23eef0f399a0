"""Shared fixtures: tiny random checkpoints, the embedded default model, and
engines that are checked for leaked KV blocks when a test ends."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvrelay.engine.config import CacheConfig, EngineConfig, SchedulerConfig
from kvrelay.engine.default_model import prepare_default_model
from kvrelay.engine.llm_engine import LLMEngine
from kvrelay.engine.tiny import TINY_ARCHS, write_tiny_checkpoint

# the cores shared among pytest-xdist's processes: two processes of two threads each on two cores
# spin against each other (a transformers reference ran 3x slower so)
_PROCESSES = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(max(1, min(2, (os.cpu_count() or 1) // _PROCESSES)))
if not any(Path("/sys/class/infiniband").glob("*")):
    os.environ.setdefault("UCX_MODULES", "^ib")  # before any NIXL agent exists (see kvtransfer/nixl.py)


def cache_dir() -> Path:
    return Path(os.environ.get("KVRELAY_CACHE_DIR", Path.home() / ".cache" / "kvrelay"))


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: write_tiny_checkpoint(root / arch, arch, seed=7) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def smollm_path() -> Path:
    return prepare_default_model(cache_dir())


@pytest.fixture(scope="session")
def plumbing_model(smollm_path, tmp_path_factory) -> Path:
    """A seeded random Llama (2 layers, width 64, one head) that reads and writes SmolLM2's tokens:
    its tokenizer, vocabulary, special tokens and folder name (so the cluster serves the same model
    id), at about a twelfth of its cost per token (5.2 ms against 61 ms on one thread of an AVX2 host,
    most of it the 49,152-token vocabulary's projection: benchmarks/RESULTS.md).
    For the tests that assert plumbing (who serves, where, what is counted, recorded or refused)
    rather than language or the engine's speed; a test that needs a real answer, or a stream slow
    enough to interrupt, keeps SmolLM2."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("plumbing") / smollm_path.name, "llama", seed=7,
                                 num_layers=2, hidden_size=64, num_heads=1, num_kv_heads=1,
                                 max_position_embeddings=8192, tokenizer_from=smollm_path)


def assert_no_leaks(engine: LLMEngine) -> None:
    assert not engine.has_unfinished(), "requests still queued or running"
    pool = engine.pool
    held = [b for b in range(pool.num_blocks) if pool.ref_count(b)]
    assert not held, f"blocks still referenced after the test: {held[:10]}"
    assert pool.num_free == pool.num_blocks


@pytest.fixture
def make_engine():
    """Factory for engines; every engine made is checked for leaked blocks."""
    made: list[LLMEngine] = []

    def make(path: Path, *, dtype: str = "float32", num_blocks: int = 256, block_size: int = 16,
             max_batched: int = 2048, max_seqs: int = 64, prefix_caching: bool = True,
             device: str = "cpu") -> LLMEngine:
        eng = LLMEngine(EngineConfig(
            model_path=path, dtype=dtype, device=device,
            cache=CacheConfig(block_size=block_size, num_blocks=num_blocks,
                              enable_prefix_caching=prefix_caching),
            scheduler=SchedulerConfig(max_num_batched_tokens=max_batched, max_num_seqs=max_seqs)))
        made.append(eng)
        return eng

    yield make
    for eng in made:
        assert_no_leaks(eng)


LONGEST_FIRST = (  # by their time in make test's first step (session 27: --durations=0, summed per module)
    "integration/test_vllm_pools.py", "integration/test_transfer_faults.py", "integration/test_routers.py",
    "integration/test_e2e.py", "integration/test_failover.py", "unit/test_default_model.py", "unit/test_sim.py",
    "integration/test_shedding.py", "integration/test_renewal.py", "integration/test_chaos.py",
    "integration/test_sim_fidelity.py", "integration/test_kv_tcp.py", "integration/test_job_limits.py",
    "unit/test_kv_codecs.py", "integration/test_oidc.py", "unit/test_import_graph.py",
    "integration/test_scaling.py", "integration/test_etcd.py", "unit/test_config_fuzz.py",
    "integration/test_fuzz.py", "integration/test_kv_bench_json.py", "unit/test_helm.py",
    "integration/test_tracing.py", "integration/test_tenant_policy.py", "integration/test_openai_http.py",
    "integration/test_cli.py", "integration/test_metrics.py", "integration/test_hardening.py",
)
"""The modules that take longest when two pytest processes share the cores (make test's first step,
a module per process at a time): handed out first, so none of them starts last and runs alone."""


def pytest_collection_modifyitems(config, items):
    """The longest modules first (LONGEST_FIRST; the rest keep their order); tests marked ``gpu``
    run only where CUDA is available."""
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0].removeprefix("tests/"), len(rank)))
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
