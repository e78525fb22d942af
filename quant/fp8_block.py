"""Block-wise FP8: the ``quant_method: "fp8"`` checkpoints of DeepSeek-V3 and the Qwen3 FP8 releases (the format
transformers calls FineGrainedFP8).

A linear's weight [N, K] is stored as float8_e4m3fn with ``weight_scale_inv`` [ceil(N / bn), ceil(K / bk)] (fp32,
bf16 or fp16): block (i, j), ``weight[i*bn:(i+1)*bn, j*bk:(j+1)*bk]``, reads back as its fp8 values times
``weight_scale_inv[i, j]`` (edge blocks are partial). ``weight_block_size`` [bn, bk] is usually [128, 128]; without
one a single scale covers the whole weight. Activations are quantized at run time per token and per group of bk
input features (scale = amax / 448), so one K-block of the GEMM has one scale per row and one per output block.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

from ..core.errors import CheckpointError
from .common import bad_pattern, is_name_list
from .fp8 import scale_from_amax, to_fp8

Block = tuple[int, int]  # (bn, bk): output rows and input columns per weight scale


@dataclass(frozen=True)
class BlockFp8Config:
    """A validated ``quant_method: "fp8"`` config. ``block`` None: one scale per weight (per-tensor)."""

    block: Block | None
    modules_to_not_convert: tuple[str, ...] | None = None

    def applies_to(self, prefix: str) -> bool:
        """transformers' rule: a name in ``modules_to_not_convert`` matches from the start up to a module boundary
        (also as a regex) or as a suffix; without the list, only ``lm_head`` stays unquantized."""
        if self.modules_to_not_convert is None:
            return prefix.rsplit(".", 1)[-1] != "lm_head"
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", prefix) or prefix.endswith(key)
                       for key in self.modules_to_not_convert)

    def block_for(self, out_features: int, in_features: int) -> Block:
        return self.block or (out_features, in_features)


def _fail(message: str) -> CheckpointError:
    return CheckpointError(f"unsupported block-wise FP8 checkpoint (quant_method 'fp8'): {message}; infer loads "
                           "e4m3 weights with float block scales (weight_scale_inv) and dynamic activations, the "
                           "format of DeepSeek-V3 and the Qwen3 FP8 releases")


def parse_block_fp8(qc: dict[str, Any]) -> BlockFp8Config:
    """Validate config.json's ``quantization_config`` of a block-wise FP8 checkpoint."""
    if str(qc.get("activation_scheme", "dynamic")).lower() != "dynamic":  # transformers lowercases it
        raise _fail(f"activation_scheme is {qc.get('activation_scheme')!r} (static activation_scale tensors)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise _fail(f"fmt is {qc.get('fmt')!r}, not e4m3")
    if qc.get("scale_fmt", "float") != "float":
        raise _fail(f"scale_fmt is {qc.get('scale_fmt')!r} (power-of-two ue8m0 scales, DeepSeek-V4 style)")
    if qc.get("expert_dtype", "fp8") != "fp8":
        raise _fail(f"expert_dtype is {qc.get('expert_dtype')!r} (FP4 experts)")
    if qc.get("modules_to_convert"):
        raise _fail(f"modules_to_convert {qc['modules_to_convert']!r} stores those layers (embeddings) in fp8 too")
    size = qc.get("weight_block_size", [128, 128])  # transformers' default; an explicit null: one per tensor
    if size is not None and not (isinstance(size, list | tuple) and len(size) == 2 and
                                 all(isinstance(s, int) and not isinstance(s, bool) and s > 0 for s in size)):
        raise _fail(f"weight_block_size must be two positive integers such as [128, 128], got {size!r}")
    skip = qc.get("modules_to_not_convert")
    skip = qc.get("ignored_layers") if skip is None else skip  # MiniMax's and AutoFP8's name for it
    if skip is not None and not is_name_list(skip):
        raise _fail(f"modules_to_not_convert must be a list of module names, got {skip!r}")
    if skip is not None and (why := bad_pattern(skip, ("(?:", ")"))):  # transformers matches them as such
        raise _fail(f"modules_to_not_convert entry {why}")
    return BlockFp8Config(None if size is None else (size[0], size[1]), None if skip is None else tuple(skip))


def k_tile(group_k: int, native: bool) -> int | None:
    """The block GEMMs' K-tile for scale groups of ``group_k`` inputs: the largest power of two up to 128 that
    divides it (a tile then never straddles two groups); None below tl.dot's minimum K for 8-bit operands, 32 on
    CUDA (``native``; the interpreter, which upcasts to fp32, takes 16)."""
    tile = min(group_k & -group_k, 128)
    return tile if tile >= (32 if native else 16) else None


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """Whether ``device`` is a GPU whose tensor cores multiply e4m3 (sm89+: L4, H100, ...), which the Triton FP8
    kernels need (Triton refuses the type below)."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def dequantize_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: Block) -> torch.Tensor:
    """fp32 ``weight`` [N, K] times its block scales (expanded over rows only: no [N, K] scale tensor)."""
    n, k = weight.shape
    out = weight.to(torch.float32, copy=True)
    row_scales = scale_inv.to(torch.float32).repeat_interleave(block[0], 0)[:n]  # [N, ceil(K / bk)]
    whole = k // block[1] * block[1]
    out[:, :whole].view(n, k // block[1], block[1]).mul_(row_scales[:, :k // block[1], None])
    if whole < k:
        out[:, whole:].mul_(row_scales[:, -1:])
    return out


def quantize_per_token_group(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (fp8 [M, K], fp32 scales [M, ceil(K / group)]): one scale per token and group of ``group``
    features (the last group may be shorter), ``amax / 448``."""
    m, k = x.shape
    groups = -(-k // group)
    padded = torch.nn.functional.pad(x.to(torch.float32), (0, groups * group - k)).reshape(m, groups, group)
    scale = scale_from_amax(padded.abs().amax(dim=-1))
    return to_fp8(x, scale.repeat_interleave(group, 1)[:, :k]), scale


def block_gemm_reference(xq: torch.Tensor, x_scale: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                         block: Block, out_dtype: torch.dtype) -> torch.Tensor:
    """``dequant(xq) @ dequant(weight).T`` in fp32, the CPU path and the reference of the Triton block GEMM."""
    x = xq.to(torch.float32) * x_scale.repeat_interleave(block[1], 1)[:, :xq.shape[1]]
    return (x @ dequantize_blocks(weight, scale_inv, block).t()).to(out_dtype)

