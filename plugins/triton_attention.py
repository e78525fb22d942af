"""The ``triton`` attention backend: paged KV, split-K decode fast path, ragged prefill/extend for mixed batches."""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from ..core.config import EngineConfig
from ..core.errors import ConfigError, PluginError
from ..core.interfaces import AttentionBackend, AttentionMetadata, kv_cache_scales

DEFAULT_NUM_SMS = 132  # H100/H200; used when no CUDA device is visible (interpreter)


@dataclass(frozen=True)
class TritonPlan:
    """What every layer of one step shares (``AttentionMetadata.backend_data``)."""

    all_decode: bool  # every sequence has query_len 1: the split-K decode kernel runs
    batch: int
    max_context_len: int


class TritonAttentionBackend(AttentionBackend):
    """store_kv, then split-K decode when all query lengths are 1, else the ragged prefill/extend kernel."""

    supports_cuda_graphs = True
    supports_mixed_cuda_graphs = True  # the prefill kernel's grid depends on T and B only
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self, kernels: ModuleType, num_sms: int) -> None:
        self.kernels = kernels
        self.num_sms = num_sms

    def prepare(self, meta: AttentionMetadata) -> TritonPlan:
        batch = len(meta.query_lens_cpu)
        return TritonPlan(all_decode=meta.max_query_len == 1 and sum(meta.query_lens_cpu) == batch,
                          batch=batch, max_context_len=meta.max_context_len)

    def num_splits(self, plan: TritonPlan, num_kv_heads: int, window: int | None = None) -> int:
        """Decode grid's split count: a pure function of the plan, the layer's KV heads and its window (constant
        per layer), sized for the keys a query reads (a sliding layer's window, not the whole context)."""
        keys = plan.max_context_len if window is None else min(plan.max_context_len, window)
        return self.kernels.default_num_splits(plan.batch, num_kv_heads, keys, self.num_sms)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        plan = meta.backend_data if isinstance(meta.backend_data, TritonPlan) else self.prepare(meta)
        k_cache, v_cache = kv_cache
        k_scale, v_scale = kv_cache_scales(kv_cache)
        if k_scale is None or v_scale is None:
            self.kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        else:
            self.kernels.store_kv_fp8(k, v, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if plan.all_decode and q.shape[0] == plan.batch:  # padded token rows would index past context_lens
            return self.kernels.decode_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens, scale,
                                                 self.num_splits(plan, k_cache.shape[2], window), k_scale=k_scale,
                                                 v_scale=v_scale, window=window, softcap=softcap)
        return self.kernels.prefill_attention(q, k_cache, v_cache, meta.block_tables, meta.query_start,
                                              meta.context_lens, scale, k_scale=k_scale, v_scale=v_scale,
                                              window=window, softcap=softcap)


def create_backend(config: EngineConfig) -> TritonAttentionBackend:
    """Factory: needs CUDA (or TRITON_INTERPRET=1, for tests on CPU tensors)."""
    from ..core.loader import resolve_device, triton_runs_on

    device = resolve_device(config.device)
    if not triton_runs_on(device):
        raise ConfigError("the triton attention backend needs a CUDA GPU (device "
                          f"{config.device!r}, CUDA available: {torch.cuda.is_available()}); drop --attention for "
                          "the device's default (cpu on a CPU), or use --attention cpu or torch")
    try:
        from ..kernels import attention as kernels
    except ImportError as exc:
        raise PluginError(f"the triton attention backend cannot import triton ({exc}); use --attention torch") from exc
    num_sms = DEFAULT_NUM_SMS
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        if config.kv_cache_dtype == "fp8" and torch.cuda.get_device_capability(device) < (8, 9):
            raise ConfigError("--kv-cache-dtype fp8 with the triton backend needs a GPU with fp8 support (sm89+, "
                              "e.g. L4/H100); use --attention torch (dequantizes in torch) or --kv-cache-dtype auto")
    return TritonAttentionBackend(kernels, num_sms)
