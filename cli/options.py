"""Group options: every engine option, parsed into an EngineConfig (also used by `infer bench --ab` arms)."""
from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from ..core.config import COMPONENT_FIELDS, SCHEDULING_POLICIES, EngineConfig
from ..core.plugins import PluginManager
from ..core.request import processor_args_text

log = logging.getLogger("infer")


# the per-request sampling options: SamplingParams field, type, default (greedy, no filters, no controls), help
_SAMPLING: list[tuple[str, type, float, str]] = [
    ("temperature", float, 0.0, "0 is greedy."),
    ("top_p", float, 1.0, "Nucleus sampling, in (0, 1]."),
    ("top_k", int, 0, "0 disables."),
    ("min_p", float, 0.0, "Drop tokens below this fraction of the top probability, in [0, 1)."),
    ("repetition_penalty", float, 1.0, "Divide the positive logits (multiply the negative ones) of tokens in the "
                                       "prompt or output by this, in (0, 1000]; 1 is off, > 1 discourages repeats."),
    ("frequency_penalty", float, 0.0, "Subtract this x a token's count in the output from its logit, in [-2, 2]."),
    ("presence_penalty", float, 0.0, "Subtract this from the logit of every token already in the output, in [-2, 2]."),
    ("min_tokens", int, 0, "EOS and stop token ids cannot be sampled before this many tokens, nor can a stop string "
                           "end in their text."),
]


class LogitBiasType(click.ParamType):
    """``TOKEN=BIAS`` (--logit-bias): a token id and the bias added to its logit."""
    name = "token=bias"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[int, float]:
        if isinstance(value, tuple):
            return value
        token, _, bias = str(value).partition("=")
        try:
            return int(token), float(bias)
        except ValueError:
            self.fail(f"{value!r} is not TOKEN=BIAS (a token id, then a number in [-100, 100], e.g. 1234=-100)",
                      param, ctx)


def unique_tokens(pairs: tuple[tuple[int, float], ...]) -> tuple[tuple[int, float], ...]:
    """--logit-bias values, each token once (a second value for a token is an error, not a silent override)."""
    tokens = [token for token, _ in pairs]
    if twice := sorted({token for token in tokens if tokens.count(token) > 1}):
        raise click.BadParameter(f"token {twice[0]} is given twice; give each token one bias",
                                 param_hint="'--logit-bias'")
    return pairs


class ProcessorType(click.ParamType):
    """``NAME`` or ``NAME=JSON`` (--logits-processor): a registered logits processor and its arguments."""
    name = "name[=json]"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> tuple[str, str]:
        if isinstance(value, tuple):
            return value
        name, _, args = str(value).partition("=")
        try:
            parsed = json.loads(args) if args else {}
        except ValueError as exc:
            self.fail(f"{value!r}: the arguments after = are not JSON ({exc}); write NAME='{{\"size\": 3}}'", param,
                      ctx)
        if not name or not isinstance(parsed, dict):
            self.fail(f"{value!r} is not NAME or NAME=JSON (a processor's name, then a JSON object of its arguments, "
                      "e.g. no-repeat-ngram='{\"size\": 3}')", param, ctx)
        return name, processor_args_text(parsed)


SAMPLING_DEFAULTS: dict[str, Any] = {name: default for name, _, default, _ in _SAMPLING} | {
    "logit_bias": (), "logits_processors": ()}
SAMPLING_OPTIONS: list[Callable[[Any], Any]] = [
    click.option(f"--{name.replace('_', '-')}", type=kind, default=default, show_default=True, help=text)
    for name, kind, default, text in _SAMPLING] + [
    click.option("--logit-bias", type=LogitBiasType(), multiple=True,
                 callback=lambda ctx, param, pairs: unique_tokens(pairs),
                 help="TOKEN=BIAS: add BIAS, in [-100, 100], to the token's logit (repeatable; -100 all but bans "
                      "it, 100 all but forces it)."),
    click.option("--logits-processor", "logits_processors", type=ProcessorType(), multiple=True,
                 help="NAME or NAME=JSON: a registered logits processor and its arguments, applied to each "
                      "request's logits before sampling, or to each beam's log-probabilities with --beam-width "
                      "(repeatable, in order; `infer plugins` lists them), e.g. no-repeat-ngram='{\"size\": 3}'.")]


