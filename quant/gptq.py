"""The GPTQ checkpoint format (AutoGPTQ, GPTQModel, optimum): config checks, and its repacking into the AWQ layout.

8-bit checkpoints load as :mod:`.w8a16` layers instead (:func:`.w8a16.from_gptq`); the rest of this docstring is
about 4 bits.

Layout of one linear layer with ``in`` inputs, ``out`` outputs and groups of ``g`` input rows (4 bits):

- ``qweight`` int32 [in / 8, out]: packed along the *input*: nibble ``i`` (bits 4i..4i+3) of row ``r`` holds the
  weight of input row ``8r + i``.
- ``qzeros``  int32 [in / g, out / 8]: packed along the output: nibble ``i`` of column ``c`` holds output column
  ``8c + i`` (no AWQ interleave).
- ``scales``  fp16  [in / g, out].
- ``g_idx``   int32 [in]: the group of each input row; ``k // g`` unless the checkpoint was quantized in
  activation order (``desc_act``), where the rows of a group are scattered over the input.

The weight of input row ``k``, output column ``n`` is ``(q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]``, where the
``checkpoint_format`` ``gptq_v2`` stores ``z`` in ``qzeros`` and ``gptq`` (v1, AutoGPTQ's, and what GPTQModel saves by
default) ``z - 1``: GPTQModel subtracts 0x11111111 from each whole word, so a zero point of 0 borrows from the next
nibble, and transformers reads v1 back by adding it to the whole word, as infer does. (AutoGPTQ's own packing of a
zero point of 0 also sets every higher nibble of its word to 15; read so, those become 0 and 1s.)

infer runs such a layer as an AWQ one (the same W4A16 kernels): ``q`` and ``z`` are repacked into :mod:`.awq`'s
layout, and in activation order the input rows are sorted by group, so that each group's rows become consecutive,
with the layer's input permuted the same way at run time (``x[:, order] @ W[order]``).
"""
from __future__ import annotations

import re
import sys
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.errors import CheckpointError, ConfigError
from . import awq
from .common import CHUNK_ELEMENTS, bad_pattern, is_lm_head, is_name_list, row_chunks

BITS = (4, 8)
FORMATS = {"gptq": 1, "gptq_v2": 0}  # checkpoint_format -> what qzeros' nibbles lack of the zero point
V1_WORD_OFFSET = 0x11111111  # added to each v1 qzeros word, in wrapping 32-bit arithmetic, gives v2's


@dataclass(frozen=True)
class GptqScheme:
    """How one linear is quantized: ``bits`` 4 or 8 (8: :mod:`.w8a16`, whose module docstring gives the byte layout;
    the rest of this one holds with 4 values per int32 instead of 8, and v1 zero points offset by 0x01010101),
    ``group_size`` (-1: one group) and ``act_order``: the config says ``desc_act``, so the layer must bring its
    ``g_idx``."""

    bits: int = 4
    group_size: int = 128
    act_order: bool = False


@dataclass(frozen=True)
class GptqConfig:
    """A validated GPTQ ``quantization_config``: its ``scheme``, the format's ``zero_offset``, and which linears are
    quantized how. ``modules_in_block_to_quantize``: the linears of each decoder layer that are quantized, by their
    path inside the layer (``self_attn.q_proj``, matched as the end of the module path after a dot: optimum matches
    any ending, so ``proj`` would name every projection there, none here); empty: all of them. ``dynamic``:
    GPTQModel's per-module overrides, in the config's order, as (regular expression ``re.match``-ed on the module
    path, its scheme; None for a ``-:`` exclusion)."""

    scheme: GptqScheme = field(default_factory=GptqScheme)
    zero_offset: int = 1
    modules_in_block_to_quantize: tuple[str, ...] = ()
    dynamic: tuple[tuple[str, GptqScheme | None], ...] = ()

    def scheme_for(self, prefix: str) -> GptqScheme | None:
        """The scheme of the linear at ``prefix``: None for the output head (never quantized), a linear outside
        ``modules_in_block_to_quantize`` or one excluded by ``dynamic``; else the first matching override's, as
        GPTQModel (and vLLM) resolve them, or the config's own."""
        blocks = self.modules_in_block_to_quantize
        if is_lm_head(prefix) or blocks and not any(prefix.endswith(f".{b}") for b in blocks):
            return None
        return next((scheme for pattern, scheme in self.dynamic if re.match(pattern, prefix)), self.scheme)

    @property
    def schemes(self) -> list[GptqScheme]:
        """The config's own scheme, then its overrides' others."""
        return list(dict.fromkeys([self.scheme, *(s for _, s in self.dynamic if s is not None)]))


