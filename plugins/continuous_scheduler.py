"""The `continuous` scheduler: iteration-level batching, decodes first, whole prefills, preemption by recompute;
in arrival order, by request priority (``--scheduling-policy priority``) or by cached prefix (``lpm``)."""
from __future__ import annotations

import bisect
import itertools
import logging
import math
from collections import deque

from ..core.config import EngineConfig
from ..core.errors import CapacityError
from ..core.hookspecs import SchedulerFactory, hookimpl
from ..core.interfaces import BlockOps, KVCache, ScheduledSequence, Scheduler, SchedulerOutput
from ..core.registry import Register
from ..core.request import FinishReason, Sequence, SequenceStatus

log = logging.getLogger("infer")

# lpm matches every waiting prompt against the prefix cache at each admission; past this many waiting sequences it
# admits in arrival order instead (SGLang's cut-off for its longest-prefix-match policy is 128 too)
LPM_MAX_WAITING = 128


class SwapSpace:
    """Host block ids for preemption by swapping. Freed ids return to the pool one step late, so that a
    swap-out in the same step cannot overwrite a block before its swap-in has read it."""

    def __init__(self, num_blocks: int) -> None:
        self.free: list[int] = list(range(num_blocks))
        self.released: list[int] = []
        self.held: dict[int, tuple[list[int], int]] = {}  # seq_id -> (host blocks, computed tokens)

    def begin_step(self) -> None:
        self.free += self.released
        self.released = []

    def swap_out(self, seq: Sequence, device_blocks: list[int], ops: BlockOps) -> bool:
        if len(device_blocks) > len(self.free) or not device_blocks:
            return False
        host = [self.free.pop() for _ in device_blocks]
        ops.swap_out += list(zip(device_blocks, host))
        self.held[seq.seq_id] = (host, seq.num_computed_tokens)
        return True

    def swap_in(self, seq: Sequence, device_blocks: list[int], ops: BlockOps) -> None:
        host, _ = self.held.pop(seq.seq_id)
        ops.swap_in += list(zip(host, device_blocks))
        self.released += host

    def drop(self, seq: Sequence) -> None:
        if seq.seq_id in self.held:
            self.released += self.held.pop(seq.seq_id)[0]


class AdmissionReserve:
    """The share R of the running sequences' future KV blocks that admission keeps free (--kv-admission-reserve):
    a fixed number, or ``"auto"``, which starts at 0.7, falls linearly to 0.1 over 600 steps that run sequences
    without a preemption, and returns to 0.7 at each preemption: admission is cautious after a preemption and bolder
    while none happens. (SGLang adapts its new-token ratio this way; 0.7, 0.1 and 600 are its defaults, rounded.)"""
    START, FLOOR, DECAY_STEPS = 0.7, 0.1, 600

    def __init__(self, setting: float | str) -> None:
        self.adaptive = setting == "auto"
        self.value = self.START if self.adaptive else float(setting)

    def after_step(self, preempted: bool) -> None:
        if self.adaptive:
            self.value = self.START if preempted else \
                max(self.FLOOR, self.value - (self.START - self.FLOOR) / self.DECAY_STEPS)


def rank(seq: Sequence, aging_s: float | None = None) -> tuple[float, float, int]:
    """The priority policy's order: higher ``SamplingParams.priority`` first, then earlier arrival. With aging, a
    request gains one priority level per ``aging_s`` seconds since it arrived: as every request gains alike, the
    order never changes, and is that of ``arrival_time - priority * aging_s``, earliest first."""
    if aging_s is None:
        return -seq.params.priority, seq.arrival_time, seq.seq_id
    return seq.arrival_time - seq.params.priority * aging_s, seq.arrival_time, seq.seq_id