def sampling_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """The per-request sampling options shared by `generate`, `client` and `bench`. The command receives them as
    one ``sampling`` keyword: a dict of SamplingParams fields."""
    @functools.wraps(fn)
    def collect(*args: Any, **kwargs: Any) -> Any:
        return fn(*args, sampling={name: kwargs.pop(name) for name in SAMPLING_DEFAULTS}, **kwargs)

    for option in reversed(SAMPLING_OPTIONS):
        collect = option(collect)
    return collect


def _parse_template_kwargs(ctx: click.Context, param: click.Parameter, text: str | None) -> dict[str, Any]:
    from ..core.chat import parse_template_kwargs
    from ..core.errors import InvalidRequestError

    try:
        return parse_template_kwargs(text, param.opts[0])
    except InvalidRequestError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


chat_template_kwargs_option = click.option(
    "--chat-template-kwargs", default=None, metavar="JSON", callback=_parse_template_kwargs,
    help="More variables for the chat template, as a JSON object, e.g. '{\"enable_thinking\": false}' for Qwen3; "
         "each must be one the template reads [default: none].")


def _read_tools(ctx: click.Context, param: click.Parameter, path: str | None) -> tuple[dict[str, Any], ...]:
    from ..core.chat_tools import parse_tools
    from ..core.errors import InvalidRequestError

    if path is None:
        return ()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path!r} ({exc}); give a UTF-8 JSON file", ctx, param) from None
    try:
        return parse_tools(text, f"{param.opts[0]} {path!r}")
    except InvalidRequestError as exc:
        raise click.BadParameter(str(exc), ctx, param) from None


tools_option = click.option(
    "--tools", default=None, metavar="FILE", callback=_read_tools,
    help="A JSON file holding a list of OpenAI tool definitions ({\"type\": \"function\", \"function\": {\"name\": "
         "..., \"parameters\": {...}}}) that the chat template shows the model; its calls come back as text in the "
         "model's own format [default: none].")


tool_choice_option = click.option(
    "--tool-choice", default="auto", show_default=True, metavar="CHOICE",
    help="With --tools: auto (the --tool-parser, the server's for infer client, if any, reads the reply), none "
         "(the reply is not read for calls), required (the reply is forced to be one call or more of the tools, "
         "JSON under their parameter schemas) or a function's NAME (the reply is forced to be one call of it; a "
         "function called auto, none or required: OpenAI's JSON object {\"type\": \"function\", \"function\": "
         "{\"name\": ...}}).")


def tool_choice_of(text: str, tools: tuple[dict[str, Any], ...]) -> object:
    """A --tool-choice as ChatPrompt.of takes it: what the gRPC field takes (a word of TOOL_CHOICES, OpenAI's JSON
    object), else the function that ``text`` names."""
    from ..core.chat_tools import TOOL_CHOICES, FunctionChoice, parse_tool_choice

    if text in TOOL_CHOICES or text.lstrip().startswith("{"):
        return parse_tool_choice(text, "--tool-choice", tools)
    return FunctionChoice(text)


def _read_json_schema(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path!r} ({exc}); give a UTF-8 JSON file", ctx, param) from None
    try:
        json.loads(text)
    except ValueError as exc:
        raise click.BadParameter(f"{path!r} is not JSON ({exc})", ctx, param) from None
    return text


def _read_grammar(ctx: click.Context, param: click.Parameter, path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.BadParameter(f"cannot read {path!r} ({exc}); give a UTF-8 GBNF file", ctx, param) from None


STRUCTURE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--regex", default=None, metavar="PATTERN",
                 help="Each completion is a whole match of this regular expression (Python re syntax without "
                      "lookarounds or backreferences) [default: free text]."),
    click.option("--choice", multiple=True, metavar="TEXT",
                 help="Each completion is exactly one of these strings (repeatable) [default: free text]."),
    click.option("--json-schema", default=None, metavar="FILE", callback=_read_json_schema,
                 help="Each completion is a JSON document valid under the JSON schema in FILE (the keywords "
                      "supported: docs/cli.md) [default: free text]."),
    click.option("--grammar", default=None, metavar="FILE", callback=_read_grammar,
                 help="Each completion is a sentence of the GBNF grammar in FILE (llama.cpp's format, from its rule "
                      "root; recursion allowed, left recursion refused: docs/cli.md) [default: free text]."),
]


