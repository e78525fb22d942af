"""Properties of server/http.py under generated and mutated requests from raw sockets on 127.0.0.1: whatever the
bytes, the server answers with well-formed HTTP/1.1 responses (OpenAI-shaped errors), logs nothing, ends each
connection's task and keeps serving; a valid request gets the same answer however it is split; pipelined requests
are answered in order; a request that stops halfway is closed after the idle timeout; the handler only ever sees
the bodies that were sent, within max_body_bytes. Each response is checked by a strict parser of RFC 9112's
grammar written here, each handled request against the request the test generated."""
from __future__ import annotations

import asyncio
import decimal
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.server.http import HttpRequest, Responder, start_http_server

MAX_BODY = 64  # max_body_bytes of every server here: generated bodies fall on both sides of it
STATUS_LINE = re.compile(rb"HTTP/1\.1 ([1-5][0-9][0-9]) [\x20-\x7e]*")
HEADER_LINE = re.compile(rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+): ([\x21-\x7e](?:[\x20-\x7e]*[\x21-\x7e])?)")
ERROR_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def fuzz(max_examples: int) -> settings:
    """Settings for a property that starts a server per example (caplog is reset by each one)."""
    return settings(max_examples=max_examples, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


# ---------------------------------------------------------------- the server side: a handler that records and echoes
def echo_payload(request: HttpRequest) -> dict[str, object]:
    return {"method": request.method, "path": request.path, "query": request.query, "headers": request.headers,
            "body": request.body.decode("latin-1")}


@dataclass
class Recorder:
    """The handler: records each request, answers /stream with an event stream and anything else with its echo."""

    calls: list[HttpRequest] = field(default_factory=list)

    async def __call__(self, request: HttpRequest, responder: Responder) -> None:
        self.calls.append(request)
        if request.path == "/stream":
            await responder.start_events()
            await responder.event(echo_payload(request))
            await responder.event("[DONE]")
        else:
            await responder.json(200, echo_payload(request))


def serve(test: Callable[[int, Recorder], Awaitable[None]], caplog: pytest.LogCaptureFixture,
          **options: float) -> Recorder:
    """Run ``test(port, recorder)`` against a fresh server, then check the invariants that hold after any client:
    no connection's task outlives its closed client, a good request on a new connection is answered, and nothing
    was logged at WARNING or above (a traceback for client garbage is a bug)."""
    recorder = Recorder()
    options.setdefault("idle_timeout_s", 0.5)  # a request the server loses shows as a close, not as a hang

    async def main() -> None:
        server = await start_http_server(recorder, "127.0.0.1", 0, max_body_bytes=MAX_BODY, **options)
        try:
            await asyncio.wait_for(test(server.port, recorder), 5)
            for _ in range(100):  # every client has closed: its connection's task ends promptly
                if not server.connections:
                    break
                await asyncio.sleep(0.01)
            assert not server.connections, "a connection's task outlived its client"
            calls = len(recorder.calls)
            reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
            writer.write(b"GET /still-serving HTTP/1.1\r\n\r\n")
            response = await asyncio.wait_for(read_response(reader, recorder, calls), 5)
            assert (response.status, response.json()["path"]) == (200, "/still-serving")
            del recorder.calls[calls:]
            writer.close()
            await writer.wait_closed()
        finally:
            await server.close()

    caplog.clear()
    with caplog.at_level(logging.WARNING):
        asyncio.run(main())
    assert [record.getMessage() for record in caplog.records] == []
    return recorder


# ---------------------------------------------------------------- the client side: a strict response parser
@dataclass
class Response:
    status: int
    headers: dict[str, str]
    body: bytes
    raw: bytes  # the response as sent, interim 100 Continue answers left out

    def json(self) -> dict[str, object]:
        return json.loads(self.body)


def check_error(payload: object, status: int) -> None:
    """An error body is OpenAI's: {"error": {"message", "type", "param", "code"}} with code the status."""
    assert isinstance(payload, dict) and list(payload) == ["error"], payload
    error = payload["error"]
    assert isinstance(error, dict) and sorted(error) == ["code", "message", "param", "type"], error
    kind = "server_error" if status >= 500 else ERROR_TYPES.get(status, "invalid_request_error")
    assert (error["code"], error["type"]) == (status, kind), error
    assert isinstance(error["message"], str) and error["message"] and error["param"] is None, error


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    raw = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = raw[:-4].split(b"\r\n")
    assert (match := STATUS_LINE.fullmatch(status_line)), raw
    headers: dict[str, str] = {}
    for line in lines:
        assert (header := HEADER_LINE.fullmatch(line)), raw
        name = header[1].decode().lower()
        assert name not in headers, f"{name} sent twice in {raw!r}"
        headers[name] = header[2].decode()
    return int(match[1]), headers, raw


async def read_response(reader: asyncio.StreamReader, recorder: Recorder, answered: int) -> Response:
    """The next response, checked: a status line and headers (after any 100 Continue), then exactly Content-Length
    bytes of JSON (none when answering HEAD), or an event stream of JSON or "[DONE]" events up to the connection's
    end; an error is OpenAI-shaped; after "Connection: close" the server sends nothing more. ``answered``: how many
    of the recorder's calls were answered before, so that a 200 is known to answer calls[answered]."""
    status, headers, raw = await read_head(reader)
    while status == 100:
        assert headers == {}, raw
        status, headers, raw = await read_head(reader)
    assert headers.get("connection") in ("keep-alive", "close"), raw
    if headers.get("content-type") == "text/event-stream":
        assert (status, headers["connection"], "content-length" in headers) == (200, "close", False), raw
        body = await reader.read()
        *events, end = body.split(b"\n\n")
        assert end == b"", body
        for event in events:
            lines = event.split(b"\n")
            assert all(line.startswith(b"data: ") for line in lines), body
            data = b"\n".join(line[6:] for line in lines)
            payload = json.loads(data) if data != b"[DONE]" else None
            if isinstance(payload, dict) and "error" in payload:
                check_error(payload, payload["error"]["code"])
        return Response(status, headers, body, raw + body)
    assert headers.get("content-type") == "application/json" and headers["content-length"].isdigit(), raw
    head_only = status == 200 and recorder.calls[answered].method == "HEAD"
    body = b"" if head_only else await reader.readexactly(int(headers["content-length"]))
    if not head_only:
        payload = json.loads(body)
        if status >= 400:
            check_error(payload, status)
    if headers["connection"] == "close":
        assert await reader.read() == b"", "bytes after a response that closes the connection"
    return Response(status, headers, body, raw + body)


async def read_all(reader: asyncio.StreamReader, recorder: Recorder) -> list[Response]:
    """Every response up to the connection's end, each checked by read_response; none of them cut short."""
    replay = asyncio.StreamReader()
    replay.feed_data(await reader.read())
    replay.feed_eof()
    responses: list[Response] = []
    while not replay.at_eof():
        answered = sum(response.status == 200 for response in responses)
        responses.append(await read_response(replay, recorder, answered))
    return responses


# ---------------------------------------------------------------- generated requests
@dataclass
class Sent:
    """A valid request as the test builds it, and what the handler must see of it."""

    method: str
    path: str
    query: dict[str, str]
    headers: list[tuple[str, bytes]]
    body: bytes
    version: str  # "HTTP/1.1" or "HTTP/1.0"
    connection: str | None  # the Connection header's value, if any
    send_length: bool  # a Content-Length header even for an empty body
    expect: bool  # Expect: 100-continue

    def encode(self) -> bytes:
        query = "&".join(f"{key}={value}" for key, value in self.query.items())
        lines = [f"{self.method} {self.path}{'?' * bool(query)}{query} {self.version}".encode()]
        lines += [f"{name}: ".encode() + value for name, value in self.headers]
        if self.connection is not None:
            lines.append(f"Connection: {self.connection}".encode())
        if self.expect:
            lines.append(b"Expect: 100-continue")
        if self.body or self.send_length:
            lines.append(f"Content-Length: {len(self.body)}".encode())
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body

    def seen(self) -> HttpRequest:
        """The request the handler must be given."""
        headers: dict[str, str] = {}
        for name, value in self.headers:
            key, text = name.lower(), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        if self.connection is not None:
            headers["connection"] = self.connection
        if self.expect:
            headers["expect"] = "100-continue"
        if self.body or self.send_length:
            headers["content-length"] = str(len(self.body))
        return HttpRequest(self.method, self.path, self.query, headers, self.body)

    def keeps_open(self) -> bool:
        tokens = {token.strip().lower() for token in (self.connection or "").split(",")}  # RFC 9110: no case
        keep = "close" not in tokens if self.version == "HTTP/1.1" else "keep-alive" in tokens
        return keep and self.path != "/stream"


RESERVED = {"connection", "content-length", "transfer-encoding", "expect"}
HEADER_NAMES = st.from_regex(r"[A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]{0,10}", fullmatch=True).filter(
    lambda name: name.lower() not in RESERVED)
HEADER_VALUES = st.binary(max_size=12).map(lambda raw: bytes(
    byte for byte in raw if byte == 9 or 0x20 <= byte != 0x7f).strip(b" \t"))
WORDS = st.from_regex(r"[a-z0-9]{1,4}", fullmatch=True)
SENT = st.builds(
    Sent, method=st.sampled_from(["GET", "POST", "HEAD", "DELETE", "PATCH"]) | st.from_regex(r"[A-Z]{1,6}",
                                                                                              fullmatch=True),
    path=st.sampled_from(["/v1/completions", "/stream", "/"]) | st.from_regex(r"/[!-~]{0,12}", fullmatch=True).filter(
        lambda path: "?" not in path and path != "/stream"),
    query=st.dictionaries(WORDS, st.from_regex(r"[a-z0-9]{0,4}", fullmatch=True), max_size=3),
    headers=st.lists(st.tuples(HEADER_NAMES, HEADER_VALUES), max_size=4), body=st.binary(max_size=MAX_BODY),
    version=st.sampled_from(["HTTP/1.1", "HTTP/1.1", "HTTP/1.0"]),
    connection=st.sampled_from([None, None, "close", "keep-alive", "Keep-Alive, foo"]), send_length=st.booleans(),
    expect=st.booleans())
KEPT_OPEN = SENT.filter(Sent.keeps_open)
CLOSING = Sent("GET", "/last", {}, [], b"", "HTTP/1.1", "close", send_length=False, expect=False)


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    await writer.wait_closed()


def check_answers(sent: list[Sent], responses: list[Response], recorder: Recorder) -> None:
    """The requests up to the first that closes the connection were handled as sent, each answered in order."""
    answered = next((index + 1 for index, request in enumerate(sent) if not request.keeps_open()), len(sent))
    assert recorder.calls == [request.seen() for request in sent[:answered]]
    assert [response.status for response in responses] == [200] * answered
    for request, response in zip(sent, responses):
        expected = echo_payload(request.seen())
        if request.path == "/stream":
            events = b"data: " + json.dumps(expected).encode() + b"\n\ndata: [DONE]\n\n"
            assert response.body == (b"" if request.method == "HEAD" else events)
        elif request.method == "HEAD":
            assert (response.body, response.headers["content-length"]) == (b"", str(len(json.dumps(expected))))
        else:
            assert response.json() == expected


# ---------------------------------------------------------------- properties
@fuzz(40)
@given(first=st.lists(KEPT_OPEN, max_size=4), last=SENT)
def test_pipelined_requests_in_one_write_are_each_answered_in_order(
        first: list[Sent], last: Sent, caplog: pytest.LogCaptureFixture) -> None:
    sent = [*first, last] if not last.keeps_open() else [*first, last, CLOSING]  # the server closes after them

    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        writer.write(b"".join(request.encode() for request in sent) + b"GET /after-a-close HTTP/1.1\r\n\r\n")
        check_answers(sent, await read_all(reader, recorder), recorder)
        await close(writer)

    serve(test, caplog)


@fuzz(40)
@given(sent=SENT, data=st.data())
def test_a_request_split_anywhere_gets_the_answer_it_gets_whole(
        sent: Sent, data: st.DataObject, caplog: pytest.LogCaptureFixture) -> None:
    raw = sent.encode()
    cuts = sorted(data.draw(st.sets(st.integers(1, len(raw) - 1), max_size=8), label="cuts"))
    pauses = data.draw(st.lists(st.sampled_from([0.0, 0.001, 0.002]), min_size=len(cuts), max_size=len(cuts)),
                       label="pauses")

    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        writer.write(raw)
        whole = await read_response(reader, recorder, 0)
        await close(writer)
        reader, writer = await connect(port)
        for start, end, pause in zip([0, *cuts], cuts, pauses):
            writer.write(raw[start:end])
            await writer.drain()
            await asyncio.sleep(pause)
        writer.write(raw[cuts[-1] if cuts else 0:])
        split = await read_response(reader, recorder, 1)
        assert split.raw == whole.raw
        check_answers([sent], [whole], Recorder(recorder.calls[:1]))
        assert recorder.calls == [sent.seen()] * 2
        await close(writer)

    serve(test, caplog)


IDLE_TIMEOUT_S = 0.2


@fuzz(12)
@given(sent=SENT, data=st.data())
def test_a_request_that_stops_halfway_is_refused_and_closed_after_the_idle_timeout(
        sent: Sent, data: st.DataObject, caplog: pytest.LogCaptureFixture) -> None:
    raw = sent.encode()
    cut = data.draw(st.integers(1, len(raw) - 1), label="cut")

    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        writer.write(raw[:cut])
        start = time.monotonic()
        responses = await read_all(reader, recorder)
        assert IDLE_TIMEOUT_S * 0.9 <= time.monotonic() - start < IDLE_TIMEOUT_S + 1
        assert [(response.status, response.headers["connection"]) for response in responses] == [(408, "close")]
        assert recorder.calls == []
        await close(writer)

    serve(test, caplog, idle_timeout_s=IDLE_TIMEOUT_S)


@fuzz(40)
@given(length=st.integers(0, 2 * MAX_BODY) | st.sampled_from([MAX_BODY, MAX_BODY + 1]),
       bytes_=st.binary(min_size=2 * MAX_BODY, max_size=2 * MAX_BODY), after=KEPT_OPEN)
def test_the_handler_gets_the_body_sent_within_max_body_bytes_or_is_not_called(
        length: int, bytes_: bytes, after: Sent, caplog: pytest.LogCaptureFixture) -> None:
    body = bytes_[:length]
    raw = f"POST /v1/completions HTTP/1.1\r\nContent-Length: {length}\r\n\r\n".encode() + body

    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        writer.write(raw + after.encode())
        responses = await read_all(reader, recorder) if length > MAX_BODY else [
            await read_response(reader, recorder, index) for index in range(2)]
        if length > MAX_BODY:
            assert ([response.status for response in responses], recorder.calls) == ([413], [])
        else:
            assert [call.body for call in recorder.calls] == [body, after.body]
            assert responses[0].json()["body"] == body.decode("latin-1")
        await close(writer)

    serve(test, caplog)


PIECES = [b"\r\n", b"\r\n\r\n", b"\n", b"\r", b" ", b"\t", b":", b"\x00", b"\x7f", b"\xff", b"?", b"/", b"0", b"-1",
          b"HTTP/1.1", b"HTTP/1.0", b"Content-Length: ", b"Content-Length: 3\r\n", b"Transfer-Encoding: chunked\r\n",
          b"Expect: 100-continue\r\n", b"Connection: close\r\n", b"HEAD", b"GET / HTTP/1.1\r\n\r\n"]


NUMBERS = st.integers(0, 2**70).map(lambda number: str(number).encode()) | st.sampled_from([
    b"-1", b"+1", b"0x10", b"1.0", b"1 1", b"1e3", b"\xd9\xa3", b"0" * 5000 + b"1", b"9" * 5000])


@st.composite
def garbage(draw: st.DrawFn) -> bytes:
    """Valid requests edited at random (bytes inserted, deleted, repeated; a number rewritten), or random bytes."""
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(min_size=1, max_size=200))
    data = bytearray(b"".join(request.encode() for request in draw(st.lists(SENT, min_size=1, max_size=3))))
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(data)))
        edit = draw(st.sampled_from(["insert", "insert", "delete", "repeat", "number"]))
        numbers = list(re.finditer(rb"[0-9]+", data))
        if edit == "number" and numbers:  # a Content-Length, a version, a digit in a header
            number = draw(st.sampled_from(numbers))
            data[number.start():number.end()] = draw(NUMBERS)
        elif edit == "insert":
            data[at:at] = draw(st.sampled_from(PIECES) | st.binary(min_size=1, max_size=6))
        elif edit == "delete":
            del data[at:at + draw(st.integers(1, 8))]
        else:
            data[at:at] = draw(st.binary(min_size=1, max_size=2)) * draw(st.sampled_from([2, 80, 5000, 70000]))
    return bytes(data)


