"""The gRPC server under what production sends it, in-process over the tiny checkpoint: storms of cancels, deadlines,
disconnects, duplicate ids and aborts beside beam searches; inputs at and past the limits; shutdown by signals.
After each, every call ended with the status docs/serving.md gives it, nothing runs, the KV pool drained, and the
server still answers a greedy request with the offline engine's tokens."""
from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking (a dependency of infer-engine; "
                    "the GPU image lacks it)")

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import InvalidRequestError, NotFoundError  # noqa: E402
from infer.core.request import FinishReason, SamplingParams, StructuredOutput  # noqa: E402
from infer.server import infer_pb2 as pb  # noqa: E402
from infer.server import infer_pb2_grpc as pb_grpc  # noqa: E402
from infer.server.app import InferenceServer, ServeOptions  # noqa: E402
from infer.server.client import AsyncClient  # noqa: E402
from infer.server.worker import EngineWorker  # noqa: E402

from test_server_worker import ScriptedEngine, rpc_code, serve_scripted, wait_until  # noqa: E402

MAX_MESSAGE = 64 * 1024
PROBE = "still serving?"
PROBE_PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
SHUTTING_DOWN = "the server is shutting down and aborted the request"


@pytest.fixture(scope="module")
def probe_tokens(tiny_model: Path) -> list[int]:
    """The offline engine's greedy tokens for PROBE: what a server whose KV pool and cache survived intact answers."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    return engine.generate([PROBE], PROBE_PARAMS)[0].outputs[0].token_ids


async def assert_idle_and_serving(client: AsyncClient, server: InferenceServer, probe_tokens: list[int]) -> pb.Stats:
    """Once the aborts of the calls that ended have reached the engine: no request or beam search is left, every KV
    block is free or cached, and a greedy request gets the offline tokens. Returns the stats from before it."""
    for _ in range(500):
        stats = await client.stats()
        if not (stats.in_flight or stats.num_running or stats.queue_depth or stats.beam_searches):
            break
        await asyncio.sleep(0.02)
    assert (stats.in_flight, stats.num_running, stats.queue_depth, stats.beam_searches) == (0, 0, 0, 0), stats
    assert stats.kv_used_blocks == 0 and stats.kv_free_blocks + stats.kv_cached_blocks == stats.kv_total_blocks
    assert not await asyncio.wrap_future(server.worker.call(lambda engine: engine.has_unfinished()))
    out = await client.complete(PROBE, PROBE_PARAMS)
    assert list(out.outputs[0].token_ids) == probe_tokens
    return stats


def serve_engine(model: Path, probe_tokens: list[int], test: Callable[[AsyncClient, InferenceServer], Awaitable[None]],
                 **config: Any) -> pb.Stats:
    """Run ``test`` against `infer serve`'s server (64 KiB messages) over a real engine, then check that it is idle
    and serving; returns the stats once idle."""
    engine = Engine(EngineConfig(model=str(model), device="cpu", **config))

    async def main() -> pb.Stats:
        server = InferenceServer(engine, ServeOptions(port=0, max_message_bytes=MAX_MESSAGE))
        port = await server.start()
        try:
            async with AsyncClient(f"127.0.0.1:{port}") as client:
                await asyncio.wait_for(test(client, server), 60)
                return await assert_idle_and_serving(client, server, probe_tokens)
        finally:
            await server.close(grace=0.0)

    return asyncio.run(main())


async def read_all(call: Any) -> tuple[grpc.StatusCode, str, list[pb.GenerateResponse]]:
    """A Generate call's status, its details and the responses before it."""
    responses = []
    try:
        while (response := await call.read()) is not grpc.aio.EOF:
            responses.append(response)
    except grpc.aio.AioRpcError as exc:
        return exc.code(), exc.details(), responses
    return grpc.StatusCode.OK, "", responses


