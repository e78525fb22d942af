"""`infer serve` as real processes on 127.0.0.1, driven by real clients (ours, grpc-requests, curl-like HTTP).

Two servers start once for the module, in parallel: ``server`` (plaintext, a small step budget, --max-queue 80,
a 64 KiB message limit, metrics) and ``secure_server`` (TLS when openssl is present, a bearer token; its last test
SIGTERMs it). Runs in about a minute on 2 CPU cores.
"""
from __future__ import annotations

import asyncio
import json
import math
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking (a dependency of infer-engine; "
                    "the GPU image lacks it)")

from infer.core.errors import InferError  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from infer.server import infer_pb2 as pb  # noqa: E402
from infer.server.client import AsyncClient, Client  # noqa: E402

STEP_BUDGET = 512  # --max-num-batched-tokens of `server`: a longer prompt is a CapacityError
MAX_QUEUE = 80
MAX_MESSAGE = 64 * 1024
TOKEN = "s3cret-token"
STARTUP_TIMEOUT_S = 120.0


# ---------------------------------------------------------------- processes
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def infer_command() -> list[str]:
    exe = shutil.which("infer")
    return [exe] if exe else [sys.executable, "-P", "-c", "from infer.cli import main; main()"]


@dataclass
class ServerProcess:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path
    client_kwargs: dict[str, Any]
    http_port: int | None = None  # serve --http-port: OpenAI's HTTP API

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self, **overrides: Any) -> Client:
        return Client(self.target, **(self.client_kwargs | overrides))

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]

    def wait_serving(self) -> ServerProcess:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        with self.client() as c:
            while True:
                if self.proc.poll() is not None:
                    pytest.fail(f"infer serve exited with {self.proc.returncode}:\n{self.log_tail()}")
                try:
                    if c.health(timeout=1.0) == "SERVING":
                        return self
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline:
                    pytest.fail(f"infer serve not SERVING after {STARTUP_TIMEOUT_S} s:\n{self.log_tail()}")
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


def launch(model: Path, log: Path, group: list[str], serve: list[str], client_kwargs: dict[str, Any],
           cwd: Path | None = None) -> ServerProcess:
    port = free_port()
    with log.open("wb") as out:
        proc = subprocess.Popen([*infer_command(), "--model", str(model), *group, "serve", "--port", str(port),
                                 *serve], stdout=out, stderr=subprocess.STDOUT, cwd=cwd)
    return ServerProcess(proc, port, log, client_kwargs)


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path] | None:
    """A self-signed certificate for 127.0.0.1, or None without openssl."""
    if shutil.which("openssl") is None:
        return None
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    return cert, key


