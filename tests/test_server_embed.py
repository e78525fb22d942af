"""The Embed RPC against an in-process `infer serve` on 127.0.0.1 (one for the module), driven by the real clients
and `infer client embed`: its vectors equal ``Engine.embed``'s, its errors are the engine's, it runs beside a
stream, and a cancelled or aborted call frees its KV blocks.

The served engine computes prompts in 4-token chunks, so that a 300-token prompt takes about 75 steps: long enough
for a test to pause the engine thread while the embedding is under way."""
from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking (a dependency of infer-engine; "
                    "the GPU image lacks it)")

from infer.core.config import EngineConfig  # noqa: E402
from infer.core.engine import Engine  # noqa: E402
from infer.core.errors import InvalidRequestError  # noqa: E402
from infer.core.pooling import PoolingParams  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from conftest import LoopThread, serving  # noqa: E402
from infer.server.app import InferenceServer  # noqa: E402
from infer.server import infer_pb2 as pb  # noqa: E402
from infer.server.client import AsyncClient, Client, build_embed_request  # noqa: E402

ENGINE = dict(device="cpu", num_kv_blocks=64, max_model_len=512, scheduler="chunked-prefill",
              max_num_batched_tokens=4)
LONG_PROMPT = list(range(3, 303))  # 75 steps of 4 tokens: the embedding a test catches under way


@dataclass
class Served:
    server: InferenceServer
    engine: Engine
    loop: asyncio.AbstractEventLoop

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.server.port}"

    def client(self) -> Client:
        return Client(self.target)


@pytest.fixture(scope="module")
def served(tiny_model: Path) -> Iterator[Served]:
    """One server for the module, its event loop on a thread of its own (the tests' clients block)."""
    engine = Engine(EngineConfig(model=str(tiny_model), **ENGINE))
    loops = LoopThread()
    try:
        with serving(engine, loops) as server:
            yield Served(server, engine, loops.loop)
    finally:
        loops.stop()


@pytest.fixture(scope="module")
def reference(tiny_model: Path) -> Engine:
    """An engine configured as the served one, run offline."""
    return Engine(EngineConfig(model=str(tiny_model), **ENGINE))


@pytest.fixture
def client(served: Served) -> Iterator[Client]:
    with served.client() as c:
        yield c


