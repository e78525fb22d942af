"""HF checkpoint folder -> (model, tokenizer): config.json, *.safetensors by mmap, tokenizer via transformers."""
from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .config import EngineConfig
from .errors import CapacityError, CheckpointError, ConfigError
from .interfaces import QuantMethod
from .model import Model
from .plugins import PluginManager

log = logging.getLogger("infer")

DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
DECODER_LAYER = re.compile(r"model\.layers\.(\d+)\.")  # HF's name of a decoder layer's tensors
BARE_BACKBONE = re.compile(r"(embed_tokens|layers|norm)\.")  # a bare backbone's names of them (Qwen3Model's)


@dataclass
class LoadedModel:
    model: Model
    arch: Any  # the architecture's parsed config (ArchConfig for the Llama family)
    tokenizer: Any
    device: torch.device
    dtype: torch.dtype
    path: Path
    quant: QuantMethod | None
    generation_eos: tuple[int, ...] = ()  # generation_config.json's eos_token_id (Llama 3 Instruct's <|eot_id|>)
    architecture: str = ""  # the registered model name (config.json's architectures[0])
    quant_name: str | None = None  # the registered quant method: --quant, else the checkpoint's quant_method


def triton_runs_on(device: torch.device) -> bool:
    """Whether Triton kernels run on ``device``: a CUDA one, or any under TRITON_INTERPRET=1 (tests, CPU tensors)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} was requested but CUDA is not available; use --device cpu")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ConfigError(f"device {name!r} was requested but this machine has {torch.cuda.device_count()} CUDA "
                          f"device(s), cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    return device


def checkpoint_dtype(raw: dict[str, Any]) -> str | None:
    """The dtype config.json states: ``dtype`` (newer transformers), else ``torch_dtype``, as HF reads them."""
    return raw.get("dtype") or raw.get("torch_dtype")


def resolve_dtype(name: str, stated: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPE_NAMES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in half precision are slow and less exact
    return torch.float16 if stated == "float16" else torch.bfloat16


def read_config(path: Path) -> dict[str, Any]:
    """config.json as a dict; without a ``quantization_config`` there, the one that older AutoAWQ and AutoGPTQ
    checkpoints keep beside it (:func:`separate_quant_config`)."""
    if not path.exists():
        raise CheckpointError(f"model folder {str(path)!r} does not exist; pass --model DIR with a local HF folder")
    if not path.is_dir():
        raise CheckpointError(f"--model must be a folder holding config.json and *.safetensors, got file {str(path)!r}")
    config_file = path / "config.json"
    if not config_file.exists():
        raise CheckpointError(f"{str(path)!r} has no config.json; is it an HF model folder?")
    try:
        raw = json.loads(config_file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file} is not valid JSON in UTF-8: {exc}") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {config_file} ({exc.strerror or exc}); it should be a file") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{config_file} holds {json.dumps(raw)[:40]}, not a JSON object of config fields; is "
                              "it an HF config.json?")
    if "quantization_config" not in raw and (separate := separate_quant_config(path)) is not None:
        raw["quantization_config"] = separate
    return raw


SEPARATE_QUANT_CONFIGS = {"quant_config.json": "awq", "quantize_config.json": "gptq"}  # AutoAWQ's, AutoGPTQ's


def separate_quant_config(path: Path) -> dict[str, Any] | None:
    """The quantization settings that older AutoAWQ (quant_config.json) and AutoGPTQ (quantize_config.json)
    checkpoints keep beside config.json, their ``quant_method`` the writer's unless they name one; None when there
    is neither file. Raises CheckpointError for both, or for one that is no JSON object."""
    found = [path / name for name in SEPARATE_QUANT_CONFIGS if (path / name).is_file()]
    if not found:
        return None
    if len(found) > 1:
        raise CheckpointError(f"{str(path)!r} holds both {found[0].name} and {found[1].name} and config.json has no "
                              "quantization_config, so infer cannot tell which describes the weights; remove the "
                              "other one, or copy the right one into config.json as \"quantization_config\"")
    try:
        qc = json.loads(found[0].read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError, OSError) as exc:
        raise CheckpointError(f"cannot read the quantization settings in {found[0]} ({exc})") from exc
    if not isinstance(qc, dict):
        raise CheckpointError(f"{found[0]} holds {json.dumps(qc)[:40]}, not a JSON object of quantization settings")
    log.info("read the quantization settings from %s (config.json has none)", found[0].name)
    return {"quant_method": SEPARATE_QUANT_CONFIGS[found[0].name], **qc}


def safetensors_files(path: Path) -> list[Path]:
    """The weight files: model.safetensors when present (as transformers picks), else the index json's, else every
    *.safetensors. Pickle formats are refused (arbitrary code)."""
    index, single = path / "model.safetensors.index.json", path / "model.safetensors"
    if index.exists() and single.exists():
        log.warning("loading %s only, as transformers does: %s and the shards it names are ignored", single.name,
                    index.name)
        return readable([single])
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
            if not all(isinstance(name, str) for name in names):
                raise TypeError(f"a file name is {next(n for n in names if not isinstance(n, str))!r}")
        except (ValueError, KeyError, TypeError, AttributeError, OSError) as exc:
            raise CheckpointError(f"{index} is not a valid safetensors index (a JSON object whose weight_map maps "
                                  f"tensor names to files): {exc!r}; fetch it again or delete it") from exc
        files = [path / n for n in names]
        missing = [f.name for f in files if not f.exists() and not f.is_symlink()]
        if missing:
            raise CheckpointError(f"{index.name} names files that are missing: {', '.join(missing)}")
        return readable(files)
    files = sorted(path.glob("*.safetensors"))
    if single in files and len(files) > 1:  # what transformers loads too
        log.warning("loading %s only: without model.safetensors.index.json the other safetensors files (%s) are "
                    "not part of the checkpoint", single.name, ", ".join(f.name for f in files if f != single))
        return readable([single])
    if files:
        return readable(files)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(
            f"{str(path)!r} holds only pickle weights ({', '.join(pickles[:3])}); infer refuses pickle files because "
            "loading them can run arbitrary code. Convert them to safetensors first, e.g. "
            "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, safe_serialization=True)`."
        )
    raise CheckpointError(f"{str(path)!r} has no *.safetensors weight files")


def readable(files: list[Path]) -> list[Path]:
    """``files``, each a file; else a CheckpointError naming the first that is a folder or a broken link (a copied
    HF cache snapshot whose links point at blobs left behind, say)."""
    for file in files:
        if file.is_file():
            continue
        if file.is_symlink() and not file.exists():
            raise CheckpointError(f"{file} is a link to {str(file.readlink())!r}, which does not exist (a copied HF "
                                  "cache snapshot leaves its blobs behind): copy the files the links point to, e.g. "
                                  "with `cp -rL`, or fetch the checkpoint again")
        raise CheckpointError(f"{file} is not a file; a checkpoint's weights are *.safetensors files")
    return files


def host_memory_available() -> int | None:
    """Bytes of host memory that can be allocated without swapping (Linux's MemAvailable, else all physical
    memory); None where neither is known."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def check_host_memory(model: torch.nn.Module, device: torch.device, sizes: str) -> None:
    """Refuse, before any weight is read, a model on the CPU whose tensors need more memory than the host has
    available: torch.empty reserves pages that only loading touches, so it would be killed part-way through."""
    if device.type != "cpu" or (available := host_memory_available()) is None:
        return
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()] if not t.is_meta}
    needed = sum(t.nbytes for t in tensors.values())
    if needed > available:
        raise CapacityError(f"the model's weights need {needed / 2**30:.1f} GiB on the CPU ({sizes}), more than the "
                            f"{available / 2**30:.1f} GiB of memory this machine has available; use a machine with "
                            "more memory or a GPU (--device cuda), a smaller --dtype if it is float32, or a smaller "
                            "model (if the checkpoint is small, config.json's sizes are wrong)")


