"""LoRA adapters in PEFT's format, served beside the base model: every adapter's A/B matrices stacked per linear
layer, each token getting its own request's adapter (S-LoRA, arXiv 2311.03285: one base pass for the whole batch,
the low-rank deltas batched beside it). Adapters are loaded at engine start (``--lora NAME=DIR``) and, into free
slots, while it runs (``Engine.load_lora_adapter``)."""
from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ..core.config import MAX_LORA_RANK as MAX_RANK
from ..core.errors import CapacityError, CheckpointError
from .layers import Linear

if TYPE_CHECKING:
    from ..core.model import Model

log = logging.getLogger("infer")

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # PEFT's tensor names: this, the HF module name, then .lora_A/.lora_B.weight
# adapter_config.json keys whose non-empty values change what the adapter computes, and why each is refused
UNSUPPORTED = {
    "use_dora": "DoRA (weight-decomposed LoRA) adapters",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "fan_in_fan_out": "fan_in_fan_out adapters (GPT-2's Conv1D layout)",
    "rank_pattern": "per-module ranks (rank_pattern)",
    "alpha_pattern": "per-module alphas (alpha_pattern)",
    "lora_bias": "adapters with a bias on lora_B (lora_bias)",
    "layer_replication": "layer replication",
    "use_qalora": "QA-LoRA adapters",
    "trainable_token_indices": "adapters that train token embeddings (trainable_token_indices)",
    "target_parameters": "adapters on parameters (target_parameters)",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens)",
    "use_bdlora": "block-diagonal LoRA (use_bdlora), whose factors are stored compressed",
    "kasa_config": "KaSA adapters (kasa_config), which also change the base weights",
    "monteclora_config": "MonteCLoRA adapters (monteclora_config)",
    "arrow_config": "Arrow-routed adapters (arrow_config)",
    "velora_config": "VeLoRA adapters (velora_config)",
}
HEAD_AND_EMBEDDINGS = ("lm_head", "embed_tokens")  # PEFT saves their base weights too; the head's rows are the
# sampled positions, not the step's tokens, and an embedding's delta is a lookup, not a matmul
# init_lora_weights values whose adapters only work on the base weights PEFT changed at initialization, unless they
# were saved converted (save_pretrained's path_initial_model_for_weight_conversion), which leaves a plain LoRA
BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq")


@dataclass
class LoraAdapter:
    """One adapter as read from its folder: ``weights`` maps an HF module name (``model.layers.0.self_attn.q_proj``)
    to its (A [rank, in], B [out, rank]); the delta of that module's output is ``scaling * x @ A.T @ B.T``."""

    name: str
    rank: int
    scaling: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with use_rslora
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def for_model(adapter: LoraAdapter, model: Model) -> LoraAdapter:
    """``adapter`` with its modules under the model's names (Model.module_name). Modules of the checkpoint that the
    model does not serve (a multimodal checkpoint's vision tower, which text never reaches) are left out, logged."""
    served = {module: model.module_name(module) for module in adapter.weights}
    if served == {module: module for module in adapter.weights}:
        return adapter
    if left_out := sorted(module for module, name in served.items() if name is None):
        if len(left_out) == len(served):
            raise CheckpointError(f"LoRA adapter {adapter.name!r} adapts only modules this model does not serve "
                                  f"(like {left_out[0]!r}); infer serves the text model's decoder layers")
        log.info("LoRA adapter %s: %d of its modules (like %s) are outside the served text model and are left out",
                 adapter.name, len(left_out), left_out[0])
    weights = {name: adapter.weights[module] for module, name in served.items() if name is not None}
    return LoraAdapter(adapter.name, adapter.rank, adapter.scaling, weights)


def read_adapter(name: str, folder: Path) -> LoraAdapter:
    """The adapter saved in ``folder`` by PEFT's ``save_pretrained``. CheckpointError says what is wrong."""
    where = f"LoRA adapter {name!r} ({folder})"
    config = _read_config(folder, where)
    rank, alpha = config.get("r"), config.get("lora_alpha", 8)
    if type(rank) is not int or not 0 < rank <= MAX_RANK:
        raise CheckpointError(f"{where}: adapter_config.json has r = {rank!r}; it must be an integer in "
                              f"[1, {MAX_RANK}]")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        # json reads NaN and Infinity: a NaN scaling passed the range check and, masked by 0 in a step that runs
        # every slot, turned every request of the batch to NaN
        raise CheckpointError(f"{where}: adapter_config.json has lora_alpha = {alpha!r}; it must be a finite "
                              "number")
    if config.get("bias", "none") != "none":
        raise CheckpointError(f"{where}: bias = {config['bias']!r}; infer serves adapters without biases "
                              "(bias 'none') only")
    for key, what in UNSUPPORTED.items():
        if config.get(key):
            raise CheckpointError(f"{where}: infer does not serve {what}; adapter_config.json sets {key}")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(BASE_CHANGING_INITS):
        raise CheckpointError(f"{where}: init_lora_weights {init!r} adapters apply to the base weights PEFT changed "
                              "at initialization, not to this checkpoint's; save the adapter again with PEFT's "
                              "save_pretrained(..., path_initial_model_for_weight_conversion=...) to convert it into "
                              "a plain LoRA")
    scaling = alpha / (rank**0.5 if config.get("use_rslora") else rank)
    return LoraAdapter(name, rank, scaling, _read_weights(folder, where, rank))


