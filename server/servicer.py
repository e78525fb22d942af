"""InferenceServicer: the infer.v1.Inference service on grpc.aio, in front of an :class:`EngineWorker`."""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import grpc

from ..core.errors import CapacityError, InvalidRequestError
from ..core.lora import check_lora_name
from ..core.pooling import PoolingParams
from ..core.request import RequestOutput, SamplingParams
from . import infer_pb2 as pb
from . import infer_pb2_grpc as pb_grpc
from .convert import (FINISH_REASONS, beam_params_of, beam_search_to_proto, completion_to_proto, pooling_params_of,
                      positions_to_proto, prompt_of, sampling_params_of, status_of)
from .streams import RequestStream
from .worker import EngineWorker, ServerFull, ServerUnavailable

if TYPE_CHECKING:
    from ..core.engine import Engine

log = logging.getLogger("infer.server")
DEFAULT_MAX_MESSAGE_BYTES = 4 * 2**20  # gRPC's own default
MAX_REQUEST_ID_CHARS = 256


class InferenceServicer(pb_grpc.InferenceServicer):
    """Admission (draining, the bounded queue), streaming, cancellation and error mapping.

    All state here lives on the event loop; the engine is reached only through ``worker``.
    """

    def __init__(self, worker: EngineWorker, model_info: pb.ModelInfo, plugins: pb.ListPluginsResponse,
                 max_queue: int, max_message_bytes: int | None = None, allow_lora_loading: bool = False) -> None:
        self.worker = worker
        self.allow_lora_loading = allow_lora_loading  # LoadLoraAdapter/UnloadLoraAdapter (serve --allow-lora-loading)
        self.max_message_bytes = max_message_bytes  # what one response may hold (--max-message-bytes)
        self.model_info = model_info
        # what GetModelInfo lists: replaced (one reference, on the engine thread) by each load and unload as it
        # runs, so a call whose caller went away mid-way still updates it
        self.served_adapters = tuple(model_info.lora_adapters)
        self.plugins = plugins
        self.max_queue = max_queue
        self.in_flight = 0
        self.rejected = 0  # refused for backpressure
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()
        self.started = time.monotonic()

    # ------------------------------------------------------------ generation
    async def Generate(self, request: pb.GenerateRequest,
                       context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
        def size_of(delta: RequestOutput) -> int:  # a slow reader's queued deltas merge up to half the limit
            size = sum(merged_share(completion_to_proto(c)) for c in delta.outputs)  # (framing and usage fit beside)
            if delta.prompt_logprobs is not None:  # they come once, with the first
                size += sum(entry.ByteSize() + 3 for entry in positions_to_proto(delta.prompt_logprobs))
            return size

        limit = self.max_message_bytes or DEFAULT_MAX_MESSAGE_BYTES
        stream = await self._open(request, context, size_of, limit // 2)
        try:
            # what a write raises (the client went away mid-send) is gRPC's to handle, which it does quietly for a
            # closed call: only the making of the responses maps to a status (an INTERNAL error logged as a fault)
            async with contextlib.aclosing(_stream_responses(stream, limit, context)) as responses:
                async for response in responses:
                    yield response
        finally:
            self.close(stream)

    async def Complete(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext) -> pb.CompleteResponse:
        stream = await self._open(request, context)
        completions: dict[int, pb.Completion] = {}
        completion_tokens = size = 0
        overhead = 64 + len(stream.request_id.encode())  # the id, the usage and their framing
        too_large = (f"the response grew past --max-message-bytes {self.max_message_bytes}, so Complete cannot "
                     "send it; use Generate (it streams the reply a few tokens per message), ask for fewer tokens, "
                     "choices or logprobs, or raise the server's --max-message-bytes")
        prompt_logprobs: list[pb.PositionLogprobs] = []
        try:
            async for out in stream:
                if out.prompt_logprobs is not None:
                    prompt_logprobs = positions_to_proto(out.prompt_logprobs)
                    size += sum(entry.ByteSize() + 3 for entry in prompt_logprobs)
                    too_large = (f"the response grew past --max-message-bytes {self.max_message_bytes} with the "
                                 f"prompt logprobs of {len(prompt_logprobs)} positions (Generate sends them in one "
                                 "message too); ask for fewer top entries (prompt_logprobs), a shorter prompt or "
                                 "fewer tokens, or raise the server's --max-message-bytes")
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    part = completion_to_proto(c)
                    size += merged_share(part)
                    framing = 32 * (len(completions) + (c.index not in completions))  # each completion's own
                    if self.max_message_bytes is not None and size + framing > self.max_message_bytes - overhead:
                        raise CapacityError(too_large)
                    if c.index in completions:
                        full = completions[c.index]
                        full.token_ids.extend(part.token_ids)
                        full.text += part.text
                        full.logprobs.extend(part.logprobs)
                        full.finish_reason = part.finish_reason
                        if part.HasField("content"):
                            full.content = part.content
                            full.tool_calls.extend(part.tool_calls)
                        if part.HasField("reasoning_content"):
                            full.reasoning_content = part.reasoning_content
                        if part.HasField("reasoning_text"):
                            full.reasoning_text += part.reasoning_text
                            full.content_text += part.content_text
                        full.new_tool_calls.extend(part.new_tool_calls)
                    else:
                        completions[c.index] = part
                if out.finished:
                    response = pb.CompleteResponse(request_id=out.request_id,
                                                   outputs=[completions[i] for i in sorted(completions)],
                                                   usage=_usage(out, completion_tokens),
                                                   prompt_logprobs=prompt_logprobs)
                    if self.max_message_bytes is not None and response.ByteSize() > self.max_message_bytes:
                        raise CapacityError(too_large)
                    return response
            raise RuntimeError("the request's stream ended without a finished output")
        except Exception as exc:
            await _abort_with(context, exc)
        finally:
            self.close(stream)

    async def Embed(self, request: pb.EmbedRequest, context: grpc.aio.ServicerContext) -> pb.EmbedResponse:
        """One prompt's embedding, admitted and run as Complete runs a request (an Abort answers with none)."""
        stream = await self._open(request, context)
        try:
            async for out in stream:
                if out.finished:
                    response = pb.EmbedResponse(request_id=out.request_id, embedding=out.embedding or [],
                                                usage=_usage(out, 0),
                                                finish_reason=FINISH_REASONS[out.outputs[0].finish_reason])
                    if self.max_message_bytes is not None and response.ByteSize() > self.max_message_bytes:
                        raise CapacityError(
                            f"the embedding ({len(response.embedding)} values, {response.ByteSize()} bytes) is past "
                            f"--max-message-bytes {self.max_message_bytes}, so Embed cannot send it; ask for fewer "
                            "dimensions, or raise the server's --max-message-bytes")
                    return response
            raise RuntimeError("the embedding request's stream ended without a finished output")
        except Exception as exc:
            await _abort_with(context, exc)
        finally:
            self.close(stream)

    async def _open(self, request: pb.GenerateRequest | pb.EmbedRequest, context: grpc.aio.ServicerContext,
                    size_of: Callable[[RequestOutput], int] | None = None, max_merged: int = 0) -> RequestStream:
        """Validate and admit a request (an embedding request for an EmbedRequest), or abort the call
        (INVALID_ARGUMENT, UNAVAILABLE, RESOURCE_EXHAUSTED)."""
        try:
            params: SamplingParams | PoolingParams = (pooling_params_of(request) if isinstance(request, pb.EmbedRequest)
                                                      else sampling_params_of(request))
            prompt = prompt_of(request)
            check_request_id(request.request_id)
        except Exception as exc:
            await _abort_with(context, exc)
        await self._admit(context)
        stream = RequestStream(request.request_id or uuid.uuid4().hex, size_of, max_merged)
        self.worker.submit(prompt, params, stream)
        return stream

    async def _admit(self, context: grpc.aio.ServicerContext) -> None:
        """:meth:`admit`, or abort the call: UNAVAILABLE while draining, RESOURCE_EXHAUSTED when full."""
        try:
            self.admit()
        except ServerFull as exc:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
        except ServerUnavailable as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))

    def admit(self) -> None:
        """Count a request in flight (the gRPC calls' and the HTTP front's alike), or raise ServerUnavailable while
        draining and ServerFull past --max-queue. Each admitted request ends with :meth:`close`."""
        if self.draining:
            raise ServerUnavailable("the server is shutting down and accepts no new requests; retry on another replica")
        if self.in_flight >= self.max_queue:
            self.rejected += 1
            raise ServerFull(f"the server is full: {self.in_flight} requests in flight (--max-queue {self.max_queue}); "
                             "retry later")
        self.in_flight += 1
        self.idle.clear()

    def close(self, stream: RequestStream) -> None:
        """An admitted request's call ended: if the request still runs (cancel, deadline, error), abort it and free
        its KV."""
        if not stream.finished:
            self.worker.cancel(stream)
        self._release()

    def _release(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()

    async def BeamSearch(self, request: pb.BeamSearchRequest,
                         context: grpc.aio.ServicerContext) -> pb.BeamSearchResponse:
        """Beam search for one prompt (core/beam_search.py), started at once beside the requests; a cancelled call
        (client cancel, deadline) stops it and frees its KV blocks."""
        try:
            params = beam_params_of(request)
            prompt = prompt_of(request)
            check_request_id(request.request_id)
        except Exception as exc:
            await _abort_with(context, exc)
        await self._admit(context)
        try:
            [output] = await asyncio.wrap_future(self.worker.beam_search([prompt], params, request.request_id))
        except Exception as exc:
            await _abort_with(context, exc)
        finally:
            self._release()
        response = beam_search_to_proto(output)
        if self.max_message_bytes is not None and response.ByteSize() > self.max_message_bytes:
            # else gRPC refuses to send it with RESOURCE_EXHAUSTED, which reads as "retry later": no retry helps
            await _abort_with(context, CapacityError(
                f"the beam search's response ({response.ByteSize()} bytes: {len(response.beams)} beams of up to "
                f"{max((len(b.token_ids) for b in response.beams), default=0)} tokens) is past --max-message-bytes "
                f"{self.max_message_bytes}, so BeamSearch cannot send it; ask for fewer beams (beam_width) or "
                "tokens (max_tokens), or raise the server's --max-message-bytes"))
        return response

    # ------------------------------------------------------------ control and introspection
    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext) -> pb.AbortResponse:
        if not request.request_id:
            await _abort_with(context, InvalidRequestError(
                "request_id is required: pass the id of the request to abort (the one in its responses)"))
        try:
            check_request_id(request.request_id)  # no request has a longer one
            await asyncio.wrap_future(self.worker.abort(request.request_id))
        except Exception as exc:
            await _abort_with(context, exc)
        return pb.AbortResponse(request_id=request.request_id)

    async def GetModelInfo(self, request: pb.GetModelInfoRequest,
                           context: grpc.aio.ServicerContext) -> pb.ModelInfo:
        info = pb.ModelInfo()
        info.CopyFrom(self.model_info)
        info.lora_adapters[:] = self.served_adapters
        return info

    async def ListPlugins(self, request: pb.ListPluginsRequest,
                          context: grpc.aio.ServicerContext) -> pb.ListPluginsResponse:
        return self.plugins

    async def GetStats(self, request: pb.GetStatsRequest, context: grpc.aio.ServicerContext) -> pb.Stats:
        try:
            return await self.stats()
        except Exception as exc:
            await _abort_with(context, exc)

    # ------------------------------------------------------------ LoRA adapters
    async def LoadLoraAdapter(self, request: pb.LoadLoraAdapterRequest,
                              context: grpc.aio.ServicerContext) -> pb.LoraAdapters:
        await self._check_lora_loading(context)
        name = request.name
        try:
            check_lora_name(name)
            if not request.path:
                raise InvalidRequestError("path is required: the adapter's folder on the server")
            if not Path(request.path).is_absolute():  # the server's working directory is no caller's business
                raise InvalidRequestError(f"path {request.path!r} is relative; give the adapter folder's absolute "
                                          "path on the server")
            from ..models.lora import read_adapter

            adapter = await asyncio.to_thread(read_adapter, name, Path(request.path))  # not on the engine thread

            def load(engine: Engine) -> list[str]:
                engine.load_lora_adapter(name, adapter)
                return self._served_now(engine)

            names = await asyncio.wrap_future(self.worker.call(load))
        except Exception as exc:
            await _abort_with(context, exc)
        return pb.LoraAdapters(names=names)

    async def UnloadLoraAdapter(self, request: pb.UnloadLoraAdapterRequest,
                                context: grpc.aio.ServicerContext) -> pb.LoraAdapters:
        await self._check_lora_loading(context)

        def unload(engine: Engine) -> list[str]:
            engine.unload_lora_adapter(request.name)
            return self._served_now(engine)

        try:
            names = await asyncio.wrap_future(self.worker.call(unload))
        except Exception as exc:
            await _abort_with(context, exc)
        return pb.LoraAdapters(names=names)

    async def _check_lora_loading(self, context: grpc.aio.ServicerContext) -> None:
        if not self.allow_lora_loading:
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, "this server loads no LoRA adapters at run time "
                                "(they are read from its own disk): start it with `infer ... serve "
                                "--allow-lora-loading` (and --max-lora-adapters N for free slots)")

    def _served_now(self, engine: Engine) -> list[str]:
        """On the engine thread, after a load or unload: the adapters served now, which GetModelInfo lists."""
        names = engine.lora_adapters
        self.served_adapters = tuple(names)
        return names

    async def stats(self) -> pb.Stats:
        """Engine load (read on the engine thread) plus this server's admission state."""
        snap = await asyncio.wrap_future(self.worker.snapshot())
        fields = dict(vars(snap))
        total = snap.kv_total_blocks
        return pb.Stats(**fields, in_flight=self.in_flight, max_queue=self.max_queue,
                        kv_usage=snap.kv_used_blocks / total if total else 0.0,
                        uptime_s=time.monotonic() - self.started, draining=self.draining)