def out_of_memory(device: torch.device, doing: str, advice: str) -> CapacityError:
    """The error for torch's OutOfMemoryError on ``device`` while ``doing``: the user's settings, not a bug."""
    total = f" ({torch.cuda.get_device_properties(device).total_memory / 2**30:.1f} GiB in all)" \
        if device.type == "cuda" else ""
    return CapacityError(f"out of {device} memory{total} while {doing}; {advice}")


@contextmanager
def device_memory(device: torch.device, doing: str, advice: str) -> Iterator[None]:
    """torch's out-of-memory error while ``doing``, as a CapacityError that gives the ``advice``."""
    try:
        yield
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(device, doing, advice) from exc


LoadProgress = Callable[[int, int], None]  # (bytes of the weight files read, their total), after each tensor


class WeightStream:
    """The (name, tensor) pairs of the weight files, in order, each name as ``layout`` maps it; ``current`` is the
    file being read (None once all are read), so that a tensor the model refuses can be traced to its file.
    ``progress`` is told the bytes read after each tensor (the files' total once each file ends)."""

    def __init__(self, files: list[Path], progress: LoadProgress | None = None,
                 layout: KeyLayout | None = None) -> None:
        self.files, self.current, self.progress = files, None, progress
        self.layout = layout or KeyLayout()

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import SafetensorError, safe_open

        sizes = [file.stat().st_size for file in self.files]
        total, done = sum(sizes), 0
        for file, size in zip(self.files, sizes):
            self.current = file
            read = 0
            try:
                with safe_open(str(file), framework="pt") as f:  # memory-mapped; tensors materialise one at a time
                    for name in f.keys():
                        tensor = f.get_tensor(name)
                        yield self.layout.model_name(name), tensor
                        read = min(size, read + tensor.nbytes)
                        if self.progress is not None:
                            self.progress(done + read, total)
            except SafetensorError as exc:
                self.current = None  # the message names the file
                raise unreadable(file, exc) from exc
            done += size
            if self.progress is not None:
                self.progress(done, total)
        self.current = None

    def refused(self, exc: CheckpointError) -> CheckpointError:
        """``exc`` (the model refused a tensor) naming the file it came from, when there are several."""
        if self.current is None or len(self.files) == 1:
            return exc
        unindexed = "" if (self.current.parent / "model.safetensors.index.json").exists() else (
            "; without model.safetensors.index.json infer reads every *.safetensors file in the folder, so move a "
            "file that is not part of the checkpoint out of it")
        return CheckpointError(f"{exc} (in {self.current.name}{unindexed})")


