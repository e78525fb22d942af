"""A small HTTP/1.1 server on asyncio streams (stdlib only), the layer under the OpenAI-compatible front.

A task per connection reads requests (bodies by Content-Length only) and hands each to a ``Handler`` with a
``Responder``, keeping the connection open between requests. While a handler runs, the connection is watched: bytes
that arrive (a pipelined request) wait for the next request, and the peer closing cancels the handler's task. Errors
are answered in OpenAI's JSON shape (``HttpError``); an event stream has no length, so it ends by closing.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import ssl
from collections.abc import Awaitable, Callable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from http import HTTPStatus
from urllib.parse import parse_qsl

from ..core.errors import ConfigError

log = logging.getLogger("infer.server")

MAX_HEADER_BYTES = 64 * 1024  # the request line and header lines, without the empty line that ends them
LINGER_S = 2.0  # after a refusal, how long the peer's unread bytes are drained so that it can read the answer
READ_SIZE = 64 * 1024
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}
_REASONS = {status.value: status.phrase for status in HTTPStatus}
_TOKEN = re.compile(rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")  # RFC 9110's token: methods and header names
_TARGET = re.compile(rb"/[\x21-\x7e]*")  # origin-form: a path (and query) of visible ASCII
_CONTROL = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")  # not allowed in a header value (a tab is)


@dataclass
class HttpRequest:
    """One request as the handler sees it."""

    method: str  # "GET", "POST", ... (upper case as sent)
    path: str  # the target without its query string, not percent-decoded, e.g. "/v1/completions"
    query: dict[str, str]  # parsed query string (last value wins)
    headers: dict[str, str]  # header names lower-cased; values latin-1 decoded; repeated headers joined by ", "
    body: bytes


class HttpError(Exception):
    """An error answered as JSON: {"error": {"message": ..., "type": ..., "param": ..., "code": status}}, OpenAI's
    error shape. ``type``: "authentication_error" (401), "permission_error" (403), "not_found_error" (404),
    "rate_limit_error" (429), "invalid_request_error" (any other 4xx), "server_error" (5xx)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        if not 400 <= status <= 599:
            raise ValueError(f"an HttpError's status is a 4xx or 5xx code, got {status}")
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def payload(self) -> dict[str, object]:
        """The JSON body (or SSE event) that answers this error."""
        kind = "server_error" if self.status >= 500 else ERROR_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


class ClientGone(Exception):
    """The peer closed the connection (raised by Responder writes)."""


