"""Registers the Llama-family architectures (Llama, Mistral, Qwen2, Qwen3, Phi-3, Gemma 2 and 3, and the MoE Mixtral,
Qwen2-MoE and Qwen3-MoE), their bare backbones (LlamaModel, Qwen3Model...) as the same models, and their sequence
classifiers (LlamaForSequenceClassification...: reward models) as the backbone with a score head."""
from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING, Any

from ..core.config import EngineConfig
from ..core.hookspecs import ModelFactory, hookimpl
from ..core.registry import Register

if TYPE_CHECKING:  # torch loads with the model, not with the plugins (`infer --help` stays fast)
    import torch

    from ..core.interfaces import Model, QuantMethod
    from ..models.layers import PointwiseOps
    from ..models.llama import LlamaFamilyModel

log = logging.getLogger("infer")
DENSE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "Phi3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
ARCHITECTURES = (*DENSE_ARCHITECTURES, "Gemma2ForCausalLM", "Gemma3ForCausalLM", *MOE_ARCHITECTURES)
# each architecture's bare backbone (transformers' AutoModel class of its model_type): embedding checkpoints name it
# (e5-mistral's MistralModel); Gemma3ForCausalLM's is Gemma3TextModel (Gemma3Model is the multimodal one)
BACKBONES = {name.removesuffix("ForCausalLM") + "Model": name for name in ARCHITECTURES
             if name != "Gemma3ForCausalLM"} | {"Gemma3TextModel": "Gemma3ForCausalLM"}
# each architecture's *ForSequenceClassification (transformers' GenericForSequenceClassification: the backbone and a
# `score` linear, hidden -> num_labels, at the last token); Gemma3ForSequenceClassification is the multimodal one's
CLASSIFIERS = {name.removesuffix("ForCausalLM") + "ForSequenceClassification": name for name in ARCHITECTURES
               if name != "Gemma3ForCausalLM"} | {"Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
                                                  "Gemma3ForSequenceClassification": "Gemma3ForConditionalGeneration"}


def build_gemma3_text(hf_config: dict[str, Any], quant: QuantMethod | None, dtype: torch.dtype,
                      config: EngineConfig) -> Model:
    """Gemma3ForConditionalGeneration (gemma-3-4b and larger): its text model; images are not supported."""
    from ..models.gemma import text_config

    log.info("Gemma3ForConditionalGeneration: serving its text model (the vision tower is not loaded: text only)")
    return build_llama_family(text_config(hf_config), quant, dtype, config, multimodal=True)


def build_backbone(hf_config: dict[str, Any], quant: QuantMethod | None, dtype: torch.dtype,
                   config: EngineConfig) -> Model:
    """A bare backbone (Qwen3Model, MistralModel...): its *ForCausalLM twin's model, with an LM head only if the
    checkpoint ships one (else an embedding model)."""
    archs = hf_config["architectures"]
    twin = {**hf_config, "architectures": [BACKBONES[archs[0]], *archs[1:]]}
    return build_llama_family(twin, quant, dtype, config, backbone=True)


def build_classifier(hf_config: dict[str, Any], quant: QuantMethod | None, dtype: torch.dtype,
                     config: EngineConfig) -> Model:
    """A *ForSequenceClassification (a reward model, a classifier): its twin's backbone, no LM head, and a score head
    of config.json's number of labels (transformers' rule, core/classification.py)."""
    from ..core.classification import num_labels

    archs = hf_config["architectures"]
    twin = {**hf_config, "architectures": [CLASSIFIERS[archs[0]], *archs[1:]]}
    if CLASSIFIERS[archs[0]] == "Gemma3ForConditionalGeneration":
        from ..models.gemma import text_config

        model = build_llama_family(text_config(twin), quant, dtype, config, multimodal=True, backbone=True)
    else:
        model = build_llama_family(twin, quant, dtype, config, backbone=True)
    model.add_score_head(num_labels(hf_config))
    return model