def _read_config(folder: Path, where: str) -> dict[str, Any]:
    path = folder / ADAPTER_CONFIG
    try:
        is_folder, has_config = folder.is_dir(), path.is_file()
    except OSError as exc:  # a name too long, a folder it may not read
        raise CheckpointError(f"{where}: cannot read {str(folder)[:200]!r}: {exc.strerror or exc}") from exc
    if not is_folder:
        relative = "" if folder.is_absolute() else f" (a relative path, read from {Path.cwd()})"
        what = "is not a folder" if folder.exists() else "does not exist"
        raise CheckpointError(f"{where}: {str(folder)!r} {what}{relative}; give the folder that PEFT's "
                              "save_pretrained wrote")
    if not has_config:
        raise CheckpointError(f"{where}: no {ADAPTER_CONFIG}; give the folder that PEFT's save_pretrained wrote")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise CheckpointError(f"{where}: {ADAPTER_CONFIG} is not readable JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{where}: {ADAPTER_CONFIG} must hold a JSON object")
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise CheckpointError(f"{where}: peft_type is {kind!r}; infer serves LORA adapters only")
    return config


def _read_weights(folder: Path, where: str, rank: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / ADAPTER_WEIGHTS
    if not path.is_file():
        hint = " (adapter_model.bin is a pickle, which infer does not load: save it again with " \
            "safe_serialization=True)" if (folder / "adapter_model.bin").exists() else ""
        raise CheckpointError(f"{where}: no {ADAPTER_WEIGHTS}{hint}")
    try:
        tensors = load_file(path)
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{where}: {ADAPTER_WEIGHTS} is not a readable safetensors file: {exc}") from exc
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for tensor_name, tensor in tensors.items():
        module, dot, half = tensor_name.removeprefix(PEFT_PREFIX).rpartition(".lora_")
        owner = (module if dot else tensor_name.removeprefix(PEFT_PREFIX).removesuffix(".base_layer.weight"))
        if owner.rpartition(".")[2] in HEAD_AND_EMBEDDINGS:
            raise CheckpointError(f"{where}: infer does not serve LoRA on the LM head or the input embeddings "
                                  f"({tensor_name!r}); train the adapter without {owner.rpartition('.')[2]} in "
                                  "target_modules")
        if not tensor_name.startswith(PEFT_PREFIX) or not dot or half not in ("A.weight", "B.weight"):
            raise CheckpointError(f"{where}: unexpected tensor {tensor_name!r}; infer serves LoRA on linear layers, "
                                  f"named {PEFT_PREFIX}MODULE.lora_A.weight and .lora_B.weight")
        if not tensor.is_floating_point() or tensor.dim() != 2:
            raise CheckpointError(f"{where}: {tensor_name} must be a 2-d float tensor, got {tensor.dtype} "
                                  f"{tuple(tensor.shape)}")
        # a step that runs every slot multiplies each one by a 0/1 mask: 0 * inf or NaN would reach every token
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{where}: {tensor_name} holds NaN or infinite values; the adapter is corrupt "
                                  "(or overflowed when it was saved)")
        halves.setdefault(module, {})[half[0]] = tensor
    weights = {}
    for module, pair in sorted(halves.items()):
        if len(pair) != 2:
            raise CheckpointError(f"{where}: {module} has lora_{next(iter(pair))} but not its other half")
        a, b = pair["A"], pair["B"]
        if a.shape[0] != rank or b.shape[1] != rank:
            raise CheckpointError(f"{where}: {module} has lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)}; with "
                                  f"r = {rank} they must be [{rank}, in] and [out, {rank}]")
        weights[module] = (a, b)
    if not weights:
        raise CheckpointError(f"{where}: {ADAPTER_WEIGHTS} holds no LoRA weights")
    return weights


