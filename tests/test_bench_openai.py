"""`infer bench` with an ``openai:URL`` arm: an in-process `infer serve --http-port` on the tiny model, beside an
engine arm on the same model in the bench's own process. The reference is the engine arm: greedy, the server must
give its tokens, token for token (and its embeddings), in the bench's records; a fake server (asyncio, chunked
events) stands for servers that tokenize otherwise or return no token ids."""
from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

pytest.importorskip("grpc_health", reason="the server needs grpcio-health-checking (a dependency of infer-engine; "
                    "the GPU image lacks it)")

from infer.bench.arms import ArmError, parse_openai_url  # noqa: E402
from infer.bench.openai_arm import sampling_fields  # noqa: E402
from infer.cli import main  # noqa: E402
from infer.core.llm import LLM  # noqa: E402
from infer.core.request import SamplingParams  # noqa: E402
from conftest import LoopThread, random_adapter, serving  # noqa: E402

NAME = "tiny-served"
TOKEN = "sesame"
ADAPTER = "sql"


def run(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


@pytest.fixture(scope="module")
def adapter(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return random_adapter(tiny_model, tmp_path_factory.mktemp("lora") / ADAPTER)


@pytest.fixture(scope="module")
def served(tiny_model: Path, adapter: Path) -> Iterator[str]:
    """The API base of `infer serve` on the tiny model, with a LoRA adapter (bearer token required)."""
    llm = LLM(model=str(tiny_model), device="cpu", num_kv_blocks=256, lora_adapters={ADAPTER: str(adapter)})
    loops = LoopThread()
    try:
        with serving(llm.engine, loops, http_port=0, token=TOKEN, served_model_name=NAME, max_queue=256) as server:
            yield f"http://127.0.0.1:{server.http_port}/v1"
    finally:
        loops.stop()


def bench(tiny_model: Path, out: Path, url: str, *args: str, group: tuple[str, ...] = ()) -> dict[str, Any]:
    """A bench of the engine arm (A) and the server (B) on the tiny model; results.json by arm key."""
    result = run("--model", str(tiny_model), "--device", "cpu", *group, "bench", "--len-sigma", "0", "--out",
                 str(out), *args, "--ab", "", f"openai:{url}")
    assert result.exit_code == 0, result.output
    data = json.loads((out / "results.json").read_text())
    return {arm["key"]: arm for arm in data["arms"]} | {"table": (out / "table.txt").read_text()}


def records(arm: dict[str, Any]) -> list[list[dict[str, Any]]]:
    return [run_["requests"] for run_ in arm["runs"]]


def test_greedy_outputs_and_records_of_a_server_are_the_engine_arms(tiny_model, served, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    arms = bench(tiny_model, tmp_path / "out", served, "--num-requests", "4", "--input-len", "12", "--output-len",
                 "6", "--repeats", "2", "--warmup-rounds", "1")
    engine, server = arms["A"], arms["B"]
    assert server["kind"] == "openai" and engine["kind"] == "engine"
    assert server["config"]["url"] == served and server["config"]["model"] == NAME
    assert server["config"]["tokenizer"] == str(tiny_model) and server["config"]["api_key"] is True
    assert server["summary"]["outputs_match"]["values"] == [1.0, 1.0]
    for ours, theirs in zip(records(engine), records(server), strict=True):
        assert len(ours) == len(theirs) == 4
        for mine, want in zip(theirs, ours):
            assert (mine["session"], mine["turn"], mine["prompt_tokens"]) == (want["session"], want["turn"], 12)
            assert mine["output_ids"] == want["output_ids"] and len(mine["output_ids"]) == 6
            assert mine["output_tokens"] == len(mine["token_times_s"]) == 6
            times = mine["token_times_s"]
            assert mine["arrival_s"] <= times[0] and times == sorted(times) and times[-1] <= mine["finish_s"]
    assert all(run_["engine"] is None for run_ in server["runs"])
    assert server["summary"]["prefix_hit_rate"]["median"] is None  # a server reports no KV counters
    assert server["summary"]["output_tokens_per_s"]["median"] > 0
    row = next(line for line in arms["table"].splitlines() if "outputs = first arm" in line)
    assert row.count("100.0%") == 2


def test_multi_turn_conversations_carry_the_servers_outputs(tiny_model, served, tmp_path, monkeypatch):
    """Each turn's prompt is the history with the server's own output ids: the engine arm's, token for token."""
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    arms = bench(tiny_model, tmp_path / "out", served, "--workload", "multi-turn", "--num-requests", "2", "--turns",
                 "3", "--input-len", "6", "--output-len", "4", "--rate", "20", "--repeats", "1", "--warmup-rounds",
                 "0")
    (ours,), (theirs,) = records(arms["A"]), records(arms["B"])
    assert [(r["session"], r["turn"]) for r in theirs] == [(s, t) for s in range(2) for t in range(3)]
    assert [r["output_ids"] for r in theirs] == [r["output_ids"] for r in ours]
    assert [r["prompt_tokens"] for r in theirs] == [r["prompt_tokens"] for r in ours]
    for before, after in zip(theirs, theirs[1:]):
        if after["session"] == before["session"]:  # the history, then 6 new user tokens
            assert after["prompt_tokens"] == before["prompt_tokens"] + 4 + 6
            assert after["arrival_s"] >= before["finish_s"]
    assert arms["B"]["summary"]["outputs_match"]["values"] == [1.0]


def test_sampled_outputs_of_a_server_are_not_compared(tiny_model, served, tmp_path, monkeypatch):
    """Seeded sampling reaches the server (two runs sample alike), and its stream is its own: outputs n/a."""
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    runs = [bench(tiny_model, tmp_path / name, served, "--num-requests", "2", "--input-len", "8", "--output-len", "8",
                  "--temperature", "2.0", "--sampling-seed", "3", "--repeats", "1", "--warmup-rounds", "0")
            for name in ("first", "again")]
    first, again = ([r["output_ids"] for r in records(arms["B"])[0]] for arms in runs)
    assert first == again
    greedy = bench(tiny_model, tmp_path / "greedy", served, "--num-requests", "2", "--input-len", "8",
                   "--output-len", "8", "--repeats", "1", "--warmup-rounds", "0")
    assert [r["output_ids"] for r in records(greedy["B"])[0]] != first  # sampled, not greedy
    assert runs[0]["B"]["summary"]["outputs_match"]["median"] is None
    assert "openai arms draw from their server's: outputs n/a" in " ".join(runs[0]["table"].split())


def test_embeddings_of_a_server_are_the_engine_arms(tiny_model, served, tmp_path, monkeypatch):
    """--dimensions and --no-normalize reach the server: its vectors are the engine arm's to float rounding."""
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    arms = bench(tiny_model, tmp_path / "out", served, "--task", "embed", "--num-requests", "3", "--input-len", "10",
                 "--dimensions", "8", "--no-normalize", "--repeats", "1", "--warmup-rounds", "0")
    (theirs,) = records(arms["B"])
    assert [(r["embed"], r["prompt_tokens"], r["output_tokens"]) for r in theirs] == [(True, 10, 0)] * 3
    assert arms["B"]["summary"]["embeddings_max_diff"]["median"] < 1e-4
    assert arms["B"]["summary"]["embeddings_per_s"]["median"] > 0

    result = run("--model", str(tiny_model), "bench", "--task", "embed", "--pooling", "last", "--ab", "",
                 "openai:http://127.0.0.1:9/v1")  # refused before any arm is built
    assert result.exit_code == 2 and "cannot choose a pooler ('last')" in result.output
    lines = tmp_path / "w.jsonl"
    lines.write_text(json.dumps({"prompt": [5, 6, 7], "max_tokens": 2}) + "\n"
                     + json.dumps({"prompt": [5, 6, 7], "embed": {"pooling": "mean"}}) + "\n")
    result = run("--model", str(tiny_model), "--device", "cpu", "bench", "--workload", "file", "--file", str(lines),
                 "--ab", "", f"openai:{served}")
    assert result.exit_code == 2, result.output
    assert "line 2: arm B" in result.output and "cannot choose a pooler ('mean')" in result.output


def test_lora_sessions_name_their_adapter_as_the_model(tiny_model, served, adapter, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", TOKEN)
    common = ("--num-requests", "2", "--input-len", "8", "--output-len", "6", "--repeats", "1", "--warmup-rounds",
              "0")
    base = bench(tiny_model, tmp_path / "base", served, *common)
    arms = bench(tiny_model, tmp_path / "lora", served, *common, "--lora-adapter", ADAPTER,
                 group=("--lora", f"{ADAPTER}={adapter}"))
    assert arms["B"]["config"]["adapters"] == [ADAPTER]
    assert arms["B"]["summary"]["outputs_match"]["values"] == [1.0]  # the engine arm's adapted tokens
    assert [r["output_ids"] for r in records(arms["B"])[0]] != [r["output_ids"] for r in records(base["B"])[0]]
    result = run("--model", str(tiny_model), "--device", "cpu", "--lora", f"other={adapter}", "bench",
                 "--lora-adapter", "other", *common, "--ab", "", f"openai:{served}")
    assert result.exit_code == 1 and "serves no LoRA adapter other (GET /models lists sql)" in result.output


def test_unreachable_refused_and_unauthorized_servers_are_clear_errors(tiny_model, served, monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    common = ["--model", str(tiny_model), "--device", "cpu", "bench", "--num-requests", "1", "--repeats", "1",
              "--ab", ""]
    result = run(*common, "openai:ftp://127.0.0.1/v1")
    assert result.exit_code == 2 and "is not an http or https URL with a host" in result.output
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    result = run(*common, f"openai:http://127.0.0.1:{closed}/v1")
    assert result.exit_code == 1 and f"cannot reach GET http://127.0.0.1:{closed}/v1/models" in result.output
    result = run(*common, f"openai:{served}")  # no OPENAI_API_KEY: the server's 401, with its message
    assert result.exit_code == 1 and "answered 401" in result.output and "bearer token" in result.output


def test_an_arm_url_must_be_an_api_base():
    assert parse_openai_url(" https://api.example.com:8443/v1/ ") == "https://api.example.com:8443/v1"
    for bad in ("127.0.0.1:8000/v1", "http:///v1", "http://h:99999/v1", "http://h/v1?x=1"):
        with pytest.raises(ArmError):
            parse_openai_url(bad)


def test_sampling_goes_by_openais_and_vllms_field_names():
    """vLLM's names and senses: priority lower first, so infer's (higher first) goes negated."""
    params = SamplingParams(max_tokens=3, temperature=0.5, top_k=4, min_p=0.1, seed=0, repetition_penalty=1.2,
                            presence_penalty=0.3, min_tokens=2, logit_bias=((7, -5.0),), priority=2)
    assert sampling_fields(params) == {"temperature": 0.5, "top_p": 1.0, "top_k": 4, "min_p": 0.1, "seed": 0,
                                       "repetition_penalty": 1.2, "presence_penalty": 0.3, "min_tokens": 2,
                                       "logit_bias": {"7": -5.0}, "priority": -2}
    assert sampling_fields(SamplingParams(temperature=0.0)) == {"temperature": 0.0, "top_p": 1.0}


class FakeServer:
    """A server of OpenAI's API that lists ``other`` and tokenizes as ``tokens`` (None: no /tokenize, 404), whose
    completions stream text without token ids, chunked (infer's server streams unchunked)."""

    def __init__(self, loops: LoopThread, tokens: list[int] | None) -> None:
        self.tokens = tokens
        self.server = loops.call(asyncio.start_server(self.handle, "127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/v1"

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        method, path, _ = (await reader.readline()).decode().split(" ")
        length = 0
        while (line := await reader.readline()) != b"\r\n":
            name, _, value = line.decode().partition(":")
            length = int(value) if name.lower() == "content-length" else length
        body = json.loads(await reader.readexactly(length)) if length else {}
        if path == "/v1/models":
            self.answer(writer, 200, {"object": "list", "data": [{"id": "other", "object": "model", "parent": None}]})
        elif path == "/tokenize" and self.tokens is not None:
            self.answer(writer, 200, {"tokens": self.tokens, "count": len(self.tokens)})
        elif path == "/v1/completions":
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n")
            for index in range(body["max_tokens"]):  # each event split over two chunks
                event = f"data: {json.dumps({'choices': [{'index': 0, 'text': str(index)}]})}\n\n"
                writer.write(chunk(event[:12]) + chunk(event[12:]))
            writer.write(chunk("data: [DONE]\n\n") + b"0\r\n\r\n")
        else:
            self.answer(writer, 404, {"error": {"message": f"no route {method} {path}"}})
        await writer.drain()
        writer.close()

    @staticmethod
    def answer(writer: asyncio.StreamWriter, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        writer.write(f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n"
                     f"Connection: close\r\n\r\n".encode() + data)


def chunk(text: str) -> bytes:
    return f"{len(text.encode()):x}\r\n".encode() + text.encode() + b"\r\n"


def test_a_server_of_another_tokenizer_or_without_token_ids_is_refused(tiny_model, caplog):
    loops = LoopThread()
    try:
        common = ["--model", str(tiny_model), "--device", "cpu", "bench", "--num-requests", "1", "--repeats", "1",
                  "--warmup-rounds", "0", "--ab", ""]
        other = FakeServer(loops, [5, 6, 7])
        result = run(*common, f"openai:{other.url}")
        assert result.exit_code == 1, result.output
        assert "the server's model 'other' tokenizes" in result.output and "as [5, 6, 7]" in result.output
        assert f"but the bench's tokenizer ({tiny_model})" in result.output

        no_ids = FakeServer(loops, None)
        result = run(*common, f"openai:{no_ids.url}")
        assert result.exit_code == 1, result.output
        assert "streamed no token ids: the bench needs vLLM's return_token_ids" in result.output
        assert "has no /tokenize" in caplog.text  # warned, and the bench went on
    finally:
        loops.stop()


def test_what_a_server_cannot_do_is_refused_before_any_model_loads(tmp_path):
    lines = tmp_path / "w.jsonl"
    lines.write_text(json.dumps({"prompt": [5, 6], "max_tokens": 2, "structured_output": {"regex": "[0-9]"}}) + "\n")
    result = run("bench", "--workload", "file", "--file", str(lines), "--ab", "", "openai:http://127.0.0.1:9/v1")
    assert result.exit_code == 2 and "openai arms (openai:http://127.0.0.1:9/v1) do not send structured" in \
        result.output
    result = run("bench", "--logits-processor", "no-repeat-ngram", "--ab", "openai:http://127.0.0.1:9/v1")
    assert result.exit_code == 2 and "OpenAI's API takes no --logits-processor" in result.output
