"""LLM: the offline convenience wrapper around an Engine."""
from __future__ import annotations

import dataclasses
import difflib
import os
from collections.abc import Mapping, Sequence as Seq
from typing import Any

from .admission import at_prompt, check_prompt_list
from .beam_search import BeamSearchOutput, BeamSearchParams
from .chat import ChatMessage, ChatPrompt, Prompt
from .chat_tools import checked_tools
from .config import COMPONENT_FIELDS, EngineConfig
from .engine import Engine
from .errors import ConfigError, InferError
from .plugins import PluginManager, checked_manager
from .pooling import PoolingParams
from .request import RequestOutput, SamplingParams


class LLM:
    """Offline API: ``LLM(model=DIR, **options).generate(prompts, SamplingParams(...))``. Not thread-safe, as its
    Engine: a call from a second thread while one runs raises RuntimeError."""

    def __init__(self, model: str | None = None, plugins: PluginManager | None = None, plugin: Seq[str] = (),
                 **options: Any) -> None:
        """``options``: EngineConfig fields. ``plugin``: component names, as ``infer --plugin NAME`` (a field
        given in ``options`` wins, with a warning, as on the command line). ``plugins``: the PluginManager
        (default: every installed plugin)."""
        if isinstance(plugin, str):
            plugin = [plugin]
        if not isinstance(plugin, (list, tuple)) or not all(isinstance(name, str) for name in plugin):
            raise ConfigError(f"plugin must be a component name or a list of them (as --plugin NAME), got {plugin!r}")
        fields = {f.name for f in dataclasses.fields(EngineConfig)}
        if unknown := sorted(set(options) - fields):
            hints = "".join(f" (did you mean {close[0]!r}?)" for name in unknown
                            if (close := difflib.get_close_matches(name, fields, n=1)))
            raise ConfigError(f"LLM() got unknown option(s) {', '.join(unknown)}{hints}; the options are the fields "
                              "of infer.core.config.EngineConfig (docs/cli.md lists them as command-line options)")
        config = EngineConfig(model=model, **options)
        plugins = checked_manager(plugins) or PluginManager.from_entry_points()
        explicit = {k: v for k, v in options.items() if k in COMPONENT_FIELDS.values()}
        config = plugins.select_components(config, list(plugin), explicit)  # as the CLI chooses and checks
        self.engine = Engine(config, plugins)

    def generate(self, prompts: Prompt | Seq[Prompt],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[RequestOutput]:
        return self.engine.generate(_as_list(prompts), params)

    def chat(self, messages: Seq[Mapping[str, Any] | ChatMessage] | Seq[Seq[Mapping[str, Any] | ChatMessage]],
             params: SamplingParams | Seq[SamplingParams] | None = None, add_generation_prompt: bool = True,
             continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
             tools: Seq[Mapping[str, Any]] | None = None, tool_choice: object = None) -> list[RequestOutput]:
        """Answer one conversation (a list of ``{"role": ..., "content": ...}`` messages or ChatMessages) or
        several (a list of such lists), each rendered by the model's chat template (core/chat.py); one
        RequestOutput per conversation, in order. ``add_generation_prompt=False`` renders the messages alone;
        ``continue_final_message=True`` (with it) leaves the last message open for the model to continue;
        ``chat_template_kwargs`` sets more template variables (``{"enable_thinking": False}``, say); ``tools`` are
        the functions the model may call (OpenAI's definitions; its calls come back as text in the model's own
        format, read into each reply's ``tool_calls`` by the engine's ``tool_parser`` if it has one; its
        ``reasoning_parser`` splits off the reasoning first, into ``reasoning_content``);
        ``tool_choice`` is OpenAI's: "auto" (the default), "none" (the reply is not read for calls), "required" or
        ``{"type": "function", "function": {"name": ...}}`` (the reply is forced to be such calls, read into
        ``tool_calls`` without a tool parser: core/tool_choice.py)."""
        one = isinstance(messages, Seq) and bool(messages) and isinstance(messages[0], (Mapping, ChatMessage))
        conversations = [messages] if one else messages
        tools = checked_tools(tools)  # the same for every conversation: refused as a whole
        prompts = []
        for index, conversation in enumerate(check_prompt_list(conversations)):
            try:
                prompts.append(ChatPrompt.of(conversation, add_generation_prompt,  # type: ignore[arg-type]
                                             continue_final_message, chat_template_kwargs, tools, tool_choice))
            except InferError as exc:
                raise at_prompt(exc, index, len(conversations)) from None
        return self.engine.generate(prompts, params)

    def embed(self, prompts: Prompt | Seq[Prompt], params: PoolingParams | Seq[PoolingParams] | None = None
              ) -> list[RequestOutput]:
        """Embed one prompt or several: one RequestOutput per prompt, in order, its ``embedding`` the pooled final
        hidden states (core/pooling.py: a pooler, last or mean or a plugin's; normalized by default), or a sequence
        classifier's label logits."""
        return self.engine.embed(_as_list(prompts), params)

    def beam_search(self, prompts: Prompt | Seq[Prompt], params: BeamSearchParams | None = None
                    ) -> list[BeamSearchOutput]:
        """Beam search for each prompt: ``beam_width`` beams per prompt, best first (see ``Engine.beam_search``)."""
        return self.engine.beam_search(_as_list(prompts), params)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def load_lora_adapter(self, name: str, folder: str | os.PathLike[str]) -> None:
        """Serve a PEFT adapter under ``name`` from now on, in a free slot of ``max_lora_adapters``
        (``Engine.load_lora_adapter``)."""
        self.engine.load_lora_adapter(name, folder)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving ``name`` and free its slot (``Engine.unload_lora_adapter``)."""
        self.engine.unload_lora_adapter(name)


def _as_list(prompts: Prompt | Seq[Prompt]) -> Seq[Prompt]:
    """One prompt (a string, a list of token ids, a ChatPrompt) as a list of one; a list of prompts as it is."""
    if isinstance(prompts, (str, ChatPrompt)) or (
            isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
        return [prompts]  # type: ignore[list-item]
    return prompts  # type: ignore[return-value]
