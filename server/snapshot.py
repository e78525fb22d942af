"""The engine's load as the server reports it (GetStats, metrics): a snapshot read on the worker thread, and the
output throughput over a sliding window."""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

THROUGHPUT_WINDOW_S = 10.0
BEAM_SEARCH_TOTALS = ("beam_searches_finished", "beam_searches_aborted", "beam_searches_failed", "beam_search_restarts",
                      "beam_search_waits")


@dataclass
class EngineSnapshot:
    """Engine load, read on the worker thread (so it is consistent with the engine's own state)."""

    queue_depth: int
    num_running: int
    kv_total_blocks: int
    kv_free_blocks: int
    kv_used_blocks: int
    kv_cached_blocks: int
    prefix_hit_rate: float
    spec_acceptance_rate: float
    requests_finished: int
    embedding_requests_finished: int
    prompt_tokens: int
    output_tokens: int
    steps: int
    preemptions: int
    mean_ttft_ms: float
    mean_tpot_ms: float
    output_tokens_per_s: float
    spec_enabled: bool
    spec_steps_on: int
    spec_steps_off_large_batch: int
    spec_steps_off_low_acceptance: int
    beam_searches: int
    beam_searches_finished: int
    beam_searches_aborted: int
    beam_searches_failed: int
    beam_search_restarts: int
    beam_search_waits: int
    lora_requests: dict[str, int]  # every adapter served: its requests and beam searches under way


@dataclass
class Throughput:
    """Output tokens per second over a sliding window."""

    window_s: float = THROUGHPUT_WINDOW_S
    started: float = field(default_factory=time.monotonic)
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def add(self, now: float, tokens: int) -> None:
        """One sample per engine step; what fell out of the window goes, so a server nobody polls stays small."""
        if tokens:
            self.samples.append((now, tokens))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self.samples and self.samples[0][0] < now - self.window_s:
            self.samples.popleft()

    def rate(self, now: float) -> float:
        self._expire(now)
        span = min(self.window_s, now - self.started)
        return sum(t for _, t in self.samples) / span if span > 0 else 0.0


def read_snapshot(engine: Any, output_tokens_per_s: float, beam_searches: int) -> EngineSnapshot:
    """``engine``'s load (the server holds no request back: each goes to the engine as it arrives);
    ``beam_searches``: the server's beam searches under way."""
    kv = engine.kv.stats()
    summary = engine.stats.summary()
    return EngineSnapshot(
        queue_depth=engine.scheduler.num_waiting(),
        num_running=engine.scheduler.num_running(),
        kv_total_blocks=kv.total_blocks,
        kv_free_blocks=kv.free_blocks,
        kv_used_blocks=kv.used_blocks,
        kv_cached_blocks=kv.cached_blocks,
        prefix_hit_rate=kv.prefix_hits / kv.prefix_queries if kv.prefix_queries else 0.0,
        spec_acceptance_rate=float(summary["spec_acceptance_rate"]),
        requests_finished=int(summary["requests_finished"]),
        embedding_requests_finished=int(summary["embedding_requests_finished"]),
        prompt_tokens=int(summary["prompt_tokens"]),
        output_tokens=int(summary["output_tokens"]),
        steps=int(summary["steps"]),
        preemptions=engine.scheduler.num_preemptions,
        mean_ttft_ms=float(summary["mean_ttft_ms"]),
        mean_tpot_ms=float(summary["mean_tpot_ms"]),
        output_tokens_per_s=output_tokens_per_s,
        spec_enabled=bool(summary["spec_enabled"]),
        spec_steps_on=int(summary["spec_steps_on"]),
        spec_steps_off_large_batch=int(summary["spec_steps_off_large_batch"]),
        spec_steps_off_low_acceptance=int(summary["spec_steps_off_low_acceptance"]),
        beam_searches=beam_searches,
        **{name: int(summary[name]) for name in BEAM_SEARCH_TOTALS},
        lora_requests=lora_requests(engine),
    )


def lora_requests(engine: Any) -> dict[str, int]:
    from ..core.lora import lora_users

    users = lora_users(engine)
    return {name: len(users.get(name, ())) for name in engine.lora_adapters}