@pytest.fixture(scope="module")
def processes(tiny_model: Path, certs: tuple[Path, Path] | None,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """Both servers, launched together so that their start-up overlaps; always killed at the end."""
    logs = tmp_path_factory.mktemp("serve-logs")
    started: dict[str, ServerProcess] = {}
    try:
        started["plain"] = launch(
            tiny_model, logs / "plain.log", ["--max-num-batched-tokens", str(STEP_BUDGET)],
            ["--max-queue", str(MAX_QUEUE), "--max-message-bytes", str(MAX_MESSAGE),
             "--metrics-port", str(free_port())], {})
        tls = ["--tls-cert", str(certs[0]), "--tls-key", str(certs[1])] if certs else []
        http = free_port()
        started["secure"] = launch(Path(tiny_model.name), logs / "secure.log", [],  # relative to its cwd
                                   [*tls, "--token", TOKEN, "--grace-period", "30", "--http-port", str(http),
                                    "--served-model-name", "tiny-secure"],
                                   {"token": TOKEN, "root_certificates": certs[0] if certs else None},
                                   cwd=tiny_model.parent)
        started["secure"].http_port = http
        yield started
    finally:
        for p in started.values():
            p.kill()


@pytest.fixture(scope="module")
def server(processes: dict[str, ServerProcess], llm: Any) -> ServerProcess:
    return processes["plain"].wait_serving()  # the reference `llm` loads while the servers start


@pytest.fixture(scope="module")
def secure_server(processes: dict[str, ServerProcess]) -> ServerProcess:
    return processes["secure"].wait_serving()


@pytest.fixture(scope="module")
def llm(tiny_model: Path) -> Any:
    """The offline reference, configured like `server`."""
    from infer import LLM

    return LLM(model=str(tiny_model), max_num_batched_tokens=STEP_BUDGET)


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with server.client() as c:
        yield c


def wait_drained(c: Client, timeout: float = 15.0) -> pb.Stats:
    """Poll GetStats until nothing runs, waits or is in flight (aborts reach the engine asynchronously)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = c.stats()
        if stats.num_running == 0 and stats.queue_depth == 0 and stats.in_flight == 0:
            return stats
        if time.monotonic() > deadline:
            pytest.fail(f"the server did not drain: {stats}")
        time.sleep(0.05)


def assert_no_leak(stats: pb.Stats) -> None:
    assert stats.kv_used_blocks == 0
    assert stats.kv_free_blocks + stats.kv_cached_blocks == stats.kv_total_blocks


def tokens_of(responses: list[pb.GenerateResponse]) -> list[int]:
    return [t for r in responses for o in r.outputs for t in o.token_ids]


def rpc_error(call: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        result = call()
        if isinstance(result, grpc.Call) and hasattr(result, "__next__"):  # a stream: errors come when read
            list(result)
    return info.value


def assert_serves(c: Client) -> None:
    out = c.complete("still serving?", max_tokens=2, temperature=0.0)
    assert len(out.outputs[0].token_ids) == 2


# ---------------------------------------------------------------- generated code
def test_generated_code_matches_the_proto(tmp_path: Path) -> None:
    from importlib.metadata import version

    from infer.server import codegen, infer_pb2_grpc

    if version("grpcio-tools") != infer_pb2_grpc.GRPC_GENERATED_VERSION:
        pytest.skip(f"the committed code was generated by grpcio-tools {infer_pb2_grpc.GRPC_GENERATED_VERSION}")
    for fresh in codegen.generate(tmp_path):
        committed = codegen.PROTO.parent / fresh.name
        stale = f"{committed.name} is stale: run python -m infer.server.codegen"
        assert fresh.read_bytes() == committed.read_bytes(), stale


def test_sampling_params_round_trip_through_the_proto() -> None:
    from infer.server import infer_pb2 as pb
    from infer.server.convert import sampling_params_of, sampling_params_to_proto

    params = SamplingParams(max_tokens=9, temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, seed=4, stop=("x",),
                            stop_token_ids=(7,), ignore_eos=True, logprobs=2, prompt_logprobs=3, n=2,
                            speculative=False, priority=3, logit_bias={9: -1.5, 4: 2.0},
                            repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=-0.5, min_tokens=3,
                            include_stop_str_in_output=True,
                            logits_processors={"no-repeat-ngram": {"size": 2}, "other": None})
    back = sampling_params_of(pb.GenerateRequest(params=sampling_params_to_proto(params), priority=3))
    assert back == params
    assert sampling_params_of(pb.GenerateRequest()).speculative is True  # unset: the engine's default


@pytest.mark.parametrize(("args", "kwargs", "message"), [
    (("hi",), {"foo": 1}, "no sampling parameter is called 'foo'; they are frequency_penalty, ignore_eos, "
                          "include_stop_str_in_output, logit_bias, logits_processors, logprobs"),
    (("hi",), {"priority": 2**40}, "priority must be an integer in (-2**31, 2**31)"),
    (("hi",), {"priority": 1.5}, "priority must be an integer in (-2**31, 2**31) and request_id a string, got 1.5"),
    (("hi",), {"request_id": 5}, "and request_id a string, got 0 and 5"),
    (("hi",), {"max_tokens": 2**40}, "max_tokens must be below 2**31 to travel over gRPC (int32)"),
    (([1, 2**70],), {}, "a prompt is a string, a list of token ids (integers below 2**63) or a ChatPrompt"),
    (("hi",), {"prompt_logprobs": 2.5}, "prompt_logprobs must be an integer, got 2.5"),
    (("hi",), {"logit_bias": ((5, 1.0), (5, -1.0))}, "logit_bias names token 5 twice"),
])
def test_a_request_the_client_cannot_encode_is_an_invalid_request_naming_it(args: tuple[Any, ...],
                                                                              kwargs: dict[str, Any],
                                                                              message: str) -> None:
    from infer.core.errors import InvalidRequestError
    from infer.server.client import build_request

    with pytest.raises(InvalidRequestError) as info:
        build_request(*args, **kwargs)
    assert message in str(info.value)


# ---------------------------------------------------------------- generation
CASES = [
    ("def main():", SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)),
    ([5, 17, 42, 99, 3, 250], SamplingParams(max_tokens=16, temperature=0.0)),
    ("import os\nimport sys", SamplingParams(max_tokens=12, temperature=0.8, top_k=20, seed=7, ignore_eos=True)),
]


@pytest.mark.parametrize("prompt,params", CASES, ids=["greedy-logprobs", "token-ids", "seeded"])
def test_stream_equals_offline_generate(client: Client, llm: Any, prompt: Any, params: SamplingParams) -> None:
    expected = llm.generate([prompt], params)[0]
    want = expected.outputs[0]
    responses = list(client.generate(prompt, params))
    assert tokens_of(responses) == want.token_ids
    assert "".join(o.text for r in responses for o in r.outputs) == want.text
    assert [r.finished for r in responses] == [False] * (len(responses) - 1) + [True]
    assert [r.HasField("usage") for r in responses] == [False] * (len(responses) - 1) + [True]  # the last has it
    last = responses[-1]
    assert last.outputs[-1].finish_reason == pb.FinishReason.Value(f"FINISH_REASON_{want.finish_reason.name}")
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(expected.prompt_token_ids),
                                                                        len(want.token_ids))
    if params.logprobs is not None:
        got = [{e.token_id: e.logprob for e in pos.tokens} for r in responses for o in r.outputs for pos in o.logprobs]
        assert [set(d) for d in got] == [set(d) for d in want.logprobs]
        assert all(math.isclose(g[t], w[t], abs_tol=1e-4) for g, w in zip(got, want.logprobs) for t in w)
    full = client.complete(prompt, params)
    assert (list(full.outputs[0].token_ids), full.outputs[0].text) == (want.token_ids, want.text)
    assert full.outputs[0].finish_reason == last.outputs[-1].finish_reason
    assert (full.usage.prompt_tokens, full.usage.completion_tokens) == (last.usage.prompt_tokens,
                                                                        last.usage.completion_tokens)
    if params.logprobs is not None:  # every position's, merged from the deltas
        got = [{e.token_id: e.logprob for e in pos.tokens} for pos in full.outputs[0].logprobs]
        assert [set(d) for d in got] == [set(d) for d in want.logprobs]
        assert all(math.isclose(g[t], w[t], abs_tol=1e-4) for g, w in zip(got, want.logprobs) for t in w)
    if params.prompt_logprobs is not None:  # once in the stream, with the first tokens; and in Complete's answer
        [streamed] = [r.prompt_logprobs for r in responses if r.prompt_logprobs]
        assert responses[0].prompt_logprobs and responses[0].outputs
        for entries in (streamed, full.prompt_logprobs):
            got = [{e.token_id: e.logprob for e in pos.tokens} for pos in entries]
            assert got[0] == {} and expected.prompt_logprobs[0] is None
            assert [set(d) for d in got[1:]] == [set(d) for d in expected.prompt_logprobs[1:]]
            assert all(math.isclose(g[t], w[t], abs_tol=1e-4)
                       for g, w in zip(got[1:], expected.prompt_logprobs[1:]) for t in w)


def test_64_streams_with_30_percent_cancelled(client: Client, server: ServerProcess) -> None:
    before = client.stats().requests_finished
    rng = random.Random(0)
    cancel_after = {i: rng.randint(1, 10) for i in rng.sample(range(64), 19)}  # 30% of 64, at a random token

    async def one(c: AsyncClient, i: int) -> str:
        call = c.generate(f"stream {i}: " + "word " * rng.randint(1, 30), max_tokens=24, temperature=0.7, seed=i,
                          ignore_eos=True)
        got, last = 0, None
        async for response in call:
            got += sum(len(o.token_ids) for o in response.outputs)
            last = response
            if i in cancel_after and got >= cancel_after[i]:
                call.cancel()
                return "cancelled"
        assert last is not None and last.finished and got == 24
        return "finished"

    async def run() -> list[str]:
        async with AsyncClient(server.target) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, i) for i in range(64))), 90)

    outcomes = asyncio.run(run())
    assert outcomes.count("cancelled") == 19 and outcomes.count("finished") == 45
    stats = wait_drained(client)
    assert_no_leak(stats)
    assert stats.requests_finished - before == 64  # the aborted ones too


def test_deadline_shorter_than_the_generation_aborts_it(client: Client) -> None:
    before = client.stats()
    err = rpc_error(lambda: client.generate("a long one", max_tokens=1000, temperature=0.0, ignore_eos=True,
                                            timeout=0.3))
    assert err.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    stats = wait_drained(client)
    assert_no_leak(stats)
    assert stats.requests_finished == before.requests_finished + 1
    assert stats.output_tokens - before.output_tokens < 1000  # it stopped early
    assert_serves(client)


def test_abort_by_id_ends_the_stream_and_unknown_ids_are_not_found(client: Client) -> None:
    call = client.generate("abort me", request_id="req-abort", max_tokens=900, temperature=0.0, ignore_eos=True)
    next(call)
    err = rpc_error(lambda: client.complete("again", request_id="req-abort", max_tokens=2))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, "request id 'req-abort' is already in use")
    client.abort("req-abort")
    rest = list(call)
    assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == pb.FINISH_REASON_ABORT
    err = rpc_error(lambda: client.abort("req-abort"))
    assert err.code() is grpc.StatusCode.NOT_FOUND and "unknown request id 'req-abort'" in err.details()
    assert_no_leak(wait_drained(client))


def test_long_client_input_quoted_in_an_error_keeps_its_status(client: Client, llm: Any) -> None:
    """Messages quote the client's input; past gRPC's 8-16 KiB metadata limit the status was dropped and the
    client read RESOURCE_EXHAUSTED (documented as "retry later") for a request that can never succeed."""
    err = rpc_error(lambda: client.complete("hi", max_tokens=2, lora_adapter="a" * 20_000))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("lora_adapter 'aaa")
    assert err.details().endswith(" more bytes cut)") and len(err.details().encode()) < 2200
    err = rpc_error(lambda: client.complete("hi", max_tokens=2, lora_adapter="\u00e9" * 20_000))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "\u00e9\u00e9" in err.details()  # cut between characters
    # what was cut is said in bytes, and no replacement character stands for a character cut in two (the "a" puts
    # the 2 KiB mark inside one)
    name = "a" + "\u00e9" * 20_000
    full = _engine_message(llm, "hi", SamplingParams(max_tokens=2, lora_adapter=name))
    err = rpc_error(lambda: client.complete("hi", max_tokens=2, lora_adapter=name))
    kept, cut = re.fullmatch(r"(.*)\.\.\. \((\d+) more bytes cut\)", err.details(), re.DOTALL).groups()
    assert full.startswith(kept) and "\ufffd" not in kept and len(kept.encode()) == 2047
    assert len(kept.encode()) + int(cut) == len(full.encode())
    # a message of exactly 2 KiB travels whole
    base = len(_engine_message(llm, "hi", SamplingParams(max_tokens=2, lora_adapter="a")).encode())
    name = "a" * (1 + 2048 - base)
    full = _engine_message(llm, "hi", SamplingParams(max_tokens=2, lora_adapter=name))
    err = rpc_error(lambda: client.complete("hi", max_tokens=2, lora_adapter=name))
    assert len(full.encode()) == 2048 and (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, full)
    err = rpc_error(lambda: client.abort("r" * 20_000))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and "request_id has 20000 characters" in err.details()


def metric(server: ServerProcess, name: str) -> float:
    args = server.proc.args
    port = args[args.index("--metrics-port") + 1]
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    [value] = [float(line.split()[-1]) for line in text.splitlines() if line.startswith(f"{name} ")]
    return value


def test_a_full_queue_answers_resource_exhausted(client: Client, server: ServerProcess) -> None:
    rejected = metric(server, "infer_server_rejected_requests_total")

    async def run() -> tuple[grpc.StatusCode, str, int]:
        async with AsyncClient(server.target) as c:
            calls = [c.generate(f"fill {i}", max_tokens=900, temperature=0.0, ignore_eos=True)
                     for i in range(MAX_QUEUE)]
            await asyncio.gather(*(call.read() for call in calls))  # every one is admitted and streaming
            in_flight = (await c.stats()).in_flight
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await c.complete("one too many", max_tokens=2)
            for call in calls:
                call.cancel()
            return info.value.code(), info.value.details(), in_flight

    code, details, in_flight = asyncio.run(run())
    assert in_flight == MAX_QUEUE
    assert code is grpc.StatusCode.RESOURCE_EXHAUSTED and f"--max-queue {MAX_QUEUE}" in details
    assert metric(server, "infer_server_rejected_requests_total") == rejected + 1  # the one refused
    assert_no_leak(wait_drained(client))
    assert_serves(client)


# ---------------------------------------------------------------- bad input
def _validation_message(**fields: Any) -> str:
    try:
        SamplingParams(**fields).validate()
    except InferError as exc:
        return str(exc)
    raise AssertionError(f"{fields} is valid")


BAD_PARAMS = [dict(max_tokens=0), dict(max_tokens=-3), dict(temperature=-0.5), dict(temperature=math.nan),
              dict(temperature=math.inf), dict(top_p=0.0), dict(top_p=1.5), dict(top_p=-0.1), dict(top_p=math.nan),
              dict(top_k=-1), dict(min_p=1.0), dict(n=0), dict(logprobs=21), dict(seed=-1), dict(stop=[""]),
              dict(stop=["x"] * 65), dict(stop=["x" * 1025])]


@pytest.mark.parametrize("fields", BAD_PARAMS, ids=lambda f: "-".join(f"{k}={v}" for k, v in f.items()))
def test_bad_sampling_params_are_invalid_argument(client: Client, fields: dict[str, Any]) -> None:
    for call in (client.generate, client.complete):
        err = rpc_error(lambda: call("hello", **fields))
        assert err.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert err.details() == _validation_message(**fields)
    assert_serves(client)


def _engine_message(llm: Any, prompt: Any, params: SamplingParams) -> str:
    try:
        llm.engine.add_request(prompt, params)
    except InferError as exc:
        return str(exc)
    raise AssertionError(f"{prompt!r} was accepted")


BAD_PROMPTS = {
    "empty-text": ("", dict(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
    "empty-ids": ([], dict(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
    "id-out-of-vocab": ([1, 10**6], dict(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
    "negative-id": ([-1], dict(max_tokens=4), grpc.StatusCode.INVALID_ARGUMENT),
    "over-the-context": ("hello there", dict(max_tokens=1020), grpc.StatusCode.INVALID_ARGUMENT),
    "over-the-step-budget": ([7] * (STEP_BUDGET + 20), dict(max_tokens=4), grpc.StatusCode.FAILED_PRECONDITION),
}


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompts_get_the_engines_message(client: Client, llm: Any, name: str) -> None:
    prompt, fields, code = BAD_PROMPTS[name]
    expected = _engine_message(llm, prompt, SamplingParams(**fields))
    for call in (client.generate, client.complete):
        err = rpc_error(lambda: call(prompt, **fields))
        assert (err.code(), err.details()) == (code, expected)
    assert_serves(client)


def test_logits_processors_run_as_offline_and_unknown_ones_are_invalid_argument(client: Client, llm: Any) -> None:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                            logits_processors={"no-repeat-ngram": {"size": 1}})
    [offline] = llm.generate(["hello"], params)
    assert client.complete("hello", params).outputs[0].token_ids == offline.outputs[0].token_ids
    assert len(set(offline.outputs[0].token_ids)) == 12
    for bad in (["nope"], {"no-repeat-ngram": {"size": 0}}):
        params = SamplingParams(max_tokens=4, logits_processors=bad)
        for call in (client.generate, client.complete):
            err = rpc_error(lambda: call("hello", params))
            assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT,
                                                   _engine_message(llm, "hello", params))
    assert_serves(client)


def test_stop_token_ids_outside_the_vocabulary_are_rejected_as_offline(client: Client, llm: Any) -> None:
    vocab = client.model_info().vocab_size
    params = SamplingParams(max_tokens=4, stop_token_ids=(5, vocab, 10**6))
    with pytest.raises(InferError) as offline:
        llm.generate(["hello"], params)
    for call in (client.generate, client.complete):
        err = rpc_error(lambda: call("hello", params))
        assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, str(offline.value))
    assert f"vocabulary size {vocab}; got [{vocab}, 1000000]" in str(offline.value)
    assert_serves(client)


def test_no_prompt_and_oversized_messages(client: Client) -> None:
    from infer.server import infer_pb2_grpc

    stub = infer_pb2_grpc.InferenceStub(client.channel)
    err = rpc_error(lambda: stub.Complete(pb.GenerateRequest()))
    assert err.code() is grpc.StatusCode.INVALID_ARGUMENT and err.details().startswith("prompt is empty")
    err = rpc_error(lambda: client.complete("x" * (MAX_MESSAGE + 1000), max_tokens=2))
    assert err.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    # a response past the limit: refused as it grows (no retry helps), saying what to change, not gRPC's own words
    big = {"max_tokens": 600, "logprobs": 20, "ignore_eos": True, "temperature": 0.0}
    err = rpc_error(lambda: client.complete("a", **big))
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION
    assert f"grew past --max-message-bytes {MAX_MESSAGE}" in err.details() and "use Generate" in err.details()
    assert sum(len(r.outputs[0].token_ids) for r in client.generate("a", **big)) == 600  # it streams
    # prompt logprobs travel in one message either way: both calls say so, and what to change
    long_prompt = list(range(5, 505))  # 500 positions x 21 entries: past 64 KiB
    err = rpc_error(lambda: client.complete(long_prompt, max_tokens=2, prompt_logprobs=20))
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "prompt logprobs of 500 positions" in err.details()
    assert "use Generate" not in err.details() and "fewer top entries (prompt_logprobs)" in err.details()
    err = rpc_error(lambda: list(client.generate(long_prompt, max_tokens=2, prompt_logprobs=20)))
    assert err.code() is grpc.StatusCode.FAILED_PRECONDITION and "prompt logprobs of 500 positions" in err.details()
    assert_serves(client)


def test_undecodable_requests_are_invalid_argument(client: Client) -> None:
    """Corrupt wire data and a prompt that is not UTF-8 name the message type, not a Python DecodeError."""
    valid = pb.GenerateRequest(text="ab", params=pb.SamplingParams(max_tokens=2)).SerializeToString()
    not_utf8 = valid.replace(b"ab", b"\xff\xfe")
    for method, streams in (("Complete", False), ("Generate", True)):
        call = (client.channel.unary_stream if streams else client.channel.unary_unary)(
            f"/infer.v1.Inference/{method}", request_serializer=None, response_deserializer=None)
        for payload in (b"\xff\xff\xff", not_utf8):
            err = rpc_error(lambda: list(call(payload)) if streams else call(payload))
            assert err.code() is grpc.StatusCode.INVALID_ARGUMENT, (method, payload, err)
            assert "not a valid infer.v1.GenerateRequest message" in err.details() and "UTF-8" in err.details()
    assert_serves(client)


def test_health_watch_streams_serving(client: Client) -> None:
    """grpc's own Health.Watch (a coroutine handler, not a generator) passes the server's interceptors."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    watch = health_pb2_grpc.HealthStub(client.channel).Watch(health_pb2.HealthCheckRequest(service=""), timeout=10)
    assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
    watch.cancel()


def test_health_answers_for_the_service_asked(client: Client) -> None:
    """Check reports the service named: "" and infer.v1.Inference are SERVING, one the server lacks is NOT_FOUND
    (the gRPC health checking protocol)."""
    from infer.server.app import SERVICE_NAME

    assert [client.health(service) for service in ("", SERVICE_NAME)] == ["SERVING"] * 2
    assert rpc_error(lambda: client.health("no.such.Service")).code() is grpc.StatusCode.NOT_FOUND


def test_a_client_where_nothing_listens_waits_its_timeout_and_a_closed_one_refuses_calls() -> None:
    """wait_until_serving polls for its whole timeout, then raises TimeoutError (not the refused connection's
    RpcError); leaving the `with` block closes the channel, so a later call fails at once."""
    with Client(f"127.0.0.1:{free_port()}") as c:  # nothing listens there
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="not SERVING within 0.3 s"):
            c.wait_until_serving(timeout=0.3)
        assert time.monotonic() - start >= 0.3
    with pytest.raises(ValueError, match="closed channel"):
        c.health()


