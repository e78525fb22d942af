"""Python clients of ``infer serve``: :class:`Client` (blocking) and :class:`AsyncClient` (asyncio).

Both return the generated protobuf messages (``infer.server.infer_pb2``; ``embed`` the vector, a list of floats).
``generate`` returns the gRPC call itself: iterate it for the GenerateResponse deltas, ``cancel()`` it to abort the
request on the server. Errors are ``grpc.RpcError`` (``grpc.aio.AioRpcError``) with the server's status code and
message.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ..core.chat import ChatPrompt, Prompt
from ..core.errors import InvalidRequestError
from ..core.request import SamplingParams
from . import infer_pb2 as pb
from . import infer_pb2_grpc as pb_grpc
from .convert import processor_calls_to_proto, sampling_params_to_proto

DEFAULT_TARGET = "127.0.0.1:50051"
DEFAULT_MAX_MESSAGE_BYTES = -1  # no limit of the client's own: the server's --max-message-bytes bounds its replies


def build_request(prompt: Prompt, params: SamplingParams | None = None, *, request_id: str = "",
                  priority: int | None = None, **sampling: Any) -> pb.GenerateRequest:
    """A GenerateRequest. ``sampling`` keywords (max_tokens=, temperature=, ...) are sent as given, unvalidated;
    fields left out take the server's SamplingParams defaults. ``priority`` defaults to ``params.priority``."""
    if priority is None:
        priority = params.priority if params is not None else 0
    try:
        request = pb.GenerateRequest(request_id=request_id, priority=priority)
    except (ValueError, TypeError):
        raise InvalidRequestError(f"priority must be an integer in (-2**31, 2**31) and request_id a string, got "
                                  f"{priority!r} and {request_id!r}") from None
    request.params.CopyFrom(sampling_params_to_proto(params, **sampling))
    set_prompt(request, prompt)
    return request


def set_prompt(request: pb.GenerateRequest | pb.BeamSearchRequest | pb.EmbedRequest, prompt: Prompt) -> None:
    if isinstance(prompt, str):
        request.text = prompt
        return
    if isinstance(prompt, ChatPrompt):  # the server renders it with its model's chat template
        prompt = prompt.checked()  # here, as the server will check it
        for message in prompt.messages:
            sent = request.chat.messages.add(role=message.role, tool_calls=[
                pb.ToolCall(id=call.id or "", name=call.name, arguments=json.dumps(call.arguments))
                for call in message.tool_calls], tool_call_id=message.tool_call_id or "", name=message.name or "",
                reasoning_content=message.reasoning_content or "")
            if message.content_parts is not None:
                sent.content_parts.texts.extend(message.content_parts)
                sent.content_parts.SetInParent()  # an empty list too
            elif message.content is not None:
                sent.content = message.content
        request.chat.add_generation_prompt = prompt.add_generation_prompt
        request.chat.continue_final_message = prompt.continue_final_message
        if prompt.chat_template_kwargs:
            request.chat.chat_template_kwargs = json.dumps(prompt.chat_template_kwargs)
        if prompt.tools:
            request.chat.tools = json.dumps(prompt.tools)
        choice = prompt.tool_choice
        if choice != "auto":
            request.chat.tool_choice = choice if isinstance(choice, str) else json.dumps(
                {"type": "function", "function": {"name": choice.name}})
        return
    try:
        request.token_ids.ids.extend(prompt)
    except (ValueError, TypeError):
        raise InvalidRequestError("a prompt is a string, a list of token ids (integers below 2**63) or a "
                                  f"ChatPrompt, got {type(prompt).__name__} {str(prompt)[:80]}") from None


def build_beam_request(prompt: Prompt, **params: Any) -> pb.BeamSearchRequest:
    """A BeamSearchRequest; ``params`` are sent as given (the server validates them), logits_processors in any
    form SamplingParams takes."""
    if "logits_processors" in params:
        params = dict(params, logits_processors=processor_calls_to_proto(params["logits_processors"],
                                                                          "beam search parameters"))
    try:
        request = pb.BeamSearchRequest(**params)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid beam search parameters {params!r}: {exc}; they are beam_width, "
                                  "max_tokens, length_penalty, ignore_eos, lora_adapter, logits_processors and "
                                  "request_id") from None
    set_prompt(request, prompt)
    return request


def build_embed_request(prompt: Prompt, *, pooling: str | None = None, normalize: bool | None = None,
                        dimensions: int | None = None, priority: int = 0, lora_adapter: str | None = None,
                        request_id: str | None = None, truncate: bool = False) -> pb.EmbedRequest:
    """An EmbedRequest; the values are sent as given (the server validates them), None ones unset (the server's
    PoolingParams defaults)."""
    fields = {name: value for name, value in (("pooling", pooling), ("normalize", normalize),
                                              ("dimensions", dimensions), ("lora_adapter", lora_adapter))
              if value is not None}
    try:
        request = pb.EmbedRequest(request_id=request_id or "", priority=priority, truncate=truncate, **fields)
    except (ValueError, TypeError) as exc:
        raise InvalidRequestError(f"invalid embedding parameters {fields | {'priority': priority}!r}: {exc}; "
                                  "dimensions is an integer in [1, 2**32), priority one in (-2**31, 2**31), pooling "
                                  "and lora_adapter strings, normalize a bool") from None
    set_prompt(request, prompt)
    return request


