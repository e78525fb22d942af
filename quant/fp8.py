"""FP8 (e4m3) formats: scale-and-round helpers, and the compressed-tensors ``float-quantized`` checkpoint config.

A tensor ``t`` is stored as ``t_fp8 = fp8(clamp(t / s, -448, 448))`` (the cast rounds to nearest even) with
``s = amax / 448`` over the scale's extent: the whole tensor, one output channel (weights) or one token
(activations). It reads back as ``t_fp8 * s``.
"""
from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import torch

from ..core.errors import CheckpointError, ConfigError
from .common import CHUNK_ELEMENTS, bad_pattern, is_name_list, row_chunks, targeted_scheme

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
MIN_AMAX = 1e-12  # an all-zero row still gets a positive scale

WEIGHT_STRATEGIES = ("tensor", "channel")
FORMATS = ("float-quantized", "naive-quantized")


def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """fp32 scale that maps ``amax`` to the largest e4m3 value."""
    return amax.to(torch.float32).clamp(min=MIN_AMAX) / FP8_MAX


def to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``fp8(clamp(t / scale, -448, 448))``, dividing in fp32; ``scale`` broadcasts against ``t``."""
    return (t.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_channel(weight: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS,
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [out, in] -> (fp8 [out, in], fp32 scales [out]) with one scale per output channel."""
    codes = torch.empty(weight.shape, dtype=FP8_DTYPE, device=weight.device)
    scales = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    quantize_per_channel_into(codes, scales, weight, chunk_elements)
    return codes, scales


def quantize_per_channel_into(codes: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor,
                              chunk_elements: int = CHUNK_ELEMENTS) -> None:
    """:func:`quantize_weight_per_channel` into existing fp8 ``codes`` [out, in] and fp32 ``scales`` [out], on
    about ``chunk_elements`` weights at a time, so the fp32 working copies stay small whatever the weight's size."""
    for rows in row_chunks(weight.shape[0], weight.shape[1], elements=chunk_elements):
        part = weight[rows]
        scale = scale_from_amax(part.abs().amax(dim=1))
        codes[rows] = to_fp8(part, scale.unsqueeze(1))
        scales[rows] = scale