def test_a_default_client_goes_where_a_default_server_listens() -> None:
    """docs/serving.md: `infer serve` listens on 127.0.0.1:50051 unless told otherwise, and so the clients go."""
    from infer.server.app import ServeOptions

    options = ServeOptions()
    with Client() as c:
        assert c.target == f"{options.host}:{options.port}" == "127.0.0.1:50051"


def test_a_seed_beyond_64_bits_samples_and_leaves_other_streams_alone(client: Client, llm: Any) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=2**62 + 12345)
    other = client.generate("another stream", max_tokens=40, temperature=0.0, ignore_eos=True)
    first = next(other)
    big = client.complete("hi", params)
    assert list(big.outputs[0].token_ids) == llm.generate(["hi"], params)[0].outputs[0].token_ids
    assert len(tokens_of([first, *other])) == 40
    assert_serves(client)


def test_messages_are_the_clis(client: Client) -> None:
    """The same words, the command line naming the option that sets the field."""
    cli = subprocess.run([*infer_command(), "generate", "--top-p", "1.5", "hello"], capture_output=True, text=True)
    assert cli.returncode != 0
    err = rpc_error(lambda: client.complete("hello", top_p=1.5))
    assert cli.stderr.strip() == f"Error: {err.details().replace('top_p ', 'top_p (--top-p) ', 1)}"


