"""Conversions between the gRPC messages and the core types, and the mapping of errors to status codes."""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import grpc

from ..core.chat import (ChatPrompt, Prompt, check_content_part_count, check_message_count, check_tool_call_count,
                         parse_template_kwargs)
from ..core.chat_tools import ToolCall, parse_tool_choice, parse_tools
from ..core.errors import CapacityError, CheckpointError, InvalidRequestError, NotFoundError, PluginError
from ..core.pooling import PoolingParams
from ..core.request import CompletionOutput, FinishReason, SamplingParams, StructuredOutput, processor_calls
from . import infer_pb2 as pb
from .worker import ServerUnavailable

if TYPE_CHECKING:  # core.beam_search imports torch, which the clients of this module do not need
    from ..core.beam_search import BeamSearchOutput, BeamSearchParams

# proto field -> SamplingParams field, for the optional scalars (unset means the SamplingParams default)
_OPTIONAL_SCALARS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "logprobs", "prompt_logprobs",
                     "n", "speculative", "repetition_penalty", "frequency_penalty", "presence_penalty", "min_tokens",
                     "lora_adapter")

FINISH_REASONS = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.ABORT: pb.FINISH_REASON_ABORT,
}


def prompt_of(request: pb.GenerateRequest | pb.BeamSearchRequest | pb.EmbedRequest) -> Prompt:
    """The prompt as text, token ids or a ChatPrompt (InvalidRequestError for a malformed conversation); a request
    with none is an empty prompt (the engine rejects it)."""
    which = request.WhichOneof("prompt")
    if which == "token_ids":
        return list(request.token_ids.ids)
    if which == "chat":
        chat = request.chat
        check_message_count(len(chat.messages))  # before any Python work per message, on the event loop
        check_tool_call_count(sum(len(m.tool_calls) for m in chat.messages))
        check_content_part_count(sum(len(m.content_parts.texts) for m in chat.messages))
        tools = parse_tools(chat.tools, "chat.tools")
        return ChatPrompt.of([_message_of(m) for m in chat.messages],
                             chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
                             chat.continue_final_message,
                             parse_template_kwargs(chat.chat_template_kwargs, "chat.chat_template_kwargs"), tools,
                             parse_tool_choice(chat.tool_choice, "chat.tool_choice", tools))
    return request.text


def _message_of(message: pb.ChatMessage) -> dict[str, Any]:
    """A ChatMessage as OpenAI's mapping; empty strings stand for unset ones, and unset content for "" (none
    beside tool calls); content_parts for a content list of text parts."""
    calls = [{"id": c.id or None, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in message.tool_calls]
    content: object = message.content if message.HasField("content") else None if calls else ""
    if message.HasField("content_parts"):
        if message.HasField("content"):
            raise InvalidRequestError("a chat message sets both content and content_parts; send its text in one "
                                      "of them")
        content = [{"type": "text", "text": text} for text in message.content_parts.texts]
    return {"role": message.role, "content": content, "tool_calls": calls or None,
            "tool_call_id": message.tool_call_id or None, "name": message.name or None,
            "reasoning_content": message.reasoning_content or None}


def sampling_params_of(request: pb.GenerateRequest) -> SamplingParams:
    """Build and validate the SamplingParams of a request. Raises InvalidRequestError with the CLI's messages."""
    p = request.params
    kwargs: dict[str, Any] = {name: getattr(p, name) for name in _OPTIONAL_SCALARS if p.HasField(name)}
    params = SamplingParams(stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop), ignore_eos=p.ignore_eos,
                            priority=request.priority, logit_bias=dict(p.logit_bias),
                            include_stop_str_in_output=p.include_stop_str_in_output,
                            structured_output=_structure_of(p) if p.HasField("structured_output") else None,
                            logits_processors=processor_calls_of(p.logits_processors),
                            **kwargs)
    params.validate()
    return params


def pooling_params_of(request: pb.EmbedRequest) -> PoolingParams:
    """The validated PoolingParams of an embedding request (unset fields: the checkpoint's defaults)."""
    fields = {name: getattr(request, name) for name in ("pooling", "normalize", "dimensions", "lora_adapter")
              if request.HasField(name)}
    return PoolingParams(priority=request.priority, truncate=request.truncate, **fields)


