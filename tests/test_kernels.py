"""Triton kernels against their torch references.

On CPU they run under the Triton interpreter (set below, before any kernel is defined); ``pytest -m gpu`` runs the
same bodies natively on CUDA tensors. fp32 and fp16 only: the interpreter gets bf16 arithmetic wrong.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402

from infer.kernels import attention as attn  # noqa: E402
from infer.kernels import fused_ops as ops  # noqa: E402
from infer.kernels import skinny_gemm  # noqa: E402
from infer.models import layers  # noqa: E402

DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float16, id="fp16")]
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=2e-3, rtol=2e-3)}
# attention on GPU dots fp16-upcast operands in tf32: p (not q.k) loses bits, about one fp16 ulp more
ATTN_TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=4e-3, rtol=4e-3)}


def paged_cache(num_blocks: int, page: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (num_blocks, page, kv_heads, head_dim)
    return torch.randn(shape, dtype=dtype, device=device), torch.randn(shape, dtype=dtype, device=device)


def block_tables_for(context_lens: list[int], page: int, num_blocks: int, device: torch.device) -> torch.Tensor:
    """Distinct shuffled blocks per sequence, padded with 0 (the AttentionMetadata convention)."""
    need = [-(-c // page) for c in context_lens]
    perm = torch.randperm(num_blocks)[: sum(need)].tolist()
    table = torch.zeros(len(need), max(max(need), 1), dtype=torch.int32)
    for i, n in enumerate(need):
        table[i, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    return table.to(device)


# ---------------------------------------------------------------- store_kv
@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    tokens, kv_heads, head_dim, page = 7, 2, 24, 4
    qkv = torch.randn(tokens, 4 + 2 * kv_heads, head_dim, dtype=dtype, device=device)
    k, v = qkv[:, 4:4 + kv_heads], qkv[:, 4 + kv_heads:]  # strided views, as a fused qkv projection gives
    slots = torch.tensor([3, 0, -1, 17, 9, -1, 22], dtype=torch.int64, device=device)
    caches = paged_cache(6, page, kv_heads, head_dim, dtype, device)
    expect = tuple(c.clone() for c in caches)
    attn.store_kv(k, v, *caches, slots)
    attn.store_kv_ref(k, v, *expect, slots)
    assert torch.equal(caches[0], expect[0]) and torch.equal(caches[1], expect[1])


# ---------------------------------------------------------------- decode
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("num_splits,page", [(1, 16), (4, 16), (3, 8)])
def test_decode_attention(device: torch.device, dtype: torch.dtype, group: int, num_splits: int, page: int) -> None:
    torch.manual_seed(group * 10 + num_splits)
    kv_heads, head_dim = 2, 32
    context = [1, 16, 17, 150]  # block boundaries, and 150 keys > one 16-key split tile
    k_cache, v_cache = paged_cache(48, page, kv_heads, head_dim, dtype, device)
    tables = block_tables_for(context, page, 48, device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(len(context), kv_heads * group, head_dim, dtype=dtype, device=device)
    out = attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.3, num_splits, block_n=16)
    ref = attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])


@pytest.mark.parametrize("window", [5, 16, 40])
@pytest.mark.parametrize("num_splits,page", [(1, 16), (3, 8)])
def test_decode_attention_in_a_sliding_window(device: torch.device, window: int, num_splits: int, page: int) -> None:
    """Each query sees the last ``window`` keys of its context: shorter contexts all of theirs."""
    torch.manual_seed(window + num_splits)
    kv_heads, head_dim, group = 2, 32, 2
    context = [1, 16, 17, 150]
    k_cache, v_cache = paged_cache(48, page, kv_heads, head_dim, torch.float32, device)
    tables = block_tables_for(context, page, 48, device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(len(context), kv_heads * group, head_dim, device=device)
    out = attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.3, num_splits, block_n=16, window=window)
    ref = attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, window=window)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])
    unwindowed = attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3)
    assert not torch.allclose(ref[3], unwindowed[3])  # the 150-key context lost keys to the window


@pytest.mark.parametrize(("num_splits", "window"), [(1, None), (3, 20)])
def test_decode_attention_with_softcapped_scores(device: torch.device, num_splits: int, window: int | None) -> None:
    """Gemma 2's scores, cap * tanh(score / cap), with a cap (2.0) that most scores reach."""
    torch.manual_seed(num_splits)
    context = [1, 16, 17, 150]
    k_cache, v_cache = paged_cache(48, 8, 2, 32, torch.float32, device)
    tables = block_tables_for(context, 8, 48, device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(len(context), 4, 32, device=device)
    out = attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.3, num_splits, block_n=16, window=window,
                                softcap=2.0)
    ref = attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, window=window, softcap=2.0)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])
    uncapped = attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.3, window=window)
    assert not torch.allclose(ref[1:], uncapped[1:], atol=1e-3)