# ---------------------------------------------------------------- introspection
def test_model_info_plugins_and_stats(client: Client, llm: Any, tiny_model: Path) -> None:
    info = client.model_info()
    assert (info.model, info.max_model_len, info.vocab_size) == (os.path.realpath(tiny_model),
                                                                 llm.engine.max_model_len,
                                                                 llm.engine.loaded.model.spec.vocab_size)
    assert info.architecture == "LlamaForCausalLM" and info.quant == "none" and not info.chat_template
    assert dict(info.components) == llm.engine.active
    names = {(p.kind, p.name) for p in client.plugins()}
    assert {("command", "serve"), ("command", "client"), ("scheduler", "continuous"), ("kv_cache", "paged")} <= names
    stats = client.stats()
    assert stats.max_queue == MAX_QUEUE and stats.kv_total_blocks == info.num_kv_blocks and not stats.draining


def test_model_info_gives_the_absolute_folder_of_a_model_given_by_a_relative_path(secure_server: ServerProcess,
                                                                                    tiny_model: Path) -> None:
    """`secure_server` was started with `--model NAME` in the model's parent folder: a path that means nothing to a
    client, so GetModelInfo answers the folder's absolute path."""
    assert secure_server.proc.args[secure_server.proc.args.index("--model") + 1] == tiny_model.name
    with secure_server.client() as c:
        assert c.model_info().model == os.path.realpath(tiny_model)


