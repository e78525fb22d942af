"""The W8A16 layout (quant/w8a16.py) and its Triton kernels (kernels/w8a16_gemm.py) against torch references:
the dequantization written out from the formula ``(q - z[k // g]) * s[k // g]`` per element, and a float matmul.
How 8-bit GPTQ and compressed-tensors checkpoints reach this layout is tested in tests/test_quant_gptq.py and
tests/test_quant_compressed_tensors.py."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():  # before the first import of a module defining @triton.jit kernels
    os.environ.setdefault("TRITON_INTERPRET", "1")

from infer.core.errors import CheckpointError  # noqa: E402
from infer.kernels.w8a16_gemm import w8a16_dequantize, w8a16_gemm, w8a16_gemm_reference  # noqa: E402
from infer.quant import w8a16  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def w8a16_state(k: int, n: int, group: int, seed: int, scale_dtype: torch.dtype = torch.float16
                ) -> dict[str, torch.Tensor]:
    """Random codes and zero points over the whole 0..255 range, and positive scales, on DEVICE."""
    gen = torch.Generator().manual_seed(seed)
    groups = k // (k if group == -1 else group)
    return {"qweight": torch.randint(0, 256, (k, n), generator=gen, dtype=torch.uint8).to(DEVICE),
            "qzeros": torch.randint(0, 256, (groups, n), generator=gen, dtype=torch.uint8).to(DEVICE),
            "scales": (torch.rand(groups, n, generator=gen) * 0.01 + 1e-3).to(DEVICE, scale_dtype)}


def elementwise_dequantize(state: dict[str, torch.Tensor], group: int) -> torch.Tensor:
    """The formula, one element at a time (in float64: exact), as the reference of the vectorized forms."""
    q, z, s = (state[name].double().cpu() for name in ("qweight", "qzeros", "scales"))
    k, n = q.shape
    g = k if group == -1 else group
    out = torch.empty(k, n, dtype=torch.float64)
    for row in range(k):
        out[row] = (q[row] - z[row // g]) * s[row // g]
    return out


@pytest.mark.parametrize("group", [32, -1])
def test_dequantize_is_the_formula_rounded_once(group: int) -> None:
    state = w8a16_state(64, 24, group, seed=1)
    exact = elementwise_dequantize(state, group)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        assert torch.equal(w8a16.dequantize(**state, group_size=group, dtype=dtype).cpu(), exact.to(dtype))


def test_gptq_words_unpack_byte_by_byte() -> None:
    """GPTQ packs four inputs per qweight word (byte i: row 4r + i) and four outputs per qzeros word; v1 stores
    z - 1, taken off (and put back) on the whole word, so that a zero point of 0 borrows from the next byte."""
    rows = [[0x04030201, -1], [0x7F008081, 0x00000100]]  # -1: 0xFFFFFFFF
    qweight = torch.tensor(rows, dtype=torch.int32)  # [in / 4 = 2, out = 2]
    assert w8a16.unpack_rows(qweight).tolist() == [[1, 255], [2, 255], [3, 255], [4, 255],
                                                   [0x81, 0], [0x80, 1], [0, 0], [0x7F, 0]]
    order = torch.tensor([7, 0, 1, 2, 3, 4, 5, 6])
    assert w8a16.unpack_rows(qweight, order)[0].tolist() == [0x7F, 0]
    v2_zeros = torch.tensor([[0, 5, 255, 7]], dtype=torch.uint8)  # one group, four outputs
    word = int.from_bytes(bytes(v2_zeros[0].tolist()), "little") - 0x01010101  # v1: one off the whole word
    v1 = torch.tensor([[word - 2**32 if word >= 2**31 else word]], dtype=torch.int32)
    assert w8a16.unpack_columns(v1).tolist() == [[255, 3, 254, 6]]  # as stored: 0 - 1 borrowed from 5
    codes, zeros, found = w8a16.from_gptq(torch.zeros(1, 4, dtype=torch.int32), v1, None, -1, 1, "layer")
    assert zeros.tolist() == v2_zeros.tolist() and codes.shape == (4, 4) and found is None


def test_shapes_the_packing_cannot_hold_are_refused_by_name() -> None:
    with pytest.raises(CheckpointError, match="in_features divisible by 4, got 6 for layer 'a.b'"):
        w8a16.check_shapes(6, 8, -1, "a.b")
    with pytest.raises(CheckpointError, match="out_features divisible by 4, got 10"):
        w8a16.check_shapes(64, 10, 32, "a.b")
    with pytest.raises(CheckpointError, match="group_size 32 does not divide in_features 48"):
        w8a16.check_shapes(48, 8, 32, "a.b")


@pytest.mark.parametrize("dtype, m, k, n, group, blocks", [
    (torch.float32, 1, 256, 96, 32, (None, None, None)),  # defaults: block_k lowered to the group
    (torch.float16, 5, 256, 200, 64, (64, 64, 2)),  # N ends in a partial block; split-K through fp32 atomics
    (torch.float32, 33, 128, 64, 128, (64, 64, 1)),  # two groups per row of K blocks; three M blocks of 16
    (torch.float16, 3, 96, 64, -1, (64, 32, 1)),  # one group over K = 96: its last K block is partial
    (torch.float32, 16, 192, 48, -1, (32, 64, 2)),  # one group over two K slices
    pytest.param(torch.bfloat16, 1, 2048, 256, 128, (None, None, None), marks=pytest.mark.gpu),
    pytest.param(torch.bfloat16, 64, 512, 384, 32, (None, None, None), marks=pytest.mark.gpu),
])
def test_w8a16_gemm_matches_the_reference(dtype: torch.dtype, m: int, k: int, n: int, group: int,
                                          blocks: tuple[int | None, int | None, int | None]) -> None:
    state = w8a16_state(k, n, group, seed=k + n)
    if dtype == torch.float32:
        state["scales"] = state["scales"].float()
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
    block_n, block_k, split_k = blocks
    out = w8a16_gemm(x, **state, group_size=group, block_n=block_n, block_k=block_k, split_k=split_k)
    exact = (x.double().cpu() @ elementwise_dequantize(state, group)).to(DEVICE)
    assert out.dtype == dtype and out.shape == (m, n)
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
    reference = w8a16_gemm_reference(x, **state, group_size=group)
    torch.testing.assert_close(out.float(), reference.float(), rtol=tol, atol=tol * exact.abs().max().item())


@pytest.mark.parametrize("dtype, m, split_k", [(torch.float32, 3, 1), (torch.float16, 17, 2)])
def test_w8a16_gemm_gathers_the_input_in_the_activation_order(dtype: torch.dtype, m: int, split_k: int) -> None:
    """GPTQ's activation order: weight row k multiplies input column order[k]; the kernel gathers as it loads x."""
    state = w8a16_state(128, 64, 32, seed=5)
    order = torch.randperm(128, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    out = w8a16_gemm(x, **state, group_size=32, input_order=order, split_k=split_k)
    exact = (x.double().cpu()[:, order.cpu()] @ elementwise_dequantize(state, 32)).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), exact, rtol=tol, atol=tol * exact.abs().max().item())
    with pytest.raises(ValueError, match="input_order must be an int32/int64 \\[128\\] tensor"):
        w8a16_gemm(x, **state, group_size=32, input_order=order[:64])