def rpc_error(call: Callable[[], Any]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value


def refusal(fn: Callable[[], Any]) -> str:
    with pytest.raises(InvalidRequestError) as info:
        fn()
    return str(info.value)


@dataclass
class Pause:
    """What the engine thread saw when it paused: the request's id still live, and the KV blocks in use."""

    live: bool
    used_blocks: int


@contextmanager
def engine_paused(served: Served, request_id: str) -> Iterator[Pause]:
    """Hold the engine thread between two steps (a command that waits) until the block ends."""
    gate, reached = threading.Event(), threading.Event()
    seen: list[Pause] = []

    def hold(engine: Engine) -> None:
        seen.append(Pause(request_id in engine.requests, engine.kv.stats().used_blocks))
        reached.set()
        gate.wait(30)

    served.server.worker.call(hold)
    try:
        assert reached.wait(30), "the engine thread did not pause"
        yield seen[0]
    finally:
        gate.set()


def under_way(client: Client, timeout: float = 30.0) -> None:
    """Wait until a request holds KV blocks (its prompt partly computed)."""
    end = time.monotonic() + timeout
    while client.stats().kv_used_blocks == 0:
        assert time.monotonic() < end, "the embedding never got under way"
        time.sleep(0.005)


def after_pending_commands(served: Served) -> Future[tuple[bool, int]]:
    """What the engine thread reads once it has handled the commands queued so far (queued while it is paused:
    before its next step): whether any request is live, and the KV blocks in use."""
    return served.server.worker.call(lambda e: (bool(e.requests), e.kv.stats().used_blocks))


# ---------------------------------------------------------------- results
PROMPTS = {"text": "def add(a, b):\n    return a + b", "token-ids": [5, 17, 42, 99, 3, 250, 8, 8, 61]}
PARAMS = {"last": PoolingParams(pooling="last"), "mean": PoolingParams(pooling="mean"),
          "last-16-raw": PoolingParams(pooling="last", dimensions=16, normalize=False),
          "mean-8": PoolingParams(pooling="mean", dimensions=8), "default": PoolingParams()}


@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("params", list(PARAMS))
def test_an_embedding_over_grpc_equals_engine_embed(client: Client, reference: Engine, prompt: str,
                                                    params: str) -> None:
    one = PARAMS[params]
    [want] = reference.embed([PROMPTS[prompt]], one)
    got = client.embed(PROMPTS[prompt], pooling=one.pooling, normalize=one.normalize, dimensions=one.dimensions)
    assert want.embedding is not None and len(got) == len(want.embedding) == (one.dimensions or 64)
    assert got == pytest.approx(want.embedding, abs=1e-6)


def test_the_response_carries_the_id_and_the_usage(client: Client, reference: Engine) -> None:
    prompt = "import os\nimport sys\n" * 4
    [want] = reference.embed([prompt], PoolingParams(pooling="mean"))
    before = client.stats()
    first = client.stub.Embed(build_embed_request(prompt, pooling="mean", request_id="usage-1"))
    assert first.request_id == "usage-1" and first.finish_reason == pb.FINISH_REASON_STOP
    assert (first.usage.prompt_tokens, first.usage.completion_tokens, first.usage.cached_tokens) == (
        len(want.prompt_token_ids), 0, 0)
    again = client.stub.Embed(build_embed_request(prompt, pooling="last"))  # last pooling takes prefix hits
    assert len(again.request_id) == 32  # the server's own id
    assert 0 < again.usage.cached_tokens < len(want.prompt_token_ids)
    [offline_again] = reference.embed([prompt], PoolingParams(pooling="last"))
    assert again.usage.cached_tokens == offline_again.num_cached_tokens
    assert list(again.embedding) == pytest.approx(offline_again.embedding, abs=1e-6)
    after = client.stats()  # the two Embed calls, counted apart from the other requests
    assert after.embedding_requests_finished - before.embedding_requests_finished == 2
    assert after.requests_finished - before.requests_finished == 2 and after.output_tokens == before.output_tokens


def test_the_async_client_embeds_too(served: Served, reference: Engine) -> None:
    [want] = reference.embed(["async"], PoolingParams(pooling="mean", normalize=False))

    async def run() -> list[float]:
        async with AsyncClient(served.target) as c:
            return await c.embed("async", pooling="mean", normalize=False)

    assert asyncio.run(run()) == pytest.approx(want.embedding, abs=1e-6)


def test_embed_beside_a_streaming_generate_call(client: Client, reference: Engine) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    [generated] = reference.generate(["for i in range("], params)
    [embedded] = reference.embed(["beside a stream"], PoolingParams(pooling="mean"))
    stream = client.generate("for i in range(", params)
    first = next(stream)  # the stream is under way
    assert client.embed("beside a stream", pooling="mean") == pytest.approx(embedded.embedding, abs=1e-6)
    responses = [first, *stream]
    assert [t for r in responses for o in r.outputs for t in o.token_ids] == generated.outputs[0].token_ids
    assert responses[-1].finished


# ---------------------------------------------------------------- errors
def test_a_bad_pooling_name_is_invalid_argument_with_the_engines_message(client: Client) -> None:
    err = rpc_error(lambda: client.embed("hi", pooling="maxx"))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert err.details().startswith("unknown pooler 'maxx' (did you mean 'max'?); registered: first, last, max")
    err = rpc_error(lambda: client.embed("hi", pooling=""))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                           refusal(lambda: PoolingParams(pooling="")))
    err = rpc_error(lambda: client.embed("hi", dimensions=0))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                           refusal(lambda: PoolingParams(dimensions=0)))


def test_dimensions_past_the_hidden_size_are_the_engines_refusal(client: Client, reference: Engine) -> None:
    err = rpc_error(lambda: client.embed("hi", dimensions=65))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                           refusal(lambda: reference.embed(["hi"], PoolingParams(dimensions=65))))


def test_an_unknown_lora_adapter_gets_completes_status(client: Client) -> None:
    complete = rpc_error(lambda: client.complete("hi", max_tokens=2, lora_adapter="nope"))
    embed = rpc_error(lambda: client.embed("hi", lora_adapter="nope"))
    assert (embed.code(), embed.details()) == (complete.code(), complete.details())
    assert embed.code() is grpc.StatusCode.INVALID_ARGUMENT and "lora_adapter 'nope' is not loaded" in embed.details()


def test_a_prompt_too_long_is_invalid_argument(client: Client, reference: Engine) -> None:
    prompt = list(range(3, 3 + 512))  # the context length: one token too many to embed
    err = rpc_error(lambda: client.embed(prompt))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                           refusal(lambda: reference.embed([prompt])))
    assert "too long to embed" in err.details()
    truncated = client.embed(prompt, truncate=True)  # its first 511 tokens
    assert truncated == pytest.approx(reference.embed([prompt[:511]])[0].embedding, abs=1e-6)


def test_values_the_protocol_cannot_carry_are_refused_before_sending() -> None:
    with pytest.raises(InvalidRequestError, match="invalid embedding parameters .*dimensions is an integer in"):
        build_embed_request("hi", dimensions=-1)
    with pytest.raises(InvalidRequestError, match="priority one in"):
        build_embed_request("hi", priority=2**40)


