"""Beam search on the KV fork primitive: a beam chosen by several candidates forks (its blocks shared by
reference, the partial last block copied on first write), and a beam no candidate chose frees its blocks.

Each step scores every live beam's continuations, cumulative log-probability plus the token's, and keeps the best
``beam_width`` over all of a prompt's beams (HF transformers' candidate rule: the best ``max(2, 1 + number of
end-of-sequence ids) x beam_width``, an end-of-sequence token among the best ``beam_width`` of them finishing a
hypothesis). A hypothesis scores
``cumulative_logprob / num_generated_tokens ** length_penalty``. A prompt is done at ``max_tokens``, or when
``beam_width`` hypotheses have finished and none of the live beams scores better now (HF's ``early_stopping=False``).

Logits processors (``BeamSearchParams.logits_processors``) change each live beam's next-token log-probabilities, as
HF's ``_beam_search`` applies its ``logits_processor`` after the log-softmax: a ban (-inf) drops a continuation, and
the others keep the model's own log-probabilities, unrenormalised. Each beam is its own row (its Sequence's id, the
prompt and its tokens), and a beam's processor state goes when the beam does. Where they leave a prompt no
continuation in any beam, they yield for that step (its beams rank as without them), with a warning, as sampling
does for a row.

A search (:class:`BeamSearch`) runs beside the engine's requests: each engine step advances every active search by
one token (:class:`BeamSearches`, which also shares the KV pool between beams and the scheduler), then runs the
scheduled step. The beams' forward passes are their own, so a search returns the same beams beside requests as alone.
"""
from __future__ import annotations

