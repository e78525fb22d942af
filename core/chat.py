"""Chat prompts: a conversation that the model's own chat template (its tokenizer's ``chat_template``, a Jinja
template from tokenizer_config.json or chat_template.jinja) renders into prompt tokens, as HF transformers'
``apply_chat_template`` does. A :class:`ChatPrompt` goes wherever a prompt goes (``Engine.add_request``,
``LLM.generate``, gRPC's ``chat`` prompt); the engine renders it when it checks the request."""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, InvalidRequestError, require_utf8

MAX_MESSAGES = 4096


@dataclass(frozen=True)
class ChatMessage:
    """One turn: ``role`` is what the template knows (usually "system", "user" or "assistant")."""

    role: str
    content: str


@dataclass(frozen=True)
class ChatPrompt:
    """A conversation to continue. ``add_generation_prompt``: end the rendering with the template's opening of an
    assistant turn (what a chat answer needs); False renders the messages alone. ``continue_final_message``: leave
    the last message open, so that the model continues it (a prefilled start of the answer; it needs
    ``add_generation_prompt=False``). ``chat_template_kwargs``: more variables for the template (Qwen3's
    ``enable_thinking``, say); each must be one the template reads."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Mapping[str, Any] = field(default_factory=dict, hash=False)  # hashable as before

    @classmethod
    def of(cls, messages: Seq[Mapping[str, str] | ChatMessage], add_generation_prompt: bool = True,
           continue_final_message: bool = False, chat_template_kwargs: Mapping[str, Any] | None = None
           ) -> ChatPrompt:
        """From OpenAI-style ``[{"role": ..., "content": ...}, ...]`` (or ChatMessages); InvalidRequestError for
        anything else."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Seq):
            raise InvalidRequestError(f"chat messages must be a list of {{'role': ..., 'content': ...}} entries, got "
                                      f"{type(messages).__name__}")
        if not messages:
            raise InvalidRequestError("a chat prompt needs at least one message")
        if len(messages) > MAX_MESSAGES:
            raise InvalidRequestError(f"a chat prompt has at most {MAX_MESSAGES} messages, got {len(messages)}")
        for name, flag in (("add_generation_prompt", add_generation_prompt),
                           ("continue_final_message", continue_final_message)):
            if not isinstance(flag, bool):
                raise InvalidRequestError(f"{name} must be True or False, got {flag!r}")
        if add_generation_prompt and continue_final_message:
            raise InvalidRequestError("continue_final_message continues the last message, and add_generation_prompt "
                                      "opens a new assistant turn after it; set add_generation_prompt=False")
        return cls(tuple(_message(i, m) for i, m in enumerate(messages)), add_generation_prompt,
                   continue_final_message, checked_template_kwargs(chat_template_kwargs))

    def checked(self) -> ChatPrompt:
        """This prompt through :meth:`of`'s checks (for one built directly, from dicts, say)."""
        return ChatPrompt.of(self.messages, self.add_generation_prompt, self.continue_final_message,
                             self.chat_template_kwargs)

    def render(self, tokenizer: Any, default_kwargs: Mapping[str, Any] | None = None, sanitize: bool = False
               ) -> list[int]:
        """The prompt's token ids: the template's text, tokenized without adding special tokens (the template
        writes its own, BOS included), as ``apply_chat_template(..., tokenize=True)`` does. ``default_kwargs``:
        template variables this prompt's own ``chat_template_kwargs`` may override (the engine's defaults).
        ``sanitize``: control tokens' text in the messages and variables is encoded as plain text."""
        import jinja2

        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template (a chat_template entry in "
                                      "tokenizer_config.json, or a chat_template.jinja file), so it cannot render "
                                      "chat messages; send a plain prompt, add the template to the model folder, "
                                      "or give one with --chat-template FILE")
        template_kwargs = {**(default_kwargs or {}), **self.chat_template_kwargs}
        if self.chat_template_kwargs:
            check_template_reads(tokenizer.chat_template, self.chat_template_kwargs)
        turns = [{"role": m.role, "content": m.content} for m in self.messages]
        options = {"add_generation_prompt": self.add_generation_prompt,
                   "continue_final_message": self.continue_final_message, **template_kwargs}
        try:
            if sanitize:  # HF encodes the marked control tokens itself (else it is the same text, encoded alike)
                return list(tokenizer.apply_chat_template(turns, tokenize=True, return_dict=False,
                                                          sanitize_control_tokens=True, **options))
            text = tokenizer.apply_chat_template(turns, tokenize=False, **options)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template is not valid Jinja (line {exc.lineno}: "
                                      f"{exc.message}); fix it, or give one with --chat-template FILE") from None
        except jinja2.TemplateError as exc:  # templates refuse what they cannot render: raise_exception('...')
            raise InvalidRequestError(f"the model's chat template refused the messages: {exc}") from None
        except (ValueError, TypeError) as exc:  # several named templates and no default; a template's own bug
            raise InvalidRequestError(f"the model's chat template cannot render the messages ({type(exc).__name__}: "
                                      f"{str(exc).splitlines()[0]}); fix it, or give one with --chat-template "
                                      "FILE") from None
        return list(tokenizer.encode(text, add_special_tokens=False))


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
    except ValueError as exc:
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
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"chat_template_kwargs: {name!r} must be JSON-like (a string, number, bool, "
                                      f"None, list or mapping), got {type(value).__name__}") from None
    return json.loads(json.dumps(dict(kwargs)))  # a deep copy: the caller's later edits change nothing


