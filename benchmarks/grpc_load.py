"""Serving overhead: load generators against `infer serve` on loopback, over gRPC (grpc.aio) and over OpenAI's HTTP
API (streaming /v1/completions, `serve --http-port`), against the same workload run offline on an Engine in this
process (driven from a second thread, as the server drives its engine). The HTTP side can drive any server of
OpenAI's API that takes token-id prompts and vLLM's ``ignore_eos`` (``--http-url``: vLLM, SGLang, another infer),
so that a peer runs side by side with the same load.

At each concurrency level a closed loop keeps C requests in flight until N requests have been sent or the time limit
passes (then the requests in flight finish). Each level runs ``--repeat`` times per side, the sides alternating, and
the runs of a side are pooled (a shared machine's busy spells then hit both sides alike). Both sides get the same
prompts (random token ids, fresh per run so the prefix cache serves nothing), greedy, ``ignore_eos``, the same
max_tokens. Reported per side: requests/s, output tokens/s, TTFT and TPOT p50/p99; and each side's throughput over
the offline one's. On the HTTP side a token's time is that of the event that carried it (the tokens counted by the
last event's usage).

Run: ``python benchmarks/grpc_load.py --model DIR`` (no --model: a tiny random Llama is written to a temp folder).
The server is started as ``infer --model DIR serve --http-port P`` on free 127.0.0.1 ports and stopped at the end.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVED_NAME = "model"  # the started server's --served-model-name


@dataclass
class Record:
    """One request's timings (perf_counter seconds)."""

    sent: float
    first: float | None = None
    last: float | None = None
    tokens: int = 0

    def observe(self, now: float, tokens: int) -> None:
        if tokens:
            self.first = now if self.first is None else self.first
            self.last = now
            self.tokens += tokens


@dataclass
class Result:
    side: str
    concurrency: int
    requests: int
    seconds: float
    output_tokens: int
    ttft_ms: list[float] = field(default_factory=list)
    tpot_ms: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, side: str, concurrency: int, records: list[Record], seconds: float) -> Result:
        done = [r for r in records if r.first is not None]
        return cls(side, concurrency, len(done), seconds, sum(r.tokens for r in done),
                   [1000 * (r.first - r.sent) for r in done if r.first is not None],
                   [1000 * (r.last - r.first) / (r.tokens - 1) for r in done
                    if r.first is not None and r.last is not None and r.tokens > 1])

    @classmethod
    def pooled(cls, runs: list[Result]) -> Result:
        """Repeated runs as one: summed requests, tokens and time; the latencies of all of them."""
        return cls(runs[0].side, runs[0].concurrency, sum(r.requests for r in runs), sum(r.seconds for r in runs),
                   sum(r.output_tokens for r in runs), [x for r in runs for x in r.ttft_ms],
                   [x for r in runs for x in r.tpot_ms])

    def summary(self) -> dict[str, float]:
        return {"req_per_s": self.requests / self.seconds, "out_tok_per_s": self.output_tokens / self.seconds,
                "ttft_p50_ms": pct(self.ttft_ms, 50), "ttft_p99_ms": pct(self.ttft_ms, 99),
                "tpot_p50_ms": pct(self.tpot_ms, 50), "tpot_p99_ms": pct(self.tpot_ms, 99)}


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def workload(level: int, n: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed * 1000 + level)
    return [[rng.randrange(3, vocab) for _ in range(prompt_len)] for _ in range(n)]


# ---------------------------------------------------------------- offline
def run_offline(engine: Any, prompts: list[list[int]], concurrency: int, params: Any, time_limit: float) -> Result:
    """The same closed loop, calling Engine.add_request / step directly."""
    queue = list(reversed(prompts))
    in_flight: dict[str, Record] = {}
    done: list[Record] = []
    start = time.perf_counter()
    while queue or in_flight:
        while queue and len(in_flight) < concurrency and time.perf_counter() - start < time_limit:
            prompt = queue.pop()
            in_flight[engine.add_request(prompt, params)] = Record(time.perf_counter())
        if time.perf_counter() - start >= time_limit:
            queue.clear()
        for out in engine.step():
            rec = in_flight[out.request_id]
            rec.observe(time.perf_counter(), sum(len(c.token_ids) for c in out.outputs))
            if out.finished:
                done.append(in_flight.pop(out.request_id))
    return Result.of("offline", concurrency, done, time.perf_counter() - start)