def unreadable(file: Path, exc: Exception) -> CheckpointError:
    return CheckpointError(f"{file} is not a readable safetensors file ({exc}); a partial download or copy leaves "
                           "such a file: fetch it again")


def checkpoint_names(files: list[Path]) -> list[str]:
    """The tensor names of the weight files, read from their headers."""
    from safetensors import SafetensorError, safe_open

    names: list[str] = []
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                names.extend(f.keys())
        except SafetensorError as exc:
            raise unreadable(file, exc) from exc
    return names


@dataclass(frozen=True)
class KeyLayout:
    """How a checkpoint names the backbone's tensors: under ``model.`` as a *ForCausalLM saves them, or ``bare`` as
    a bare backbone does (Qwen3Model, e5-mistral's MistralModel, Qwen3-Embedding: ``embed_tokens.weight``,
    ``layers.N.*``, ``norm.weight``), which load under ``model.``; ``lm_head.*`` keeps its name in both."""

    bare: bool = False

    def model_name(self, name: str) -> str:
        """The name the model gives the checkpoint's tensor ``name``."""
        return f"model.{name}" if self.bare and not name.startswith("lm_head.") else name

    def for_model(self, model: torch.nn.Module) -> KeyLayout:
        """This layout (the bare one logged); none for a model that names tensors bare itself (a plugin's), which
        takes the checkpoint's names as they are."""
        if self.bare and any(BARE_BACKBONE.match(name) for name in model.state_dict()):
            return KeyLayout()
        if self.bare:
            log.info("the checkpoint names its tensors as a bare backbone does (embed_tokens, layers.N, norm "
                     "without 'model.'): loading them as model.*")
        return self


def key_layout(names: list[str]) -> KeyLayout:
    """The layout of the checkpoint tensor ``names``; CheckpointError for one that mixes both."""
    bare = [name for name in names if BARE_BACKBONE.match(name)]
    if not bare:
        return KeyLayout()
    prefixed = [name for name in names if name.startswith("model.")]
    if prefixed:
        raise CheckpointError(f"the checkpoint mixes two layouts of the backbone's tensor names: {len(prefixed)} "
                              f"under 'model.' (e.g. {prefixed[0]!r}) and {len(bare)} without it (e.g. {bare[0]!r}, "
                              "as a bare backbone such as Qwen3Model saves them); a checkpoint holds one of them: "
                              "remove the files of the other export (or list the right ones in "
                              "model.safetensors.index.json)")
    return KeyLayout(bare=True)


