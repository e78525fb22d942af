"""Engine metrics: per-step stats for observers, and running totals (TTFT, TPOT, ITL, KV, prefix hits)."""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

from .interfaces import KVCache, KVStats, Scheduler, SchedulerOutput
from .request import Sequence, SequenceStatus


LATENCY_SAMPLES = 10_000  # bounded, so that a long-running server does not grow


@dataclass
class StepTimes:
    """When a step's forward pass was launched (after scheduling) and returned, the tokens in flight were read back,
    and the due outputs were built; and the KV blocks in use as the forward pass ran."""

    scheduled: float
    executed: float
    settled: float
    emitted: float
    used_blocks: int = 0


@dataclass
class StepStats:
    """One engine step, passed to the ``on_step`` hook."""

    step: int
    duration_s: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_waiting: int
    num_running: int
    num_preempted: int
    kv: KVStats  # at the end of the step: the sequences that finished in it freed their blocks
    peak_used_blocks: int = 0  # KV blocks in use as the step's forward pass ran (before those sequences freed theirs)
    spec_state: str = "off"  # speculative decoding this step: off (no proposer), on, or off-* (graceful degradation)
    num_draft_tokens: int = 0  # draft tokens verified this step
    num_accepted_tokens: int = 0  # of which the verification accepted (a stop may still cut some from the output)
    # Host wall time of the step's phases. On a GPU, work is queued asynchronously: `execute_s` is preparing the
    # batch and launching the forward pass, and the wait for the device falls in `sample_s`, which reads the tokens
    # (with async scheduling, the previous step's tokens, read back while this step's forward pass runs).
    schedule_s: float = 0.0  # the scheduler (and the proposer's drafts, when speculating)
    execute_s: float = 0.0  # building the batch tensors and running (or launching) the model
    sample_s: float = 0.0  # sampling and, with speculation, verification
    postprocess_s: float = 0.0  # appending tokens, stop checks, detokenization, outputs, stats