# ---------------------------------------------------------------- cancel and abort
def test_cancelling_an_embed_call_aborts_it_and_frees_its_blocks(served: Served, client: Client) -> None:
    call = client.stub.Embed.future(build_embed_request(LONG_PROMPT, pooling="mean", request_id="cancel-me"))
    under_way(client)
    with engine_paused(served, "cancel-me") as seen:
        assert seen.live and seen.used_blocks > 0, "the embedding finished before the test could cancel it"
        call.cancel()
        end = time.monotonic() + 30
        while served.server.servicer.in_flight:  # the servicer closes the call: its cancel queues behind the pause
            assert time.monotonic() < end, "the servicer never closed the cancelled call"
            time.sleep(0.005)
        after_cancel = after_pending_commands(served)
    assert after_cancel.result(30) == (False, 0)  # aborted before the engine's next step
    assert call.cancelled()
    assert client.embed("still serving", pooling="last")  # and the server goes on


def test_an_abort_by_id_ends_the_call_as_complete_ends_an_aborted_request(served: Served, client: Client) -> None:
    call = client.stub.Embed.future(build_embed_request(LONG_PROMPT, pooling="mean", request_id="abort-me"))
    under_way(client)
    with engine_paused(served, "abort-me") as seen:
        assert seen.live, "the embedding finished before the test could abort it"
    client.abort("abort-me")
    response = call.result(30)  # status OK, as Complete answers an aborted request
    assert (response.request_id, list(response.embedding)) == ("abort-me", [])
    assert response.finish_reason == pb.FINISH_REASON_ABORT
    assert after_pending_commands(served).result(30) == (False, 0)
    err = rpc_error(lambda: client.abort("abort-me"))
    assert err.code() is grpc.StatusCode.NOT_FOUND


# ---------------------------------------------------------------- the command line
def run_cli(*args: str) -> Any:
    from click.testing import CliRunner

    from infer.cli import main

    return CliRunner().invoke(main, list(args))


def test_infer_client_embed(served: Served, reference: Engine) -> None:
    [want] = reference.embed(["hello"], PoolingParams(pooling="mean", normalize=False, dimensions=8))
    out = run_cli("client", "embed", "hello", "--target", served.target, "--pooling", "mean", "--no-normalize",
                  "--dimensions", "8", "--json")
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout) == pytest.approx(want.embedding, abs=1e-6)
    [default] = reference.embed(["hello"])
    out = run_cli("client", "embed", "hello", "--target", served.target)
    assert out.exit_code == 0, out.output
    shown = ", ".join(f"{v:.4f}" for v in default.embedding[:4])
    assert out.stdout == f"64 dimensions: [{shown}, ...]\n"
    out = run_cli("client", "embed", "hello", "--target", served.target, "--dimensions", "0")
    assert (out.exit_code, out.stdout) == (2, "") and "dimensions (--dimensions) must be a positive integer" in \
        out.stderr
    out = run_cli("client", "embed", "hello", "--target", served.target, "--lora-adapter", "nope")
    assert out.exit_code == 1 and out.stderr.startswith("Error: INVALID_ARGUMENT: lora_adapter 'nope' is not loaded")


def test_infer_client_still_generates_and_takes_a_prompt_named_like_a_command(served: Served,
                                                                              reference: Engine) -> None:
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    [want] = reference.generate(["embed"], params)  # `infer client embed` is the subcommand: `generate` sends it
    out = run_cli("client", "generate", "embed", "--target", served.target, "--max-tokens", "4", "--ignore-eos")
    assert (out.exit_code, out.stdout) == (0, "embed" + want.outputs[0].text + "\n"), out.output
    [want] = reference.generate(["x = "], params)
    out = run_cli("client", "x = ", "--target", served.target, "--max-tokens", "4", "--ignore-eos")
    assert (out.exit_code, out.stdout) == (0, "x = " + want.outputs[0].text + "\n"), out.output


def test_an_embedding_past_the_message_limit_says_what_to_change(tiny_model_factory: Callable[..., Path],
                                                                  serve_engine: Any) -> None:
    """A 512-wide model's vector takes 2,048 bytes, past a 1 KiB --max-message-bytes; 128 dimensions fit."""
    wide = Engine(EngineConfig(model=str(tiny_model_factory("llama", hidden_size=512, intermediate_size=256,
                                                            num_layers=1)), device="cpu", num_kv_blocks=16))
    [want] = wide.embed(["hi"], PoolingParams(dimensions=128))

    async def test(client: AsyncClient, port: int) -> None:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.embed("hi")
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert refused.value.details().startswith("the embedding (512 values, ")
        assert "past --max-message-bytes 1024, so Embed cannot send it; ask for fewer dimensions" in \
            refused.value.details()
        assert await client.embed("hi", dimensions=128) == pytest.approx(want.embedding, abs=1e-6)
        stats = await client.stats()
        assert stats.kv_used_blocks == 0 and stats.in_flight == 0

    serve_engine(wide, test, max_message_bytes=1024)