@fuzz(100)
@given(raw=garbage())
def test_garbage_gets_well_formed_answers_and_the_server_goes_on(raw: bytes, caplog: pytest.LogCaptureFixture) -> None:
    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        writer.write(raw)
        responses = await read_all(reader, recorder)  # the idle timeout ends what is left
        statuses = [response.status for response in responses]
        assert statuses.count(200) == len(recorder.calls) and 200 not in statuses[len(recorder.calls):], statuses
        for call in recorder.calls:
            assert len(call.body) <= MAX_BODY and call.body in raw
        await close(writer)

    serve(test, caplog, idle_timeout_s=0.05)


# ---------------------------------------------------------------- regressions: bugs these properties found
LENGTHS = st.one_of(
    st.integers(0, 2 * MAX_BODY).map(lambda number: str(number).encode()),
    st.builds(lambda zeros, digits: b"0" * zeros + digits, st.integers(0, 6000), st.from_regex(rb"[0-9]{1,3}",
                                                                                                fullmatch=True)),
    st.integers(4000, 6000).map(lambda size: b"9" * size),  # Python's int() refuses over 4,300 digits
    st.builds(lambda before, digits: before + digits, st.sampled_from([b"+", b"-", b"1_", b"0x", b"1 ", b"1,"]),
              st.from_regex(rb"[0-9]{1,2}", fullmatch=True)),  # what int() or a lax parser would take
    st.binary(min_size=1, max_size=8).filter(lambda value: b"\r" not in value and b"\n" not in value))


