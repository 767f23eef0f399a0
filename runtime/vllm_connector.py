"""kvrelay's KV connector for vLLM: vLLM loads it by module path
(``kv_connector_module_path``) into the worker process that runs the engine.

vLLM makes two instances, one per role. The scheduler's decides which
requests move KV and which blocks they own; the worker's sees the cache
tensors and each layer as it is computed. Both talk to the kvrelay worker
through the :class:`Bridge` registered under the engine's id before the
engine starts. The engine runs in the worker's own process (vLLM's
in-process engine core and single-process executor), so the bridge is a
plain object; the transports are kvrelay's (runtime/vllm_engine.py).

What each role does with a kvrelay request (``kv_transfer_params["kvrelay"]``):

- a *send* request (a prefill worker's): every layer's finished blocks are
  handed to its send handle right after the layer's attention wrote them
  (:class:`LayerSends`); when it finishes, its blocks stay allocated until
  the worker releases them (the transfer ended), reported as
  ``finished_sending``;
- a *receive* request (a decode worker's): vLLM allocates its blocks and
  parks it (an asynchronous load of the prompt less its local prefix-cache
  hit); the bridge resolves the reservation with those block ids; kvrelay's
  receiver writes into them; the worker's commit reports the request in
  ``finished_recving``, and vLLM computes the last prompt token and goes on
  decoding. An aborted receive is reported the same way once the receiver
  stopped writing, so vLLM frees its blocks.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import vllm
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)
from vllm.v1.request import RequestStatus

from kvrelay.engine.kv_cache import KVCache, KVLayout
from kvrelay.runtime.vllm_bridge import PARAMS_KEY, LayerSends, StepSend, bridge_for
from kvrelay.runtime.vllm_families import refusal

log = logging.getLogger(__name__)

def _request_params(request) -> dict | None:
    params = request.kv_transfer_params or {}
    kv = params.get(PARAMS_KEY)
    return kv if isinstance(kv, dict) else None


class KvrelayMetadata(KVConnectorMetadata):
    """Scheduler -> worker, each step: the send requests of the step, and the
    kvrelay ids of sends vLLM preempted (their blocks are reused this step)."""

    def __init__(self, sends: list[StepSend], preempted: list[str]) -> None:
        self.sends = sends
        self.preempted = preempted


class KvrelayConnector(KVConnectorBase_V1):
    """The connector vLLM instantiates (see the module's docstring)."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        self.bridge = bridge_for(vllm_config.kv_transfer_config.engine_id)
        if kv_cache_config is not None:  # what vLLM made of the model's attention: refused here, before a request
            why = refusal(self.bridge.model_name,
                          [type(g.kv_cache_spec).__name__ for g in kv_cache_config.kv_cache_groups])
            if why is not None:
                raise ValueError(why)
        self.block_size = vllm_config.cache_config.block_size
        self._sends: dict[str, tuple[str, int, list[int]]] = {}
        """Scheduler side: internal id -> (kvrelay id, prompt tokens, blocks so far) of send requests."""
        self._rids: dict[str, str] = {}
        """Scheduler side: internal id -> kvrelay id, of every request vLLM allocated blocks to."""

    # -- scheduler side ----------------------------------------------------
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        kv = _request_params(request)
        if kv is None or kv.get("mode") != "recv":
            return 0, False
        n = request.num_prompt_tokens - num_computed_tokens
        return (n, True) if n > 0 else (0, False)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        kv = _request_params(request)
        if kv is None:
            return
        rid = str(kv.get("id"))
        self.bridge.internal[rid] = request.request_id
        self._rids[request.request_id] = rid
        if kv.get("mode") == "send":
            self._sends[request.request_id] = (rid, request.num_prompt_tokens, [])
            return
        if kv.get("mode") != "recv":
            return
        fut = self.bridge.reservations.pop(rid, None)
        if fut is None or num_external_tokens == 0:
            return
        ids = list(blocks.get_block_ids()[0])
        local = request.num_prompt_tokens - num_external_tokens
        start = local // self.block_size
        self.bridge.local_hits[rid] = local
        if not fut.done():
            fut.set_result((ids, start))

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        step: list[StepSend] = []
        n_sched = scheduler_output.num_scheduled_tokens
        for r in scheduler_output.scheduled_new_reqs:
            self._step_request(step, r.req_id, list(r.block_ids[0]), r.num_computed_tokens, n_sched)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            new = cached.new_block_ids[i]
            self._step_request(step, req_id, list(new[0]) if new else [], cached.num_computed_tokens[i], n_sched)
        preempted = [self._sends.pop(i)[0] for i in scheduler_output.preempted_req_ids or () if i in self._sends]
        return KvrelayMetadata(step, preempted)

    def _step_request(self, step: list[StepSend], req_id: str, new_blocks: list[int], computed: int,
                      n_sched: dict[str, int]) -> None:
        rid = self._rids.get(req_id)
        if rid is not None:
            self.bridge.step_tokens.append((rid, computed, n_sched.get(req_id, 0)))
        entry = self._sends.get(req_id)
        if entry is None:
            return
        rid, num_prompt, blocks = entry
        blocks.extend(new_blocks)
        step.append(StepSend(rid, tuple(blocks), computed + n_sched.get(req_id, 0), num_prompt))

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        self._rids.pop(request.request_id, None)
        entry = self._sends.pop(request.request_id, None)
        if entry is None or request.status in (RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR):
            return False, None
        self.bridge.held.add(entry[0])
        return True, None

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config) -> str | None:
        """LBHNC: every layer's pages back to back in one buffer, a page [heads, tokens, content]
        (what :func:`cache_over` wraps), on CPU (vLLM's only layout there) and on GPUs."""
        return "LBHNC"

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Per-layer hooks must run at every step: attention stays outside captured CUDA graphs."""
        return True

    # -- worker side -------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        names = list(kv_caches)
        self.bridge.layer_index = {name: i for i, name in enumerate(names)}
        self.bridge.cache = cache_over(kv_caches, self.block_size, self.bridge.model_name)
        self.bridge.sends = LayerSends(self.block_size, len(names))

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step's forward pass: a preempted prefill's transfer fails (the router
        recovers it) and nothing reads its blocks any more when they are overwritten."""
        if isinstance(kv_connector_metadata, KvrelayMetadata) and self.bridge.sends is not None:
            for rid in kv_connector_metadata.preempted:
                self.bridge.sends.abandon(rid, "vLLM preempted the prefill (its blocks are reused)")

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        pass  # kvrelay's receiver wrote the KV before the request was released

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvrelayMetadata) or not meta.sends or self.bridge.sends is None:
            return
        self.bridge.sends.on_layer(self.bridge.layer_index[layer_name], meta.sends)

    def wait_for_save(self) -> None:
        pass  # the transport reads blocks that stay allocated until released

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sent, self.bridge.sent = self.bridge.sent, set()
        received, self.bridge.received = self.bridge.received, set()
        return sent or None, received or None


