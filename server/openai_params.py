"""OpenAI's request bodies (``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, and vLLM's
``/tokenize`` and ``/detokenize``) read into the engine's prompts and parameters. Every field is checked by name: an
unknown field, or one the engine cannot honour, is an InvalidRequestError that names it (a typo is never dropped
quietly). The names vLLM adds beside OpenAI's
(top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids, include_stop_str_in_output, priority,
structured_outputs, return_token_ids, chat_template_kwargs, add_generation_prompt, continue_final_message) are read as
vLLM reads them: ``priority`` too, lower first, so the engine's (higher first) is its negation."""
from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence as Seq
from dataclasses import dataclass, replace
from typing import Any

from ..core.chat import ChatPrompt, Prompt, check_message_count
from ..core.errors import InvalidRequestError, NotFoundError
from ..core.pooling import PoolingParams
from ..core.request import SamplingParams, StructuredOutput

MAX_PROMPTS = 1024  # prompts (or inputs) in one body: each is its own engine request
MAX_TOP_LOGPROBS = 20  # OpenAI's bound for chat's top_logprobs, kept for completions' logprobs too


@dataclass(frozen=True)
class Served:
    """What the ``model`` field may name: the served model, or one of the LoRA adapters served now."""

    name: str
    adapters: Callable[[], Seq[str]]

    def adapter_of(self, body: Mapping[str, Any]) -> str | None:
        """The LoRA adapter ``body["model"]`` names, None for the served model (or no ``model``); NotFoundError for
        a name this server does not serve."""
        model = body.get("model")
        if model is None or model == self.name:
            return None
        if not isinstance(model, str):
            raise InvalidRequestError(f"model must be a string, the served model's name or an adapter's, got "
                                      f"{json.dumps(model)[:200]}")
        if model in self.adapters():
            return model
        served = ", ".join(repr(name) for name in (self.name, *self.adapters()))
        raise NotFoundError(f"the model {str(model)[:200]!r} does not exist here; this server serves {served} "
                            "(GET /v1/models lists them)")


@dataclass
class OpenAIRequest:
    """One body read: its prompts (each an engine request of ``n`` choices) and how to answer."""

    prompts: list[Prompt]
    params: SamplingParams | PoolingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage: a last chunk with the usage
    echo: bool = False  # completions: the prompt's text before each choice's
    fill_context: bool = False  # chat without max_tokens: as many tokens as the context has room for
    one_call: bool = False  # chat's parallel_tool_calls false: each choice carries its reply's first call alone
    token_ids: bool = False  # vLLM's return_token_ids: each choice also carries its prompt's and its own token ids
    encoding_format: str = "float"  # embeddings: "float" or "base64" (little-endian float32)


class Fields:
    """The fields of one body, taken one by one with their types checked; :meth:`done` refuses any left over."""

    def __init__(self, body: object, endpoint: str) -> None:
        if not isinstance(body, dict):
            raise InvalidRequestError(f"the body of {endpoint} must be a JSON object, got {type(body).__name__}")
        self.left, self.endpoint = dict(body), endpoint

    def take(self, name: str, kinds: type | tuple[type, ...], default: Any = None, what: str = "") -> Any:
        value = self.left.pop(name, None)
        if value is None:
            return default
        kinds = kinds if isinstance(kinds, tuple) else (kinds,)
        numeric = float in kinds and isinstance(value, int)
        if isinstance(value, bool) and bool not in kinds or not (isinstance(value, kinds) or numeric):
            names = " or ".join({bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                 list: "an array", dict: "an object"}[kind] for kind in kinds)
            raise InvalidRequestError(f"{name} must be {what or names}, got {json.dumps(value)[:200]}")
        return float(value) if numeric and int not in kinds else value

    def drop(self, *names: str) -> None:
        """Fields read and ignored (OpenAI's ``user``: who asked, for the provider's abuse checks)."""
        for name in names:
            self.left.pop(name, None)

    def done(self) -> None:
        if self.left:
            raise InvalidRequestError(f"{self.endpoint} does not support the field(s) {', '.join(sorted(self.left))};"
                                      " leave them out (docs/serving.md lists the fields this server reads)")


def completion_request(body: object, served: Served) -> OpenAIRequest:
    """A ``/v1/completions`` body: ``prompt`` is a string, token ids, or a list of either (one request each)."""
    fields = Fields(body, "/v1/completions")
    prompts = _prompts(fields, "prompt")
    if fields.take("suffix", str) is not None:
        raise InvalidRequestError("suffix (text after the completion, for fill-in-the-middle) is not supported; "
                                  "leave it out")
    echo = fields.take("echo", bool, False)
    top = fields.take("logprobs", int)
    n = fields.take("n", int, 1)
    if fields.take("best_of", int, n) != n:
        raise InvalidRequestError("best_of other than n is not supported (the engine does not rank completions); "
                                  "leave best_of out, or set it to n")
    request = _generation(fields, served, n, top, max_tokens=fields.take("max_tokens", int, 16))
    request.prompts, request.echo = prompts, echo
    if echo and top is not None:  # the prompt's tokens come with their logprobs too (lm-evaluation-harness reads them)
        request.params = replace(request.params, prompt_logprobs=top)  # type: ignore[type-var]
    fields.done()
    return request