class LoraTokens:
    """Which adapter each token of the step runs, as one-hot weights [tokens, adapters] that every LoRA linear
    reads. Steps of up to ``len(static)`` tokens write a fixed buffer, which CUDA graphs capture; larger ones, which
    run eagerly, get their own tensor."""

    def __init__(self, num_slots: int, dtype: torch.dtype, device: torch.device, capacity: int = 256) -> None:
        self.slot_of: dict[str, int] = {}  # the loaded adapters' slots (LoraStack writes it)
        self.static = torch.zeros(capacity, num_slots, dtype=dtype, device=device)
        self.current = self.static
        self.active = False  # whether a linear adds its delta (some token has an adapter, or graphs are captured)
        self.always_active = False  # CUDA graphs: the delta is part of every captured step
        self.only: int | None = None  # an eager step whose adapted tokens all use this slot: its columns alone run

    @property
    def num_slots(self) -> int:
        return self.static.shape[1]

    def prepare_capture(self, num_tokens: int) -> None:
        """Before CUDA graphs of up to ``num_tokens`` tokens are captured: the fixed buffer holds their largest
        step, and every adapter's delta runs from now on (a branch not taken at capture is never replayed)."""
        if num_tokens > len(self.static):
            self.static = self.static.new_zeros(num_tokens, self.num_slots)
        self.current, self.only = self.static, None
        self.always_active = self.active = True

    def set(self, slots: torch.Tensor, in_use: frozenset[int]) -> None:
        """``slots`` [tokens] (int64, on the device): each token's adapter slot, -1 for none; ``in_use``: the slots
        that occur (known on the host)."""
        self.active = bool(in_use) or self.always_active
        self.only = next(iter(in_use)) if len(in_use) == 1 and not self.always_active else None
        if not self.active:
            return
        n = slots.shape[0]
        weights = self.static[:n] if n <= len(self.static) else self.static.new_empty(n, self.num_slots)
        weights.zero_()
        weights.scatter_(1, slots.clamp(min=0).unsqueeze(1), (slots >= 0).unsqueeze(1).to(weights.dtype))
        self.current = self.static if n <= len(self.static) else weights


