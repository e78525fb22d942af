"""OpenAIFront: OpenAI's HTTP API (``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``,
``/v1/models`` and ``/v1/models/{model}``; vLLM's ``/tokenize`` and ``/detokenize``; ``/health``, ``/metrics``) in
front of the gRPC server's engine worker, on the same event loop. Requests are admitted by the servicer (one
--max-queue for both fronts, the same draining), read by server/openai_params.py, and answered by
server/openai_replies.py; a client that goes away cancels its requests (their KV is freed)."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import urllib.parse
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence as Seq
from dataclasses import replace
from typing import Any

from ..core.errors import CapacityError, InferError, InvalidRequestError, NotFoundError
from ..core.request import RequestOutput, SamplingParams
from .auth import bearer_token_matches
from .http import ClientGone, HttpError, HttpRequest, Responder
from .openai_params import (OpenAIRequest, Served, chat_request, completion_request, detokenize_request,
                            embedding_request, tokenize_request)
from .openai_replies import Reply, TokenText, embeddings_reply
from .servicer import MAX_REQUEST_ID_CHARS, InferenceServicer
from .streams import RequestStream, merge_deltas
from .worker import EngineFault, ServerFull, ServerUnavailable

log = logging.getLogger("infer.server")
MODEL_PATH = "/v1/models/{model}"  # OpenAI's retrieve route: any path under /v1/models/
OPEN_PATHS = ("/health", "/metrics")  # probes and scrapers send no token; these serve no request content
CORS_HEADERS = "Authorization, Content-Type, X-Request-Id"  # what a page may send, when its preflight names none


class OpenAIFront:
    """The HTTP handler (server/http.py's ``Handler``) of OpenAI's API, for one served model."""

    def __init__(self, servicer: InferenceServicer, served_name: str, token: str | None = None,
                 allowed_origins: Seq[str] = ()) -> None:
        self.servicer, self.worker = servicer, servicer.worker
        self.served = Served(served_name, lambda: servicer.served_adapters)
        self.token = token.encode() if token else None
        self.allowed_origins = frozenset(allowed_origins)  # CORS: web pages of these origins may call ("*": any)
        self.created = int(time.time())
        self.routes: dict[tuple[str, str], Callable[[HttpRequest, Responder], Awaitable[None]]] = {
            ("GET", "/v1/models"): self.models, ("GET", MODEL_PATH): self.model, ("GET", "/health"): self.health,
            ("POST", "/v1/completions"): self.completions, ("POST", "/v1/chat/completions"): self.chat,
            ("POST", "/v1/embeddings"): self.embeddings, ("POST", "/tokenize"): self.tokenize,
            ("POST", "/detokenize"): self.detokenize, ("GET", "/metrics"): self.metrics}

    async def __call__(self, request: HttpRequest, respond: Responder) -> None:
        wanted = MODEL_PATH if request.path.startswith(MODEL_PATH[:-len("{model}")]) else request.path
        if self._cors(request, respond) and request.method == "OPTIONS":  # a browser's preflight: no token
            methods = sorted({method for method, path in self.routes if path == wanted})
            asked = request.headers.get("access-control-request-headers")  # an SDK's own headers too (x-stainless-*)
            await respond.json(200, {}, {"Access-Control-Allow-Methods": ", ".join(methods) or "GET, POST",
                                         "Access-Control-Allow-Headers": asked or CORS_HEADERS,
                                         "Access-Control-Max-Age": "600"})
            return
        route = self.routes.get((request.method, wanted))
        if route is None:
            methods = [method for method, path in self.routes if path == wanted]
            if methods:
                raise HttpError(405, f"{request.path} answers {', '.join(methods)}, not {request.method}")
            raise HttpError(404, f"no route {request.path}; this server answers "
                            f"{', '.join(sorted({path for _, path in self.routes}))}")
        if self.token is not None and request.path not in OPEN_PATHS and not bearer_token_matches(
                request.headers.get("authorization", "").encode("latin-1"), self.token):  # the bytes sent
            raise HttpError(401, "missing or invalid bearer token: send the header 'Authorization: Bearer <token>' "
                            "(the server's INFER_SERVER_TOKEN)")
        try:
            respond.headers.update(_echoed(request_id_of(request)))  # on every answer to it, errors too
            await route(request, respond)
        except (HttpError, ClientGone):  # the layer answers the first and ends quietly on the second
            raise
        except Exception as exc:
            raise http_error_of(exc) from exc

    def _cors(self, request: HttpRequest, respond: Responder) -> bool:
        """Whether the request comes from a web page of an allowed origin (--allowed-origins); if so, every answer
        to it says so (Access-Control-Allow-Origin), errors too, so that the page can read them."""
        origin = request.headers.get("origin")
        if origin is None or not ("*" in self.allowed_origins or origin in self.allowed_origins):
            return False
        respond.headers.update({"Access-Control-Allow-Origin": "*" if "*" in self.allowed_origins else origin,
                                "Access-Control-Expose-Headers": "X-Request-Id", "Vary": "Origin"})
        return True

    async def health(self, request: HttpRequest, respond: Responder) -> None:
        if self.servicer.draining:
            raise HttpError(503, "the server is shutting down")
        if not self.worker.serving:  # as gRPC health turns NOT_SERVING: a balancer routes elsewhere
            raise HttpError(503, "the server's engine thread is not running (it failed or stopped); restart the server")
        await respond.json(200, {"status": "ok"})

    async def metrics(self, request: HttpRequest, respond: Responder) -> None:
        """Prometheus' text, as --metrics-port serves it (vLLM serves its own on the API's port)."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from .metrics import StatsCollector, registry_of

        stats = await self.servicer.stats()
        registry = registry_of(StatsCollector(lambda: stats, lambda: self.servicer.rejected))
        await respond.text(200, generate_latest(registry).decode(), CONTENT_TYPE_LATEST)

    async def models(self, request: HttpRequest, respond: Responder) -> None:
        await respond.json(200, {"object": "list", "data": self._cards()})

    async def model(self, request: HttpRequest, respond: Responder) -> None:
        """OpenAI's retrieve: the card of the model or adapter named in the path (percent-encoded)."""
        name = urllib.parse.unquote(request.path[len(MODEL_PATH) - len("{model}"):])
        self.served.adapter_of({"model": name})  # NotFoundError for a name not served
        await respond.json(200, next(card for card in self._cards() if card["id"] == name))

    def _cards(self) -> list[dict[str, Any]]:
        """The served model's card, then each LoRA adapter's (its parent: the model)."""
        info = self.servicer.model_info
        card = {"object": "model", "created": self.created, "owned_by": "infer", "root": info.model,
                "max_model_len": info.max_model_len}
        return [{"id": self.served.name, **card, "parent": None}] + [
            {"id": name, **card, "parent": self.served.name} for name in self.servicer.served_adapters]

    async def completions(self, request: HttpRequest, respond: Responder) -> None:
        body = completion_request(_json_of(request), self.served)
        await self._generate(body, "text_completion", respond, request_id_of(request))

    async def chat(self, request: HttpRequest, respond: Responder) -> None:
        await self._generate(chat_request(_json_of(request), self.served), "chat.completion", respond,
                             request_id_of(request))

    async def embeddings(self, request: HttpRequest, respond: Responder) -> None:
        body = embedding_request(_json_of(request), self.served)
        given = request_id_of(request)
        async with _Submitted(self.servicer, body, given) as streams:
            outputs = await _collect_all(streams)
        for out in outputs:
            if out.embedding is None:
                raise ServerUnavailable(f"request {out.request_id} was aborted before its embedding was computed")
        await respond.json(200, embeddings_reply(outputs, body.encoding_format, self.served.name))

    async def tokenize(self, request: HttpRequest, respond: Responder) -> None:
        """vLLM's: the token ids the engine would compute for a prompt or conversation, and the context length."""
        prompt = tokenize_request(_json_of(request), self.served)
        ids = await asyncio.wrap_future(self.worker.call(lambda engine: engine.tokenize(prompt)))
        await respond.json(200, {"count": len(ids), "max_model_len": self.servicer.model_info.max_model_len,
                                 "tokens": ids})

    async def detokenize(self, request: HttpRequest, respond: Responder) -> None:
        """vLLM's: the text of token ids."""
        ids = detokenize_request(_json_of(request), self.served, self.servicer.model_info.vocab_size)
        await respond.json(200, {"prompt": await self._decode_text(ids)})

    async def _generate(self, body: OpenAIRequest, kind: str, respond: Responder, given: str | None) -> None:
        """Answer a completions or chat body; ``given``: the client's X-Request-Id (the engine's request id, and
        the answer's id after its prefix), else a fresh one."""
        if body.fill_context:
            body.params = await self._context_rest(body)
        tokens = TokenText(self._decode)
        submitted = _Submitted(self.servicer, body, given)
        reply = Reply(kind, f"{'chatcmpl' if kind == 'chat.completion' else 'cmpl'}-{submitted.stem}",
                      self.served.name, body, tokens)
        async with submitted as streams:
            if body.echo:
                reply.echoed = [prompt if isinstance(prompt, str) else await self._decode_text(prompt)
                                for prompt in body.prompts]  # type: ignore[misc]
            if not body.stream:
                await respond.json(200, await reply.whole(await _collect_all(streams)))
                return
            for stream in streams:  # an engine's refusal is still an answer of its own status, not a 200
                await stream.wait_accepted()
            await respond.start_events()
            for chunk in reply.opening():
                await respond.event(chunk)
            async for index, delta in _interleaved(streams):
                for chunk in await reply.chunks(index, delta):
                    await respond.event(chunk)
            if (usage := reply.usage_chunk()) is not None:
                await respond.event(usage)
            await respond.event("[DONE]")

    async def _context_rest(self, body: OpenAIRequest) -> SamplingParams:
        """Chat without max_tokens: as many tokens as the context holds after the prompt (OpenAI's default)."""
        prompt = body.prompts[0]
        ids = await asyncio.wrap_future(self.worker.call(lambda engine: engine.tokenize(prompt)))
        assert isinstance(body.params, SamplingParams)
        params = replace(body.params, max_tokens=max(1, self.servicer.model_info.max_model_len - len(ids)))
        params.validate()  # min_tokens within that room
        return params

    async def _decode(self, ids: list[int]) -> list[str]:
        """Each token's text (by the engine's tokenizer, on its thread): logprobs name their tokens by it."""
        return await asyncio.wrap_future(self.worker.call(lambda engine: [engine.tokenizer.decode([i]) for i in ids]))

    async def _decode_text(self, ids: list[int]) -> str:
        return await asyncio.wrap_future(self.worker.call(lambda engine: engine.tokenizer.decode(ids)))


