"""The server's engine thread and servicer in-process, over a scripted engine (a few tests over a real one):
internal faults map to INTERNAL and the server keeps serving; a cancelled call aborts its request or beam search;
proto <-> SamplingParams defaults."""
from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import pytest

pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking (a dependency of infer-engine; "
                    "the GPU image lacks it)")

from infer.core.errors import InvalidRequestError, NotFoundError, PluginError  # noqa: E402
from infer.core.request import CompletionOutput, FinishReason, RequestOutput, SamplingParams  # noqa: E402
from infer.server import infer_pb2 as pb  # noqa: E402
from infer.server import infer_pb2_grpc as pb_grpc  # noqa: E402
from infer.server.client import AsyncClient, Client, build_request  # noqa: E402
from infer.server.convert import sampling_params_of  # noqa: E402
from infer.server.servicer import InferenceServicer  # noqa: E402
from infer.server.worker import EngineWorker  # noqa: E402


class ScriptedSearch:
    """A beam search that makes one beam of token 7s, a token per engine step."""

    def __init__(self, params: Any) -> None:
        self.params, self.steps, self.aborted = params, 0, False

    @property
    def done(self) -> bool:
        return self.aborted or self.steps >= self.params.max_tokens

    def result(self) -> list[Any]:
        from infer.core.beam_search import Beam, BeamSearchOutput

        assert not self.aborted
        return [BeamSearchOutput([1], [Beam([7] * self.params.max_tokens, "t", -1.0, -0.5, FinishReason.LENGTH)])]


class ScriptedEngine:
    """Emits token 7 once per step per request, and a token per step to each beam search. Prompts "crash-in-add" /
    "crash-in-step" raise RuntimeError, "plugin-error-in-step" a PluginError; "wide" emits 3,000 characters a step,
    "prompt-logprobs" gives 13 positions of 5 prompt logprobs each (about 700 bytes) with its first token, "burst"
    emits three tokens a step (as a step of accepted speculative tokens does); a beam search of "crash-in-start"
    raises RuntimeError."""

    def __init__(self) -> None:
        self.requests: dict[str, list] = {}  # request id -> [tokens emitted, params]
        self.faults: dict[str, Exception] = {}  # request id -> what a step raises while it runs
        self.aborted: list[str] = []
        self.events: list[tuple[str, Any]] = []  # ("add", prompt) and ("beam", requests unfinished then)
        self.searches: list[ScriptedSearch] = []  # under way
        self.aborted_searches: list[ScriptedSearch] = []
        self.arrivals: dict[str, float | None] = {}  # what the worker said each request's arrival_time was

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        params = params or SamplingParams()
        self.check_request(prompt, params)
        if prompt == "crash-in-add":
            raise RuntimeError("boom while adding")
        assert request_id is not None
        self.events.append(("add", prompt))
        self.arrivals[request_id] = arrival_time
        self.requests[request_id] = [0, params, prompt]
        if prompt == "crash-in-step":
            self.faults[request_id] = RuntimeError("boom in the step")
        if prompt == "plugin-error-in-step":
            self.faults[request_id] = PluginError("scheduler 'scripted' scheduled nothing; fix the plugin")
        return request_id

    def check_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> list[int]:
        (params or SamplingParams()).validate()
        if not prompt:
            raise InvalidRequestError("prompt is empty; give at least one character or token")
        return [1]

    def step(self) -> list[RequestOutput]:
        for rid, fault in self.faults.items():  # O(1) per step: a long request must not slow the loop down
            if rid in self.requests:
                raise fault
        for search in list(self.searches):
            search.steps += 1
            if search.done:
                self.searches.remove(search)
        outputs = []
        for rid, state in list(self.requests.items()):
            state[0] += 1
            done = state[0] >= state[1].max_tokens
            tokens = [7, 7, 7] if state[2] == "burst" else [7]
            outputs.append(RequestOutput(rid, [1], [CompletionOutput(0, tokens, "w" * 3000 if state[2] == "wide" else
                                                                     "t" * len(tokens),
                                                                     FinishReason.LENGTH if done else None)], done))
            if state[2] == "prompt-logprobs" and state[0] == 1:
                outputs[-1].prompt_logprobs = [None] + [{t: -0.5 * t for t in range(1000, 1005)}] * 12
            if done:
                del self.requests[rid]
        return outputs

    def abort(self, request_id: str) -> RequestOutput:
        if request_id not in self.requests:
            raise NotFoundError(f"unknown request id {request_id!r} (it may have finished already)")
        del self.requests[request_id]
        self.aborted.append(request_id)
        return RequestOutput(request_id, [1], [CompletionOutput(0, [], "", FinishReason.ABORT)], True)

    def has_unfinished(self) -> bool:
        return bool(self.requests or self.searches)

    def start_beam_search(self, prompts: list[str | list[int]], params: Any) -> ScriptedSearch:
        """As Engine.start_beam_search: bad input raises at once; else it runs beside the requests."""
        params.validate()
        for prompt in prompts:
            self.check_request(prompt)
        if prompts == ["crash-in-start"]:
            raise RuntimeError("boom while starting a search")
        self.events.append(("beam", len(self.requests)))
        self.searches.append(ScriptedSearch(params))
        return self.searches[-1]

    def abort_beam_search(self, search: ScriptedSearch) -> None:
        if search in self.searches:
            self.searches.remove(search)
            search.aborted = True
            self.aborted_searches.append(search)


def serve_scripted(test: Callable[[AsyncClient, Any], Awaitable[None]], max_message_bytes: int | None = None,
                   engine: Any = None) -> Any:
    """Run ``test`` against an in-process server over ``engine`` (default: a new ScriptedEngine), sending at most
    ``max_message_bytes`` per message, as `infer serve --max-message-bytes` sets both."""
    engine = engine if engine is not None else ScriptedEngine()

    async def main() -> None:
        worker = EngineWorker(engine)
        limit = [] if max_message_bytes is None else [("grpc.max_send_message_length", max_message_bytes)]
        server = grpc.aio.server(options=limit)
        pb_grpc.add_InferenceServicer_to_server(
            InferenceServicer(worker, pb.ModelInfo(), pb.ListPluginsResponse(), max_queue=8, max_message_bytes=
                              max_message_bytes), server)
        port = server.add_insecure_port("127.0.0.1:0")
        worker.start()
        await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                await asyncio.wait_for(test(client, engine), 30)
        finally:
            await server.stop(None)
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())
    return engine


async def rpc_code(call: Awaitable[Any]) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call
    return info.value.code(), info.value.details()


def test_internal_faults_are_internal_and_the_server_keeps_serving() -> None:
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(client.complete("crash-in-step", max_tokens=3))
        assert code is grpc.StatusCode.INTERNAL and "boom in the step" in details
        code, details = await rpc_code(client.complete("crash-in-add", max_tokens=3))
        assert code is grpc.StatusCode.INTERNAL and "boom while adding" in details
        code, details = await rpc_code(client.beam_search("crash-in-start", max_tokens=3))
        assert (code, details) == (grpc.StatusCode.INTERNAL, "boom while starting a search")
        code, details = await rpc_code(client.complete("", max_tokens=3))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("prompt is empty")
        out = await client.complete("fine", max_tokens=3)
        assert list(out.outputs[0].token_ids) == [7, 7, 7] and out.usage.completion_tokens == 3
        assert out.outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
        assert not engine.requests

    engine = serve_scripted(test)
    assert len(engine.aborted) == 1  # the step fault aborted the request that was in flight


def test_the_worker_gives_the_engine_each_calls_arrival_time() -> None:
    """The engine counts TTFT (and priority aging) from when the call came in, not from when the engine thread got
    to it: the worker stamps each call on arrival."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        before = time.perf_counter()
        await client.complete("fine", max_tokens=2, request_id="timed")
        arrival = engine.arrivals["timed"]
        assert arrival is not None and before <= arrival <= time.perf_counter()

    serve_scripted(test)


def test_a_plugin_error_in_a_step_keeps_its_status_and_message() -> None:
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(client.complete("plugin-error-in-step", max_tokens=3))
        assert (code, details) == (grpc.StatusCode.FAILED_PRECONDITION,
                                   "scheduler 'scripted' scheduled nothing; fix the plugin")
        out = await client.complete("fine", max_tokens=2)
        assert list(out.outputs[0].token_ids) == [7, 7]

    serve_scripted(test)


def test_a_slow_reader_gets_every_token_in_messages_under_the_limit() -> None:
    """Deltas queued while the client does not read merge into messages that still fit --max-message-bytes (one
    merged message of every token failed with RESOURCE_EXHAUSTED and lost them all)."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        call = client.generate("slow", max_tokens=30000)  # past the HTTP/2 window: the server stops sending
        first = await call.read()
        while engine.requests:  # the reader sleeps until the engine has produced everything
            await asyncio.sleep(0.05)
        responses = [first]
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
        assert sum(len(r.outputs[0].token_ids) for r in responses) == 30000 and responses[-1].finished
        assert len(responses) < 30000 and max(r.ByteSize() for r in responses) <= 1024  # merged, and small

    serve_scripted(test, max_message_bytes=1024)