@pytest.mark.parametrize("num_splits", [1, 4])  # one split writes the output without the reduce kernel
def test_decode_zero_context_gives_zeros(device: torch.device, num_splits: int) -> None:
    k_cache, v_cache = paged_cache(4, 16, 1, 16, torch.float32, device)
    q = torch.randn(2, 2, 16, device=device)
    lens = torch.tensor([0, 5], dtype=torch.int32, device=device)
    tables = torch.tensor([[0], [1]], dtype=torch.int32, device=device)
    out = attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, num_splits)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    torch.testing.assert_close(out[1:], attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.25)[1:])


def test_strided_metadata_is_refused_not_misread(device: torch.device) -> None:
    """The kernels index 1-D metadata as contiguous: a strided view (every other entry) would read other entries
    (out of bounds for a block table) and write other slots."""
    k_cache, v_cache = paged_cache(4, 16, 1, 16, torch.float32, device)
    q, k = torch.randn(2, 2, 16, device=device), torch.randn(2, 1, 16, device=device)

    def ints(*values: int) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    def every_other(t: torch.Tensor) -> torch.Tensor:  # the same values, as a strided view
        return torch.stack([t, torch.full_like(t, 99)], dim=-1).flatten(-2)[..., ::2]

    lens, tables, starts = ints(3, 5), ints(0, 1).view(2, 1), ints(0, 1, 2)
    for bad in range(2):  # context lengths, block tables
        args = [lens, tables]
        args[bad] = every_other(args[bad])
        with pytest.raises(ValueError, match="contiguous"):
            attn.decode_attention(q, k_cache, v_cache, args[1], args[0], 0.25, 1)
    for bad in range(3):  # context lengths, block tables, query starts
        args = [lens, tables, starts]
        args[bad] = every_other(args[bad])
        with pytest.raises(ValueError, match="contiguous"):
            attn.prefill_attention(q, k_cache, v_cache, args[1], args[2], args[0], 0.25)
    with pytest.raises(ValueError, match="contiguous"):
        attn.store_kv(k, k, k_cache, v_cache, every_other(torch.tensor([1, 2], device=device)))
    positions, cos = torch.tensor([0, 1], device=device), torch.randn(8, 8, device=device)
    for args in ((every_other(positions), cos, cos), (positions, every_other(cos), cos),
                 (positions, cos, every_other(cos))):
        with pytest.raises(ValueError, match="contiguous"):
            ops.rotary_embedding(args[0], q.clone(), k.clone(), args[1], args[2])
    attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)  # the contiguous originals run


# ---------------------------------------------------------------- prefill / extend
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_attention(device: torch.device, dtype: torch.dtype, group: int, block_m: int) -> None:
    torch.manual_seed(group + block_m)
    kv_heads, head_dim, page = 2, 32, 16
    query = [1, 7, 20, 3, 1]
    context = [9, 7, 45, 3, 33]  # decode rows, fresh prompts, and extends over cached prefixes
    k_cache, v_cache = paged_cache(24, page, kv_heads, head_dim, dtype, device)
    tables = block_tables_for(context, page, 24, device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(sum(query), kv_heads * group, head_dim, dtype=dtype, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.2, block_m=block_m,
                                 block_n=32)
    ref = attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.2)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [4, 20])
@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_attention_in_a_sliding_window(device: torch.device, dtype: torch.dtype, window: int,
                                               block_m: int) -> None:
    """Each query token sees the keys of the last ``window`` positions up to its own, in fresh prompts, extends
    over cached prefixes and decode rows alike."""
    torch.manual_seed(window + block_m)
    kv_heads, head_dim, page, group = 2, 32, 16, 2
    query = [1, 7, 40, 3, 1]
    context = [9, 7, 75, 3, 33]
    k_cache, v_cache = paged_cache(24, page, kv_heads, head_dim, dtype, device)
    tables = block_tables_for(context, page, 24, device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(sum(query), kv_heads * group, head_dim, dtype=dtype, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.2, block_m=block_m, block_n=16,
                                 window=window)
    ref = attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.2, window=window)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_attention_with_softcapped_scores(device: torch.device, dtype: torch.dtype, window: int | None
                                                  ) -> None:
    """cap * tanh(score / cap) before the causal mask and the softmax, in prompts, extends and decode rows."""
    torch.manual_seed(7)
    query, context = [1, 7, 40, 3], [9, 7, 75, 3]
    k_cache, v_cache = paged_cache(24, 16, 2, 32, dtype, device)
    tables = block_tables_for(context, 16, 24, device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(sum(query), 4, 32, dtype=dtype, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_n=16, window=window,
                                 softcap=2.0)
    ref = attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.3, window=window, softcap=2.0)
    torch.testing.assert_close(out, ref, **ATTN_TOL[dtype])
    uncapped = attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.3, window=window)
    assert not torch.allclose(ref.float(), uncapped.float(), atol=1e-2)