class _Submitted:
    """``async with``: each prompt of a body admitted and submitted as its own request; on exit (an answer, an
    error, the client gone) every request still running is aborted and the admission released."""

    def __init__(self, servicer: InferenceServicer, body: OpenAIRequest, given: str | None = None) -> None:
        self.servicer, self.body, self.streams = servicer, body, []  # type: ignore[var-annotated]
        self.stem, self.given = given or uuid.uuid4().hex, given is not None

    def request_id(self, index: int) -> str:
        """A given X-Request-Id is the request's id as it is (one prompt) or before ``-INDEX``."""
        return self.stem if self.given and len(self.body.prompts) == 1 else f"{self.stem}-{index}"

    async def __aenter__(self) -> list[RequestStream]:
        try:
            for index, prompt in enumerate(self.body.prompts):
                self.servicer.admit()
                stream = RequestStream(self.request_id(index))
                self.streams.append(stream)
                self.servicer.worker.submit(prompt, self.body.params, stream)
        except BaseException:
            await self.__aexit__()
            raise
        return self.streams

    async def __aexit__(self, *exc: object) -> None:
        for stream in self.streams:
            self.servicer.close(stream)


async def _collect_all(streams: list[RequestStream]) -> list[RequestOutput]:
    """Each request's whole output; the first error raised once the others' readers are cancelled (none is left
    waiting on a stream that the cleanup aborts without a word)."""
    tasks = [asyncio.ensure_future(_collect(stream)) for stream in streams]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def _collect(stream: RequestStream) -> RequestOutput:
    """The whole output of a request, its deltas joined."""
    deltas = [delta async for delta in stream]
    if not deltas or not deltas[-1].finished:
        raise EngineFault(f"request {stream.request_id}'s stream ended without a finished output")
    return merge_deltas(*deltas)