def test_complete_refuses_a_response_over_the_limit_by_its_whole_size() -> None:
    """The size check counted the completions only; a long request_id pushed the response past the limit."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        out = await client.complete("x", max_tokens=4, request_id="r" * 256)
        assert list(out.outputs[0].token_ids) == [7] * 4
        # ~810 bytes of completion: under 1024 alone, over it with the 256-character id beside
        code, details = await rpc_code(client.complete("x", max_tokens=400, request_id="r" * 256))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "use Generate" in details, details
        code, details = await rpc_code(client.complete("x", max_tokens=4, request_id="r" * 257))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "request_id has 257 characters; at most 256" in details

    serve_scripted(test, max_message_bytes=1024)


def test_a_generate_message_past_the_limit_is_refused_by_name() -> None:
    """One step's output past --max-message-bytes: FAILED_PRECONDITION saying what to change (gRPC itself failed it
    as RESOURCE_EXHAUSTED, which invites a retry that fails alike)."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(collect(client.generate("wide", max_tokens=3)))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and details.startswith(
            "one message of the reply (1 completion of a step or so) takes 30"), details
        assert "past --max-message-bytes 1024; ask for fewer completions (n) or top logprobs" in details
        await until(lambda: not engine.requests, "the refused request to go")  # the server aborts it after replying

    serve_scripted(test, max_message_bytes=1024)


def test_prompt_logprobs_fit_whether_or_not_the_reader_kept_up() -> None:
    """Deltas queued behind a busy event loop merged with the first one, past the limit with its prompt logprobs,
    and the request failed; the merge counts them now."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        for busy in (0.0, 0.3):
            added = len(engine.events)
            call = client.generate("prompt-logprobs", max_tokens=200)
            while len(engine.events) == added:  # until the server has submitted it
                await asyncio.sleep(0)
            time.sleep(busy)  # the loop blocked: the engine's deltas, the first one too, queue up meanwhile
            responses = [r async for r in call]
            assert sum(len(r.outputs[0].token_ids) for r in responses) == 200
            assert [len(r.prompt_logprobs) for r in responses if r.prompt_logprobs] == [13]
            assert max(r.ByteSize() for r in responses) <= 1024

    serve_scripted(test, max_message_bytes=1024)


def test_the_clients_take_what_the_server_may_send() -> None:
    """A server with --max-message-bytes above gRPC's 4 MiB default: the clients set no limit of their own, so a
    5 MB Complete response (infer client --n 2 uses Complete) arrives."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        out = await client.complete("wide", max_tokens=1700)
        assert len(out.outputs[0].text) == 5_100_000 and out.ByteSize() > 4 * 2**20

    serve_scripted(test, max_message_bytes=16 * 2**20)


def test_a_clients_own_message_limit_bounds_what_it_sends_and_receives() -> None:
    """Client(max_message_bytes=N) sets a limit of the client's own (docs/serving.md): a request or a reply over N
    bytes fails with RESOURCE_EXHAUSTED, the request never reaching the engine; smaller ones pass."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        async with AsyncClient(client.target, max_message_bytes=1024) as small:
            code, _ = await rpc_code(small.complete("x" * 2000, max_tokens=2))
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and engine.events == []
            code, _ = await rpc_code(small.complete("wide", max_tokens=1))  # a 3,000-character reply
            assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and engine.events == [("add", "wide")]
            assert list((await small.complete("x", max_tokens=2)).outputs[0].token_ids) == [7, 7]
        with pytest.raises(grpc.aio.UsageError):  # leaving `async with` closed its channel
            await small.stats()

    serve_scripted(test)


async def collect(call: Any) -> list[Any]:
    return [response async for response in call]


def test_complete_sends_a_response_that_fits() -> None:
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        out = await client.complete("x", max_tokens=1400)
        assert list(out.outputs[0].token_ids) == [7] * 1400 and 2800 < out.ByteSize() <= 4096

    serve_scripted(test, max_message_bytes=4096)


def test_complete_sizes_deltas_by_what_they_add_to_the_merged_completion() -> None:
    """Complete's running size: each delta's share of the merged completion, within its framing. (Summing each
    delta's own message size counted the fields' framing once per delta: 2-3x the size of one-token deltas.)"""
    import random

    from infer.server.servicer import merged_share

    rng = random.Random(0)
    parts = [pb.Completion(index=0, token_ids=[rng.randrange(128256)], text=rng.choice(["a", "é", " hello", "🙂"]),
                           logprobs=[pb.PositionLogprobs(tokens=[pb.TokenLogprob(token_id=rng.randrange(128256),
                                                                                 logprob=-rng.random())] * 5)])
             for _ in range(1000)]
    plain = [pb.Completion(index=0, token_ids=part.token_ids, text=part.text) for part in parts]  # no logprobs
    for deltas in (parts, plain):
        merged = pb.Completion(index=0, finish_reason=pb.FINISH_REASON_LENGTH)
        for part in deltas:
            merged.token_ids.extend(part.token_ids)
            merged.text += part.text
            merged.logprobs.extend(part.logprobs)
        estimate = sum(merged_share(part) for part in deltas)
        assert merged.ByteSize() - 32 <= estimate <= 1.02 * merged.ByteSize()
    assert sum(part.ByteSize() for part in plain) > 1.4 * merged.ByteSize()  # what the old sum counted


def test_a_cancelled_stream_aborts_its_request() -> None:
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        call = client.generate("long", request_id="gone", max_tokens=10**6)
        await call.read()
        call.cancel()
        for _ in range(200):
            if "gone" in engine.aborted:
                break
            await asyncio.sleep(0.01)
        assert engine.aborted == ["gone"] and not engine.requests
        code, _ = await rpc_code(client.abort("gone"))
        assert code is grpc.StatusCode.NOT_FOUND

    serve_scripted(test)


def test_a_failed_write_is_grpcs_to_handle_not_an_internal_error(caplog) -> None:
    """A write that fails (the client went away mid-send: gRPC raises at the handler's yield, and ignores that once
    the call is closed) was caught as the request's own error: logged as an INTERNAL fault with its traceback and
    answered with an abort on a call that had already ended. It passes through now, and the request still ends."""
    import logging

    class WriteFailed(Exception):
        pass

    class Context:
        aborted: list[tuple[Any, str]] = []

        async def abort(self, code: Any, details: str) -> None:
            self.aborted.append((code, details))
            raise grpc.aio.AbortError()

    async def main() -> None:
        engine = ScriptedEngine()
        worker = EngineWorker(engine)
        worker.start()
        try:
            servicer = InferenceServicer(worker, pb.ModelInfo(), pb.ListPluginsResponse(), max_queue=8)
            context = Context()
            call = servicer.Generate(build_request("long", request_id="cut", max_tokens=10**6), context)  # type: ignore
            first = await call.__anext__()
            assert first.request_id == "cut" and set(first.outputs[0].token_ids) == {7}
            with pytest.raises(WriteFailed):
                await call.athrow(WriteFailed("the transport refused the message"))
            assert context.aborted == [] and servicer.in_flight == 0
            await until(lambda: engine.aborted == ["cut"], "the request's abort")
        finally:
            await asyncio.to_thread(worker.stop)

    with caplog.at_level(logging.DEBUG, logger="infer.server"):
        asyncio.run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def until(condition: Callable[[], bool], what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def wait_until(condition: Callable[[], bool], what: str) -> None:
    """``until`` for a test without an event loop."""
    for _ in range(500):
        if condition():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_a_beam_search_runs_beside_requests() -> None:
    """A beam search starts at once beside a running request and ends before it; a request sent during a long
    search runs beside it and finishes first."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        before = client.generate("before", request_id="before", max_tokens=10**6)
        await before.read()
        result = await asyncio.wait_for(client.beam_search("beam", beam_width=2, max_tokens=3), 5)
        assert [list(b.token_ids) for b in result.beams] == [[7, 7, 7]] and result.prompt_tokens == 1
        assert "before" in engine.requests  # it did not wait for "before" to end
        before.cancel()
        await until(lambda: not engine.requests, "the cancelled request to go")
        long = asyncio.create_task(client.beam_search("long", max_tokens=10**6))
        await until(lambda: bool(engine.searches), "the long search to start")
        done = await asyncio.wait_for(client.complete("after", max_tokens=2), 5)
        assert list(done.outputs[0].token_ids) == [7, 7] and not long.done() and engine.searches
        assert engine.events == [("add", "before"), ("beam", 1), ("beam", 0), ("add", "after")]
        long.cancel()
        await until(lambda: not engine.searches, "the cancelled search to stop")
        assert len(engine.aborted_searches) == 1
        code, details = await rpc_code(client.beam_search("x", beam_width=0))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "beam_width must be an integer >= 1" in details
        code, details = await rpc_code(client.beam_search([], max_tokens=2))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "prompt is empty" in details

    serve_scripted(test)