def _channel_config(tls: bool, root_certificates: bytes | str | Path | None,
                    max_message_bytes: int) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, Any]]]:
    options = [("grpc.max_receive_message_length", max_message_bytes),
               ("grpc.max_send_message_length", max_message_bytes)]
    if not tls and root_certificates is None:
        return None, options
    roots = Path(root_certificates).read_bytes() if isinstance(root_certificates, (str, Path)) else root_certificates
    return grpc.ssl_channel_credentials(root_certificates=roots), options


class _Base:
    def __init__(self, channels: Any, target: str, token: str | None, tls: bool,
                 root_certificates: bytes | str | Path | None, timeout: float | None, max_message_bytes: int) -> None:
        """``channels`` is ``grpc`` or ``grpc.aio``: both have ``secure_channel`` and ``insecure_channel``."""
        self.target, self.timeout = target, timeout
        self.metadata = (("authorization", f"Bearer {token}"),) if token else None
        creds, options = _channel_config(tls, root_certificates, max_message_bytes)
        self.channel = (channels.secure_channel(target, creds, options) if creds
                        else channels.insecure_channel(target, options))
        self.stub = pb_grpc.InferenceStub(self.channel)
        self.health_stub = health_pb2_grpc.HealthStub(self.channel)

    def _kw(self, timeout: float | None) -> dict[str, Any]:
        return {"metadata": self.metadata, "timeout": self.timeout if timeout is None else timeout}