def quantize_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` [M, K] -> (fp8 [M, K], fp32 scales [M]): the dynamic per-token activation quantization."""
    scale = scale_from_amax(x.abs().amax(dim=-1))
    return to_fp8(x, scale.unsqueeze(-1)), scale


def dequantize(t_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 ``t_fp8 * scale``; ``scale`` is [rows], [1] or a scalar (one per row or one for all)."""
    s = scale.to(torch.float32).reshape(-1, *([1] * (t_fp8.dim() - 1))) if scale.numel() > 1 else \
        scale.to(torch.float32).reshape(())
    return t_fp8.to(torch.float32) * s


@dataclass(frozen=True)
class Fp8Scheme:
    """How one group of linears is quantized. ``act_strategy`` None means weight-only (activations unquantized)."""

    weight_strategy: str  # "tensor" | "channel"
    act_strategy: str | None  # "tensor" | "token" | None
    act_dynamic: bool = True

    @property
    def static_input(self) -> bool:
        return self.act_strategy is not None and not self.act_dynamic


DYNAMIC = Fp8Scheme("channel", "token", True)  # FP8_DYNAMIC, and what on-load quantization produces
STATIC = Fp8Scheme("tensor", "tensor", False)  # the FP8 preset


@dataclass(frozen=True)
class Fp8CheckpointConfig:
    """A validated compressed-tensors FP8 config: (targets, scheme) groups and the ``ignore`` list."""

    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, prefix: str) -> Fp8Scheme | None:
        """The scheme of the linear at ``prefix`` (compressed-tensors' precedence: :func:`.common.targeted_scheme`),
        or None when it is ignored or targeted by no group."""
        return targeted_scheme(prefix, self.groups, self.ignore)


def _fail(message: str) -> CheckpointError:
    return CheckpointError(f"unsupported compressed-tensors checkpoint: {message}; infer loads the FP8 "
                           "(static per-tensor) and FP8_DYNAMIC (per-channel weights, dynamic per-token activations) "
                           "float-quantized schemes")


def _parse_args(args: Any, what: str) -> dict[str, Any]:
    if not isinstance(args, dict):
        raise _fail(f"{what} must be an object, got {args!r}")
    if args.get("type", "float") != "float" or args.get("num_bits", 8) != 8:
        raise _fail(f"{what} are {args.get('type')!r} with {args.get('num_bits')!r} bits, not 8-bit float")
    if args.get("symmetric", True) is not True:
        raise _fail(f"{what} are asymmetric")
    return args


def parse_group(name: str, group: dict[str, Any], default_format: str | None) -> tuple[tuple[str, ...], Fp8Scheme]:
    """One float-quantized compressed-tensors group: its targets and scheme."""
    fmt = group.get("format") or default_format
    if fmt not in FORMATS:
        raise _fail(f"group {name!r} has format {fmt!r}, not 'float-quantized'")
    weights = _parse_args(group.get("weights"), f"group {name!r} weights")
    w_strategy = weights.get("strategy")
    if w_strategy not in WEIGHT_STRATEGIES or weights.get("dynamic", False):
        raise _fail(f"group {name!r} weights use strategy {w_strategy!r} (dynamic={weights.get('dynamic')}); "
                    "static 'tensor' or 'channel' weights are supported")
    if group.get("output_activations"):
        raise _fail(f"group {name!r} quantizes output activations")
    acts = group.get("input_activations")
    if acts is None:
        scheme = Fp8Scheme(w_strategy, None)
    else:
        acts = _parse_args(acts, f"group {name!r} input_activations")
        a_strategy, dynamic = acts.get("strategy"), bool(acts.get("dynamic", False))
        if not ((a_strategy == "tensor") or (a_strategy == "token" and dynamic)):
            raise _fail(f"group {name!r} input activations use strategy {a_strategy!r} with dynamic={dynamic}; "
                        "supported: 'tensor' (static or dynamic) and dynamic 'token'")
        scheme = Fp8Scheme(w_strategy, a_strategy, dynamic)
    targets = group.get("targets") or []
    if not targets or not is_name_list(targets):
        raise _fail(f"group {name!r} needs a non-empty list of targets, got {targets!r}")
    if why := bad_pattern(target[3:] for target in targets if target.startswith("re:")):
        raise _fail(f"a target pattern of group {name!r}: {why}")
    return tuple(targets), scheme


OFFLINE_TRANSFORMS = ("weight_input", "weight_output")  # fused into the stored weights: nothing left to apply


def online_transforms(transform_config: object) -> list[str]:
    """The run-time locations (input, output, k_cache, q_attn) of a compressed-tensors ``transform_config``'s
    rotations, sorted; a transform_config that is not the library's shape counts as one ('unreadable')."""
    if not transform_config:
        return []
    groups = transform_config.get("config_groups") if isinstance(transform_config, dict) else None
    if not isinstance(groups, dict):
        return ["(an unreadable transform_config)"]
    locations = set()
    for group in groups.values():
        applied = group.get("apply") if isinstance(group, dict) else None
        if not isinstance(applied, list):
            return ["(an unreadable transform_config)"]
        for entry in applied:
            location = entry.get("location") if isinstance(entry, dict) else None
            if location not in OFFLINE_TRANSFORMS:
                locations.add(str(location))
    return sorted(locations)


def group_formats(qc: dict[str, Any]) -> set[str]:
    """The formats of a compressed-tensors config's groups (a group's own, else the config's ``format``)."""
    groups = qc.get("config_groups")
    return {str(g.get("format") or qc.get("format")) for g in groups.values() if isinstance(g, dict)} \
        if isinstance(groups, dict) else set()


def parse_compressed_tensors(qc: dict[str, Any]) -> Fp8CheckpointConfig:
    """Validate a compressed-tensors ``quantization_config`` holding FP8 ``float-quantized`` groups."""
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise ConfigError(
            f"--quant fp8 was given, but the checkpoint is quantized with {method!r}; infer's fp8 method loads "
            "compressed-tensors FP8 checkpoints or quantizes unquantized ones. Drop --quant to use the "
            "checkpoint's own method")
    ignore = check_compressed_tensors(qc, _fail)
    parsed = tuple(parse_group(name, g if isinstance(g, dict) else {}, qc.get("format"))
                   for name, g in qc["config_groups"].items())
    return Fp8CheckpointConfig(parsed, ignore)


def check_compressed_tensors(qc: dict[str, Any], fail: Callable[[str], CheckpointError]) -> tuple[str, ...]:
    """The checks of every compressed-tensors config infer loads (compressed, dense, no run-time rotation, some
    config_groups, a valid ignore list, raised as ``fail(reason)``); returns the ignore list."""
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise fail(f"quantization_status is {status!r}; save the model compressed (the quantized weights stored)")
    if qc.get("sparsity_config"):
        raise fail("the checkpoint is sparse (sparsity_config is set)")
    if online := online_transforms(qc.get("transform_config")):
        raise fail(f"its transform_config rotates {', '.join(online)} at run time (QuIP/SpinQuant-style), which "
                   "infer does not apply: without the rotation the model computes garbage")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise fail("config_groups is missing or empty")
    ignore = qc.get("ignore") or []
    if not is_name_list(ignore):
        raise fail(f"ignore must be a list of module names or 're:' patterns, got {ignore!r}")
    if why := bad_pattern(name[3:] for name in ignore if name.startswith("re:")):
        raise fail(f"an ignore pattern: {why}")
    return tuple(ignore)