@pytest.mark.parametrize("block_m", [16, 64])
def test_prefill_attention_skips_padding(device: torch.device, block_m: int) -> None:
    """A CUDA graph's padded step: more rows than sequences (query length 0, context 0, stale tables) and tokens
    after the last sequence's. Real rows equal the unpadded call's; the padding tokens' rows are zeroed (no
    uninitialized memory reaches the model)."""
    torch.manual_seed(5)
    kv_heads, group, head_dim, page = 2, 2, 16, 8
    query, context = [3, 1, 18], [10, 33, 18]
    k_cache, v_cache = paged_cache(16, page, kv_heads, head_dim, torch.float32, device)
    tables = block_tables_for(context, page, 16, device)
    starts = torch.tensor([0, 3, 4, 22], dtype=torch.int32, device=device)  # query lengths 3, 1, 18
    assert starts.diff().tolist() == query
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(22, kv_heads * group, head_dim, device=device)
    want = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_m=block_m, block_n=16)
    pad_tokens, pad_rows = 35, 6  # a graph of 57 tokens and 9 rows
    q_pad = torch.cat([q, torch.randn(pad_tokens, *q.shape[1:], device=device)])
    tables_pad = torch.cat([tables, torch.randint(0, 16, (pad_rows, tables.shape[1]), dtype=torch.int32,
                                                  device=device)])
    starts_pad = torch.cat([starts, torch.full((pad_rows,), 22, dtype=torch.int32, device=device)])
    lens_pad = torch.cat([lens, torch.zeros(pad_rows, dtype=torch.int32, device=device)])
    out = torch.full_like(q_pad, float("nan"))
    attn.prefill_attention(q_pad, k_cache, v_cache, tables_pad, starts_pad, lens_pad, 0.3, block_m=block_m,
                           block_n=16, out=out)
    torch.testing.assert_close(out[:22], want, atol=0, rtol=0)
    assert bool((out[22:] == 0).all())


def test_attention_head_dim_not_a_power_of_two(device: torch.device) -> None:
    torch.manual_seed(4)
    context, page = [3, 21], 8
    k_cache, v_cache = paged_cache(8, page, 1, 40, torch.float32, device)
    tables = block_tables_for(context, page, 8, device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(2, 2, 40, device=device)
    out = attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.2, 2, block_n=16)
    torch.testing.assert_close(out, attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 0.2))
    starts = torch.tensor([0, 2, 7], dtype=torch.int32, device=device)
    q = torch.randn(7, 2, 40, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.2)
    torch.testing.assert_close(out, attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.2))


def test_store_kv_reads_and_writes_each_tensor_with_its_own_strides(device: torch.device) -> None:
    """k and v need not share a layout (Qwen3's k leaves its norm contiguous while v stays a view of the fused
    projection), nor need the two caches (last dim contiguous, other strides free): each is indexed by its own."""
    torch.manual_seed(1)
    tokens, kv_heads, head_dim, page = 5, 2, 16, 4
    k = torch.randn(tokens, kv_heads, head_dim, device=device)
    v = torch.randn(tokens, 3 * kv_heads, head_dim, device=device)[:, kv_heads:2 * kv_heads]
    k_cache = torch.zeros(4, page, kv_heads, head_dim, device=device)
    v_cache = torch.zeros(4, page, 2 * kv_heads, head_dim, device=device)[:, :, kv_heads:]
    slots = [5, -1, 0, 15, 9]
    attn.store_kv(k, v, k_cache, v_cache, torch.tensor(slots, device=device))
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    for t, slot in enumerate(slots):
        if slot >= 0:
            want_k[slot // page, slot % page], want_v[slot // page, slot % page] = k[t], v[t]
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_attention_reads_a_strided_q_and_caches_of_different_layouts(device: torch.device, num_splits: int) -> None:
    """q as the engine passes it, a view of the fused qkv projection (its row stride is not the output's), and a V
    cache whose strides are not the K cache's: the output rows land where a contiguous q's would."""
    torch.manual_seed(11)
    kv_heads, group, head_dim, page = 2, 2, 16, 8
    context, query = [5, 30, 12], [1, 9, 1]
    k_cache = torch.randn(12, page, kv_heads, head_dim, device=device)
    v_cache = torch.randn(12, page, 3 * kv_heads, head_dim, device=device)[:, :, kv_heads:2 * kv_heads]
    tables = block_tables_for(context, page, 12, device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    heads = kv_heads * group
    qkv = torch.randn(sum(query), heads + 2 * kv_heads, head_dim, device=device)
    q = qkv[:, :heads]
    want = attn.paged_attention_ref(q.contiguous(), k_cache, v_cache.contiguous(), tables, starts, lens, 0.3)
    got = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_m=16, block_n=16)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])
    q_dec = torch.randn(3, heads + 2 * kv_heads, head_dim, device=device)[:, :heads]
    want = attn.decode_attention_ref(q_dec.contiguous(), k_cache, v_cache.contiguous(), tables, lens, 0.3)
    got = attn.decode_attention(q_dec, k_cache, v_cache, tables, lens, 0.3, num_splits, block_n=16)
    torch.testing.assert_close(got, want, **ATTN_TOL[torch.float32])


