"""What the engine does with what arrives from the wire and with its own
failures: an out-of-vocabulary first token from a KV transfer is refused
before it joins the batch (the reservation stays abortable and nothing enters
the prefix cache); a failed step marks the async engine dead with its cause."""

from __future__ import annotations

import asyncio

import pytest

from kvrelay.engine.async_engine import AsyncEngine, EngineStopped
from kvrelay.engine.errors import InvalidRequestError
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.runtime.worker import failing_step


def test_an_out_of_vocabulary_first_token_is_refused(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    prompt = list(range(3, 3 + 40))
    _blocks, _start = eng.reserve("r", prompt, SamplingParams(max_tokens=4))
    vocab = eng.model_config.vocab_size
    for bad in (vocab, -1, 10**9):
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            eng.commit_prefilled("r", bad, None)
    assert eng.num_reserved == 1 and not eng.has_unfinished()  # nothing joined the batch
    assert eng.abort_request("r")  # and the reservation is freed (make_engine checks for leaks)
    _again, cached = eng.reserve("r2", prompt, SamplingParams(max_tokens=4))
    assert cached == 0  # the refused blocks never entered the prefix cache
    assert eng.abort_request("r2")


def test_a_failed_step_marks_the_engine_dead(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"])
    eng.step = failing_step(eng.step, 2)

    async def run() -> None:
        aeng = AsyncEngine(eng)
        await aeng.start()
        with pytest.raises(RuntimeError, match="injected engine failure"):
            async for _ in aeng.generate("r", [5, 6, 7], SamplingParams(max_tokens=8)):
                pass
        await asyncio.wait_for(aeng.dead.wait(), 10)
        assert "injected" in str(aeng.failure)
        with pytest.raises(EngineStopped):
            await aeng.call(eng.abort_request, "r")
        eng.abort_request("r")  # the test cleans up on the dead engine itself
        await aeng.stop()

    asyncio.run(run())