def _structure_of(params: pb.SamplingParams) -> StructuredOutput:
    which = params.structured_output.WhichOneof("kind")
    if which is None:
        raise InvalidRequestError("invalid sampling parameters: structured_output sets none of regex, choice, "
                                  "json_schema and grammar; set one, or leave structured_output unset for free text")
    value = getattr(params.structured_output, which)
    return StructuredOutput(**{which: tuple(value.choices) if which == "choice" else value})


def structure_to_proto(spec: StructuredOutput) -> pb.StructuredOutput:
    if spec.choice is not None:
        return pb.StructuredOutput(choice=pb.Choices(choices=spec.choice))
    return pb.StructuredOutput(**{spec.kind: getattr(spec, spec.kind)})


def sampling_params_to_proto(params: SamplingParams | None = None, **fields: Any) -> pb.SamplingParams:
    """The proto form of ``params`` (every field set) or of the given keyword fields only (no validation)."""
    if params is not None:
        fields = {name: getattr(params, name) for name in (*_OPTIONAL_SCALARS, "stop_token_ids", "stop", "ignore_eos",
                                                           "include_stop_str_in_output")} | {
            "logit_bias": params.logit_bias, "logits_processors": params.logits_processors} | fields
        if fields.get("seed") is None:
            fields.pop("seed")
        for name in ("logprobs", "prompt_logprobs", "lora_adapter"):
            if fields.get(name) is None:
                fields.pop(name)
        if params.structured_output is not None:
            fields["structured_output"] = params.structured_output
    if isinstance(spec := fields.get("structured_output"), StructuredOutput):
        spec.validate()
        fields["structured_output"] = structure_to_proto(spec)
    if isinstance(fields.get("stop"), str):
        fields["stop"] = [fields["stop"]]
    if isinstance(pairs := fields.get("logit_bias"), (list, tuple)):  # SamplingParams keeps (token, bias) pairs
        tokens = [pair[0] for pair in pairs if isinstance(pair, (list, tuple)) and pair]
        if twice := [token for token in tokens if tokens.count(token) > 1]:
            raise InvalidRequestError(f"invalid sampling parameters: logit_bias names token {twice[0]!r} twice")
        try:
            fields["logit_bias"] = dict(pairs)
        except (TypeError, ValueError):
            raise InvalidRequestError(f"invalid sampling parameters: logit_bias must map token ids to biases, got "
                                      f"{pairs!r}"[:300]) from None
    if "logits_processors" in fields:
        fields["logits_processors"] = processor_calls_to_proto(fields["logits_processors"], "sampling parameters")
    try:
        return pb.SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid sampling parameters: {_unfit_field(fields) or exc}") from None


def processor_calls_to_proto(value: Any, what: str) -> list[pb.LogitsProcessorCall]:
    """Logits processors given as SamplingParams takes them (names, (name, args) pairs or a {name: args} dict) in
    proto form; InvalidRequestError naming ``what`` for another form (no validation beyond that)."""
    calls = processor_calls(value)
    if not isinstance(calls, tuple) or not all(isinstance(c, tuple) for c in calls):
        raise InvalidRequestError(f"invalid {what}: logits_processors must be names, (name, args) pairs or a "
                                  f"{{name: args}} dict, args a JSON object; got {calls!r}"[:300])
    return [pb.LogitsProcessorCall(name=name, args_json=args) for name, args in calls]


def processor_calls_of(calls: Iterable[pb.LogitsProcessorCall]) -> tuple[tuple[str, str], ...]:
    """A request's logits processors as (name, JSON text of its args) pairs (args_json "" is {})."""
    return tuple((c.name, c.args_json or "{}") for c in calls)


_INT_RANGES = {"int32": 2**31, "int64": 2**63}