def test_prefill_attention_finds_the_sequence_of_each_tile_past_16_sequences(device: torch.device) -> None:
    """A mixed step of 20 sequences (decode rows and two prompts): each tile's sequence is looked up among all of
    them, not among the first 16."""
    torch.manual_seed(12)
    page = 8
    query = [1] * 17 + [5, 1, 9]
    context = [3 + 2 * i for i in range(17)] + [5, 21, 14]
    k_cache, v_cache = paged_cache(64, page, 1, 16, torch.float32, device)
    tables = block_tables_for(context, page, 64, device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(sum(query), 2, 16, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, block_m=16, block_n=16)
    ref = attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.25)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


@pytest.mark.parametrize("block_m", [2, 16])  # 2: fewer rows than the group asks (raised to 4, one token a tile)
def test_attention_with_a_group_that_is_not_a_power_of_two(device: torch.device, block_m: int) -> None:
    """Three query heads per KV head (as 12 over 4, or Qwen2.5-7B's 7): a tile of 16 rows holds 5 tokens and one
    spare row, which must compute and write nothing."""
    torch.manual_seed(13)
    kv_heads, group, head_dim, page = 2, 3, 16, 8
    query, context = [1, 12, 7], [10, 12, 20]
    k_cache, v_cache = paged_cache(12, page, kv_heads, head_dim, torch.float32, device)
    tables = block_tables_for(context, page, 12, device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(sum(query), kv_heads * group, head_dim, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_m=block_m, block_n=16)
    torch.testing.assert_close(out, attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.3),
                               **ATTN_TOL[torch.float32])
    q_dec = q[[0, 12, 19]]
    out = attn.decode_attention(q_dec, k_cache, v_cache, tables, lens, 0.3, 2, block_n=16)
    torch.testing.assert_close(out, attn.decode_attention_ref(q_dec, k_cache, v_cache, tables, lens, 0.3),
                               **ATTN_TOL[torch.float32])


def test_prefill_attention_zeroes_padding_tokens_of_a_batch_without_padding_sequences(device: torch.device) -> None:
    """Padding tokens after the last sequence's and no padding sequence: the last sequence's own tiles zero them,
    the rows that share its last real tile included."""
    torch.manual_seed(14)
    query, context = [3, 18], [10, 18]
    k_cache, v_cache = paged_cache(8, 8, 2, 16, torch.float32, device)
    tables = block_tables_for(context, 8, 8, device)
    starts = torch.tensor([0] + query, dtype=torch.int32).cumsum(0).to(torch.int32).to(device)  # 0, 3, 21
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(30, 4, 16, device=device)  # 9 padding tokens
    out = torch.full_like(q, float("nan"))
    attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_m=16, block_n=16, out=out)
    torch.testing.assert_close(out[:21], attn.paged_attention_ref(q[:21], k_cache, v_cache, tables, starts, lens,
                                                                  0.3), **ATTN_TOL[torch.float32])
    assert bool((out[21:] == 0).all())