async def rpc_outcome(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as exc:
        return exc.code()
    return grpc.StatusCode.OK


def test_a_storm_of_cancels_deadlines_disconnects_duplicates_and_aborts_leaves_nothing_behind(
        tiny_model: Path, probe_tokens: list[int]) -> None:
    """Dozens of calls at once on a KV pool too small for them (so requests are preempted), beside beam searches:
    each ends with its documented status, and afterwards nothing runs and every block is back."""
    async def test(client: AsyncClient, server: InferenceServer) -> None:
        target = f"127.0.0.1:{server.port}"
        long = dict(max_tokens=1000, temperature=0.8, ignore_eos=True)  # what a call that ends early leaves

        async def cancel_after(i: int) -> None:
            call = client.generate(f"cancel {i} " + "w " * i, seed=i, **long)
            for _ in range(1 + i % 4):
                assert await call.read() is not grpc.aio.EOF
            call.cancel()
            assert await call.code() is grpc.StatusCode.CANCELLED

        async def deadline(i: int) -> None:
            code, _, _ = await read_all(client.generate(f"deadline {i}", timeout=0.05 * (1 + i % 4), **long))
            assert code is grpc.StatusCode.DEADLINE_EXCEEDED
            code, _ = await rpc_code(client.complete(f"deadline {i}", timeout=0.05 * (1 + i % 4), **long))
            assert code is grpc.StatusCode.DEADLINE_EXCEEDED

        async def to_the_end(i: int) -> None:
            code, _, responses = await read_all(client.generate(f"whole {i}", seed=i, **long | dict(max_tokens=200)))
            assert code is grpc.StatusCode.OK and sum(len(r.outputs[0].token_ids) for r in responses) == 200
            assert responses[-1].outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH

        async def disconnect(i: int) -> None:  # the client goes away without reading the rest or cancelling
            channel = grpc.aio.insecure_channel(target)
            call = pb_grpc.InferenceStub(channel).Generate(pb.GenerateRequest(
                text=f"gone {i}", params=pb.SamplingParams(max_tokens=1000, ignore_eos=True)))
            assert await call.read() is not grpc.aio.EOF
            await channel.close(None)

        async def duplicate(i: int) -> None:
            calls = [client.generate("twice", request_id=f"dup-{i}", max_tokens=20, ignore_eos=True) for _ in range(2)]
            outcomes = sorted(await asyncio.gather(*map(read_all, calls)), key=lambda o: o[0].value[0])
            (ok, _, responses), (refused, details, _) = outcomes
            assert (ok, refused) == (grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT)
            assert sum(len(r.outputs[0].token_ids) for r in responses) == 20
            assert details == f"request id 'dup-{i}' is already in use"

        async def aborted(i: int) -> None:
            call = client.generate("abort me", request_id=f"abort-{i}", **long)
            assert await call.read() is not grpc.aio.EOF
            aborts = await asyncio.gather(*(rpc_outcome(client.abort(rid))
                                            for rid in (f"abort-{i}", f"abort-{i}", f"never-{i}")))
            assert sorted(aborts[:2], key=lambda code: code.value[0]) == [grpc.StatusCode.OK, grpc.StatusCode.NOT_FOUND]
            assert aborts[2] is grpc.StatusCode.NOT_FOUND
            code, _, responses = await read_all(call)
            assert code is grpc.StatusCode.OK and responses[-1].finished
            assert responses[-1].outputs[-1].finish_reason == pb.FINISH_REASON_ABORT
            await client.complete("done", request_id=f"finished-{i}", max_tokens=2)
            assert await rpc_outcome(client.abort(f"finished-{i}")) is grpc.StatusCode.NOT_FOUND

        async def beam_search(i: int) -> None:
            search = asyncio.ensure_future(client.beam_search("x = [", request_id=f"beam-{i}", beam_width=2,
                                                              max_tokens=300, ignore_eos=True))
            while not (await client.stats()).beam_searches:
                await asyncio.sleep(0.01)
            await client.abort(f"beam-{i}")
            result = await search
            assert {b.finish_reason for b in result.beams} == {pb.FINISH_REASON_ABORT}
            code, _ = await rpc_code(client.beam_search("x", beam_width=2, max_tokens=300, ignore_eos=True,
                                                        timeout=0.1))
            assert code is grpc.StatusCode.DEADLINE_EXCEEDED

        kinds = [cancel_after, deadline, to_the_end, disconnect, duplicate, aborted]
        await asyncio.gather(*(kind(i) for i in range(8) for kind in kinds), beam_search(0))

    stats = serve_engine(tiny_model, probe_tokens, test, num_kv_blocks=64)
    assert stats.preemptions > 0  # the pool was short: requests were preempted and resumed
    assert stats.output_tokens < 16_000  # run to their end, the 40 calls that ended early would have made 40,000


def test_inputs_at_and_past_the_limits_get_their_documented_status(tiny_model: Path, probe_tokens: list[int]) -> None:
    """A request of exactly --max-message-bytes is read (the engine refuses its prompt), one byte more is
    RESOURCE_EXHAUSTED; token ids at int64's ends, and a prompt and stop strings of control characters, combining
    marks, emoji sequences and noncharacters, reach the engine as sent (its message, or its offline output)."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    unicode_prompt = "\x00\u202e\ufeffe\u0301 \U0001F469\u200d\U0001F469\u200d\U0001F467 \uffff\U0010ffff"
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    unstopped = engine.generate([unicode_prompt], greedy)[0].outputs[0].text
    unicode_params = replace(greedy, stop=("e\u0301\U0001F600", "\x00\ufeff", unstopped[6:8]))
    offline = engine.generate([unicode_prompt], unicode_params)[0].outputs[0]
    assert offline.finish_reason is FinishReason.STOP and len(offline.token_ids) < 12

    def engine_message(prompt: Any, params: SamplingParams) -> str:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(prompt, params)
        return str(info.value)

    async def test(client: AsyncClient, server: InferenceServer) -> None:
        empty = pb.GenerateRequest(text="", params=pb.SamplingParams(max_tokens=2)).ByteSize()
        at_limit = "a" * (MAX_MESSAGE - empty - 2)  # its length takes a varint of 3 bytes, not the empty text's 1
        request = pb.GenerateRequest(text=at_limit, params=pb.SamplingParams(max_tokens=2))
        assert request.ByteSize() == MAX_MESSAGE
        code, details = await rpc_code(client.stub.Complete(request))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                                   engine_message(at_limit, SamplingParams(max_tokens=2)))
        request.text += "a"
        code, _ = await rpc_code(client.stub.Complete(request))
        assert code is grpc.StatusCode.RESOURCE_EXHAUSTED
        for ids in ([-(2**63)], [2**63 - 1], [5, -1]):
            code, details = await rpc_code(client.complete(ids, max_tokens=2))
            assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT,
                                       engine_message(ids, SamplingParams(max_tokens=2)))
        for call in (client.complete(unicode_prompt, unicode_params),
                     collect_completion(client.generate(unicode_prompt, unicode_params))):
            got = (await call).outputs[0]
            assert (list(got.token_ids), got.text) == (offline.token_ids, offline.text)
            assert got.finish_reason == pb.FINISH_REASON_STOP

    serve_engine(tiny_model, probe_tokens, test)


async def collect_completion(call: Any) -> pb.CompleteResponse:
    """A Generate call's deltas joined as Complete returns them (one completion)."""
    code, details, responses = await read_all(call)
    assert code is grpc.StatusCode.OK, details
    joined = pb.Completion()
    for response in responses:
        joined.token_ids.extend(response.outputs[0].token_ids)
        joined.text += response.outputs[0].text
        joined.finish_reason = response.outputs[0].finish_reason
    return pb.CompleteResponse(outputs=[joined])


def test_logits_processor_arguments_nested_past_the_json_parsers_reach_are_invalid_argument() -> None:
    """JSON nested deeper than Python's parser recurses raised RecursionError while the request was read: INTERNAL
    (logged as a server fault) for a malformed request, and the same crash offline."""
    deep = '{"a":' * 5000 + "1" + "}" * 5000
    with pytest.raises(InvalidRequestError) as offline:
        SamplingParams(max_tokens=2, logits_processors=[("no-repeat-ngram", deep)]).validate()
    assert "nest too deeply" in str(offline.value)
    for depth, refused in ((32, False), (33, True)):  # within the parser's reach, a processor's own limit
        nested = '{"a":' + "[" * (depth - 1) + "1" + "]" * (depth - 1) + "}"
        params = SamplingParams(max_tokens=2, logits_processors=[("no-repeat-ngram", nested)])
        if refused:
            with pytest.raises(InvalidRequestError, match="'no-repeat-ngram' nest 33 objects and arrays deep, over "
                                                          "32; flatten them"):
                params.validate()
        else:
            params.validate()

    async def test(client: AsyncClient, engine: ScriptedEngine) -> None:
        request = pb.GenerateRequest(text="hi", params=pb.SamplingParams(
            max_tokens=2, logits_processors=[pb.LogitsProcessorCall(name="no-repeat-ngram", args_json=deep)]))
        assert await rpc_code(client.stub.Complete(request)) == (grpc.StatusCode.INVALID_ARGUMENT, str(offline.value))
        code, details, _ = await read_all(client.stub.Generate(request))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, str(offline.value))

    serve_scripted(test)