def check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:  # every response repeats it; logs name it
        raise InvalidRequestError(f"request_id has {len(request_id)} characters; at most {MAX_REQUEST_ID_CHARS} "
                                  "are accepted")


def _too_large_message(out: RequestOutput, size: int, limit: int) -> str:
    """Why one Generate response is past the limit, and what to change."""
    if out.prompt_logprobs is not None:
        return (f"the prompt logprobs of {len(out.prompt_logprobs)} positions make a response of {size} bytes, past "
                f"--max-message-bytes {limit}; ask for fewer top entries (prompt_logprobs), send a shorter prompt, or "
                "raise the server's --max-message-bytes")
    count = len(out.outputs)
    return (f"one message of the reply ({count} completion{'s' * (count != 1)} of a step or so) takes {size} bytes, "
            f"past --max-message-bytes {limit}; ask for fewer completions (n) or top logprobs, or raise the server's "
            "--max-message-bytes")


def merged_share(part: pb.Completion) -> int:
    """The bytes a delta adds to its completion once merged: token-id varints, text, logprob entries with their
    framing (the completion's own fields and framing come once, outside this)."""
    ids = sum((token.bit_length() + 6) // 7 or 1 for token in part.token_ids)
    entries = sum(entry.ByteSize() + 3 for entry in (*part.logprobs, *part.tool_calls, *part.new_tool_calls))
    texts = (part.text, part.content, part.reasoning_content, part.reasoning_text, part.content_text)
    return ids + entries + sum(len(text.encode()) for text in texts)


def _usage(out: RequestOutput, completion_tokens: int) -> pb.Usage:
    return pb.Usage(prompt_tokens=len(out.prompt_token_ids), completion_tokens=completion_tokens,
                    cached_tokens=out.num_cached_tokens)


async def _stream_responses(stream: RequestStream, limit: int,
                            context: grpc.aio.ServicerContext) -> AsyncIterator[pb.GenerateResponse]:
    """Generate's messages, one per delta of ``stream``; an error (the engine's, or a message past ``limit``)
    aborts the call with its status."""
    completion_tokens = 0
    try:
        async for out in stream:
            completion_tokens += sum(len(c.token_ids) for c in out.outputs)
            response = pb.GenerateResponse(request_id=out.request_id,
                                           outputs=[completion_to_proto(c) for c in out.outputs],
                                           finished=out.finished)
            if out.prompt_logprobs is not None:
                response.prompt_logprobs.extend(positions_to_proto(out.prompt_logprobs))
            if out.finished:
                response.usage.CopyFrom(_usage(out, completion_tokens))
            if (size := response.ByteSize()) > limit:  # gRPC would fail it as RESOURCE_EXHAUSTED: say why
                raise CapacityError(_too_large_message(out, size, limit))
            yield response
    except Exception as exc:
        await _abort_with(context, exc)


async def _abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the call with the status of ``exc``; an abort already in progress passes through unchanged."""
    if isinstance(exc, grpc.aio.AbortError):
        raise exc
    code, details = status_of(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error: %s", details, exc_info=exc)
    await context.abort(code, details)
    raise AssertionError("unreachable: context.abort raises")
