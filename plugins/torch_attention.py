"""The `torch` attention backend: the reference implementation, correct on CPU and GPU."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..core.interfaces import AttentionBackend, AttentionMetadata, kv_cache_scales


def sliding_mask(length: int, num_queries: int, window: int, device: torch.device) -> torch.Tensor:
    """[num_queries, length] bool: the last ``num_queries`` positions of a ``length``-token context each see the
    keys after their own position - ``window``, up to their own (HF's sliding window)."""
    query = torch.arange(length - num_queries, length, device=device)[:, None]
    key = torch.arange(length, device=device)[None, :]
    return (key <= query) & (key > query - window)


@dataclass
class PrefillItem:
    tokens: slice  # rows of the flat batch
    blocks: torch.Tensor  # [ceil(L / block_size)] the sequence's blocks
    length: int  # L, the context length
    mask: torch.Tensor | None  # [n, L] bool, None when the query is the whole context (plain causal)
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its [n, L] mask, made once a step

    def mask_for(self, window: int | None) -> torch.Tensor | None:
        """The mask of a layer with sliding ``window`` (keys after q - window only, q's own included)."""
        if window is None or window >= self.length:
            return self.mask
        if window not in self.windowed:
            n = self.tokens.stop - self.tokens.start
            self.windowed[window] = sliding_mask(self.length, n, window, self.blocks.device)
        return self.windowed[window]


@dataclass
class DecodeGroup:
    rows: torch.Tensor  # [G] flat rows of single-token queries
    blocks: torch.Tensor  # [G, ceil(Lmax / block_size)] blocks (padding points at block 0)
    mask: torch.Tensor  # [G, 1, 1, Lmax] True where the key is in the context
    lens: torch.Tensor  # [G] the context lengths
    windowed: dict[int, torch.Tensor] = field(default_factory=dict)  # window -> its mask, made once a step

    def mask_for(self, window: int | None) -> torch.Tensor:
        """The mask of a layer with sliding ``window``: also only the last ``window`` keys of each context."""
        if window is None:
            return self.mask
        if window not in self.windowed:
            key = torch.arange(self.mask.shape[-1], device=self.mask.device)
            self.windowed[window] = self.mask & (key[None, :] >= self.lens[:, None] - window)[:, None, None, :]
        return self.windowed[window]


@dataclass
class TorchAttentionPlan:
    decodes: Any  # what _plan_decodes made: here, groups of decodes of similar context lengths (little padding)
    prefills: list[PrefillItem]


DECODE_GROUP = 16  # decodes per batched call: sorted by context length, each group pads to its own longest


class TorchAttention(AttentionBackend):
    """Gathers each sequence's context from the paged cache and calls scaled_dot_product_attention.

    Single-token queries (decodes) share one padded batched call; longer queries run one call each. Gathers
    land in two reused workspaces: a fresh multi-megabyte tensor per call costs page faults on the CPU.
    """

    # queries of at most this many tokens (a decode, a verification of k drafts, a draft round's first step) are
    # planned by _plan_decodes: each token as a decode of the context up to itself, so that a verified position
    # computes exactly what a plain decode there would (bf16 and fp16 included: a prefill-shaped call need not)
    short_query = 16
    supports_sliding_window = True
    supports_softcap = True

    def __init__(self) -> None:
        self._workspaces: dict[str, torch.Tensor] = {}

    def _workspace(self, name: str, like: torch.Tensor, rows: int) -> torch.Tensor:
        """At least ``rows`` rows shaped like ``like``'s (one cache block each); grown by half when too small."""
        ws = self._workspaces.get(name)
        if ws is None or ws.shape[0] < rows or ws.shape[1:] != like.shape[1:] or ws.dtype != like.dtype \
                or ws.device != like.device:
            size = rows if ws is None else max(rows, ws.shape[0] * 3 // 2)
            ws = torch.empty((size, *like.shape[1:]), dtype=like.dtype, device=like.device)
            self._workspaces[name] = ws
        return ws

    def prepare(self, meta: AttentionMetadata) -> TorchAttentionPlan:
        device = meta.slot_mapping.device
        size = meta.block_size
        tables = meta.block_tables
        decode_idx = [i for i, n in enumerate(meta.query_lens_cpu) if n <= self.short_query]
        starts = meta.query_start.tolist()
        prefills = []
        for i, (n, length) in enumerate(zip(meta.query_lens_cpu, meta.context_lens_cpu)):
            if n <= self.short_query:
                continue
            mask = None
            if n != length:
                pos = torch.arange(length, device=device)
                mask = pos[None, :] <= torch.arange(length - n, length, device=device)[:, None]
            blocks = tables[i, : -(-length // size)].long()
            prefills.append(PrefillItem(slice(starts[i], starts[i] + n), blocks, length, mask))
        return TorchAttentionPlan(self._plan_decodes(meta, decode_idx, starts), prefills)

    def _plan_decodes(self, meta: AttentionMetadata, decode_idx: list[int], starts: list[int]) -> Any:
        """The short queries' part of the plan: sequence i of ``decode_idx`` has up to ``short_query`` query tokens,
        from row starts[i]; query token j of n sees the context up to its own position."""
        tokens: list[tuple[int, int, int]] = []
        for i in decode_idx:
            n, length = meta.query_lens_cpu[i], meta.context_lens_cpu[i]
            tokens += [(length - n + 1 + j, starts[i] + j, i) for j in range(n)]
        tokens.sort()  # similar context lengths share a group: little padding
        groups = [tokens[g : g + DECODE_GROUP] for g in range(0, len(tokens), DECODE_GROUP)]
        return [self._decode_group(meta, group) for group in groups]

    @staticmethod
    def _decode_group(meta: AttentionMetadata, group: list[tuple[int, int, int]]) -> DecodeGroup:
        """``group``: (context length, flat row, sequence index) per query token, shortest context first."""
        device, size = meta.slot_mapping.device, meta.block_size
        lens = torch.tensor([length for length, _, _ in group], device=device)
        width = -(-group[-1][0] // size)
        valid = torch.arange(width * size, device=device)[None, :] < lens[:, None]
        owners = torch.tensor([i for _, _, i in group], device=meta.block_tables.device)
        blocks = meta.block_tables[owners][:, :width].long()  # whole blocks gather far faster than single slots
        rows = torch.tensor([row for _, row, _ in group], device=device)
        return DecodeGroup(rows, blocks, valid[:, None, None, :], lens)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, scale: float, window: int | None = None, softcap: float | None = None
                ) -> torch.Tensor:
        plan: TorchAttentionPlan = meta.backend_data
        k_cache, v_cache = kv_cache
        k_scale, v_scale = kv_cache_scales(kv_cache)
        heads, dim = k_cache.shape[2], k_cache.shape[3]
        cache_dtype = k_cache.dtype
        k_raw, v_raw = _raw(k_cache), _raw(v_cache)
        k_raw.view(-1, heads, dim).index_copy_(0, meta.slot_mapping, _raw(_to_cache(k, cache_dtype, k_scale)))
        v_raw.view(-1, heads, dim).index_copy_(0, meta.slot_mapping, _raw(_to_cache(v, cache_dtype, v_scale)))
        out = torch.empty_like(q)
        self._attend_decodes(plan.decodes, q, kv_cache, scale, out, window, softcap)
        fresh = k_scale is None and cache_dtype == k.dtype  # a whole-context query can read k/v as computed
        for item in plan.prefills:
            qp = q[item.tokens].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            if fresh and item.mask is None:
                kp, vp = k[item.tokens], v[item.tokens]
            else:
                kp = _from_cache(self._gather("k", k_raw, item.blocks)[: item.length], cache_dtype, q.dtype, k_scale)
                vp = _from_cache(self._gather("v", v_raw, item.blocks)[: item.length], cache_dtype, q.dtype, v_scale)
            mask = item.mask_for(window)
            res = attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0), mask, scale,
                            softcap)
            out[item.tokens] = res[0].transpose(0, 1)
        return out

    def _attend_decodes(self, decodes: Any, q: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor],
                        scale: float, out: torch.Tensor, window: int | None = None,
                        softcap: float | None = None) -> None:
        """Write the decodes' attention rows into ``out``; the cache already holds this step's K/V. ``window``:
        each decode sees the last ``window`` keys of its context only; ``softcap``: see :func:`attention`."""
        k_scale, v_scale = kv_cache_scales(kv_cache)
        cache_dtype = kv_cache[0].dtype
        k_raw, v_raw = _raw(kv_cache[0]), _raw(kv_cache[1])
        for group in decodes:
            qd = q.index_select(0, group.rows).unsqueeze(2)  # [G, Hq, 1, D]
            kd = _from_cache(self._gather("k", k_raw, group.blocks), cache_dtype, q.dtype, k_scale)  # [G, L, Hkv, D]
            vd = _from_cache(self._gather("v", v_raw, group.blocks), cache_dtype, q.dtype, v_scale)
            res = attention(qd, kd.transpose(1, 2), vd.transpose(1, 2), group.mask_for(window), scale, softcap)
            out.index_copy_(0, group.rows, res.squeeze(2))


    def _gather(self, name: str, cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
        """Whole blocks [*blocks.shape, block_size, Hkv, D] -> [*blocks.shape[:-1], n * block_size, Hkv, D], in
        workspace ``name`` (valid until its next gather).

        index_select copies whole rows; advanced indexing (``cache[blocks]``) is 4-7x slower on the CPU."""
        index = blocks.reshape(-1)
        rows = self._workspace(name, cache, index.numel())[: index.numel()]
        torch.index_select(cache, 0, index, out=rows)
        return rows.view(*blocks.shape[:-1], blocks.shape[-1] * cache.shape[1], *cache.shape[2:])


SOFTCAP_SCORES_BYTES = 64 << 20  # the explicit softcap path's float32 scores, per slice of query rows


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              softcap: float | None, max_score_bytes: int = SOFTCAP_SCORES_BYTES) -> torch.Tensor:
    """q [B, Hq, n, D], k/v [B, Hkv, L, D] -> [B, Hq, n, D]: SDPA with the boolean ``mask`` (None: causal, n == L).
    With ``softcap`` (Gemma 2), which SDPA cannot apply, each score becomes softcap * tanh(score / softcap) before
    the mask, and the softmax runs in float32 (as transformers' eager attention computes it); the query rows go in
    slices, so that the scores of a long prompt never take more than about ``max_score_bytes``."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                              enable_gqa=True)
    batch, heads, n, dim = q.shape
    kv_heads, length = k.shape[1], k.shape[2]
    group = heads // kv_heads
    if mask is None:
        mask = torch.ones(n, length, dtype=torch.bool, device=q.device).tril(length - n)
    mask = mask.expand(*mask.shape[:-2], n, length)
    grouped = q.view(batch, kv_heads, group, n, dim)  # each K/V head's query heads: no repeated K/V
    out = torch.empty_like(q)
    rows = max(1, max_score_bytes // (4 * batch * heads * length))
    for start in range(0, n, rows):
        part = slice(start, start + rows)
        scores = grouped[:, :, :, part] @ k.unsqueeze(2).transpose(-1, -2)  # [B, Hkv, G, rows, L]
        scores = scores.float().mul_(scale / softcap).tanh_().mul_(softcap)
        hidden = ~mask[..., part, :]  # [rows, L], or per decode [B, 1, rows, L]: its heads' group dim added
        scores.masked_fill_(hidden.unsqueeze(-3) if hidden.dim() == 4 else hidden, float("-inf"))
        weights = scores.softmax(-1).to(q.dtype)
        out.view(batch, kv_heads, group, n, dim)[:, :, :, part] = weights @ v.unsqueeze(2)
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