class _Connection:
    """One client connection: its writer, the bytes received and not yet parsed (``pending``), and whether the
    peer has closed or reset it (``gone``)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, idle_timeout_s: float) -> None:
        self.reader, self.writer, self.idle_timeout_s = reader, writer, idle_timeout_s
        self.pending, self.gone = bytearray(), False

    async def receive(self, idle_timeout_s: float | None = None) -> bool:
        """Append the next bytes to ``pending``; False once the peer has left. TimeoutError after
        ``idle_timeout_s`` without a byte."""
        async with asyncio.timeout(idle_timeout_s):
            try:
                chunk = b"" if self.gone else await self.reader.read(READ_SIZE)
            except OSError:  # reset, or a TLS failure
                chunk = b""
        self.pending += chunk
        self.gone = not chunk
        return not self.gone

    async def watch(self, max_pending: int) -> None:
        """Receive until the peer leaves, or until ``max_pending`` bytes wait unparsed (then stop watching)."""
        while len(self.pending) <= max_pending and await self.receive():
            pass

    async def write(self, data: bytes) -> None:
        """Send ``data`` and wait until the transport takes it; ClientGone when the peer has left."""
        if self.gone or self.writer.is_closing():
            raise ClientGone("the client closed the connection")
        try:
            self.writer.write(data)
            await self.writer.drain()
        except OSError as exc:
            self.gone = True
            raise ClientGone(f"the client closed the connection ({exc})") from exc

    async def linger(self) -> None:
        """After refusing a request: end our side, then drop what the peer still sends (at most LINGER_S), so that
        closing with unread bytes does not reset the connection before the peer has read the refusal."""
        if self.gone or not self.writer.can_write_eof():  # TLS cannot half-close
            return
        with suppress(OSError, TimeoutError):
            self.writer.write_eof()
            async with asyncio.timeout(LINGER_S):
                while await self.reader.read(READ_SIZE):
                    pass


class Responder:
    """How a handler answers one request. Exactly one of json(), text() or start_events() per request. ``headers``: what
    every answer to this request carries, the layer's error answers too (a handler sets them first: CORS's)."""

    def __init__(self, connection: _Connection, keep_alive: bool, head_only: bool = False) -> None:
        self._connection, self._keep_alive, self._head_only = connection, keep_alive, head_only
        self._kind: str | None = None  # "whole" (json, text) or "events" once the response has begun
        self.headers: dict[str, str] = {}

    @property
    def started(self) -> bool:
        """Whether a response has begun (headers sent)."""
        return self._kind is not None

    async def json(self, status: int, payload: object, headers: Mapping[str, str] | None = None) -> None:
        """Answer ``status`` with ``payload`` as JSON; ``headers`` are added (Content-Type may be among them;
        Content-Length and Connection are the layer's)."""
        fields = _fields({"Content-Type": "application/json", **self.headers}, headers)
        body = json.dumps(payload, allow_nan=False).encode()  # before _begin: not JSON (NaN too) is a 500
        self._begin("whole")
        head = _head(status, {**fields, "Content-Length": str(len(body))}, self._keep_alive)
        await self._connection.write(head if self._head_only else head + body)

    async def text(self, status: int, text: str, content_type: str) -> None:
        """Answer ``status`` with ``text`` (UTF-8) of ``content_type`` (Prometheus' exposition format, say)."""
        fields = _fields({"Content-Type": content_type, **self.headers}, None)
        self._begin("whole")
        head = _head(status, {**fields, "Content-Length": str(len(body := text.encode()))}, self._keep_alive)
        await self._connection.write(head if self._head_only else head + body)

    async def start_events(self, headers: Mapping[str, str] | None = None) -> None:
        """Answer 200 with an event stream (text/event-stream), ``headers`` added; the connection closes after it."""
        fields = _fields({"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **self.headers}, headers)
        self._begin("events")
        self._keep_alive = False
        await self._connection.write(_head(200, fields, keep_alive=False))

    async def event(self, payload: object) -> None:
        """Send one event, ``data: <json.dumps(payload)>``; a str payload is sent as is (e.g. "[DONE]")."""
        if self._kind != "events":
            raise RuntimeError("call start_events() before event()")
        text = payload if isinstance(payload, str) else json.dumps(payload, allow_nan=False)  # NaN is not JSON
        if not self._head_only:  # a line break in the text continues the data on a second "data:" line
            await self._connection.write("".join(f"data: {line}\n" for line in text.split("\n")).encode() + b"\n")

    def _begin(self, kind: str) -> None:
        if self._kind is not None:
            raise RuntimeError(f"this request was already answered ({self._kind}): a handler answers once")
        self._kind = kind

    async def _fail(self, error: HttpError) -> None:
        """Answer ``error``: as the JSON response, or as the event stream's last event."""
        if self._kind is None:
            await self.json(error.status, error.payload())
        elif self._kind == "events":  # the error, then the end of the stream as OpenAI's servers mark it
            await self.event(error.payload())
            await self.event("[DONE]")
        else:
            log.error("an HTTP handler failed after its response was sent: %s", error.message)


Handler = Callable[[HttpRequest, Responder], Awaitable[None]]


def _fields(base: Mapping[str, str], headers: Mapping[str, str] | None) -> dict[str, str]:
    """``base`` with a handler's ``headers`` over it; ValueError for Content-Length, Connection (the layer's) or a
    header that is not one line."""
    fields = {**base, **(headers or {})}
    if any(name.lower() in ("content-length", "connection") or _CONTROL.search(f"{name}{value}".encode())
           for name, value in fields.items()):
        raise ValueError(f"cannot send the headers {headers}: the layer sets Content-Length and Connection, "
                         "and a header is one line")
    return fields


def _head(status: int, fields: Mapping[str, str], keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}", *(f"{name}: {value}" for name, value in fields.items()),
             f"Connection: {'keep-alive' if keep_alive else 'close'}"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


async def _read_head(connection: _Connection) -> bytes | None:
    """The next request line and headers; None when the peer closed or idled between requests. Once its first byte
    is in, the whole head must arrive within the idle timeout, so that a client cannot hold the connection by
    sending a byte now and then."""
    pending, loop, timeout_s = connection.pending, asyncio.get_running_loop(), connection.idle_timeout_s
    deadline = loop.time() + timeout_s if pending else None
    try:
        while True:
            while pending.startswith(b"\r\n"):  # empty lines before a request line are ignored (RFC 9112)
                del pending[:2]
            if (end := pending.find(b"\r\n\r\n", 0, MAX_HEADER_BYTES + 4)) >= 0:
                break
            if len(pending) >= MAX_HEADER_BYTES + 4:
                raise HttpError(431, f"the request line and headers exceed {MAX_HEADER_BYTES} bytes; send less")
            if not await connection.receive(timeout_s if deadline is None else deadline - loop.time()):
                return None
            deadline = loop.time() + timeout_s if deadline is None else deadline
    except TimeoutError:
        if pending:
            raise HttpError(408, "the request was not sent in time; send it again") from None
        return None
    head = bytes(pending[:end])
    del pending[:end + 4]
    return head


def _parse_head(head: bytes) -> tuple[str, str, bool, dict[str, str]]:
    """(method, target, whether HTTP/1.1, headers) of a request head; HttpError 400 when malformed."""
    request_line, *header_lines = head.split(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not _TOKEN.fullmatch(parts[0]) or not _TARGET.fullmatch(parts[1]) or parts[2] not in (
            b"HTTP/1.0", b"HTTP/1.1"):
        raise HttpError(400, f"malformed request line {request_line[:200]!r}: send 'METHOD /path HTTP/1.1'")
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(b":")
        value = value.strip(b" \t")
        if not colon or not _TOKEN.fullmatch(name) or _CONTROL.search(value):
            raise HttpError(400, f"malformed header line {line[:200]!r}: send 'Name: value'")
        key, text = name.decode("ascii").lower(), value.decode("latin-1")
        headers[key] = f"{headers[key]}, {text}" if key in headers else text
    return parts[0].decode("ascii"), parts[1].decode("ascii"), parts[2] == b"HTTP/1.1", headers


async def _read_request(connection: _Connection, max_body_bytes: int) -> tuple[HttpRequest, bool] | None:
    """The next request and whether the connection stays open after it; None when the peer left."""
    head = await _read_head(connection)
    if head is None:
        return None
    method, target, http11, headers = _parse_head(head)
    if "transfer-encoding" in headers:
        raise HttpError(411, "request bodies in Transfer-Encoding (chunked) are not supported: send the body "
                             "with a Content-Length header")
    length_text = headers.get("content-length", "0")
    if not length_text.isascii() or not length_text.isdigit():
        raise HttpError(400, f"Content-Length must be one number of bytes, got {length_text[:200]!r}")
    digits = length_text.lstrip("0") or "0"  # int() refuses over 4,300 digits: compare lengths first
    if len(digits) > len(str(max_body_bytes)) or (length := int(digits)) > max_body_bytes:
        shown = digits if len(digits) <= 20 else f"a {len(digits)}-digit number of"
        raise HttpError(413, f"the request body has {shown} bytes, over this server's limit of {max_body_bytes}; "
                             "send a smaller request")
    if length > len(connection.pending) and http11 and headers.get("expect", "").lower() == "100-continue":
        await connection.write(b"HTTP/1.1 100 Continue\r\n\r\n")
    try:
        while len(connection.pending) < length:
            if not await connection.receive(connection.idle_timeout_s):
                return None
    except TimeoutError:
        raise HttpError(408, "the request body was not sent in time; send it again") from None
    body = bytes(connection.pending[:length])
    del connection.pending[:length]
    tokens = {token.strip().lower() for token in headers.get("connection", "").split(",")}
    keep_alive = "close" not in tokens if http11 else "keep-alive" in tokens
    path, _, query = target.partition("?")
    return HttpRequest(method, path, dict(parse_qsl(query, keep_blank_values=True)), headers, body), keep_alive


async def _respond(handle: Handler, request: HttpRequest, responder: Responder) -> None:
    """Run the handler and answer its failure in OpenAI's error shape; a client gone ends it quietly."""
    try:
        try:
            await handle(request, responder)
            if not responder.started:
                log.error("the HTTP handler returned without answering %s %s", request.method, request.path)
                raise HttpError(500, "the handler sent no response")
        except (HttpError, ClientGone):
            raise
        except Exception:
            log.exception("the HTTP handler failed on %s %s", request.method, request.path)
            raise HttpError(500, "the server failed on this request; its log has the details") from None
    except HttpError as error:
        with suppress(ClientGone):
            await responder._fail(error)
    except ClientGone:
        pass


async def _run_handler(handle: Handler, request: HttpRequest, responder: Responder, connection: _Connection,
                       max_pending: int) -> bool:
    """Run the handler in a task of its own, cancelled if the peer leaves meanwhile; whether it was not cancelled."""
    handler = asyncio.create_task(_respond(handle, request, responder))
    watcher = asyncio.create_task(connection.watch(max_pending))
    try:
        await asyncio.wait({handler, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if connection.gone:
            handler.cancel()
        await asyncio.wait({handler})
    finally:  # also when this connection's task is cancelled: the handler goes with it
        handler.cancel()
        watcher.cancel()
        await asyncio.wait({handler, watcher})
    return not handler.cancelled() and handler.result() is None  # result() re-raises a KeyboardInterrupt


async def _serve_connection(connection: _Connection, handle: Handler, max_body_bytes: int) -> None:
    try:
        while True:
            try:
                received = await _read_request(connection, max_body_bytes)
            except HttpError as error:  # a malformed or refused request: answer, then close
                await Responder(connection, keep_alive=False).json(error.status, error.payload())
                await connection.linger()
                return
            if received is None:
                return
            request, keep_alive = received
            responder = Responder(connection, keep_alive, head_only=request.method == "HEAD")
            ended = await _run_handler(handle, request, responder, connection, MAX_HEADER_BYTES + max_body_bytes)
            if not (ended and responder._keep_alive) or connection.gone:
                return
    except ClientGone:
        pass
    finally:
        connection.writer.close()  # after sending what is buffered


@dataclass
class HttpServer:
    """A listening server: :meth:`stop_listening` refuses new connections, :meth:`close` ends the open ones too
    (their handlers cancelled), so that none outlives the event loop."""

    listener: asyncio.Server
    connections: set[asyncio.Task[None]]  # the loop holds tasks weakly

    @property
    def port(self) -> int:
        return self.listener.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        self.listener.close()

    async def close(self) -> None:
        self.listener.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)


async def start_http_server(handle: Handler, host: str, port: int, *, ssl: ssl.SSLContext | None = None,
                            max_body_bytes: int = 4 * 2**20, idle_timeout_s: float = 60.0) -> HttpServer:
    """Serve ``handle`` on host:port (0 picks a free port: read the server's ``port``), over TLS with ``ssl``.
    Bodies over ``max_body_bytes`` are refused (413); a connection that sends nothing for ``idle_timeout_s`` is
    closed, and a request whose line and headers take longer than that from their first byte is refused (408)."""
    if max_body_bytes < 0:
        raise ConfigError(f"max_body_bytes must be >= 0, got {max_body_bytes}")
    if not 0 < idle_timeout_s < float("inf"):
        raise ConfigError(f"idle_timeout_s must be a positive number of seconds, got {idle_timeout_s}")

    connections: set[asyncio.Task[None]] = set()

    def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # a task of our own: Python 3.11's start_server logs its own connection task's cancellation as an error
        task = asyncio.create_task(_serve_connection(_Connection(reader, writer, idle_timeout_s), handle,
                                                     max_body_bytes))
        connections.add(task)
        task.add_done_callback(connections.discard)

    return HttpServer(await asyncio.start_server(serve, host, port, ssl=ssl), connections)
