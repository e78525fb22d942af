"""The `torch` attention backend: the reference implementation, correct on CPU and GPU."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..core.config import EngineConfig
from ..core.hookspecs import AttentionBackendFactory, hookimpl
from ..core.interfaces import AttentionBackend, AttentionMetadata, kv_cache_scales
from ..core.registry import Register


@dataclass
class PrefillItem:
    tokens: slice  # rows of the flat batch
    slots: torch.Tensor  # [L] flat cache slots of the whole context
    mask: torch.Tensor | None  # [n, L] bool, None when the query is the whole context (plain causal)


@dataclass
class TorchAttentionPlan:
    decode_rows: torch.Tensor  # [Bd] flat rows of single-token queries
    decode_slots: torch.Tensor  # [Bd, Lmax] flat cache slots (padding points at slot 0)
    decode_mask: torch.Tensor  # [Bd, 1, 1, Lmax] True where the key is in the context
    prefills: list[PrefillItem]


class TorchAttention(AttentionBackend):
    """Gathers each sequence's context from the paged cache and calls scaled_dot_product_attention.

    Single-token queries (decodes) share one padded batched call; longer queries run one call each.
    """

    def prepare(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        device = meta.slot_mapping.device
        size = meta.block_size
        tables = meta.block_tables
        decode_idx = [i for i, n in enumerate(meta.query_lens_cpu) if n == 1]
        starts = meta.query_start.tolist()
        prefills = []
        for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            if n == 1:
                continue
            pos = torch.arange(length, device=device)
            slots = tables[i, pos // size].long() * size + pos % size
            mask = None
            if n != length:
                query_pos = torch.arange(length - n, length, device=device)
                mask = pos[None, :] <= query_pos[:, None]
            prefills.append(PrefillItem(slice(starts[i], starts[i] + n), slots, mask))
        if decode_idx:
            lens = meta.context_lens[decode_idx].long()
            width = int(max(meta.context_lens_cpu[i] for i in decode_idx))
            pos = torch.arange(width, device=device)
            valid = pos[None, :] < lens[:, None]
            blocks = tables[decode_idx][:, pos // size].long()
            slots = torch.where(valid, blocks * size + pos % size, 0)
            rows = torch.tensor([starts[i] for i in decode_idx], device=device)
            return TorchAttentionPlan(rows, slots, valid[:, None, None, :], prefills)
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return TorchAttentionPlan(empty, empty.view(0, 0), empty.view(0, 1, 1, 0).bool(), prefills)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float) -> torch.Tensor:
        plan: TorchAttentionPlan = meta.backend_data
        k_cache, v_cache = kv_cache
        k_scale, v_scale = kv_cache_scales(kv_cache)
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        k_flat, v_flat = k_cache.view(-1, heads, dim), v_cache.view(-1, heads, dim)
        cache_dtype = k_flat.dtype
        k_flat, v_flat = _raw(k_flat), _raw(v_flat)
        k_flat[meta.slot_mapping] = _raw(_to_cache(k, cache_dtype, k_scale))
        v_flat[meta.slot_mapping] = _raw(_to_cache(v, cache_dtype, v_scale))
        out = torch.empty_like(q)
        if plan.decode_rows.numel():
            qd = q[plan.decode_rows].unsqueeze(2)  # [Bd, Hq, 1, D]
            kd = _from_cache(k_flat[plan.decode_slots], cache_dtype, q.dtype, k_scale).transpose(1, 2)  # [Bd,Hkv,L,D]
            vd = _from_cache(v_flat[plan.decode_slots], cache_dtype, q.dtype, v_scale).transpose(1, 2)
            res = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=plan.decode_mask, scale=scale, enable_gqa=True)
            out[plan.decode_rows] = res.squeeze(2)
        for item in plan.prefills:
            qp = q[item.tokens].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            kp = _from_cache(k_flat[item.slots], cache_dtype, q.dtype, k_scale).transpose(0, 1).unsqueeze(0)
            vp = _from_cache(v_flat[item.slots], cache_dtype, q.dtype, v_scale).transpose(0, 1).unsqueeze(0)
            res = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=item.mask, is_causal=item.mask is None,
                                                 scale=scale, enable_gqa=True)
            out[item.tokens] = res[0].transpose(0, 1)
        return out


def _raw(t: torch.Tensor) -> torch.Tensor:
    """One-byte (fp8) caches are indexed as raw bytes: fp8 gather/scatter kernels are missing on older torch."""
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _to_cache(x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None) -> torch.Tensor:
    """K/V [T, Hkv, D] as stored: cast, or for an fp8 cache ``fp8(clamp(x / scale[h]))``."""
    if scale is None:
        return x.to(dtype)
    from ..quant.kv_cache import quantize_kv

    return quantize_kv(x, scale)


def _from_cache(x: torch.Tensor, cache_dtype: torch.dtype, dtype: torch.dtype, scale: torch.Tensor | None
                ) -> torch.Tensor:
    """Gathered cache rows [..., Hkv, D] (raw bytes for fp8) in ``dtype``, dequantized (``x * scale[h]``) for an
    fp8 cache."""
    x = x.view(cache_dtype)
    if scale is None:
        return x.to(dtype)
    from ..quant.kv_cache import dequantize_kv

    return dequantize_kv(x, scale, dtype)


@hookimpl
def register_attention_backends(register: Register[AttentionBackendFactory]) -> None:
    def factory(config: EngineConfig) -> AttentionBackend:
        return TorchAttention()

    register("torch", factory)
