"""Replay a workload against an infer engine, recording what a client sees and what the engine counts.

Each engine arm gets its own PluginManager with a :class:`StepRecorder` registered next to the installed plugins:
an ``on_step`` observer that tracks the peak of used KV blocks during a run. The engine is built once per arm
and reused by every round; counters that the engine keeps cumulatively are read as differences over a run.
"""
from __future__ import annotations

import dataclasses
import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..core.chat import ChatPrompt
from ..core.engine import Engine
from ..core.hookspecs import hookimpl
from ..core.metrics import StepStats
from ..core.plugins import PluginManager
from ..core.pooling import PoolingParams
from ..core.request import SamplingParams, StructuredOutput
from .arms import ArmSpec
from .stats import EngineCounters, RequestRecord, RunResult
from .workloads import Session, Vocab, Workload

log = logging.getLogger("infer")
WARMUP_PROMPT_TOKENS = 8  # a first short request, shorter than a default KV block


class StepRecorder:
    """An observer plugin (``on_step``): the peak of used KV blocks since :meth:`reset`."""

    def __init__(self) -> None:
        self.peak_used_blocks = 0
        self.steps = 0

    def reset(self) -> None:
        self.peak_used_blocks = 0
        self.steps = 0

    @hookimpl
    def on_step(self, stats: StepStats) -> None:
        self.steps += 1
        self.peak_used_blocks = max(self.peak_used_blocks, stats.peak_used_blocks)


@dataclass
class _Live:
    """A request in flight."""

    session: int
    turn: int
    arrival_s: float
    prompt: list[int]
    output: list[int] = field(default_factory=list)
    times: list[float] = field(default_factory=list)
    embed: bool = False  # an embedding request: its one output carries the embedding


class Replay:
    """Arrival bookkeeping shared by every arm: which turn of which session is due when, and its prompt.

    A multi-turn session's next turn is due when its previous turn finishes; its prompt is the history (every
    earlier prompt and output) followed by the new user tokens.
    """

    def __init__(self, workload: Workload) -> None:
        self.sessions: list[Session] = list(workload.sessions)
        self.due: list[tuple[float, int, int]] = [(s.arrival_s, i, 0) for i, s in enumerate(self.sessions)]
        heapq.heapify(self.due)
        self.history: dict[int, list[int]] = {}

    def next_arrival(self) -> float | None:
        return self.due[0][0] if self.due else None

    def pop_due(self, now: float) -> list[tuple[float, int, int, list[int], int]]:
        """(arrival, session, turn, prompt, max_tokens) of every turn due by ``now``."""
        ready = []
        while self.due and self.due[0][0] <= now:
            arrival, s, t = heapq.heappop(self.due)
            turn = self.sessions[s].turns[t]
            ready.append((arrival, s, t, self.history.get(s, []) + list(turn.tokens), turn.max_tokens))
        return ready

    def finished(self, session: int, turn: int, prompt: list[int], output: list[int], now: float) -> None:
        self.history[session] = prompt + output
        if turn + 1 < len(self.sessions[session].turns):
            heapq.heappush(self.due, (now, session, turn + 1))

    def pending(self) -> bool:
        return bool(self.due)