@fuzz(40)
@given(value=LENGTHS)
def test_any_content_length_is_answered_by_its_value(value: bytes, caplog: pytest.LogCaptureFixture) -> None:
    """A Content-Length of any size or shape is a length (200 with that many bytes), too large (413) or no number
    (400); decimal.Decimal, with no limit on digits, is the reference."""
    number = value.strip(b" \t")
    valid = re.fullmatch(rb"[0-9]+", number) is not None
    expected = 413 if valid and decimal.Decimal(number.decode()) > MAX_BODY else 200 if valid else 400
    body = b"b" * int(decimal.Decimal(number.decode())) if expected == 200 else b""

    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        writer.write(b"POST / HTTP/1.1\r\nContent-Length: " + value + b"\r\nConnection: close\r\n\r\n" + body)
        responses = await read_all(reader, recorder)
        assert [response.status for response in responses] == [expected]
        assert [call.body for call in recorder.calls] == ([body] if expected == 200 else [])
        await close(writer)

    serve(test, caplog)


def test_a_request_head_sent_a_byte_at_a_time_is_cut_off_after_the_idle_timeout(
        caplog: pytest.LogCaptureFixture) -> None:
    """Each byte comes well within the idle timeout, yet the head is refused (408) once it has taken longer in
    all: a client cannot hold a connection (a slow loris) by trickling its headers."""
    async def trickle(writer: asyncio.StreamWriter) -> None:
        writer.write(b"GET / HTTP/1.1\r\nX-Long: ")
        for _ in range(int(3 / (IDLE_TIMEOUT_S / 4))):  # for 3 s if the server lets it
            await asyncio.sleep(IDLE_TIMEOUT_S / 4)
            writer.write(b"x")

    async def test(port: int, recorder: Recorder) -> None:
        reader, writer = await connect(port)
        start = time.monotonic()
        trickling = asyncio.create_task(trickle(writer))
        responses = await read_all(reader, recorder)
        assert IDLE_TIMEOUT_S * 0.9 <= time.monotonic() - start < IDLE_TIMEOUT_S + 1
        assert [response.status for response in responses] == [408]
        trickling.cancel()
        await close(writer)

    serve(test, caplog, idle_timeout_s=IDLE_TIMEOUT_S)