async def _interleaved(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """The deltas of several requests as they come, each with its prompt's index."""
    if len(streams) == 1:  # the common body, read without a task and a queue hop per delta
        async for delta in streams[0]:
            yield 0, delta
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: RequestStream) -> None:
        try:
            async for delta in stream:
                await queue.put((index, delta))
            await queue.put((index, None))
        except Exception as exc:
            await queue.put((index, exc))

    tasks = [asyncio.ensure_future(pump(index, stream)) for index, stream in enumerate(streams)]
    try:
        open_streams = len(streams)
        while open_streams:
            index, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                open_streams -= 1
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def request_id_of(request: HttpRequest) -> str | None:
    """The client's X-Request-Id (vLLM's header), as long as gRPC's request_id may be; None without one."""
    given = request.headers.get("x-request-id")
    if given is not None and not (0 < len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable()):
        raise InvalidRequestError(f"X-Request-Id must be 1 to {MAX_REQUEST_ID_CHARS} printable ASCII characters, got "
                                  f"{len(given)}: {given[:80]!r}")
    return given


def _echoed(given: str | None) -> dict[str, str]:
    return {} if given is None else {"X-Request-Id": given}


def _json_of(request: HttpRequest) -> Any:
    try:
        return json.loads(request.body)
    except RecursionError:
        raise InvalidRequestError("the body nests too deeply to read; send a flatter JSON object") from None
    except ValueError as exc:  # UnicodeDecodeError too
        raise InvalidRequestError(f"the body is not JSON ({exc}); send a JSON object with Content-Type: "
                                  "application/json") from None


def http_error_of(exc: BaseException) -> HttpError:
    """The HTTP status of an error: 400 for a bad request (or one that never fits), 404 for an unknown model or
    adapter, 429 when the server is full, 503 while it shuts down, 500 for the rest (logged)."""
    if isinstance(exc, NotFoundError):
        return HttpError(404, str(exc))
    if isinstance(exc, (InvalidRequestError, CapacityError)):
        return HttpError(400, str(exc))
    if isinstance(exc, ServerFull):
        return HttpError(429, str(exc))
    if isinstance(exc, ServerUnavailable):
        return HttpError(503, str(exc))
    if not isinstance(exc, InferError):
        log.error("internal error in the HTTP front: %s", exc, exc_info=exc)
    return HttpError(500, str(exc) or f"internal error: {type(exc).__name__}")