def structured_output_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """--regex, --choice, --json-schema and --grammar: the command receives one ``structured_output`` keyword, a
    StructuredOutput or None (a usage error when more than one is given)."""
    @functools.wraps(fn)
    def collect(*args: Any, **kwargs: Any) -> Any:
        from ..core.request import STRUCTURE_FIELDS, StructuredOutput

        given = {name: value for name in STRUCTURE_FIELDS
                 if (value := kwargs.pop(name)) is not None and value != ()}
        if len(given) > 1:
            raise click.UsageError(f"give one of --regex, --choice, --json-schema and --grammar, not "
                                   f"{' and '.join('--' + name.replace('_', '-') for name in given)}")
        return fn(*args, structured_output=StructuredOutput(**given) if given else None, **kwargs)

    for option in reversed(STRUCTURE_OPTIONS):
        collect = option(collect)
    return collect


def refuse_beside_beam_search(given: list[str]) -> None:
    """--beam-width's usage error for the options ``given`` with it."""
    if given:
        raise click.UsageError(f"--beam-width ranks whole beams by the model's own log-probabilities, with no "
                               f"sampling, logit controls or per-token output: drop {', '.join(given)}")


def sampling_option(name: str) -> str:
    """The command-line name of the sampling option that sets SamplingParams field ``name``."""
    return "--logits-processor" if name == "logits_processors" else f"--{name.replace('_', '-')}"


def changed_sampling(sampling: dict[str, Any], beam_search: bool = False) -> list[str]:
    """The options of ``sampling`` that differ from their defaults, by their command-line names; with
    ``beam_search``, those that beam search does not take (it takes --logits-processor)."""
    return [sampling_option(name) for name, value in sampling.items() if value != SAMPLING_DEFAULTS[name]
            and not (beam_search and name == "logits_processors")]


class ReserveType(click.ParamType):
    """A share in [0, 1] or ``auto`` (--kv-admission-reserve)."""
    name = "reserve"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float | str:
        if isinstance(value, (int, float)) or value == "auto":
            return value
        try:
            return float(value)
        except ValueError:
            self.fail(f"{value!r} is neither a number in [0, 1] nor auto", param, ctx)

