"""Chat prompts: a conversation that the model's own chat template (its tokenizer's ``chat_template``, a Jinja
template from tokenizer_config.json or chat_template.jinja) renders into prompt tokens, as HF transformers'
``apply_chat_template`` does. A :class:`ChatPrompt` goes wherever a prompt goes (``Engine.add_request``,
``LLM.generate``, gRPC's ``chat`` prompt); the engine renders it when it checks the request."""
from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass
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
    assistant turn (what a chat answer needs); False renders the messages alone."""

    messages: tuple[ChatMessage, ...]
    add_generation_prompt: bool = True

    @classmethod
    def of(cls, messages: Seq[Mapping[str, str] | ChatMessage], add_generation_prompt: bool = True) -> ChatPrompt:
        """From OpenAI-style ``[{"role": ..., "content": ...}, ...]`` (or ChatMessages); InvalidRequestError for
        anything else."""
        if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Seq):
            raise InvalidRequestError(f"chat messages must be a list of {{'role': ..., 'content': ...}} entries, got "
                                      f"{type(messages).__name__}")
        if not messages:
            raise InvalidRequestError("a chat prompt needs at least one message")
        if len(messages) > MAX_MESSAGES:
            raise InvalidRequestError(f"a chat prompt has at most {MAX_MESSAGES} messages, got {len(messages)}")
        return cls(tuple(_message(i, m) for i, m in enumerate(messages)), add_generation_prompt)

    def render(self, tokenizer: Any) -> list[int]:
        """The prompt's token ids: the template's text, tokenized without adding special tokens (the template
        writes its own, BOS included), as ``apply_chat_template(..., tokenize=True)`` does."""
        import jinja2

        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template (a chat_template entry in "
                                      "tokenizer_config.json, or a chat_template.jinja file), so it cannot render "
                                      "chat messages; send a plain prompt, add the template to the model folder, "
                                      "or give one with --chat-template FILE")
        turns = [{"role": m.role, "content": m.content} for m in self.messages]
        try:
            text = tokenizer.apply_chat_template(turns, tokenize=False,
                                                 add_generation_prompt=self.add_generation_prompt)
        except jinja2.TemplateSyntaxError as exc:
            raise InvalidRequestError(f"the model's chat template is not valid Jinja (line {exc.lineno}: "
                                      f"{exc.message}); fix it, or give one with --chat-template FILE") from None
        except jinja2.TemplateError as exc:  # templates refuse what they cannot render: raise_exception('...')
            raise InvalidRequestError(f"the model's chat template refused the messages: {exc}") from None
        except (ValueError, TypeError) as exc:  # several named templates and no default; a template's own bug
            raise InvalidRequestError(f"the model's chat template cannot render the messages ({type(exc).__name__}: "
                                      f"{exc}); fix it, or give one with --chat-template FILE") from None
        return list(tokenizer.encode(text, add_special_tokens=False))


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