def chat_request(body: object, served: Served) -> OpenAIRequest:
    """A ``/v1/chat/completions`` body: one conversation (``messages``, ``tools``, ``tool_choice``)."""
    fields = Fields(body, "/v1/chat/completions")
    messages = fields.take("messages", list, what="an array of messages")
    if not messages:
        raise InvalidRequestError("messages is required: a non-empty array of {\"role\": ..., \"content\": ...}")
    one_call = not fields.take("parallel_tool_calls", bool, True)
    prompt = _conversation(fields, messages, fields.take("tool_choice", (str, dict)))
    wants_logprobs, top = fields.take("logprobs", bool, False), fields.take("top_logprobs", int)
    if top is not None and not wants_logprobs:
        raise InvalidRequestError("top_logprobs needs logprobs true; set logprobs, or leave top_logprobs out")
    most = _most_tokens(fields)
    request = _generation(fields, served, fields.take("n", int, 1), (top or 0) if wants_logprobs else None,
                          max_tokens=most)
    request.prompts, request.fill_context, request.one_call = [prompt], most is None, one_call
    fields.done()
    return request


def _conversation(fields: Fields, messages: list[Any], tool_choice: object = None) -> ChatPrompt:
    """``messages`` as a ChatPrompt with the body's ``tools``, ``add_generation_prompt``, ``continue_final_message``
    and ``chat_template_kwargs`` (a chat's and /tokenize's)."""
    check_message_count(len(messages))
    return ChatPrompt.of(messages, fields.take("add_generation_prompt", bool, True),
                         fields.take("continue_final_message", bool, False),
                         fields.take("chat_template_kwargs", dict, {}), fields.take("tools", list, ()), tool_choice)


def _most_tokens(fields: Fields) -> int | None:
    """A chat's ``max_completion_tokens``, or ``max_tokens`` (its deprecated name); None when neither is given."""
    newer, older = fields.take("max_completion_tokens", int), fields.take("max_tokens", int)
    if newer is not None and older is not None and newer != older:
        raise InvalidRequestError(f"max_completion_tokens ({newer}) and max_tokens ({older}) disagree; give one of "
                                  "them (max_tokens is the deprecated name of max_completion_tokens)")
    return older if newer is None else newer


def embedding_request(body: object, served: Served) -> OpenAIRequest:
    """A ``/v1/embeddings`` body: ``input`` is a string, token ids, or a list of either (one request each)."""
    fields = Fields(body, "/v1/embeddings")
    prompts = _prompts(fields, "input")
    encoding = fields.take("encoding_format", str, "float")
    if encoding not in ("float", "base64"):
        raise InvalidRequestError(f"encoding_format must be \"float\" or \"base64\", got {encoding[:50]!r}")
    params = PoolingParams(pooling=fields.take("pooling", str), normalize=fields.take("normalize", bool),
                           dimensions=fields.take("dimensions", int), priority=-fields.take("priority", int, 0),
                           lora_adapter=served.adapter_of(body),  # type: ignore[arg-type]
                           truncate=fields.take("truncate", bool, False))
    fields.drop("model", "user")
    fields.done()
    return OpenAIRequest(prompts, params, encoding_format=encoding)


def tokenize_request(body: object, served: Served) -> Prompt:
    """vLLM's ``/tokenize`` body: a ``prompt`` string, or a conversation (``messages``, and ``tools``,
    ``add_generation_prompt``, ``continue_final_message``, ``chat_template_kwargs`` as in a chat body)."""
    fields = Fields(body, "/tokenize")
    served.adapter_of(fields.left)
    text, messages = fields.take("prompt", str), fields.take("messages", list)
    if (text is None) == (messages is None):
        raise InvalidRequestError("/tokenize takes a prompt (a string) or messages (a conversation): give one")
    prompt: Prompt = text if messages is None else _conversation(fields, messages)
    fields.drop("model")
    fields.done()
    return prompt


def detokenize_request(body: object, served: Served, vocab_size: int) -> list[int]:
    """vLLM's ``/detokenize`` body: ``tokens``, ids of the model's vocabulary."""
    fields = Fields(body, "/detokenize")
    served.adapter_of(fields.left)
    tokens = fields.take("tokens", list, what="an array of token ids")
    if tokens is None or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab_size
                                 for t in tokens):
        raise InvalidRequestError(f"tokens must be an array of token ids in [0, {vocab_size}), got "
                                  f"{json.dumps(tokens)[:200]}")
    fields.drop("model")
    fields.done()
    return tokens