def test_metrics_endpoint(client: Client, server: ServerProcess) -> None:
    args = server.proc.args
    port = args[args.index("--metrics-port") + 1]
    client.complete("count me", max_tokens=3)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'infer_kv_blocks{state="free"}' in text
    assert "infer_output_tokens_total" in text and "infer_server_max_queue 80.0" in text
    log = server.log.read_text(errors="replace")  # where an operator finds the ports (--metrics-port 0 too)
    assert f" on 127.0.0.1:{server.port} (gRPC, plaintext)" in log
    assert f"infer: metrics on http://127.0.0.1:{port}/metrics" in log


def test_a_reflection_client_nobody_here_wrote(server: ServerProcess, llm: Any) -> None:
    from grpc_requests import Client as ReflectionClient

    rc = ReflectionClient.get_by_endpoint(server.target)
    assert {"infer.v1.Inference", "grpc.health.v1.Health"} <= set(rc.service_names)
    responses = list(rc.request("infer.v1.Inference", "Generate", {
        "text": "hello", "params": {"max_tokens": 4, "temperature": 0.0, "ignore_eos": True}}))
    assert responses[-1]["finished"] is True
    tokens = [int(t) for r in responses for t in r.get("outputs", [{}])[0].get("token_ids", [])]
    want = llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert tokens == want.outputs[0].token_ids and len(tokens) == 4
    assert rc.request("grpc.health.v1.Health", "Check", {"service": ""}) == {"status": "SERVING"}
    assert rc.request("grpc.health.v1.Health", "Check", {"service": "infer.v1.Inference"}) == {"status": "SERVING"}


# ---------------------------------------------------------------- token, TLS, client command, SIGTERM
def test_a_token_is_required(secure_server: ServerProcess) -> None:
    for kwargs in ({"token": None}, {"token": "wrong"}):
        with secure_server.client(**kwargs) as c:
            for call in (lambda: c.complete("hi", max_tokens=2), c.stats, lambda: c.generate("hi", max_tokens=2)):
                err = rpc_error(call)
                assert err.code() is grpc.StatusCode.UNAUTHENTICATED and "Bearer" in err.details()
            assert c.health() == "SERVING"  # probes need no token
    with secure_server.client() as c:
        assert len(c.complete("hi", max_tokens=2, temperature=0.0).outputs[0].token_ids) == 2


def test_the_openai_api_serves_beside_grpc_with_its_token_and_tls(secure_server: ServerProcess,
                                                                  certs: tuple[Path, Path] | None) -> None:
    """`serve --http-port --served-model-name`: OpenAI's API on the same engine, token and TLS (the openai client
    is the reference consumer; its answer is the gRPC Complete's)."""
    openai = pytest.importorskip("openai", reason="the HTTP front's tests drive it with the openai client")
    import ssl

    scheme = "https" if certs else "http"
    verify = ssl.create_default_context(cafile=str(certs[0])) if certs else True
    url = f"{scheme}://127.0.0.1:{secure_server.http_port}/v1"
    assert f"OpenAI API on {url} (model 'tiny-secure')" in secure_server.log_tail()
    with openai.OpenAI(base_url=url, api_key=TOKEN, max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=verify)) as api:
        assert [m.id for m in api.models.list().data] == ["tiny-secure"]
        got = api.completions.create(model="tiny-secure", prompt="hi", max_tokens=6, temperature=0)
        with secure_server.client() as c:
            assert got.choices[0].text == c.complete("hi", max_tokens=6, temperature=0.0).outputs[0].text
    with openai.OpenAI(base_url=url, api_key="wrong", max_retries=0,
                       http_client=openai.DefaultHttpxClient(verify=verify)) as api:
        with pytest.raises(openai.AuthenticationError, match="Bearer"):
            api.models.list()


def test_the_ca_may_be_a_path_a_string_path_or_the_pem_bytes(secure_server: ServerProcess) -> None:
    """Client(root_certificates=...) takes the CA file as a Path or a str (the signature's bytes | str | Path), or
    its PEM bytes."""
    roots = secure_server.client_kwargs["root_certificates"]
    if roots is None:
        pytest.skip("no openssl here: the secure server is plaintext")
    for given in (roots, str(roots), roots.read_bytes()):
        with secure_server.client(root_certificates=given) as c:
            assert c.health() == "SERVING"


def test_the_bearer_scheme_is_read_in_any_case() -> None:
    """RFC 7235: the auth-scheme is case-insensitive; `bearer TOKEN` (some clients send it) was refused."""
    from infer.server.auth import BearerTokenInterceptor

    authorized = BearerTokenInterceptor("s3cret").authorized
    for header in ("Bearer s3cret", "bearer s3cret", "BEARER  s3cret", b"Bearer s3cret"):
        assert authorized([("Authorization", header)]), header
    for header in ("Bearer s3cre", "Bearer s3cret!", "Basic s3cret", "Bearers3cret", "s3cret", "Bearer", ""):
        assert not authorized([("authorization", header)]), header
    assert not authorized([("x-token", "Bearer s3cret")]) and not authorized(None)