def check_layer_count(raw: dict[str, Any], names: list[str]) -> None:
    """config.json's num_hidden_layers against the decoder layers the weights hold (``model.layers.N.`` names, as
    the model names them), before the model is built: a count past them built every missing layer first (minutes
    for an absurd one, or a "does not fit" refusal for a model that would) before the load named missing tensors.
    Weights named otherwise are not checked here."""
    stated = raw.get("num_hidden_layers")
    if not isinstance(stated, int) or isinstance(stated, bool):
        return
    last = max([-1] + [int(m.group(1)) for name in names if (m := DECODER_LAYER.match(name))])
    if 0 <= last < stated - 1:
        raise CheckpointError(f"config.json has num_hidden_layers {stated}, but the weights hold decoder layers 0 to "
                              f"{last} only (model.layers.N.*); correct num_hidden_layers, or fetch the checkpoint "
                              "again if some of its files are missing")


VOCABULARY_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model", "*.tiktoken",
                    "tiktoken.model")


def load_tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    files = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "tiktoken.model")
    if not any((path / name).exists() for name in files):
        raise CheckpointError(f"{str(path)!r} has no tokenizer (none of {', '.join(files)}); copy the tokenizer "
                              "files of the model it came from into the folder")
    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as exc:
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "config.json"):
            if not (path / name).is_file():
                continue
            try:
                json.loads((path / name).read_text(encoding="utf-8"))
            except OSError:  # an unreadable file: transformers' own error below says more
                continue
            except (ValueError, UnicodeDecodeError) as bad:  # JSONDecodeError is a ValueError
                raise CheckpointError(f"could not load the tokenizer from {str(path)!r}: {name} is not valid JSON "
                                      f"({bad}); fetch or copy it again") from exc
        if not any(any(path.glob(pattern)) for pattern in VOCABULARY_FILES):  # transformers blames missing packages
            raise CheckpointError(f"could not load the tokenizer from {str(path)!r}: it has no vocabulary file (none "
                                  f"of {', '.join(VOCABULARY_FILES)}); copy the tokenizer files of the model it came "
                                  "from into the folder") from exc
        raise CheckpointError(f"could not load the tokenizer from {str(path)!r} (transformers reads config.json "
                              f"too, so a bad field there fails here): {exc}") from exc


def generation_eos(path: Path) -> tuple[int, ...]:
    """generation_config.json's eos_token_id (an id or a list), which HF's generate stops at; () without one."""
    file = path / "generation_config.json"
    if not file.exists():
        return ()
    try:
        eos = json.loads(file.read_text()).get("eos_token_id")
    except (ValueError, AttributeError) as exc:
        raise CheckpointError(f"{file} is not a valid JSON object: {exc}; fix or delete it") from exc
    except OSError as exc:
        raise CheckpointError(f"cannot read {file} ({exc.strerror or exc}); it should be a file") from exc
    ids = eos if isinstance(eos, list) else [] if eos is None else [eos]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(f"{file} has eos_token_id = {eos!r}; it should be a token id or a list of them")
    return tuple(ids)


def check_finite(model: torch.nn.Module, narrowed_to: str | None = None) -> None:
    """Refuse NaN or infinite weights: they make every output garbage without any error. ``narrowed_to``: the
    dtype the weights were cast down to (float16 from a wider checkpoint), which may overflow to infinity. Warn of
    weight matrices that hold only zeros, the mark of a file cut short where its download preallocated it."""
    tensors = [(name, t) for name, t in [*model.named_parameters(), *model.named_buffers()]
               if t.is_floating_point() and t.numel()]
    if not tensors:
        return
    states = torch.stack([_finite_and_nonzero(t) for _, t in tensors]).tolist()  # one device sync
    bad = [name for (name, _), (finite, _) in zip(tensors, states) if not finite]
    if bad:
        why = "the checkpoint is corrupt or was saved from a diverged run: fetch or export it again" \
            if narrowed_to is None else (f"cast to --dtype {narrowed_to}, whose largest value is 65504, its weights "
                                         "overflow (or the checkpoint is corrupt): load it with --dtype bfloat16 or "
                                         "float32")
        raise CheckpointError(f"{len(bad)} weight tensor(s) hold NaN or infinite values ({', '.join(bad[:5])}"
                              f"{', ...' if len(bad) > 5 else ''}); {why}")
    zeros = [name for (name, t), (_, nonzero) in zip(tensors, states) if t.dim() >= 2 and not nonzero]
    if zeros:
        log.warning("%d weight matrices hold only zeros (%s%s): a trained model has none, but a download cut short "
                    "leaves zeros where its file was preallocated; compare the files' checksums with the source's",
                    len(zeros), ", ".join(zeros[:5]), ", ..." if len(zeros) > 5 else "")


