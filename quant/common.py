"""Helpers shared by the quantized linear methods: load bookkeeping and module-name matching."""
from __future__ import annotations

import re
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch

from ..core.errors import CheckpointError

if TYPE_CHECKING:
    from ..core.interfaces import QuantMethod

Scheme = TypeVar("Scheme", bound=Hashable)

LOADED_ATTR = "_quant_loaded"  # per-layer set of the tensor names load_weight has filled
# the elements of a weight quantized at once: its fp32 (and int64, for packing) working copies stay a few MiB each
CHUNK_ELEMENTS = 1 << 22


def row_chunks(rows: int, columns: int, multiple: int = 1, elements: int = CHUNK_ELEMENTS) -> Iterator[slice]:
    """Consecutive slices covering ``rows`` rows of ``columns`` elements, each about ``elements`` elements and a
    multiple of ``multiple`` rows (at least ``multiple``), so that quantizing a large weight never holds working
    copies of all of it."""
    step = max(multiple, elements // max(columns, 1) // multiple * multiple)
    return (slice(start, min(start + step, rows)) for start in range(0, rows, step))


def layer_name(layer: torch.nn.Module) -> str:
    """The module path of ``layer`` (``Linear`` stores it as ``prefix``), for error messages."""
    return str(getattr(layer, "prefix", "") or type(layer).__name__)


def mark_loaded(layer: torch.nn.Module, name: str) -> None:
    """Record that tensor ``name`` of ``layer`` came from the checkpoint."""
    loaded: set[str] = layer.__dict__.setdefault(LOADED_ATTR, set())
    loaded.add(name)


def was_loaded(layer: torch.nn.Module, name: str) -> bool:
    """Whether tensor ``name`` of ``layer`` came from the checkpoint (:func:`mark_loaded`)."""
    return name in layer.__dict__.get(LOADED_ATTR, set())


def require_loaded(layer: torch.nn.Module, names: Iterable[str], method: str) -> None:
    """Raise CheckpointError naming the tensors of ``layer`` that the checkpoint never provided."""
    loaded: set[str] = layer.__dict__.get(LOADED_ATTR, set())
    missing = [n for n in names if n not in loaded]
    if missing:
        raise CheckpointError(
            f"the {method} checkpoint is missing {', '.join(missing)} for layer {layer_name(layer)!r}; "
            "the files are incomplete or were written for a different model or quantization format")


def deferred_weight(layer: torch.nn.Module, out_features: int, in_features: int, dtype: torch.dtype) -> None:
    """The float ``weight`` [out, in] of a layer that quantizes on load, as it loads (:func:`loaded_float_weight`):
    on the meta device, so that the float model is never held whole. A zero-size ``load_anchor`` buffer (not in
    the state dict) holds the device the quantized tensors go to: the model factory's device context, or wherever
    the layer was moved since (``Linear._apply`` moves the anchor, not the placeholder)."""
    layer.register_buffer("load_anchor", torch.empty(0), persistent=False)
    layer.weight = torch.nn.Parameter(torch.empty(out_features, in_features, dtype=dtype, device="meta"),
                                      requires_grad=False)


def loaded_float_weight(layer: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
    """Checkpoint ``tensor`` for a :func:`deferred_weight`: shape and float-ness checked, in the model dtype on the
    layer's device; the placeholder and the anchor are dropped (the caller registers the quantized tensors)."""
    from ..core.interfaces import check_float

    if getattr(layer, "load_anchor", None) is None:
        raise CheckpointError(f"{layer_name(layer)}.weight arrived twice; the checkpoint (or the model plugin's "
                              "loader) must give each weight once")
    check_tensor_shape(layer, "weight", tensor, tuple(layer.weight.shape))
    check_float(f"{layer_name(layer)}.weight", tensor)
    weight = tensor.to(layer.load_anchor.device, layer.weight.dtype)
    del layer.weight, layer.load_anchor
    return weight


def is_lm_head(prefix: str) -> bool:
    """Whether a module path names the output projection (never quantized by AWQ or by on-load FP8)."""
    return prefix.rsplit(".", 1)[-1] == "lm_head"


def matches_target(prefix: str, target: str) -> bool:
    """compressed-tensors matching: ``re:PATTERN`` is ``re.match`` on the module path, ``Linear`` matches every
    linear layer (the class name), anything else must equal the module path."""
    if target.startswith("re:"):
        return re.match(target[3:], prefix) is not None
    return target in ("Linear", prefix)


def targeted_scheme(prefix: str, groups: Iterable[tuple[Iterable[str], Scheme]], ignore: Iterable[str]
                    ) -> Scheme | None:
    """The scheme compressed-tensors gives the linear at ``prefix`` from its config's (targets, scheme) groups, or
    None when an ``ignore`` entry or no target matches it. Where several targets match, the library's precedence
    decides, whatever the groups' order: the exact module path, then ``re:`` patterns in sorted order, then the class
    name; a target in two groups is the later group's."""
    if any(matches_target(prefix, pattern) for pattern in ignore):
        return None
    by_target = {target: scheme for targets, scheme in groups for target in targets}
    matched = sorted((t for t in by_target if matches_target(prefix, t)),
                     key=lambda t: (0, t) if t == prefix else (1, t) if t.startswith("re:") else (2, t))
    return by_target[matched[0]] if matched else None


def is_name_list(value: object) -> bool:
    """Whether a quantization config's module list is a JSON list of strings."""
    return isinstance(value, list | tuple) and all(isinstance(item, str) for item in value)


def bad_pattern(patterns: Iterable[str], around: tuple[str, str] = ("", "")) -> str | None:
    """Why the first pattern that is no valid regular expression (placed between ``around``'s two strings, as its
    matcher uses it) fails to compile, quoting it; None if all compile."""
    for pattern in patterns:
        try:
            re.compile(f"{around[0]}{pattern}{around[1]}")
        except re.error as exc:
            return f"{pattern!r} is not a valid regular expression ({exc})"
    return None


def check_tensor_shape(layer: torch.nn.Module, name: str, tensor: torch.Tensor, shape: tuple[int, ...]) -> None:
    """Raise CheckpointError when a checkpoint tensor's shape differs from the one the layer expects."""
    if tuple(tensor.shape) != tuple(shape):
        raise CheckpointError(f"shape mismatch for {layer_name(layer)}.{name}: checkpoint {tuple(tensor.shape)}, "
                              f"model {tuple(shape)}")


class WeightOnlyApply:
    """The forward pass the weight-only methods (W4A16's :class:`~.awq_method.AwqLinearMethod`, W8A16's
    :class:`~.w8a16_method.W8A16LinearMethod`) share: on CUDA, batches of at most ``fused_max_rows`` rows run the
    method's fused GEMM (:meth:`fused_gemm`, which gathers an input order as it loads x); others multiply by the
    weight dequantized for that call (:meth:`dequantized`), never cached."""

    fused_max_rows: int

    def apply(self, layer: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return self.apply_ordered(layer, x, None)

    def runs_fused(self, x: torch.Tensor) -> bool:
        """Whether the fused Triton GEMM computes ``x`` [M, K]: on CUDA, for at most ``fused_max_rows`` rows."""
        return x.is_cuda and x.shape[0] <= self.fused_max_rows

    def apply_ordered(self, layer: torch.nn.Module, x: torch.Tensor, input_order: torch.Tensor | None
                      ) -> torch.Tensor:
        """``x[..., input_order] @ W (+ bias)``: the fused kernel gathers x's columns as it loads them, the other
        paths first."""
        x2 = x.reshape(-1, x.shape[-1])
        fused = self.runs_fused(x2)
        if input_order is not None and not fused:
            x2 = x2.index_select(-1, input_order)
        out = self.fused_gemm(layer, x2, input_order) if fused else x2 @ self.dequantized(layer, x2.dtype, x2.is_cuda)
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def fused_gemm(self, layer: torch.nn.Module, x: torch.Tensor, input_order: torch.Tensor | None) -> torch.Tensor:
        """``x[:, input_order] @ W`` for x [M, K] on CUDA, in one Triton kernel."""
        raise NotImplementedError

    def dequantized(self, layer: torch.nn.Module, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
        """The layer's weight [K, N] in ``dtype``: on CUDA by one Triton kernel, else in torch."""
        raise NotImplementedError


class SchemeVariants:
    """A QuantMethod mixin for checkpoints that quantize their linears by more than one scheme (GPTQModel's
    ``dynamic`` overrides, compressed-tensors groups of other bits or group sizes): :meth:`scheme_for` names each
    linear's scheme and ``variants`` holds one method per scheme (:func:`with_variants`), so that ``method_for``
    hands each linear its scheme's method, shared by the linears of that scheme."""

    variants: dict[Any, QuantMethod]

    def scheme_for(self, prefix: str) -> Hashable | None:
        """The scheme of the linear at module path ``prefix``; None leaves it unquantized."""
        raise NotImplementedError

    def applies_to(self, prefix: str) -> bool:
        return self.scheme_for(prefix) is not None

    def method_for(self, prefix: str) -> QuantMethod | None:
        scheme = self.scheme_for(prefix)
        return None if scheme is None else self.variants[scheme]


def with_variants(build: Callable[[Scheme], QuantMethod], schemes: Sequence[Scheme]) -> QuantMethod:
    """The method of ``schemes[0]`` (the checkpoint's main scheme), each scheme's method built once by ``build`` (a
    :class:`SchemeVariants`) and all of them sharing the ``variants`` that map every scheme to its method."""
    variants = {scheme: build(scheme) for scheme in dict.fromkeys(schemes)}
    for method in variants.values():
        if isinstance(method, SchemeVariants):  # build may hand out another kind of method for some schemes
            method.variants = variants
    return variants[schemes[0]]