def cache_format(t: torch.Tensor, block_size: int) -> str:
    """What makes two vLLM caches byte-compatible beyond the layout's numbers: vLLM's
    version, the device and, on CPU, the attention kernel's ISA (it packs blocks per ISA)."""
    if t.device.type != "cpu":  # one layout on GPUs (get_required_kvcache_layout)
        return f"vllm-{vllm.__version__}-{t.device.type}-LBHNC"
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa  # private: the ISA that packs the blocks

    isa = _get_attn_isa(t.dtype, block_size, t.shape[3] // 2)
    return f"vllm-{vllm.__version__}-cpu-LBHNC-{isa}"


def cache_over(kv_caches: dict[str, torch.Tensor], block_size: int, model: str) -> KVCache:
    """vLLM's per-layer views as one kvrelay cache ``[layers, 1, blocks, ...]`` over the
    same memory; ValueError unless the layers lie back to back in one buffer."""
    tensors = list(kv_caches.values())
    first = tensors[0]
    nb = first.shape[0]
    page = first[0].numel() * first.element_size()
    layer_bytes = nb * page
    for i, t in enumerate(tensors):
        if (t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous()
                or t.data_ptr() != first.data_ptr() + i * layer_bytes):
            raise ValueError("vLLM's KV cache is not one buffer of equal, consecutive layers; "
                             "kvrelay's connector moves whole pages of such a buffer only")
    heads, head_dim = first.shape[1], first.shape[3] // 2
    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}.get(first.dtype)
    if dtype is None:
        raise ValueError(f"vLLM's KV cache dtype {first.dtype} is not one kvrelay moves")
    layout = KVLayout(model, dtype, len(tensors), heads, head_dim, block_size, kinds=1,
                      format=cache_format(first, block_size))
    shape = (len(tensors), 1, *first.shape)
    strides = torch.empty(shape, device="meta").stride()
    whole = torch.empty(0, dtype=first.dtype, device=first.device).set_(
        first.untyped_storage(), first.storage_offset(), shape, strides)
    return KVCache.wrap(layout, whole)