def test_client_errors_say_what_to_change(secure_server: ServerProcess) -> None:
    roots = secure_server.client_kwargs["root_certificates"]
    tls = ["--tls-ca", str(roots)] if roots else []
    out = run_cli("client", "hi", "--target", secure_server.target, *tls)
    assert out.exit_code == 1 and out.stderr.startswith("Error: UNAUTHENTICATED: ") and \
        "pass the server's token with --token TOKEN (or set INFER_SERVER_TOKEN)" in out.stderr
    idle = f"127.0.0.1:{free_port()}"  # nothing listens there
    out = run_cli("client", "hi", "--target", idle)
    assert out.exit_code == 1 and out.stderr.startswith(f"Error: UNAVAILABLE: nothing accepts connections at {idle}; "
                                                        "is `infer serve` running there")
    for target in ("127.0.0.1:99999", "127.0.0.1:0", "127.0.0.1", "127.0.0.1:port", ":50051"):
        out = run_cli("client", "hi", "--target", target)
        assert out.exit_code == 2 and "is not HOST:PORT with a port in 1-65535" in out.stderr, target
    out = run_cli("client", "hi", "--target", f"unix:{secure_server.log.parent}/none.sock")  # gRPC's own scheme
    assert out.exit_code == 1 and out.stderr.startswith("Error: UNAVAILABLE")
    for option, message in ((["--temperature", "-1"], "temperature (--temperature) must be a number >= 0"),
                            (["--n", "0"], "n (--n) must be an integer in [1, 64], got 0"),
                            (["--max-tokens", "0"], "max_tokens (--max-tokens) must be a positive integer"),
                            (["--stop", ""], "stop (--stop) must be a non-empty string"),
                            (["--beam-width", "-1"],
                             "beam_width (--beam-width) must be an integer >= 1, got -1"),
                            (["--beam-width", "2", "--length-penalty", "nan"],
                             "length_penalty (--length-penalty) must be a finite")):
        out = run_cli("client", "hi", "--target", idle, *option)  # named before any server is asked, as generate does
        assert out.exit_code == 2 and message in out.stderr, (option, out.stderr)


def test_client_command(secure_server: ServerProcess, llm: Any) -> None:
    roots = secure_server.client_kwargs["root_certificates"]
    tls = ["--tls-ca", str(roots)] if roots else []
    env = os.environ | {"INFER_SERVER_TOKEN": TOKEN}
    out = subprocess.run([*infer_command(), "client", "def main():", "--target", secure_server.target,
                          "--max-tokens", "8", "--ignore-eos", *tls], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    want = llm.generate(["def main():"], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out.stdout == "def main():" + want.outputs[0].text + "\n"


def run_cli(*args: str) -> Any:
    """`infer ARGS` in this process (no model load, no start-up cost); returns click's Result."""
    from click.testing import CliRunner

    from infer.cli import main

    return CliRunner().invoke(main, list(args))


def test_a_tls_mismatch_prints_only_the_explanation(server: ServerProcess) -> None:
    """In a process of its own (gRPC's core logs to the real stderr, which CliRunner does not see): the raw SSL
    handshake log line is not printed before the explanation."""
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    cli = subprocess.run([*infer_command(), "client", "hello", "--target", server.target, "--tls"],
                         capture_output=True, text=True, env=env)
    assert (cli.returncode, cli.stdout) == (1, "")
    assert cli.stderr == f"Error: UNAVAILABLE: {server.target} does not speak TLS (a plaintext server?); drop --tls " \
                         "and --tls-ca\n"


def test_beam_search_over_grpc_equals_offline(client: Client, llm: Any, server: ServerProcess) -> None:
    """BeamSearch returns LLM.beam_search's beams (tokens, text, scores, finish reasons), beside a running stream;
    `infer client --beam-width` prints the best."""
    from infer.core.beam_search import BeamSearchParams

    prompt = "def main():"
    want = llm.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=10, length_penalty=0.5))[0]
    running = client.generate("word " * 20, max_tokens=40, temperature=0.0, ignore_eos=True)
    first = next(iter(running))  # a request in flight: the beam search runs beside it
    got = client.beam_search(prompt, beam_width=3, max_tokens=10, length_penalty=0.5)
    streamed = [o for r in [first, *running] for o in r.outputs]
    assert sum(len(o.token_ids) for o in streamed) == 40  # the stream finished whole
    assert got.prompt_tokens == len(want.prompt_token_ids)
    assert [(list(b.token_ids), b.text) for b in got.beams] == [(b.token_ids, b.text) for b in want.beams]
    assert all(math.isclose(g.score, w.score, abs_tol=1e-5) and math.isclose(g.cumulative_logprob,
               w.cumulative_logprob, abs_tol=1e-5) for g, w in zip(got.beams, want.beams))
    assert [b.finish_reason for b in got.beams] == [
        pb.FinishReason.Value(f"FINISH_REASON_{b.finish_reason.name}") for b in want.beams]
    out = run_cli("client", prompt, "--target", server.target, "--beam-width", "3", "--max-tokens", "10",
                  "--length-penalty", "0.5")
    assert (out.exit_code, out.stdout) == (0, prompt + want.beams[0].text + "\n")
    out = run_cli("client", prompt, "--target", server.target, "--beam-width", "3", "--temperature", "0.5")
    assert out.exit_code == 2 and "drop --temperature" in out.stderr
    assert run_cli("client", prompt, "--target", server.target, "--length-penalty", "2").exit_code == 2
    assert_serves(client)


def test_beam_search_over_grpc_carries_logits_processors(client: Client, llm: Any, server: ServerProcess) -> None:
    """BeamSearch's logits_processors reach the engine: LLM.beam_search's beams with them (not the plain ones), an
    unknown one is INVALID_ARGUMENT with the engine's message; `infer client --beam-width --logits-processor`
    prints the best."""
    from infer.core.beam_search import BeamSearchParams

    calls, prompts = {"no-repeat-ngram": {"size": 1}}, ["x = [", "def main():", "import os\n", "hello world"]
    params = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True, logits_processors=calls)
    plain = llm.beam_search(prompts, BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))
    # a prompt whose best beam the processor changes, so that the CLI's line shows it was sent
    prompt, want = next((p, w) for p, w, b in zip(prompts, llm.beam_search(prompts, params), plain)
                        if w.beams[0].token_ids != b.beams[0].token_ids)
    got = client.beam_search(prompt, beam_width=3, max_tokens=12, ignore_eos=True, logits_processors=calls)
    assert [list(b.token_ids) for b in got.beams] == [b.token_ids for b in want.beams]
    assert all(math.isclose(g.score, w.score, abs_tol=1e-5) for g, w in zip(got.beams, want.beams))
    err = rpc_error(lambda: client.beam_search(prompt, beam_width=3, logits_processors=["nope"]))
    with pytest.raises(InferError) as offline:
        llm.beam_search([prompt], BeamSearchParams(beam_width=3, logits_processors=["nope"]))
    assert (err.code(), err.details()) == (grpc.StatusCode.INVALID_ARGUMENT, str(offline.value))
    out = run_cli("client", prompt, "--target", server.target, "--beam-width", "3", "--max-tokens", "12",
                  "--ignore-eos", "--logits-processor", 'no-repeat-ngram={"size": 1}')
    assert (out.exit_code, out.stdout) == (0, prompt + want.beams[0].text + "\n")
    assert_serves(client)


