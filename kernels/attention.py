"""Paged-KV attention kernels (store, split-K decode, ragged prefill/extend), each beside its torch reference.

Layouts: q [T, Hq, D], k/v [T, Hkv, D] (last dim contiguous, other strides free), caches [num_blocks, block_size,
Hkv, D], block_tables [B, max_blocks] int32 (padded with 0), context_lens [B] int32, query_start [B + 1] int32.
Every kernel upcasts to fp32 right after loading; softmax runs in base 2 with ``scale * log2(e)`` folded into q.k.
fp8 caches (``--kv-cache-dtype fp8``) carry fp32 scales [Hkv]: K's is folded into the q.k scale and V's into the
output, so the loaded e4m3 values are only upcast (exact). :func:`store_kv_fp8` quantizes in torch, then copies bytes.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs dot exactly; fp16/bf16 upcasts are exact in tf32, so tf32 loses nothing on q.k."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_last_dim(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if t.stride(-1) != 1:
            raise ValueError(f"attention kernels need a contiguous last dimension (1-D metadata contiguous), got "
                             f"strides {t.stride()} for shape {tuple(t.shape)}")


# ---------------------------------------------------------------- store_kv
@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    # slot -1 (padding) masks every head; a scalar bound, since the interpreter mishandles scalar-bool & tensor
    mask = (h < tl.where(slot >= 0, NUM_HEADS, 0)) & (d < HEAD_DIM)
    page = slot // PAGE
    off = slot % PAGE
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=mask)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=mask)
    tl.store(k_cache_ptr + page * stride_kcb + off * stride_kcs + h * stride_kch + d, k, mask=mask)
    tl.store(v_cache_ptr + page * stride_vcb + off * stride_vcs + h * stride_vch + d, v, mask=mask)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k/v [T, Hkv, D] into the caches at flat ``slot_mapping`` [T] (block * block_size + offset; -1 skips)."""
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _check_last_dim(k, v, k_cache, v_cache, slot_mapping)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, PAGE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_heads), BLOCK_D=triton.next_power_of_2(head_dim))


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor) -> None:
    """Torch reference of :func:`store_kv`."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    page, off = slots // k_cache.shape[1], slots % k_cache.shape[1]
    k_cache[page, off] = k[keep].to(k_cache.dtype)
    v_cache[page, off] = v[keep].to(v_cache.dtype)


def store_kv_fp8(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    """:func:`store_kv` into fp8 caches: ``fp8(clamp(x / scale[h]))`` rounded by torch (the interpreter rounds
    fp32 -> fp8 wrongly), then stored by the kernel as raw bytes."""
    from ..quant.kv_cache import quantize_kv

    kq, vq = quantize_kv(k, k_scale), quantize_kv(v, v_scale)
    store_kv(kq.view(torch.uint8), vq.view(torch.uint8), k_cache.view(torch.uint8), v_cache.view(torch.uint8),
             slot_mapping)


# ---------------------------------------------------------------- decode (flash-decoding)
@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                         mid_o_ptr, mid_lse_ptr, qk_scale, k_scale_ptr, v_scale_ptr, window, softcap,
                         stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_bt, stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         PRECISION: tl.constexpr, KV_SCALED: tl.constexpr, FINAL: tl.constexpr,
                         SOFTCAP: tl.constexpr):
    # FINAL (one split): mid_o is the output itself and no lse is written, so no reduce kernel runs
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if KV_SCALED:  # fp8 cache: dequantization scales of this KV head
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
        v_scale = tl.load(v_scale_ptr + kvh)
    else:
        v_scale = 1.0
    ctx = tl.load(context_lens_ptr + b)
    first = tl.where(window > 0, tl.maximum(ctx - window, 0), 0)  # a sliding window: the last `window` keys
    # per-sequence split length, a multiple of BLOCK_N: split s covers [lo, hi) of [first, ctx) (maybe empty)
    split_len = tl.cdiv(tl.cdiv(ctx - first, tl.num_programs(2)), BLOCK_N) * BLOCK_N
    lo = first + split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    g_mask = g < GROUP
    d_mask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)

    m = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (page * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + (page * stride_vb + (pos % PAGE) * stride_vs + kvh * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # scale after: q stays exact in tf32
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    # empty split: lse = -inf and o = 0, which the reduce weighs by exp2(-inf) = 0
    l_safe = tl.where(l > 0, l, 1.0)
    lse = tl.where(l > 0, m + tl.log2(l_safe), float("-inf"))
    o = acc * (v_scale / l_safe)[:, None]
    mo = mid_o_ptr + b * stride_mob + heads[:, None] * stride_moh + split * stride_mos + d[None, :]
    tl.store(mo, o.to(mid_o_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])
    if not FINAL:
        tl.store(mid_lse_ptr + b * stride_mlb + heads * stride_mlh + split, lse, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(mid_o_ptr, mid_lse_ptr, o_ptr, num_splits,
                          stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh, stride_ot, stride_oh,
                          HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_mask = s < num_splits
    lse = tl.load(mid_lse_ptr + b * stride_mlb + h * stride_mlh + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # context length 0: every weight is 0, output 0
    w = tl.exp2(lse - top)
    o = tl.load(mid_o_ptr + b * stride_mob + h * stride_moh + s[:, None] * stride_mos + d[None, :],
                mask=s_mask[:, None] & (d[None, :] < HEAD_DIM), other=0.0)
    den = tl.sum(w, 0)
    out = tl.sum(w[:, None] * o, 0) / tl.where(den > 0, den, 1.0)
    tl.store(o_ptr + b * stride_ot + h * stride_oh + d, out.to(o_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                     context_lens: torch.Tensor, scale: float, num_splits: int, *, block_n: int = 64,
                     out: torch.Tensor | None = None, num_warps: int = 4, k_scale: torch.Tensor | None = None,
                     v_scale: torch.Tensor | None = None, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> out [B, Hq, D], the KV length split ``num_splits`` ways.

    ``num_splits`` fixes the grid (CUDA-graph friendly); each sequence's split length is derived on device.
    ``k_scale``/``v_scale`` (fp32 [Hkv]) dequantize an fp8 cache. ``window``: each query sees the last ``window``
    keys of its context only (a sliding window). ``softcap``: scores become softcap * tanh(score / softcap).
    """
    batch, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} are not a multiple of KV heads {num_kv_heads}")
    _check_last_dim(q, k_cache, v_cache, block_tables, context_lens)
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    if batch == 0:
        return out
    final = num_splits == 1  # the split kernel writes ``out`` itself: no partials, no reduce
    if final:
        mid_o, mid_lse = out.unsqueeze(2), out  # [B, Hq, 1, D] view; mid_lse is never read or written
    else:
        mid_o = torch.empty(batch, num_q_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        mid_lse = torch.empty(batch, num_q_heads, num_splits, dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 (Triton 3.6 enforces it)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, mid_o, mid_lse, scale * LOG2E, *_scales(k_scale, v_scale, q),
        window or 0, _log2_cap(softcap), q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_N=block_n, BLOCK_D=block_d, PRECISION=_dot_precision(q.dtype), KV_SCALED=k_scale is not None,
        FINAL=final, SOFTCAP=softcap is not None, num_warps=num_warps)
    if final:
        return out
    _decode_reduce_kernel[(batch, num_q_heads)](
        mid_o, mid_lse, out, num_splits, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, BLOCK_S=triton.next_power_of_2(num_splits), BLOCK_D=block_d)
    return out


# ---------------------------------------------------------------- prefill / extend (ragged, mixed batches)
@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, o_ptr, block_tables_ptr, query_start_ptr, context_lens_ptr,
                    qk_scale, k_scale_ptr, v_scale_ptr, num_seqs, num_tokens, window, softcap,
                    stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    stride_ot, stride_oh, stride_bt,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, TOKENS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_B: tl.constexpr,
                    PRECISION: tl.constexpr, KV_SCALED: tl.constexpr, SOFTCAP: tl.constexpr):
    # One program per (tile, KV head). Sequence b owns tiles [first(b), first(b + 1)) with first(b) =
    # query_start[b] // TOKENS + b: at least cdiv(its query length, TOKENS) of them, the surplus idle, so the grid
    # (num_tokens // TOKENS + num_seqs tiles) depends on shapes alone and a CUDA graph may hold it for any batch.
    # first() strictly increases, so b = (number of sequences with first(b) <= tile) - 1: one vector load.
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    seqs = tl.arange(0, BLOCK_B)
    firsts = tl.load(query_start_ptr + seqs, mask=seqs < num_seqs, other=2**30) // TOKENS + seqs
    b = tl.sum((firsts <= tile).to(tl.int32), 0) - 1
    tok0 = (tile - tl.load(query_start_ptr + b) // TOKENS - b) * TOKENS
    if KV_SCALED:  # fp8 cache: dequantization scales of this KV head
        qk_scale = qk_scale * tl.load(k_scale_ptr + kvh)
        v_scale = tl.load(v_scale_ptr + kvh)
    else:
        v_scale = 1.0
    q_start = tl.load(query_start_ptr + b)
    q_len = tl.load(query_start_ptr + b + 1) - q_start
    ctx = tl.load(context_lens_ptr + b)

    # row r = (token tok0 + r // GROUP, q head kvh * GROUP + r % GROUP): the whole GQA group shares each K/V tile
    r = tl.arange(0, BLOCK_M)
    tok = tok0 + r // GROUP
    heads = kvh * GROUP + r % GROUP
    row_mask = (r < TOKENS * GROUP) & (tok < q_len)
    q_pos = ctx - q_len + tok  # a row may see no key in a block (padding, a window): m_use keeps it finite
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_off = (q_start + tok).to(tl.int64)
    q = tl.load(q_ptr + (q_off * stride_qt + heads * stride_qh)[:, None] + d[None, :],
                mask=row_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
    # keys needed by this tile: positions < position of its last real token + 1 (none for an idle program); with
    # a sliding window, from the first one its first token sees
    hi = tl.where(tok0 < q_len, ctx - q_len + tl.minimum(tok0 + TOKENS, q_len), 0)
    lo = tl.where(window > 0, tl.maximum(ctx - q_len + tok0 - window + 1, 0), 0)
    lo = tl.minimum(lo, hi) // BLOCK_N * BLOCK_N

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        page = tl.load(block_tables_ptr + b * stride_bt + pos // PAGE, mask=valid, other=0).to(tl.int64)
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + (page * stride_kb + (pos % PAGE) * stride_ks + kvh * stride_kh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        v = tl.load(v_cache_ptr + (page * stride_vb + (pos % PAGE) * stride_vs + kvh * stride_vh)[:, None]
                    + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # scale after: q stays exact in tf32
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        seen = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        seen = seen & ((window <= 0) | (pos[None, :] > q_pos[:, None] - window))
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that sees no key yet (its window is later)
        alpha = tl.exp2(m - m_use)
        p = tl.exp2(s - m_use[:, None])
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PRECISION)
        m = m_new

    o = acc * (v_scale / tl.where(l > 0, l, 1.0))[:, None]
    # the last sequence's surplus tiles zero the tokens after query_start[B] (a padded step's), so that no
    # uninitialized row reaches a layer that reduces over rows (a per-tensor activation scale)
    padding_end = tl.where(b == num_seqs - 1, num_tokens, 0)
    padding = (r < TOKENS * GROUP) & (tok >= q_len) & (q_start + tok < padding_end)
    o = tl.where(row_mask[:, None], o, 0.0)
    tl.store(o_ptr + (q_off * stride_ot + heads * stride_oh)[:, None] + d[None, :],
             o.to(o_ptr.dtype.element_ty), mask=(row_mask | padding)[:, None] & d_mask[None, :])


def prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      query_start: torch.Tensor, context_lens: torch.Tensor, scale: float, *,
                      block_m: int = 64, block_n: int = 64, out: torch.Tensor | None = None,
                      num_warps: int | None = None, k_scale: torch.Tensor | None = None,
                      v_scale: torch.Tensor | None = None, window: int | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Ragged causal attention over the paged cache: q [T, Hq, D] -> out [T, Hq, D]; with ``window``, each query
    sees the keys of the last ``window`` positions up to its own only (a sliding window); with ``softcap``, scores
    become softcap * tanh(score / softcap) (Gemma 2).

    Sequence i's queries are rows ``query_start[i]:query_start[i+1]`` at positions ending at ``context_lens[i] - 1``;
    their own K/V must already be in the cache. Any mix of query lengths (decode = 1) is fine. The launch grid
    depends on T and B alone, so padded inputs replay in a CUDA graph: sequences of query length 0 compute nothing,
    and rows after ``query_start[B]`` are set to 0.
    ``k_scale``/``v_scale`` (fp32 [Hkv]) dequantize an fp8 cache.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if num_q_heads % num_kv_heads:
        raise ValueError(f"query heads {num_q_heads} are not a multiple of KV heads {num_kv_heads}")
    _check_last_dim(q, k_cache, v_cache, block_tables, query_start, context_lens)
    group = num_q_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0:
        return out
    block_m = max(block_m, triton.next_power_of_2(group))
    tokens = block_m // group
    num_warps = num_warps or (4 if head_dim <= 64 else 8)  # fp32 q/acc tiles: keep registers per thread bounded
    _prefill_kernel[(num_tokens // tokens + batch, num_kv_heads)](
        q, k_cache, v_cache, out, block_tables, query_start, context_lens, scale * LOG2E, *_scales(k_scale, v_scale, q),
        batch, num_tokens, window or 0, _log2_cap(softcap),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1), block_tables.stride(0),
        GROUP=group, HEAD_DIM=head_dim, PAGE=k_cache.shape[1], TOKENS=tokens, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_B=max(16, triton.next_power_of_2(batch)),
        PRECISION=_dot_precision(q.dtype), KV_SCALED=k_scale is not None, SOFTCAP=softcap is not None,
        num_warps=num_warps)
    return out


@triton.jit
def _tanh(x):
    # 1 - 2 / (e^2x + 1): exact at both ends (e^2x overflowing to inf gives 1, underflowing to 0 gives -1)
    return 1.0 - 2.0 / (tl.exp2(x * (2.0 * 1.4426950408889634)) + 1.0)


def _log2_cap(softcap: float | None) -> float:
    """The kernels' scores are in log2 units (score * log2 e), so cap * tanh(score / cap) is c * tanh(s / c) with
    c = cap * log2 e; 0.0 for no cap (never read)."""
    if softcap is None:
        return 0.0
    if not 0 < softcap < math.inf:
        raise ValueError(f"softcap must be a positive number, got {softcap}")
    return softcap * LOG2E


# ---------------------------------------------------------------- torch references
def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        query_start: torch.Tensor, context_lens: torch.Tensor, scale: float,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Torch reference of :func:`prefill_attention` (fp32 math, one sequence at a time)."""
    ks = 1.0 if k_scale is None else k_scale.float()[:, None]  # per KV head; broadcasts over [ctx, Hkv, D]
    vs = 1.0 if v_scale is None else v_scale.float()[:, None]
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    page = k_cache.shape[1]
    for i in range(context_lens.shape[0]):
        start, end, ctx = int(query_start[i]), int(query_start[i + 1]), int(context_lens[i])
        if end == start:
            continue
        pos = torch.arange(ctx, device=q.device)
        blocks = block_tables[i, pos // page].long()
        k = (k_cache[blocks, pos % page].float() * ks).repeat_interleave(group, dim=1)  # [ctx, Hq, D]
        v = (v_cache[blocks, pos % page].float() * vs).repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:end].float(), k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx - (end - start), ctx, device=q.device)
        hidden = pos[None, None, :] > q_pos[None, :, None]
        if window is not None:
            hidden = hidden | (pos[None, None, :] <= q_pos[None, :, None] - window)
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(q.dtype)
    return out


def decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                         context_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                         v_scale: torch.Tensor | None = None, window: int | None = None,
                         softcap: float | None = None) -> torch.Tensor:
    """Torch reference of :func:`decode_attention`: one query per sequence, at the last context position."""
    query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, query_start, context_lens, scale, k_scale, v_scale,
                               window, softcap)


def _scales(k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, q: torch.Tensor
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' scale pointers: fp32 [Hkv] each, or ``q`` as a placeholder that an unscaled launch never reads
    (no allocation, so the common path launches nothing extra)."""
    if k_scale is None or v_scale is None:
        if k_scale is not None or v_scale is not None:
            raise ValueError("give both k_scale and v_scale, or neither")
        return q, q
    return k_scale.to(torch.float32).contiguous(), v_scale.to(torch.float32).contiguous()


def default_num_splits(batch: int, num_kv_heads: int, max_context_len: int, num_sms: int,
                       min_split_tokens: int = 128, max_splits: int = 128) -> int:
    """Enough splits to give ~4 programs per SM, none shorter than ``min_split_tokens`` keys."""
    by_length = max(1, math.ceil(max_context_len / min_split_tokens))
    by_occupancy = max(1, math.ceil(4 * num_sms / max(1, batch * num_kv_heads)))
    return min(by_length, by_occupancy, max_splits)
