"""AWQ and FP8: formats, packing, RTN error bounds, the Triton kernels (interpreted on CPU), the quant methods on
``infer.models.layers.Linear``, config validation, and the plugin registrations."""
from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():  # must precede the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.errors import CheckpointError, ConfigError, InvalidRequestError  # noqa: E402
from infer.core.registry import Registry  # noqa: E402
from infer.kernels.awq_gemm import awq_gemm, awq_gemm_reference  # noqa: E402
from infer.kernels.fp8 import per_token_quant, w8a8_gemm, w8a8_gemm_reference  # noqa: E402
from infer.models.layers import Linear, UnquantizedMethod  # noqa: E402
from infer.plugins import awq as awq_plugin  # noqa: E402
from infer.plugins import fp8 as fp8_plugin  # noqa: E402
from infer.quant import awq, fp8  # noqa: E402
from infer.quant.awq_method import AwqLinearMethod, auto_group_size  # noqa: E402
from infer.quant.fp8_method import Fp8LinearMethod  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ORDER = [0, 2, 4, 6, 1, 3, 5, 7]


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test draws the same random tensors."""
    torch.manual_seed(0)


# ---------------------------------------------------------------- references written from the format's definition
def naive_pack(q: torch.Tensor) -> torch.Tensor:
    """Nibble i of packed column c holds column c * 8 + ORDER[i], written as a loop."""
    values = q.numpy().astype(np.uint32)
    packed = np.zeros((values.shape[0], values.shape[1] // 8), dtype=np.uint32)
    for c in range(packed.shape[1]):
        for i in range(8):
            packed[:, c] |= values[:, c * 8 + ORDER[i]] << np.uint32(4 * i)
    return torch.from_numpy(packed.view(np.int32).copy())


def naive_unpack(packed: torch.Tensor) -> torch.Tensor:
    """naive_pack's inverse, written as a loop: column c * 8 + ORDER[i] is nibble i of packed column c."""
    words = packed.numpy().view(np.uint32)
    values = np.zeros((words.shape[0], words.shape[1] * 8), dtype=np.int64)
    for c in range(words.shape[1]):
        for i in range(8):
            values[:, c * 8 + ORDER[i]] = (words[:, c] >> np.uint32(4 * i)) & np.uint32(0xF)
    return torch.from_numpy(values)