def parse_config(qc: dict[str, Any]) -> GptqConfig:
    """Validate a checkpoint's GPTQ ``quantization_config`` (config.json's, as transformers and GPTQModel write it)."""
    method = str(qc.get("quant_method", "gptq")).lower()
    if method != "gptq":
        raise ConfigError(f"--quant gptq was given, but the checkpoint is quantized with {method!r}; drop --quant "
                              "to use the checkpoint's own method")
    # config.json's field is checkpoint_format; GPTQModel also writes format, and older AutoGPTQ is_marlin_format
    named = {str(qc[key]).lower() for key in ("checkpoint_format", "format") if qc.get(key)}
    if len(named) > 1:
        raise CheckpointError(f"the GPTQ config's checkpoint_format and format disagree ({' and '.join(sorted(named))})"
                              ": transformers reads the first, GPTQModel the second; correct config.json")
    form = "marlin" if qc.get("is_marlin_format") else named.pop() if named else "gptq"
    if form not in FORMATS:
        raise CheckpointError(f"GPTQ checkpoint_format {form!r} is not one infer loads ({', '.join(FORMATS)}): the "
                              "others are kernel-specific repackings; save the model in the gptq format")
    if qc.get("lm_head") is True:
        raise CheckpointError("this GPTQ checkpoint quantizes lm_head, which infer does not load (transformers and "
                              "AutoGPTQ keep the head in 16 bits): use a checkpoint whose head is not quantized")
    if str(qc.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
        raise CheckpointError(f"GPTQ pack_dtype {qc['pack_dtype']!r} is not int32, the packing infer loads; save the "
                              "model with pack_dtype int32")
    blocks = qc.get("modules_in_block_to_quantize") or []
    if not isinstance(blocks, list) or not all(is_name_list(names) for names in blocks):
        raise CheckpointError("GPTQ modules_in_block_to_quantize must be a list of lists of module names "
                              f"(e.g. [[\"self_attn.q_proj\"]]), got {blocks!r}")
    return GptqConfig(parse_scheme(qc, "the GPTQ config"), FORMATS[form],
                      tuple(name for names in blocks for name in names), parse_dynamic(qc.get("dynamic"), qc))


def parse_scheme(qc: dict[str, Any], where: str, method: str = "GPTQ") -> GptqScheme:
    """The bits, group_size and desc_act of a GPTQ config (or of a ``dynamic`` override merged into it; or of another
    ``method``'s config that packs GPTQ's layout)."""
    bits = qc.get("bits")
    if bits not in BITS or type(bits) is not int:
        raise CheckpointError(f"{method} bits must be 4 or 8, got {bits!r} in {where}: infer runs 4-bit GPTQ "
                              "checkpoints on its W4A16 kernels and 8-bit ones on its W8A16 kernels")
    group_size = qc.get("group_size")
    if not awq.is_group_size(group_size):
        raise CheckpointError(f"{method} group_size must be one of {', '.join(map(str, awq.GROUP_SIZES))} for "
                              f"infer's kernels, got {group_size!r} in {where}")
    return GptqScheme(bits, group_size, qc.get("desc_act") is True and group_size != -1)


# a dynamic override may not change these (read once for the checkpoint); besides bits, group_size, desc_act and
# sym, its other keys steer calibration only (damp_percent, mse, ...) and change nothing infer reads
LAYOUT_KEYS = ("quant_method", "checkpoint_format", "format", "pack_dtype", "lm_head")


def parse_dynamic(dynamic: object, qc: dict[str, Any]) -> tuple[tuple[str, GptqScheme | None], ...]:
    """GPTQModel's ``dynamic``: ``-:PATTERN`` keys exclude the modules they match, other keys (``+:PATTERN`` or
    ``PATTERN``) give them the config with the key's overrides (bits, group_size, desc_act; sym, which the stored
    zero points make moot). Each override keeps the checkpoint's format: one that changes it is refused."""
    if not dynamic:
        return ()
    if not isinstance(dynamic, dict):
        raise CheckpointError(f"GPTQ dynamic must be an object of module patterns, got {dynamic!r}")
    rules: list[tuple[str, GptqScheme | None]] = []
    for key, overrides in dynamic.items():
        key = str(key)
        if key.startswith("-:"):
            rules.append((key[2:], None))
            continue
        if not isinstance(overrides, dict):
            raise CheckpointError(f"GPTQ dynamic {key!r} must map to an object of overrides, got {overrides!r}")
        if changed := [name for name in LAYOUT_KEYS if name in overrides and not _same_layout(name, overrides, qc)]:
            raise CheckpointError(f"GPTQ dynamic {key!r} changes {', '.join(changed)}, which infer reads once for the "
                                  "whole checkpoint: use one without such overrides")
        if "sym" in overrides and type(overrides["sym"]) is not bool:
            raise CheckpointError(f"GPTQ dynamic {key!r} gives sym {overrides['sym']!r}, not true or false")
        rules.append((key.removeprefix("+:"), parse_scheme({**qc, **overrides}, f"dynamic {key!r}")))
    if why := bad_pattern(pattern for pattern, _ in rules):
        raise CheckpointError(f"a GPTQ dynamic pattern: {why}")
    return tuple(rules)


def _same_layout(name: str, overrides: dict[str, Any], qc: dict[str, Any]) -> bool:
    """Whether a dynamic override's layout key ``name`` restates the config's: the format by either of its two
    keys (GPTQModel writes ``format``, transformers ``checkpoint_format``), the rest as given."""
    if name in ("format", "checkpoint_format"):
        given = {str(qc[key]).lower() for key in ("checkpoint_format", "format") if qc.get(key)} or {"gptq"}
        return str(overrides[name]).lower() in given
    return bool(overrides[name] == qc.get(name))


def repack_rows(qweight: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """GPTQ ``qweight`` int32 [in / 8, cols] (cols a multiple of 8) -> AWQ's int32 [in, cols / 8], its input rows
    taken in ``order`` (None: as they are). Works on the nibbles as bytes (little-endian words: byte ``j`` holds
    nibbles ``2j`` and ``2j + 1``), a few passes over half a byte per weight."""
    if sys.byteorder != "little" and qweight.device.type == "cpu":  # GPUs are little-endian
        raise CheckpointError("infer repacks GPTQ weights as little-endian bytes, and this CPU is big-endian")
    words, cols = qweight.shape
    as_bytes = qweight.contiguous().view(torch.uint8).view(words, cols, 4)
    nibbles = torch.stack((as_bytes & awq.MAX_Q, as_bytes >> awq.BITS), dim=-1).view(words, cols, awq.PACK)
    q = nibbles.permute(0, 2, 1).reshape(words * awq.PACK, cols)  # [in, cols]: row 8r + i is nibble i of word r
    if order is not None:
        q = q[order]
    q = q.view(-1, cols // awq.PACK, awq.PACK)[..., list(awq.AWQ_ORDER)]  # nibble j: column AWQ_ORDER[j]
    packed = q[..., 0::2] | (q[..., 1::2] << awq.BITS)  # [in, cols / 8, 4] bytes
    return packed.contiguous().view(torch.int32).view(-1, cols // awq.PACK)


def unpack_columns(qzeros: torch.Tensor) -> torch.Tensor:
    """GPTQ ``qzeros`` int32 [rows, out / 8] -> int32 [rows, out], values 0..15 (column ``8c + i``: nibble ``i``)."""
    shifts = torch.arange(0, 32, awq.BITS, device=qzeros.device, dtype=torch.int32)
    return ((qzeros.unsqueeze(-1) >> shifts) & awq.MAX_Q).reshape(qzeros.shape[0], -1)


def input_order(g_idx: torch.Tensor, group: int, prefix: str) -> torch.Tensor | None:
    """None when ``g_idx`` is ``k // group`` (no activation order); else the permutation of the input rows that
    sorts them by group (stable). Every group must hold exactly ``group`` rows, as GPTQ's activation order makes."""
    in_features = g_idx.shape[0]
    groups = in_features // group
    g = g_idx.to(torch.int64)
    if g.numel() and (int(g.min()) < 0 or int(g.max()) >= groups):
        raise CheckpointError(f"{prefix}.g_idx names groups outside 0..{groups - 1}: the checkpoint does not fit its "
                              "group_size, or is corrupt")
    if torch.equal(g, torch.arange(in_features, device=g.device) // group):
        return None
    if not bool((torch.bincount(g, minlength=groups) == group).all()):
        raise CheckpointError(f"{prefix}.g_idx gives its groups other sizes than group_size {group}, which infer's "
                              "kernels (W4A16, W8A16) cannot run")
    return torch.argsort(g, stable=True)


def to_awq(qweight: torch.Tensor, qzeros: torch.Tensor, g_idx: torch.Tensor | None, group_size: int,
           zero_offset: int, prefix: str, chunk_elements: int = CHUNK_ELEMENTS
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A GPTQ layer's packed tensors -> AWQ's ``(qweight, qzeros)`` and the input order (None: none), the weight
    repacked about ``chunk_elements`` values at a time. ``g_idx`` None: ``k // group``."""
    in_features, out_features = qweight.shape[0] * awq.PACK, qweight.shape[1]
    group = awq.check_shapes(in_features, out_features, group_size, prefix, checkpoint=True)
    order = input_order(g_idx, group, prefix) if g_idx is not None else None
    words = qzeros.to(torch.int64) + zero_offset * V1_WORD_OFFSET  # v1 -> v2, wrapping as 32-bit words do
    zeros = unpack_columns(torch.where(words >= 2**31, words - 2**32, words).to(torch.int32))
    packed = torch.empty(in_features, out_features // awq.PACK, dtype=torch.int32, device=qweight.device)
    for columns in row_chunks(out_features, in_features, awq.PACK, chunk_elements):
        packed[:, columns.start // awq.PACK: columns.stop // awq.PACK] = repack_rows(qweight[:, columns], order)
    return packed, awq.pack_int4(zeros), order
