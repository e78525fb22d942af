"""Chat prompts: a conversation that the model's own chat template (its tokenizer's ``chat_template``, a Jinja
template from tokenizer_config.json or chat_template.jinja) renders into prompt tokens, as HF transformers'
``apply_chat_template`` does. A :class:`ChatPrompt` goes wherever a prompt goes (``Engine.add_request``,
``LLM.generate``, gRPC's ``chat`` prompt); the engine renders it when it checks the request."""
from __future__ import annotations

import functools
import json
from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .chat_tools import ToolCall, ToolChoice, brief, checked_tool_choice, checked_tools, json_like, tool_calls_of
from .errors import ConfigError, InvalidRequestError, require_utf8

MAX_MESSAGES = 4096
MAX_TOOL_CALLS = 4096  # in all of a chat's messages
MAX_CONTENT_PARTS = 4096  # text parts, in all of a chat's messages


def check_has_chat_template(tokenizer: Any) -> None:
    """InvalidRequestError for a tokenizer without a chat template: it renders no chat."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError("this model's tokenizer has no chat template (a chat_template entry in "
                                  "tokenizer_config.json, or a chat_template.jinja file), so it cannot render chat "
                                  "messages; send a plain prompt, add the template to the model folder, or give one "
                                  "with --chat-template FILE (LLM(chat_template=...) in Python)")


def check_message_count(count: int) -> None:
    """InvalidRequestError for a chat of more than MAX_MESSAGES messages (the server checks before converting)."""
    if count > MAX_MESSAGES:
        raise InvalidRequestError(f"a chat prompt has at most {MAX_MESSAGES} messages, got {count}")


def check_content_part_count(count: int) -> None:
    """InvalidRequestError for a chat whose messages hold more than MAX_CONTENT_PARTS text parts."""
    if count > MAX_CONTENT_PARTS:
        raise InvalidRequestError(f"a chat prompt's messages hold at most {MAX_CONTENT_PARTS} text parts in all, got "
                                  f"{count}; join the texts into fewer parts")


def check_tool_call_count(count: int) -> None:
    """InvalidRequestError for a chat whose messages hold more than MAX_TOOL_CALLS tool calls."""
    if count > MAX_TOOL_CALLS:
        raise InvalidRequestError(f"a chat prompt's messages hold at most {MAX_TOOL_CALLS} tool calls, got {count}")


@dataclass(frozen=True)
class ChatMessage:
    """One turn: ``role`` is what the template knows (usually "system", "user", "assistant" or "tool").
    ``tool_calls``: an assistant turn's calls (its content may then be None); ``tool_call_id``: in a "tool" turn,
    the call it answers; ``name``: the speaker's or tool's name, for templates that read it (core/chat_tools.py);
    ``reasoning_content``: an assistant turn's reasoning, for templates that read it (Qwen3's, DeepSeek-R1's).
    ``content_parts``: the texts of OpenAI's text parts, where the content came as that list (``content`` is then
    their texts joined by newlines, what a template that reads content as a string gets)."""

    role: str
    content: str | None
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None
    reasoning_content: str | None = None
    content_parts: tuple[str, ...] | None = None

    def __post_init__(self) -> None:  # lists from the caller, kept hashable
        for name in ("tool_calls", "content_parts"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    def template_dict(self, parts: bool = False) -> dict[str, Any]:
        """The message as apply_chat_template gets it: OpenAI's keys, those without a value left out. ``parts``:
        content that came as text parts goes as that list (for a template that loops over them)."""
        turn: dict[str, Any] = {"role": self.role}
        if parts and self.content_parts is not None:
            turn["content"] = [{"type": "text", "text": text} for text in self.content_parts]
        elif self.content is not None:
            turn["content"] = self.content
        if self.tool_calls:
            turn["tool_calls"] = [call.template_dict() for call in self.tool_calls]
        for key in OPTIONAL_TEXT_KEYS:
            if (value := getattr(self, key)) is not None:
                turn[key] = value
        return turn


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to continue. ``add_generation_prompt``: end the rendering with the template's opening of an
    assistant turn (what a chat answer needs); False renders the messages alone. ``continue_final_message``: leave
    the last message open, so that the model continues it (a prefilled start of the answer; it needs
    ``add_generation_prompt=False``). ``chat_template_kwargs``: more variables for the template (Qwen3's
    ``enable_thinking``, say); each must be one the template reads. ``tools``: the functions the model may call, as
    OpenAI's ``{"type": "function", "function": {...}}`` definitions (the template must read ``tools``).
    ``tool_choice``: OpenAI's; "auto" (the engine's tool parser, if any, reads the reply), "none" (the reply is
    content), "required" or a FunctionChoice (the reply is forced to be calls: core/tool_choice.py)."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # hashable as before
    tools: tuple[Mapping[str, Any], ...] = field(default=(), hash=False)  # an empty list is no tools
    tool_choice: ToolChoice = "auto"

    def __post_init__(self) -> None:  # lists from the caller: equal prompts compare equal
        for name in ("messages", "tools"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))

    @classmethod
    def of(cls, messages: Seq[Mapping[str, Any] | ChatMessage], add_generation_prompt: bool = True,
           continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None,
           tools: Seq[Mapping[str, Any]] | None = None, tool_choice: object = None) -> ChatPrompt:
        """From OpenAI-style ``[{"role": ..., "content": ...}, ...]`` (or ChatMessages; tool calls and tool
        answers included); InvalidRequestError for anything else."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Seq):
            raise InvalidRequestError(f"chat messages must be a list of {{'role': ..., 'content': ...}} entries, got "
                                      f"{type(messages).__name__}")
        if not messages:
            raise InvalidRequestError("a chat prompt needs at least one message")
        check_message_count(len(messages))
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise InvalidRequestError(f"{name} must be True or False, got {flag!r}")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message continues the last message, and add_generation_prompt "
                                      "opens a new assistant turn after it; set add_generation_prompt=False")
        check_content_part_count(sum(len(content) for m in messages if isinstance(m, Mapping) and
                                     isinstance(content := m.get("content"), (list, tuple))))
        checked = tuple(_message(i, m) for i, m in enumerate(messages))
        check_tool_call_count(sum(len(m.tool_calls) for m in checked))
        check_content_part_count(sum(len(m.content_parts or ()) for m in checked))
        if continue_final_message and checked[-1].content_parts == ():
            raise InvalidRequestError(f"continue_final_message continues the last message's text, but message "
                                      f"{len(checked) - 1} has an empty list of parts; add a text part, or set "
                                      "continue_final_message=False")
        if continue_final_message and checked[-1].content is None:
            raise InvalidRequestError(f"continue_final_message continues the last message's content, but message "
                                      f"{len(checked) - 1} has none (only tool calls); add content, or set "
                                      "continue_final_message=False")
        tools = checked_tools(tools)
        return cls(checked, add_generation_prompt, continue_final_message,
                   checked_template_kwargs(chat_template_kwargs), tools, checked_tool_choice(tool_choice, tools))

    def checked(self) -> ChatPrompt:
        """This prompt through :meth:`of`'s checks (for one built directly, from dicts, say)."""
        return ChatPrompt.of(self.messages, self.add_generation_prompt, self.continue_final_message,
                             self.chat_template_kwargs, self.tools, self.tool_choice)

    def text_length(self) -> int:
        """Characters of the messages' texts, tool calls and tools: what the rendered prompt holds besides the
        template's own text."""
        calls = [call.template_dict() for m in self.messages for call in m.tool_calls]
        texts = [m.content or "" for m in self.messages] + [
            getattr(m, key) or "" for m in self.messages for key in OPTIONAL_TEXT_KEYS]
        return sum(map(len, texts)) + (
            len(json.dumps([calls, self.tools], ensure_ascii=False)) if calls or self.tools else 0)

    def render(self, tokenizer: Any, default_kwargs: Mapping[str, Any] | None = None, sanitize: bool = False
               ) -> list[int]:
        """The prompt's token ids: the template's text, tokenized without adding special tokens (the template
        writes its own, BOS included), as ``apply_chat_template(..., tokenize=True)`` does. ``default_kwargs``:
        template variables this prompt's own ``chat_template_kwargs`` may override (the engine's defaults).
        ``sanitize``: control tokens' text in the messages and variables is encoded as plain text."""
        import jinja2

        check_has_chat_template(tokenizer)
        tools = [dict(tool) for tool in self.tools] or None
        try:  # HF's choice among named templates: "tool_use" with tools, else "default"
            template = tokenizer.get_chat_template(tools=tools)
        except ValueError as exc:
            raise InvalidRequestError(f"the model's chat template cannot render the messages ({exc}); give one with "
                                      "--chat-template FILE") from None
        if self.chat_template_kwargs:
            check_template_reads(template, self.chat_template_kwargs)
        self._check_template_reads_tools(template)
        parts = template_loops_over_content(template)
        turns = [m.template_dict(parts) for m in self.messages]
        options = {"add_generation_prompt": self.add_generation_prompt, "chat_template": template,
                   "continue_final_message": self.continue_final_message, "tools": tools,
                   **{**(default_kwargs or {}), **self.chat_template_kwargs}}
        try:
            if sanitize:  # HF encodes the marked control tokens itself (else it is the same text, encoded alike)
                return list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False,
                                                          sanitize_control_tokens=True, **options))
            text = tokenizer.apply_chat_template(turns, tokenize=False, **options)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template is not valid Jinja (line {exc.lineno}: "
                                      f"{exc.message}); fix it, or give one with --chat-template FILE "
                                      "(LLM(chat_template=...) in Python)") from None
        except jinja2.TemplateError as exc:  # templates refuse what they cannot render: raise_exception('...')
            raise InvalidRequestError(f"the model's chat template refused the messages: {exc}") from None
        except Exception as exc:  # several named templates and no default; a template's own bug (1 // 0)
            raise InvalidRequestError(f"the model's chat template cannot render the messages ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0]}); fix it, or give one with --chat-template "
                                      "FILE") from None
        return list(tokenizer.encode(text, add_special_tokens=False))

    def _check_template_reads_tools(self, template: str) -> None:
        """InvalidRequestError for tools or tool calls that the template in use would drop without a word: tools
        when it never reads ``tools``, calls when its text never names ``tool_calls``."""
        if self.tools and "tools" not in template_reads(template, default={"tools"}):
            raise InvalidRequestError("the chat template in use does not read tools, so the model would not see "
                                      "them; send the chat without tools, or give a tool-use template with "
                                      "--chat-template FILE")
        if any(m.tool_calls for m in self.messages) and "tool_calls" not in template:
            raise InvalidRequestError("the chat template in use does not read messages' tool_calls, so it would "
                                      "drop them; send those turns as content, or give a tool-use template with "
                                      "--chat-template FILE")


CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message", "chat_template_kwargs", "tools",
               "tool_choice")


def chat_of_fields(item: Mapping[str, Any]) -> ChatPrompt:
    """A ChatPrompt from a mapping of CHAT_FIELDS, the fields of the gRPC ``Chat`` message (JSON input of the CLI
    and the bench); other keys are the caller's to allow or refuse."""
    return ChatPrompt.of(item.get("messages"), item.get("add_generation_prompt", True),  # type: ignore[arg-type]
                         item.get("continue_final_message", False), item.get("chat_template_kwargs"),
                         item.get("tools"), item.get("tool_choice"))


# apply_chat_template's own parameters, and the names the template gets from it: not template variables to set
RESERVED_TEMPLATE_NAMES = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


def parse_template_kwargs(text: str | None, what: str) -> dict[str, Any]:
    """``chat_template_kwargs`` from a JSON object (a CLI option or a gRPC field, named ``what``); empty for None
    or an empty string."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as exc:  # RecursionError: nested too deep to parse
        raise InvalidRequestError(f"{what} must be a JSON object such as '{{\"enable_thinking\": false}}' ({exc})"
                                  ) from None
    if not isinstance(value, dict):
        raise InvalidRequestError(f"{what} must be a JSON object of template variables, got {text[:80]}")
    return value


def checked_template_kwargs(kwargs: Mapping[str, Any] | None) -> dict[str, Any]:
    """A private copy of ``kwargs``; InvalidRequestError for a name that is not a plain identifier or that
    apply_chat_template keeps for itself, and for a value that is not JSON-like (what a template can read)."""
    if kwargs is None:
        return {}
    if not isinstance(kwargs, Mapping):
        raise InvalidRequestError(f"chat_template_kwargs must be a mapping of template variables, got "
                                  f"{type(kwargs).__name__}")
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequestError(f"chat_template_kwargs: {name!r} is not a template variable name")
        if name in RESERVED_TEMPLATE_NAMES:
            own = " (it is an option of its own)" if name in ("add_generation_prompt", "continue_final_message") else ""
            raise InvalidRequestError(f"chat_template_kwargs: {name!r} is set by the engine, not a template "
                                      f"variable{own}")
    return {name: json_like(value, f"chat_template_kwargs: {name!r}") for name, value in kwargs.items()}


def template_reads(template: str | Mapping[str, str], default: set[str]) -> set[str]:
    """The variables the template (or any of its named templates) reads; ``default`` for a template with syntax
    this parser lacks, which is not checked."""
    import jinja2
    import jinja2.meta

    environment = _parsing_environment()
    reads: set[str] = set()
    for text in template.values() if isinstance(template, Mapping) else [template]:
        try:
            reads |= jinja2.meta.find_undeclared_variables(environment.parse(text))
        except jinja2.TemplateSyntaxError:
            return default
    return reads


@functools.lru_cache(maxsize=16)
def template_loops_over_content(template: str) -> bool:
    """Whether the template loops over a message's content (``{% for part in message['content'] %}``, directly,
    through a slice or a filter, or through a name set from it or a macro parameter given it): such a template
    (Llama 4's, Gemma 3's) reads OpenAI's text parts itself, so a content that came as parts goes to it as that
    list, as HF's apply_chat_template hands it on; any other gets the parts joined by newlines. vLLM's
    content-format detection reads templates alike. False for syntax this parser lacks."""
    import jinja2
    from jinja2 import nodes

    try:
        tree = _parsing_environment().parse(template)
    except jinja2.TemplateSyntaxError:
        return False

    def is_content(expr: nodes.Node | None, names: set[str]) -> bool:  # X['content'], X.content, X.get('content')
        while isinstance(expr, nodes.Filter) and expr.node is not None or \
                isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Slice):  # | selectattr(...), [1:]
            expr = expr.node
        return (isinstance(expr, nodes.Getitem) and isinstance(expr.arg, nodes.Const) and expr.arg.value == "content"
                or isinstance(expr, nodes.Getattr) and expr.attr == "content"
                or isinstance(expr, nodes.Call) and isinstance(expr.node, nodes.Getattr) and expr.node.attr == "get"
                and bool(expr.args) and isinstance(expr.args[0], nodes.Const) and expr.args[0].value == "content"
                or isinstance(expr, nodes.Name) and expr.name in names)

    macros = {macro.name: [arg.name for arg in macro.args] for macro in tree.find_all(nodes.Macro)}
    names: set[str] = set()
    while True:  # names holding a content: set from one, or a macro's parameter that a call gives one
        found = {assign.target.name for assign in tree.find_all(nodes.Assign)
                 if isinstance(assign.target, nodes.Name) and is_content(assign.node, names)}
        for call in tree.find_all(nodes.Call):
            params = macros.get(call.node.name, []) if isinstance(call.node, nodes.Name) else []
            found |= {param for param, arg in zip(params, call.args) if is_content(arg, names)}
            found |= {kw.key for kw in call.kwargs if kw.key in params and is_content(kw.value, names)}
        if found <= names:
            break
        names |= found
    return any(is_content(loop.iter, names) for loop in tree.find_all(nodes.For))


def _parsing_environment() -> Any:
    """A Jinja environment that parses what HF's template environment parses: loop controls and transformers'
    ``{% generation %}`` blocks (read here for the variables inside them)."""
    import jinja2
    import jinja2.ext

    class GenerationBlock(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return jinja2.Environment(extensions=["jinja2.ext.loopcontrols", GenerationBlock])


def check_template_reads(template: str | Mapping[str, str], kwargs: Mapping[str, Any]) -> None:
    """InvalidRequestError for a variable no template reads: a misspelt ``enable_thinking`` would otherwise
    change nothing, silently."""
    reads = template_reads(template, default=set(kwargs))
    if unread := sorted(set(kwargs) - reads):
        own = sorted(reads - RESERVED_TEMPLATE_NAMES - {"raise_exception", "strftime_now", "bos_token", "eos_token"})
        raise InvalidRequestError(f"the chat template in use does not read {', '.join(map(repr, unread))}, so "
                                  f"setting it would change nothing; the variables it reads: "
                                  f"{', '.join(own) if own else 'none beyond the messages'}")


def read_chat_template(path: str, tokenizer: Any) -> str:
    """The Jinja template in file ``path`` (``--chat-template``); ConfigError for a file that is missing, not
    UTF-8, empty or not valid Jinja, so that a bad one stops the engine at start, not at the first chat. It is
    compiled as ``tokenizer.apply_chat_template`` compiles it (transformers' extensions: ``{% generation %}``,
    ``{% break %}``)."""
    import jinja2

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path!r} cannot be read ({exc}); give a UTF-8 Jinja template "
                          "file") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path!r} is empty; give a Jinja template file")
    try:  # a probe conversation: only a syntax error is the file's fault (a template may refuse the probe)
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=text, tokenize=False)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path!r} is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    except Exception:  # noqa: BLE001 - refusing the probe (raise_exception, a role rule) is the template's right
        pass
    return text


def check_can_sanitize(tokenizer: Any) -> None:
    """ConfigError, at start, when the installed transformers cannot encode control tokens typed in messages as
    text (``apply_chat_template(sanitize_control_tokens=True)``)."""
    import inspect

    import transformers

    if "sanitize_control_tokens" not in inspect.signature(tokenizer.apply_chat_template).parameters:
        raise ConfigError(f"--sanitize-chat-control-tokens needs a transformers release whose apply_chat_template "
                          f"takes sanitize_control_tokens (5.24 does; installed: {transformers.__version__}); "
                          "upgrade transformers, or drop the option")


def check_default_template_kwargs(tokenizer: Any, kwargs: Mapping[str, Any]) -> None:
    """ConfigError, at start, for default template variables (``--default-chat-template-kwargs``) that the
    model's template does not read, or for a model without a template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("--default-chat-template-kwargs sets variables of the chat template, but this model has "
                          "none; drop the option, or give a template with --chat-template FILE")
    try:
        check_template_reads(tokenizer.chat_template, kwargs)
    except InvalidRequestError as exc:
        raise ConfigError(f"--default-chat-template-kwargs: {exc}") from None


