"""What every ``infer quantize`` method shares: its options, the checks of a request before any heavy work, the
unquantized model and calibration samples, the decoder layers' linears grouped by shared input, and the writing of
the checkpoint (to a temporary sibling folder, then moved into place)."""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, ClassVar, Self, TypeVar

import torch
from torch import nn

from ..core.errors import CheckpointError, ConfigError
from ..core.files import chmod_as_umask
from . import awq
from .awq_method import auto_group_size
from .calib_data import default_texts, token_samples

ProgressFn = Callable[[str, int, int], None]  # (phase, done, total)
SKIPPED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl")
SKIPPED_NAMES = ("config.json", "model.safetensors.index.json", "quant_config.json", "quantize_config.json")
FP16_MAX = float(torch.finfo(torch.float16).max)

log = logging.getLogger("infer")


@dataclass(frozen=True)
class CalibrationOptions:
    """The options every ``infer quantize`` method shares (what :func:`check_request` and
    :func:`load_for_calibration` read); each method's options add their own."""

    group_size: int | None = None  # None: the largest of 128, 64, 32 that divides every layer's input size, else -1
    bits: int = 4
    num_samples: int = 64
    seq_len: int = 512
    batch_samples: int = 8  # samples per calibration forward pass
    device: str = "auto"
    supported_bits: ClassVar[tuple[int, ...]] = (awq.BITS,)
    bits_refusal: ClassVar[str] = "infer quantizes to 4-bit weights only"

    def validate(self) -> Self:
        """Bits among ``supported_bits``, a group size of :data:`.awq.GROUP_SIZES` or None, at least one sample of
        at least 2 tokens, a device torch can parse; ConfigError otherwise."""
        from ..core.loader import resolve_device

        if self.bits not in self.supported_bits:
            raise ConfigError(f"{self.bits_refusal}, got --bits {self.bits}")
        if self.group_size is not None and not awq.is_group_size(self.group_size):
            raise ConfigError(f"--group-size must be one of {', '.join(map(str, awq.GROUP_SIZES))}, "
                              f"got {self.group_size}")
        if self.seq_len < 2:
            raise ConfigError(f"--seq-len must be >= 2 (a sample needs a next token), got {self.seq_len}")
        check_at_least_one(self, ("num_samples", "batch_samples"))
        try:
            resolve_device(self.device)
        except RuntimeError as exc:  # torch's message for a malformed device string
            raise ConfigError(f"--device must be auto, cpu, cuda or cuda:N, got {self.device!r}") from exc
        return self


def check_at_least_one(options: object, names: Iterable[str]) -> None:
    """ConfigError naming the first of the options ``names`` below 1, as its command-line flag."""
    for name in names:
        if getattr(options, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(options, name)}")


Options = TypeVar("Options", bound=CalibrationOptions)


@dataclass(frozen=True)
class LinearGroup:
    """Linears (paths inside a decoder layer) that share one input, and the op whose weight absorbs ``1 / s``."""

    name: str
    linears: tuple[str, ...]
    prev: str


GROUPS = (
    LinearGroup("qkv", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "input_layernorm"),
    LinearGroup("o", ("self_attn.o_proj",), "self_attn.v_proj"),
    LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "post_attention_layernorm"),
    LinearGroup("down", ("mlp.down_proj",), "mlp.up_proj"),
)
FUSED_GROUPS = (  # Phi-3: o's and down's 1 / s goes into the last rows of qkv_proj (v's) and gate_up_proj (up's)
    LinearGroup("qkv", ("self_attn.qkv_proj",), "input_layernorm"),
    LinearGroup("o", ("self_attn.o_proj",), "self_attn.qkv_proj"),
    LinearGroup("gate_up", ("mlp.gate_up_proj",), "post_attention_layernorm"),
    LinearGroup("down", ("mlp.down_proj",), "mlp.gate_up_proj"),
)


GEMMA_GROUPS = GROUPS[:2] + (
    LinearGroup("gate_up", ("mlp.gate_proj", "mlp.up_proj"), "pre_feedforward_layernorm"), GROUPS[3])


