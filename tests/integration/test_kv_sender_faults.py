"""What a decode worker does with KV from a sender built here (a prefill
worker's certificate from this cluster's CA, real KV computed by a local
engine): an out-of-vocabulary first token is refused, the Decode call ends
ABORTED (what the router recovers from), nothing enters the prefix cache,
and the same request with the right token then decodes exactly the
reference output."""

from __future__ import annotations

import grpc
import pytest

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.tcp import TcpKVSender
from kvrelay.runtime.kvcreds import CertCredentials
from kvrelay.runtime.pki import CertRole, Identity
from kvrelay.v1 import worker_pb2 as wpb
from kvrelay.v1 import worker_pb2_grpc as wgrpc
from tests.integration.helpers import workers

pytestmark = pytest.mark.model
MAX_TOKENS = 8


def _prefill_here(engine, prompt: list[int]) -> tuple[int, list[int]]:
    """The prompt's first token and the blocks holding its KV in ``engine``."""
    engine.add_request("kv-source", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
    first = None
    while engine.has_unfinished():
        for out in engine.step():
            first = out.new_token_ids[0] if out.new_token_ids else first
    return first, engine.held_blocks("kv-source")


def _decode(stub, sender, engine, prompt, blocks, first_token, rid: str):
    call = stub.Decode(wpb.DecodeRequest(request=wpb.WorkRequest(
        request_id=rid, prompt_token_ids=prompt, max_tokens=MAX_TOKENS, ignore_eos=True), lease_s=30), timeout=120)
    events = iter(call)
    res = next(events).reservation
    h = sender.open(TransferTarget(res.endpoint, res.transfer_id, tuple(res.block_ids), res.layout_hash,
                                   receiver="local/decode/0"))
    for layer in range(engine.layout.num_layers):
        h.send_layer(layer, blocks[res.start_block:], 0)
    h.finish(first_token, 0.0)
    assert h.wait(30) is TransferState.DONE, h.failure()  # the bytes were fine; the token is not
    return res, events


def test_an_out_of_vocabulary_first_token_is_refused_and_the_request_recovers(shared_cluster, reference_engine):
    eng = reference_engine
    prompt = eng.tokenizer.encode("Research networks carry the traffic of universities between cities, " * 3)
    want = eng.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))[0].token_ids
    first, blocks = _prefill_here(eng, prompt)
    assert first == want[0]
    creds = CertCredentials(shared_cluster.creds.material(Identity("local", CertRole.PREFILL, "9")), (CertRole.DECODE,))
    sender = TcpKVSender(eng.cache, TransferConfig(secret=shared_cluster.kv_secret, credentials=creds, streams=1))
    info = workers(shared_cluster)["local/decode/0"].info
    try:
        with shared_cluster.worker_channel(info) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            res, events = _decode(stub, sender, eng, prompt, blocks, eng.model_config.vocab_size + 7, "bad")
            with pytest.raises(grpc.RpcError) as err:
                list(events)
            assert err.value.code() == grpc.StatusCode.ABORTED
            assert "outside the vocabulary" in err.value.details()
            # the worker serves on; the refused blocks never entered its prefix cache
            res, events = _decode(stub, sender, eng, prompt, blocks, first, "good")
            assert res.start_block == 0
            tokens = [t for ev in events for t in ev.output.token_ids]
            assert tokens == want
    finally:
        sender.close()
        eng.release_blocks("kv-source")