class LoraDelta(nn.Module):
    """The stacked adapters of one linear layer, whose output is ``parts`` (one, or q/k/v or gate/up merged) side by
    side. Rows of ``a`` come slot by slot, each slot's part by part, ``rank`` rows each (an adapter's smaller rank
    padded with zeros); ``bs[p]`` holds part p's B, scaled, one group of ``rank`` columns per slot."""

    def __init__(self, a: torch.Tensor, bs: list[torch.Tensor], rank: int, tokens: LoraTokens) -> None:
        super().__init__()
        self.register_buffer("a", a, persistent=False)  # [slots * parts * rank, in]
        self.bs = bs  # [part's out, slots * rank] each
        for index, b in enumerate(bs):
            self.register_buffer(f"b{index}", b, persistent=False)
        self.rank, self.tokens = rank, tokens

    def forward(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if not self.tokens.active:
            return out
        rows = x.reshape(-1, x.shape[-1])
        weights, a, bs = self.tokens.current[: rows.shape[0]], self.a, self.bs  # weights [T, slots]
        if (slot := self.tokens.only) is not None:  # one adapter's rows and columns (views), not every loaded one's
            width, rank = a.shape[0] // weights.shape[1], self.rank
            weights, a = weights[:, slot : slot + 1], a[slot * width : (slot + 1) * width]
            bs = [b[:, slot * rank : (slot + 1) * rank] for b in bs]
        h = (rows @ a.t()).view(rows.shape[0], weights.shape[1], len(bs), self.rank)
        h = torch.where(weights[:, :, None, None] != 0, h, 0.0)  # a select: an overflow times 0 would be NaN
        flat = out.reshape(-1, out.shape[-1])
        if len(bs) == 1:
            return torch.addmm(flat, h.flatten(1), bs[0].t()).view(out.shape)
        bounds = [0]
        for b in bs:
            bounds.append(bounds[-1] + b.shape[0])
        return torch.cat([torch.addmm(flat[:, bounds[p] : bounds[p + 1]], h[:, :, p].flatten(1), b.t())
                          for p, b in enumerate(bs)], dim=1).view(out.shape)


class LoraStack:
    """The adapters served, stacked per linear layer in ``slots`` slots of ``rank`` columns per part. Built once (the
    buffers CUDA graphs read never move); adapters are written into free slots and cleared out of them, between
    steps, while the engine runs. ``targets``: the HF module names that get room (None: every decoder linear)."""

    def __init__(self, model: nn.Module, slots: int, rank: int, targets: set[str] | None, dtype: torch.dtype,
                 device: torch.device) -> None:
        # the head's rows are the sampled positions, not the step's tokens: adapters on it are refused (not a layer);
        # an expert's Linears (AWQ experts) see its routed tokens only, so they take no adapters either
        linears = [m for m in model.modules() if isinstance(m, Linear) and m.prefix != "lm_head"
                   and ".experts." not in m.prefix]
        self.owner = {part: (linear, index) for linear in linears for index, (part, _) in enumerate(linear.parts)}
        self.tokens = LoraTokens(slots, dtype, device)
        self.rank, self.dtype = rank, dtype
        self.linears = [linear for linear in linears
                        if targets is None or any(part in targets for part, _ in linear.parts)]
        for linear in self.linears:
            a = torch.zeros(slots * len(linear.parts) * rank, linear.in_features, dtype=dtype, device=device)
            bs = [torch.zeros(size, slots * rank, dtype=dtype, device=device) for _, size in linear.parts]
            linear.lora = LoraDelta(a, bs, rank, self.tokens)

    def check(self, adapter: LoraAdapter) -> None:
        """CheckpointError for an adapter that does not fit: a module the model lacks or that has no room, a shape
        other than the layer's, a rank above the stack's."""
        if adapter.rank > self.rank:
            raise CheckpointError(f"LoRA adapter {adapter.name!r} has rank {adapter.rank}, above the {self.rank} this "
                                  "engine reserved (--max-lora-rank)")
        for module, (a, b) in adapter.weights.items():
            if module not in self.owner:
                examples = ", ".join(sorted(self.owner)[:3])
                raise CheckpointError(f"LoRA adapter {adapter.name!r} has weights for {module!r}, which is not a "
                                      f"linear layer of this model (those are named like {examples}); infer serves "
                                      "LoRA on the decoder layers' linears")
            linear, index = self.owner[module]
            size = linear.parts[index][1]
            if a.shape[1] != linear.in_features or b.shape[0] != size:
                raise CheckpointError(f"LoRA adapter {adapter.name!r}: {module} has lora_A {tuple(a.shape)} and "
                                      f"lora_B {tuple(b.shape)}, but the layer maps {linear.in_features} to {size} "
                                      "features; was the adapter trained on this base model?")
            largest = max(float(a.abs().max()), float(b.abs().max()) * abs(adapter.scaling))
            if not largest <= torch.finfo(self.dtype).max:
                raise CheckpointError(f"LoRA adapter {adapter.name!r}: {module} holds values up to {largest:.3g} "
                                      f"(lora_B scaled by {adapter.scaling:g}), beyond {self.dtype}'s range; serve "
                                      "the model in a wider dtype (--dtype bfloat16 or float32)")
            if linear.lora is None:
                raise CheckpointError(f"LoRA adapter {adapter.name!r} adapts {module}, which no adapter loaded at "
                                      "start adapts, so the engine reserved no room for it; start the engine with "
                                      "--max-lora-adapters N (then every linear layer has room)")

    def add(self, adapter: LoraAdapter) -> int:
        """Write ``adapter`` (checked) into the lowest free slot and return it; CapacityError when none is free."""
        self.check(adapter)
        used = set(self.tokens.slot_of.values())
        slot = next((s for s in range(self.tokens.num_slots) if s not in used), None)
        if slot is None:
            raise CapacityError(f"cannot load LoRA adapter {adapter.name!r}: all {self.tokens.num_slots} adapter "
                                "slots are taken; unload one, or start the engine with a larger --max-lora-adapters")
        self._write(slot, adapter)
        self.tokens.slot_of[adapter.name] = slot
        return slot

    def remove(self, name: str) -> None:
        """Clear ``name``'s slot (no step may run a token of it afterwards) and free it."""
        self._write(self.tokens.slot_of.pop(name), None)

    def _write(self, slot: int, adapter: LoraAdapter | None) -> None:
        rank = self.rank
        for linear in self.linears:
            delta = linear.lora
            assert isinstance(delta, LoraDelta)
            width = rank * len(linear.parts)
            delta.a[slot * width : (slot + 1) * width] = 0
            for index, ((part, _), b) in enumerate(zip(linear.parts, delta.bs)):
                b[:, slot * rank : (slot + 1) * rank] = 0
                if adapter is not None and part in adapter.weights:
                    part_a, part_b = adapter.weights[part]
                    row = slot * width + index * rank
                    delta.a[row : row + adapter.rank] = part_a.to(self.dtype)
                    b[:, slot * rank : slot * rank + adapter.rank] = (part_b.float() * adapter.scaling).to(self.dtype)