def test_a_beam_search_past_its_deadline_stops_and_a_stopped_worker_fails_the_searches() -> None:
    import time
    from concurrent.futures import Future

    from infer.core.beam_search import BeamSearchParams
    from infer.server.worker import ServerUnavailable

    def started_past_its_deadline(target: str) -> grpc.StatusCode:
        with Client(target) as blocking:  # Client.start_beam_search: the call's timeout holds too
            return blocking.start_beam_search("long", max_tokens=10**6, timeout=0.3).exception(timeout=10).code()

    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, _ = await rpc_code(client.beam_search("long", max_tokens=10**6, timeout=0.3))
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: not engine.searches, "the search past its deadline to stop")
        assert len(engine.aborted_searches) == 1
        code = await asyncio.to_thread(started_past_its_deadline, client.target)
        assert code is grpc.StatusCode.DEADLINE_EXCEEDED
        await until(lambda: not engine.searches, "the started search past its deadline to stop")
        assert len(engine.aborted_searches) == 2

    serve_scripted(test)
    engine = ScriptedEngine()
    worker = EngineWorker(engine)
    worker.start()
    reply: Future = worker.beam_search(["x"], BeamSearchParams(max_tokens=10**6))
    for _ in range(500):
        if engine.searches:
            break
        time.sleep(0.01)
    worker.stop()  # returns once the thread has ended: what was left is answered by then
    assert reply.done() and isinstance(reply.exception(), ServerUnavailable) and engine.aborted_searches


def test_a_real_engine_serves_a_beam_search_beside_a_stream_and_a_cancelled_one_frees_its_blocks(
        tiny_model: Any) -> None:
    """Over a real engine: a BeamSearch and a Generate at the same time both complete with their outputs alone; a
    cancelled BeamSearch stops at once and the KV pool drains."""
    from infer.core.beam_search import BeamSearchParams
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    config = EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=512, block_size=4)
    solo = Engine(config)
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    want_tokens = solo.generate(["import os"], params)[0].outputs[0].token_ids
    want_beams = solo.beam_search(["def f(x):"], BeamSearchParams(beam_width=3, max_tokens=10))[0]
    engine = Engine(config)

    async def test(client: AsyncClient, engine: Engine) -> None:
        async def stream() -> list[int]:
            return [t async for r in client.generate("import os", max_tokens=30, temperature=0.0, ignore_eos=True)
                    for t in r.outputs[0].token_ids]

        tokens, beams = await asyncio.gather(stream(), client.beam_search("def f(x):", beam_width=3, max_tokens=10))
        assert tokens == want_tokens
        assert [list(b.token_ids) for b in beams.beams] == [b.token_ids for b in want_beams.beams]
        long = asyncio.create_task(client.beam_search("x = [", beam_width=4, max_tokens=300, ignore_eos=True))
        used = 0
        for _ in range(500):
            if (used := (await client.stats()).kv_used_blocks) > 0:
                break
            await asyncio.sleep(0.01)
        assert used > 0 and not long.done()  # the search holds blocks
        assert (await client.stats()).beam_searches == 1
        steps = engine.steps_taken
        long.cancel()
        stats = await client.stats()
        for _ in range(100):
            if stats.kv_used_blocks == 0:
                break
            await asyncio.sleep(0.01)
            stats = await client.stats()
        assert stats.kv_used_blocks == 0 and stats.kv_free_blocks + stats.kv_cached_blocks == stats.kv_total_blocks
        assert stats.beam_searches == 0
        assert (stats.beam_searches_finished, stats.beam_searches_aborted) == (1, 1)  # the cancelled one: aborted
        assert engine.steps_taken - steps < 200  # stopped, not run to its 300 tokens

    serve_scripted(test, engine=engine)
    assert not engine.searches and not engine.has_unfinished()


def test_abort_by_id_stops_a_beam_search_with_its_best_beams_so_far(tiny_model: Any) -> None:
    """A BeamSearch given a request_id: Abort(request_id) answers the call with the beams it has (those of a search
    that ends at that length, finish reason abort); the id is taken while it runs, by requests and searches alike."""
    from infer.core.beam_search import BeamSearchParams
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=512, block_size=4))

    async def test(client: AsyncClient, engine: Engine) -> None:
        long = asyncio.create_task(client.beam_search("x = [", request_id="s1", beam_width=3, max_tokens=400,
                                                      ignore_eos=True))
        await until(lambda: bool(engine.searches), "the search to start")
        for call in (client.complete("y", request_id="s1", max_tokens=2), client.beam_search("y", request_id="s1")):
            code, details = await rpc_code(call)
            assert code is grpc.StatusCode.INVALID_ARGUMENT and "request id 's1' is already in use" in details
        await asyncio.sleep(0.05)  # a few tokens in
        await client.abort("s1")
        result = await asyncio.wait_for(long, 5)
        length = len(result.beams[0].token_ids)
        assert 0 < length < 400 and {b.finish_reason for b in result.beams} == {pb.FINISH_REASON_ABORT}
        seen.extend([result, length])  # compared below, once the worker thread has let the engine go
        code, _ = await rpc_code(client.abort("s1"))
        assert code is grpc.StatusCode.NOT_FOUND
        stats = await client.stats()
        assert stats.beam_searches == 0 and stats.kv_used_blocks == 0
        assert (stats.beam_searches_aborted, stats.beam_searches_finished, stats.beam_searches_failed) == (1, 0, 0)
        code, details = await rpc_code(client.beam_search("y", request_id="r" * 257))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "request_id has 257 characters" in details

    seen: list[Any] = []
    serve_scripted(test, engine=engine)
    result, length = seen
    want = engine.beam_search(["x = ["], BeamSearchParams(beam_width=3, max_tokens=length, ignore_eos=True))[0]
    assert [list(b.token_ids) for b in result.beams] == [b.token_ids for b in want.beams]
    assert [b.score for b in result.beams] == pytest.approx([b.score for b in want.beams], rel=1e-6)


def test_abort_without_a_request_id_is_invalid_argument() -> None:
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(client.abort(""))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith("request_id is required")

    serve_scripted(test)


def test_unset_fields_take_the_sampling_params_defaults() -> None:
    params = sampling_params_of(build_request("hi", priority=3, temperature=0.0))
    assert params == SamplingParams(temperature=0.0, priority=3)
    explicit = SamplingParams(max_tokens=5, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=4, stop=("x",),
                              stop_token_ids=(2,), ignore_eos=True, logprobs=1, n=2, priority=7)
    assert sampling_params_of(build_request("hi", explicit)) == explicit  # priority included: it was dropped
    assert sampling_params_of(build_request("hi", explicit, priority=2)).priority == 2  # the keyword wins
    with pytest.raises(InvalidRequestError, match="max_tokens must be a positive integer"):
        sampling_params_of(build_request("hi", max_tokens=0))


