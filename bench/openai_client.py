"""A small client of OpenAI's HTTP API (stdlib only, asyncio): one HTTP/1.1 connection per request, JSON bodies,
server-sent events read from a chunked or a plain body, https with the system's CA certificates.

It serves ``infer bench``'s ``openai:URL`` arms (bench/openai_arm.py) and benchmarks/grpc_load.py's HTTP side,
which drive any server of the API (``infer serve --http-port``, vLLM, SGLang) with their own load.
"""
from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from ..core.errors import InferError

MAX_HEADER_LINES = 200
ERROR_BODY_BYTES = 4000  # of an error's body: enough for its message


class OpenAIServerError(InferError):
    """A server of OpenAI's API answered with an error status (``status``), or could not be reached (``status``
    None); the message carries the server's own."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class Endpoint:
    """The API base (``http://HOST:PORT/v1``) and the bearer token sent with each request, if any."""

    url: str
    api_key: str | None = None

    @property
    def host(self) -> str:
        return urlsplit(self.url).hostname or "127.0.0.1"

    @property
    def port(self) -> int:
        parts = urlsplit(self.url)
        return parts.port or (443 if parts.scheme == "https" else 80)

    def path(self, route: str) -> str:
        """The request path of ``route`` under the API base (``/completions`` -> ``/v1/completions``)."""
        return urlsplit(self.url).path.rstrip("/") + route

    def server_path(self, route: str) -> str:
        """The request path of ``route`` at the server's root, beside the API (vLLM's ``/tokenize``): the base's
        path without its last ``/v1``."""
        base = urlsplit(self.url).path.rstrip("/")
        return base.removesuffix("/v1") + route


async def get_json(endpoint: Endpoint, path: str) -> Any:
    """``GET path`` (a full request path: Endpoint.path or server_path), its JSON answer."""
    async with _Exchange(endpoint, "GET", path, None) as exchange:
        return _json(await exchange.read_all(), exchange.where)


async def post_json(endpoint: Endpoint, path: str, body: dict[str, Any]) -> Any:
    """``POST path`` with a JSON body, its JSON answer."""
    async with _Exchange(endpoint, "POST", path, body) as exchange:
        return _json(await exchange.read_all(), exchange.where)


async def post_events(endpoint: Endpoint, path: str, body: dict[str, Any]) -> AsyncIterator[str]:
    """``POST path`` with a JSON body, answered by server-sent events: each event's ``data`` as it arrives (one
    data line per event, as OpenAI's servers send), up to ``[DONE]`` (not yielded) or the end of the body."""
    async with _Exchange(endpoint, "POST", path, body) as exchange:
        buffer = b""
        async for data in exchange.body():
            buffer += data
            *lines, buffer = buffer.split(b"\n")
            for line in lines:
                if not line.startswith(b"data:"):
                    continue  # blank separators, comments, event names
                event = line[5:].strip().decode()
                if event == "[DONE]":
                    return
                yield event


class _Exchange:
    """``async with``: one request on a fresh connection, its status and headers read (an error status raised
    as OpenAIServerError with the server's message); the connection is closed on exit."""

    def __init__(self, endpoint: Endpoint, method: str, path: str, body: dict[str, Any] | None) -> None:
        self.endpoint, self.method, self.path = endpoint, method, path
        self.payload = b"" if body is None else json.dumps(body).encode()
        self.where = f"{method} {urlsplit(endpoint.url).scheme}://{endpoint.host}:{endpoint.port}{path}"
        self.headers: dict[str, str] = {}
        self.writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> _Exchange:
        endpoint = self.endpoint
        secure = urlsplit(endpoint.url).scheme == "https"
        try:
            self.reader, self.writer = await asyncio.open_connection(
                endpoint.host, endpoint.port, ssl=ssl.create_default_context() if secure else None)
        except OSError as exc:
            raise OpenAIServerError(f"cannot reach {self.where}: {exc}; is the server running, and is the URL its "
                                    "API base (e.g. http://127.0.0.1:8000/v1)?") from None
        try:
            await self._send_and_read_head()
        except BaseException:
            await self.__aexit__()
            raise
        return self

    async def _send_and_read_head(self) -> None:
        endpoint = self.endpoint
        auth = f"Authorization: Bearer {endpoint.api_key}\r\n" if endpoint.api_key else ""
        body_headers = f"Content-Type: application/json\r\nContent-Length: {len(self.payload)}\r\n" \
            if self.method == "POST" else ""
        head = (f"{self.method} {self.path} HTTP/1.1\r\nHost: {endpoint.host}:{endpoint.port}\r\n{auth}"
                f"Accept: application/json, text/event-stream\r\n{body_headers}Connection: close\r\n\r\n")
        assert self.writer is not None
        self.writer.write(head.encode() + self.payload)
        try:
            status_line = (await self.reader.readline()).decode("latin-1").strip()
            for _ in range(MAX_HEADER_LINES):
                line = await self.reader.readline()
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                self.headers[name.strip().lower()] = value.strip()
        except (OSError, asyncio.IncompleteReadError) as exc:
            raise OpenAIServerError(f"{self.where}: the connection failed before an answer: {exc}") from None
        fields = status_line.split(" ", 2)
        if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
            raise OpenAIServerError(f"{self.where}: not an HTTP answer ({status_line[:100]!r}); is the URL an http "
                                    "server's, with the right scheme (http or https)?")
        status = int(fields[1])
        if status != 200:
            text = (await self.read_all(ERROR_BODY_BYTES)).decode("utf-8", "replace")
            raise OpenAIServerError(f"{self.where} answered {status_line.removeprefix(fields[0]).strip()}: "
                                    f"{error_message(text)}", status)

    async def body(self) -> AsyncIterator[bytes]:
        """The body's bytes as they arrive: chunked, by Content-Length, or up to the end of the connection."""
        try:
            if self.headers.get("transfer-encoding", "").lower() == "chunked":
                while size := int((await self.reader.readline()).split(b";")[0], 16):
                    yield (await self.reader.readexactly(size + 2))[:-2]
                return
            left = int(self.headers["content-length"]) if "content-length" in self.headers else None
            while left is None or left > 0:
                data = await self.reader.read(65536 if left is None else min(left, 65536))
                if not data:
                    return
                left = None if left is None else left - len(data)
                yield data
        except (OSError, ValueError, asyncio.IncompleteReadError) as exc:
            raise OpenAIServerError(f"{self.where}: the answer broke off: {exc}") from None

    async def read_all(self, limit: int | None = None) -> bytes:
        data = b""
        async for part in self.body():
            data += part
            if limit is not None and len(data) >= limit:
                return data[:limit]
        return data

    async def __aexit__(self, *exc: object) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None


def error_message(text: str) -> str:
    """The message of an error body: OpenAI's ``{"error": {"message": ...}}``, vLLM's ``{"message": ...}``,
    FastAPI's ``{"detail": ...}``, else the text itself."""
    try:
        data = json.loads(text)
    except ValueError:
        return text.strip()[:1000] or "(no body)"
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for key in ("message", "detail", "error"):
            if key in data:
                return str(data[key])
    return text.strip()[:1000]


def _json(data: bytes, where: str) -> Any:
    try:
        return json.loads(data)
    except ValueError:
        raise OpenAIServerError(f"{where}: the answer is not JSON: {data[:200]!r}") from None