class ContinuousScheduler(Scheduler):
    """Running sequences decode first (oldest first); then waiting ones are admitted FIFO while budgets allow.

    When blocks run out, the youngest running sequence is preempted: its blocks are freed and it is re-queued
    at the front to be recomputed. A single sequence always fits (checked in :meth:`add`), so this never
    deadlocks. ``chunked`` allows a prefill to be split over steps within the token budget.

    With the ``priority`` policy the waiting queue is kept in :func:`rank` order, running sequences are served in
    priority order (decodes first within each priority; a prefill chunk leaves a token to each decode after it, so
    every decode runs in every step), the lowest-priority one is preempted first, and a waiting
    request that does not fit preempts running sequences of lower priority until it does (each waiting one in turn,
    a burst of important arrivals in one step). Equal priorities never preempt each other, so a sequence is only
    ever preempted for a strictly more important one: no livelock. With ``priority_aging_s`` the order is
    :func:`rank`'s with aging, served, preempted and admitted by it alone: a request that waited
    ``priority_aging_s`` seconds ranks as one level more important, so none waits for ever; a waiting request makes
    room only in running sequences both of lower priority and later in that fixed order, so a preempted sequence
    never preempts the one it made room for.

    With ``lpm`` (longest prefix match) waiting sequences are admitted in order of the prompt tokens the KV cache
    holds for them, most first (ties in queue order), while at most LPM_MAX_WAITING wait: requests that share a
    cached prefix run before it is evicted. A request whose prefix nothing shares may wait while others keep coming.

    Whatever the policy, a waiting sequence whose next prompt block (past its cache hit) another sequence computes
    in the same step is held back a step, keeping its place, when the KV cache reuses prefixes: requests that arrive
    together with a shared prompt prefix compute it once.
    """

    scheduling_policies = ("fcfs", "priority", "lpm")
    follows_priority_aging = True

    def __init__(self, config: EngineConfig, kv: KVCache, chunked: bool = False) -> None:
        self.kv, self.chunked = kv, chunked
        self.by_priority = config.scheduling_policy == "priority"
        self.by_cached_prefix = config.scheduling_policy == "lpm"
        self.aging_s = config.priority_aging_s
        self.lpm_max_waiting = LPM_MAX_WAITING
        self.token_budget = config.max_num_batched_tokens
        # seats: never more running sequences than the budget has tokens, so that every decode runs in every step
        self.max_num_seqs = min(config.max_num_seqs, config.max_num_batched_tokens)
        self.reserve = AdmissionReserve(config.kv_admission_reserve)
        swap_blocks = (config.num_swap_blocks or 0) if config.preemption_mode == "swap" else 0
        self.swap = SwapSpace(swap_blocks) if swap_blocks else None
        self.ops = BlockOps()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._preemptions = 0
        self.num_swapped_out = 0
        self.warned_swap_full = False

    # ------------------------------------------------------------ admission
    def add(self, seq: Sequence) -> None:
        self.check(seq)
        self._enqueue(seq, at_front=False)

    def _enqueue(self, seq: Sequence, at_front: bool) -> None:
        """Queue a new sequence at the back, or a preempted one at the front (fcfs); by rank (priority)."""
        if self.by_priority:
            bisect.insort(self.waiting, seq, key=self._rank)
        elif at_front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def check(self, seq: Sequence) -> None:
        # positions that ever get KV: the last sampled token is never fed back (speculative drafts stay within too)
        longest = min(seq.num_prompt_tokens + seq.params.max_tokens - 1, seq.max_model_len)
        need = self.kv.num_blocks_needed(longest)
        if need > self.kv.num_blocks:
            shorten = "shorten the prompt" if self.kv.num_blocks_needed(seq.num_prompt_tokens) > self.kv.num_blocks \
                else "lower max_tokens (--max-tokens)"
            more = f" with max_tokens {seq.params.max_tokens}" if seq.params.max_tokens > 1 else ""  # 1: embeddings'
            raise CapacityError(
                f"a prompt of {seq.num_prompt_tokens} tokens{more} needs up to "
                f"{need} KV blocks ({longest} tokens) but the cache has only {self.kv.num_blocks}; {shorten} or "
                "give the KV cache more blocks (--num-kv-blocks, --kv-cache-memory-gb)")
        if seq.params.n > self.max_num_seqs:
            raise CapacityError(f"n={seq.params.n} asks for {seq.params.n} sequences at once but at most "
                                f"{self.max_num_seqs} run at once (the smaller of --max-num-seqs and "
                                "--max-num-batched-tokens); lower n (--n) or raise those options")
        if not self.chunked and seq.num_prompt_tokens > self.token_budget:
            raise CapacityError(
                f"prompt of {seq.num_prompt_tokens} tokens exceeds max-num-batched-tokens {self.token_budget}; "
                "raise --max-num-batched-tokens or use --scheduler chunked-prefill")

    # ------------------------------------------------------------ one step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(scheduled=[])
        if self.swap:
            self.swap.begin_step()
        budget = self.token_budget
        kept: list[Sequence] = []
        made_room = self._make_room(out) if self.by_priority else 0
        order, decodes_left = self._decodes_first()
        queue = deque(order)
        while queue and budget > 0:
            seq = queue.popleft()
            n = seq.num_tokens - seq.num_computed_tokens
            if self._is_decode(seq):
                decodes_left -= 1
            elif self.chunked:  # a chunk leaves a token to each decode after it (a lower priority's): none stalls
                n = min(n, budget - decodes_left)
                if n < 1:
                    continue
            while not self.kv.allocate(seq, n):
                victim = queue.pop() if queue else seq
                if victim is not seq and self._is_decode(victim):
                    decodes_left -= 1
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                kept.append(seq)
                out.scheduled.append(ScheduledSequence(seq, n))
                budget -= n
        gone = {s.seq_id for s in out.preempted}  # the others keep their blocks, scheduled this step or not
        self.running = [s for s in order if s.seq_id not in gone]
        if kept or out.preempted:  # a preemption that made room for a more important request is no shortage
            self.reserve.after_step(preempted=len(out.preempted) > made_room)
        if len(out.preempted) == made_room:  # no admission while running sequences lack room
            self._admit(out, budget)
        out.block_ops = self.kv.take_block_ops()
        out.block_ops.swap_out, out.block_ops.swap_in = self.ops.swap_out, self.ops.swap_in
        self.ops = BlockOps()
        return out

    @staticmethod
    def _is_decode(seq: Sequence) -> bool:
        return seq.num_tokens - seq.num_computed_tokens <= 1

    def _decodes_first(self) -> tuple[list[Sequence], int]:
        """The running sequences, decodes first (a fork's children join at the end, behind prefill chunks), then
        prefill chunks, each in running order (a preemption takes the last in this order); and how many decode."""
        later = [s for s in self.running if not self._is_decode(s)]
        order = [s for s in self.running if self._is_decode(s)] + later if later else self.running
        if self.by_priority and self.aging_s is None:  # stable: decodes first within a priority; the last goes first
            order = sorted(order, key=lambda s: -s.params.priority)
        elif self.by_priority:
            order = sorted(order, key=self._rank)
        return list(order), len(self.running) - len(later)

    def _rank(self, seq: Sequence) -> tuple[float, float, int]:
        return rank(seq, self.aging_s)

    def _outranks(self, seq: Sequence, other: Sequence) -> bool:
        """Whether ``seq`` may preempt ``other`` (priority policy): a strictly higher priority and, with aging, an
        earlier place in :func:`rank`'s order too: a sequence that runs while one of its priority earlier in that
        order waits got its seat while that one was held back a step for a shared prefix, and keeps it."""
        higher = seq.params.priority > other.params.priority
        return higher if self.aging_s is None else higher and self._rank(seq) < self._rank(other)

    def _make_room(self, out: SchedulerOutput) -> int:
        """Priority policy: for each waiting sequence in queue order, preempt running sequences it outranks, lowest
        first (:func:`rank`), until it fits (:meth:`_fits`) beside the running ones and the waiting ones before it,
        so that a burst of important arrivals gets its seats in one step; stop at the first that outranks none, or
        would not fit even so. Returns how many were preempted."""
        made, coming, pending = 0, [], 0  # the waiting sequences room was made for, and the blocks they will take
        for head in list(itertools.islice(self.waiting, self.max_num_seqs)):  # each takes a seat: no more fit
            victims = sorted((s for s in self.running if self._outranks(head, s)), key=self._rank)
            others = [s for s in self.running if not self._outranks(head, s)] + coming
            freed = sum(len(self.kv.block_table(s)) for s in victims)
            if not victims or not self._fits(head, others, freed - pending):
                break
            while victims and not self._fits(head, self.running + coming, -pending):
                victim = victims.pop()
                self.running.remove(victim)
                self._preempt(victim, out)
                made += 1
            pending += self._blocks_to_start(head, self._cache_hit(head)[1], self.running + coming)
            coming.append(head)
        return made

    def _fits(self, seq: Sequence, running: list[Sequence], more_blocks: int = 0) -> bool:
        """Whether the waiting ``seq`` has, beside ``running``, its seats, step budget (its uncached prompt, or a
        chunk of it) and the blocks of its whole prompt (counting ``more_blocks`` free; less its prefix-cache hits
        on blocks the running sequences hold: those it shares)."""
        if sum(self._seats(s) for s in running) + self._seats(seq) > self.max_num_seqs:
            return False
        hit, matched = self._cache_hit(seq)
        room = self.token_budget - sum(s.num_tokens - s.num_computed_tokens for s in running)
        if room < (1 if self.chunked else min(seq.num_tokens - hit, self.token_budget)):
            return False
        return self.kv.num_free_blocks() + more_blocks >= self._blocks_to_start(seq, matched, running)

    def _blocks_to_start(self, seq: Sequence, matched: list[int], running: list[Sequence]) -> int:
        """The free blocks the waiting ``seq`` takes to start: its whole prompt's, less those of its prefix-cache
        hit (``matched``) that ``running`` hold (it shares them)."""
        held = {block for s in running for block in self.kv.block_table(s)}
        return self.kv.num_blocks_needed(seq.num_tokens) - sum(block in held for block in matched)

    def _cache_hit(self, seq: Sequence) -> tuple[int, list[int]]:
        """The tokens of the waiting ``seq`` that the prefix cache holds, and its blocks (none for a swapped-out
        sequence, whose blocks come back from host memory)."""
        if self.swap is not None and seq.seq_id in self.swap.held:
            return 0, []
        hit = self.kv.match_prefix(seq)
        seq.num_computed_tokens = hit
        matched = list(self.kv.block_table(seq)[: hit // self.kv.block_size])
        self.kv.free(seq)  # the match_prefix contract: free or allocate follows each lookup
        seq.num_computed_tokens = 0
        return hit, matched

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        if not self.waiting:
            return
        if self.by_cached_prefix and 1 < len(self.waiting) <= self.lpm_max_waiting:
            self.waiting = deque(sorted(self.waiting, key=lambda seq: -self._cached_tokens(seq)))
        held_back: list[Sequence] = []
        try:
            self._admit_in_order(out, budget, held_back)
        finally:
            self.waiting.extendleft(reversed(held_back))  # first in the queue next step, in their order

    def _admit_in_order(self, out: SchedulerOutput, budget: int, held_back: list[Sequence]) -> None:
        """Admit waiting sequences from the front while budgets allow. With a prefix cache, one whose first block
        past its cache hit a sequence fills in this step goes to ``held_back``: a step later it finds that block
        cached, where admitted now it would compute it a second time."""
        occupied = sum(self._seats(s) for s in self.running)
        future = sum(self._future_of(s, len(self.kv.block_table(s))) for s in self.running) \
            if self.reserve.value else 0
        in_progress: set[int] | None = None  # keys of the prompt blocks this step computes, built at the first need
        while self.waiting and occupied < self.max_num_seqs and budget > 0:
            seq = self.waiting[0]
            if occupied + self._seats(seq) > self.max_num_seqs:
                return
            swapped = self.swap is not None and seq.seq_id in self.swap.held
            if swapped:
                held_tokens = self.swap.held[seq.seq_id][1]
                remaining = seq.num_tokens - held_tokens
                n = min(remaining, budget) if self.chunked else remaining  # the rest of a prefill goes in chunks
                if (n > budget and out.scheduled) or not self.kv.allocate(seq, held_tokens + n):
                    self.kv.free(seq)
                    return
                self.swap.swap_in(seq, self.kv.block_table(seq)[: -(-held_tokens // self.kv.block_size)], self.ops)
                seq.num_computed_tokens = held_tokens
                seats = self._seats(seq)  # before _start: n > 1 forks from the parent's first token
                self._start(seq, n, out)
                budget -= n
                occupied += seats
                if self.reserve.value:
                    future += self._future_of(seq, len(self.kv.block_table(seq)))
                continue
            seq.num_computed_tokens = self.kv.match_prefix(seq)
            if self.kv.reuses_prefixes and not seq.needs_prompt_logits and out.scheduled:
                if in_progress is None:
                    in_progress = {key for item in out.scheduled for key in self._blocks_computed(item)}
                if self._next_block_key(seq) in in_progress:
                    self.kv.free(seq)
                    seq.num_computed_tokens = 0
                    held_back.append(self.waiting.popleft())
                    continue
            remaining = seq.num_tokens - seq.num_computed_tokens
            n = min(remaining, budget) if self.chunked else remaining
            alone = not out.scheduled  # an over-budget recompute may run alone rather than wait forever
            if self.reserve.value:
                future += self._future_of(seq, self.kv.num_blocks_needed(seq.num_tokens))
                if self.running and not self._leaves_reserve(seq, future):
                    self.kv.free(seq)  # the match_prefix contract: free or allocate follows each lookup
                    seq.num_computed_tokens = 0
                    return
            if (n > budget and not alone) or not self.kv.allocate(seq, n):
                self.kv.free(seq)
                seq.num_computed_tokens = 0
                return
            if seq.num_preemptions == 0:  # a recompute hitting its own earlier blocks is not a prompt cache hit
                seq.num_cached_tokens = seq.num_computed_tokens
            self._start(seq, n, out)
            budget -= n
            occupied += self._seats(seq)
            if in_progress is not None:
                in_progress.update(self._blocks_computed(out.scheduled[-1]))

    def _blocks_computed(self, item: ScheduledSequence) -> list[int]:
        """Keys (:meth:`_block_keys`) of the prompt blocks that ``item``, a prefill, fills in this step (none for
        a decode: no hashing of every running sequence)."""
        seq, size = item.seq, self.kv.block_size
        start = seq.num_computed_tokens
        end = min(start + item.num_new_tokens, seq.num_prompt_tokens)
        if end <= start or end // size <= start // size:
            return []
        return self._block_keys(seq, end // size)[start // size:]

    def _next_block_key(self, seq: Sequence) -> int:
        """The key of the first block of the waiting ``seq`` past its cache hit (a partial one matches none)."""
        index = seq.num_computed_tokens // self.kv.block_size
        return self._block_keys(seq, index + 1)[index]

    def _block_keys(self, seq: Sequence, count: int) -> list[int]:
        """Keys of ``seq``'s first ``count`` blocks, each chained to those before it and to the sequence's cache
        namespace, as a prefix cache matches blocks. A collision could only hold a request back a step."""
        key, size, keys = hash(("namespace", seq.cache_namespace)), self.kv.block_size, []
        for i in range(count):
            key = hash((key, tuple(seq.token_ids[i * size : (i + 1) * size])))
            keys.append(key)
        return keys

    def _cached_tokens(self, seq: Sequence) -> int:
        """The tokens of the waiting ``seq`` that the KV cache's prefix cache holds."""
        cached = self.kv.match_prefix(seq)
        self.kv.free(seq)  # the match_prefix contract: free or allocate follows each lookup
        return cached

    def _leaves_reserve(self, seq: Sequence, future_blocks: int) -> bool:
        """Whether the free blocks less those ``seq``'s prompt takes cover ``reserve`` x ``future_blocks``
        (--kv-admission-reserve), the blocks the running sequences and ``seq`` take if they run to max_tokens. Its
        prefix-cache hits take no new block, but those no running sequence holds are counted free until it does."""
        matched = self.kv.block_table(seq)[: seq.num_computed_tokens // self.kv.block_size]
        if matched:
            held = {block for running in self.running for block in self.kv.block_table(running)}
            matched = [block for block in matched if block in held]
        prompt_blocks = self.kv.num_blocks_needed(seq.num_tokens) - len(matched)
        return self.kv.num_free_blocks() - prompt_blocks >= math.ceil(self.reserve.value * future_blocks)

    def _future_of(self, seq: Sequence, held: int) -> int:
        """``_future_blocks`` of ``seq`` and, for a parent not forked yet, of its n - 1 children: each shares the
        prompt's full blocks and writes its own copy of the partial last one."""
        own, seats = self._future_blocks(seq, held), self._seats(seq)
        if seats == 1:
            return own
        return own + (seats - 1) * self._future_blocks(seq, seq.num_prompt_tokens // self.kv.block_size)

    def _future_blocks(self, seq: Sequence, held: int) -> int:
        """Blocks beyond ``held`` that ``seq`` needs for every position it may write: its prompt and max_tokens
        (less the last token, never fed back), within the context."""
        final = min(seq.num_prompt_tokens + seq.params.max_tokens - 1, seq.max_model_len)
        return max(0, self.kv.num_blocks_needed(final) - held)

    @staticmethod
    def _seats(seq: Sequence) -> int:
        """Running slots a sequence takes on admission: n for a parent whose siblings fork from its first token."""
        return seq.params.n if seq.index == 0 and seq.num_output_tokens == 0 else 1

    def _start(self, seq: Sequence, n: int, out: SchedulerOutput) -> None:
        self.waiting.popleft()
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        out.scheduled.append(ScheduledSequence(seq, n))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        if self.swap is not None:
            computed_blocks = self.kv.block_table(seq)[: -(-seq.num_computed_tokens // self.kv.block_size)]
            if self.swap.swap_out(seq, computed_blocks, self.ops):
                self.num_swapped_out += 1
            elif not self.warned_swap_full:
                self.warned_swap_full = True
                log.warning("the swap space is full: preempted sequences that do not fit in it are recomputed "
                            "instead (correct, slower); raise --swap-space-gb to swap them all")
        self.kv.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self._preemptions += 1
        self._enqueue(seq, at_front=True)
        out.preempted.append(seq)

    def update(self, output: SchedulerOutput, sampled: dict[int, list[int]], now: float) -> list[Sequence]:
        finished = []
        for item in output.scheduled:
            seq = item.seq
            if seq.is_finished:  # aborted between schedule and update
                continue
            seq.num_computed_tokens += item.num_new_tokens
            reason = None
            for i, token in enumerate(sampled.get(seq.seq_id, ())):
                if i:  # speculative decoding: the tokens before the last are accepted drafts, computed this step
                    seq.num_computed_tokens += 1
                seq.append_token(token, now)
                if (reason := seq.check_stop_token()) is not None:
                    break
            self.kv.commit(seq)  # before any finish, so the finished prefix stays cached
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
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
        try:
            if seq in self.running:
                self.running.remove(seq)
                self.kv.free(seq)
            elif seq in self.waiting:
                self.waiting.remove(seq)
                if self.swap is not None:
                    self.swap.drop(seq)
        finally:  # an interrupted free (Ctrl-C) must not leave the sequence neither queued nor finished
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
