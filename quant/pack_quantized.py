"""compressed-tensors' ``pack-quantized`` int weights: llm-compressor's W4A16 and W4A16_ASYM (GPTQ or RTN), and
W8A16. With 8 bits each int32 holds four 8-bit fields (bits 8i..8i+7), each code offset by 128 (the signed zero
point 0 reads 128); the rest is as below, which gives 4 bits.

Layout of one linear layer with ``in`` inputs, ``out`` outputs and groups of ``g`` inputs (``channel``: one group):

- ``weight_packed`` int32 [out, in / 8]: nibble ``i`` (bits 4i..4i+3) of word ``c`` of row ``n`` holds
  ``q[n, 8c + i] + 8`` (the signed int4 code, offset to 0..15).
- ``weight_scale`` [out, in / g] in the model dtype.
- ``weight_zero_point`` int32 [out / 8, in / g], asymmetric schemes only: packed along the output the same way;
  symmetric ones have a zero point of 0 (8 once offset).
- ``weight_g_idx`` int32 [in]: the group of each input, with activation order ``group`` only.
- ``weight_shape`` [2]: ``(out, in)``.

The weight is ``(q - z) * s``, which the offsets leave unchanged. Transposed, ``weight_packed`` and
``weight_zero_point`` are GPTQ's ``qweight`` and ``qzeros`` in the ``gptq_v2`` format (:mod:`.gptq`), which is how
infer loads them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError
from . import awq, fp8
from .common import bad_pattern, is_name_list, targeted_scheme
from .fp8 import Fp8Scheme, check_compressed_tensors

FORMAT = "pack-quantized"
BITS = (4, 8)


def _fail(message: str) -> CheckpointError:
    return CheckpointError(f"unsupported compressed-tensors checkpoint: {message}; infer loads pack-quantized int4 "
                           "and int8 weights (W4A16, W4A16_ASYM, W8A16: groups of 32/64/128, or per channel) with "
                           "unquantized activations")


@dataclass(frozen=True)
class PackQuantizedScheme:
    """How the linears of one compressed-tensors group are quantized: the weights' group size (-1: per channel),
    symmetry, activation order (``group``: each layer brings its weight_g_idx) and bits."""

    group_size: int
    symmetric: bool
    act_order: bool = False
    bits: int = 4


@dataclass(frozen=True)
class PackQuantizedConfig:
    """A validated compressed-tensors int4/int8 config: its (targets, scheme) groups, in the config's order, and
    its ``ignore`` list. A non-uniform checkpoint's float-quantized groups are here too, with their
    :class:`~.fp8.Fp8Scheme`."""

    groups: tuple[tuple[tuple[str, ...], PackQuantizedScheme | Fp8Scheme], ...]
    ignore: tuple[str, ...] = ()

    def scheme_for(self, prefix: str) -> PackQuantizedScheme | Fp8Scheme | None:
        """The scheme of the linear at ``prefix`` (compressed-tensors' precedence:
        :func:`.common.targeted_scheme`), or None when it is not quantized."""
        return targeted_scheme(prefix, self.groups, self.ignore)

    @property
    def schemes(self) -> list[PackQuantizedScheme | Fp8Scheme]:
        """The groups' schemes, each once: the int ones in the config's order, then the FP8 ones."""
        unique = dict.fromkeys(scheme for _, scheme in self.groups)
        return sorted(unique, key=lambda scheme: isinstance(scheme, Fp8Scheme))


def _weights(name: str, group: dict[str, Any]) -> PackQuantizedScheme:
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _fail(f"group {name!r} has no weights arguments")
    bits = weights.get("num_bits")
    if weights.get("type") != "int" or bits not in BITS or type(bits) is not int or weights.get("dynamic", False):
        raise _fail(f"group {name!r} weights are {weights.get('type')!r} with {bits!r} bits "
                    f"(dynamic={weights.get('dynamic', False)}), not static 4- or 8-bit int")
    strategy, size = weights.get("strategy"), weights.get("group_size")
    if strategy == "channel":
        size = -1
    elif strategy != "group" or not awq.is_group_size(size) or size == -1:
        raise _fail(f"group {name!r} weights use strategy {strategy!r} with group_size {size!r}")
    if group.get("input_activations") or group.get("output_activations"):
        raise _fail(f"group {name!r} quantizes activations too")
    return PackQuantizedScheme(size, bool(weights.get("symmetric", True)),
                               weights.get("actorder") == "group" and size != -1, bits)


def parse_pack_quantized(qc: dict[str, Any]) -> PackQuantizedConfig:
    """Validate a compressed-tensors ``quantization_config`` with ``pack-quantized`` int weight groups (each group its
    own scheme: W4A16 and W8A16 groups may mix), and in a non-uniform checkpoint float-quantized FP8 ones
    (:func:`.fp8.parse_group`)."""
    ignore = check_compressed_tensors(qc, _fail)
    groups = []
    for name, group in qc["config_groups"].items():
        group = group if isinstance(group, dict) else {}
        form = group.get("format") or qc.get("format")
        if form in fp8.FORMATS:
            groups.append(fp8.parse_group(name, group, qc.get("format")))
            continue
        if form != FORMAT:
            raise _fail(f"group {name!r} is {form!r}, neither pack-quantized nor float-quantized")
        scheme = _weights(name, group)
        names = group.get("targets") or []
        if not names or not is_name_list(names):
            raise _fail(f"group {name!r} needs a non-empty list of targets, got {names!r}")
        if why := bad_pattern(t[3:] for t in names if t.startswith("re:")):
            raise _fail(f"a target pattern of group {name!r}: {why}")
        groups.append((tuple(names), scheme))
    return PackQuantizedConfig(tuple(groups), ignore)