def test_the_async_client_sends_the_priority_and_request_id_it_is_given() -> None:
    """AsyncClient.complete and generate send their request_id and priority: the engine adds the request under that
    id, with that SamplingParams.priority (docs/serving.md, GenerateRequest)."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        await client.complete("x", max_tokens=1, priority=5, request_id="c")
        await collect(client.generate("x", max_tokens=1, priority=-3, request_id="g"))
        assert added == [("c", 5), ("g", -3)]

    added: list[tuple[str | None, int]] = []
    engine = ScriptedEngine()
    add = engine.add_request
    engine.add_request = lambda prompt, params, request_id, arrival_time: (  # type: ignore[method-assign]
        added.append((request_id, params.priority)) or add(prompt, params, request_id, arrival_time))
    serve_scripted(test, engine=engine)


def test_queued_deltas_merge_into_one() -> None:
    from infer.server.streams import merge_deltas

    a = RequestOutput("r", [1], [CompletionOutput(0, [5], "a", None, [{5: -0.1}]), CompletionOutput(1, [6], "b")],
                      False)
    b = RequestOutput("r", [1], [CompletionOutput(0, [7], "c", FinishReason.STOP, [{7: -0.2}])], True, 3)
    merged = merge_deltas(a, b)
    assert merged.finished and merged.num_cached_tokens == 3
    assert [(c.index, c.token_ids, c.text, c.finish_reason, c.logprobs) for c in merged.outputs] == [
        (0, [5, 7], "ac", FinishReason.STOP, [{5: -0.1}, {7: -0.2}]), (1, [6], "b", None, None)]
    assert a.outputs[0].token_ids == [5]  # the inputs are left alone
    x = RequestOutput("r", [1], [CompletionOutput(2, [8], "x", None, [{8: -0.3}])], False)
    y = RequestOutput("r", [1], [CompletionOutput(2, [9], "y", None, [{9: -0.4}])], False)
    three = merge_deltas(a, x, y)  # a slow reader's queue, merged in one pass
    assert [(c.index, c.token_ids, c.text, c.logprobs) for c in three.outputs] == [
        (0, [5], "a", [{5: -0.1}]), (1, [6], "b", None), (2, [8, 9], "xy", [{8: -0.3}, {9: -0.4}])]
    assert (x.outputs[0].token_ids, x.outputs[0].logprobs) == ([8], [{8: -0.3}])  # a later one is not appended to


def test_queued_deltas_merge_only_while_they_fit() -> None:
    """A slow reader's queued deltas merge, but never past what one message may hold (a merged Generate response
    over --max-message-bytes lost the whole completion)."""
    from infer.server.streams import RequestStream

    async def main() -> list[list[int]]:
        stream = RequestStream("r", size_of=lambda delta: len(delta.outputs[0].token_ids), max_merged=3)
        for i in range(8):
            stream.put(RequestOutput("r", [1], [CompletionOutput(0, [i], "x", None)], i == 7))
        return [out.outputs[0].token_ids async for out in stream]

    assert asyncio.run(main()) == [[0, 1, 2], [3, 4, 5], [6, 7]]


def test_a_stopped_worker_refuses_at_once() -> None:
    from infer.server.worker import ServerUnavailable

    worker = EngineWorker(ScriptedEngine())
    worker.start()
    worker.stop()
    with pytest.raises(ServerUnavailable):
        worker.call(lambda engine: None).result(timeout=5)


def test_calls_whose_callers_gave_up_do_not_kill_the_engine_thread() -> None:
    """A GetStats or Abort RPC past its deadline cancels its future while the worker is busy; answering it then
    raised InvalidStateError on the worker thread, which died and left every stream hanging."""
    import threading

    engine, release = ScriptedEngine(), threading.Event()
    worker = EngineWorker(engine)
    worker.start()
    try:
        worker.call(lambda e: release.wait(10))  # the worker is busy until released
        engine.requests["r1"] = [0, SamplingParams(max_tokens=100)]
        stats, abort = worker.call(lambda e: len(e.requests)), worker.abort("r1")
        assert stats.cancel() and abort.cancel()  # the callers give up while both are queued
        release.set()
        assert worker.call(lambda e: "alive").result(timeout=10) == "alive"
        assert engine.aborted == ["r1"]  # the abort still happened: its caller only stopped waiting
    finally:
        release.set()
        worker.stop()


@pytest.mark.parametrize("reporting_fails", [False, True])
def test_a_failing_worker_thread_fails_its_streams_refuses_new_work_and_reports(reporting_fails: bool) -> None:
    """Whether or not on_fatal itself raises: the streams get the fault and new work is refused."""
    from infer.server.streams import RequestStream
    from infer.server.worker import ServerUnavailable

    class BrokenEngine(ScriptedEngine):
        def has_unfinished(self) -> bool:  # a bug outside step(), which the worker cannot contain
            if self.requests:
                raise RuntimeError("bug in the loop")
            return False

    async def main() -> None:
        fatal: list[BaseException] = []

        def report(exc: BaseException) -> None:
            fatal.append(exc)
            if reporting_fails:
                raise RuntimeError("the health service is gone")

        worker = EngineWorker(BrokenEngine(), on_fatal=report)
        worker.start()
        stream = RequestStream("r1")
        worker.submit("hello", SamplingParams(max_tokens=3), stream)
        with pytest.raises(Exception, match=r"engine thread failed \(RuntimeError\('bug in the loop'\)\); the "
                                            "server must be restarted"):
            await asyncio.wait_for(stream.__anext__(), 10)
        assert [str(e) for e in fatal] == ["bug in the loop"]
        with pytest.raises(ServerUnavailable, match="engine thread failed, so this server must be restarted"):
            worker.call(lambda engine: None).result(timeout=5)

    asyncio.run(main())


def test_the_command_being_handled_when_the_engine_thread_dies_gets_the_error() -> None:
    """The request whose add killed the thread is in no stream table and no queue: it hung until its deadline."""
    from infer.server.streams import RequestStream

    class DyingEngine(ScriptedEngine):
        def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                        request_id: str | None = None, arrival_time: float | None = None) -> str:
            if prompt == "killer":
                raise SystemExit("a bug that escapes the worker's own error handling")
            return super().add_request(prompt, params, request_id)

    async def main() -> None:
        worker = EngineWorker(DyingEngine())
        worker.start()
        other, killer = RequestStream("other"), RequestStream("killer")
        # long enough to be running when the killer arrives (1,000 tokens, a few ms of steps, finished first in a
        # loaded CI run, and its stream then ended instead of failing)
        worker.submit("hello", SamplingParams(max_tokens=10**7), other)
        await asyncio.wait_for(other.__anext__(), 10)  # running
        worker.submit("killer", SamplingParams(max_tokens=3), killer)
        for stream in (killer, other):
            with pytest.raises(Exception, match="engine thread failed"):
                while True:
                    await asyncio.wait_for(stream.__anext__(), 10)

    asyncio.run(main())


@pytest.mark.parametrize(("field", "value", "complaint"), [
    ("max_queue", 2**32, r"max-queue must be in \[1, 2\*\*32\)"),  # Stats.max_queue is a uint32: every GetStats failed
    ("max_message_bytes", 3_000_000_000, r"max-message-bytes must be in \[1024, 2\*\*31\)"),  # int32 in gRPC
    ("grace_period_s", float("nan"), "grace-period must be a finite number"),  # asyncio.wait(nan) drains nothing
    ("grace_period_s", float("inf"), "grace-period must be a finite number"),
])
def test_serve_options_out_of_range_are_config_errors(field: str, value: Any, complaint: str) -> None:
    from infer.core.errors import ConfigError
    from infer.server.app import ServeOptions

    with pytest.raises(ConfigError, match=complaint):
        ServeOptions(**{field: value}).validate()
    ServeOptions(max_queue=2**32 - 1, max_message_bytes=2**31 - 1, grace_period_s=0.0).validate()


def test_a_failed_engine_thread_turns_health_not_serving(tiny_model: Any) -> None:
    """A balancer must stop routing to a server whose engine thread is gone (it could only refuse requests)."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.server.app import SERVICE_NAME, InferenceServer, ServeOptions

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16))

    async def main() -> None:
        server = InferenceServer(engine, ServeOptions(port=0, grace_period_s=0.0))
        port = await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                assert await client.health() == "SERVING"
                code, _ = await rpc_code(client.health("no.such.Service"))  # the gRPC health protocol's answer
                assert code is grpc.StatusCode.NOT_FOUND
                assert server.worker.on_fatal is not None
                await asyncio.to_thread(server.worker.on_fatal, RuntimeError("bug in the loop"))  # its thread
                for _ in range(100):
                    if await client.health() == "NOT_SERVING":
                        break
                    await asyncio.sleep(0.05)
                assert [await client.health(s) for s in ("", SERVICE_NAME)] == ["NOT_SERVING"] * 2
        finally:
            await server.close(grace=0.0)

    asyncio.run(main())