@pytest.mark.parametrize("window", [4, 9])
def test_prefill_attention_window_starting_at_every_offset_in_a_key_block(device: torch.device, window: int) -> None:
    """Decode rows whose windows start at each of the 16 offsets in a key block: the first key of each window is
    read, also where it is the last key of the block before the one its query falls in."""
    torch.manual_seed(window)
    context = list(range(window + 8, window + 24))  # window starts ctx - window = 8 ... 23
    k_cache, v_cache = paged_cache(64, 8, 1, 16, torch.float32, device)
    tables = block_tables_for(context, 8, 64, device)
    starts = torch.arange(len(context) + 1, dtype=torch.int32, device=device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.randn(len(context), 2, 16, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.3, block_n=16, window=window)
    ref = attn.paged_attention_ref(q, k_cache, v_cache, tables, starts, lens, 0.3, window=window)
    torch.testing.assert_close(out, ref, **ATTN_TOL[torch.float32])


def test_attention_keeps_a_score_far_above_the_later_blocks(device: torch.device) -> None:
    """One key in the first block scores 100 above every later key (an attention sink): the running max carries it,
    so later blocks' rescaling factors stay at most 1 (exp2 of a 144 gap would overflow fp32)."""
    torch.manual_seed(15)
    head_dim, context = 16, [48]
    k_cache, v_cache = paged_cache(6, 8, 1, head_dim, torch.float32, device)
    tables = block_tables_for(context, 8, 6, device)
    lens = torch.tensor(context, dtype=torch.int32, device=device)
    q = torch.zeros(1, 1, head_dim, device=device)
    q[0, 0, 0] = 10.0
    k_cache.mul_(0.1)
    k_cache[tables[0, 0], 0] = 0.0
    k_cache[tables[0, 0], 0, 0, 0] = 10.0  # key 0: score 100, the others about 1 or less
    out = attn.decode_attention(q, k_cache, v_cache, tables, lens, 1.0, 1, block_n=16)
    torch.testing.assert_close(out, attn.decode_attention_ref(q, k_cache, v_cache, tables, lens, 1.0))
    torch.testing.assert_close(out[0, 0], v_cache[tables[0, 0], 0, 0])  # all of the weight on key 0
    starts = torch.tensor([0, 1], dtype=torch.int32, device=device)
    out = attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 1.0, block_n=16)
    torch.testing.assert_close(out[0, 0], v_cache[tables[0, 0], 0, 0])


def test_attention_refuses_one_sided_kv_scales_and_uneven_groups(device: torch.device) -> None:
    k_cache, v_cache = paged_cache(2, 8, 2, 16, torch.float32, device)
    tables, lens = torch.zeros(1, 1, dtype=torch.int32, device=device), torch.ones(1, dtype=torch.int32, device=device)
    starts, scale = torch.tensor([0, 1], dtype=torch.int32, device=device), torch.ones(2, device=device)
    q = torch.randn(1, 4, 16, device=device)
    for kwargs in ({"k_scale": scale}, {"v_scale": scale}):
        with pytest.raises(ValueError, match="give both"):
            attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 1, **kwargs)
        with pytest.raises(ValueError, match="give both"):
            attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25, **kwargs)
    q = torch.randn(1, 3, 16, device=device)  # 3 query heads over 2 KV heads
    with pytest.raises(ValueError, match="not a multiple"):
        attn.decode_attention(q, k_cache, v_cache, tables, lens, 0.25, 1)
    with pytest.raises(ValueError, match="not a multiple"):
        attn.prefill_attention(q, k_cache, v_cache, tables, starts, lens, 0.25)


# ---------------------------------------------------------------- fused small ops (references: models/layers.py)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(device: torch.device, dtype: torch.dtype, with_residual: bool) -> None:
    torch.manual_seed(1)
    x = torch.randn(2, 3, 96, dtype=dtype, device=device)
    residual = torch.randn_like(x) if with_residual else None
    weight = torch.randn(96, dtype=dtype, device=device) * 0.2 + 1.0
    got = ops.rms_norm(x, weight, 1e-6, residual)
    ref = layers.rms_norm(x, weight, 1e-6, residual)
    for g, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref)), strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [False, True])