import logging
import math
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .admission import at_prompt, check_prompt_list
from .chat import Prompt
from .errors import CapacityError, InferError, InvalidRequestError
from .interfaces import ScheduledSequence, SchedulerOutput
from .request import FinishReason, SamplingParams, Sequence, processor_calls, validate_processor_calls
from .tool_choice import forces_calls

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams of up to ``max_tokens`` tokens each; ``length_penalty`` > 0 favours longer hypotheses
    (0: the plain cumulative log-probability; one so far from 0 that scores leave the floats' range, hundreds,
    ties them, ordered as they finished); ``ignore_eos`` runs every beam to ``max_tokens``; ``lora_adapter`` and
    ``logits_processors`` (applied to each beam's log-probabilities) as in SamplingParams."""
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False
    lora_adapter: str | None = None
    logits_processors: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "logits_processors", processor_calls(self.logits_processors))

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        penalty = self.length_penalty  # NaN and the infinities fail the comparison; an int compares exactly
        if not isinstance(penalty, (int, float)) or isinstance(penalty, bool) \
                or not -sys.float_info.max <= penalty <= sys.float_info.max:
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")
        validate_processor_calls(self.logits_processors, InvalidRequestError)

    def sampling(self) -> SamplingParams:
        """The greedy SamplingParams each beam's sequence carries (for the prompt checks and the KV cache)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos,
                              lora_adapter=self.lora_adapter, logits_processors=self.logits_processors)


@dataclass
class Beam:
    """One finished hypothesis: the generated tokens (an end-of-sequence token last when it stopped there) and
    their text (without that token's, as generate leaves it out)."""
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    beams: list[Beam]  # best first, beam_width of them (fewer if the vocabulary is; one empty if aborted at once)


@dataclass
class _Prompt:
    ids: list[int]
    live: list[tuple[Sequence, float]]  # (beam, cumulative log-probability)
    done: list[tuple[float, float, list[int], FinishReason]] = field(default_factory=list)  # score, logprob, ...
    finished: bool = False


class BeamSearch:
    """One beam search: its prompts' beams batched together, on its engine's model and KV pool, beside the engine's
    requests. Its beams are Sequences the scheduler never sees. ``Engine.start_beam_search`` starts it; each engine
    step then runs :meth:`step` (through :class:`BeamSearches`) until ``done``; ``result()`` gives one
    BeamSearchOutput per prompt (an aborted search's best so far), or raises the error that ended it. Whatever
    ends it (its last token, an error, ``Engine.abort_beam_search``) frees every beam it made."""

    def __init__(self, engine: Engine, prompt_ids: list[list[int]], params: BeamSearchParams,
                 new_seq_id: Callable[[], int]) -> None:
        self.engine, self.prompt_ids, self.params, self.new_seq_id = engine, prompt_ids, params, new_seq_id
        self.sampling = params.sampling()  # what every beam's Sequence carries
        self.waits = 0  # steps it waited for KV blocks that others held
        self.processors_yielded_steps = 0  # steps of a prompt whose logits processors banned every continuation
        self.unscorable_steps = 0  # steps whose log-probabilities held a NaN (never chosen)
        self.restarts = 0  # times an older search took its blocks and it began again
        self.error: BaseException | None = None
        self.outputs: list[BeamSearchOutput] | None = [] if not prompt_ids else None  # no prompt: done, as generate
        self._begin()

    def _begin(self) -> None:
        self.created: list[Sequence] = []  # every beam made, freed at the end whatever happens (free is idempotent)
        self.states = [_Prompt(ids, [(self._new_beam(ids, ids), 0.0)]) for ids in self.prompt_ids]
        self.length = 0  # tokens each live beam has generated
        self.ready: set[int] = set()  # beams whose blocks for this step are allocated (kept while it waits)
        self.short: list[Sequence] = []  # beams without their blocks, when the last step had to wait

    def _new_beam(self, prompt_ids: list[int], token_ids: list[int]) -> Sequence:
        engine = self.engine
        self.created.append(Sequence(self.new_seq_id(), "beam-search", prompt_ids, self.sampling,
                                     time.perf_counter(), eos_token_ids=engine.eos_token_ids,
                                     max_model_len=engine.max_model_len, token_ids=list(token_ids)))
        return self.created[-1]

    @property
    def done(self) -> bool:
        return self.outputs is not None or self.error is not None

    def result(self) -> list[BeamSearchOutput]:
        """One BeamSearchOutput per prompt, in order; the search's error if one ended it."""
        if self.error is not None:
            raise self.error
        if self.outputs is None:
            raise InvalidRequestError("the beam search has not finished; step the engine until its done is True")
        return self.outputs

    def step(self) -> bool:
        """Advance every unfinished prompt by one token: True. False when the KV pool has no blocks for some beam
        now: nothing else changes (the beams that got blocks keep them for the retry). Raises what the model
        run raises (the caller fails the search)."""
        running = [s for s in self.states if not s.finished]
        beams = [beam for s in running for beam, _ in s.live]
        self.short = self.short_of_blocks(beams)
        if self.short:
            return False
        logprobs, model_nan = scoreable(_forward(self.engine, beams))
        processed = self.engine.processors.apply(logprobs, beams)
        processed, processor_nan = (None, False) if processed is None else scoreable(processed)
        if model_nan or processor_nan:
            self._note_unscorable(model_nan)
        self.ready.clear()
        self.length += 1
        row = 0
        for index, state in enumerate(self.states):
            if state.finished:
                continue
            rows = logprobs[row : row + len(state.live)]
            if processed is not None:
                rows = self._processed(processed[row : row + len(state.live)], rows, index)
            row += len(state.live)
            _choose(self.engine, state, rows, self.params, self.length, self._new_beam)
        if self.length == self.params.max_tokens or all(s.finished for s in self.states):
            self.conclude(FinishReason.LENGTH)
        return True

    def _processed(self, processed: torch.Tensor, plain: torch.Tensor, prompt_index: int) -> torch.Tensor:
        """A prompt's rows as its processors left them, or as the model gave them where the processors left no
        continuation in any of its beams (they yield, as for a sampled row; the first time, a warning)."""
        if (processed > float("-inf")).any():
            return processed
        self.processors_yielded_steps += 1
        if self.processors_yielded_steps == 1:
            log.warning("beam search (prompt %d, token %d): its logits processors (%s) banned every continuation of "
                        "every beam, so this step, and any other where that happens, ranks them without the "
                        "processors", prompt_index, self.length,
                        ", ".join(name for name, _ in self.params.logits_processors))
        return plain

    def _note_unscorable(self, by_model: bool) -> None:
        """A step whose log-probabilities held a NaN (``scoreable`` made it -inf): counted; the first, a warning."""
        self.unscorable_steps += 1
        if self.unscorable_steps == 1:
            log.warning("beam search (token %d): some of its beams' next-token log-probabilities are NaN (%s); those "
                        "continuations are never chosen, here and at any later step where that happens",
                        self.length + 1, "the model's" if by_model else "after its logits processors")

    def conclude(self, reason: FinishReason) -> None:
        """End now: the live beams become hypotheses with ``reason`` (LENGTH at max_tokens; ABORT when stopped
        early), the best ``beam_width`` of each prompt are the outputs, and every beam is freed (``_release``)."""
        for state in self.states:
            for beam, logprob in state.live:
                _finish(state, beam, logprob, reason, self.params)
        self.outputs = [_output(self.engine, state, self.params) for state in self.states]
        self._release()

    def short_of_blocks(self, beams: list[Sequence]) -> list[Sequence]:
        """Allocate each beam's uncomputed tokens (the first step: after a prefix-cache lookup); the beams the pool
        could not serve now. The copies that the allocations made run at once when some beam is short, since no
        forward pass of this search follows to run them."""
        kv, short = self.engine.kv, []
        for beam in beams:
            if beam.seq_id in self.ready:
                continue
            if self.length == 0:
                beam.num_computed_tokens = kv.match_prefix(beam)  # allocate follows at once, as its contract asks
            if kv.allocate(beam, beam.num_tokens - beam.num_computed_tokens):
                self.ready.add(beam.seq_id)
                continue
            short.append(beam)
            if self.length == 0:
                kv.free(beam)
                beam.num_computed_tokens = 0
        if short and (ops := kv.take_block_ops()):
            with torch.inference_mode():
                self.engine.runner.apply_block_ops(ops)
        return short

    def blocks_short(self) -> int:
        """How many more blocks the short beams need, at least: a prompt (the first step) all of its blocks; a beam
        whose next token starts a block, one; beams that share a partial last block, one copy each but the last
        (it writes in place)."""
        kv, size = self.engine.kv, self.engine.config.block_size
        need, sharers = 0, Counter[int]()
        for beam in self.short:
            table = kv.block_table(beam)
            if self.length == 0 or (beam.num_tokens - 1) // size >= len(table):
                need += kv.num_blocks_needed(beam.num_tokens) - len(table)
            else:
                sharers[table[-1]] += 1
        return need + sum(count - 1 for count in sharers.values())

    def held_blocks(self) -> set[int]:
        """The KV blocks its live beams hold."""
        return {block for s in self.states for beam, _ in s.live for block in self.engine.kv.block_table(beam)}

    def restart(self) -> None:
        """Free every beam and begin again from the prompts (an older search needs the blocks); the same beams
        come out in the end, a beam search being deterministic."""
        self.close()
        self.restarts += 1
        self._begin()

    def fail(self, error: BaseException) -> None:
        """End with ``error`` (``result()`` raises it), freeing every beam (``_release``)."""
        self.error = error
        self._release()

    def _release(self) -> None:
        """Free every beam and drop the copies queued for them: they must not run later, into blocks that others
        get."""
        self.close()
        self.engine.kv.take_block_ops()

    def close(self) -> None:
        """Free every beam it made, and the live beams' logits processor state (idempotent; ``_free`` released
        the others as they went)."""
        live = [beam for state in self.states for beam, _ in state.live]
        for beam in self.created:
            self.engine.kv.free(beam)
        for state in self.states:
            state.live = []
        for beam in live:  # after the blocks: a processor's error cannot keep them
            self.engine.processors.release(beam)


class BeamSearches:
    """The engine's active beam searches, oldest first, each advanced one token per engine step before the
    scheduled step (so blocks freed by finished requests go to beams before the scheduler admits new work).

    The beams share the KV pool with the scheduler's sequences. A search whose beams cannot get blocks in a step
    waits (skips it, keeping the blocks it got) while others hold blocks that will come back: the scheduler's
    sequences (they finish, or the scheduler preempts them), or an older search (it goes first, so it always
    progresses). The oldest search, short of blocks with neither, restarts the youngest other search that holds
    blocks and tries again; with none left, it cannot fit the pool: CapacityError. So does a search whose beams
    need more blocks than the pool has, whoever holds them. An error fails its search only."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.active: list[BeamSearch] = []

    def __bool__(self) -> bool:
        return bool(self.active)

    def start(self, prompts: Seq[Prompt], params: BeamSearchParams, new_seq_id: Callable[[], int]) -> BeamSearch:
        """Check ``params`` and every prompt (InvalidRequestError, CapacityError before any work), then start."""
        if not isinstance(params, BeamSearchParams):
            raise InvalidRequestError(f"beam search takes a BeamSearchParams, got {type(params).__name__}")
        params.validate()
        search = BeamSearch(self.engine, check_prompts(self.engine, prompts, params), params, new_seq_id)
        if not search.done:
            self.active.append(search)
        return search

    def abort(self, search: BeamSearch) -> None:
        """Stop ``search`` now and free its beams (idempotent): ``result()`` gives each prompt's best hypotheses so
        far, the beams still live among them with finish reason ABORT (as an aborted request keeps its tokens)."""
        if search in self.active:
            self.active.remove(search)
            search.conclude(FinishReason.ABORT)
            self.engine.stats.beam_searches_aborted += 1

    def step(self) -> None:
        """One step of each active search, oldest first; the searches that end leave."""
        engine = self.engine
        engine.unemitted += engine._settle()  # async scheduling: no step in flight beside the beams' forward
        for search in list(self.active):
            try:
                with engine._plugin_code():
                    while not search.step() and not self._wait_or_make_room(search):
                        pass
            except Exception as exc:  # that search fails; the others and the requests go on
                search.fail(exc)
            except BaseException as exc:  # Ctrl-C: a half-run step cannot resume, so the search ends with it
                search.fail(exc)
                self._leave(search)
                raise
            if search.done:
                self._leave(search)

    def _leave(self, search: BeamSearch) -> None:
        self.active.remove(search)
        if search.error is None:
            self.engine.stats.beam_searches_finished += 1
        else:
            self.engine.stats.beam_searches_failed += 1

    def _wait_or_make_room(self, search: BeamSearch) -> bool:
        """For a search short of blocks: whether it waits this step (True), or may try again now that a younger
        search has made room (False). CapacityError when waiting cannot help."""
        kv, held = self.engine.kv, set[int]().union(*(s.held_blocks() for s in self.active))
        needed = len(search.held_blocks()) + search.blocks_short()
        scheduler = self.engine.scheduler
        if needed <= kv.num_blocks and (self.active.index(search) > 0 or (
                scheduler.has_unfinished() and kv.stats().used_blocks > len(held))):
            search.waits += 1
            self.engine.stats.beam_search_waits += 1
            return True
        younger = [s for s in self.active[self.active.index(search) + 1 :] if s.held_blocks()]
        if needed <= kv.num_blocks and younger:
            younger[-1].restart()
            self.engine.stats.beam_search_restarts += 1
            return False
        raise CapacityError(f"beam search ran out of KV blocks ({kv.num_blocks} in the pool) with "
                            f"{sum(len(s.live) for s in search.states)} beams; lower beam_width, max_tokens or the "
                            "number of prompts, or give the KV cache more blocks (--num-kv-blocks, "
                            "--kv-cache-memory-gb)")


def check_prompts(engine: Engine, prompts: Seq[Prompt], params: BeamSearchParams) -> list[list[int]]:
    """Each prompt's token ids, or the InvalidRequestError or CapacityError beam search would raise for the first
    bad one (naming its position, ``prompt_index``), before any work."""
    sampling = params.sampling()
    engine.processors.check(sampling)  # unknown names, arguments a processor refuses
    checked = []
    for index, prompt in enumerate(check_prompt_list(prompts)):
        try:
            ids = engine.checker.check(prompt, sampling)
            if forces_calls(prompt):
                raise InvalidRequestError("beam search cannot force tool calls (tool_choice 'required' or a named "
                                          "function makes the reply structured output, which beams do not follow); "
                                          "send the chat to generate, or set tool_choice 'auto'")
            need = engine.kv.num_blocks_needed(len(ids) + params.max_tokens - 1)
            if need > engine.kv.num_blocks:
                raise CapacityError(f"a prompt of {len(ids)} tokens with max_tokens {params.max_tokens} needs up to "
                                    f"{need} KV blocks for one beam, but the cache has {engine.kv.num_blocks}; "
                                    "shorten the prompt, lower max_tokens, or give the KV cache more blocks "
                                    "(--num-kv-blocks, --kv-cache-memory-gb)")
            # the last forward pass feeds each beam live after max_tokens - 1 choices its own token (none at 1)
            beams = live_beams(params.beam_width, engine.loaded.model.spec.vocab_size, params.max_tokens - 1)
            shared = len(ids) // engine.kv.block_size  # the prompt's full blocks, which every beam shares
            if params.max_tokens > 1 and beams > engine.kv.num_blocks - shared:
                raise CapacityError(f"beam_width {params.beam_width} keeps {beams} beams live, each writing its own "
                                    f"last KV block beside the {shared} of the prompt they share, but the cache has "
                                    f"{engine.kv.num_blocks} blocks; lower beam_width, or give the KV cache more "
                                    "blocks (--num-kv-blocks, --kv-cache-memory-gb)")
        except InferError as exc:
            raise at_prompt(exc, index, len(prompts)) from None
        checked.append(ids)
    return checked


def live_beams(beam_width: int, vocab_size: int, tokens: int) -> int:
    """How many beams a search keeps live once it has chosen ``tokens`` tokens, at most: ``beam_width``, or fewer
    where the vocabulary's continuations of ``tokens`` tokens are fewer (vocab_size ** tokens)."""
    continuations = 1
    for _ in range(tokens):
        continuations *= vocab_size
        if continuations >= beam_width:
            return beam_width
    return continuations


def scoreable(logprobs: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``logprobs`` with every NaN (an overflowing model or adapter, a processor's bug) made -inf, so that such a
    continuation is never chosen and the others rank as they would; and whether there was one (one pass, one
    read-back)."""
    nan = logprobs.isnan()
    if not bool(nan.any()):
        return logprobs, False
    return logprobs.masked_fill(nan, float("-inf")), True


def _forward(engine: Engine, beams: list[Sequence]) -> torch.Tensor:
    """Run each beam's uncomputed tokens (allocated), as the scheduler would: batches of at most --max-num-seqs
    sequences and --max-num-batched-tokens tokens, a long prompt in chunks. Returns the next-token log-probabilities
    [beams, V], in the order of ``beams``."""
    kv, config = engine.kv, engine.config
    rows: dict[int, torch.Tensor] = {}
    pending = beams
    while pending:
        items, later, size = [], [], 0
        for beam in pending:
            left = beam.num_tokens - beam.num_computed_tokens
            n = min(left, config.max_num_batched_tokens - size)
            if n < 1 or len(items) == config.max_num_seqs:
                later.append(beam)
                continue
            items.append(ScheduledSequence(beam, n))
            size += n
            if n < left:  # the rest of a long prompt, in a later batch
                later.append(beam)
        out = SchedulerOutput(items, block_ops=kv.take_block_ops())  # copy-on-write copies of shared blocks
        batch, logits = engine.runner.execute(out, kv)
        logprobs = torch.log_softmax(logits.float(), dim=-1).cpu()
        rows.update(zip(batch.sample_seq_ids, logprobs))  # the beams whose last token ran
        for item in items:
            item.seq.num_computed_tokens += item.num_new_tokens
            kv.commit(item.seq)
        pending = later
    return torch.stack([rows[beam.seq_id] for beam in beams])


def _choose(engine: Engine, state: _Prompt, logprobs: torch.Tensor, params: BeamSearchParams, length: int,
             new_beam: Callable[[list[int], list[int]], Sequence]) -> None:
    """Choose the prompt's next beams from ``logprobs`` [beams, V] (each beam's next-token log-probabilities, as
    its logits processors left them: a -inf continuation is never chosen)."""
    width = params.beam_width
    totals = torch.tensor([logprob for _, logprob in state.live], dtype=torch.float64)[:, None] + logprobs
    num_eos = 0 if params.ignore_eos else len(state.live[0][0].eos_token_ids)
    # HF's count: enough candidates that width of them survive even if every eos id ranks first
    values, flat = totals.flatten().topk(min(max(2, 1 + num_eos) * width, totals.numel()))
    vocab = logprobs.shape[1]
    chosen: list[tuple[int, int, float]] = []  # (beam index, token, cumulative log-probability)
    for rank, (total, index) in enumerate(zip(values.tolist(), flat.tolist())):
        if total == -math.inf:  # banned by a logits processor, as is every candidate after it
            break
        beam, token = divmod(index, vocab)
        parent = state.live[beam][0]
        if token in parent.eos_token_ids and not params.ignore_eos:
            if rank < width:
                _finish(state, parent, total, FinishReason.STOP, params, token)
            continue
        chosen.append((beam, token, total))
        if len(chosen) == width:
            break
    taken = [False] * len(state.live)
    live: list[tuple[Sequence, float]] = []
    for beam, token, total in chosen:
        parent = state.live[beam][0]
        if taken[beam]:  # a second candidate of this beam: fork it, sharing its blocks (its token is appended)
            child = new_beam(parent.prompt_token_ids, parent.token_ids[:-1])
            child.num_computed_tokens = parent.num_computed_tokens
            engine.kv.fork(parent, child)
            live.append((child, total))
            child.token_ids.append(token)
        else:
            taken[beam] = True
            live.append((parent, total))
            parent.token_ids.append(token)
    for (beam, _), kept in zip(state.live, taken):
        if not kept:
            _free(engine, beam)
    state.live = live
    best_live = length_score(max((total for _, total in live), default=-math.inf), length, params.length_penalty)
    kept = sorted((score for score, *_ in state.done), reverse=True)[:width]  # the hypotheses that would be returned
    state.finished = not live or (len(kept) == width and kept[-1] >= best_live)
    if state.finished:
        for beam, _ in live:
            _free(engine, beam)
        state.live = []


def _free(engine: Engine, beam: Sequence) -> None:
    """A beam no longer live: its blocks and its logits processors' state go (its id is never used again)."""
    engine.kv.free(beam)
    engine.processors.release(beam)


def _finish(state: _Prompt, beam: Sequence, logprob: float, reason: FinishReason, params: BeamSearchParams,
            eos: int | None = None) -> None:
    tokens = beam.output_token_ids + ([] if eos is None else [eos])
    state.done.append((length_score(logprob, max(1, len(tokens)), params.length_penalty), logprob, tokens, reason))


def length_score(logprob: float, length: int, penalty: float) -> float:
    """``logprob / length ** penalty``, HF's and vLLM's score; where that overflows (a penalty in the hundreds), in
    log space: a score past the floats' range is infinite (of the logprob's sign), one below it 0."""
    penalty = float(penalty)  # an int's power would be exact, and slow
    try:
        return logprob / length ** penalty
    except (OverflowError, ZeroDivisionError):
        pass
    if logprob == 0 or math.isinf(logprob):
        return logprob
    exponent = math.log(abs(logprob)) - penalty * math.log(length)
    return math.copysign(math.exp(exponent) if exponent < math.log(sys.float_info.max) else math.inf, logprob)


def _output(engine: Engine, state: _Prompt, params: BeamSearchParams) -> BeamSearchOutput:
    best = sorted(state.done, key=lambda hypothesis: hypothesis[0], reverse=True)[: params.beam_width]
    beams = []
    for score, logprob, tokens, reason in best:
        detok = engine.new_detokenizer(state.ids)
        detok.add(tokens[:-1] if reason is FinishReason.STOP else tokens)  # the EOS's text left out, as generate does
        detok.flush()
        beams.append(Beam(tokens, detok.text, logprob, score, reason))
    return BeamSearchOutput(state.ids, beams)