# bit patterns of 8-bit floats that are NaN or infinite: (mask, value) with (byte & mask) == value
FP8_NON_FINITE = {torch.float8_e4m3fn: (0x7F, 0x7F), torch.float8_e5m2: (0x7C, 0x7C),
                  torch.float8_e4m3fnuz: (0xFF, 0x80), torch.float8_e5m2fnuz: (0xFF, 0x80)}


def _finite_and_nonzero(t: torch.Tensor) -> torch.Tensor:
    """Whether ``t`` is all finite, and whether it holds a value other than zero: two bools on t's device, without
    a host sync."""
    if t.element_size() == 1:  # no aminmax for 8-bit floats: read the bits
        mask, value = FP8_NON_FINITE.get(t.dtype, (0, 1))  # an unknown 8-bit float: never flagged
        bits = t.view(torch.uint8)
        return torch.stack([~((bits & mask) == value).any(), (bits & 0x7F).any()])  # the low 7 bits: all but sign
    extremes = torch.stack(torch.aminmax(t))
    return torch.stack([torch.isfinite(extremes).all(), extremes.any()])  # NaN spreads to both extremes; inf is one


def architectures(raw: dict[str, Any]) -> list[str]:
    """config.json's ``architectures``: a list of class names (maybe empty). Raises CheckpointError."""
    archs = raw.get("architectures") or []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json has architectures = {archs!r}; it should be a list of class names, "
                              'e.g. ["LlamaForCausalLM"]')
    if not archs and isinstance(model_type := raw.get("model_type"), str):
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        if (named := MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)) is not None:
            log.info("config.json names no architectures; model_type %r means %s, as in transformers' "
                     "AutoModelForCausalLM", model_type, named)
            return [named]
    if archs and isinstance(model_type := raw.get("model_type"), str):
        from transformers.models.auto.modeling_auto import (MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES,
                                                            MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES)

        named = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
        backbone = MODEL_MAPPING_NAMES.get(model_type)  # a bare backbone of the same model (an embedding model's)
        classifier = MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES.get(model_type)  # its reward model's
        if named is not None and archs[0] not in (named, backbone, classifier):  # HF's Auto class builds another
            log.warning("config.json names the architecture %s but model_type %r, which transformers' "
                        "AutoModelForCausalLM builds as %s; infer builds %s (as vLLM does), so what only %s does "
                        "(a sliding window, say) does not apply: fix config.json if it should", archs[0],
                        model_type, named, archs[0], named)
    return archs


def log_no_lm_head(architecture: str, num_labels: int | None = None) -> None:
    """Say that a model loaded without an LM head serves embeddings only (a classifier's: its ``num_labels`` label
    logits); a *ForCausalLM may have lost its head."""
    if num_labels is not None:
        log.info("%s is a sequence classifier with %d labels: this engine serves embedding requests only, each one's "
                 "embedding the label logits; generation requests and beam searches will be refused", architecture,
                 num_labels)
        return
    if not architecture.endswith("ForCausalLM"):
        log.info("no LM head: this engine serves embeddings only (%s is a bare backbone); generation requests and "
                 "beam searches will be refused", architecture)
        return
    log.warning("no LM head: this engine serves embeddings only: config.json names %s with tie_word_embeddings "
                "false, but the checkpoint holds no lm_head.weight, so generation requests and beam searches will "
                "be refused. Embedding checkpoints (Qwen3-Embedding) ship so; a generation model's head is missing: "
                "fetch the checkpoint again, or set tie_word_embeddings true if the head is the embedding",
                architecture)