def test_a_beam_search_response_past_the_message_limit_says_what_to_change(tiny_model: Path, tmp_path: Path,
                                                                          llm: Any) -> None:
    """As Complete's: FAILED_PRECONDITION naming --max-message-bytes (no retry helps), not gRPC's own
    RESOURCE_EXHAUSTED ("Sent message larger than max"), which reads as "retry later"; the server goes on."""
    from infer.core.beam_search import BeamSearchParams
    from infer.server.convert import beam_search_to_proto

    limit = 1024  # the smallest --max-message-bytes
    want = llm.beam_search(["a"], BeamSearchParams(beam_width=4, max_tokens=64, ignore_eos=True))[0]
    assert beam_search_to_proto(want).ByteSize() > limit  # 4 beams of 64 token ids (and their text) do not fit
    small = llm.beam_search(["a"], BeamSearchParams(beam_width=2, max_tokens=4))[0]
    proc = launch(tiny_model, tmp_path / "serve.log", [], ["--max-message-bytes", str(limit)], {})
    try:
        proc.wait_serving()
        with proc.client() as c:
            err = rpc_error(lambda: c.beam_search("a", beam_width=4, max_tokens=64, ignore_eos=True))
            assert err.code() is grpc.StatusCode.FAILED_PRECONDITION, (err.code(), err.details())
            assert f"past --max-message-bytes {limit}" in err.details() and "fewer beams" in err.details()
            got = c.beam_search("a", beam_width=2, max_tokens=4)
            assert [list(b.token_ids) for b in got.beams] == [b.token_ids for b in small.beams]
    finally:
        proc.kill()