def test_gemma_rms_norm(device: torch.device, dtype: torch.dtype, with_residual: bool) -> None:
    """Gemma's (1 + w) norm, multiplied in float32 and rounded once: the kernel against the torch op, and the torch
    op against transformers' Gemma3RMSNorm (whose weight holds w)."""
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    torch.manual_seed(4)
    x = torch.randn(2, 3, 96, dtype=dtype, device=device) * 4
    residual = torch.randn_like(x) if with_residual else None
    w = torch.randn(96, device=device) * 0.3
    got = ops.gemma_rms_norm(x, 1.0 + w, 1e-6, residual)
    ref = layers.gemma_rms_norm(x, 1.0 + w, 1e-6, residual)
    for g, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref)), strict=True):
        assert g.dtype == r.dtype == dtype and g.shape == r.shape
        torch.testing.assert_close(g, r, **TOL[dtype])
        if dtype == torch.float16:  # one rounding, where the torch op has it: the last bit, but for fp32 order
            assert (g == r).float().mean() > 0.97  # (rounding the normed value first matches 71%)
    hf = Gemma3RMSNorm(96, eps=1e-6).to(device)
    with torch.no_grad():
        hf.weight.copy_(w)
        summed = x if residual is None else x + residual
        normed = ref[0] if isinstance(ref, tuple) else ref
        assert torch.equal(normed, hf(summed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inplace", [False, True])
@pytest.mark.parametrize("rotary_dim", [32, 24])  # whole heads; Phi-4-mini's partial rotation (3/4 of each head)
def test_rotary_embedding(device: torch.device, dtype: torch.dtype, inplace: bool, rotary_dim: int) -> None:
    torch.manual_seed(2)
    rope = layers.RotaryEmbedding(rotary_dim, 64, {"rope_theta": 10000.0}).to(device)
    qkv = torch.randn(6, 4 + 2 + 2, 32, dtype=dtype, device=device)
    q, k = qkv[:, :4], qkv[:, 4:6]  # strided views of a fused projection
    positions = torch.tensor([0, 5, 63, 1, 7, 30], device=device)
    ref_q, ref_k = layers.apply_rotary(positions, q, k, rope.cos, rope.sin)
    before = q.clone(), k.clone()
    got_q, got_k = ops.rotary_embedding(positions, q, k, rope.cos, rope.sin, inplace=inplace)
    torch.testing.assert_close(got_q, ref_q, **TOL[dtype])
    torch.testing.assert_close(got_k, ref_k, **TOL[dtype])
    for got, original in zip((got_q, got_k), before):  # the dimensions past rotary_dim pass as they were
        assert torch.equal(got[..., rotary_dim:], original[..., rotary_dim:])
    if inplace:
        assert got_q.data_ptr() == q.data_ptr()


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(device: torch.device, dtype: torch.dtype) -> None:
    torch.manual_seed(3)
    gate_up = torch.randn(3, 5, 2 * 40, dtype=dtype, device=device) * 3
    gate, up = gate_up[..., :40], gate_up[..., 40:]  # strided halves, as one gate/up projection would give
    got = ops.silu_and_mul(gate, up, block=16)  # 3 column blocks, the last one partial
    assert got.shape == (3, 5, 40)
    torch.testing.assert_close(got, layers.silu_and_mul(gate, up), **TOL[dtype])
    with pytest.raises(ValueError, match="one shape"):
        ops.silu_and_mul(gate, up[..., :39])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_tanh_and_mul(device: torch.device, dtype: torch.dtype) -> None:
    """Gemma's MLP activation: gelu(gate, approximate="tanh") * up, the activation rounded before the mul."""
    torch.manual_seed(5)
    gate_up = torch.randn(3, 5, 2 * 40, dtype=dtype, device=device) * 3
    gate_up[0, 0, :8] = torch.tensor([0.0, 1e-4, -1e-4, 12.0, -12.0, 30.0, -30.0, 0.5])  # tanh's flat ends, near 0
    gate, up = gate_up[..., :40], gate_up[..., 40:]
    got = ops.gelu_tanh_and_mul(gate, up, block=16)
    torch.testing.assert_close(got, layers.gelu_tanh_and_mul(gate, up), **TOL[dtype])


@pytest.mark.parametrize("weight_dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_rounds_the_normed_value_where_the_torch_op_does(device: torch.device, weight_dtype: torch.dtype,
                                                                  with_residual: bool) -> None:
    """fp16 activations: the normed value is rounded to fp16 before the weight multiply (HF Llama), so the kernel
    equals the torch op to the last bit but for fp32 summation order (rounding once instead matches 73%); an fp32
    weight promotes the output to fp32, which still carries the fp16 rounding of the normed value."""
    torch.manual_seed(6)
    x = torch.randn(8, 96, dtype=torch.float16, device=device) * 3
    residual = torch.randn_like(x) if with_residual else None
    weight = (torch.randn(96, device=device) * 0.2 + 1.0).to(weight_dtype)
    got = ops.rms_norm(x, weight, 1e-6, residual)
    ref = layers.rms_norm(x, weight, 1e-6, residual)
    for g, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref)), strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert (g == r).float().mean() > 0.97
    assert (got[0] if with_residual else got).dtype == weight_dtype


@pytest.mark.parametrize("norm", ["rms_norm", "gemma_rms_norm"])
@pytest.mark.parametrize("layout", ["column-slice", "transposed"])
def test_rms_norm_reads_and_writes_rows_with_their_own_strides(device: torch.device, norm: str, layout: str) -> None:
    """x a column slice of a wider tensor (its row stride is not the output's, nor the residual's), or a transposed
    one (its last dimension strided: copied to contiguous rows first)."""
    torch.manual_seed(7)
    wide, tall = torch.randn(5, 128, device=device), torch.randn(96, 5, device=device)
    x = wide[:, :96] if layout == "column-slice" else tall.t()
    residual = torch.randn(5, 96, device=device)
    weight = torch.randn(96, device=device) * 0.2 + 1.0
    for res in (None, residual):
        got = getattr(ops, norm)(x, weight, 1e-6, res)
        ref = getattr(layers, norm)(x, weight, 1e-6, res)
        for g, r in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, ref)), strict=True):
            torch.testing.assert_close(g, r, **TOL[torch.float32])


