"""Layer-wise streaming: a chunked prefill pushes each layer's finished
blocks while later chunks are still being computed, over the real TCP
transport, and the receiver ends up with exactly the prefill's KV."""

from __future__ import annotations

import torch

from kvrelay.benchmarks.kv_peer import SECRET
from kvrelay.engine.kv_cache import KVCache
from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.kvtransfer.base import TransferState, TransferTarget
from kvrelay.kvtransfer.config import TransferConfig
from kvrelay.kvtransfer.tcp import TcpKVReceiver, TcpKVSender
from kvrelay.prefill_worker.streamer import LayerStreamer


def test_chunked_prefill_streams_layers_during_compute(tiny_checkpoints, make_engine):
    eng = make_engine(tiny_checkpoints["llama"], max_batched=64)
    layout, bs = eng.layout, eng.layout.block_size
    prompt = torch.randint(0, 256, (150,), generator=torch.Generator().manual_seed(4)).tolist()
    n_blocks = -(-len(prompt) // bs)  # 10 blocks, the last one partial
    start_block = 2  # pretend the decode side caches the first two blocks
    dst = KVCache(layout, 32)
    dest_ids = list(range(31, 31 - (n_blocks - start_block), -1))
    rx = TcpKVReceiver(dst, cfg=TransferConfig(secret=SECRET))
    tx = TcpKVSender(eng.cache, TransferConfig(secret=SECRET, streams=2))
    streamer = LayerStreamer(eng.runner, layout.num_layers)
    calls = []
    steps = [0]
    try:
        rh = rx.expect("t", dest_ids)
        h = tx.open(TransferTarget(rx.endpoint, "t", tuple(dest_ids), layout.compat_hash()))
        real_send = h.send_layer

        def recording_send(layer, src, first):
            calls.append((steps[0], layer, list(src), first))
            real_send(layer, src, first)

        h.send_layer = recording_send
        streamer.add("r", h, start_block, n_blocks - start_block)
        eng.add_request("r", prompt, SamplingParams(max_tokens=1), hold_blocks=True)
        while eng.has_unfinished():
            eng.step()
            steps[0] += 1
        held = eng.held_blocks("r")
        h.finish(5, 0.0)
        assert rh.wait(30) is TransferState.DONE, rh.failure()
        assert h.wait(30) is TransferState.DONE, h.failure()
        # Received bytes equal the prefill's KV for the blocks after start_block.
        assert torch.equal(dst.kv[:, :, dest_ids], eng.cache.kv[:, :, held[start_block:]])
        # 150 tokens in chunks of 64: three steps, and blocks left in each of them.
        assert steps[0] == 3
        assert {c[0] for c in calls} == {0, 1, 2}
        first_step_blocks = [c for c in calls if c[0] == 0 and c[1] == 0]
        assert first_step_blocks and first_step_blocks[0][3] == 0  # block 2 -> target index 0
        for layer in range(layout.num_layers):
            sent = [b for c in calls if c[1] == layer for b in c[2]]
            assert sent == held[start_block:], f"layer {layer} sent {sent}"
    finally:
        streamer.remove("r")
        eng.release_blocks("r")
        tx.close()
        rx.close()