class EngineArm:
    """An infer engine built from an arm's options, with its step recorder. ``task`` is the kind of its warm-up's
    first request ("embed": an embedding, which a checkpoint without an LM head can serve)."""

    def __init__(self, spec: ArmSpec, plugins: PluginManager, task: str = "generate") -> None:
        assert spec.args is not None
        self.spec, self.task = spec, task
        self.recorder = StepRecorder()
        plugins.register(self.recorder, name="infer-bench-recorder", source="infer bench")
        # measured as `infer serve` runs (a frozen heap); the engines live until the bench ends
        self.engine = Engine(spec.args.build(plugins, freeze_gc=True), plugins)
        tokenizer = self.engine.tokenizer
        special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self.vocab = Vocab(self.engine.loaded.model.spec.vocab_size, special)
        self.max_model_len = self.engine.max_model_len
        self.kv_capacity_tokens: int | None = self.engine.num_blocks * self.engine.config.block_size
        self.warmup_counters: dict[str, int] = {}
        self.warned_warm = False
        config = self.engine.config
        self.cpu_threads = config.cpu_threads if self.engine.loaded.device.type == "cpu" else None
        self.freeze_gc = bool(config.freeze_gc)
        self.kept: set[StructuredOutput] = set()  # the workload's grammars, compiled once (keep_structured)

    def describe(self) -> dict[str, object]:
        config = self.engine.config
        return {"components": dict(self.engine.active), "num_kv_blocks": self.engine.num_blocks,
                "device": str(self.engine.loaded.device), "dtype": str(self.engine.loaded.dtype),
                "config": dataclasses.asdict(config)}

    def tokenize(self, prompt: str | ChatPrompt) -> list[int]:
        return self.engine.tokenize(prompt)

    def check_request(self, prompt: list[int], max_tokens: int) -> None:
        self.engine.check_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))

    def check_embedding(self, prompt: list[int], pooling: PoolingParams) -> None:
        """InferError where the engine would refuse this embedding request (an unknown pooler, say)."""
        self.engine.check_request(prompt, pooling)

    def reasons_before_grammar(self, chat: ChatPrompt) -> bool:
        """Whether this engine serves ``chat``'s own structured output after a reasoning block (its reasoning parser
        says where that block ends in the rendered prompt)."""
        parser = self.engine.intake.reasoning_parser
        return parser is not None and parser.reasoning_end(self.engine.tokenize(chat)) is not None

    def keep_structured(self, params: SamplingParams) -> None:
        """Compile the structured output of ``params`` (InferError for one this arm cannot follow), and keep it
        compiled while the arm lives: compiling is never inside a run."""
        self.engine.check_structured_output(params)
        spec = params.structured_output
        if spec is not None and spec not in self.kept:
            self.kept.add(spec)
            self.engine.structured.admit(spec)

    def warm_up(self, workloads: list[Workload]) -> None:
        """A short request, then each warm-up workload, unmeasured: first-call costs (kernels, allocator growth)
        are not timed. The prefix-cache counters they move are kept in ``warmup_counters``."""
        before = self.engine.kv.stats()
        short = [list(self.vocab.allowed[:WARMUP_PROMPT_TOKENS])]
        if self.task == "embed":
            self.engine.embed(short, PoolingParams(pooling="last"))  # whatever the checkpoint's default
        else:
            self.engine.generate(short, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        for workload in workloads:
            self.run(workload, lambda: None)
        after = self.engine.kv.stats()
        self.warmup_counters = {"prefix_queries": after.prefix_queries - before.prefix_queries,
                                "prefix_hits": after.prefix_hits - before.prefix_hits}

    def run(self, workload: Workload, on_request_done: Callable[[], None]) -> RunResult:
        engine = self.engine
        cold = engine.kv.reset_prefix_cache()  # no run finds another's prompts (a file workload repeats them)
        if not cold and engine.config.enable_prefix_caching and not self.warned_warm:
            self.warned_warm = True
            log.warning("arm %s: KV cache %r cannot drop its prefix cache between runs, so a run may hit prompts of "
                        "an earlier one (the file workload repeats its prompts)", self.spec.key, engine.config.kv_cache)
        kv_before = engine.kv.stats()
        preempt_before = engine.scheduler.num_preemptions
        spec_before = (engine.stats.spec_proposed, engine.stats.spec_accepted)
        self.recorder.reset()
        replay = Replay(workload)
        live: dict[str, _Live] = {}
        records: list[RequestRecord] = []
        start = time.perf_counter()
        while replay.pending() or live:
            now = time.perf_counter() - start
            for arrival, s, t, prompt, max_tokens in replay.pop_due(now):
                session = workload.sessions[s]
                turn = session.turns[t]
                params: SamplingParams | PoolingParams
                if turn.pooling is not None:
                    params = dataclasses.replace(turn.pooling, priority=turn.priority,
                                                 lora_adapter=session.lora_adapter)
                else:
                    params = workload.sampling.params(max_tokens, workload.round, s, t, session.lora_adapter,
                                                      turn.structured_output, turn.priority)
                rid = engine.add_request(prompt, params, request_id=f"bench-{workload.round}-{s}-{t}")
                live[rid] = _Live(s, t, arrival, prompt, embed=turn.pooling is not None)
            if not live:
                next_at = replay.next_arrival()
                if next_at is not None:
                    time.sleep(max(0.0, next_at - now))
                continue
            outputs = engine.step()
            now = time.perf_counter() - start
            for out in outputs:
                item = live[out.request_id]
                for completion in out.outputs:
                    item.output += completion.token_ids
                    item.times += [now] * len(completion.token_ids)
                if out.finished:
                    del live[out.request_id]
                    records.append(RequestRecord(item.session, item.turn, item.arrival_s, len(item.prompt),
                                                 len(item.output), item.times, now, out.num_cached_tokens,
                                                 item.output, workload.priority(item.session, item.turn),
                                                 item.embed, out.embedding if item.embed else None))
                    replay.finished(item.session, item.turn, item.prompt, item.output, now)
                    on_request_done()
        duration = time.perf_counter() - start
        kv_after = engine.kv.stats()
        counters = EngineCounters(
            kv_total_blocks=kv_after.total_blocks,
            kv_peak_used_blocks=self.recorder.peak_used_blocks,
            prefix_queries=kv_after.prefix_queries - kv_before.prefix_queries,
            prefix_hits=kv_after.prefix_hits - kv_before.prefix_hits,
            preemptions=engine.scheduler.num_preemptions - preempt_before,
            evictions=kv_after.evictions - kv_before.evictions,
            spec_proposed=engine.stats.spec_proposed - spec_before[0],
            spec_accepted=engine.stats.spec_accepted - spec_before[1],
            speculative=engine.config.proposer is not None,
        )
        records.sort(key=lambda r: (r.session, r.turn))
        return RunResult(self.spec.key, workload.round, duration, records, counters,
                         {"steps": self.recorder.steps, "cold_prefix_cache": cold})