def check_template_reads(template: str | Mapping[str, str], kwargs: Mapping[str, Any]) -> None:
    """InvalidRequestError for a variable no template reads: a misspelt ``enable_thinking`` would otherwise
    change nothing, silently. A template with syntax this parser lacks (transformers' extensions) is not checked."""
    import jinja2
    import jinja2.meta

    environment = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"])
    reads: set[str] = set()
    for text in template.values() if isinstance(template, Mapping) else [template]:
        try:
            reads |= jinja2.meta.find_undeclared_variables(environment.parse(text))
        except jinja2.TemplateSyntaxError:
            return
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


TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


def _message(index: int, message: Mapping[str, Any] | ChatMessage) -> ChatMessage:
    """One message, as HF normalizes it (keys whose value is None dropped) and as vLLM reads OpenAI's text parts
    (a content list of ``{"type": "text", "text": ...}`` joined by newlines)."""
    if isinstance(message, ChatMessage):
        message = {"role": message.role, "content": message.content}
    if not isinstance(message, Mapping):
        raise InvalidRequestError(f"chat message {index} must be a {{'role': ..., 'content': ...}} mapping, got "
                                  f"{type(message).__name__}")
    message = {key: value for key, value in message.items() if value is not None}
    if tools := [key for key in TOOL_KEYS if key in message]:
        raise InvalidRequestError(f"chat message {index} has {', '.join(map(repr, tools))}: tool calls are not "
                                  "supported; send the messages' role and content only")
    if set(message) != {"role", "content"}:
        raise InvalidRequestError(f"chat message {index} must have exactly the keys 'role' and 'content', got "
                                  f"{sorted(message)}")
    role, content = message["role"], _text_of(index, message["content"])
    if not isinstance(role, str) or not role:
        raise InvalidRequestError(f"chat message {index}: role must be a non-empty string, got {role!r}")
    for name, text in (("role", role), ("content", content)):
        require_utf8(text, f"chat message {index}: its {name}")
    return ChatMessage(role, content)


def _text_of(index: int, content: object) -> str:
    """A message's content: a string, or OpenAI's list of text parts (joined by newlines, as vLLM joins them)."""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)) and all(isinstance(part, Mapping) and part.get("type") == "text" and
                                                  isinstance(part.get("text"), str) for part in content):
        return "\n".join(part["text"] for part in content)
    raise InvalidRequestError(f"chat message {index}: content must be a string or a list of {{'type': 'text', "
                              f"'text': ...}} parts (images and other parts are not supported), got "
                              f"{str(content)[:80]}")


Prompt = str | list[int] | ChatPrompt  # what every prompt-taking call accepts