def test_a_json_schema_whose_numbers_python_will_not_read_is_invalid_argument(tiny_model: Path,
                                                                             probe_tokens: list[int]) -> None:
    """A bound of more digits than Python converts (4,300) failed json.loads with a ValueError that is no
    JSONDecodeError: the fsm backend let it out, and the engine reported a broken plugin (FAILED_PRECONDITION)
    for a malformed request."""
    from infer.plugins.json_schema_regex import schema_to_regex

    schema = '{"type": "integer", "minimum": ' + "9" * 5000 + "}"
    with pytest.raises(InvalidRequestError) as direct:
        schema_to_regex(schema)
    assert str(direct.value) == ("invalid JSON schema: at the root: an integer in it has more than "
                                 f"{sys.get_int_max_str_digits()} digits; write it shorter (no schema needs such a "
                                 "bound)")

    async def test(client: AsyncClient, server: InferenceServer) -> None:
        code, details = await rpc_code(client.complete("hi", max_tokens=4, structured_output=StructuredOutput(
            json_schema=schema)))
        assert (code, details) == (grpc.StatusCode.INVALID_ARGUMENT, str(direct.value))

    serve_engine(tiny_model, probe_tokens, test)


def test_a_second_abort_of_a_beam_search_is_not_found_as_a_requests_is() -> None:
    """Two Aborts of one search handled in the same round of the engine thread (an abort storm) both answered OK:
    the search was stopped but not yet answered, so the second found it still listed."""
    from infer.core.beam_search import BeamSearchParams

    engine, release = ScriptedEngine(), threading.Event()
    worker = EngineWorker(engine)
    worker.start()
    try:
        search = worker.beam_search(["x"], BeamSearchParams(max_tokens=10**6), "s1")
        wait_until(lambda: bool(engine.searches), "the search to start")
        worker.call(lambda e: release.wait(10))  # holds the worker so that both aborts come in one round
        first, second = worker.abort("s1"), worker.abort("s1")
        release.set()
        assert first.result(timeout=10) is None
        with pytest.raises(NotFoundError, match="unknown request id 's1'"):
            second.result(timeout=10)
        wait_until(search.done, "the aborted search's answer")
        assert len(engine.aborted_searches) == 1
    finally:
        release.set()
        worker.stop()


