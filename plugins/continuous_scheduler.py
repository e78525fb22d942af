"""The `continuous` scheduler: iteration-level batching, decodes first, whole prefills, preemption by recompute."""
from __future__ import annotations

from collections import deque

from ..core.config import EngineConfig
from ..core.errors import CapacityError
from ..core.hookspecs import SchedulerFactory, hookimpl
from ..core.interfaces import KVCache, ScheduledSequence, Scheduler, SchedulerOutput
from ..core.registry import Register
from ..core.request import FinishReason, Sequence, SequenceStatus


class ContinuousScheduler(Scheduler):
    """Running sequences decode first (oldest first); then waiting ones are admitted FIFO while budgets allow.

    When blocks run out, the youngest running sequence is preempted: its blocks are freed and it is re-queued
    at the front to be recomputed. A single sequence always fits (checked in :meth:`add`), so this never
    deadlocks. ``chunked`` allows a prefill to be split over steps within the token budget.
    """

    def __init__(self, config: EngineConfig, kv: KVCache, chunked: bool = False) -> None:
        self.kv, self.chunked = kv, chunked
        self.max_num_seqs, self.token_budget = config.max_num_seqs, config.max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._preemptions = 0

    # ------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens, seq.max_model_len)
        need = self.kv.num_blocks_needed(longest)
        if need > self.kv.num_blocks:
            raise CapacityError(
                f"request {seq.request_id} needs up to {need} KV blocks ({longest} tokens) but the cache has only "
                f"{self.kv.num_blocks}; lower max_tokens or give the KV cache more memory (--num-kv-blocks)")
        if not self.chunked and seq.num_prompt_tokens > self.token_budget:
            raise CapacityError(
                f"prompt of {seq.num_prompt_tokens} tokens exceeds max-num-batched-tokens {self.token_budget}; "
                "raise --max-num-batched-tokens or use --scheduler chunked-prefill")
        self.waiting.append(seq)

    # ------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[])
        budget = self.token_budget
        kept: list[Sequence] = []
        queue = list(self.running)
        while queue and budget > 0:
            seq = queue.pop(0)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget if self.chunked else 1 << 30)
            while not self.kv.allocate(seq, n):
                victim = queue.pop() if queue else seq
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        self.running = kept + queue  # sequences left in `queue` got no budget this step but keep their blocks
        if not out.preempted:
            self._admit(out, budget)
        out.block_ops = self.kv.take_block_ops()
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            seq.num_computed_tokens = seq.num_cached_tokens = self.kv.match_prefix(seq)
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget) if self.chunked else remaining
            alone = not out.scheduled  # an over-budget recompute may run alone rather than wait forever
            if (n > budget and not alone) or not self.kv.allocate(seq, n):
                self.kv.free(seq)
                seq.num_computed_tokens = seq.num_cached_tokens = 0
                return
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, n))
            budget -= n

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self._preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]], now: float) -> list[Sequence]:
        finished = []
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted between schedule and update
                continue
            seq.num_computed_tokens += item.num_new_tokens
            self.kv.commit(seq)  # before any finish, so the finished prefix stays cached
            for token in sampled.get(seq.seq_id, ()):
                seq.append_token(token, now)
                reason = seq.check_stop_token()
                if reason is not None:
                    self.finish(seq, reason)
                    finished.append(seq)
                    break
        return finished

    def fork(self, parent: Sequence, child: Sequence) -> None:
        child.token_ids = list(parent.token_ids)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.kv.fork(parent, child)
        self.running.append(child)

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_preemptions(self) -> int:
        return self._preemptions


@hookimpl
def register_schedulers(register: Register[SchedulerFactory]) -> None:
    register("continuous", lambda config, kv: ContinuousScheduler(config, kv))
    register("chunked-prefill", lambda config, kv: ContinuousScheduler(config, kv, chunked=True),
             aliases=("chunked",))