def quantization_config(raw: dict[str, Any]) -> dict[str, Any] | None:
    """config.json's ``quantization_config``: an object, or None when absent. Raises CheckpointError."""
    qc = raw.get("quantization_config")
    if qc is not None and not isinstance(qc, dict):
        raise CheckpointError(f"config.json has quantization_config = {qc!r}; it should be an object such as "
                              '{"quant_method": "awq", "bits": 4, ...}, or absent for an unquantized checkpoint')
    return qc or None


def load_model(config: EngineConfig, plugins: PluginManager, path: Path, progress: LoadProgress | None = None
               ) -> LoadedModel:
    """Build the model ``config`` names and load its weights; ``progress``: told the bytes read (WeightStream)."""
    raw = read_config(path)
    archs = architectures(raw)
    raw = {**raw, "architectures": archs}  # from model_type, where config.json names none
    models = plugins.registry("model")
    if not archs or archs[0] not in models:
        raise CheckpointError(
            f"unsupported architecture {archs[0] if archs else '(none in config.json)'!r}; "
            f"supported: {', '.join(models.names()) or '(none)'}{models.unknown_hint(archs[0]) if archs else ''}"
        )
    files = safetensors_files(path)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, checkpoint_dtype(raw), device)
    quant_config = quantization_config(raw)
    declared = quant_config.get("quant_method") if quant_config is not None else None
    methods = plugins.registry("quant_method")
    if isinstance(declared, str) and declared not in methods and declared.lower() in methods:
        declared = declared.lower()  # "AWQ" in some hub configs
    if config.quant is None and quant_config is not None and declared is None:
        raise CheckpointError(f"config.json's quantization_config {json.dumps(quant_config)[:120]} has no "
                              "quant_method, so infer cannot tell how its weights are quantized; add one "
                              '("quant_method": "awq" for AutoAWQ\'s w_bit/q_group_size spelling), or pass --quant '
                              "with the method that made the checkpoint")
    if config.quant is None and declared is not None and declared not in methods:
        raise CheckpointError(f"config.json's quantization_config has quant_method {declared!r}, which no installed "
                              f"plugin loads (registered quant methods: {', '.join(methods.names())}); use a "
                              "checkpoint in one of those formats, or install a plugin for it")
    quant_name = config.quant or declared
    quant = plugins.build("quant_method", quant_name, QuantMethod, config, quant_config) if quant_name else None
    names = checkpoint_names(files)
    layout = key_layout(names)
    check_layer_count(raw, [layout.model_name(name) for name in names])
    too_large = ("the model does not fit: use a quantized checkpoint or quantize it as it loads (--quant awq: about "
                 "a quarter of its 16-bit size, --quant fp8: a half), a smaller model, or a device with more memory "
                 "(other processes on the GPU, shown by nvidia-smi, take their share)")
    with torch.device(device), device_memory(device, "building the model", too_large):
        model = plugins.build("model", archs[0], Model, raw, quant, dtype, config)  # parses config.json
    sizes = ", ".join(f"{key} {raw[key]}" for key in ("num_hidden_layers", "hidden_size", "vocab_size") if key in raw)
    check_host_memory(model, device, str(dtype).removeprefix("torch.") + (f"; config.json: {sizes}" if sizes else ""))
    tokenizer = load_tokenizer(path)  # before the weights: a bad tokenizer fails fast
    eos = generation_eos(path)
    if len(tokenizer) > model.spec.vocab_size:
        log.warning("the tokenizer has %d tokens but the model's vocabulary %d: prompts with the extra tokens are "
                    "refused", len(tokenizer), model.spec.vocab_size)
    weights = WeightStream(files, progress, layout.for_model(model))
    try:
        with device_memory(device, "loading the model's weights", too_large):
            model.load_weights(iter(weights))
    except CheckpointError as exc:
        raise weights.refused(exc) from exc
    check_finite(model, "float16" if dtype == torch.float16 and checkpoint_dtype(raw) != "float16" else None)
    if not model.spec.has_lm_head:
        log_no_lm_head(archs[0], model.spec.num_labels)
    model.eval()
    return LoadedModel(model, getattr(model, "cfg", raw), tokenizer, device, dtype, path, quant, eos, archs[0],
                       quant_name if quant is not None else None)