def test_rotary_embedding_with_head_strides_that_are_not_the_head_size(device: torch.device) -> None:
    """Heads spaced wider than their size (a slice of each head's row), and a sin table that is a view of a joint
    cos/sin table: each tensor is indexed with its own strides."""
    torch.manual_seed(8)
    rope = layers.RotaryEmbedding(32, 64, {"rope_theta": 10000.0}).to(device)
    q = torch.randn(6, 4, 64, device=device)[:, :, :32]
    k = torch.randn(6, 2, 48, device=device)[:, :, :32]
    sin = torch.cat([rope.cos, rope.sin], dim=1)[:, rope.cos.shape[1]:]  # row stride 32, cos's is 16
    positions = torch.tensor([0, 5, 63, 1, 7, 30], device=device)
    ref_q, ref_k = layers.apply_rotary(positions, q, k, rope.cos, sin)
    got_q, got_k = ops.rotary_embedding(positions, q, k, rope.cos, sin)
    torch.testing.assert_close(got_q, ref_q, **TOL[torch.float32])
    torch.testing.assert_close(got_k, ref_k, **TOL[torch.float32])


@pytest.mark.parametrize("act", ["silu_and_mul", "gelu_tanh_and_mul"])
def test_act_and_mul_rounds_the_activation_before_the_mul(device: torch.device, act: str) -> None:
    """fp16: the activation is rounded to fp16 before the product, as torch's separate ops round it, so the kernel
    equals the torch ops to the last bit but for fp32 rounding (rounding the product once instead matches 72%). The
    up half is read with its own row stride."""
    torch.manual_seed(9)
    gate = torch.randn(6, 64, dtype=torch.float16, device=device) * 3
    up = torch.randn(6, 96, dtype=torch.float16, device=device)[:, 16:80]
    got = getattr(ops, act)(gate, up, block=32)
    ref = getattr(layers, act)(gate, up)
    torch.testing.assert_close(got, ref, **TOL[torch.float16])
    assert (got == ref).float().mean() > 0.97