def naive_dequant_fp16(q: torch.Tensor, z: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """AutoAWQ's dequantization arithmetic: integer difference times fp16 scales, in fp16, [in, out]."""
    zz = z.repeat_interleave(group, dim=0)
    ss = s.repeat_interleave(group, dim=0)
    return (q.to(torch.int8) - zz.to(torch.int8)) * ss


def round_up_to_fp16(x: np.ndarray) -> np.ndarray:
    """Positive fp32 -> the smallest fp16 >= x."""
    h = x.astype(np.float16)
    return np.where(h.astype(np.float32) < x, np.nextafter(h, np.float16(np.inf)), h)


def rtn_reference(w: torch.Tensor, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``quantize_rtn``'s documented rule per group, in numpy fp32: the range widened to include 0 (floored at
    AutoAWQ's 1e-5), s = range / 15 rounded up to fp16, z = clamp(-round(min / s)), q = clamp(round(w / s) + z).
    Returns q [out, groups, group], z [out, groups] and fp16 s [out, groups]."""
    x = w.to(torch.float32).numpy().reshape(w.shape[0], -1, group)
    hi, lo = np.maximum(x.max(axis=-1), 0), np.minimum(x.min(axis=-1), 0)
    s = round_up_to_fp16(np.maximum(hi - lo, np.float32(1e-5)) / np.float32(15))
    z = np.clip(-np.round(lo / s.astype(np.float32)), 0, 15)
    q = np.clip(np.round(x / s.astype(np.float32)[..., None]) + z[..., None], 0, 15)
    return q, z, s


def awq_state(out_features: int, in_features: int, group: int, seed: int = 0
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A random weight [out, in] and its packed AutoAWQ-layout tensors."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(out_features, in_features, generator=g)
    qweight, qzeros, scales = awq.quantize_rtn(weight, group)
    return weight, {"qweight": qweight, "qzeros": qzeros, "scales": scales}


# ---------------------------------------------------------------- AWQ packing
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 6), packs=st.integers(1, 4), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(rows: int, packs: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (rows, packs * 8), generator=g, dtype=torch.int32)
    packed = awq.pack_int4(q)
    assert packed.dtype == torch.int32 and packed.shape == (rows, packs)
    assert torch.equal(packed, naive_pack(q))
    assert torch.equal(awq.unpack_int4(packed), q)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=1, max_size=12))
def test_every_int32_unpacks_and_repacks(words: list[int]) -> None:
    packed = torch.tensor(words, dtype=torch.int32).reshape(1, -1)
    assert torch.equal(awq.pack_int4(awq.unpack_int4(packed)), packed)


def test_nibble_layout_matches_the_format() -> None:
    for i, column in enumerate(ORDER):
        q = torch.zeros(1, 16, dtype=torch.int32)
        q[0, 8 + column] = 0xF
        packed = awq.pack_int4(q)
        assert packed[0, 0] == 0
        assert (int(packed[0, 1]) & 0xFFFFFFFF) == 0xF << (4 * i)


def test_pack_rejects_out_of_range() -> None:
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        awq.pack_int4(torch.full((1, 8), 16))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):  # a negative value would carry into the next nibbles
        awq.pack_int4(torch.full((1, 8), -1))
    with pytest.raises(ValueError, match="multiple of 8"):
        awq.pack_int4(torch.zeros(1, 7, dtype=torch.int32))


# ---------------------------------------------------------------- AWQ RTN and dequantization
@pytest.mark.parametrize("group", [32, 64, 128, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk_elements", [1, 256 * 12, 256 * 16 + 7, 1 << 22],
                         ids=["8-rows", "12-rows-rounded-to-8", "16-rows", "one-chunk"])
def test_rtn_error_is_at_most_half_a_step(group: int, dtype: torch.dtype, chunk_elements: int) -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(24, 256, generator=g)
    w[0, :64] = w[0, :64].abs() + 3.0  # a group that is all positive
    w[1, :128] = -w[1, :128].abs() - 1.0  # all negative
    w[2, :] = 0.0  # all zero
    w[3, 5] = 40.0  # an outlier
    w = w.to(dtype)
    qweight, qzeros, scales = awq.quantize_rtn(w, group, chunk_elements)  # 24 output rows, chunked as named
    eff = 256 if group == -1 else group
    assert qweight.shape == (256, 3) and qzeros.shape == (256 // eff, 3) and scales.shape == (256 // eff, 24)
    assert qweight.dtype == qzeros.dtype == torch.int32 and scales.dtype == torch.float16
    q, z, s = rtn_reference(w, eff)
    assert np.array_equal(scales.t().numpy().view(np.uint16), s.view(np.uint16))
    assert np.array_equal(awq.unpack_int4(qzeros).t().numpy(), z)
    assert np.array_equal(awq.unpack_int4(qweight).t().reshape(24, -1, eff).numpy(), q)
    deq = awq.dequantize(qweight, qzeros, scales, group, dtype=torch.float32).t()  # [out, in]
    step = scales.to(torch.float32).t().repeat_interleave(eff, dim=1)
    err = (deq - w.to(torch.float32)).abs()
    assert bool((err <= step / 2 * (1 + 1e-5) + 1e-12).all()), float((err / step).max())


def test_dequantize_equals_autoawq_arithmetic_bit_for_bit() -> None:
    _, state = awq_state(32, 128, 32, seed=3)
    q, z = naive_unpack(state["qweight"]), naive_unpack(state["qzeros"])  # from the format, not the code under test
    expected = naive_dequant_fp16(q, z, state["scales"], 32)
    got = awq.dequantize(state["qweight"], state["qzeros"], state["scales"], 32)
    assert got.dtype == torch.float16 and got.shape == (128, 32)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


@pytest.mark.autoawq
@pytest.mark.parametrize("group", [128, 64])
def test_rtn_matches_autoawq_pseudo_quantize(group: int) -> None:
    """AutoAWQ's ``pseudo_quantize_tensor`` (zero_point=True, fp32 weights) keeps the fp32 scale (max - min) / 15,
    which infer rounds up to the fp16 it stores (< 2^-10 relative; Gaussian groups span 0, so widening the range to
    include 0 changes nothing). So the two are not bit-exact: the scales are AutoAWQ's rounded up, and the integer
    codes agree except where that round-up moved w / s across a rounding boundary (about 0.1% of the weights), there
    by one step; where the codes agree, the weights differ by the scales' ratio."""
    quantizer = pytest.importorskip("awq.quantize.quantizer", reason="AutoAWQ is not installed")
    autoawq = object.__new__(quantizer.AwqQuantizer)  # __init__ calibrates a model; this method reads only these
    autoawq.w_bit, autoawq.group_size, autoawq.zero_point = 4, group, True
    w = torch.randn(256, 512)
    ref, ref_scales, _ = autoawq.pseudo_quantize_tensor(w.clone())
    _, _, scales = awq.quantize_rtn(w, group)
    assert np.array_equal(scales.t().numpy().view(np.uint16), round_up_to_fp16(ref_scales.numpy()).view(np.uint16))
    ours = awq.fake_quantize_rtn(w, group)
    ref_step, our_step = (s.float().repeat_interleave(group, dim=1) for s in (ref_scales, scales.t()))
    code_diff = torch.round(ref / ref_step) - torch.round(ours / our_step)
    off = code_diff != 0
    x = w / ref_step
    to_boundary = (x - 0.5 - torch.round(x - 0.5)).abs()  # distance from w / s to the nearest k + 1/2
    assert bool((code_diff.abs() <= 1).all()) and bool((to_boundary[off] < x[off].abs() * 2**-10).all())
    assert int(off.sum()) < 2**-10 * float(x.abs().sum())  # each weight is off with probability < |w / s| 2^-10
    assert bool(((ours - ref).abs()[~off] <= ref.abs()[~off] * 2**-10 * (1 + 1e-4)).all())


def test_rtn_rejects_bad_shapes() -> None:
    with pytest.raises(CheckpointError, match="group_size 128 does not divide in_features 96"):
        awq.quantize_rtn(torch.randn(8, 96), 128)
    with pytest.raises(CheckpointError, match="out_features divisible by 8"):
        awq.quantize_rtn(torch.randn(12, 64), 32)
    for bad in (0, -2):  # -1 is the only group size below 1 (one group over the whole input)
        with pytest.raises(CheckpointError, match=f"group_size {bad} does not divide in_features 64"):
            awq.quantize_rtn(torch.randn(8, 64), bad)


def test_rtn_refuses_a_group_whose_scale_overflows_fp16() -> None:
    """The scale (max - min) / 15 is stored in fp16, whose largest value is 65504: a group spanning more than
    15 * 65504 has no scale, and quantizing it would store inf."""
    w = torch.randn(8, 64)
    w[3, 7] = 2e6
    with pytest.raises(CheckpointError, match="overflows the fp16 AWQ scales"):
        awq.quantize_rtn(w, 32)
    w[3, 7] = 0.99 * 15 * 65504  # just inside the range
    _, _, scales = awq.quantize_rtn(w, 32)
    assert bool(scales.isfinite().all())


def test_dequantize_refuses_tensors_that_do_not_fit_the_group_size() -> None:
    """qzeros and scales hold one row per group of group_size inputs; any other shape is a malformed checkpoint,
    never broadcast over the groups."""
    _, state = awq_state(16, 128, 64)
    qweight, qzeros, scales = state["qweight"], state["qzeros"], state["scales"]
    with pytest.raises(CheckpointError, match=r"inconsistent AWQ tensors for group_size 64.*qzeros \(1, 2\)"):
        awq.dequantize(qweight, qzeros[:1], scales, 64)  # one row of zero points for two groups
    with pytest.raises(CheckpointError, match=r"inconsistent AWQ tensors for group_size 64.*scales \(1, 16\)"):
        awq.dequantize(qweight, qzeros, scales[:1], 64)
    with pytest.raises(CheckpointError, match="inconsistent AWQ tensors for group_size 48"):
        awq.dequantize(qweight, qzeros, scales, 48)  # 128 // 48 = 2 rows, but 48 does not divide 128


# ---------------------------------------------------------------- AWQ config validation
GOOD_AWQ = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": None}


def test_parse_awq_config_accepts_both_spellings() -> None:
    assert awq.parse_config(GOOD_AWQ) == awq.AwqConfig(128, ())
    autoawq_style = {"w_bit": 4, "q_group_size": 64, "zero_point": True, "version": "GEMM",
                     "modules_to_not_convert": ["visual"]}
    assert awq.parse_config(autoawq_style) == awq.AwqConfig(64, ("visual",))


@pytest.mark.parametrize("change, message", [
    ({"version": "gemv"}, "'gemv' layout.*not support.*re-export it in the GEMM"),
    ({"version": "marlin"}, "unsupported AWQ version 'marlin'"),
    ({"bits": 8}, "bits must be 4, got 8"),
    ({"group_size": 100}, "group_size must be one of -1, 32, 64, 128, got 100"),
    ({"zero_point": 0}, "zero_point must be true or false, got 0"),  # false: AutoRound's, tests/test_quant_auto_round
    ({"zero_point": "false"}, "zero_point must be true or false, got 'false'"),
    ({"quant_method": "gptq"}, "quantized with 'gptq'"),
    ({"modules_to_not_convert": "lm_head"}, "must be a list"),
    ({"modules_to_not_convert": 5}, "must be a list of module names, got 5"),  # was a TypeError
])
def test_parse_awq_config_errors(change: dict[str, object], message: str) -> None:
    # another method's checkpoint under --quant awq: the command is what to change (drop --quant)
    with pytest.raises(ConfigError if "quantized with" in message else CheckpointError, match=message):
        awq.parse_config({**GOOD_AWQ, **change})


# ---------------------------------------------------------------- the AWQ Triton kernel
@pytest.mark.parametrize("dtype, m, k, n, group, split_k", [
    (torch.float32, 3, 128, 64, 64, 1),
    (torch.float16, 5, 256, 96, 32, 2),  # a partial N block, split-K through fp32 atomics
    (torch.float32, 1, 96, 48, -1, 1),  # one group over all of K, a partial K block
    (torch.float16, 17, 128, 64, 128, 1),  # two M blocks
])
def test_awq_gemm_matches_reference(dtype: torch.dtype, m: int, k: int, n: int, group: int, split_k: int) -> None:
    _, state = awq_state(n, k, group, seed=m)
    state = {name: t.to(DEVICE) for name, t in state.items()}
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    out = awq_gemm(x, state["qweight"], state["qzeros"], state["scales"], group, split_k=split_k)
    ref = awq_gemm_reference(x, state["qweight"], state["qzeros"], state["scales"], group)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


# per-group path: group % block_k == 0, or one group over K; general path: per-row scales and zeros
@pytest.mark.parametrize("dtype, m, k, n, group, blocks", [
    (torch.float32, 1, 320, 128, 64, (64, 64, 3)),  # per-group; 3 K slices of 128, 128 and 64 rows
    (torch.float16, 5, 256, 200, 128, (128, 128, 2)),  # per-group; N = 200 ends in a partial block
    (torch.float16, 16, 320, 96, 32, (64, 64, 3)),  # general: group 32 < block_k 64
    (torch.float32, 33, 256, 72, 64, (64, 128, 1)),  # general: two groups per K block; three M blocks
    (torch.float16, 1, 192, 64, -1, (64, 128, 1)),  # per-group: one group, K = 192 ends in a partial block
    (torch.float32, 16, 192, 64, -1, (32, 64, 2)),  # per-group: one group over two K slices
    (torch.float16, 1, 256, 128, 32, (None, None, None)),  # defaults: block_k lowered to 32, per-group path
    # bf16 on a GPU only (the interpreter does bf16 arithmetic on raw bits): the mantissa-OR unpacking of bf16
    pytest.param(torch.bfloat16, 1, 2048, 256, 128, (None, None, None), marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, 16, 320, 96, 32, (64, 64, 3), marks=pytest.mark.gpu),
    # a quantized head (awq.lm_head): N is the 1B's vocabulary, 1,002 column blocks of 128
    pytest.param(torch.bfloat16, 1, 512, 128256, 128, (None, None, None), marks=pytest.mark.gpu),
])
def test_awq_gemm_paths_match_reference(dtype: torch.dtype, m: int, k: int, n: int, group: int,
                                        blocks: tuple[int, int, int]) -> None:
    _, state = awq_state(n, k, group, seed=k + n)
    state = {name: t.to(DEVICE) for name, t in state.items()}
    # scales as a checkpoint stores them (fp16), so the reference's dequantization is exact
    state["scales"] = state["scales"].half().to(torch.float32 if dtype == torch.float32 else dtype)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    block_n, block_k, split_k = blocks
    out = awq_gemm(x, state["qweight"], state["qzeros"], state["scales"], group, block_n=block_n, block_k=block_k,
                   split_k=split_k)
    ref = awq_gemm_reference(x, state["qweight"], state["qzeros"], state["scales"], group)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())


@pytest.mark.parametrize("dtype, m, group, split_k", [(torch.float32, 3, 32, 1), (torch.float16, 17, 64, 2),
                                                      (torch.float32, 5, -1, 1)])
def test_awq_gemm_gathers_the_input_in_the_activation_order(dtype: torch.dtype, m: int, group: int,
                                                            split_k: int) -> None:
    """GPTQ's activation order: weight row k multiplies input column order[k]; the kernel gathers as it loads x."""
    _, state = awq_state(64, 128, group, seed=m)
    state = {name: t.to(DEVICE) for name, t in state.items()}
    order = torch.randperm(128, generator=torch.Generator().manual_seed(m)).to(DEVICE)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(9)).to(DEVICE, dtype)
    out = awq_gemm(x, state["qweight"], state["qzeros"], state["scales"], group, input_order=order, split_k=split_k)
    ref = awq_gemm_reference(x[:, order], state["qweight"], state["qzeros"], state["scales"], group)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max().item())
    assert not torch.allclose(out.float(), awq_gemm_reference(x, state["qweight"], state["qzeros"], state["scales"],
                                                              group).float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype, k, n, group", [
    (torch.float32, 128, 96, 32), (torch.float16, 72, 64, -1), (torch.float16, 256, 200, 128),
    # bf16 on a GPU only: the interpreter rounds float32 to bf16 by truncation, CUDA to nearest even as torch does
    pytest.param(torch.bfloat16, 256, 256, 64, marks=pytest.mark.gpu)])
def test_awq_dequantize_kernel_equals_the_torch_dequantization_bit_for_bit(dtype: torch.dtype, k: int, n: int,
                                                                           group: int) -> None:
    """The large-batch path of a W4A16 linear on CUDA (dequantize, then matmul) dequantizes in one kernel."""
    from infer.kernels.awq_gemm import awq_dequantize

    _, state = awq_state(n, k, group, seed=k + n)
    state = {name: t.to(DEVICE) for name, t in state.items()}
    ours = awq_dequantize(state["qweight"], state["qzeros"], state["scales"], group, dtype)
    reference = awq.dequantize(state["qweight"], state["qzeros"], state["scales"], group, dtype=dtype)
    assert ours.dtype == dtype and torch.equal(ours, reference)


@pytest.mark.parametrize("layout", ["column-slice", "transposed"])
def test_awq_gemm_reads_x_with_its_own_strides(layout: str) -> None:
    """x need not be contiguous: a column slice of a wider activation (row stride > K) or a transposed one (column
    stride > 1) gives the product of its values."""
    _, state = awq_state(64, 128, 64, seed=3)
    state = {name: t.to(DEVICE) for name, t in state.items()}
    g = torch.Generator().manual_seed(4)
    if layout == "column-slice":
        x = torch.randn(5, 192, generator=g).to(DEVICE)[:, :128]
    else:
        x = torch.randn(128, 5, generator=g).to(DEVICE).t()
    out = awq_gemm(x, state["qweight"], state["qzeros"], state["scales"], 64, split_k=1)
    ref = awq_gemm_reference(x.contiguous(), state["qweight"], state["qzeros"], state["scales"], 64)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())