OPTIONAL_TEXT_KEYS = ("tool_call_id", "name", "reasoning_content")
MESSAGE_KEYS = ("role", "content", "tool_calls", *OPTIONAL_TEXT_KEYS)


def _message(index: int, message: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    """One message, as HF normalizes it (keys whose value is None dropped) and as vLLM reads OpenAI's text parts
    (a content list of ``{"type": "text", "text": ...}`` joined by newlines) and tool calls."""
    if isinstance(message, ChatMessage):
        parts, content = message.content_parts, message.content
        message = {key: getattr(message, key) for key in MESSAGE_KEYS}
        if parts is not None:
            if not isinstance(parts, tuple) or not all(isinstance(text, str) for text in parts):
                raise InvalidRequestError(f"chat message {index}: content_parts must be a list of strings, got "
                                          f"{brief(parts)}")
            if content is not None and content != "\n".join(parts):
                raise InvalidRequestError(f"chat message {index} has content and content_parts that differ; give "
                                          "the parts alone (content is their texts joined by newlines)")
            message["content"] = [{"type": "text", "text": text} for text in parts]
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"chat message {index} must be a {{'role': ..., 'content': ...}} mapping, got "
                                  f"{type(message).__name__}")
    message = {key: value for key, value in message.items() if value is not None}
    if unknown := sorted(set(message) - set(MESSAGE_KEYS), key=str):
        raise InvalidRequestError(f"chat message {index} has keys {unknown} that infer does not pass to chat "
                                  f"templates; a message has {', '.join(map(repr, MESSAGE_KEYS))}")
    role = message.get("role")
    if not isinstance(role, str) or not role:
        raise InvalidRequestError(f"chat message {index}: role must be a non-empty string, got {role!r}")
    calls = tool_calls_of(index, message["tool_calls"]) if "tool_calls" in message else ()
    if calls and role != "assistant":
        raise InvalidRequestError(f"chat message {index}: tool_calls belong to an assistant message, not {role!r}")
    if "content" not in message and not calls:
        raise InvalidRequestError(f"chat message {index} has no content (only an assistant message with "
                                  "tool_calls may leave it out)")
    content, parts = _text_of(index, message["content"]) if "content" in message else (None, None)
    texts = {"role": role, "content": content}
    for key in OPTIONAL_TEXT_KEYS:
        value = texts[key] = message.get(key)
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidRequestError(f"chat message {index}: {key} must be a non-empty string, got {value!r}")
    if texts["tool_call_id"] is not None and role != "tool":
        raise InvalidRequestError(f"chat message {index}: tool_call_id belongs to a 'tool' message (the answer of "
                                  f"that call), not {role!r}")
    for name, text in texts.items():
        if text is not None:
            require_utf8(text, f"chat message {index}: its {name}")
    return ChatMessage(role, content, calls, texts["tool_call_id"], texts["name"], texts["reasoning_content"], parts)


def _text_of(index: int, content: object) -> tuple[str, tuple[str, ...] | None]:
    """A message's content and, for OpenAI's list of text parts, their texts (the content is then those joined by
    newlines, as vLLM joins them for a template that reads content as a string)."""
    if isinstance(content, str):
        return content, None
    if isinstance(content, (list, tuple)) and all(isinstance(part, Mapping) and part.get("type") == "text" and
                                                  isinstance(part.get("text"), str) for part in content):
        texts = tuple(part["text"] for part in content)
        return "\n".join(texts), texts
    raise InvalidRequestError(f"chat message {index}: content must be a string or a list of {{'type': 'text', "
                              f"'text': ...}} parts (images and other parts are not supported), got "
                              f"{brief(content)}")


Prompt = str | list[int] | ChatPrompt  # what every prompt-taking call accepts