def groups_of(layer: nn.Module) -> tuple[LinearGroup, ...]:
    """The scale groups of a dense decoder layer: its checkpoint's own linears (Gemma's MLP reads its
    pre_feedforward_layernorm, the post-attention norm being the attention's output norm there)."""
    if hasattr(layer, "pre_feedforward_layernorm"):
        return GEMMA_GROUPS
    return FUSED_GROUPS if layer.self_attn.qkv_proj is not None else GROUPS


def linear_groups(layer: nn.Module) -> tuple[LinearGroup, ...]:
    """A decoder layer's linears, by shared input: attention's, and a dense MLP's or a sparse layer's shared expert's
    (the experts themselves are stacked tensors, not Linears)."""
    from ..models.moe import SparseMoe

    groups = groups_of(layer)
    ffn = layer.ffn()
    if not isinstance(ffn, SparseMoe):
        return groups

    def shared(path: str) -> str:
        return path.replace("mlp.", f"{layer.feed_forward}.shared_expert.", 1)
    return groups[:2] + (() if ffn.shared_expert is None else tuple(
        LinearGroup(g.name, tuple(map(shared, g.linears)), shared(g.prev)) for g in groups[2:]))


# ---------------------------------------------------------------- checks (before any heavy work)
def check_request(model_dir: Path, out_dir: Path, config: Options) -> tuple[dict[str, Any], Options]:
    """Validate the options, MODEL and OUT; return MODEL's config.json and the options with the group size chosen.
    Raises ConfigError/CheckpointError."""
    from ..core.loader import architectures, quantization_config, read_config, safetensors_files
    from ..models.llama import ArchConfig
    from ..models.gemma import ARCHITECTURES as GEMMAS
    from ..plugins.llama_family import DENSE_ARCHITECTURES, MOE_ARCHITECTURES

    config.validate()
    if not model_dir.is_dir():
        raise CheckpointError(f"MODEL {str(model_dir)!r} does not exist or is not a folder; give the local HF "
                              "checkpoint folder to quantize")
    raw = read_config(model_dir)
    declared = quantization_config(raw)
    if declared:
        raise CheckpointError(f"{str(model_dir)!r} is already quantized ({declared.get('quant_method', '?')}); "
                              "`infer quantize` needs the unquantized checkpoint it came from")
    arch = (architectures(raw) or ["(none)"])[0]
    supported = DENSE_ARCHITECTURES + GEMMAS + MOE_ARCHITECTURES
    if arch not in supported:
        raise CheckpointError(f"infer quantize supports {', '.join(supported)}; {str(model_dir)!r} is {arch!r}")
    safetensors_files(model_dir)
    cfg = ArchConfig.from_hf(raw)
    q_size, kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {"q_proj": (cfg.hidden_size, q_size), "k_proj": (cfg.hidden_size, kv_size),
              "v_proj": (cfg.hidden_size, kv_size), "o_proj": (q_size, cfg.hidden_size),
              "gate_proj": (cfg.hidden_size, cfg.intermediate_size),
              "up_proj": (cfg.hidden_size, cfg.intermediate_size),
              "down_proj": (cfg.intermediate_size, cfg.hidden_size)}
    if cfg.fused_projections:  # Phi-3's checkpoint linears
        shapes = {"qkv_proj": (cfg.hidden_size, q_size + 2 * kv_size), "o_proj": shapes["o_proj"],
                  "gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size), "down_proj": shapes["down_proj"]}
    if cfg.moe is not None:  # each expert's gate, up and down, and a shared expert's
        for what, size in (("an expert's", cfg.moe.intermediate_size),
                           ("the shared expert's", cfg.moe.shared_intermediate_size)):
            if size:
                shapes |= {f"{what} gate_proj": (cfg.hidden_size, size), f"{what} up_proj": (cfg.hidden_size, size),
                           f"{what} down_proj": (size, cfg.hidden_size)}
    if config.group_size is None:  # one group size per checkpoint: the smallest of the layers' own choices
        config = replace(config, group_size=min(auto_group_size(i) for i, _ in shapes.values()))
    for name, (in_features, out_features) in shapes.items():
        if config.bits == awq.BITS:
            awq.check_shapes(in_features, out_features, config.group_size, name)
        elif out_features % (32 // config.bits) or config.group_size != -1 and in_features % config.group_size:
            raise ConfigError(f"{name} ({in_features} inputs, {out_features} outputs) cannot be stored at "
                              f"{config.bits} bits: GPTQ packs {32 // config.bits} output columns per int32 and "
                              f"needs groups of --group-size {config.group_size} to divide the inputs")
    if out_dir.is_symlink():
        raise ConfigError(f"OUT {str(out_dir)!r} is a symbolic link; give the real folder it points to, or a new path")
    out = out_dir.resolve()
    if out == model_dir.resolve():
        raise ConfigError("OUT must differ from MODEL: the quantized checkpoint is written to a new folder")
    if out.parent.exists() and not out.parent.is_dir():
        raise ConfigError(f"the parent of OUT, {str(out.parent)!r}, is a file, not a folder; choose another path")
    if not out.parent.is_dir():
        raise ConfigError(f"the parent folder of OUT, {str(out.parent)!r}, does not exist; create it first")
    try:  # a folder like the one the checkpoint is written to first: made and removed now, not after hours
        temporary_sibling(out).rmdir()
    except OSError as exc:
        raise ConfigError(f"cannot write into {str(out.parent)!r}, the parent folder of OUT ({exc.strerror or exc}); "
                          "choose a writable path") from None
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(f"OUT {str(out_dir)!r} already exists and is not an empty folder; choose a new path")
    return raw, config


def _to_fp16(name: str, tensor: torch.Tensor) -> torch.Tensor:
    if tensor.is_floating_point() and tensor.dtype != torch.float16:
        if bool((tensor.abs() > FP16_MAX).any()):
            raise CheckpointError(f"{name} holds values beyond the fp16 range, which AWQ checkpoints use; "
                                  "this model cannot be stored as AWQ, use --quant fp8 instead")
        tensor = tensor.to(torch.float16)
    return tensor.detach().cpu().contiguous()


def load_for_calibration(model_dir: Path, config: CalibrationOptions, texts: Iterable[str] | None,
                         plugins: Any = None) -> tuple[Any, list[list[int]], int]:
    """The unquantized model (float32 on the CPU, its checkpoint's own linears) and the calibration samples: up to
    ``config.num_samples`` of ``config.seq_len`` tokens (at most the model's context) from ``texts``, by default
    the standard library's sources; a warning when the text holds fewer), and that sample length."""
    from ..core.config import EngineConfig
    from ..core.loader import load_model, resolve_device
    from ..core.plugins import PluginManager

    device = resolve_device(config.device)
    plugins = plugins or PluginManager.from_entry_points().collect()
    engine_config = EngineConfig(model=str(model_dir), device=str(device),  # calibration reads each projection
                                 dtype="float32" if device.type == "cpu" else "auto", fuse_projections=False).validate()
    loaded = load_model(engine_config, plugins, model_dir)
    seq_len = min(config.seq_len, loaded.model.spec.max_model_len)
    if seq_len < config.seq_len:
        log.warning("--seq-len %d is longer than the model's context (%d tokens): the samples use %d",
                    config.seq_len, loaded.model.spec.max_model_len, seq_len)
    samples = token_samples(loaded.tokenizer, default_texts() if texts is None else texts, config.num_samples, seq_len)
    used = sum(map(len, samples))
    if used < seq_len:  # a search on a handful of tokens can be worse than plain round-to-nearest
        log.warning("the calibration text holds only %d tokens, under one sample of %d: the quantization may fit it "
                    "and nothing else; give more text with --calib", used, seq_len)
    elif len(samples) < config.num_samples:
        log.warning("the calibration text holds %d sample%s of %d tokens, not the %d asked for (--num-samples): "
                    "calibrating on those; give more text with --calib for more", len(samples),
                    "" if len(samples) == 1 else "s", seq_len, config.num_samples)
    return loaded, samples, seq_len


def write_quantized(model: Any, tensors: dict[str, torch.Tensor], model_dir: Path, out_dir: Path, raw: dict[str, Any],
                    quantization_config: dict[str, Any], record: tuple[str, dict[str, Any]]) -> None:
    """Write the checkpoint (:func:`_write_checkpoint`): the quantized linears' ``tensors`` (float ones in float16,
    as AutoAWQ and GPTQ store their scales), and the rest of ``model``'s tensors (norms, embeddings, the head)
    beside them, as its checkpoint holds them (``Model.checkpoint_weights``), in float16; a model that overflows
    float16 (Gemma) keeps those in bfloat16, and config.json says so."""
    from safetensors.torch import save_file

    dtype = torch.bfloat16 if overflows_float16(raw) else torch.float16
    quantized_owners = {name.rpartition(".")[0] for name in tensors}
    everything = {name: _to_fp16(name, t) for name, t in tensors.items()}
    for name, tensor in model.checkpoint_weights().items():
        if name.rpartition(".")[0] not in quantized_owners:
            everything[name] = _to_fp16(name, tensor) if dtype == torch.float16 or not tensor.is_floating_point() \
                else tensor.detach().to(dtype).cpu().contiguous()
    _write_checkpoint(model_dir, out_dir, raw, everything, save_file, quantization_config, record)


def overflows_float16(raw: dict[str, Any]) -> bool:
    """Whether the model of config.json ``raw`` runs in bfloat16, never float16 (Gemma 2 and 3)."""
    from ..core.loader import architectures
    from ..models.gemma import ARCHITECTURES as GEMMAS

    return bool(set(architectures(raw)) & set(GEMMAS))


def temporary_sibling(out_dir: Path) -> Path:
    """A new folder beside ``out_dir`` (``.OUT.tmp-XXXX``, the mode of a plain mkdir), where the checkpoint is
    written before it is moved."""
    folder = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    chmod_as_umask(folder)
    return folder


def _write_checkpoint(model_dir: Path, out_dir: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor],
                      save_file: Any, quantization_config: dict[str, Any], record: tuple[str, dict[str, Any]]) -> None:
    """Write to a temporary sibling folder, then move it into place, so OUT is complete or absent."""
    from safetensors import SafetensorError

    tmp: Path | None = None
    try:
        tmp = temporary_sibling(out_dir)  # check_request made one there
        _write_files(model_dir, tmp, raw, tensors, save_file, quantization_config, record)
        existed = out_dir.exists()
        if existed:
            out_dir.rmdir()  # checked empty by check_request
        try:
            os.replace(tmp, out_dir)
        except BaseException:  # Ctrl-C included
            if existed:
                out_dir.mkdir(exist_ok=True)  # as it was: empty
            raise
    except (OSError, SafetensorError) as exc:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        full = getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(exc)
        raise CheckpointError(f"writing the quantized checkpoint to {str(out_dir)!r} failed ({exc}); OUT was not "
                              f"created: {'free disk space or ' if full else ''}choose another path, then run "
                              "again") from exc
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_files(model_dir: Path, tmp: Path, raw: dict[str, Any], tensors: dict[str, torch.Tensor], save_file: Any,
                 quantization_config: dict[str, Any], record: tuple[str, dict[str, Any]]) -> None:
    """The checkpoint's files, in ``tmp``: weights (float16 beside the quantized tensors), config.json with the
    ``quantization_config``, the calibration ``record`` (file name, contents), and MODEL's other files (tokenizer,
    generation config, chat template, ...)."""
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    chmod_as_umask(tmp / "model.safetensors")
    quantized = dict(raw)
    quantized["quantization_config"] = quantization_config
    dtype = "bfloat16" if overflows_float16(raw) else "float16"
    quantized["torch_dtype"] = dtype
    if "dtype" in quantized:
        quantized["dtype"] = dtype
    (tmp / "config.json").write_text(json.dumps(quantized, indent=2) + "\n")
    (tmp / record[0]).write_text(json.dumps(record[1], indent=1) + "\n")
    for item in model_dir.iterdir():
        if item.is_file() and item.suffix not in SKIPPED_SUFFIXES and item.name not in SKIPPED_NAMES:
            shutil.copy2(item, tmp / item.name)
