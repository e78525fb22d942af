"""server/http.py against real clients on 127.0.0.1: http.client (the stdlib's HTTP/1.1 client) as the reference for
framing and keep-alive, raw asyncio sockets for what a well-behaved client never sends."""
from __future__ import annotations

import asyncio
import datetime
import http.client
import json
import logging
import socket
import ssl
import struct
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from infer.core.errors import ConfigError
from infer.server.http import ClientGone, HttpError, HttpRequest, Responder, start_http_server

Test = Callable[[int], Awaitable[None]]
HEADER_LIMIT = 64 * 1024  # the brief's limit on the request line and headers


def serve(handle: Callable[[HttpRequest, Responder], Awaitable[None]], test: Test, **options: object) -> None:
    """Run ``test(port)`` against a server of ``handle`` on 127.0.0.1, in one event loop, within 10 s."""
    async def main() -> None:
        server = await start_http_server(handle, "127.0.0.1", 0, **options)  # type: ignore[arg-type]
        try:
            await asyncio.wait_for(test(server.port), 10)
        finally:
            await server.close()

    asyncio.run(main())


@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> object:
        return json.loads(self.body)


async def read_response(reader: asyncio.StreamReader) -> Response:
    """One response: by Content-Length, else up to the connection's end (an event stream)."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head[:-4].split("\r\n")
    headers = {name.lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
    if "content-length" in headers:
        return Response(int(status_line.split()[1]), headers, await reader.readexactly(int(headers["content-length"])))
    return Response(int(status_line.split()[1]), headers, await reader.read())


async def at_eof(reader: asyncio.StreamReader) -> bool:
    """Whether the server closes the connection (within 2 s) without sending more."""
    return await asyncio.wait_for(reader.read(), 2) == b""


async def echo(request: HttpRequest, responder: Responder) -> None:
    await responder.json(200, {"method": request.method, "path": request.path, "query": request.query,
                               "headers": request.headers, "body": request.body.decode("latin-1")},
                         headers={"X-Echo": "yes"})


def error_body(status: int, type_: str, message: str, param: str | None = None) -> dict[str, object]:
    return {"error": {"message": message, "type": type_, "param": param, "code": status}}


# ---------------------------------------------------------------- keep-alive, framing
def test_keep_alive_serves_several_requests_on_one_connection() -> None:
    def client(port: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/v1/models?a=1&b=x%20y&a=2&empty=")
        first_socket = conn.sock
        response = conn.getresponse()
        assert (response.status, response.getheader("Connection"), response.getheader("X-Echo")) == (
            200, "keep-alive", "yes")
        assert json.loads(response.read()) == {"method": "GET", "path": "/v1/models",
                                               "query": {"a": "2", "b": "x y", "empty": ""},
                                               "headers": {"host": f"127.0.0.1:{port}",
                                                           "accept-encoding": "identity"}, "body": ""}
        for body in (b'{"prompt": "hi"}', b""):
            conn.request("POST", "/v1/completions", body=body, headers={"X-Note": "caf\xe9", "Content-Type": "a/b"})
            response = conn.getresponse()
            got = json.loads(response.read())
            assert (got["method"], got["path"], got["body"]) == ("POST", "/v1/completions", body.decode())
            assert (got["headers"]["x-note"], got["headers"]["content-length"]) == ("caf\xe9", str(len(body)))
            assert conn.sock is first_socket  # http.client opens a new socket after a response that closes
        conn.close()

    serve(echo, lambda port: asyncio.to_thread(client, port))


@pytest.mark.parametrize("request_head, closes", [
    (b"GET / HTTP/1.1\r\n\r\n", False),
    (b"GET / HTTP/1.1\r\nConnection: close\r\n\r\n", True),
    (b"GET / HTTP/1.1\r\nConnection: Keep-Alive, CLOSE\r\n\r\n", True),
    (b"GET / HTTP/1.0\r\n\r\n", True),
    (b"GET / HTTP/1.0\r\nConnection: keep-alive\r\n\r\n", False),
])
def test_connection_close_and_http10(request_head: bytes, closes: bool) -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(request_head)
        response = await read_response(reader)
        assert (response.status, response.headers["connection"]) == (200, "close" if closes else "keep-alive")
        if closes:
            assert await at_eof(reader)
        else:
            writer.write(request_head)
            assert (await read_response(reader)).status == 200
        writer.close()

    serve(echo, test)


def test_idle_connections_close_after_the_timeout_but_busy_ones_stay() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for index in range(4):  # longer than the timeout in all, with no gap as long
            if index:
                await asyncio.sleep(0.2)
            writer.write(b"GET / HTTP/1.1\r\n\r\n")
            assert (await read_response(reader)).status == 200
        start = time.monotonic()
        assert await at_eof(reader)
        assert 0.4 <= time.monotonic() - start < 1.5
        writer.close()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\n")  # a request that stops halfway is told so
        response = await read_response(reader)
        assert response.json() == error_body(408, "invalid_request_error",
                                             "the request was not sent in time; send it again")
        assert await at_eof(reader)
        writer.close()

    serve(echo, test, idle_timeout_s=0.5)


def test_head_answers_have_no_body() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"HEAD /v1/models HTTP/1.1\r\n\r\nGET /v1/models HTTP/1.1\r\n\r\n")
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        response = await read_response(reader)  # a body after the HEAD answer would be read as this status line
        assert (response.status, response.json()["method"]) == (200, "GET")  # type: ignore[index]
        assert head.startswith("HTTP/1.1 200 OK\r\n")  # with the length of its body ("HEAD" is "GET" + 1)
        assert f"\r\nContent-Length: {len(response.body) + 1}\r\n" in head
        writer.close()

    serve(echo, test)


def test_expect_100_continue_is_answered_before_the_body() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /x HTTP/1.1\r\nExpect: 100-continue\r\nContent-Length: 5\r\n\r\n")
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"hello")
        assert (await read_response(reader)).json()["body"] == "hello"
        writer.close()

    serve(echo, test)


# ---------------------------------------------------------------- refusals
BAD_REQUESTS = {
    "chunked": (b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", 411,
                "send the body with a Content-Length header"),
    "body-too-large": (b"POST / HTTP/1.1\r\nContent-Length: 101\r\n\r\n", 413,  # the body is never sent
                       "the request body has 101 bytes, over this server's limit of 100; send a smaller request"),
    "headers-too-large": (b"GET / HTTP/1.1\r\nX: " + b"a" * (HEADER_LIMIT - 18) + b"\r\n\r\n", 431,
                          f"exceed {HEADER_LIMIT} bytes"),
    "garbage": (b"GARBAGE\r\n\r\n", 400, "malformed request line"),
    "no-slash": (b"GET v1/models HTTP/1.1\r\n\r\n", 400, "malformed request line"),
    "two-spaces": (b"GET  / HTTP/1.1\r\n\r\n", 400, "malformed request line"),
    "http2": (b"GET / HTTP/2.0\r\n\r\n", 400, "malformed request line"),
    "no-colon": (b"GET / HTTP/1.1\r\nNoColon\r\n\r\n", 400, "malformed header line"),
    "space-before-colon": (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", 400, "malformed header line"),
    "folded": (b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n", 400, "malformed header line"),
    "bare-lf-in-value": (b"GET / HTTP/1.1\r\nX: a\nY: b\r\n\r\n", 400, "malformed header line"),
    "bad-length": (b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n", 400, "Content-Length must be one number"),
    "two-lengths": (b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab", 400,
                    "Content-Length must be one number"),
}


@pytest.mark.parametrize("name", BAD_REQUESTS)
def test_bad_requests_are_refused_then_the_connection_closes(name: str) -> None:
    raw, status, message = BAD_REQUESTS[name]
    calls: list[HttpRequest] = []

    async def handle(request: HttpRequest, responder: Responder) -> None:
        calls.append(request)
        await echo(request, responder)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(raw + b"GET / HTTP/1.1\r\n\r\n")  # the request after it is never answered
        response = await read_response(reader)
        error = response.json()["error"]  # type: ignore[index]
        assert (response.status, response.headers["connection"]) == (status, "close")
        assert error == {"message": error["message"], "type": "server_error" if status >= 500 else
                         "invalid_request_error", "param": None, "code": status}
        assert message in error["message"]
        assert await at_eof(reader)
        writer.close()

    serve(handle, test, max_body_bytes=100)
    assert calls == []


def test_limits_are_inclusive() -> None:
    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = b"POST / HTTP/1.1\r\nContent-Length: 100\r\nX: "
        head += b"a" * (HEADER_LIMIT - len(head))  # exactly the limit, before the empty line
        writer.write(head + b"\r\n\r\n" + b"b" * 100)
        response = await read_response(reader)
        assert (response.status, response.json()["body"]) == (200, "b" * 100)  # type: ignore[index]
        writer.close()

    serve(echo, test, max_body_bytes=100)


def test_a_large_body_refused_while_being_sent_still_reaches_the_client_as_413() -> None:
    def client(port: int) -> None:  # http.client sends all of the body before reading the answer
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", "/v1/completions", body=b"x" * 32 * 2**20)  # more than the sockets' buffers hold
        assert conn.getresponse().status == 413
        conn.close()

    serve(echo, lambda port: asyncio.to_thread(client, port), max_body_bytes=1000)


# ---------------------------------------------------------------- handler errors
@pytest.mark.parametrize("status, type_", [(400, "invalid_request_error"), (401, "authentication_error"),
                                           (404, "not_found_error"), (422, "invalid_request_error"),
                                           (429, "rate_limit_error"), (500, "server_error"), (503, "server_error")])
def test_http_errors_are_answered_in_openai_shape_and_the_connection_stays(status: int, type_: str) -> None:
    async def handle(request: HttpRequest, responder: Responder) -> None:
        if request.path == "/fail":
            raise HttpError(status, "no such thing; ask for another", param="model")
        await echo(request, responder)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /fail HTTP/1.1\r\n\r\n")
        response = await read_response(reader)
        assert (response.status, response.headers["content-type"]) == (status, "application/json")
        assert response.json() == error_body(status, type_, "no such thing; ask for another", "model")
        writer.write(b"GET /next HTTP/1.1\r\n\r\n")
        assert (await read_response(reader)).json()["path"] == "/next"  # type: ignore[index]
        writer.close()

    serve(handle, test)


def test_other_exceptions_are_500_logged_with_their_traceback(caplog: pytest.LogCaptureFixture) -> None:
    async def handle(request: HttpRequest, responder: Responder) -> None:
        if request.path == "/bug":
            raise KeyError("a bug")
        if request.path == "/silent":
            return  # answers nothing
        await echo(request, responder)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /bug HTTP/1.1\r\n\r\nGET /silent HTTP/1.1\r\n\r\nGET /next HTTP/1.1\r\n\r\n")
        response = await read_response(reader)
        assert (response.status, response.json()["error"]["type"]) == (500, "server_error")  # type: ignore[index]
        assert "a bug" not in response.body.decode()  # the details stay in the log
        assert (await read_response(reader)).json() == error_body(500, "server_error", "the handler sent no response")
        assert (await read_response(reader)).json()["path"] == "/next"  # type: ignore[index]
        writer.close()

    with caplog.at_level(logging.ERROR, logger="infer.server"):
        serve(handle, test)
    failures = [record for record in caplog.records if record.name == "infer.server" and record.exc_info]
    assert len(failures) == 1 and failures[0].exc_info[0] is KeyError  # type: ignore[index]


def test_a_handler_cancelled_by_itself_is_no_500_the_connection_closes() -> None:
    async def handle(request: HttpRequest, responder: Responder) -> None:
        raise asyncio.CancelledError

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await at_eof(reader)
        writer.close()

    serve(handle, test)


# ---------------------------------------------------------------- event streams
def test_event_stream_flushes_each_event_and_ends_by_closing() -> None:
    release = asyncio.Event()

    async def handle(request: HttpRequest, responder: Responder) -> None:
        await responder.start_events()
        await responder.event({"text": "caf\xe9", "n": 1})
        await release.wait()  # the first event must be out before the handler goes on
        await responder.event("two\nlines")
        await responder.event("[DONE]")

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nContent-Length: 2\r\n\r\n{}")
        head = (await reader.readuntil(b"\r\n\r\n")).decode().lower()
        for header in ("content-type: text/event-stream", "cache-control: no-cache", "connection: close"):
            assert header in head.split("\r\n")
        assert "content-length" not in head
        assert await reader.readuntil(b"\n\n") == b'data: {"text": "caf\\u00e9", "n": 1}\n\n'
        release.set()
        assert await asyncio.wait_for(reader.read(), 2) == b"data: two\ndata: lines\n\ndata: [DONE]\n\n"
        writer.close()

    serve(handle, test)


def test_a_client_that_does_not_read_holds_the_event_stream_back() -> None:
    event_size, count, sent = 2**19, 64, []  # 32 MiB in all: more than the sockets' buffers hold

    async def handle(request: HttpRequest, responder: Responder) -> None:
        await responder.start_events()
        for index in range(count):
            await responder.event(f"{index:08d}" + "x" * (event_size - 8))
            sent.append(index)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # it stops reading at 128 KiB
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")
        while not sent:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)
        assert len(sent) < count  # the handler waits on the client instead of buffering the stream in memory
        events = (await reader.read()).split(b"\n\n")
        assert [event[6:14] for event in events[:-1]] == [f"{index:08d}".encode() for index in range(count)]
        writer.close()

    serve(handle, test)


@pytest.mark.parametrize("failure", [HttpError(429, "slow down"), ValueError("a bug")])
def test_an_error_during_an_event_stream_is_its_last_event_before_done(failure: Exception) -> None:
    """The error's object as an event, then ``[DONE]``, the end OpenAI's servers (vLLM's) mark a stream with."""
    async def handle(request: HttpRequest, responder: Responder) -> None:
        await responder.start_events()
        await responder.event({"n": 1})
        raise failure

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        response = await read_response(reader)
        first, last, done, end = response.body.split(b"\n\n")
        assert (response.status, first, done, end) == (200, b'data: {"n": 1}', b"data: [DONE]", b"")
        expected = (error_body(429, "rate_limit_error", "slow down") if isinstance(failure, HttpError) else
                    error_body(500, "server_error", "the server failed on this request; its log has the details"))
        assert last.startswith(b"data: ") and json.loads(last[6:]) == expected
        writer.close()

    serve(handle, test)


# ---------------------------------------------------------------- disconnects and pipelining
@pytest.mark.parametrize("how", ["close", "reset"])
def test_a_client_that_leaves_cancels_its_handler_whose_writes_raise_client_gone(
        how: str, caplog: pytest.LogCaptureFixture) -> None:
    started, finished = asyncio.Event(), asyncio.Event()
    outcomes: list[str] = []

    async def handle(request: HttpRequest, responder: Responder) -> None:
        await responder.start_events()
        started.set()
        try:
            try:
                await asyncio.Event().wait()  # a generation that never ends
            except asyncio.CancelledError:
                outcomes.append("cancelled")
                raise
            finally:
                try:
                    await responder.event("late")
                except ClientGone:
                    outcomes.append("gone")
                await responder.event("[DONE]")  # ClientGone out of the handler: the layer ends quietly
        finally:
            finished.set()

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n\r\n")
        await reader.readuntil(b"\r\n\r\n")  # unread bytes would make close() reset the connection
        await started.wait()
        if how == "reset":  # SO_LINGER 0: close() sends RST
            writer.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.close()
        await asyncio.wait_for(finished.wait(), 2)
        for _ in range(5):
            await asyncio.sleep(0)  # the connection's task ends

    with caplog.at_level(logging.WARNING):
        serve(handle, test)
    assert outcomes == ["cancelled", "gone"]
    assert [record.getMessage() for record in caplog.records] == []


def test_pipelined_requests_are_answered_in_order() -> None:
    release = asyncio.Event()
    seen: list[str] = []

    async def handle(request: HttpRequest, responder: Responder) -> None:
        seen.append(request.path)
        if request.path == "/slow":
            await release.wait()
        await echo(request, responder)

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        # one write; the empty line after a body (some clients send one) is no request
        writer.write(b"POST /a HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc\r\nGET /slow HTTP/1.1\r\n\r\n")
        assert (await read_response(reader)).json()["body"] == "abc"  # type: ignore[index]
        while seen != ["/a", "/slow"]:
            await asyncio.sleep(0.01)
        writer.write(b"POST /b HTTP/1.1\r\nContent-Length: 3\r\n\r\nxyz")  # sent while /slow's handler runs
        await writer.drain()
        await asyncio.sleep(0.1)  # the server reads it meanwhile
        release.set()
        assert (await read_response(reader)).json()["path"] == "/slow"  # type: ignore[index]
        assert (await read_response(reader)).json()["body"] == "xyz"  # type: ignore[index]
        writer.close()

    serve(handle, test)


# ---------------------------------------------------------------- TLS, options
def self_signed(folder: Path) -> tuple[Path, Path]:
    """A certificate for localhost and its key, made with cryptography (a dependency of the dev tools)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=1))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


def test_tls(tmp_path: Path) -> None:
    cert, key = self_signed(tmp_path)
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(cert, key)
    client_context = ssl.create_default_context(cafile=str(cert))

    async def test(port: int) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=client_context,
                                                       server_hostname="localhost")
        for path in ("/one", "/two"):
            writer.write(f"GET {path} HTTP/1.1\r\n\r\n".encode())
            assert (await read_response(reader)).json()["path"] == path  # type: ignore[index]
        writer.close()

    serve(echo, test, ssl=server_context)


@pytest.mark.parametrize("options", [{"max_body_bytes": -1}, {"idle_timeout_s": 0.0}, {"idle_timeout_s": float("nan")}])
def test_bad_options_are_config_errors(options: dict[str, float]) -> None:
    with pytest.raises(ConfigError):
        asyncio.run(start_http_server(echo, "127.0.0.1", 0, **options))  # type: ignore[arg-type]


def test_the_loops_end_cancels_running_handlers_quietly(caplog: pytest.LogCaptureFixture) -> None:
    started, outcomes = asyncio.Event(), []

    async def handle(request: HttpRequest, responder: Responder) -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            outcomes.append("cancelled")
            raise

    client = socket.socket()  # outside the loop, to stay open after it

    async def test(port: int) -> None:
        client.connect(("127.0.0.1", port))
        client.sendall(b"GET / HTTP/1.1\r\n\r\nGET / HTTP/1.1\r\n\r\n")
        await started.wait()  # and the test returns with the handler running and the connection open

    with caplog.at_level(logging.WARNING), client:
        serve(handle, test)
        client.settimeout(2)
        assert client.recv(100) == b""  # closed without an answer
    assert outcomes == ["cancelled"]
    assert [record.getMessage() for record in caplog.records] == []