def test_the_throughput_window_forgets_without_being_read() -> None:
    """Samples older than the window used to go only when someone read the rate: a server nobody polled kept one
    sample per output token forever."""
    from infer.server.snapshot import Throughput

    window = Throughput(window_s=10.0, started=0.0)
    for step in range(1000):
        window.add(float(step), 3)
    assert len(window.samples) == 11  # steps 989..999: within 10 s of the last
    assert window.rate(999.0) == 33 / 10.0  # 11 steps of 3 tokens over the 10 s window


def test_stats_and_metrics_show_speculation_and_its_degradation(tiny_model: Any) -> None:
    """GetStats and /metrics carried only the lifetime acceptance rate: an operator could not see the policy turn
    speculation off."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.server.metrics import StatsCollector

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32, proposer="ngram",
                                 num_speculative_tokens=2, plugin_options={"spec_decode": {"max_batch_size": 1}}))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    # before any step could draft, the state in force is the policy's first, on ("off" said: no proposer)
    assert engine.stats.summary()["spec_enabled"] == 1
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6]], params)  # alone: speculates
    engine.generate([[5, 6, 7, 5, 6, 7, 5, 6], [9, 8, 9, 8, 9, 8]], params)  # two at once: over max_batch_size
    worker = EngineWorker(engine)
    worker.start()
    try:
        snap = worker.snapshot().result(timeout=30)
    finally:
        worker.stop()
    summary = engine.stats.summary()
    assert snap.spec_steps_on == summary["spec_steps_on"] > 0
    assert snap.spec_steps_off_large_batch == summary["spec_steps_off_large_batch"] > 0
    assert snap.spec_enabled == bool(summary["spec_enabled"])
    stats = pb.Stats(**vars(snap))
    families = {f.name: f.samples[0].value for f in StatsCollector(lambda: stats, lambda: 0).collect()}
    assert families["infer_spec_steps_on"] == snap.spec_steps_on  # a counter family: exposed with _total
    assert families["infer_spec_steps_off_large_batch"] == snap.spec_steps_off_large_batch
    assert families["infer_spec_enabled"] == float(snap.spec_enabled)


def test_a_failed_command_whose_caller_gave_up_is_logged_not_lost(caplog):
    """An abort that still runs for a caller past its deadline had its error dropped without a trace."""
    import logging
    from concurrent.futures import Future

    from infer.core.errors import NotFoundError
    from infer.server.worker import _resolve

    def fails(exc: Exception):
        def run():
            raise exc
        return run

    for exc, logged in ((ZeroDivisionError("broken"), True), (NotFoundError("gone already"), False)):
        reply: Future = Future()
        reply.cancel()
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="infer.server"):
            _resolve(reply, fails(exc), even_if_cancelled=True)
        assert ("a command whose caller gave up failed" in caplog.text) is logged


def test_a_chat_prompt_over_grpc_is_rendered_by_the_servers_template(chat_model: Any) -> None:
    """Generate, Complete and BeamSearch take a conversation; the server's engine renders it (LLM.chat's tokens);
    a malformed one is INVALID_ARGUMENT, and so is a model without a template (rendered on the engine thread)."""
    from click.testing import CliRunner

    from infer import ChatPrompt
    from infer.cli import main
    from infer.core.beam_search import BeamSearchParams
    from infer.core.llm import LLM

    from infer.server.app import describe_engine

    llm = LLM(model=str(chat_model), device="cpu", num_kv_blocks=128)
    assert describe_engine(llm.engine).chat_template  # GetModelInfo tells clients that chats render
    chat = [{"role": "system", "content": "Answer in code."}, {"role": "user", "content": "def add(a, b):"}]
    want = llm.chat(chat, SamplingParams(max_tokens=6, temperature=0.0))[0]
    beams = llm.beam_search(ChatPrompt.of(chat), BeamSearchParams(beam_width=2, max_tokens=4))[0]

    async def test(client: AsyncClient, engine: Any) -> None:
        done = await client.complete(ChatPrompt.of(chat), max_tokens=6, temperature=0.0, prompt_logprobs=0)
        assert done.usage.prompt_tokens == len(want.prompt_token_ids)  # each entry holds its prompt token:
        assert [e.tokens[0].token_id for e in done.prompt_logprobs[1:]] == want.prompt_token_ids[1:]
        assert list(done.outputs[0].token_ids) == want.outputs[0].token_ids
        direct = ChatPrompt(tuple(chat))  # built from dicts, not through ChatPrompt.of: the client checks it
        streamed = [t async for r in client.generate(direct, max_tokens=6, temperature=0.0)
                    for t in r.outputs[0].token_ids]
        assert streamed == want.outputs[0].token_ids
        got = await client.beam_search(ChatPrompt.of(chat), beam_width=2, max_tokens=4)
        assert [list(b.token_ids) for b in got.beams] == [b.token_ids for b in beams.beams]
        for messages, complaint in (([], "a chat prompt needs at least one message"),
                                    ([pb.ChatMessage(role="", content="x")], "role must be a non-empty string"),
                                    ([pb.ChatMessage(role="tool", content="x")], "template refused the messages")):
            request = pb.GenerateRequest(chat=pb.Chat(messages=messages))
            code, details = await rpc_code(client.stub.Complete(request))
            assert code is grpc.StatusCode.INVALID_ARGUMENT and complaint in details, details
        for prompt in (ChatPrompt.of(chat, add_generation_prompt=False), ChatPrompt.of(  # the options travel too
                [*chat, {"role": "assistant", "content": "return"}], False, continue_final_message=True)):
            done = await client.complete(prompt, max_tokens=1, prompt_logprobs=0)
            assert [e.tokens[0].token_id for e in done.prompt_logprobs[1:]] == llm.engine.tokenize(prompt)[1:]
        thinking = ChatPrompt.of(chat, chat_template_kwargs={"enable_thinking": False})
        code, details = await rpc_code(client.stub.Complete(build_request(thinking)))  # the server's check
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "does not read 'enable_thinking'" in details, details
        request = pb.GenerateRequest(chat=pb.Chat(messages=[pb.ChatMessage(role="user", content="x")],
                                                  chat_template_kwargs="{oops"))
        code, details = await rpc_code(client.stub.Complete(request))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "chat.chat_template_kwargs must be a JSON object" in details
        cli = await asyncio.to_thread(CliRunner().invoke, main, [  # `infer client --chat` sends the same chat
            "client", chat[1]["content"], "--target", client.target, "--chat", "--system", chat[0]["content"],
            "--max-tokens", "6", "--temperature", "0"])
        assert (cli.exit_code, cli.stdout) == (0, want.outputs[0].text + "\n"), cli.output
        cli = await asyncio.to_thread(CliRunner().invoke, main, [  # its template variables go with it
            "client", chat[1]["content"], "--target", client.target, "--chat", "--chat-template-kwargs",
            '{"enable_thinking": false}', "--max-tokens", "6"])
        assert cli.exit_code == 1 and "does not read 'enable_thinking'" in cli.stderr, cli.output
        request = build_request(ChatPrompt.of(chat), max_tokens=1, prompt_logprobs=0)
        request.chat.ClearField("add_generation_prompt")  # a client that predates the field: HF's default, True
        done = await client.stub.Complete(request)
        assert [e.tokens[0].token_id for e in done.prompt_logprobs[1:]] == llm.engine.tokenize(ChatPrompt.of(chat))[1:]

    serve_scripted(test, engine=llm.engine)


def test_an_abort_without_an_id_leaves_a_search_sent_without_one_running() -> None:
    """A beam search sent without a request_id is stopped only by cancelling its call: abort("") does not match
    it, and answers as for any id the engine does not know (NotFoundError)."""
    from infer.core.beam_search import BeamSearchParams

    engine = ScriptedEngine()
    worker = EngineWorker(engine)
    worker.start()
    try:
        reply = worker.beam_search(["x"], BeamSearchParams(max_tokens=10**6))
        with pytest.raises(NotFoundError):
            worker.abort("").result(timeout=10)  # handled after the search started: the inbox is in order
        assert engine.searches and not engine.aborted_searches and not reply.done()
    finally:
        worker.stop()


def test_an_abort_that_fails_for_a_cancelled_stream_is_logged_and_the_worker_serves_on(caplog) -> None:
    """A cancelled call's abort that raises is the engine's fault, logged; it does not end the engine thread."""
    import logging

    from infer.server.streams import RequestStream

    class FailingAbort(ScriptedEngine):
        def abort(self, request_id: str) -> RequestOutput:
            raise RuntimeError("abort failed")

    async def main() -> None:
        worker = EngineWorker(FailingAbort())
        worker.start()
        try:
            stream = RequestStream("r1")
            worker.submit("long", SamplingParams(max_tokens=10**6), stream)
            await asyncio.wait_for(stream.__anext__(), 10)
            worker.cancel(stream)
            assert await asyncio.wait_for(asyncio.wrap_future(worker.call(lambda e: "alive")), 10) == "alive"
        finally:
            await asyncio.to_thread(worker.stop)

    with caplog.at_level(logging.ERROR, logger="infer.server"):
        asyncio.run(main())
    assert "abort of request r1 failed" in caplog.text and "engine thread failed" not in caplog.text, caplog.text


def closed_loop_stream(request_id: str) -> Any:
    """A RequestStream whose event loop has closed: nobody will read it."""
    from infer.server.streams import RequestStream

    async def make() -> RequestStream:
        return RequestStream(request_id)

    return asyncio.run(make())


def test_a_failed_step_that_had_ended_its_requests_logs_no_failed_abort(caplog) -> None:
    """A step that fails after the engine let its requests go: the worker's abort of each finds none (NotFoundError),
    which is no error of its own; the step's fault is the one logged."""
    import logging

    class EndsThenFails(ScriptedEngine):
        def step(self) -> list[RequestOutput]:
            self.requests.clear()
            raise RuntimeError("boom after the requests ended")

    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(client.complete("x", max_tokens=3))
        assert code is grpc.StatusCode.INTERNAL and "boom after the requests ended" in details

    with caplog.at_level(logging.ERROR, logger="infer.server"):
        serve_scripted(test, engine=EndsThenFails())
    assert "engine step failed" in caplog.text and "abort of request" not in caplog.text, caplog.text