# ---------------------------------------------------------------- gRPC
async def run_grpc(target: str, prompts: list[list[int]], concurrency: int, max_tokens: int,
                   time_limit: float) -> Result:
    from infer.server.client import AsyncClient

    queue = list(reversed(prompts))
    done: list[Record] = []
    start = time.perf_counter()

    async def worker(client: AsyncClient) -> None:
        while queue and time.perf_counter() - start < time_limit:
            prompt = queue.pop()
            rec = Record(time.perf_counter())
            async for response in client.generate(prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
                rec.observe(time.perf_counter(), sum(len(o.token_ids) for o in response.outputs))
            done.append(rec)

    async with AsyncClient(target, max_message_bytes=64 * 1024 * 1024) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return Result.of("grpc", concurrency, done, time.perf_counter() - start)


# ---------------------------------------------------------------- OpenAI's HTTP API
async def run_http(url: str, model: str, api_key: str | None, prompts: list[list[int]], concurrency: int,
                   max_tokens: int, time_limit: float) -> Result:
    """The same closed loop over streaming ``POST {url}/completions``, one connection per request
    (infer.bench.openai_client: stdlib only)."""
    from infer.bench.openai_client import Endpoint, post_events

    endpoint = Endpoint(url, api_key)
    queue = list(reversed(prompts))
    done: list[Record] = []
    start = time.perf_counter()

    async def one(prompt: list[int]) -> Record:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        rec = Record(time.perf_counter())
        async for event in post_events(endpoint, endpoint.path("/completions"), body):
            chunk = json.loads(event)
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                rec.observe(time.perf_counter(), 1)
            if chunk.get("usage"):
                rec.tokens = chunk["usage"]["completion_tokens"]
        return rec

    async def worker() -> None:
        while queue and time.perf_counter() - start < time_limit:
            done.append(await one(queue.pop()))

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return Result.of("http", concurrency, done, time.perf_counter() - start)


def in_thread(fn: Callable[..., Result], *args: Any) -> Result:
    """Run the offline loop on a second thread, as the server drives its engine: same threading conditions
    (on a busy 2-core machine torch's intra-op threads made main-thread steps many times slower)."""
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(fn, *args).result()


def start_server(model: str, port: int, http_port: int) -> subprocess.Popen[bytes]:
    exe = shutil.which("infer")
    cmd = [exe] if exe else [sys.executable, "-P", "-c", "from infer.cli import main; main()"]
    return subprocess.Popen([*cmd, "--model", model, "serve", "--port", str(port), "--max-queue", "100000",
                             "--http-port", str(http_port), "--served-model-name", SERVED_NAME],
                            stderr=subprocess.DEVNULL)


def wait_serving(target: str, proc: subprocess.Popen[bytes] | None, timeout: float = 180.0) -> None:
    from infer.server.client import Client

    deadline = time.monotonic() + timeout
    with Client(target) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise SystemExit(f"infer serve exited with {proc.returncode}")
            try:
                if client.health(timeout=1.0) == "SERVING":
                    return
            except Exception:
                pass
            time.sleep(0.2)
    raise SystemExit(f"{target} was not SERVING within {timeout} s")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------- report
def report(rows: list[tuple[Result, list[Result]]], emit: Callable[[str], None] = print) -> None:
    emit("| concurrency | side | requests | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
         "TPOT p99 ms | side/offline tok/s |")
    emit("|---|---|---|---|---|---|---|---|---|---|")
    for offline, online in rows:
        base = offline.summary()["out_tok_per_s"]
        for r in (offline, *online):
            s = r.summary()
            ratio = f"{s['out_tok_per_s'] / base:.2f}" if r is not offline else ""
            emit(f"| {r.concurrency} | {r.side} | {r.requests} | {s['req_per_s']:.1f} | {s['out_tok_per_s']:.0f} | "
                 f"{s['ttft_p50_ms']:.1f} | {s['ttft_p99_ms']:.1f} | {s['tpot_p50_ms']:.2f} | {s['tpot_p99_ms']:.2f} | "
                 f"{ratio} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF model folder (default: a tiny random Llama in a temp folder)")
    ap.add_argument("--sides", default="grpc,http", help="serving sides beside offline: grpc, http or both")
    ap.add_argument("--target", help="host:port of a running `infer serve` (default: start one on loopback)")
    ap.add_argument("--http-url", help="base URL of a running server of OpenAI's API, e.g. http://HOST:8000/v1 "
                                       "(default: the started server's --http-port)")
    ap.add_argument("--served-model-name", default=SERVED_NAME, help="the body's model, for --http-url")
    ap.add_argument("--api-key", help="bearer token for --http-url")
    ap.add_argument("--concurrency", default="1,8,32,64", help="comma-separated levels")
    ap.add_argument("--requests", type=int, default=0, help="requests per level and side (default: max(32, 4*C))")
    ap.add_argument("--time-limit", type=float, default=60.0, help="seconds per run before no new sends")
    ap.add_argument("--repeat", type=int, default=3, help="runs per level and side, alternated and pooled")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, help="also write the results here")
    args = ap.parse_args(argv)
    sides = [side.strip() for side in args.sides.split(",") if side.strip()]
    if not sides or set(sides) - {"grpc", "http"}:
        ap.error(f"--sides takes grpc, http or both, got {args.sides!r}")

    from infer.bench.openai_client import OpenAIServerError
    from infer.core.config import EngineConfig
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    tmp = None
    model = args.model
    if model is None:
        from infer.models.tiny import make_tiny_model

        tmp = tempfile.TemporaryDirectory()
        model = str(make_tiny_model(Path(tmp.name) / "tiny", "llama"))
    levels = [int(c) for c in args.concurrency.split(",")]
    port, http_port = free_port(), free_port()
    target = args.target or f"127.0.0.1:{port}"
    url = args.http_url or f"http://127.0.0.1:{http_port}/v1"
    external = args.target or args.http_url
    proc = None if external else start_server(model, port, http_port)
    try:
        engine = Engine(EngineConfig(model=model))  # loads while the server starts
        if "grpc" in sides or proc is not None:
            wait_serving(target, proc)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        vocab = engine.loaded.model.spec.vocab_size

        def run_side(side: str, prompts: list[list[int]], c: int, time_limit: float) -> Result:
            if side == "grpc":
                return asyncio.run(run_grpc(target, prompts, c, args.max_tokens, time_limit))
            try:
                return asyncio.run(run_http(url, args.served_model_name, args.api_key, prompts, c, args.max_tokens,
                                            time_limit))
            except OpenAIServerError as exc:
                raise SystemExit(str(exc)) from None

        warm = workload(-1, 8, args.prompt_len, vocab, args.seed)
        in_thread(run_offline, engine, warm, 8, params, 60)
        for side in sides:
            run_side(side, warm, 8, 60)
        rows = []
        for c in levels:
            offline_runs: list[Result] = []
            online_runs: dict[str, list[Result]] = {side: [] for side in sides}
            for rep in range(args.repeat):  # alternate the sides, so that a busy spell hits each
                prompts = workload(c * 100 + rep, args.requests or max(32, 4 * c), args.prompt_len, vocab, args.seed)
                offline_runs.append(in_thread(run_offline, engine, prompts, c, params, args.time_limit))
                for side in sides:
                    online_runs[side].append(run_side(side, prompts, c, args.time_limit))
            offline = Result.pooled(offline_runs)
            online = [Result.pooled(runs) for runs in online_runs.values()]
            rows.append((offline, online))
            print(f"concurrency {c}: offline {offline.summary()['out_tok_per_s']:.0f} tok/s, " + ", ".join(
                f"{r.side} {r.summary()['out_tok_per_s']:.0f} tok/s" for r in online), file=sys.stderr)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
        if tmp is not None:
            tmp.cleanup()
    report(rows)
    if args.json:
        args.json.write_text(json.dumps([{"side": r.side, "concurrency": r.concurrency, "requests": r.requests,
                                          "seconds": r.seconds, "output_tokens": r.output_tokens, **r.summary()}
                                         for offline, online in rows for r in (offline, *online)], indent=2))


if __name__ == "__main__":
    main()