def test_sigint_drains_like_sigterm_and_a_second_one_ends_what_is_left_at_once(tiny_model: Path) -> None:
    """`infer serve`'s signals (InferenceServer.run): the first SIGINT turns health NOT_SERVING and refuses new
    calls while the streams in flight go on and GetStats answers; the second ends the streams and the beam search
    in flight with UNAVAILABLE saying why, long before the 60 s grace period, and leaves the engine with nothing
    running and every KV block free."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    server = InferenceServer(engine, ServeOptions(port=0, grace_period_s=60.0))

    async def main() -> None:
        ready = asyncio.Event()
        running = asyncio.ensure_future(server.run(lambda started: ready.set()))
        await asyncio.wait_for(ready.wait(), 30)
        async with AsyncClient(f"127.0.0.1:{server.port}") as client:
            calls = [client.generate(f"drain {i}", max_tokens=900, ignore_eos=True) for i in range(3)]
            for call in calls:
                assert await call.read() is not grpc.aio.EOF
            search = asyncio.ensure_future(client.beam_search("x", beam_width=2, max_tokens=900, ignore_eos=True))
            while not (await client.stats()).beam_searches:
                await asyncio.sleep(0.01)
            os.kill(os.getpid(), signal.SIGINT)
            while await client.health() != "NOT_SERVING":
                await asyncio.sleep(0.01)
            code, details = await rpc_code(client.complete("too late", max_tokens=2))
            assert code is grpc.StatusCode.UNAVAILABLE and "accepts no new requests" in details
            stats = await client.stats()
            assert stats.draining and stats.in_flight == 4 and stats.beam_searches == 1
            assert await calls[0].read() is not grpc.aio.EOF  # still streaming
            started = time.monotonic()
            os.kill(os.getpid(), signal.SIGINT)
            for call in calls:
                code, details, _ = await read_all(call)
                assert code is grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in details
            code, details = await rpc_code(search)
            assert code is grpc.StatusCode.UNAVAILABLE and SHUTTING_DOWN in details
            await asyncio.wait_for(running, 30)
            assert time.monotonic() - started < 10

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    signal.signal(signal.SIGINT, lambda *args: None)  # a server that ignored SIGINT fails the test, not pytest
    try:
        asyncio.run(asyncio.wait_for(main(), 30))
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert not engine.has_unfinished() and engine.kv.stats().used_blocks == 0
