"""The AutoAWQ GEMM checkpoint format: int4 packing, round-to-nearest quantization, dequantization, config checks.

Layout of one linear layer with ``in`` inputs, ``out`` outputs and groups of ``g`` input rows:

- ``qweight`` int32 [in, out / 8]: eight 4-bit weights per int32.
- ``qzeros``  int32 [in / g, out / 8]: the zero points, packed the same way.
- ``scales``  fp16  [in / g, out].

Nibble ``i`` (bits 4i..4i+3) of packed column ``c`` holds output column ``c * 8 + AWQ_ORDER[i]``, and the weight
of input row ``k``, output column ``n`` is ``(q[k, n] - z[k // g, n]) * s[k // g, n]``. Everything here works on
the [in, out] orientation of the checkpoint; ``torch.nn.Linear`` weights are its transpose.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import CheckpointError, ConfigError
from . import AWQ_GROUP_SIZES
from .common import CHUNK_ELEMENTS, is_name_list, row_chunks

BITS = 4
PACK = 32 // BITS  # int4 values per int32
MAX_Q = 2**BITS - 1
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i holds column AWQ_ORDER[i] of its group of 8
AWQ_INVERSE = (0, 4, 1, 5, 2, 6, 3, 7)  # column j sits in nibble AWQ_INVERSE[j]
GROUP_SIZES = AWQ_GROUP_SIZES


def is_group_size(value: object) -> bool:
    """An int in GROUP_SIZES: 128.0 or True would pass ``in`` and fail later, inside a reshape."""
    return type(value) is int and value in GROUP_SIZES
SUPPORTED_VERSION = "gemm"


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """Pack int4 values [rows, cols] (each 0..15, any integer dtype) into int32 [rows, cols / 8] in AWQ order."""
    if values.dim() != 2 or values.shape[1] % PACK:
        raise ValueError(f"pack_int4 needs a 2-D tensor whose last dim is a multiple of {PACK}, "
                         f"got {tuple(values.shape)}")
    v = values.to(torch.int64)
    if v.numel() and (int(v.min()) < 0 or int(v.max()) > MAX_Q):
        raise ValueError("pack_int4 values must lie in [0, 15]")
    v = v.reshape(v.shape[0], -1, PACK)[:, :, list(AWQ_ORDER)]  # [rows, cols / 8, nibble]
    shifts = torch.arange(0, 32, BITS, device=v.device, dtype=torch.int64)
    packed = (v << shifts).sum(dim=-1)  # < 2**32, exact in int64
    packed = torch.where(packed >= 2**31, packed - 2**32, packed)  # reinterpret as two's-complement int32
    return packed.to(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`pack_int4`: int32 [rows, cols / 8] -> int32 [rows, cols] with values 0..15."""
    if packed.dtype != torch.int32 or packed.dim() != 2:
        raise ValueError(f"unpack_int4 needs a 2-D int32 tensor, got {packed.dtype} {tuple(packed.shape)}")
    # column j of a group of 8 sits in nibble AWQ_INVERSE[j] = (j >> 1) + 4 * (j & 1); computed on the device, with
    # no index list from the host, so that it can run inside CUDA graph capture
    j = torch.arange(PACK, device=packed.device, dtype=torch.int32)
    shifts = BITS * ((j >> 1) + 4 * (j & 1))
    columns = (packed.unsqueeze(-1) >> shifts) & MAX_Q  # [rows, cols / 8, column]; & drops the sign extension
    return columns.reshape(packed.shape[0], -1)


def round_up_to_fp16(x: torch.Tensor) -> torch.Tensor:
    """Positive fp32 -> the nearest fp16 that is >= x, so a scale never shrinks the representable range."""
    h = x.to(torch.float16)
    below = h.to(torch.float32) < x
    # for positive finite halves, the next representable value up is the next bit pattern
    h = torch.where(below, (h.view(torch.int16) + 1).view(torch.float16), h)
    if bool(torch.isinf(h).any()):
        raise CheckpointError("a weight group's range overflows the fp16 AWQ scales (|w| > ~1e6); "
                              "this checkpoint cannot be stored in the AWQ format, use --quant fp8 instead")
    return h