@dataclass
class EngineStats:
    """Totals since the engine started, as shown by ``infer generate --stats`` and GetStats."""

    steps: int = 0
    requests_finished: int = 0
    embedding_requests_finished: int = 0  # of requests_finished, the embedding requests (PoolingParams)
    prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    num_waiting: int = 0
    num_running: int = 0
    kv: KVStats | None = None
    kv_peak_used_blocks: int = 0
    kv_waste_slots: int = 0  # allocated slots holding no token, over the sequences the last step ran
    kv_max_waste_per_seq: float = 0.0  # the largest waste per running sequence seen at any step, in slots
    spec_proposed: int = 0
    spec_accepted: int = 0  # accepted drafts kept in the outputs (a stop token or string cuts what follows it)
    spec_rounds: int = 0  # verifications: one per sequence and step that verified drafts
    spec_emitted: int = 0  # output tokens those verifications produced (accepted drafts + 1 each, less stop cuts)
    spec_judged: int = 0  # drafts the target judged: the accepted ones and the first rejected (those after go unseen)
    spec_judged_accepted: int = 0  # accepted drafts, stop cuts aside (the drafts' quality)
    spec_grammar_refused: int = 0  # structured output: rounds whose drafts the grammar refused one of (cut there)
    beam_searches_finished: int = 0  # ended with their beams (max_tokens, or every hypothesis done)
    beam_searches_aborted: int = 0  # stopped early (Engine.abort_beam_search): their best beams so far
    beam_searches_failed: int = 0  # ended by an error (CapacityError, a plugin's)
    beam_search_restarts: int = 0  # searches begun again because an older one needed their blocks: work redone
    beam_search_waits: int = 0  # steps a search skipped, waiting for KV blocks that others held
    spec_state: str = "off"  # the last step's: off (no proposer), on, off-large-batch, off-low-acceptance
    spec_steps: dict[str, int] = field(default_factory=dict)  # steps per speculation state
    phase_s: dict[str, float] = field(default_factory=dict)  # summed StepStats phase times: schedule, execute, ...
    ttft_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))  # the latest requests
    tpot_s: deque[float] = field(default_factory=lambda: deque(maxlen=LATENCY_SAMPLES))

    @property
    def prefix_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens looked up."""
        return self.kv.prefix_hits / self.kv.prefix_queries if self.kv and self.kv.prefix_queries else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.spec_accepted / self.spec_proposed if self.spec_proposed else 0.0

    def record_step(self, out: SchedulerOutput, kv: KVCache, scheduler: Scheduler, start: float, times: StepTimes,
                    sampled: float, decode_tokens: int) -> StepStats:
        """Update the totals after a step that began at ``start`` and sampled at ``sampled``, in which
        ``decode_tokens`` items were decodes (:func:`count_decodes`); return its StepStats. Sampling time includes
        the wait for tokens read back; postprocess is the rest of the step."""
        schedule_s, execute_s = times.scheduled - start, times.executed - times.scheduled
        sample_s = times.settled - times.executed + sampled - times.emitted
        self.steps += 1
        kv_stats = self.refresh(kv, scheduler)
        peak = max(times.used_blocks, kv_stats.used_blocks)
        self.kv_peak_used_blocks = max(self.kv_peak_used_blocks, peak)
        ran = [item.seq for item in out.scheduled if item.seq.status is SequenceStatus.RUNNING]
        self.kv_waste_slots = kv_waste_slots(kv, ran)
        if ran:
            self.kv_max_waste_per_seq = max(self.kv_max_waste_per_seq, self.kv_waste_slots / len(ran))
        duration = time.perf_counter() - start
        step = StepStats(self.steps, duration, len(out.scheduled), out.num_tokens - decode_tokens, decode_tokens,
                         self.num_waiting, self.num_running, len(out.preempted), dataclasses.replace(kv_stats),
                         peak_used_blocks=peak, schedule_s=schedule_s,
                         execute_s=execute_s, sample_s=sample_s,
                         postprocess_s=duration - schedule_s - execute_s - sample_s)
        for phase in ("schedule", "execute", "sample", "postprocess"):
            self.phase_s[phase] = self.phase_s.get(phase, 0.0) + getattr(step, f"{phase}_s")
        return step

    def refresh(self, kv: KVCache, scheduler: Scheduler) -> KVStats:
        """Read the KV pool and the scheduler's counts now (after a step, and after an abort outside one)."""
        self.kv = kv_stats = kv.stats()
        self.preemptions = scheduler.num_preemptions
        self.num_waiting, self.num_running = scheduler.num_waiting(), scheduler.num_running()
        return kv_stats

    def record_finished(self, seqs: list[Sequence], arrival: float) -> dict[str, float]:
        """One finished request: one TTFT (its first token), and each sequence's TPOT. Returns the request's own
        figures for RequestOutput.metrics: ttft_s and tpot_s (mean over its sequences) when it produced tokens,
        e2e_s, num_preemptions, num_output_tokens (all its sequences')."""
        self.requests_finished += 1
        mine: dict[str, float] = {"e2e_s": time.perf_counter() - arrival,
                                  "num_preemptions": sum(seq.num_preemptions for seq in seqs),
                                  "num_output_tokens": sum(seq.num_output_tokens for seq in seqs)}
        firsts = [seq.first_token_time for seq in seqs if seq.first_token_time is not None]
        if firsts:
            mine["ttft_s"] = min(firsts) - arrival
            self.ttft_s.append(mine["ttft_s"])
        tpots = [(seq.token_times[-1] - seq.token_times[0]) / (len(seq.token_times) - 1)
                 for seq in seqs if len(seq.token_times) > 1]
        self.tpot_s.extend(tpots)
        if tpots:
            mine["tpot_s"] = sum(tpots) / len(tpots)
        return mine

    def summary(self) -> dict[str, float | int]:
        kv = self.kv
        return {
            "requests_finished": self.requests_finished,
            "embedding_requests_finished": self.embedding_requests_finished,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "steps": self.steps,
            "preemptions": self.preemptions,
            "kv_blocks_total": kv.total_blocks if kv else 0,
            "kv_blocks_used": kv.used_blocks if kv else 0,
            "kv_blocks_free": kv.free_blocks if kv else 0,
            "kv_blocks_cached": kv.cached_blocks if kv else 0,
            "kv_evictions": kv.evictions if kv else 0,
            "kv_peak_used_blocks": self.kv_peak_used_blocks,
            "kv_waste_slots": self.kv_waste_slots,
            "kv_max_waste_per_seq": round(self.kv_max_waste_per_seq, 3),
            "prefix_hit_rate": round(self.prefix_hit_rate, 4),
            "beam_searches_finished": self.beam_searches_finished,
            "beam_searches_aborted": self.beam_searches_aborted,
            "beam_searches_failed": self.beam_searches_failed,
            "beam_search_restarts": self.beam_search_restarts,
            "beam_search_waits": self.beam_search_waits,
            "spec_acceptance_rate": round(self.acceptance_rate, 4),
            "spec_proposed": self.spec_proposed,
            "spec_accepted": self.spec_accepted,
            "spec_per_draft_acceptance": round(self.spec_judged_accepted / self.spec_judged, 4)
            if self.spec_judged else 0.0,
            "spec_rounds": self.spec_rounds,
            "spec_grammar_refused": self.spec_grammar_refused,
            "spec_tokens_per_round": round(self.spec_emitted / self.spec_rounds, 4) if self.spec_rounds else 0.0,
            "spec_enabled": int(self.spec_state == "on"),
            "spec_steps_on": self.spec_steps.get("on", 0),
            "spec_steps_off_large_batch": self.spec_steps.get("off-large-batch", 0),
            "spec_steps_off_low_acceptance": self.spec_steps.get("off-low-acceptance", 0),
            "mean_ttft_ms": round(1000 * sum(self.ttft_s) / len(self.ttft_s), 3) if self.ttft_s else 0.0,
            "mean_tpot_ms": round(1000 * sum(self.tpot_s) / len(self.tpot_s), 3) if self.tpot_s else 0.0,
            **{f"time_{phase}_s": round(seconds, 4) for phase, seconds in self.phase_s.items()},
        }


def kv_waste_slots(kv: KVCache, seqs: list[Sequence]) -> int:
    """Allocated slots holding no token, summed over ``seqs`` (each sequence's own tail). Each step counts the
    sequences it ran that are still running: O(batch), where a scan of all requests would grow with the queue."""
    return sum(len(kv.block_table(s)) * kv.block_size - s.num_computed_tokens for s in seqs)


def count_decodes(out: SchedulerOutput) -> int:
    """Items that compute a sequence's next token after its whole prompt (a decode, or a verification); a one-token
    prefill (a prefix hit that leaves one prompt token) is not one. Call before the step updates the sequences."""
    return sum(1 for item in out.scheduled
               if item.num_new_tokens == 1 and item.seq.num_computed_tokens >= item.seq.num_prompt_tokens)