def test_outputs_for_a_stream_whose_event_loop_has_closed_are_dropped() -> None:
    """Nobody reads a stream whose event loop has closed: its outputs go nowhere, and the engine thread goes on."""
    stream = closed_loop_stream("orphan")
    engine = ScriptedEngine()
    worker = EngineWorker(engine)
    worker.start()
    try:
        worker.submit("x", SamplingParams(max_tokens=3), stream)
        wait_until(lambda: bool(engine.events) and not engine.requests, "the request to run its 3 steps")
        assert worker.call(lambda e: "alive").result(timeout=10) == "alive"
    finally:
        worker.stop()


def test_a_beam_search_whose_caller_gave_up_before_it_started_never_starts() -> None:
    """A BeamSearch cancelled while queued behind a busy worker is not started (no beams, no KV) and the
    worker goes on; one sent after the worker stopped is refused with ServerUnavailable."""
    import threading

    from infer.core.beam_search import BeamSearchParams
    from infer.server.worker import ServerUnavailable

    engine, release = ScriptedEngine(), threading.Event()
    worker = EngineWorker(engine)
    worker.start()
    try:
        worker.call(lambda e: release.wait(10))  # the worker is busy until released
        reply = worker.beam_search(["x"], BeamSearchParams(max_tokens=10**6))
        assert reply.cancel()
        release.set()
        assert worker.call(lambda e: "alive").result(timeout=10) == "alive"
        assert engine.events == [] and not engine.searches and not engine.aborted_searches
    finally:
        release.set()
        worker.stop()
    with pytest.raises(ServerUnavailable):
        worker.beam_search(["x"], BeamSearchParams(max_tokens=2)).result(timeout=5)


@pytest.mark.parametrize("error", [InvalidRequestError("bad prompt"), SystemExit("a bug past the worker's handling")])
def test_a_search_whose_caller_gave_up_while_it_failed_to_start_is_answered_to_nobody(error: BaseException) -> None:
    """The caller gives up while start_beam_search runs, which then fails: nothing is set on the cancelled future
    (that raised on the engine thread). A refused search leaves the worker serving; a fault that ends the thread
    leaves it refusing new work, not hanging."""
    import threading

    from infer.core.beam_search import BeamSearchParams
    from infer.server.worker import ServerUnavailable

    started, release = threading.Event(), threading.Event()

    class SlowToFail(ScriptedEngine):
        def start_beam_search(self, prompts: list[str | list[int]], params: Any) -> ScriptedSearch:
            started.set()
            release.wait(10)
            raise error

    worker = EngineWorker(SlowToFail())
    worker.start()
    try:
        reply = worker.beam_search(["x"], BeamSearchParams(max_tokens=2))
        assert started.wait(10) and reply.cancel()
        release.set()
        if isinstance(error, SystemExit):
            with pytest.raises(ServerUnavailable, match="engine thread failed"):
                worker.call(lambda e: "alive").result(timeout=10)
        else:
            assert worker.call(lambda e: "alive").result(timeout=10) == "alive"
    finally:
        release.set()
        worker.stop()


def test_a_stop_right_after_a_search_was_cancelled_is_a_clean_stop() -> None:
    """A search whose caller gave up while the worker was busy, then a stop: the search is aborted and the stop is
    not reported as the engine thread's failure (answering the cancelled future would raise on that thread)."""
    import threading

    from infer.core.beam_search import BeamSearchParams

    engine, busy, release, fatal = ScriptedEngine(), threading.Event(), threading.Event(), []
    worker = EngineWorker(engine, on_fatal=fatal.append)
    worker.start()
    reply = worker.beam_search(["x"], BeamSearchParams(max_tokens=10**6))
    worker.call(lambda e: busy.set() or release.wait(10))  # the worker is busy until released
    assert busy.wait(10) and engine.searches and reply.cancel()
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    # the stop, queued behind the busy call, is handled before the loop looks for cancelled searches
    wait_until(lambda: worker._inbox.qsize() == 1, "the stop to be queued")
    release.set()
    stopping.join(10)
    assert fatal == [] and engine.aborted_searches and not engine.searches


def test_a_failing_search_abort_is_logged_and_a_dying_search_start_gets_the_error(caplog) -> None:
    """An abort_beam_search that raises (a cancelled search) is logged and the worker keeps serving; a start
    that kills the engine thread answers its own BeamSearch with the fault rather than leave it hanging."""
    import logging
    import time

    from infer.core.beam_search import BeamSearchParams

    class FlakyEngine(ScriptedEngine):
        def abort_beam_search(self, search: ScriptedSearch) -> None:
            raise RuntimeError("abort failed")

        def start_beam_search(self, prompts: list[str | list[int]], params: Any) -> ScriptedSearch:
            if prompts == ["killer"]:
                raise SystemExit("a bug that escapes the worker's own error handling")
            return super().start_beam_search(prompts, params)

    engine = FlakyEngine()
    worker = EngineWorker(engine)
    worker.start()
    try:
        with caplog.at_level(logging.ERROR, logger="infer.server"):
            reply = worker.beam_search(["x"], BeamSearchParams(max_tokens=10**6))
            for _ in range(500):
                if engine.searches:
                    break
                time.sleep(0.01)
            assert reply.cancel()
            for _ in range(500):
                if "abort of a beam search failed" in caplog.text:
                    break
                time.sleep(0.01)
            assert "abort of a beam search failed" in caplog.text
            assert worker.call(lambda e: "alive").result(timeout=10) == "alive"
        with pytest.raises(Exception, match="engine thread failed"):
            worker.beam_search(["killer"], BeamSearchParams(max_tokens=2)).result(timeout=10)
    finally:
        worker.stop()


def test_the_size_a_delta_adds_once_merged_counts_its_calls() -> None:
    """merged_share, which the size checks add up, is at least what merging a delta into its completion adds to the
    message (the reference: protobuf's own ByteSize), for a delta of calls (entries come with their framing; a
    field's own framing comes once per completion, outside merged_share)."""
    from infer.server.servicer import merged_share

    call = pb.ToolCall(id="call_1", name="lookup", arguments='{"city": "Oslo"}')
    for part in (pb.Completion(new_tool_calls=[call] * 3), pb.Completion(tool_calls=[call] * 3)):
        full = pb.Completion(index=0, text="t")
        before = full.ByteSize()
        full.tool_calls.extend(part.tool_calls)
        full.new_tool_calls.extend(part.new_tool_calls)
        assert 0 < full.ByteSize() - before <= merged_share(part), part