def _prompts(fields: Fields, name: str) -> list[Prompt]:
    """A prompt field: a string, a list of token ids, or a non-empty list of strings or of token-id lists."""
    value = fields.take(name, (str, list), what="a string, an array of token ids, or an array of either")
    if value is None or value == []:
        raise InvalidRequestError(f"{name} is required: a string, an array of token ids, or an array of either")
    if isinstance(value, str) or all(isinstance(v, int) and not isinstance(v, bool) for v in value):
        return [value]
    if len(value) > MAX_PROMPTS:
        raise InvalidRequestError(f"{name} holds {len(value)} prompts; at most {MAX_PROMPTS} go in one body")
    for index, item in enumerate(value):
        ids = isinstance(item, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in item)
        if not (isinstance(item, str) or ids):
            raise InvalidRequestError(f"{name}[{index}] must be a string or an array of token ids, got "
                                      f"{json.dumps(item)[:200]}")
    return list(value)


def _generation(fields: Fields, served: Served, n: int, top: int | None, max_tokens: int | None) -> OpenAIRequest:
    """The sampling fields that completions and chat share, as SamplingParams (validated). ``max_tokens`` None: the
    context's room, which the front sets once the prompt is tokenized (a stand-in of at least min_tokens till then)."""
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise InvalidRequestError(f"logprobs asks for the top {top} tokens; give 0 to {MAX_TOP_LOGPROBS}")
    stream = fields.take("stream", bool, False)
    options = fields.take("stream_options", dict, {})
    if not stream and options:
        raise InvalidRequestError("stream_options needs stream true; set stream, or leave stream_options out")
    if set(options) - {"include_usage"} or not isinstance(options.get("include_usage", False), bool):
        raise InvalidRequestError(f"stream_options supports include_usage (a boolean) alone, got "
                                  f"{json.dumps(options)[:200]}")
    bias = fields.take("logit_bias", dict, {})
    try:
        bias = {int(token): value for token, value in bias.items()}
    except ValueError:
        raise InvalidRequestError(f"logit_bias must map token ids (as strings) to biases, got "
                                  f"{json.dumps(bias)[:200]}") from None
    kwargs = {name: fields.take(name, kinds) for name, kinds in _SCALARS.items()}
    if (priority := fields.take("priority", int)) is not None:
        kwargs["priority"] = -priority  # vLLM's: lower first
    params = SamplingParams(
        max_tokens=max(16, kwargs["min_tokens"] or 0) if max_tokens is None else max_tokens, n=n, logprobs=top,
        logit_bias=bias,
        stop=fields.take("stop", (str, list), ()), stop_token_ids=tuple(fields.take("stop_token_ids", list, ())),
        structured_output=_structure(fields), lora_adapter=served.adapter_of(fields.left),
        **{name: value for name, value in kwargs.items() if value is not None})
    fields.drop("model", "user")
    params.validate()
    return OpenAIRequest([], params, stream, options.get("include_usage", False),
                         token_ids=fields.take("return_token_ids", bool, False))


_SCALARS: dict[str, type | tuple[type, ...]] = {
    "temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int, "presence_penalty": float,
    "frequency_penalty": float, "repetition_penalty": float, "min_tokens": int, "ignore_eos": bool,
    "include_stop_str_in_output": bool}


def _structure(fields: Fields) -> StructuredOutput | None:
    """OpenAI's ``response_format`` or vLLM's ``structured_outputs`` (one of regex, choice, json, grammar)."""
    form = fields.take("response_format", dict)
    spec = fields.take("structured_outputs", dict)
    if form is not None and spec is not None:
        raise InvalidRequestError("response_format and structured_outputs both set; give one of them")
    if form is not None:
        kind = form.get("type")
        if kind == "text" and set(form) == {"type"}:
            return None
        if kind == "json_object" and set(form) == {"type"}:
            return StructuredOutput(json_schema=json.dumps({"type": "object"}))
        if kind == "json_schema" and set(form) == {"type", "json_schema"} and _is_json_schema(form["json_schema"]):
            return StructuredOutput(json_schema=json.dumps(form["json_schema"]["schema"]))
        raise InvalidRequestError('response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
                                  '"json_schema", "json_schema": {"name": ..., "schema": {...}}} (and optionally '
                                  f'"description" and "strict", a boolean), got {json.dumps(form)[:200]}')
    if spec is None:
        return None
    kinds = {"regex": "regex", "choice": "choice", "json": "json_schema", "grammar": "grammar"}
    if len(spec) != 1 or (name := next(iter(spec))) not in kinds:
        raise InvalidRequestError(f"structured_outputs must set exactly one of {', '.join(kinds)}, got "
                                  f"{json.dumps(spec)[:200]}")
    value = spec[name]
    if name == "choice":
        value = tuple(value) if isinstance(value, list) else value
    elif name == "json" and isinstance(value, dict):
        value = json.dumps(value)
    output = StructuredOutput(**{kinds[name]: value})
    output.validate()
    return output


def _is_json_schema(spec: object) -> bool:
    """OpenAI's ``json_schema`` object: a ``schema``, and ``name``, ``description``, ``strict`` that change nothing
    here (the schema is enforced token by token, strict or not)."""
    return isinstance(spec, dict) and isinstance(spec.get("schema"), dict) and set(spec) <= {
        "name", "description", "schema", "strict"} and isinstance(spec.get("strict", False), (bool, type(None)))
