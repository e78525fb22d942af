"""Chat prompts: a conversation that the model's own chat template (its tokenizer's ``chat_template``, a Jinja
template from tokenizer_config.json or chat_template.jinja) renders into prompt tokens, as HF transformers'
``apply_chat_template`` does. A :class:`ChatPrompt` goes wherever a prompt goes (``Engine.add_request``,
``LLM.generate``, gRPC's ``chat`` prompt); the engine renders it when it checks the request."""
from __future__ import annotations

from collections.abc import Mapping, Sequence as Seq
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ConfigError, InvalidRequestError

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
        return list(tokenizer.encode(text, add_special_tokens=False))


def read_chat_template(path: str) -> str:
    """The Jinja template in file ``path`` (``--chat-template``); ConfigError for a file that is missing, not
    UTF-8, empty or not valid Jinja, so that a bad one stops the engine at start, not at the first chat."""
    import jinja2

    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--chat-template {path!r} cannot be read ({exc}); give a UTF-8 Jinja template "
                          "file") from None
    if not text.strip():
        raise ConfigError(f"--chat-template {path!r} is empty; give a Jinja template file")
    try:  # transformers renders with the loop-controls extension ({% break %}, {% continue %})
        jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(text)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"--chat-template {path!r} is not valid Jinja (line {exc.lineno}: {exc.message})") from None
    return text


def _message(index: int, message: Mapping[str, str] | ChatMessage) -> ChatMessage:
    if isinstance(message, ChatMessage):
        message = {"role": message.role, "content": message.content}
    if not isinstance(message, Mapping) or set(message) != {"role", "content"}:
        keys = sorted(message) if isinstance(message, Mapping) else type(message).__name__
        raise InvalidRequestError(f"chat message {index} must have exactly the keys 'role' and 'content', got {keys}")
    role, content = message["role"], message["content"]
    if not isinstance(role, str) or not role or not isinstance(content, str):
        raise InvalidRequestError(f"chat message {index}: role must be a non-empty string and content a string, got "
                                  f"{role!r} and {type(content).__name__}")
    return ChatMessage(role, content)


Prompt = str | list[int] | ChatPrompt  # what every prompt-taking call accepts