def test_awq_auto_split_k_fills_the_gpu_within_its_caps() -> None:
    from infer.kernels.awq_gemm import auto_split_k

    sms = 132
    assert auto_split_k(1, 64, 2048, 128, sms) == 9  # 1B gate_up at M = 1: 64 tiles, 9 slices (8 after rounding)
    assert auto_split_k(1, 16, 8192, 128, sms) == 32  # down: the cap of 32
    assert auto_split_k(16, 64, 2048, 128, sms) == 4  # partial sums: 16 * 4 bytes * 4 slices <= 2048 / 8
    assert auto_split_k(1, 16, 256, 128, sms) == 2  # no more slices than K blocks
    assert auto_split_k(64, 128, 2048, 64, sms) == 1 and auto_split_k(1, 600, 4096, 128, sms) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU behaviour of the GPU-only benchmark")
def test_quant_bench_refuses_to_run_without_cuda() -> None:
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[1] / "benchmarks" / "quant_bench.py"
    done = subprocess.run([sys.executable, str(script), "--awq-sweep", "--skip", "decode", "fp8", "gemm", "kv"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "quant_bench needs a CUDA GPU" in done.stderr, done.stderr[-2000:]


# ---------------------------------------------------------------- the AWQ QuantMethod on Linear
def make_linear(method: object, in_features: int, out_features: int, bias: bool = False,
                prefix: str = "model.layers.0.mlp.up_proj", dtype: torch.dtype = torch.float32) -> Linear:
    return Linear(in_features, out_features, bias, prefix, method, dtype)  # type: ignore[arg-type]


def test_awq_linear_loads_packed_checkpoint_and_applies() -> None:
    method = AwqLinearMethod(group_size=64)
    layer = make_linear(method, 128, 32, bias=True)
    assert layer.qweight.shape == (128, 4) and layer.qweight.dtype == torch.int32
    assert layer.qzeros.shape == (2, 4) and layer.scales.shape == (2, 32) and layer.scales.dtype == torch.float16
    assert layer.bias.dtype == torch.float32 and not hasattr(layer, "weight")
    _, state = awq_state(32, 128, 64, seed=4)
    bias = torch.randn(32, dtype=torch.float16)
    for name, tensor in {**state, "bias": bias}.items():
        layer.load(name, tensor)
    method.process_after_loading(layer)
    x = torch.randn(2, 3, 128)
    w = awq.dequantize(state["qweight"], state["qzeros"], state["scales"], 64, dtype=torch.float32)
    torch.testing.assert_close(layer(x), x @ w + bias.float(), rtol=1e-5, atol=1e-5)


def test_awq_linear_quantizes_on_load() -> None:
    """The output error of int4 RTN on Gaussian weights: the step is E[range of 32 normals] / 15 = 4.14 sigma / 15
    and the rounding noise step / sqrt(12), relative 0.080 (measured over 200 seeds: 1.01x that, std 0.03x)."""
    method = AwqLinearMethod(group_size=32, quantize_on_load=True)
    layer = make_linear(method, 128, 32, dtype=torch.bfloat16)
    weight = torch.randn(32, 128)
    layer.load("weight", weight.to(torch.bfloat16))
    method.process_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters()) and layer.qweight.shape == (128, 4)
    qweight, qzeros, scales = awq.quantize_rtn(weight.to(torch.bfloat16), 32)
    assert torch.equal(layer.qweight, qweight) and torch.equal(layer.scales, scales)
    x = torch.randn(64, 128)
    out = layer(x.to(torch.bfloat16)).float()
    expected = x.to(torch.bfloat16).float() @ awq.dequantize(qweight, qzeros, scales, 32, torch.bfloat16).float()
    torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
    exact = x @ weight.t()
    predicted = 4.14 / 15 / math.sqrt(12)
    assert 0.8 * predicted < float((out - exact).norm() / exact.norm()) < 1.2 * predicted


@pytest.mark.parametrize("method", [AwqLinearMethod(64, quantize_on_load=True), Fp8LinearMethod(None)],
                         ids=["awq", "fp8"])
def test_on_load_linears_move_before_loading_and_refuse_a_second_weight(method: object) -> None:
    """A linear that quantizes as it loads holds a meta placeholder until then, which a move leaves behind (its
    load anchor moves); the weight is quantized on arrival, and a second one is refused."""
    layer = make_linear(method, 128, 64).to("cpu", torch.float32)
    assert layer.weight.device.type == "meta"
    weight = torch.randn(64, 128)
    layer.load("weight", weight)
    method.process_after_loading(layer)
    assert "weight" not in dict(layer.named_parameters()) and not hasattr(layer, "load_anchor")
    out = layer(torch.eye(128))  # W.T, dequantized
    assert float((out.t() - weight).norm() / weight.norm()) < 0.1
    with pytest.raises(CheckpointError, match="up_proj.weight arrived twice"):
        layer.load("weight", weight)


@pytest.mark.parametrize("method", [AwqLinearMethod(64, quantize_on_load=True), Fp8LinearMethod(None)],
                         ids=["awq", "fp8"])
def test_on_load_linears_refuse_a_weight_of_another_shape_or_type(method: object) -> None:
    """A float weight quantized on load is checked first: another shape would quantize into tensors of the wrong
    size, integer or fp8 data is a quantized layout the config does not describe."""
    layer = make_linear(method, 128, 64)
    with pytest.raises(CheckpointError, match=r"shape mismatch for model.layers.0.mlp.up_proj.weight: "
                                              r"checkpoint \(64, 64\), model \(64, 128\)"):
        layer.load("weight", torch.randn(64, 64))
    for dtype in (torch.int8, torch.int32, torch.float8_e4m3fn):
        name = str(dtype).removeprefix("torch.")
        with pytest.raises(CheckpointError, match=f"'model.layers.0.mlp.up_proj.weight' is {name}, where infer "
                                                  "expects float weights"):
            layer.load("weight", torch.zeros(64, 128).to(dtype))


def test_awq_linear_errors() -> None:
    method = AwqLinearMethod(group_size=128)
    with pytest.raises(CheckpointError, match="group_size 128 does not divide in_features 96.*'blk.proj'"):
        make_linear(method, 96, 16, prefix="blk.proj")
    layer = make_linear(method, 128, 16)
    with pytest.raises(CheckpointError, match=r"shape mismatch.*qweight.*\(128, 4\).*\(128, 2\)"):
        layer.load("qweight", torch.zeros(128, 4, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=r"shape mismatch.*qweight.*\(16, 16\).*\(128, 2\)"):  # GPTQ's packing
        layer.load("qweight", torch.zeros(16, 16, dtype=torch.int32))
    with pytest.raises(CheckpointError, match="qzeros must be int32"):
        layer.load("qzeros", torch.zeros(1, 2, dtype=torch.int64))
    with pytest.raises(CheckpointError, match="qweight must be int32, got torch.int64"):  # copy_ would truncate it
        layer.load("qweight", torch.zeros(128, 2, dtype=torch.int64))
    with pytest.raises(CheckpointError, match="scales must be floating point, got torch.int32"):
        layer.load("scales", torch.ones(1, 16, dtype=torch.int32))
    # 3 rows of zero points imply no group size over 128 inputs: a plain shape mismatch, not a wrong group_size
    with pytest.raises(CheckpointError, match=r"^shape mismatch for model.layers.0.mlp.up_proj.qzeros: "
                                              r"checkpoint \(3, 2\), model \(1, 2\)$"):
        layer.load("qzeros", torch.zeros(3, 2, dtype=torch.int32))
    for name, dtype in (("qzeros", torch.int32), ("scales", torch.float16)):  # rows of group 32, config says 128
        with pytest.raises(CheckpointError, match=f"{name} has 4 group rows, i.e. group_size 32 over 128 inputs, "
                                                  "but quantization_config.group_size is 128; correct"):
            layer.load(name, torch.zeros(4, 2 if name == "qzeros" else 16, dtype=dtype))
    with pytest.raises(CheckpointError, match="out_features divisible by 8, got 12.*modules_to_not_convert"):
        make_linear(method, 128, 12)
    with pytest.raises(CheckpointError, match="out_features divisible by 8, got 12.*load it unquantized with "
                                              "`infer --quant fp8"):
        make_linear(AwqLinearMethod(quantize_on_load=True), 128, 12)
    with pytest.raises(CheckpointError, match="does not divide in_features 96.*does not fit its own config.json"):
        make_linear(AwqLinearMethod(group_size=64), 96, 16)
    with pytest.raises(CheckpointError, match="unquantized 'weight'.*modules_to_not_convert"):
        layer.load("weight", torch.zeros(16, 128))
    layer.load("qweight", torch.zeros(128, 2, dtype=torch.int32))
    with pytest.raises(CheckpointError, match="missing qzeros, scales for layer"):
        method.process_after_loading(layer)
    on_load = AwqLinearMethod(quantize_on_load=True)
    with pytest.raises(CheckpointError, match="declares no AWQ quantization_config"):
        make_linear(on_load, 128, 16).load("qweight", torch.zeros(128, 2, dtype=torch.int32))
    biased = make_linear(method, 128, 16, bias=True)
    for name, tensor in awq_state(16, 128, 128)[1].items():
        biased.load(name, tensor)
    with pytest.raises(CheckpointError, match="missing bias for layer 'model.layers.0.mlp.up_proj'"):
        method.process_after_loading(biased)  # else the bias would be torch.empty's leftovers


def test_awq_linear_uses_the_checkpoint_scales_as_stored() -> None:
    """Scales a checkpoint stores in fp32 are used as they are (the dequantized weight is (q - z) * s from the
    format's nibble layout): rounding them to fp16 on load would move every weight."""
    method = AwqLinearMethod(group_size=64)
    layer = make_linear(method, 128, 32)
    _, state = awq_state(32, 128, 64, seed=5)
    scales = torch.rand(2, 32) * 0.1 + 0.01
    assert not torch.equal(scales.half().float(), scales)
    for name, tensor in {**state, "scales": scales}.items():
        layer.load(name, tensor)
    method.process_after_loading(layer)
    assert layer.scales.dtype == torch.float32
    q, z = naive_unpack(state["qweight"]), naive_unpack(state["qzeros"]).repeat_interleave(64, dim=0)
    w = (q - z).double() * scales.double().repeat_interleave(64, dim=0)  # [in, out]
    x = torch.randn(3, 128)
    expected = x.double() @ w
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_awq_parts_merge_only_with_one_group_size() -> None:
    """Parts merge by concatenating their packed columns, which keeps each part's rows of zero points and scales
    only when their group sizes agree."""
    parts = []
    for i, group in enumerate((64, 64, 32)):
        method = AwqLinearMethod(group_size=group)
        part = make_linear(method, 128, 16, prefix=f"model.layers.0.self_attn.{'qkv'[i]}_proj")
        for name, tensor in awq_state(16, 128, group, seed=i)[1].items():
            part.load(name, tensor)
        method.process_after_loading(part)
        parts.append(part)
    x = torch.randn(3, 128)
    merged = Linear.merged(parts[:2], "qk")
    assert merged is not None and torch.equal(merged(x), torch.cat([parts[0](x), parts[1](x)], dim=-1))
    assert Linear.merged(parts, "qkv") is None


def test_awq_skips_lm_head_and_modules_to_not_convert() -> None:
    method = AwqLinearMethod(64, modules_to_not_convert=["mlp.gate"])
    assert isinstance(make_linear(method, 64, 16, prefix="lm_head").method, UnquantizedMethod)
    assert isinstance(make_linear(method, 64, 16, prefix="model.layers.1.mlp.gate_proj").method, UnquantizedMethod)
    assert make_linear(method, 64, 16, prefix="model.layers.1.mlp.up_proj").method is method


def test_awq_plugin_factory(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="infer"):
        on_load = awq_plugin.build_awq(EngineConfig(), None)
    assert isinstance(on_load, AwqLinearMethod) and on_load.quantize_on_load and on_load.group_size is None
    assert [auto_group_size(n) for n in (2048, 192, 96, 100)] == [128, 64, 32, -1]  # largest dividing group
    assert [r.message for r in caplog.records if "calibrated AWQ" in r.message and "infer quantize" in r.message]
    loaded = awq_plugin.build_awq(EngineConfig(plugin_options={"awq": {"fused_max_rows": 8}}),
                                  {**GOOD_AWQ, "group_size": 64, "modules_to_not_convert": ["visual"]})
    assert isinstance(loaded, AwqLinearMethod) and not loaded.quantize_on_load
    assert (loaded.group_size, loaded.modules_to_not_convert, loaded.fused_max_rows) == (64, ("visual",), 8)
    rows = awq_plugin.build_awq(EngineConfig(plugin_options={"awq": {"fused_max_rows": 0}}), None)  # on load too
    assert isinstance(rows, AwqLinearMethod) and rows.quantize_on_load and rows.fused_max_rows == 0
    with pytest.raises(CheckpointError, match="gemv"):
        awq_plugin.build_awq(EngineConfig(), {**GOOD_AWQ, "version": "gemv"})
    small = awq_plugin.build_awq(EngineConfig(plugin_options={"awq": {"group_size": 32}}), None)
    assert isinstance(small, AwqLinearMethod) and small.group_size == 32
    for bad in (48, 64.0, True):  # 64.0 and True pass ``in (-1, 32, 64, 128)`` and failed later, in a reshape
        with pytest.raises(ConfigError, match=f"--plugin-option awq.group_size must be one of -1, 32, 64, 128, "
                                              f"got {bad}: "):
            awq_plugin.build_awq(EngineConfig(plugin_options={"awq": {"group_size": bad}}), None)
        with pytest.raises(CheckpointError, match=f"AWQ group_size must be one of -1, 32, 64, 128, got {bad}$"):
            awq_plugin.build_awq(EngineConfig(), {**GOOD_AWQ, "group_size": bad})
    with caplog.at_level(logging.WARNING, logger="infer"):
        awq_plugin.build_awq(EngineConfig(plugin_options={"awq": {"group_size": 32}}), GOOD_AWQ)
    assert any("awq.group_size=32 is ignored" in r.message for r in caplog.records)


def test_plugins_register_their_names() -> None:
    registry: Registry[object] = Registry("quant method")
    awq_plugin.register_quant_methods(register=registry.callback("awq"))
    fp8_plugin.register_quant_methods(register=registry.callback("fp8"))
    assert registry.names() == ["awq", "compressed-tensors", "fp8"]
    assert registry.get("compressed-tensors") is fp8_plugin.build_compressed_tensors


# ---------------------------------------------------------------- FP8 formats and kernels
def fp8_error_bound(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 keeps 3 mantissa bits: normals round within 2^-4 relative, subnormals within 2^-10 * scale."""
    return t.abs() * 2.0**-4 + scale * 2.0**-10 + 1e-12


@pytest.mark.parametrize("chunk_elements", [1, 64 * 5, 1 << 22], ids=["1-row", "5-rows", "one-chunk"])
def test_fp8_weight_per_channel_error_bound(chunk_elements: int) -> None:
    g = torch.Generator().manual_seed(5)
    w = torch.randn(16, 64, generator=g) * torch.logspace(-3, 3, 16).unsqueeze(1)
    w[3] = 0.0
    w_fp8, scale = fp8.quantize_weight_per_channel(w, chunk_elements)
    assert w_fp8.dtype == torch.float8_e4m3fn and scale.shape == (16,) and scale.dtype == torch.float32
    torch.testing.assert_close(scale, w.abs().amax(1).clamp(min=fp8.MIN_AMAX) / 448)
    expected = (w / scale.unsqueeze(1)).clamp(-448, 448).to(torch.float8_e4m3fn)  # the definition, in one pass
    assert torch.equal(w_fp8.view(torch.uint8), expected.view(torch.uint8))
    assert torch.equal(w_fp8.float().abs().amax(1)[w.abs().amax(1) > 0], torch.full((15,), 448.0))
    err = (fp8.dequantize(w_fp8, scale) - w).abs()
    assert bool((err <= fp8_error_bound(w, scale.unsqueeze(1))).all())


def test_fp8_per_token_kernel_matches_torch_exactly() -> None:
    g = torch.Generator().manual_seed(6)
    x = torch.randn(5, 100, generator=g) * torch.tensor([1.0, 10.0, 0.01, 0.0, 1000.0]).unsqueeze(1)
    for dtype in (torch.float32, torch.float16):
        xd = x.to(DEVICE, dtype)
        scaled, scale = per_token_quant(xd, out_dtype=torch.float32, block_k=32)  # two passes over K blocks
        ref_q, ref_scale = fp8.quantize_per_token(xd)
        assert torch.equal(scale, ref_scale)
        # the cast happens in torch: the interpreter rounds fp32 -> fp8 wrongly
        assert torch.equal(scaled.to(fp8.FP8_DTYPE).view(torch.uint8), ref_q.view(torch.uint8))
        err = (fp8.dequantize(ref_q, ref_scale) - xd.float()).abs()
        assert bool((err <= fp8_error_bound(xd.float(), ref_scale.unsqueeze(1))).all())


def test_fp8_per_token_kernel_keeps_nan_and_inf_rows_as_torch_does() -> None:
    """max (and tl.max) return the operand that is not NaN: a NaN activation came out as finite fp8 values with a
    finite scale, and +inf as -448, where torch gives NaN; the engine's non-finite check could not see it then."""
    x = torch.tensor([[1.0, -2.0, float("nan"), 3.0], [1.0, float("inf"), -2.0, 0.5], [1.0, -2.0, 0.25, 3.0]])
    scaled, scale = per_token_quant(x.to(DEVICE), out_dtype=torch.float32, block_k=4)
    ref_q, ref_scale = fp8.quantize_per_token(x.to(DEVICE))
    torch.testing.assert_close(scale, ref_scale, equal_nan=True, rtol=0, atol=0)
    torch.testing.assert_close(scaled.to(fp8.FP8_DTYPE).float(), ref_q.float(), equal_nan=True, rtol=0, atol=0)
    assert not bool(scale[:2].isfinite().any()) and bool(scale[2:].isfinite().all())


def test_fp8_per_token_kernel_divides_by_the_scale_with_one_rounding() -> None:
    """x / s correctly rounded, as torch divides on the CPU, not x times the rounded 1 / s: the two differ in the
    last fp32 bit now and then, and next to the midpoint of two e4m3 values that bit picks the fp8 value (here
    0.293136 / 0.173710 lies just above 1.6875: 1.75, where the reciprocal's product gives 1.625)."""
    x = torch.tensor([[77.82218170166016, 0.29313600063323975, -0.29313600063323975, 1.0]])
    scaled, scale = per_token_quant(x.to(DEVICE), out_dtype=torch.float32)
    ref_q, ref_scale = fp8.quantize_per_token(x.to(DEVICE))
    assert torch.equal(scale, ref_scale)
    assert ref_q.float()[0, 1:3].tolist() == [1.75, -1.75]
    assert torch.equal(scaled.to(fp8.FP8_DTYPE).view(torch.uint8), ref_q.view(torch.uint8))


@pytest.mark.parametrize("m, n, k", [(3, 48, 100), (20, 64, 64)])
def test_w8a8_gemm_matches_reference(m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m)
    xq, xs = fp8.quantize_per_token(torch.randn(m, k, generator=g))
    wq, ws = fp8.quantize_weight_per_channel(torch.randn(n, k, generator=g))
    xq, xs, wq, ws = xq.to(DEVICE), xs.to(DEVICE), wq.to(DEVICE), ws.to(DEVICE)
    for out_dtype in (torch.float32, torch.float16):
        out = w8a8_gemm(xq, xs, wq, ws, out_dtype)
        ref = w8a8_gemm_reference(xq, xs, wq, ws, out_dtype)
        torch.testing.assert_close(out.float(), ref.float(), rtol=1e-3, atol=1e-3 * ref.abs().max().item())
    per_tensor = w8a8_gemm(xq, xs[:1], wq, ws[:1], torch.float32)  # [1] scales broadcast
    torch.testing.assert_close(per_tensor, w8a8_gemm_reference(xq, xs[:1], wq, ws[:1], torch.float32),
                               rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- FP8 compressed-tensors config
def ct_config(weights: dict[str, object], acts: dict[str, object] | None, ignore: list[str] | None = None,
              **extra: object) -> dict[str, object]:
    """A compressed-tensors quantization_config as the library writes it (0.20 layout)."""
    group = {"format": "float-quantized", "targets": ["Linear"], "output_activations": None,
             "weights": {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "group_size": None,
                         **weights},
             "input_activations": None if acts is None else {"num_bits": 8, "type": "float", "symmetric": True,
                                                             "group_size": None, **acts}}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": group}, "ignore": ["lm_head"] if ignore is None else ignore,
            "kv_cache_scheme": None, "sparsity_config": {}, **extra}


# compressed-tensors' TransformScheme as ModelCompressor writes it: a Hadamard rotation of the inputs at run time,
# its inverse fused into the weights; loaded without the rotation, the logits were garbage (relative error 1.4)
ROTATED = {"config_groups": {"v": {"type": "hadamard", "apply": [
    {"targets": ["Linear"], "location": "input", "inverse": False, "ignore": []},
    {"targets": ["Linear"], "location": "weight_input", "inverse": True, "ignore": []}]}}}
FP8_DYNAMIC_CFG = ct_config({"strategy": "channel"}, {"strategy": "token", "dynamic": True})
FP8_STATIC_CFG = ct_config({"strategy": "tensor"}, {"strategy": "tensor", "dynamic": False,
                                                    "observer": "static_minmax"})


def test_parse_compressed_tensors_presets() -> None:
    dyn = fp8.parse_compressed_tensors(FP8_DYNAMIC_CFG)
    assert dyn.scheme_for("model.layers.0.self_attn.q_proj") == fp8.DYNAMIC
    assert dyn.scheme_for("lm_head") is None
    static = fp8.parse_compressed_tensors(FP8_STATIC_CFG)
    assert static.scheme_for("model.layers.0.mlp.down_proj") == fp8.STATIC
    regex = fp8.parse_compressed_tensors(ct_config({"strategy": "channel"}, None, ignore=["re:.*mlp.gate_proj$"]))
    assert regex.scheme_for("model.layers.3.mlp.gate_proj") is None
    assert regex.scheme_for("model.layers.3.mlp.up_proj") == fp8.Fp8Scheme("channel", None)
    rotation = ROTATED["config_groups"]["v"]
    fused = {"config_groups": {"v": {**rotation, "apply": rotation["apply"][1:]}}}
    assert fp8.parse_compressed_tensors(ct_config({"strategy": "channel"}, None, transform_config=fused)) == \
        fp8.parse_compressed_tensors(ct_config({"strategy": "channel"}, None))  # in the weights: nothing to apply
    naive = {**FP8_DYNAMIC_CFG, "format": "naive-quantized",  # the library's other format for fp8 values
             "config_groups": {"group_0": {**FP8_DYNAMIC_CFG["config_groups"]["group_0"],  # type: ignore[dict-item]
                                           "format": None}}}
    assert fp8.parse_compressed_tensors(naive) == dyn


def with_group(config: dict[str, object], **changes: object) -> dict[str, object]:
    """``config`` with its one config group changed."""
    group = config["config_groups"]["group_0"]  # type: ignore[index]
    return {**config, "config_groups": {"g": {**group, **changes}}}


@pytest.mark.parametrize("config, message", [
    (ct_config({"strategy": "group", "group_size": 128}, None), "strategy 'group'"),
    (ct_config({"strategy": "channel", "type": "int"}, None), "'int' with 8 bits, not 8-bit float"),
    (ct_config({"strategy": "channel"}, {"strategy": "token", "dynamic": False}), "dynamic 'token'"),
    (ct_config({"strategy": "channel"}, None, sparsity_config={"format": "sparse-24"}), "sparse"),
    (ct_config({"strategy": "channel"}, None, quantization_status="frozen"), "save the model compressed"),
    (ct_config({"strategy": "channel"}, None, transform_config=ROTATED), r"rotates input at run time \(QuIP"),
    (ct_config({"strategy": "channel"}, None, transform_config={"config_groups": [1]}), "unreadable transform"),
    (ct_config({"strategy": "channel"}, None, transform_config={"config_groups": {"v": {"type": "hadamard", "apply": [
        {"targets": ["Linear"], "location": "output", "inverse": False}]}}}), r"rotates output at run time"),
    (ct_config({"strategy": "channel", "num_bits": 4}, None), "'float' with 4 bits, not 8-bit float"),
    (ct_config({"strategy": "channel", "symmetric": False}, None), "group 'group_0' weights are asymmetric"),
    (ct_config({"strategy": "channel"}, {"strategy": "token", "dynamic": True, "symmetric": False}),
     "group 'group_0' input_activations are asymmetric"),
    (ct_config({"strategy": "channel", "dynamic": True}, None), r"weights use strategy 'channel' \(dynamic=True\)"),
    (with_group(FP8_DYNAMIC_CFG, output_activations={"num_bits": 8, "type": "float", "strategy": "token"}),
     "group 'g' quantizes output activations"),
    (with_group(FP8_DYNAMIC_CFG, targets=[]), r"group 'g' needs a non-empty list of targets, got \[\]"),
    (with_group(FP8_DYNAMIC_CFG, targets=[5]), r"group 'g' needs a non-empty list of targets, got \[5\]"),
    (ct_config({"strategy": "channel"}, None, ignore=["lm_head", 5]), "ignore must be a list of module names"),
    ({**ct_config({"strategy": "channel"}, None), "config_groups": {}}, "config_groups is missing"),
    ({"quant_method": "awq", "bits": 4}, "quantized with 'awq'"),
    # were a TypeError and re.error, reported as bugs in infer
    (ct_config({"strategy": "channel"}, None, ignore=5), "ignore must be a list of module names or 're:' patterns"),
    (ct_config({"strategy": "channel"}, None, ignore=["re:[bad"]), "an ignore pattern: '\\[bad' is not a valid"),
    ({**FP8_DYNAMIC_CFG, "config_groups": {"g": {**FP8_DYNAMIC_CFG["config_groups"]["group_0"],  # type: ignore
                                                  "targets": ["re:(x"]}}},
     "a target pattern of group 'g': '\\(x' is not a valid regular expression"),
])
def test_parse_compressed_tensors_errors(config: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError if "quantized with" in message else CheckpointError, match=message):
        fp8.parse_compressed_tensors(config)


# ---------------------------------------------------------------- the FP8 QuantMethod on Linear
def emulated_reference(x: torch.Tensor, w_fp8: torch.Tensor, w_scale: torch.Tensor,
                       x_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize x (per token, or with a static scale) to fp8 and back; dequantize W; matmul in fp32."""
    if x_scale is None:
        xq, x_scale = fp8.quantize_per_token(x)
    else:
        xq = fp8.to_fp8(x, x_scale)
    return fp8.dequantize(xq, x_scale) @ fp8.dequantize(w_fp8, w_scale).t()


def test_fp8_on_load_quantization(caplog: pytest.LogCaptureFixture) -> None:
    method = Fp8LinearMethod()
    assert isinstance(make_linear(method, 64, 32, prefix="lm_head").method, UnquantizedMethod)
    layer = make_linear(method, 64, 32, bias=True)
    weight, bias = torch.randn(32, 64), torch.randn(32)
    layer.load("weight", weight)
    layer.load("bias", bias)
    method.process_after_loading(layer)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (32,)
    x = torch.randn(2, 3, 64)
    with caplog.at_level(logging.WARNING, logger="infer"):
        out = layer(x)
        layer(x)
    expected = emulated_reference(x.reshape(6, 64), layer.weight, layer.weight_scale).reshape(2, 3, 32) + bias
    torch.testing.assert_close(out, expected)
    assert len([r for r in caplog.records if "fp8" in r.message and "emulate" in r.message]) == 1
    exact = x @ weight.t()
    assert (out - bias - exact).norm() < 0.08 * exact.norm()  # e4m3 keeps 3 mantissa bits: about 3%


@pytest.mark.parametrize("config", [FP8_DYNAMIC_CFG, FP8_STATIC_CFG], ids=["FP8_DYNAMIC", "FP8"])
def test_fp8_loads_compressed_tensors_state(config: dict[str, object]) -> None:
    method = fp8_plugin.build_fp8(EngineConfig(), config)
    assert isinstance(method, Fp8LinearMethod)
    assert isinstance(make_linear(method, 64, 32, prefix="lm_head").method, UnquantizedMethod)
    layer = make_linear(method, 64, 32)
    weight = torch.randn(32, 64)
    static = config is FP8_STATIC_CFG
    if static:
        w_scale = (weight.abs().amax() / 448).reshape(1)
        state = {"weight": fp8.to_fp8(weight, w_scale), "weight_scale": w_scale,
                 "input_scale": torch.tensor([0.02])}
    else:
        w_fp8, w_scale = fp8.quantize_weight_per_channel(weight)
        state = {"weight": w_fp8, "weight_scale": w_scale.unsqueeze(1)}  # the library stores [out, 1]
    for name, tensor in state.items():
        layer.load(name, tensor)
    method.process_after_loading(layer)
    assert torch.equal(layer.weight.view(torch.uint8), state["weight"].view(torch.uint8))
    x = torch.randn(5, 64)
    expected = emulated_reference(x, state["weight"], w_scale, state.get("input_scale"))
    torch.testing.assert_close(layer(x), expected)


@pytest.mark.parametrize("config", [FP8_DYNAMIC_CFG, FP8_STATIC_CFG], ids=["FP8_DYNAMIC", "FP8"])
def test_fp8_scaled_mm_backend_matches_emulation(config: dict[str, object]) -> None:
    """torch._scaled_mm has a CPU implementation too (torch >= 2.13 with row-wise scales; 2.11 per-tensor only),
    which checks the call."""
    probe = torch.zeros(16, 16, dtype=fp8.FP8_DTYPE, device=DEVICE)
    rows = config is FP8_DYNAMIC_CFG  # row-wise scales: [M, 1] and [1, N]
    scale_a, scale_b = (torch.ones(16, 1, device=DEVICE), torch.ones(1, 16, device=DEVICE)) if rows else \
        (torch.ones((), device=DEVICE), torch.ones((), device=DEVICE))
    try:
        torch._scaled_mm(probe, probe.t(), scale_a=scale_a, scale_b=scale_b,
                         out_dtype=torch.bfloat16 if rows else torch.float32)
    except (RuntimeError, NotImplementedError) as exc:
        pytest.skip(f"torch._scaled_mm cannot run these scales on {DEVICE} with torch {torch.__version__}: {exc}")
    weight = torch.randn(48, 64)
    static = config is FP8_STATIC_CFG
    w_scale = (weight.abs().amax() / 448).reshape(1) if static else fp8.quantize_weight_per_channel(weight)[1]
    state = {"weight": fp8.to_fp8(weight, w_scale.reshape(-1, 1)), "weight_scale": w_scale}
    if static:
        state["input_scale"] = torch.tensor([0.01])
    x = torch.randn(5, 64, device=DEVICE)
    outs = []
    for backend in ("scaled_mm", "emulate"):
        method = Fp8LinearMethod(fp8.parse_compressed_tensors(config), backend=backend)
        layer = make_linear(method, 64, 48).to(DEVICE)
        for name, tensor in state.items():
            layer.load(name, tensor)
        method.process_after_loading(layer)
        outs.append(layer(x))
    tol = 1e-5 if static else 1e-2  # row-wise scaling returns bf16
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol * outs[1].abs().max().item())


@pytest.mark.gpu
def test_a_forced_scaled_mm_backend_refuses_shapes_scaled_mm_cannot_run() -> None:
    """On CUDA torch._scaled_mm needs dimensions that are multiples of 16: auto emulates the rest, a forced
    scaled_mm used to fail inside torch at the first forward."""
    method = Fp8LinearMethod(None, backend="scaled_mm")
    layer = make_linear(method, 64, 24, dtype=torch.bfloat16).cuda()  # 24 outputs: not a multiple of 16
    layer.load("weight", torch.randn(24, 64, dtype=torch.bfloat16))
    method.process_after_loading(layer)
    with pytest.raises(ConfigError, match=r"fp8.backend=scaled_mm needs layer shapes that are multiples of 16 on "
                                          r"CUDA \(torch._scaled_mm\), got a \[24, 64\] layer"):
        layer(torch.randn(2, 64, device="cuda", dtype=torch.bfloat16))


def test_fp8_triton_backend_matches_emulation() -> None:
    outs = []
    for backend in ("triton", "emulate"):
        method = Fp8LinearMethod(fp8.parse_compressed_tensors(FP8_DYNAMIC_CFG), backend=backend)
        layer = make_linear(method, 64, 32).to(DEVICE)
        weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(2))
        w_fp8, w_scale = fp8.quantize_weight_per_channel(weight)
        layer.load("weight", w_fp8)
        layer.load("weight_scale", w_scale)
        method.process_after_loading(layer)
        outs.append(layer(torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).to(DEVICE)))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-4, atol=1e-4)


def test_fp8_linear_errors() -> None:
    method = Fp8LinearMethod(fp8.parse_compressed_tensors(FP8_DYNAMIC_CFG))
    layer = make_linear(method, 64, 32)
    with pytest.raises(CheckpointError, match="expected a float8_e4m3fn weight, got torch.float32"):
        layer.load("weight", torch.randn(32, 64))
    with pytest.raises(CheckpointError, match=r"weight_scale has shape \(1,\).*channel scheme needs 32"):
        layer.load("weight_scale", torch.ones(1))
    with pytest.raises(CheckpointError, match="unexpected tensor 'input_scale'"):
        layer.load("input_scale", torch.ones(1))
    with pytest.raises(CheckpointError, match="asymmetric FP8"):
        layer.load("weight_zero_point", torch.ones(32, 1))
    with pytest.raises(CheckpointError, match="weight_zero_point is not zero; asymmetric FP8"):  # one is enough
        layer.load("weight_zero_point", torch.eye(32)[0].reshape(32, 1))
    with pytest.raises(CheckpointError, match=r"weight_scale has shape \(32,\) \(torch.int32\)"):
        layer.load("weight_scale", torch.ones(32, dtype=torch.int32))
    with pytest.raises(CheckpointError, match=r"shape mismatch for model.layers.0.mlp.up_proj.weight: "
                                              r"checkpoint \(1, 64\), model \(32, 64\)"):  # not broadcast
        layer.load("weight", torch.zeros(1, 64, dtype=torch.float8_e4m3fn))
    layer.load("weight", torch.zeros(32, 64, dtype=torch.float8_e4m3fn))
    with pytest.raises(CheckpointError, match="missing weight_scale"):
        method.process_after_loading(layer)
    with pytest.raises(CheckpointError, match="declares no quantization_config"):
        make_linear(Fp8LinearMethod(), 64, 32).load("weight_scale", torch.ones(32))
    with pytest.raises(ConfigError, match="backend must be one of"):
        Fp8LinearMethod(backend="cutlass")
    static = Fp8LinearMethod(fp8.parse_compressed_tensors(FP8_STATIC_CFG))
    layer = make_linear(static, 64, 32)
    layer.load("weight", torch.zeros(32, 64, dtype=torch.float8_e4m3fn))
    layer.load("weight_scale", torch.ones(1))
    with pytest.raises(CheckpointError, match="missing input_scale for layer"):  # static activations need their scale
        static.process_after_loading(layer)


@pytest.mark.parametrize("acts", [None, {"strategy": "tensor", "dynamic": True}],
                         ids=["weight-only", "dynamic-per-tensor"])
def test_fp8_weight_only_and_dynamic_per_tensor_schemes(acts: dict[str, object] | None) -> None:
    """Weight-only: ``x @ (w_fp8 * s_w).T`` on x as it is. Dynamic per-tensor: x rounded to e4m3 on one scale,
    max |x| over the whole batch / 448."""
    method = Fp8LinearMethod(fp8.parse_compressed_tensors(ct_config({"strategy": "channel"}, acts)), "emulate")
    layer = make_linear(method, 64, 32)
    w_fp8 = (torch.randn(32, 64) * 100).to(fp8.FP8_DTYPE)
    w_scale = torch.rand(32) * 0.01 + 1e-3
    layer.load("weight", w_fp8)
    layer.load("weight_scale", w_scale.reshape(32, 1))
    method.process_after_loading(layer)
    x = torch.randn(4, 64) * torch.tensor([0.01, 1.0, 30.0, 0.5])[:, None]  # token 0 far below the batch's max
    used = x
    if acts is not None:
        s = x.abs().max() / 448
        used = (x / s).clamp(-448, 448).to(fp8.FP8_DTYPE).float() * s
    expected = used.double() @ (w_fp8.double() * w_scale.double()[:, None]).t()
    torch.testing.assert_close(layer(x).double(), expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))


def test_fp8_warns_that_the_checkpoint_kv_cache_scheme_is_ignored(caplog: pytest.LogCaptureFixture) -> None:
    kv_scheme = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}
    with caplog.at_level(logging.WARNING, logger="infer"):
        fp8_plugin.build_fp8(EngineConfig(), {**FP8_STATIC_CFG, "kv_cache_scheme": kv_scheme})
    assert any("kv_cache_scheme and its k/v scales are ignored" in r.message for r in caplog.records)


# ---------------------------------------------------------------- AWQ calibration pieces
def test_fake_quantize_rtn_equals_pack_then_dequantize() -> None:
    weight = torch.randn(48, 128)
    for group in (32, -1):
        packed = awq.quantize_rtn(weight, group)
        expected = awq.dequantize(*packed, group, dtype=torch.float32).t()
        assert torch.equal(awq.fake_quantize_rtn(weight, group), expected)


def test_scale_search_finds_activation_outliers() -> None:
    from infer.quant.calibrate import search_scale

    x = torch.randn(256, 128)
    x[:, [5, 40, 99]] *= 20  # outlier input channels
    weight = [torch.randn(64, 128), torch.randn(32, 128)]
    found = search_scale(x, x.abs().mean(dim=0), weight, 32, grid=10)
    assert found.alpha > 0 and found.error < 0.7 * found.rtn_error
    assert found.scales[[5, 40, 99]].min() > found.scales.median() * 3  # outlier columns are scaled up
    flat = search_scale(torch.randn(256, 128), torch.ones(128), weight, 32, grid=10)
    assert torch.allclose(flat.scales, torch.ones(128)) and flat.error == flat.rtn_error  # nothing to gain
    assert flat.alpha == 0  # a tie keeps plain RTN: an alpha > 0 is chosen only for a strictly lower error
    shared = search_scale(x, x.abs().mean(dim=0), weight, 32, grid=10, share=(2, 2, 32))  # o_proj under GQA
    per_kv = shared.scales.view(2, 2, 32)
    assert torch.equal(per_kv[:, 0], per_kv[:, 1])


def test_awq_calibration_defaults_and_bounds() -> None:
    """The defaults docs/cli.md gives (grid 20: AutoAWQ's n_grid); grid, max_rows and batch_samples below 1 and any
    bit width but 4 are ConfigErrors."""
    from dataclasses import replace

    from infer.quant.calibrate import AwqCalibrationConfig

    config = AwqCalibrationConfig()
    assert (config.group_size, config.bits, config.num_samples, config.seq_len, config.device) == (None, 4, 64, 512,
                                                                                                   "auto")
    assert config.grid == 20 and config.validate() is config
    for name in ("grid", "max_rows", "batch_samples"):
        with pytest.raises(ConfigError, match=f"--{name.replace('_', '-')} must be >= 1, got 0"):
            replace(config, **{name: 0}).validate()
    for bits in (3, 8):
        with pytest.raises(ConfigError, match=f"4-bit weights only .the AutoAWQ GEMM format., got --bits {bits}"):
            replace(config, bits=bits).validate()


def test_awq_checkpoint_tensors_are_fp16_up_to_its_largest_value() -> None:
    """Float tensors are stored as fp16: its largest value, 65504, is kept; beyond it is a CheckpointError naming the
    tensor; integer tensors (qweight, qzeros) keep their dtype."""
    from infer.quant.calib_job import _to_fp16

    edge = torch.tensor([65504.0, -65504.0, 1.5])
    assert torch.equal(_to_fp16("w", edge), edge.half())
    packed = torch.tensor([[1, -2]], dtype=torch.int32)
    assert torch.equal(_to_fp16("q", packed), packed) and _to_fp16("q", packed).dtype == torch.int32
    with pytest.raises(CheckpointError, match="model.norm.weight holds values beyond the fp16 range"):
        _to_fp16("model.norm.weight", torch.tensor([1.0, -7e4]))


def documented_scales(stat: torch.Tensor, alpha: float) -> torch.Tensor:
    """The module docstring's ``s = stat^alpha`` (floored at 1e-4, as AutoAWQ does), normalised by
    ``sqrt(max(s) * min(s))``."""
    s = stat.double().pow(alpha).clamp(min=1e-4)
    return (s / (s.max() * s.min()).sqrt()).float()


def output_mse(x: torch.Tensor, weights: list[torch.Tensor], s: torch.Tensor, group: int) -> float:
    """Mean squared difference of all the linears' outputs, x @ W.T against x @ (RTN(W * s) / s).T."""
    w = torch.cat(weights)
    return float((x @ (awq.fake_quantize_rtn(w * s, group) / s).t() - x @ w.t()).pow(2).mean())


@pytest.mark.parametrize("share, power", [(None, 1.0), ((2, 2, 32), 0.25)], ids=["plain", "gqa-best-at-alpha-1"])
def test_scale_search_takes_the_best_alpha_of_the_documented_grid(share: tuple[int, int, int] | None,
                                                                  power: float) -> None:
    """Every alpha in {0, 1/grid, ..., 1} is tried with the documented normalised scales, the output MSE of all the
    group's linears decides (the first of equal errors wins), alpha 0 is RTN's error; a channel the calibration
    never excited (stat 0) is floored, not divided by. Under GQA the stat of a shared scale is the mean over the
    q heads that share it."""
    from infer.quant.calibrate import search_scale

    x = torch.randn(256, 128)
    x[:, [5, 40, 99]] *= 20
    x[:, 7] = 0
    x[:, 64:96] *= torch.linspace(0.5, 4, 32)  # the two q heads of KV head 1 see different magnitudes
    stat, grid = x.abs().mean(dim=0).pow(power), 10  # a flattened stat moves the best alpha to the grid's end
    weights = [torch.randn(64, 128), torch.randn(32, 128) * 3]  # the second linear dominates the error
    found = search_scale(x, stat, weights, 32, grid, share)
    base = stat if share is None else stat.view(share).mean(dim=1)
    candidates = []
    for i in range(grid + 1):
        s = documented_scales(base, i / grid)
        s = s if share is None else s[:, None].expand(share).reshape(-1)
        candidates.append((output_mse(x, weights, s, 32), i / grid, s))
    best = min(candidates, key=lambda c: c[0])  # min keeps the first of equal errors
    assert found.alpha == best[1] > 0
    torch.testing.assert_close(found.scales, best[2], rtol=1e-5, atol=0)
    assert math.isclose(found.error, best[0], rel_tol=1e-4) and math.isclose(found.rtn_error, candidates[0][0],
                                                                             rel_tol=1e-4)


class Chars:  # a calibration tokenizer: one token per character
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


def test_calibration_texts_and_samples(tmp_path: Path) -> None:
    from infer.quant.calib_data import read_texts, token_samples

    lines = tmp_path / "calib.txt"
    lines.write_text("first text\n\n \t\n  second text\n")  # blank lines, spaces only or not, hold no text
    assert read_texts(lines) == ["first text", "  second text"]
    lines.write_text('{\n  "key": 1,\n}\n')  # code opening with a brace line: text, not broken JSONL
    assert read_texts(lines) == ["{", '  "key": 1,', "}"]
    lines.write_text('{"text": "a b"}\n')  # a first line that is a JSON object: JSONL, whatever the suffix
    assert read_texts(lines) == ["a b"]
    jsonl = tmp_path / "calib.jsonl"
    jsonl.write_text('{"text": "a b"}\n"c d"\n')
    assert read_texts(jsonl) == ["a b", "c d"]
    jsonl.write_text('{"text": 3}\n')  # bad data, not bad options: InvalidRequestError (exit 1), no ConfigError
    with pytest.raises(InvalidRequestError, match="line 1 must be a JSON string or an object") as info:
        read_texts(jsonl)
    assert not isinstance(info.value, ConfigError)
    jsonl.write_text("{oops\n")
    with pytest.raises(InvalidRequestError, match="line 1 is not a whole JSON value") as info:
        read_texts(jsonl)
    assert not isinstance(info.value, ConfigError)
    document = tmp_path / "calib.json"  # one JSON document over several lines: said to be JSON Lines' job
    document.write_text('[\n  "a b",\n  "c d"\n]\n')
    with pytest.raises(InvalidRequestError, match="is JSON Lines: one JSON string, or object with a 'text' field, "
                                                  "per line"):
        read_texts(document)
    lines.write_text('\ufeff{"text": "a b"}\n', encoding="utf-8")  # a byte-order mark: still JSONL, not text
    assert read_texts(lines) == ["a b"]
    jsonl.write_text('{"text": ""}\n" "\n')
    with pytest.raises(InvalidRequestError, match="holds only empty texts"):
        read_texts(jsonl)

    samples = token_samples(Chars(), ["abcdefgh", "ijklmnop"], num_samples=3, seq_len=5)
    assert samples == [[ord(c) for c in "abcde"], [ord(c) for c in "fgh\n\n"], [ord(c) for c in "ijklm"]]
    assert token_samples(Chars(), ["ab"], 4, 64) == [[97, 98, 10, 10]]  # short text: one shorter sample
    with pytest.raises(InvalidRequestError, match="holds 0 token") as info:
        token_samples(Chars(), [], 4, 64)
    assert not isinstance(info.value, ConfigError)


def test_calibration_files_that_hold_no_text_or_no_json_lines(tmp_path: Path) -> None:
    """A file that is empty or not UTF-8 is refused by name (InvalidRequestError); a first line that is a JSON
    value other than an object (a quoted line, a number) leaves a .txt file plain text."""
    from infer.quant.calib_data import read_texts

    path = tmp_path / "calib.txt"
    path.write_text("\n  \n")
    with pytest.raises(InvalidRequestError, match="calib.txt' holds no text"):
        read_texts(path)
    path.write_bytes(b"caf\xe9 latin-1\n")
    with pytest.raises(InvalidRequestError, match="cannot read calibration file .*calib.txt'"):
        read_texts(path)
    path.write_text('"a quoted line"\n42\nplain text\n')
    assert read_texts(path) == ['"a quoted line"', "42", "plain text"]


def test_token_samples_bounds_and_reads_no_more_text_than_needed() -> None:
    """At least 1 sample of at least 2 tokens (ConfigError), a text of at least 2 tokens (InvalidRequestError); the
    texts are read only until they hold num_samples * seq_len tokens (the default is thousands of files)."""
    from infer.quant.calib_data import token_samples

    for num_samples, seq_len in ((0, 8), (1, 1)):
        with pytest.raises(ConfigError, match=f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and "
                                              f"{seq_len}"):
            token_samples(Chars(), ["abcdef"], num_samples, seq_len)

    class OneToken:
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [7]

    with pytest.raises(InvalidRequestError, match="holds 1 token"):
        token_samples(OneToken(), ["x"], 1, 4)

    def texts() -> Iterator[str]:
        yield "abc"  # "abc\n\n": 5 tokens, exactly 1 sample of 5
        raise AssertionError("read a text past the tokens needed")

    assert token_samples(Chars(), texts(), 1, 5) == [[ord(c) for c in "abc\n\n"]]


# ---------------------------------------------------------------- fp8 KV cache
def test_kv_quantization_error_bound() -> None:
    from infer.quant import kv_cache

    x = torch.randn(40, 2, 32) * torch.tensor([0.5, 30.0])[:, None]  # two heads of very different ranges
    scale = kv_cache.scales_from_amax(x.abs().amax(dim=(0, 2)))
    stored = kv_cache.quantize_kv(x, scale)
    assert stored.dtype == torch.float8_e4m3fn and float(stored.float().abs().max()) == 448 / kv_cache.HEADROOM
    back = kv_cache.dequantize_kv(stored, scale, torch.float32)
    assert bool(((back - x).abs() <= fp8_error_bound(x, scale[:, None])).all())
    clamped = kv_cache.quantize_kv(x * 4, scale)  # beyond the headroom: saturates, never inf or nan
    assert float(clamped.float().abs().max()) == 448


def test_kv_scales_of_an_all_zero_head_stay_positive() -> None:
    """A head whose calibration K (or V) is all zero still gets a positive scale, so that it stores zeros as zeros
    (a zero scale would make them 0 / 0 = nan)."""
    from infer.quant import kv_cache

    scale = kv_cache.scales_from_amax(torch.tensor([0.0, 3.0]))
    assert bool((scale > 0).all())
    x = torch.zeros(5, 2, 8)
    x[:, 1] = torch.randn(5, 8)
    back = kv_cache.dequantize_kv(kv_cache.quantize_kv(x, scale), scale, torch.float32)
    assert bool(back.isfinite().all()) and torch.equal(back[:, 0], x[:, 0])


def test_dequantize_kv_rounds_the_exact_product_once() -> None:
    """``stored * scale[h]`` is formed exactly (in fp32) and rounded once to the model dtype; scales with 20
    significant bits keep the fp8 x scale products exact in fp32, and are no bf16 values."""
    from infer.quant import kv_cache

    stored = (torch.randn(64, 2, 16) * 50).to(torch.float8_e4m3fn)
    raw = torch.tensor([0.0123, 1.7], dtype=torch.float64)
    step = 2.0 ** (torch.floor(torch.log2(raw)) - 19)
    scale = ((raw / step).round() * step).to(torch.float32)
    assert not torch.equal(scale.to(torch.bfloat16).float(), scale)
    expected = (stored.double() * scale.double()[:, None]).to(torch.bfloat16)
    assert torch.equal(kv_cache.dequantize_kv(stored, scale, torch.bfloat16), expected)


def test_kv_calibration_names_a_model_that_skips_the_observer(monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from infer.core.errors import PluginError
    from infer.quant import kv_cache

    def forward(model: object, samples: object, device: torch.device, observe: object) -> None:
        for layer in (0, 2):  # layer 1 never reports its K and V
            observe(layer, torch.ones(4, 2, 8), torch.ones(4, 2, 8))  # type: ignore[operator]

    monkeypatch.setattr(kv_cache, "dense_forward", forward)
    model = SimpleNamespace(spec=SimpleNamespace(num_layers=3))
    with pytest.raises(PluginError, match="called the KV observer for 2 of its 3 attention layers"):
        kv_cache.calibrate_kv_scales(model, [1, 2, 3], torch.device("cpu"))  # type: ignore[arg-type]


def test_runner_keeps_fp8_scales_next_to_the_cache() -> None:
    from infer.core.interfaces import LayerKVCache, kv_cache_scales
    from infer.core.runner import ModelRunner
    from infer.models.llama import ArchConfig, LlamaFamilyModel
    from infer.plugins.torch_attention import TorchAttention

    cfg = ArchConfig("LlamaForCausalLM", 32, 2, 4, 2, 8, 8, 64, 100, 1e-6, 64, False, False, False, False, False)
    model = LlamaFamilyModel(cfg, None, torch.float32, 64)
    scales = [(torch.full((2,), 0.1), torch.full((2,), 0.2)) for _ in range(2)]
    runner = ModelRunner(model, TorchAttention(), 4, 16, torch.float32, torch.device("cpu"), 0,
                         kv_dtype=torch.float8_e4m3fn, kv_scales=scales)
    cache = runner.kv_caches[1]
    k_cache, v_cache = cache  # still unpacks like the plain (k, v) tuple
    assert isinstance(cache, LayerKVCache) and k_cache.dtype == v_cache.dtype == torch.float8_e4m3fn
    assert torch.equal(kv_cache_scales(cache)[1], torch.full((2,), 0.2))
    assert kv_cache_scales((k_cache, v_cache)) == (None, None)
    assert ModelRunner.bytes_per_block(model, 16, torch.float8_e4m3fn) * 2 == \
        ModelRunner.bytes_per_block(model, 16, torch.bfloat16)
    plain = ModelRunner(model, TorchAttention(), 4, 16, torch.float32, torch.device("cpu"), 0)
    assert plain.kv_caches[0][0].dtype == torch.float32 and plain.kv_caches[0].k_scale is None
    with pytest.raises(ValueError, match="needs \\(k_scale, v_scale\\) for each of the 2 layers"):
        ModelRunner(model, TorchAttention(), 4, 16, torch.float32, torch.device("cpu"), 0,
                    kv_dtype=torch.float8_e4m3fn)


def test_kv_cache_dtype_option_reaches_the_config() -> None:
    from infer.cli.options import EngineArgs

    args = EngineArgs.from_kwargs({"kv_cache_dtype": "fp8"})
    assert args.values["kv_cache_dtype"] == "fp8"
    with pytest.raises(ConfigError, match="kv-cache-dtype must be one of auto, fp8"):
        EngineConfig(kv_cache_dtype="int8").validate()


def fp8_paged_case(group: int) -> dict[str, torch.Tensor]:
    """fp8 caches with per-head scales, shuffled block tables, and q for a mixed batch (extend + decode)."""
    page, blocks, kv_heads, head_dim = 16, 12, 2, 32
    context, query = [37, 9, 20], [5, 1, 1]
    full = torch.randn(blocks, page, kv_heads, head_dim) * torch.tensor([1.0, 6.0])[:, None]
    scale = (full.abs().amax(dim=(0, 1, 3)) * 2 / 448, full.abs().amax(dim=(0, 1, 3)) * 2 / 448 * 1.5)
    from infer.quant.kv_cache import quantize_kv

    tables = torch.randperm(blocks)[:9].reshape(3, 3).to(torch.int32)
    return {
        "q": torch.randn(sum(query), kv_heads * group, head_dim),
        "k_cache": quantize_kv(full, scale[0]), "v_cache": quantize_kv(full.flip(0), scale[1]),
        "k_scale": scale[0], "v_scale": scale[1], "tables": tables,
        "query_start": torch.tensor([0, 5, 6, 7], dtype=torch.int32),
        "context_lens": torch.tensor(context, dtype=torch.int32),
    }


@pytest.mark.parametrize("group", [1, 2])
def test_attention_kernels_read_fp8_caches(group: int) -> None:
    from infer.kernels import attention as kernels

    c = {k: v.to(DEVICE) for k, v in fp8_paged_case(group).items()}
    scales = {"k_scale": c["k_scale"], "v_scale": c["v_scale"]}
    ref = kernels.paged_attention_ref(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["query_start"],
                                      c["context_lens"], 0.2, **scales)
    out = kernels.prefill_attention(c["q"], c["k_cache"], c["v_cache"], c["tables"], c["query_start"],
                                    c["context_lens"], 0.2, **scales)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    q_dec = c["q"][[4, 5, 6]]  # the last query token of each sequence
    dec = kernels.decode_attention(q_dec, c["k_cache"], c["v_cache"], c["tables"], c["context_lens"], 0.2, 2,
                                   **scales)
    torch.testing.assert_close(dec, ref[[4, 5, 6]], atol=2e-5, rtol=2e-5)
    dense_k = (c["k_cache"].float() * c["k_scale"][:, None]).contiguous()  # dequantized by hand: same result
    dense_v = (c["v_cache"].float() * c["v_scale"][:, None]).contiguous()
    plain = kernels.prefill_attention(c["q"], dense_k, dense_v, c["tables"], c["query_start"], c["context_lens"],
                                      0.2)
    torch.testing.assert_close(out, plain, atol=2e-5, rtol=2e-5)


def test_store_kv_fp8_writes_the_torch_rounding() -> None:
    from infer.kernels import attention as kernels
    from infer.quant.kv_cache import quantize_kv

    k, v = torch.randn(2, 7, 2, 16).to(DEVICE).unbind(0)
    scale = torch.tensor([0.01, 0.02], device=DEVICE)
    slots = torch.tensor([3, 0, -1, 17, 9, -1, 22], device=DEVICE)
    caches = [torch.zeros(3, 8, 2, 16, dtype=torch.float8_e4m3fn, device=DEVICE) for _ in range(2)]
    kernels.store_kv_fp8(k, v, *caches, slots, scale, scale * 2)
    keep = slots >= 0
    flat_k, flat_v = (c.view(-1, 2, 16)[slots[keep]] for c in caches)
    assert torch.equal(flat_k.view(torch.uint8), quantize_kv(k[keep], scale).view(torch.uint8))
    assert torch.equal(flat_v.view(torch.uint8), quantize_kv(v[keep], scale * 2).view(torch.uint8))


# ---------------------------------------------------------------- native GPU variants (pytest -m gpu)
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_awq_linear_fused_and_dequant_paths_agree_on_gpu(dtype: torch.dtype) -> None:
    method = AwqLinearMethod(group_size=128, fused_max_rows=64)
    layer = make_linear(method, 512, 256, dtype=dtype).cuda()
    _, state = awq_state(256, 512, 128, seed=11)
    for name, tensor in state.items():
        layer.load(name, tensor)
    method.process_after_loading(layer)
    w = awq.dequantize(layer.qweight, layer.qzeros, layer.scales, 128, dtype=torch.float32)
    for rows in (1, 7, 64, 65, 300):  # fused Triton kernel up to 64 rows, dequantize + matmul above
        x = torch.randn(rows, 512, device="cuda", dtype=dtype)
        ref = x.float() @ w
        torch.testing.assert_close(layer(x).float(), ref, rtol=3e-2, atol=3e-2 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.parametrize("config", [FP8_DYNAMIC_CFG, FP8_STATIC_CFG], ids=["FP8_DYNAMIC", "FP8"])
def test_fp8_scaled_mm_matches_emulation_on_gpu(config: dict[str, object]) -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs sm89+")
    weight = torch.randn(256, 512)
    static = config is FP8_STATIC_CFG
    w_scale = (weight.abs().amax() / 448).reshape(1) if static else fp8.quantize_weight_per_channel(weight)[1]
    state = {"weight": fp8.to_fp8(weight, w_scale.reshape(-1, 1)), "weight_scale": w_scale}
    if static:
        state["input_scale"] = torch.tensor([0.01])
    x = torch.randn(96, 512, device="cuda", dtype=torch.bfloat16)
    outs = []
    for backend in ("scaled_mm", "emulate", "triton"):
        method = Fp8LinearMethod(fp8.parse_compressed_tensors(config), backend=backend)
        layer = make_linear(method, 512, 256, dtype=torch.bfloat16).cuda()
        for name, tensor in state.items():
            layer.load(name, tensor)
        method.process_after_loading(layer)
        outs.append(layer(x).float())
    for other in outs[1:]:
        torch.testing.assert_close(outs[0], other, rtol=2e-2, atol=2e-2 * other.abs().max().item())


@pytest.mark.gpu
def test_fp8_scaled_mm_runs_a_vocabulary_sized_head_on_gpu() -> None:
    """fp8.lm_head: the head's GEMM (N = the 1B's 128,256 vocabulary) through scaled_mm equals the emulation."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("torch._scaled_mm needs sm89+")
    weight = torch.randn(128256, 512, generator=torch.Generator().manual_seed(0))
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    outs = []
    for backend in ("scaled_mm", "emulate"):
        method = Fp8LinearMethod(None, backend=backend, quantize_lm_head=True)
        layer = make_linear(method, 512, 128256, prefix="lm_head", dtype=torch.bfloat16).cuda()
        layer.load("weight", weight.to(torch.bfloat16))
        method.process_after_loading(layer)
        outs.append(layer(x).float())
    torch.testing.assert_close(outs[0], outs[1], rtol=2e-2, atol=2e-2 * outs[1].abs().max().item())


@pytest.mark.gpu
def test_fp8_per_token_kernel_emits_fp8_on_gpu() -> None:
    x = torch.randn(33, 1000, device="cuda", dtype=torch.bfloat16)
    q, scale = per_token_quant(x)
    # the reference on the CPU: on CUDA, torch divides by a Python float as a multiply by its rounded reciprocal
    ref_q, ref_scale = fp8.quantize_per_token(x.cpu())
    assert torch.equal(scale.cpu(), ref_scale)
    assert torch.equal(q.view(torch.uint8).cpu(), ref_q.view(torch.uint8))
