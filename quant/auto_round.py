"""AutoRound checkpoints (Intel's ``auto-round``: ``quant_method: "auto-round"``), loaded as the layouts they pack.

AutoRound tunes the rounding of int weights, then packs them as an existing format names (``packing_format``):
``auto_round:auto_gptq`` (its default for symmetric schemes) holds GPTQ's ``qweight``/``qzeros``/``scales`` with v1
zero points (each stored less 1, clamped at 0, as AutoGPTQ packs them; :mod:`.gptq`), and ``auto_round:auto_awq``
(4-bit asymmetric ones) AutoAWQ's GEMM tensors (:mod:`.awq`). Which linears are quantized how, as vLLM reads it
(auto-round's own loader differs only for hand-written regex entries that reach layers outside the blocks):

1. an ``extra_config`` entry named exactly after the linear gives its ``bits``, ``group_size`` and ``sym``;
2. else the linear is quantized when its path starts with one of ``block_name_to_quantize`` (comma-separated, or a
   list; ``to_quant_block_names`` in older files), every linear but the head when there is none;
3. an ``extra_config`` key holding a regular-expression character that ``re.search`` finds in the path overrides
   the settings (the first such key in the file's order);
4. bits of 16 or more leave the linear in 16 bits.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from ..core.errors import CheckpointError
from . import awq
from .awq_method import AwqLinearMethod
from .common import bad_pattern, is_lm_head
from .gptq import BITS, GptqConfig, GptqScheme, parse_scheme

PACKINGS = {"auto_round:auto_gptq": "gptq", "auto_round:auto_awq": "awq"}
REGEX_CHARACTERS = set("*+?^$()[]{}|\\")
UNQUANTIZED_BITS = 16


@dataclass(frozen=True)
class AutoRoundConfig(GptqConfig):
    """A validated AutoRound config: the GPTQ view the loaders use (``scheme``, v1 ``zero_offset``) plus its rules:
    ``packing`` ("gptq" or "awq"), ``blocks`` (path prefixes; empty: every linear), ``exact`` and ``patterns``
    (``extra_config``'s entries by exact path and by regular expression, in the file's order, each with its scheme,
    None for a 16-bit linear)."""

    packing: str = "gptq"
    blocks: tuple[str, ...] = ()
    exact: tuple[tuple[str, GptqScheme | None], ...] = ()
    # (pattern, its scheme for a linear of the blocks, for one outside them: its own bits, else 16)
    patterns: tuple[tuple[str, GptqScheme | None, GptqScheme | None], ...] = ()

    def scheme_for(self, prefix: str) -> GptqScheme | None:
        exact = dict(self.exact)
        if prefix in exact:
            return exact[prefix]
        quantized = not is_lm_head(prefix) and (not self.blocks or any(prefix.startswith(b) for b in self.blocks))
        for pattern, inside, outside in self.patterns:
            if re.search(pattern, prefix):
                return inside if quantized else outside
        return self.scheme if quantized else None

    @property
    def schemes(self) -> list[GptqScheme]:
        found = [s for _, s in self.exact] + [s for _, inside, outside in self.patterns for s in (inside, outside)]
        return list(dict.fromkeys([self.scheme, *(s for s in found if s is not None)]))


def parse_auto_round(qc: dict[str, Any]) -> AutoRoundConfig:
    """Validate an AutoRound ``quantization_config`` (config.json's, as auto-round writes it)."""
    packing = str(qc.get("packing_format", "auto_round:auto_gptq"))
    if packing not in PACKINGS:
        raise CheckpointError(f"AutoRound packing_format {packing!r} is not one infer loads ({', '.join(PACKINGS)}); "
                              "export the model with auto-round's format='auto_round' (or 'auto_gptq', 'auto_awq')")
    base = _scheme(qc, "the AutoRound config")
    if base is None:
        raise CheckpointError(f"this AutoRound checkpoint's bits are {qc.get('bits')!r}, which leave every layer in "
                              "16 bits: load it unquantized (without --quant auto-round)")
    blocks = qc.get("block_name_to_quantize", qc.get("to_quant_block_names")) or ()
    blocks = tuple(blocks.split(",")) if isinstance(blocks, str) else blocks
    if not isinstance(blocks, tuple | list) or not all(isinstance(b, str) and b for b in blocks):
        raise CheckpointError(f"AutoRound block_name_to_quantize must be a name or a list of names, got {blocks!r}")
    extra = qc.get("extra_config") or {}
    if not isinstance(extra, dict) or not all(isinstance(v, dict) for v in extra.values()):
        raise CheckpointError(f"AutoRound extra_config must map module names to settings, got {extra!r}")
    keys = [key for key in extra if REGEX_CHARACTERS & set(key)]
    if why := bad_pattern(keys):
        raise CheckpointError(f"an AutoRound extra_config pattern: {why}")
    outside = {**qc, "bits": UNQUANTIZED_BITS, "group_size": -1}  # a pattern's defaults off the blocks
    config = AutoRoundConfig(
        base, 1, packing=PACKINGS[packing], blocks=tuple(b.strip() for b in blocks),
        exact=tuple((key, _scheme({**qc, **settings}, f"extra_config {key!r}")) for key, settings in extra.items()
                    if key not in keys),
        patterns=tuple((key, _scheme({**qc, **extra[key]}, f"extra_config {key!r}"),
                        _scheme({**outside, **extra[key]}, f"extra_config {key!r}")) for key in keys))
    if config.scheme_for("lm_head") is not None:
        raise CheckpointError("this AutoRound checkpoint quantizes lm_head, which infer does not load: use one "
                              "whose head is in 16 bits")
    if config.packing == "awq" and config.schemes != [base]:
        raise CheckpointError("this AutoRound checkpoint packs its layers as AWQ with settings of their own "
                              f"(extra_config), which infer's AWQ layers do not load (one {awq.BITS}-bit group size "
                              "per checkpoint); export it with format='auto_round:auto_gptq'")
    return config


def _scheme(settings: dict[str, Any], where: str) -> GptqScheme | None:
    """The scheme of ``settings`` (bits, group_size; weight-only ``int``): None for 16 bits or more."""
    bits = settings.get("bits")
    if type(bits) is int and bits >= UNQUANTIZED_BITS:
        return None
    if bits not in BITS or type(bits) is not int:
        raise CheckpointError(f"AutoRound bits must be 4 or 8 (or 16: unquantized), got {bits!r} in {where}: "
                              "infer runs 4- and 8-bit weights")
    if settings.get("data_type", "int") != "int":  # a layer's own, in a mixed-format checkpoint, too
        raise CheckpointError(f"AutoRound data_type {settings.get('data_type')!r} in {where} is not int, which "
                              "infer loads (its float and MX types are not)")
    if type(act_bits := settings.get("act_bits")) is int and act_bits < UNQUANTIZED_BITS:
        raise CheckpointError(f"AutoRound act_bits {act_bits} in {where}: infer loads weight-only AutoRound "
                              "checkpoints (act_bits 16)")
    return parse_scheme({**settings, "desc_act": False}, where, "AutoRound")  # its group size, as GPTQ's


class AutoRoundAwqMethod(AwqLinearMethod):
    """AutoRound's ``auto_round:auto_awq`` packing: AutoAWQ GEMM layers (one group size), quantized where the
    config's rules say."""

    name = "auto-round"

    def __init__(self, config: AutoRoundConfig, fused_max_rows: int = 64) -> None:
        super().__init__(config.scheme.group_size, fused_max_rows=fused_max_rows)
        self.config = config

    def applies_to(self, prefix: str) -> bool:
        return self.config.scheme_for(prefix) is not None