def _unfit_field(fields: dict[str, Any]) -> str | None:
    """Which of ``fields`` the proto refuses, and the range its wire type holds."""
    from google.protobuf.descriptor import FieldDescriptor

    names = {FieldDescriptor.TYPE_INT32: "int32", FieldDescriptor.TYPE_INT64: "int64"}
    known = pb.SamplingParams.DESCRIPTOR.fields_by_name
    for name, value in fields.items():
        if name not in known:
            return f"no sampling parameter is called {name!r}; they are {', '.join(sorted(known))}"
        try:
            pb.SamplingParams(**{name: value})
        except (ValueError, TypeError):
            wire = names.get(pb.SamplingParams.DESCRIPTOR.fields_by_name[name].type)
            if wire is None:
                return f"{name} cannot be {value!r}"
            if not isinstance(value, int) or isinstance(value, bool):
                return f"{name} must be an integer, got {value!r}"
            return f"{name} must be below 2**{_INT_RANGES[wire].bit_length() - 1} to travel over gRPC ({wire}), " \
                   f"got {value!r}"
    return None


def beam_params_of(request: pb.BeamSearchRequest) -> BeamSearchParams:
    """The validated BeamSearchParams of a request (unset fields: the defaults)."""
    from ..core.beam_search import BeamSearchParams

    fields = {name: getattr(request, name) for name in ("beam_width", "max_tokens", "length_penalty", "lora_adapter")
              if request.HasField(name)}
    params = BeamSearchParams(ignore_eos=request.ignore_eos,
                              logits_processors=processor_calls_of(request.logits_processors), **fields)
    params.validate()
    return params


def beam_search_to_proto(out: BeamSearchOutput) -> pb.BeamSearchResponse:
    return pb.BeamSearchResponse(prompt_tokens=len(out.prompt_token_ids), beams=[
        pb.Beam(token_ids=b.token_ids, text=b.text, cumulative_logprob=b.cumulative_logprob, score=b.score,
                finish_reason=FINISH_REASONS[b.finish_reason]) for b in out.beams])


def positions_to_proto(positions: list[dict[int, float] | None]) -> list[pb.PositionLogprobs]:
    """Logprob entries ({token id: logprob} per position; None: an empty entry) in proto form."""
    return [pb.PositionLogprobs(tokens=[pb.TokenLogprob(token_id=t, logprob=lp) for t, lp in (pos or {}).items()])
            for pos in positions]


def completion_to_proto(out: CompletionOutput) -> pb.Completion:
    completion = pb.Completion(index=out.index, token_ids=out.token_ids, text=out.text,
                               logprobs=positions_to_proto(out.logprobs or []),
                               finish_reason=FINISH_REASONS[out.finish_reason])
    if out.content is not None:  # parsed: the content is set, if empty
        completion.content = out.content
    if out.reasoning_content is not None:
        completion.reasoning_content = out.reasoning_content
    if out.reasoning_text is not None:
        completion.reasoning_text, completion.content_text = out.reasoning_text, out.content_text or ""
    if out.tool_calls is not None:
        completion.tool_calls.extend(map(call_to_proto, out.tool_calls))
    if out.new_tool_calls:
        completion.new_tool_calls.extend(map(call_to_proto, out.new_tool_calls))
    return completion


def call_to_proto(call: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=call.id or "", name=call.name, arguments=json.dumps(call.arguments, ensure_ascii=False))


MAX_DETAILS_BYTES = 2048  # grpc-message travels percent-encoded in trailers: 8 KiB of metadata drops a status


def bounded_details(message: str) -> str:
    """``message`` cut to at most MAX_DETAILS_BYTES of UTF-8, saying how much was cut. Messages quote the client's
    input: past gRPC's metadata limit the status was lost and the client read RESOURCE_EXHAUSTED, a retry signal."""
    encoded = message.encode("utf-8", "backslashreplace")  # a lone surrogate would fail the encoding in grpc
    if len(encoded) <= MAX_DETAILS_BYTES:
        return encoded.decode("utf-8")
    kept = encoded[:MAX_DETAILS_BYTES].decode("utf-8", "ignore")
    return f"{kept}... ({len(encoded) - len(kept.encode('utf-8'))} more bytes cut)"


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status of an error. The details are the message the CLI prints (without its ``Error: ``), cut to
    MAX_DETAILS_BYTES."""
    code, details = _status_of(exc)
    return code, bounded_details(details)


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, InvalidRequestError):  # ConfigError too
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    # CapacityError: the request never fits this server, so a retry fails alike (RESOURCE_EXHAUSTED would invite one)
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, NotFoundError):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, (PluginError, CheckpointError)):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ServerUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    return grpc.StatusCode.INTERNAL, str(exc) or f"internal error: {type(exc).__name__}"