def test_usage_counts_the_tokens_of_steps_that_emit_several() -> None:
    """Complete's usage counted one token per delta: a step of accepted speculative tokens (three here) was one."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        done = await client.complete("burst", max_tokens=4)
        assert list(done.outputs[0].token_ids) == [7] * 12 and done.usage.completion_tokens == 12
        streamed = await collect(client.generate("burst", max_tokens=4))
        assert sum(len(r.outputs[0].token_ids) for r in streamed) == 12 == streamed[-1].usage.completion_tokens

    serve_scripted(test)


def test_a_request_id_is_taken_while_its_request_runs_and_free_once_it_ends() -> None:
    """A beam search may not take the id of a running request (Abort would pick one of them); once the request is
    cancelled, finished or failed, the id is free again (the worker used to keep the stream of a cancelled one)."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        call = client.generate("long", request_id="g1", max_tokens=10**6)
        await call.read()
        code, details = await rpc_code(client.beam_search("x", request_id="g1", max_tokens=2))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and "request id 'g1' is already in use" in details
        call.cancel()
        await until(lambda: "g1" in engine.aborted, "the cancelled request's abort")
        await client.complete("x", request_id="done", max_tokens=2)
        code, _ = await rpc_code(client.complete("crash-in-step", request_id="failed", max_tokens=2))
        assert code is grpc.StatusCode.INTERNAL
        for rid in ("g1", "done", "failed"):
            result = await client.beam_search("x", request_id=rid, max_tokens=2)
            assert [list(b.token_ids) for b in result.beams] == [[7, 7]]

    serve_scripted(test)


def test_cancelling_a_refused_duplicate_leaves_the_request_of_that_id_running() -> None:
    """A request refused because its id is in use, whose call ended before it read the refusal, sends a cancel for
    that id: it must not abort the other request, the one that holds the id."""
    from infer.server.streams import RequestStream

    class UniqueIds(ScriptedEngine):  # as Engine.add_request
        def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                        request_id: str | None = None, arrival_time: float | None = None) -> str:
            if request_id in self.requests:
                raise InvalidRequestError(f"request id {request_id!r} is already in use")
            return super().add_request(prompt, params, request_id)

    async def main() -> None:
        engine = UniqueIds()
        worker = EngineWorker(engine)
        worker.start()
        try:
            holder, duplicate = RequestStream("x"), RequestStream("x")
            worker.submit("first", SamplingParams(max_tokens=10**6), holder)
            await asyncio.wait_for(holder.__anext__(), 10)
            worker.submit("second", SamplingParams(max_tokens=3), duplicate)
            worker.cancel(duplicate)  # its call ended (deadline, cancel) before it read the refusal
            with pytest.raises(InvalidRequestError, match="request id 'x' is already in use"):
                await asyncio.wait_for(duplicate.__anext__(), 10)
            await asyncio.wrap_future(worker.call(lambda e: None))  # the cancel has been handled
            assert engine.aborted == [] and "x" in engine.requests
            assert not (await asyncio.wait_for(holder.__anext__(), 10)).finished  # still streaming
        finally:
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())


def test_commands_queued_behind_the_stop_are_refused_and_cancelled_calls_never_run() -> None:
    """What comes in while the worker stops is refused (UNAVAILABLE, shutting down), not left hanging, even behind
    commands nobody waits for any more; a call whose caller gave up while it waited is not run at all (a LoRA load
    whose caller timed out in the queue does not load)."""
    import threading

    from infer.server.streams import RequestStream
    from infer.server.worker import ServerUnavailable

    async def main() -> None:
        engine, busy, release, ran = ScriptedEngine(), threading.Event(), threading.Event(), []
        worker = EngineWorker(engine)
        worker.start()
        try:
            worker.call(lambda e: busy.set() or release.wait(10))  # the worker is busy until released
            await asyncio.to_thread(busy.wait, 10)
            given_up = worker.call(lambda e: ran.append("given up"))
            assert given_up.cancel()
            stopping = asyncio.ensure_future(asyncio.to_thread(worker.stop))
            await until(lambda: worker._inbox.qsize() == 2, "the stop to be queued")  # behind the given-up call
            assert worker.call(lambda e: ran.append("late, given up")).cancel()  # refusing these two raises
            worker.submit("orphan", SamplingParams(max_tokens=2), await asyncio.to_thread(closed_loop_stream, "orphan"))
            late_call, late_stream = worker.call(lambda e: ran.append("late")), RequestStream("late")
            worker.submit("late", SamplingParams(max_tokens=2), late_stream)
            release.set()
            await asyncio.wait_for(stopping, 10)
            with pytest.raises(ServerUnavailable):
                late_call.result(timeout=5)
            after = RequestStream("after")
            worker.submit("after", SamplingParams(max_tokens=2), after)
            for stream in (late_stream, after):
                with pytest.raises(ServerUnavailable, match="shutting down"):
                    await asyncio.wait_for(stream.__anext__(), 5)
            assert ran == [] and engine.events == []
        finally:
            release.set()
            await asyncio.to_thread(worker.stop)

    asyncio.run(main())


def test_a_reader_gets_the_deltas_before_an_error_then_the_error() -> None:
    """Deltas queued ahead of an error (a step that failed after some tokens) merge and come first; the error
    comes next and ends the stream."""
    from infer.server.streams import RequestStream

    async def main() -> None:
        stream = RequestStream("r")
        for token in (5, 6):
            stream.put(RequestOutput("r", [1], [CompletionOutput(0, [token], "x", None)], False))
        stream.put(PluginError("scheduler 'scripted' scheduled nothing"))
        first = await asyncio.wait_for(stream.__anext__(), 5)
        assert first.outputs[0].token_ids == [5, 6] and not first.finished
        with pytest.raises(PluginError, match="scheduled nothing"):
            await asyncio.wait_for(stream.__anext__(), 5)
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(stream.__anext__(), 5)

    asyncio.run(main())


def test_usage_reports_the_prefix_cached_tokens_as_offline(tiny_model: Any) -> None:
    """Usage.cached_tokens is the engine's num_cached_tokens: the same two requests on a fresh engine, offline."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    config = EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, block_size=4)
    prompt, params = list(range(5, 31)), SamplingParams(max_tokens=3, temperature=0.0)
    offline = Engine(config)
    want = [offline.generate([prompt], params)[0] for _ in range(3)]
    assert want[0].num_cached_tokens == 0 < want[1].num_cached_tokens

    async def test(client: AsyncClient, engine: Any) -> None:
        for expected in want[:2]:
            done = await client.complete(prompt, params)
            assert (done.usage.prompt_tokens, done.usage.cached_tokens) == (len(prompt), expected.num_cached_tokens)
        streamed = await collect(client.generate(prompt, params))
        assert streamed[-1].usage.cached_tokens == want[2].num_cached_tokens

    serve_scripted(test, engine=Engine(config))


def test_stats_ratios_rates_and_uptime_are_the_engines(tiny_model: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """GetStats' kv_usage is used / total blocks, output_tokens_per_s the engine's output tokens (every completion's)
    over the 10 s window, uptime_s the seconds since the server started."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.server import worker as worker_module
    from infer.server.snapshot import THROUGHPUT_WINDOW_S, Throughput

    # a server up for a whole window already: the rate is the window's tokens over exactly THROUGHPUT_WINDOW_S
    monkeypatch.setattr(worker_module, "Throughput",
                        lambda: Throughput(started=time.monotonic() - THROUGHPUT_WINDOW_S))
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, block_size=4))

    async def test(client: AsyncClient, engine: Engine) -> None:
        done = await client.complete("count me", n=2, max_tokens=8, temperature=0.0, ignore_eos=True)
        assert done.usage.completion_tokens == 16
        stats = await client.stats()
        assert stats.output_tokens == 16
        assert stats.output_tokens_per_s == pytest.approx(16 / THROUGHPUT_WINDOW_S)
        call = client.generate("hold blocks", max_tokens=200, temperature=0.0, ignore_eos=True)
        await call.read()
        stats = await client.stats()
        assert 0 < stats.kv_used_blocks < stats.kv_total_blocks
        assert stats.kv_usage == pytest.approx(stats.kv_used_blocks / stats.kv_total_blocks)
        assert 0 < stats.uptime_s <= time.monotonic() - before
        call.cancel()

    before = time.monotonic()
    serve_scripted(test, engine=engine)