def test_w8a16_gemm_refuses_what_it_cannot_compute() -> None:
    state = w8a16_state(64, 32, 32, seed=2)
    with pytest.raises(ValueError, match="block_k 64 must divide the group size 32"):
        w8a16_gemm(torch.randn(1, 64, device=DEVICE), **state, group_size=32, block_k=64)
    with pytest.raises(ValueError, match="qweight must be uint8"):
        w8a16_gemm(torch.randn(1, 64, device=DEVICE), state["qweight"].int(), state["qzeros"], state["scales"], 32)
    assert w8a16_gemm(torch.randn(0, 64, device=DEVICE), **state, group_size=32).shape == (0, 32)
    with pytest.raises(ValueError, match="needs uint8 codes"):
        w8a16_dequantize(state["qweight"].to(torch.int8), state["qzeros"], state["scales"], 32, torch.float32)
    column_major = state["qweight"].t().contiguous().t()  # the same codes, another layout: the same weight
    assert torch.equal(w8a16_dequantize(column_major, state["qzeros"], state["scales"], 32, torch.float32),
                       w8a16.dequantize(**state, group_size=32, dtype=torch.float32))


@pytest.mark.parametrize("dtype, k, n, group", [
    (torch.float32, 128, 96, 32), (torch.float16, 72, 64, -1), (torch.float16, 256, 200, 128),
    # bf16 on a GPU only: the interpreter rounds float32 to bf16 by truncation, CUDA to nearest even as torch does
    pytest.param(torch.bfloat16, 256, 256, 64, marks=pytest.mark.gpu)])
def test_dequantize_kernel_equals_the_torch_dequantization_bit_for_bit(dtype: torch.dtype, k: int, n: int,
                                                                       group: int) -> None:
    state = w8a16_state(k, n, group, seed=k)
    ours = w8a16_dequantize(**state, group_size=group, dtype=dtype)
    assert ours.dtype == dtype and torch.equal(ours, w8a16.dequantize(**state, group_size=group, dtype=dtype))
    assert torch.equal(ours.cpu(), elementwise_dequantize(state, group).to(dtype))