ENGINE_OPTIONS: list[Callable[[Any], Any]] = [
    click.option("--model", "-m", default=None, help="Local HF model folder (default: the embedded demo model)."),
    click.option("--plugin", "plugins", multiple=True, metavar="NAME",
                 help="Select a registered component by name, whatever its kind (repeatable)."),
    click.option("--scheduler", default=None,
                 help="Scheduler: continuous or chunked-prefill, or a plugin's [default: continuous]."),
    click.option("--kv-cache", default=None, help="KV cache: paged or radix-cache, or a plugin's [default: paged]."),
    click.option("--attention", default=None, help="Attention backend: triton, cpu or torch [default: triton on CUDA, "
                 "else cpu (torch without a C compiler)]."),
    click.option("--quant", default=None, help="Quantization method: awq or fp8 quantize a float checkpoint on "
                 "load; quantized checkpoints (awq, gptq, auto-round, compressed-tensors, fp8) need none [default: "
                 "from the checkpoint]."),
    click.option("--eviction-policy", default=None, help="Eviction policy for cached KV blocks: lru, lfu or "
                 "priority, or a plugin's [default: lru]."),
    click.option("--dtype", type=click.Choice(["auto", "float32", "bfloat16", "float16"]), default=None,
                 help="Weight and activation dtype [default: auto: float32 on CPU; on GPU float16 for a float16 "
                      "checkpoint, else bfloat16]."),
    click.option("--device", default=None, help="auto, cpu, cuda or cuda:N [default: auto]."),
    click.option("--max-num-seqs", type=int, default=None, help="Most sequences in one step [default: 256]."),
    click.option("--max-num-batched-tokens", type=int, default=None, help="Token budget of one step [default: 8192]."),
    click.option("--max-model-len", type=int, default=None, help="Context length [default: the model's]."),
    click.option("--block-size", type=int, default=None, help="Tokens per KV block [default: 16]."),
    click.option("--num-kv-blocks", type=int, default=None,
                 help="Size of the KV pool in blocks (overrides --kv-cache-memory-gb)."),
    click.option("--kv-cache-memory-gb", type=float, default=None,
                 help="KV pool as a memory budget [default: 90% of free GPU memory less 1 GiB, or up to 2 GiB "
                      "on CPU]."),
    click.option("--kv-cache-dtype", type=click.Choice(["auto", "fp8"]), default=None,
                 help="KV element type: auto (the model dtype) or fp8 (e4m3 with per-head scales calibrated at "
                      "start: half the memory of bf16, so twice the blocks) [default: auto]."),
    click.option("--no-prefix-caching", is_flag=True, default=False, help="Disable prefix caching."),
    click.option("--preemption", "preemption_mode", type=click.Choice(["recompute", "swap"]), default=None,
                 help="What a preempted sequence does with its KV [default: recompute]."),
    click.option("--swap-space-gb", type=float, default=None, help="Host memory for --preemption swap [default: 4]."),
    click.option("--scheduling-policy", type=click.Choice(SCHEDULING_POLICIES), default=None,
                 help="Order of requests: fcfs (arrival), priority (higher request priority first, ties by "
                      "arrival; a request that does not fit preempts lower-priority ones) or lpm (the longest "
                      "cached prefix first) [default: fcfs]."),
    click.option("--priority-aging-s", type=float, default=None, metavar="SECONDS",
                 help="With --scheduling-policy priority: a request gains one priority level per SECONDS since it "
                      "arrived, so only more important requests that arrive within SECONDS per level after it go "
                      "first, and none waits for ever [default: no aging]."),
    click.option("--kv-admission-reserve", type=ReserveType(), default=None, metavar="R|auto",
                 help="Admit a waiting request only if the KV blocks left after its prompt cover R x the blocks that "
                      "the running sequences and it still need to reach their max_tokens, so fewer are preempted "
                      "later; 0 admits whenever the prompt fits; auto: R starts at 0.7, falls to 0.1 over 600 "
                      "steps without a preemption, back to 0.7 at each one [default: 0]."),
    click.option("--seed", type=int, default=None, help="Seed of unseeded sampling, in [0, 2**63) [default: 0]."),
    click.option("--cpu-threads", type=int, default=None,
                 help="torch intra-op threads on CPU [default: torch's]; 1 is fastest for tiny models on a busy host."),
    click.option("--no-cuda-graphs", is_flag=True, default=False, help="Run every step eagerly on CUDA."),
    click.option("--cuda-graph-max-tokens", type=int, default=None, metavar="N",
                 help="Prefill and mixed steps of up to N tokens replay CUDA graphs (padded to the next of a ladder "
                      "of token counts) where the attention backend can; 0: they run eagerly [default: 2048, or "
                      "--max-num-batched-tokens when smaller]."),
    click.option("--fused-ops/--no-fused-ops", default=None,
                 help="Fused Triton kernels for the model's norms, rotary and SiLU-and-mul [default: on with CUDA]."),
    click.option("--skinny-gemm-rows", type=int, default=None, metavar="N",
                 help="Unquantized linears of steps with at most N rows (<= 16) run infer's skinny Triton GEMM "
                      "instead of cuBLAS, on CUDA in fp16/bf16 [default: 0, off: not yet timed on a GPU]."),
    click.option("--fuse-projections/--no-fuse-projections", default=None,
                 help="Merge each layer's q/k/v and gate/up projections into one GEMM each after loading, where the "
                      "quant method can [default: on with CUDA]."),
    click.option("--async-output/--no-async-output", default=None,
                 help="Build a step's outputs (detokenization, stop strings) during the next step's forward pass, "
                      "one step later [default: on with CUDA]."),
    click.option("--async-scheduling/--no-async-scheduling", default=None,
                 help="Schedule and launch each step before reading the previous step's tokens back, so the device "
                      "need not idle while the host prepares the next step (implies --async-output; not with "
                      "speculative decoding) [default: on with CUDA unless a proposer is set or --no-async-output]."),
    click.option("--freeze-gc/--no-freeze-gc", default=None,
                 help="After start-up, freeze the Python heap out of the garbage collector's scans, so that no full "
                      "collection stalls a step [default: on for serve and bench arms, off elsewhere]."),
    click.option("--proposer", default=None,
                 help="Speculative-decoding proposer: draft-model, ngram, or jump-forward (structured output only) "
                      "[default: none, no speculation]."),
    click.option("--draft-model", default=None, metavar="DIR",
                 help="Draft checkpoint for --proposer draft-model; it must share the target's tokenizer "
                      "[default: the shipped draft, with the embedded default model]."),
    click.option("--lora", "lora", multiple=True, metavar="NAME=DIR",
                 callback=lambda ctx, param, value: parse_lora_adapters(value),
                 help="Serve the LoRA adapter that PEFT's save_pretrained wrote to DIR under NAME (repeatable, at "
                      "most 16); a request picks it with --lora-adapter NAME (SamplingParams.lora_adapter) "
                      "[default: none]."),
    click.option("--max-lora-adapters", type=int, default=None, metavar="N",
                 help="LoRA adapter slots (at most 16), so that adapters can be loaded and unloaded while the engine "
                      "runs (Engine.load_lora_adapter, the LoadLoraAdapter RPC) beside the --lora ones; every "
                      "decoder linear then gets room [default: as many as --lora adapters]."),
    click.option("--max-lora-rank", type=int, default=None, metavar="R",
                 help="The largest rank an adapter slot holds (1-512) [default: the largest --lora adapter's, and "
                      "at least 16 with --max-lora-adapters above their count]."),
    click.option("--tool-parser", default=None, metavar="NAME",
                 help="Read the tool calls out of the replies of chats that offer tools, in the model's format: "
                      "hermes (Qwen 2.5/3, Hermes), llama3-json (Llama 3.1/3.2), pythonic (Llama 3.2/4) or mistral "
                      "(Mistral's [TOOL_CALLS]), or a plugin's [default: none: replies stay text]."),
    click.option("--reasoning-parser", default=None, metavar="NAME",
                 help="Split the replies of chats into reasoning and content: qwen3 (a <think> block the reply "
                      "opens), deepseek-r1 (a block the template opens in the prompt), or a plugin's [default: none: "
                      "replies stay text]."),
    click.option("--structured-output-backend", default=None, metavar="NAME",
                 help="Compiles each request's structured output (--regex, --choice, --json-schema, --grammar; "
                      "SamplingParams.structured_output) into token masks: fsm, or a plugin's [default: fsm]."),
    click.option("--chat-template", default=None, metavar="FILE",
                 help="A Jinja chat template file that renders conversations (infer chat, chat prompts) in place of "
                      "the model's own [default: the tokenizer's chat_template, if any]."),
    click.option("--sanitize-chat-control-tokens/--no-sanitize-chat-control-tokens", default=None,
                 help="Encode a control token's text typed in a chat message (a user's '<|im_end|>') as plain text, "
                      "so that only the template writes control tokens and a user cannot forge a turn; for a server "
                      "open to untrusted users [default: off, as HF transformers and vLLM render chats]."),
    click.option("--default-chat-template-kwargs", default=None, metavar="JSON",
                 callback=lambda ctx, param, text: None if text is None else _parse_template_kwargs(ctx, param, text),
                 help="Template variables of every chat prompt, as a JSON object, e.g. '{\"enable_thinking\": "
                      "false}'; each must be one the template reads, and a request's own chat_template_kwargs win "
                      "[default: none]."),
    click.option("--num-speculative-tokens", type=int, default=None, metavar="K",
                 help="Draft tokens verified per step and sequence when a proposer is selected, 0-16 [default: 0; "
                      "a proposer needs K >= 1]."),
    click.option("--spec-min-acceptance", type=float, default=None, metavar="A",
                 help="Turn speculation off while the recent acceptance rate is below A (probing now and then; "
                      "not before 8 verified sequence-rounds) [default: 0, never]."),
    click.option("--spec-max-batch-size", type=int, default=None, metavar="B",
                 help="Turn speculation off in steps that run more than B sequences [default: 0, no limit]."),
    click.option("--plugin-option", "plugin_option", multiple=True, metavar="NAMESPACE.KEY=VALUE",
                 callback=lambda ctx, param, value: parse_plugin_options(value),
                 help="Set EngineConfig.plugin_options[NAMESPACE][KEY], an option of one plugin (repeatable); "
                      "VALUE is read as JSON when it parses (8, true, \"x\"), else as text. E.g. "
                      "--plugin-option awq.fused_max_rows=32."),
]