def test_ctrl_c_on_a_client_beam_search_prints_the_best_beam_so_far(client: Client, llm: Any,
                                                                     server: ServerProcess) -> None:
    """`infer client --beam-width` aborts its search by request id on Ctrl-C and prints the best beam so far: that
    of a search cut at its length (the offline reference); the server frees the search's blocks."""
    import re

    from infer.core.beam_search import BeamSearchParams

    proc = subprocess.Popen([*infer_command(), "client", "x = [", "--target", server.target, "--beam-width", "3",
                             "--max-tokens", "1000", "--ignore-eos"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(600):
            if client.stats().beam_searches:
                break
            time.sleep(0.05)
        time.sleep(0.3)  # some tokens in
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    length = int(re.search(r"interrupted: printed the best beam so far \((\d+) tokens\)", err).group(1))
    want = llm.beam_search(["x = ["], BeamSearchParams(beam_width=3, max_tokens=length, ignore_eos=True))[0]
    assert 0 < length < 1000 and out == "x = [" + want.beams[0].text + "\n"
    stats = wait_drained(client)
    assert stats.beam_searches == 0 and stats.kv_used_blocks == 0


def test_client_chat_on_a_model_without_a_template_is_refused_by_the_server(server: ServerProcess) -> None:
    out = run_cli("client", "Hi", "--target", server.target, "--chat", "--system", "Be brief.")
    assert (out.exit_code, out.stdout) == (1, "")
    assert out.stderr.startswith("Error: INVALID_ARGUMENT: this model's tokenizer has no chat template")
    out = run_cli("client", "Hi", "--target", server.target, "--system", "Be brief.")
    assert out.exit_code == 2 and "--system is for a conversation; add --chat" in out.stderr
    out = run_cli("client", "Hi", "--target", server.target, "--chat-template-kwargs", '{"enable_thinking": false}')
    assert out.exit_code == 2 and "--chat-template-kwargs is for a conversation; add --chat" in out.stderr
    out = run_cli("client", "Hi", "--target", server.target, "--chat", "--chat-template-kwargs", "[]")
    assert out.exit_code == 2 and "must be a JSON object of template variables" in out.stderr


def test_client_errors_stand_alone(server: ServerProcess) -> None:
    out = run_cli("client", "hello", "--target", server.target, "--top-p", "1.5")
    assert (out.exit_code, out.stdout) == (2, "")  # the option's value: refused before anything is sent
    assert out.stderr == f"Error: {_validation_message(top_p=1.5).replace('top_p ', 'top_p (--top-p) ', 1)}\n"
    out = run_cli("client", "hello", "--target", server.target, "--lora-adapter", "none-here")
    assert (out.exit_code, out.stdout) == (1, "")  # no prompt echo glued to the server's error
    assert out.stderr.startswith("Error: INVALID_ARGUMENT: lora_adapter 'none-here' is not loaded")
    out = run_cli("client", "hello", "--target", server.target, "--max-tokens", "1000", "--ignore-eos",
                  "--timeout", "0.5")
    assert out.stderr.startswith("Error: DEADLINE_EXCEEDED: the call did not finish within --timeout 0.5 s; raise "
                                 "--timeout, or drop it")
    assert out.stdout == "" or (out.stdout.startswith("hello") and out.stdout.endswith("\n"))
    out = run_cli("client", "hello", "--target", server.target, "--tls")
    assert out.stderr == f"Error: UNAVAILABLE: {server.target} does not speak TLS (a plaintext server?); drop --tls " \
                         "and --tls-ca\n"
    out = run_cli("client", "hello", "--target", server.target, "--max-tokens", str(2**31))
    assert (out.exit_code, out.stdout) == (2, "") and out.stderr == (
        f"Error: invalid sampling parameters: max_tokens must be below 2**31 to travel over gRPC (int32), got "
        f"{2**31}\n")
    out = run_cli("client", "hello", "--target", server.target, "--seed", str(2**63))
    assert out.exit_code == 2 and "seed (--seed) must be an integer in [0, 2**63)" in out.stderr
    out = run_cli("client", "hello", "--target", server.target, "--timeout", "0")
    assert out.exit_code == 2 and "--timeout" in out.stderr


def test_client_stats_are_the_servers_counters_as_json_numbers(server: ServerProcess) -> None:
    out = run_cli("client", "hello", "--target", server.target, "--max-tokens", "3", "--ignore-eos", "--stats")
    assert out.exit_code == 0, out.stderr
    stats = json.loads(out.stderr)
    with server.client() as c:
        after = c.stats()
    assert stats["requests_finished"] >= 1 and stats["output_tokens"] >= 3  # numbers, not protobuf's JSON strings
    assert stats["requests_finished"] <= after.requests_finished and stats["kv_total_blocks"] == after.kv_total_blocks
    assert set(stats) == {field.name for field in after.DESCRIPTOR.fields}


def test_client_refuses_a_prompt_that_is_not_utf8_before_sending() -> None:
    out = run_cli("client", "a\udcffb", "--target", "127.0.0.1:1")  # a surrogate-escaped byte from the shell
    assert (out.exit_code, out.stdout) == (1, "") and "the prompt is not valid UTF-8 text" in out.stderr


@pytest.mark.parametrize("option, value", [("--chat-template-kwargs", "{}"), ("--tools", "[]"), ("--system", "")])
def test_conversation_options_without_chat_are_refused_even_when_empty(option: str, value: str,
                                                                       tmp_path: Path) -> None:
    """An empty object, a file of no tools or an empty system message is still an option the user typed for a
    conversation: exit 2 before anything is sent, as a non-empty one is, not a plain-text request."""
    if option == "--tools":
        (tmp_path / "tools.json").write_text(value)
        value = str(tmp_path / "tools.json")
    out = run_cli("client", "Hi", "--target", "127.0.0.1:1", option, value)  # nothing listens: sending is exit 1
    assert out.exit_code == 2 and f"{option} is for a conversation; add --chat" in out.stderr, out.stderr


def test_plaintext_client_of_a_tls_server(secure_server: ServerProcess) -> None:
    if secure_server.client_kwargs["root_certificates"] is None:
        pytest.skip("no openssl: the secure server is plaintext")
    out = run_cli("client", "hello", "--target", secure_server.target, "--token", TOKEN)
    assert out.exit_code == 1 and "if it serves TLS (--tls-cert), add --tls-ca or --tls" in out.stderr


@pytest.mark.parametrize("subject", ["/CN=infer-test", "/CN=localhost"])
def test_a_certificate_that_does_not_name_the_targets_host_is_explained(subject: str, tiny_model: Path,
                                                                         tmp_path: Path) -> None:
    """A trusted certificate for 127.0.0.1 reached as localhost: gRPC fails the handshake (UNAVAILABLE, "failed to
    connect") or the call (UNAUTHENTICATED, seen from `infer client` with the host as the certificate's CN); the
    client says that the certificate does not name the host, neither that nothing listens nor that a token is
    missing."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", subject,
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    proc = launch(tiny_model, tmp_path / "serve.log", [], ["--tls-cert", str(cert), "--tls-key", str(key)],
                  {"root_certificates": cert})
    try:
        proc.wait_serving()
        ok = run_cli("client", "hello", "--target", proc.target, "--tls-ca", str(cert), "--max-tokens", "2")
        assert ok.exit_code == 0, ok.output  # the certificate names 127.0.0.1
        out = run_cli("client", "hello", "--target", f"localhost:{proc.port}", "--tls-ca", str(cert),
                      "--max-tokens", "2")
        assert out.exit_code == 1 and out.stdout == ""
        assert f"the TLS certificate of localhost:{proc.port} does not name the host localhost" in out.stderr
        assert "--token" not in out.stderr and "nothing accepts connections" not in out.stderr, out.stderr
    finally:
        proc.kill()


def test_bad_tls_files_are_named_before_the_model_loads(tmp_path: Path, certs: tuple[Path, Path] | None) -> None:
    bad = tmp_path / "bad.pem"
    bad.write_text("not a pem file\n")
    serve = ["--model", str(tmp_path / "no-model"), "serve", "--port", "0"]
    out = run_cli(*serve, "--tls-cert", str(bad), "--tls-key", str(bad))
    assert out.stderr.startswith(f"Error: --tls-cert {bad} is not a PEM certificate;"), out.stderr
    if certs is None:
        pytest.skip("openssl is not installed: the key checks need a real certificate (the checks above ran)")
    cert, key = certs
    out = run_cli(*serve, "--tls-cert", str(cert), "--tls-key", str(bad))
    assert out.stderr.startswith(f"Error: --tls-key {bad} is not an unencrypted PEM private key;"), out.stderr
    other = tmp_path / "other-key.pem"
    subprocess.run(["openssl", "genpkey", "-algorithm", "RSA", "-out", str(other)], check=True, capture_output=True)
    out = run_cli(*serve, "--tls-cert", str(cert), "--tls-key", str(other))
    assert out.stderr.startswith(f"Error: --tls-key {other} is not the private key of --tls-cert {cert};")


def test_taken_ports_fail_before_the_model_loads(tmp_path: Path) -> None:
    serve = ["--model", str(tmp_path / "no-model"), "serve"]  # the model error would come second
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for args, option in ((["--port", port], "--port"), (["--port", "0", "--metrics-port", port], "--metrics-port")):
            out = run_cli(*serve, *args)
            assert out.stderr.startswith(f"Error: could not listen on 127.0.0.1:{port}: "), out.stderr
            assert f"(is the port in use? pick another {option}, or 0 for a free one)" in out.stderr
        out = run_cli(*serve, "--port", "0", "--http-port", port)
        assert out.stderr.startswith(f"Error: could not listen on 127.0.0.1:{port}: "), out.stderr
        assert "pick another --http-port" in out.stderr
    out = run_cli(*serve, "--port", port, "--metrics-port", port)
    assert out.stderr == f"Error: --metrics-port must differ from --port (both are {port})\n"
    out = run_cli(*serve, "--port", port, "--http-port", port)
    assert out.stderr == f"Error: --http-port must differ from --port and --metrics-port (it is {port})\n"
    for port in ("0", "50999"):  # a host that is not this machine's: refused before the model loads, port 0 too
        out = run_cli(*serve, "--host", "192.0.2.1", "--port", port)  # TEST-NET-1: never a local address
        assert out.stderr.startswith(f"Error: could not listen on 192.0.2.1:{port}: "), out.stderr
        assert "--host must be an address of this machine" in out.stderr


def test_sigterm_drains_in_flight_streams_and_exits_0(secure_server: ServerProcess) -> None:
    with secure_server.client() as c:
        calls = [c.generate(f"drain {i}", max_tokens=500, temperature=0.0, ignore_eos=True) for i in range(3)]
        firsts = [next(call) for call in calls]
        secure_server.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        while c.health() != "NOT_SERVING":
            assert time.monotonic() < deadline, "health never turned NOT_SERVING"
            time.sleep(0.02)
        err = rpc_error(lambda: c.complete("too late", max_tokens=2))
        assert err.code() is grpc.StatusCode.UNAVAILABLE
        for first, call in zip(firsts, calls):
            rest = list(call)
            assert len(tokens_of([first, *rest])) == 500
            assert rest[-1].finished and rest[-1].outputs[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert secure_server.proc.wait(timeout=60) == 0, secure_server.log_tail()
    assert "server stopped" in secure_server.log_tail()


def test_streams_cut_by_the_grace_period_say_why(tiny_model: Path, tmp_path: Path) -> None:
    proc = launch(tiny_model, tmp_path / "serve.log", [], ["--grace-period", "0"], {})  # the stream never finishes
    try:
        proc.wait_serving()
        with proc.client() as c:
            call = c.generate("never done", max_tokens=1000, temperature=0.0, ignore_eos=True)
            next(call)
            started = time.monotonic()
            proc.proc.send_signal(signal.SIGTERM)
            err = rpc_error(lambda: list(call))
            assert err.code() is grpc.StatusCode.UNAVAILABLE
            assert "shutting down and aborted the request; retry it on another replica" in err.details()
        assert proc.proc.wait(timeout=30) == 0, proc.log_tail()
        assert time.monotonic() - started < 10
    finally:
        proc.kill()