def quantize_rtn(weight: torch.Tensor, group_size: int, chunk_elements: int = CHUNK_ELEMENTS,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest asymmetric int4 quantization of ``weight`` [out, in] -> (qweight, qzeros, scales).

    Per group of ``group_size`` input columns (-1: one group over all of them) of one output row, as AutoAWQ
    does: ``s = (max - min) / 15``, ``z = -round(min / s)``, ``q = clamp(round(w / s) + z, 0, 15)``. Two
    deliberate differences keep every weight within ``s / 2`` of its dequantized value: the range is widened to
    include 0 (as GPTQ and compressed-tensors do), and ``s`` is rounded *up* to fp16 before ``q`` and ``z`` are
    computed from it. The arithmetic is in fp32 whatever the weight's dtype, on about ``chunk_elements`` weights
    (a multiple of 8 output rows) at a time, so the working copies stay small whatever the weight's size.
    """
    out_features, in_features = weight.shape
    group = check_shapes(in_features, out_features, group_size)
    device = weight.device
    qweight = torch.empty(in_features, out_features // PACK, dtype=torch.int32, device=device)
    qzeros = torch.empty(in_features // group, out_features // PACK, dtype=torch.int32, device=device)
    scales = torch.empty(in_features // group, out_features, dtype=torch.float16, device=device)
    for rows in row_chunks(out_features, in_features, PACK, chunk_elements):
        packed = slice(rows.start // PACK, rows.stop // PACK)
        q, zeros, chunk_scales = _rtn(weight[rows], group_size)
        qweight[:, packed] = pack_int4(q.reshape(-1, in_features).t().to(torch.int32))  # [in, rows]
        qzeros[:, packed] = pack_int4(zeros.t().to(torch.int32))
        scales[:, rows] = chunk_scales.t()
    return qweight, qzeros, scales


def fake_quantize_rtn(weight: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` [out, in] -> fp32 ``(q - z) * s`` [out, in]: what :func:`quantize_rtn` then :func:`dequantize`
    give (transposed), without packing. The AWQ scale search calls it once per grid point."""
    q, zeros, scales = _rtn(weight, group_size)
    return ((q - zeros.unsqueeze(-1)) * scales.to(torch.float32).unsqueeze(-1)).reshape(weight.shape)


def _rtn(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The arithmetic of :func:`quantize_rtn`: fp32 q [out, in / g, g], zeros [out, in / g], fp16 scales."""
    out_features, in_features = weight.shape
    group = check_shapes(in_features, out_features, group_size)
    w = weight.detach().to(torch.float32).reshape(out_features, in_features // group, group)
    w_max = w.amax(dim=-1).clamp(min=0)
    w_min = w.amin(dim=-1).clamp(max=0)
    scales = round_up_to_fp16((w_max - w_min).clamp(min=1e-5) / MAX_Q)  # [out, in / g]
    s = scales.to(torch.float32)
    zeros = (-torch.round(w_min / s)).clamp(0, MAX_Q)
    q = (torch.round(w / s.unsqueeze(-1)) + zeros.unsqueeze(-1)).clamp(0, MAX_Q)
    return q, zeros, scales


def dequantize(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group_size: int,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """Unpack an AWQ GEMM layer to its weight, oriented [in, out] (the checkpoint's; ``nn.Linear`` uses [out, in]).

    Computed in fp32, where ``(q - z) * s`` is exact, then rounded once to ``dtype`` (default: the scales' dtype).
    In fp16 the result equals AutoAWQ's ``dequantize_gemm`` bit for bit.
    """
    in_features = qweight.shape[0]
    out_features = qweight.shape[1] * PACK
    group = in_features if group_size == -1 else group_size
    groups = in_features // group
    if in_features % group or qzeros.shape != (groups, qweight.shape[1]) or scales.shape != (groups, out_features):
        raise CheckpointError(
            f"inconsistent AWQ tensors for group_size {group_size}: qweight {tuple(qweight.shape)}, qzeros "
            f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)}; expected qzeros ({groups}, {qweight.shape[1]}) "
            f"and scales ({groups}, {out_features})")
    q = unpack_int4(qweight).reshape(groups, group, out_features)
    z = unpack_int4(qzeros).unsqueeze(1)
    w = (q - z).to(torch.float32) * scales.to(torch.float32).unsqueeze(1)
    return w.reshape(in_features, out_features).to(dtype or scales.dtype)


def check_shapes(in_features: int, out_features: int, group_size: int, prefix: str = "",
                 checkpoint: bool = False) -> int:
    """Check a layer fits the AWQ GEMM layout; return the effective group size (``in_features`` for -1).
    ``checkpoint``: the group size comes from a quantized checkpoint's config (the advice differs)."""
    where = f" for layer {prefix!r}" if prefix else ""
    group = in_features if group_size == -1 else group_size
    if group <= 0 or in_features % group:
        todo = ("the checkpoint does not fit its own config.json (a wrong quantization_config.group_size, or the "
                "config.json of another model)") if checkpoint else (
            f"use a group size that divides every layer's input size "
            f"({', '.join(str(g) for g in GROUP_SIZES if g > 0)}), or -1 for one group over the whole input")
        raise CheckpointError(f"AWQ group_size {group_size} does not divide in_features {in_features}{where}; {todo}")
    if out_features % PACK:
        todo = ("list the module in quantization_config.modules_to_not_convert if the checkpoint keeps it "
                "unquantized") if checkpoint else ("AWQ cannot quantize this model; load it unquantized with "
                                                   "`infer --quant fp8 ...` instead")
        raise CheckpointError(f"AWQ packs {PACK} output columns per int32, so it needs out_features divisible by "
                              f"{PACK}, got {out_features}{where}; {todo}")
    return group


@dataclass(frozen=True)
class AwqConfig:
    """A validated AutoAWQ ``quantization_config``."""

    group_size: int = 128
    modules_to_not_convert: tuple[str, ...] = field(default_factory=tuple)
    zero_point: bool = True  # False: symmetric, every stored zero point the midpoint 8 (AutoRound's auto_awq export)


def parse_config(qc: dict[str, Any]) -> AwqConfig:
    """Validate a checkpoint's ``quantization_config`` (config.json spelling, or AutoAWQ's quant_config.json one)."""
    method = str(qc.get("quant_method", "awq")).lower()
    if method != "awq":
        raise ConfigError(
            f"--quant awq was given, but the checkpoint is quantized with {method!r}; drop --quant to use the "
            "checkpoint's own method, or start from an unquantized checkpoint")
    version = str(qc.get("version", SUPPORTED_VERSION)).lower()
    if version == "gemv":
        raise CheckpointError(
            "this AWQ checkpoint uses the 'gemv' layout, which infer does not support; re-export it in the GEMM "
            "format (AutoAWQ: quant_config={'version': 'GEMM', ...}) or quantize with `infer quantize --method awq`")
    if version != SUPPORTED_VERSION:
        raise CheckpointError(
            f"unsupported AWQ version {version!r}; infer loads only 'gemm' checkpoints: re-export in the GEMM format")
    bits = qc.get("bits", qc.get("w_bit"))
    if bits != BITS:
        raise CheckpointError(f"AWQ bits must be {BITS}, got {bits!r}; only 4-bit AWQ checkpoints are supported")
    group_size = qc.get("group_size", qc.get("q_group_size"))
    if not is_group_size(group_size):
        raise CheckpointError(
            f"AWQ group_size must be one of {', '.join(map(str, GROUP_SIZES))}, got {group_size!r}")
    if type(qc.get("zero_point", True)) is not bool:  # false: AutoRound's symmetric export, qzeros stored all the same
        raise CheckpointError(f"AWQ zero_point must be true or false, got {qc['zero_point']!r}")
    skip = qc.get("modules_to_not_convert") or ()
    if not is_name_list(skip):
        raise CheckpointError(f"AWQ modules_to_not_convert must be a list of module names, got {skip!r}")
    return AwqConfig(group_size=group_size, modules_to_not_convert=tuple(skip), zero_point=qc.get("zero_point", True))