# ---------------------------------------------------------------- skinny GEMM (reference: torch matmul in fp32)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("block_n", [None, 16, 64])
def test_skinny_gemm(device: torch.device, dtype: torch.dtype, rows: int, block_n: int | None) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 300, dtype=dtype, device=device)  # K and N off the tile sizes: masked edges
    weight = torch.randn(72, 300, dtype=dtype, device=device) * 0.1
    got = skinny_gemm.skinny_gemm(x, weight, block_n=block_n, block_k=128, num_sms=4)
    want = (x.float() @ weight.float().T).to(dtype)
    assert got.shape == (rows, 72) and got.dtype == dtype
    torch.testing.assert_close(got, want, **({"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else TOL[dtype]))


@pytest.mark.parametrize("dtype", [torch.float16])
def test_a_linear_layer_on_the_skinny_path_adds_its_bias(device: torch.device, dtype: torch.dtype) -> None:
    """UnquantizedMethod with skinny rows enabled: x @ W.T + b for few rows (the kernel), as F.linear for more."""
    from infer.models.layers import UnquantizedMethod

    torch.manual_seed(0)
    method, weight = UnquantizedMethod(skinny_max_rows=4), torch.randn(40, 96, dtype=dtype, device=device) * 0.1
    bias = torch.randn(40, dtype=dtype, device=device)
    for rows in (2, 9):  # the kernel's, then torch's
        x = torch.randn(1, rows, 96, dtype=dtype, device=device)
        want = (x.float() @ weight.float().T + bias.float()).to(dtype)
        torch.testing.assert_close(method.matmul(x, weight, bias), want, **TOL[dtype])


def test_skinny_gemm_refuses_what_it_cannot_do(device: torch.device) -> None:
    w = torch.randn(32, 64, device=device)
    with pytest.raises(ValueError, match="M <= 16"):
        skinny_gemm.skinny_gemm(torch.randn(17, 64, device=device), w)
    with pytest.raises(ValueError, match="contiguous along K"):
        skinny_gemm.skinny_gemm(torch.randn(64, 2, device=device).T, w)
    assert skinny_gemm.default_block_n(16384, 132) == 64 and skinny_gemm.default_block_n(3072, 132) == 16


def test_skinny_gemm_reads_rows_with_their_own_strides(device: torch.device) -> None:
    """x and the weight contiguous along K only: column slices of wider tensors (row strides 320 and 400, not K)."""
    torch.manual_seed(6)
    x = torch.randn(3, 320, device=device)[:, :300]
    weight = (torch.randn(72, 400, device=device) * 0.1)[:, 100:]
    got = skinny_gemm.skinny_gemm(x, weight, block_n=16, block_k=128)
    torch.testing.assert_close(got, x @ weight.T, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- the fused ops inside a model
@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norms run through the fused RMSNorm too
def test_model_with_fused_ops_equals_torch_ops(device: torch.device, arch: str, tiny_model_factory) -> None:
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    model = str(tiny_model_factory(arch))
    base = dict(model=model, device=device.type, dtype="float32", attention="torch", num_kv_blocks=64,
                cuda_graphs=False)
    fused, plain = Engine(EngineConfig(**base, fused_ops=True)), Engine(EngineConfig(**base, fused_ops=False))
    assert fused.loaded.model.ops.name == "triton" and plain.loaded.model.ops.name == "torch"
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
    prompts = [[5, 17, 99, 3, 250, 8, 41], [7, 7, 300]]
    for got, want in zip(fused.generate(prompts, params), plain.generate(prompts, params), strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for got_top, want_top in zip(got.outputs[0].logprobs, want.outputs[0].logprobs, strict=True):
            assert got_top.keys() == want_top.keys()
            assert list(got_top.values()) == pytest.approx(list(want_top.values()), abs=1e-4)


def test_model_with_skinny_gemm_matches_torch_matmul(device: torch.device, tiny_model_factory) -> None:
    """--skinny-gemm-rows 16 in float16: every linear and the tied head of a 7-token prefill run the skinny kernel;
    the first token's top logprobs match the torch-matmul engine's (fp16 rounding apart)."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    base = dict(model=str(tiny_model_factory("llama")), device=device.type, dtype="float16", attention="torch",
                num_kv_blocks=64, cuda_graphs=False)
    skinny, plain = Engine(EngineConfig(**base, skinny_gemm_rows=16)), Engine(EngineConfig(**base))
    model = skinny.loaded.model
    assert model.tied_head.skinny_max_rows == 16 and model.model.layers[0].mlp.down_proj.method is model.tied_head
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    prompt = [[5, 17, 99, 3, 250, 8, 41]]
    got = skinny.generate(prompt, params)[0].outputs[0].logprobs[0]
    want = plain.generate(prompt, params)[0].outputs[0].logprobs[0]
    common = got.keys() & want.keys()
    assert len(common) >= 4
    assert [got[t] for t in common] == pytest.approx([want[t] for t in common], abs=2e-2)


def test_skinny_gemm_is_refused_on_the_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch,
                                                                  tiny_model_factory) -> None:
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.errors import ConfigError

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="drop --skinny-gemm-rows"):
        Engine(EngineConfig(model=str(tiny_model_factory("llama")), device="cpu", skinny_gemm_rows=8))


def test_fused_ops_are_refused_on_the_cpu_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from infer.core.config import EngineConfig
    from infer.core.errors import ConfigError
    from infer.plugins.llama_family import pointwise_ops

    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ConfigError, match="drop --fused-ops"):
        pointwise_ops(EngineConfig(device="cpu", fused_ops=True))
    assert pointwise_ops(EngineConfig(device="cpu")).name == "torch"  # the default on a CPU


def test_fused_ops_default_on_cuda_without_triton_warns_and_runs_torch_ops(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from infer.core import loader
    from infer.core.config import EngineConfig
    from infer.core.errors import ConfigError
    from infer.plugins.llama_family import pointwise_ops

    def no_triton() -> None:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(loader, "resolve_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(layers, "triton_ops", no_triton)
    with caplog.at_level(logging.WARNING, logger="infer"):
        assert pointwise_ops(EngineConfig(device="cuda")).name == "torch"
    assert "fused ops are off" in caplog.text
    with pytest.raises(ConfigError, match="--no-fused-ops"):
        pointwise_ops(EngineConfig(device="cuda", fused_ops=True))


def test_a_sliding_layers_decode_splits_cover_its_window_not_the_context() -> None:
    """One sequence, 8 KV heads, a 32k context on 132 SMs: 66 splits for a full layer (4 programs per SM); a layer
    with a 256-key window reads 256 keys, so 2 splits of 128 (66 left 62 of them empty)."""
    from infer.plugins.triton_attention import TritonAttentionBackend, TritonPlan

    backend = TritonAttentionBackend(attn, num_sms=132)
    plan = TritonPlan(all_decode=True, batch=1, max_context_len=32768)
    assert backend.num_splits(plan, 8) == 66
    assert backend.num_splits(plan, 8, window=256) == 2
    assert backend.num_splits(plan, 8, window=65536) == 66