def lora_adapter_option(where: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """--lora-adapter NAME of a command that builds an engine: the adapter applied ``where``."""
    return click.option("--lora-adapter", default=None, metavar="NAME", help=f"Apply the LoRA adapter loaded as "
                        f"NAME (the group's --lora NAME=DIR) {where} [default: none, the base model].")


def parse_lora_adapters(items: tuple[str, ...]) -> dict[str, str] | None:
    """``("name=dir", ...)`` -> ``{"name": "dir"}`` (None when none). Raises click.BadParameter."""
    adapters: dict[str, str] = {}
    for item in items:
        name, sep, folder = item.partition("=")
        if not (sep and name and folder):
            raise click.BadParameter(f"{item!r} is not NAME=DIR (e.g. sql=adapters/sql)", param_hint="'--lora'")
        if name in adapters:
            raise click.BadParameter(f"adapter name {name!r} is given twice", param_hint="'--lora'")
        adapters[name] = folder
    return adapters or None


def parse_plugin_options(items: tuple[str, ...]) -> dict[str, Any]:
    """``("ns.key=value", ...)`` -> ``{"plugin_options.ns.key": value}``. Raises click.BadParameter."""
    import json

    parsed: dict[str, Any] = {}
    for item in items:
        target, sep, text = item.partition("=")
        namespace, dot, key = target.rpartition(".")  # keys have no '.'; a component's name may
        if not (sep and dot and namespace and key):
            raise click.BadParameter(f"{item!r} is not NAMESPACE.KEY=VALUE (e.g. awq.fused_max_rows=32)",
                                     param_hint="'--plugin-option'")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        parsed[f"plugin_options.{namespace}.{key}"] = value
    return parsed

FIELD_OF_OPTION = {
    "model": "model", "scheduler": "scheduler", "kv_cache": "kv_cache", "attention": "attention", "quant": "quant",
    "eviction_policy": "eviction_policy", "dtype": "dtype", "device": "device", "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens", "max_model_len": "max_model_len",
    "block_size": "block_size", "num_kv_blocks": "num_kv_blocks", "kv_cache_memory_gb": "kv_cache_memory_gb",
    "kv_cache_dtype": "kv_cache_dtype",
    "seed": "seed", "cpu_threads": "cpu_threads", "fused_ops": "fused_ops",
    "cuda_graph_max_tokens": "cuda_graph_max_tokens", "skinny_gemm_rows": "skinny_gemm_rows",
    "fuse_projections": "fuse_projections", "async_output": "async_output",
    "async_scheduling": "async_scheduling",
    "freeze_gc": "freeze_gc",
    "preemption_mode": "preemption_mode", "swap_space_gb": "swap_space_gb", "scheduling_policy": "scheduling_policy",
    "priority_aging_s": "priority_aging_s",
    "kv_admission_reserve": "kv_admission_reserve",
    "proposer": "proposer", "draft_model": "draft_model", "num_speculative_tokens": "num_speculative_tokens",
    "lora": "lora_adapters", "max_lora_adapters": "max_lora_adapters", "max_lora_rank": "max_lora_rank",
    "tool_parser": "tool_parser", "reasoning_parser": "reasoning_parser",
    "structured_output_backend": "structured_output_backend",
    "chat_template": "chat_template", "default_chat_template_kwargs": "default_chat_template_kwargs",
    "sanitize_chat_control_tokens": "sanitize_chat_control_tokens",
    # "plugin_options.NAMESPACE.KEY": one plugin's option, set in EngineConfig.plugin_options[NAMESPACE][KEY]
    "spec_min_acceptance": "plugin_options.spec_decode.min_acceptance",
    "spec_max_batch_size": "plugin_options.spec_decode.max_batch_size",
}


def refuse_engine_options(ctx: click.Context, command: str, advice: str = "") -> None:
    """For a command that builds no engine: group options given before it would be ignored without a word, so
    they are a usage error naming them."""
    args = ctx.find_object(EngineArgs)
    if args is None:
        return
    option_of = {name: value for value, name in FIELD_OF_OPTION.items()}
    given = {"--plugin-option" if key.startswith("plugin_options.") else
             "--" + option_of.get(key, key).replace("_", "-") for key in args.values}
    given |= {"--plugin"} if args.plugin_names else set()
    given |= {flag for flag, on in (("--no-prefix-caching", args.no_prefix_caching),
                                    ("--no-cuda-graphs", args.no_cuda_graphs)) if on}
    if given:
        raise click.UsageError(f"the options before `{command}` ({', '.join(sorted(given))}) configure an engine, "
                               f"which `infer {command}` does not build; drop them{advice}")


def engine_options(func: Callable[..., Any]) -> Callable[..., Any]:
    for option in reversed(ENGINE_OPTIONS):
        func = option(func)
    return func


@dataclass
class EngineArgs:
    """Parsed group options; ``build`` turns them into a validated EngineConfig against a plugin manager."""

    values: dict[str, Any] = field(default_factory=dict)
    plugin_names: list[str] = field(default_factory=list)
    no_prefix_caching: bool = False
    no_cuda_graphs: bool = False

    @classmethod
    def from_kwargs(cls, kwargs: dict[str, Any]) -> EngineArgs:
        values = {FIELD_OF_OPTION[k]: v for k, v in kwargs.items() if k in FIELD_OF_OPTION and v is not None}
        values.update(kwargs.get("plugin_option") or {})
        return cls(values, list(kwargs.get("plugins") or ()), bool(kwargs.get("no_prefix_caching")),
                   bool(kwargs.get("no_cuda_graphs")))

    def build(self, plugins: PluginManager, **defaults: Any) -> EngineConfig:
        """The EngineConfig of these options; ``defaults``: a command's own defaults for fields not given (`serve`
        and the bench arms freeze the heap, say)."""
        fields = {**defaults, **{k: v for k, v in self.values.items() if not k.startswith("plugin_options.")}}
        config = EngineConfig(**fields)
        for key, value in self.values.items():
            if key.startswith("plugin_options."):
                namespace, _, name = key.removeprefix("plugin_options.").rpartition(".")
                config.plugin_options.setdefault(namespace, {})[name] = value
        if self.no_prefix_caching:
            config.enable_prefix_caching = False
        if self.no_cuda_graphs:
            config.cuda_graphs = False
        explicit = {k: v for k, v in self.values.items() if k in COMPONENT_FIELDS.values()}
        config = plugins.select_components(config, self.plugin_names, explicit)  # an explicit option wins
        for kind, name in (("scheduler", config.scheduler), ("kv_cache", config.kv_cache),
                           ("eviction_policy", config.eviction_policy)):
            plugins.registry(kind).entry(name)  # unknown names fail here, listing the choices
        if config.attention:
            plugins.registry("attention_backend").entry(config.attention)
        if config.quant:
            plugins.registry("quant_method").entry(config.quant)
        if config.proposer:
            plugins.registry("proposer").entry(config.proposer)
        if config.tool_parser:
            plugins.registry("tool_parser").entry(config.tool_parser)
        if config.reasoning_parser:
            plugins.registry("reasoning_parser").entry(config.reasoning_parser)
        if config.structured_output_backend != EngineConfig.structured_output_backend:  # the default: at first use
            plugins.registry("structured_output_backend").entry(config.structured_output_backend)
        config = config.validate()  # a bad value is an error first, not a warning about its use
        if "swap_space_gb" in self.values and config.preemption_mode != "swap":
            log.warning("--swap-space-gb is unused: it sizes the host swap of --preemption swap, and preemption is %r",
                        config.preemption_mode)
        return config