def build_llama_family(hf_config: dict[str, Any], quant: QuantMethod | None, dtype: torch.dtype,
                       config: EngineConfig, multimodal: bool = False, backbone: bool = False) -> LlamaFamilyModel:
    from ..core.errors import ConfigError
    from ..models.gemma import ARCHITECTURES as GEMMAS
    from ..models.gemma import GemmaConfig, GemmaModel
    from ..models.llama import ArchConfig, LlamaFamilyModel

    gemma = hf_config["architectures"][0] in GEMMAS
    arch = GemmaConfig.from_hf(hf_config) if gemma else ArchConfig.from_hf(hf_config)
    import torch

    if gemma and dtype == torch.float16:
        raise ConfigError(f"{arch.architecture} overflows float16 (Gemma's activations pass 65504, and vLLM refuses "
                          "Gemma 2 and 3 in float16 too); use --dtype bfloat16 or float32")
    # linear RoPE scaling stretches the trained positions by its factor (e.g. a 4k model run at 16k), YaRN the
    # original context (vLLM's rule: Qwen2.5's 32k max_position_embeddings at factor 4 is 128k); llama3 and
    # LongRoPE configs already state the extended length; dynamic NTK runs within max_position_embeddings, where HF
    # keeps the default frequencies (vLLM instead scales them for max_position_embeddings x factor, at every length)
    scaling = arch.rope.get("rope_type", arch.rope.get("type", "default"))
    limit = arch.max_position_embeddings
    # Gemma 3's 131072 positions count its factor 8 already (trained at 32k)
    if scaling == "linear" and arch.architecture != "Gemma3ForCausalLM":
        limit = int(limit * float(arch.rope["factor"]))
    elif scaling == "yarn":
        limit = int(float(arch.rope["original_max_position_embeddings"]) * float(arch.rope["factor"]))
    # the scaled context by default, as vLLM derives it; LongRoPE's original one (vLLM's default too): past it,
    # every position turns by long_factor (see models/layers.py longrope_inv_freq)
    original = int(arch.rope["original_max_position_embeddings"]) if scaling == "longrope" else limit
    max_len = config.max_model_len or min(limit, original)
    if max_len > limit:
        dynamic = "; past it, HF's dynamic NTK scaling changes the RoPE frequencies with each sequence's length, " \
            "which infer does not follow" if scaling == "dynamic" else ""
        raise ConfigError(f"max-model-len {max_len} exceeds the {limit} positions the model supports "
                          f"(max_position_embeddings {arch.max_position_embeddings}, rope {scaling}{dynamic}); use "
                          f"--max-model-len <= {limit}")
    if max_len > original:
        log.info("LongRoPE: the %d-position context exceeds the original %d, so every position turns by long_factor "
                 "(vLLM's rule); HF turns sequences within %d positions by short_factor", max_len, original, original)
    elif config.max_model_len is None and limit > original:
        log.info("LongRoPE: serving the original %d positions, turned by short_factor (vLLM's default); "
                 "--max-model-len up to %d serves more, every position then turned by long_factor", original, limit)
    merge = config.fuse_projections
    if merge is None:
        from ..core.loader import resolve_device

        merge = resolve_device(config.device).type == "cuda"
    ops = pointwise_ops(config)
    if quant is None and config.skinny_gemm_rows:
        from ..core.loader import resolve_device, triton_runs_on
        from ..models.layers import UnquantizedMethod

        if not triton_runs_on(resolve_device(config.device)):
            raise ConfigError("--skinny-gemm-rows runs a Triton kernel, which needs a CUDA device (this model runs "
                              "on the CPU); drop --skinny-gemm-rows")
        quant = UnquantizedMethod(config.skinny_gemm_rows)  # every linear, and the tied head, share it
    if gemma:
        model = GemmaModel(arch, quant, dtype, max_positions=max_len, ops=ops, merge_projections=merge,
                           multimodal=multimodal, backbone=backbone)
    else:
        model = LlamaFamilyModel(arch, quant, dtype, max_positions=max_len, ops=ops, merge_projections=merge,
                                 backbone=backbone)
    model.spec = dataclasses.replace(model.spec, graph_blocker=experts_loop_blocker(model, config))
    return model


def experts_loop_blocker(model: LlamaFamilyModel, config: EngineConfig) -> str | None:
    """Why CUDA graphs cannot capture the model (ModelSpec.graph_blocker): experts run by the torch loop, which
    reads each layer's expert counts back to the host. The loop runs quantized experts that the stacked kernels do
    not run (not all int4 in the AWQ layout, nor all W8A16), and any experts without the fused Triton ops; the fused
    Triton experts (unquantized, FP8, int4 or int8, the default on CUDA) are capturable."""
    from ..models.moe import SparseMoe

    blocks = [module for module in model.modules() if isinstance(module, SparseMoe)]
    architecture = model.cfg.architecture
    if any(block.unstackable for block in blocks):
        return (f"{architecture} runs its quantized experts by the torch loop (one expert's Linears at a time): "
                "infer stacks experts whose gate, up and down projections are all int4 (AWQ, GPTQ) or all 8-bit "
                "(GPTQ, compressed-tensors) only")
    if any(not block.fused for block in blocks):
        why = "with --no-fused-ops" if config.fused_ops is False else \
            "without the fused Triton ops (the CUDA default)"
        return f"{architecture} {why} runs its experts by the torch loop"
    return None


def pointwise_ops(config: EngineConfig) -> PointwiseOps:
    """Torch ops, or the fused Triton kernels: on CUDA unless ``fused_ops`` is False, elsewhere only on request
    (CPU tensors under TRITON_INTERPRET=1, for tests)."""
    from ..core.errors import ConfigError
    from ..core.loader import resolve_device, triton_runs_on
    from ..models.layers import TORCH_OPS, triton_ops

    on_cuda = resolve_device(config.device).type == "cuda"
    if not (on_cuda if config.fused_ops is None else config.fused_ops):
        return TORCH_OPS
    if not triton_runs_on(resolve_device(config.device)):
        raise ConfigError("--fused-ops runs Triton kernels, which need a CUDA device (this model runs on the CPU); "
                          "drop --fused-ops")
    try:
        return triton_ops()
    except ImportError as exc:
        if config.fused_ops is None:  # the default on CUDA: say why, run the torch ops
            log.warning("fused ops are off: triton cannot be imported (%s)", exc)
            return TORCH_OPS
        raise ConfigError(f"--fused-ops needs triton, which cannot be imported ({exc}); use --no-fused-ops") from exc


@hookimpl
def register_models(register: Register[ModelFactory]) -> None:
    for name in ARCHITECTURES:
        register(name, build_llama_family)
    for name in BACKBONES:
        register(name, build_backbone)
    for name in CLASSIFIERS:
        register(name, build_classifier)
    register("Gemma3ForConditionalGeneration", build_gemma3_text)