@pytest.mark.parametrize("value, error", [(object(), TypeError), (float("nan"), ValueError)])
def test_a_payload_that_is_not_json_is_answered_500_and_the_connection_goes_on(
        caplog: pytest.LogCaptureFixture, value: object, error: type) -> None:
    """A handler's payload that is not JSON (an object json.dumps refuses, or a NaN, which it would write as the
    invalid token NaN) is the handler's bug (500, logged with its traceback), not a response begun: the client is
    answered instead of waiting forever."""
    recorder = Recorder()

    async def handle(request: HttpRequest, responder: Responder) -> None:
        if request.path == "/not-json":
            await responder.json(200, {"value": value})
        else:
            await recorder(request, responder)

    async def main() -> list[Response]:
        server = await start_http_server(handle, "127.0.0.1", 0)
        try:
            reader, writer = await connect(server.port)
            writer.write(b"GET /not-json HTTP/1.1\r\n\r\nGET /next HTTP/1.1\r\n\r\n")
            responses = [await asyncio.wait_for(read_response(reader, recorder, 0), 2) for _ in range(2)]
            await close(writer)
            return responses
        finally:
            await server.close()

    with caplog.at_level(logging.WARNING):
        failed, answered = asyncio.run(main())
    assert (failed.status, failed.json()["error"]["message"], answered.json()["path"]) == (
        500, "the server failed on this request; its log has the details", "/next")
    assert [record.exc_info[0] for record in caplog.records if record.exc_info] == [error]  # type: ignore[index]