def test_a_draining_server_says_so_refuses_new_calls_and_ends_once_idle(tiny_model: Any) -> None:
    """Drain: GetStats (and /metrics) say draining, new calls get UNAVAILABLE, the stream in flight runs to its end,
    and the drain ends as soon as nothing is in flight, not at the end of the grace period."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.server.app import InferenceServer, ServeOptions

    config = EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = Engine(config).generate(["drain me"], params)[0].outputs[0].token_ids

    async def main() -> None:
        server = InferenceServer(Engine(config), ServeOptions(port=0, grace_period_s=60.0))
        port = await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                assert not (await client.stats()).draining
                call = client.generate("drain me", params)
                first = await call.read()
                draining = asyncio.ensure_future(server.drain())
                await until(lambda: server.servicer.draining, "the drain to begin")
                stats = await client.stats()
                assert stats.draining and stats.in_flight == 1
                code, details = await rpc_code(client.complete("too late", max_tokens=2))
                assert code is grpc.StatusCode.UNAVAILABLE and "shutting down" in details
                rest = []
                while (response := await call.read()) is not grpc.aio.EOF:
                    rest.append(response)
                assert [t for r in (first, *rest) for t in r.outputs[0].token_ids] == want
                assert rest[-1].outputs[0].finish_reason == pb.FINISH_REASON_LENGTH
                await asyncio.wait_for(draining, 15)  # idle: done long before the 60 s grace period
        finally:
            await server.close(grace=0.0)

    asyncio.run(main())


def test_the_size_a_delta_adds_once_merged_counts_every_field() -> None:
    """merged_share is at least what merging a delta adds to its completion (protobuf's ByteSize the reference):
    token id 0 takes a byte as any other, and the reasoning and content text of a parsed reply count too."""
    from infer.server.servicer import merged_share

    for part in (pb.Completion(token_ids=[0] * 50), pb.Completion(token_ids=[0, 1, 300, 2**40]),
                 pb.Completion(reasoning_text="thinking " * 10, content_text="answer " * 15),
                 pb.Completion(content="c" * 100, reasoning_content="r" * 100)):
        full = pb.Completion(index=0, token_ids=[1], text="t", content="", reasoning_content="", reasoning_text="",
                             content_text="")  # each field's own framing is there already
        before = full.ByteSize()
        full.token_ids.extend(part.token_ids)
        full.content += part.content
        full.reasoning_content += part.reasoning_content
        full.reasoning_text += part.reasoning_text
        full.content_text += part.content_text
        assert 0 < full.ByteSize() - before <= merged_share(part), part


def test_an_internal_error_without_a_message_names_its_type_and_is_logged(caplog) -> None:
    """An unexpected exception with no message answers INTERNAL with its type, not empty details, and the server logs
    it with its traceback."""
    import logging

    class BareErrors(ScriptedEngine):
        def abort(self, request_id: str) -> RequestOutput:
            if request_id == "bare":
                raise RuntimeError()
            return super().abort(request_id)

    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(client.abort("bare"))
        assert (code, details) == (grpc.StatusCode.INTERNAL, "internal error: RuntimeError")

    with caplog.at_level(logging.ERROR, logger="infer.server"):
        serve_scripted(test, engine=BareErrors())
    assert [r.exc_info[0] for r in caplog.records if r.getMessage() == "internal error: internal error: RuntimeError"
            and r.exc_info] == [RuntimeError], caplog.text


def test_a_structured_output_of_no_kind_is_invalid_argument() -> None:
    """A StructuredOutput message that sets none of its kinds is refused by name, not an internal error."""
    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        request = pb.GenerateRequest(text="x", params=pb.SamplingParams(structured_output=pb.StructuredOutput()))
        code, details = await rpc_code(client.stub.Complete(request))
        assert code is grpc.StatusCode.INVALID_ARGUMENT and details.startswith(
            "invalid sampling parameters: structured_output sets none of regex, choice, json_schema and grammar")
        assert engine.events == []

    serve_scripted(test)


def test_a_complete_response_past_the_limit_is_stopped_as_it_grows() -> None:
    """A Complete response that will not fit is refused while it grows, the request aborted, rather than run to its
    end first; the request id counts toward the size (~810 bytes of tokens and a 256-character id: past 1024)."""
    class Paced(ScriptedEngine):  # a step takes a while, as a model's does: the reader keeps up
        def step(self) -> list[RequestOutput]:
            time.sleep(0.005)
            return super().step()

    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        code, details = await rpc_code(client.complete("x", max_tokens=400, request_id="r" * 256))
        assert code is grpc.StatusCode.FAILED_PRECONDITION and "use Generate" in details, details
        await until(lambda: not engine.requests, "the refused request to go")
        assert engine.aborted == ["r" * 256]  # stopped before its 400th token

    serve_scripted(test, max_message_bytes=1024, engine=Paced())


def test_beam_search_fields_reach_the_engine_and_unset_ones_take_the_defaults() -> None:
    """The engine starts each search with the BeamSearchParams the request gave (ignore_eos included); unset
    fields are BeamSearchParams' defaults."""
    from infer.core.beam_search import BeamSearchParams
    from infer.server.client import build_beam_request
    from infer.server.convert import beam_params_of

    assert beam_params_of(pb.BeamSearchRequest(text="x")) == BeamSearchParams()
    explicit = dict(beam_width=3, max_tokens=5, length_penalty=0.5, ignore_eos=True, lora_adapter="sql")
    assert beam_params_of(build_beam_request("x", **explicit)) == BeamSearchParams(**explicit)
    for bad in ({"beam_witdh": 2}, {"beam_width": "2"}, {"max_tokens": 2**40}):  # the proto refuses each
        with pytest.raises(InvalidRequestError, match="they are beam_width, max_tokens, length_penalty, ignore_eos"):
            build_beam_request("x", **bad)

    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        await client.beam_search("x", beam_width=2, max_tokens=3, ignore_eos=True)
        await client.beam_search("x", max_tokens=2)
        assert [s.params for s in done] == [
            BeamSearchParams(beam_width=2, max_tokens=3, ignore_eos=True), BeamSearchParams(max_tokens=2)]

    done: list[ScriptedSearch] = []
    engine = ScriptedEngine()
    start = engine.start_beam_search
    engine.start_beam_search = lambda prompts, params: done.append(start(prompts, params)) or done[-1]  # type: ignore
    serve_scripted(test, engine=engine)


def test_a_stop_token_ends_a_reply_with_stop_as_offline(tiny_model: Any) -> None:
    """A completion that ends at a stop token has finish reason STOP over gRPC, as offline (both calls)."""
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine

    config = EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64)
    offline = Engine(config)
    free = offline.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    params = SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=(free.outputs[0].token_ids[3],))
    want = offline.generate(["def main():"], params)[0].outputs[0]
    assert want.finish_reason is FinishReason.STOP

    async def test(client: AsyncClient, engine: Any) -> None:
        done = await client.complete("def main():", params)
        streamed = await collect(client.generate("def main():", params))
        for completion in (done.outputs[0], streamed[-1].outputs[0]):
            assert completion.finish_reason == pb.FINISH_REASON_STOP
        assert list(done.outputs[0].token_ids) == want.token_ids

    serve_scripted(test, engine=Engine(config))


def test_tool_call_arguments_travel_as_the_json_text_the_cli_prints() -> None:
    """A call's arguments are the JSON text `infer generate --json` prints for it, non-ASCII text kept as is."""
    import json

    from infer.cli.main import _completion_json
    from infer.core.chat_tools import ToolCall
    from infer.server.convert import completion_to_proto

    out = CompletionOutput(0, [7], "t", FinishReason.STOP, content="",
                           tool_calls=[ToolCall("weather", {"city": "Zürich", "note": "☀ 20°"}, "call_1")])
    printed = _completion_json(0, "p", RequestOutput("r", [1], [out], True), out)["tool_calls"]
    [call] = completion_to_proto(out).tool_calls
    assert (call.id, call.name, call.arguments) == ("call_1", "weather", printed[0]["function"]["arguments"])
    assert "Zürich" in call.arguments and json.loads(call.arguments) == {"city": "Zürich", "note": "☀ 20°"}