class Client(_Base):
    """Blocking client. ``Client("127.0.0.1:50051", token=..., tls=True, root_certificates=PATH)``."""

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        super().__init__(grpc, target, token, tls, root_certificates, timeout, max_message_bytes)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str = "",
                 priority: int | None = None, timeout: float | None = None, **sampling: Any) -> Any:
        """Stream a request: an iterator of GenerateResponse that also has ``cancel()``."""
        request = build_request(prompt, params, request_id=request_id, priority=priority, **sampling)
        return self.stub.Generate(request, **self._kw(timeout))

    def complete(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str = "",
                 priority: int | None = None, timeout: float | None = None, **sampling: Any) -> pb.CompleteResponse:
        request = build_request(prompt, params, request_id=request_id, priority=priority, **sampling)
        return self.stub.Complete(request, **self._kw(timeout))

    def embed(self, prompt: Prompt, pooling: str | None = None, normalize: bool | None = None,
              dimensions: int | None = None, priority: int = 0, lora_adapter: str | None = None,
              request_id: str | None = None, timeout: float | None = None, truncate: bool = False) -> list[float]:
        """The embedding of ``prompt`` (the Embed RPC): ``pooling`` a pooler's name ("last", "mean", ...),
        ``normalize``, ``dimensions`` (the first N values), ``truncate`` (embed a too-long prompt's first tokens
        instead of INVALID_ARGUMENT); None takes the server checkpoint's defaults. Empty if the request was
        aborted."""
        request = build_embed_request(prompt, pooling=pooling, normalize=normalize, dimensions=dimensions,
                                      priority=priority, lora_adapter=lora_adapter, request_id=request_id,
                                      truncate=truncate)
        return list(self.stub.Embed(request, **self._kw(timeout)).embedding)

    def abort(self, request_id: str, timeout: float | None = None) -> None:
        self.stub.Abort(pb.AbortRequest(request_id=request_id), **self._kw(timeout))

    def beam_search(self, prompt: Prompt, *, timeout: float | None = None,
                    **params: Any) -> pb.BeamSearchResponse:
        """Beam search for one prompt; ``params``: beam_width=, max_tokens=, length_penalty=, ignore_eos=,
        lora_adapter=, logits_processors= (unset: the server's BeamSearchParams defaults), and request_id= (then
        ``abort(request_id)`` stops it)."""
        return self.stub.BeamSearch(build_beam_request(prompt, **params), **self._kw(timeout))

    def start_beam_search(self, prompt: Prompt, *, timeout: float | None = None, **params: Any) -> Any:
        """:meth:`beam_search` without waiting: a ``grpc.Future`` whose ``result()`` is the BeamSearchResponse
        (with a request_id, ``abort(request_id)`` meanwhile makes it the best beams so far)."""
        return self.stub.BeamSearch.future(build_beam_request(prompt, **params), **self._kw(timeout))

    def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._kw(timeout))

    def plugins(self, timeout: float | None = None) -> list[pb.Plugin]:
        return list(self.stub.ListPlugins(pb.ListPluginsRequest(), **self._kw(timeout)).plugins)

    def stats(self, timeout: float | None = None) -> pb.Stats:
        return self.stub.GetStats(pb.GetStatsRequest(), **self._kw(timeout))

    def load_lora_adapter(self, name: str, path: str | Path, timeout: float | None = None) -> list[str]:
        """Have a server started with ``--allow-lora-loading`` serve the adapter in ``path`` (a folder on the
        server, absolute) as ``name``; returns the adapters it serves then."""
        request = pb.LoadLoraAdapterRequest(name=name, path=str(path))
        return list(self.stub.LoadLoraAdapter(request, **self._kw(timeout)).names)

    def unload_lora_adapter(self, name: str, timeout: float | None = None) -> list[str]:
        """Stop serving ``name``; returns the adapters the server serves then."""
        request = pb.UnloadLoraAdapterRequest(name=name)
        return list(self.stub.UnloadLoraAdapter(request, **self._kw(timeout)).names)

    def health(self, service: str = "", timeout: float | None = None) -> str:
        """The health status name: SERVING, NOT_SERVING, SERVICE_UNKNOWN or UNKNOWN."""
        response = self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), **self._kw(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def wait_until_serving(self, timeout: float = 60.0) -> None:
        """Poll health until SERVING; raise TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                if self.health(timeout=1.0) == "SERVING":
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"the server was not SERVING within {timeout} s")
            time.sleep(0.1)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; the same methods as :class:`Client`, as coroutines (``generate`` is an async iterator)."""

    def __init__(self, target: str = DEFAULT_TARGET, *, token: str | None = None, tls: bool = False,
                 root_certificates: bytes | str | Path | None = None, timeout: float | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        super().__init__(grpc.aio, target, token, tls, root_certificates, timeout, max_message_bytes)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, request_id: str = "",
                 priority: int | None = None, timeout: float | None = None, **sampling: Any) -> Any:
        """Stream a request: a grpc.aio call, async-iterable over GenerateResponse, with ``cancel()``."""
        request = build_request(prompt, params, request_id=request_id, priority=priority, **sampling)
        return self.stub.Generate(request, **self._kw(timeout))

    async def complete(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       request_id: str = "", priority: int | None = None, timeout: float | None = None,
                       **sampling: Any) -> pb.CompleteResponse:
        request = build_request(prompt, params, request_id=request_id, priority=priority, **sampling)
        return await self.stub.Complete(request, **self._kw(timeout))

    async def embed(self, prompt: Prompt, pooling: str | None = None, normalize: bool | None = None,
                    dimensions: int | None = None, priority: int = 0, lora_adapter: str | None = None,
                    request_id: str | None = None, timeout: float | None = None, truncate: bool = False
                    ) -> list[float]:
        """As :meth:`Client.embed`."""
        request = build_embed_request(prompt, pooling=pooling, normalize=normalize, dimensions=dimensions,
                                      priority=priority, lora_adapter=lora_adapter, request_id=request_id,
                                      truncate=truncate)
        return list((await self.stub.Embed(request, **self._kw(timeout))).embedding)

    async def abort(self, request_id: str, timeout: float | None = None) -> None:
        await self.stub.Abort(pb.AbortRequest(request_id=request_id), **self._kw(timeout))

    async def beam_search(self, prompt: Prompt, *, timeout: float | None = None,
                          **params: Any) -> pb.BeamSearchResponse:
        """As :meth:`Client.beam_search`."""
        return await self.stub.BeamSearch(build_beam_request(prompt, **params), **self._kw(timeout))

    async def model_info(self, timeout: float | None = None) -> pb.ModelInfo:
        return await self.stub.GetModelInfo(pb.GetModelInfoRequest(), **self._kw(timeout))

    async def plugins(self, timeout: float | None = None) -> list[pb.Plugin]:
        return list((await self.stub.ListPlugins(pb.ListPluginsRequest(), **self._kw(timeout))).plugins)

    async def stats(self, timeout: float | None = None) -> pb.Stats:
        return await self.stub.GetStats(pb.GetStatsRequest(), **self._kw(timeout))

    async def load_lora_adapter(self, name: str, path: str | Path, timeout: float | None = None) -> list[str]:
        request = pb.LoadLoraAdapterRequest(name=name, path=str(path))
        return list((await self.stub.LoadLoraAdapter(request, **self._kw(timeout))).names)

    async def unload_lora_adapter(self, name: str, timeout: float | None = None) -> list[str]:
        request = pb.UnloadLoraAdapterRequest(name=name)
        return list((await self.stub.UnloadLoraAdapter(request, **self._kw(timeout))).names)

    async def health(self, service: str = "", timeout: float | None = None) -> str:
        response = await self.health_stub.Check(health_pb2.HealthCheckRequest(service=service), **self._kw(timeout))
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
