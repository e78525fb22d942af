"""Beam search on the KV fork primitive: a beam chosen by several candidates forks (its blocks shared by
reference, the partial last block copied on first write), and a beam no candidate chose frees its blocks.

Each step scores every live beam's continuations, cumulative log-probability plus the token's, and keeps the best
``beam_width`` over all of a prompt's beams (HF transformers' candidate rule: the best ``max(2, 1 + number of
end-of-sequence ids) x beam_width``, an end-of-sequence token among the best ``beam_width`` of them finishing a
hypothesis). A hypothesis scores
``cumulative_logprob / num_generated_tokens ** length_penalty``. A prompt is done at ``max_tokens``, or when
``beam_width`` hypotheses have finished and none of the live beams scores better now (HF's ``early_stopping=False``).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence as Seq
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from .admission import at_prompt, check_prompt_list
from .chat import Prompt
from .errors import CapacityError, InferError, InvalidRequestError
from .interfaces import ScheduledSequence, SchedulerOutput
from .request import FinishReason, SamplingParams, Sequence

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class BeamSearchParams:
    """``beam_width`` beams of up to ``max_tokens`` tokens each; ``length_penalty`` > 0 favours longer hypotheses
    (0: the plain cumulative log-probability); ``ignore_eos`` runs every beam to ``max_tokens``."""
    beam_width: int = 4
    max_tokens: int = 16
    length_penalty: float = 1.0
    ignore_eos: bool = False

    def validate(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool) \
                or not math.isfinite(self.length_penalty):
            raise InvalidRequestError(f"length_penalty must be a finite number, got {self.length_penalty!r}")

    def sampling(self) -> SamplingParams:
        """The greedy SamplingParams each beam's sequence carries (for the prompt checks and the KV cache)."""
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0, ignore_eos=self.ignore_eos)


@dataclass
class Beam:
    """One finished hypothesis: the generated tokens (an end-of-sequence token last when it stopped there)."""
    token_ids: list[int]
    text: str
    cumulative_logprob: float
    score: float
    finish_reason: FinishReason


@dataclass
class BeamSearchOutput:
    prompt_token_ids: list[int]
    beams: list[Beam]  # best score first, beam_width of them (fewer only if the vocabulary is smaller)


@dataclass
class _Prompt:
    ids: list[int]
    live: list[tuple[Sequence, float]]  # (beam, cumulative log-probability)
    done: list[tuple[float, float, list[int], FinishReason]] = field(default_factory=list)  # score, logprob, ...
    finished: bool = False


def beam_search(engine: Engine, prompts: Seq[Prompt], params: BeamSearchParams,
                new_seq_id: Callable[[], int]) -> list[BeamSearchOutput]:
    """Run beam search for every prompt, the prompts' beams batched together, on ``engine``'s model and KV pool
    (which must have no other requests). Raises InvalidRequestError, or CapacityError when the beams outgrow the
    KV pool (their blocks are freed first)."""
    if not isinstance(params, BeamSearchParams):
        raise InvalidRequestError(f"beam search takes a BeamSearchParams, got {type(params).__name__}")
    params.validate()
    if engine.has_unfinished():
        raise InvalidRequestError(f"beam search runs alone, and the engine has {len(engine.requests)} unfinished "
                                  "request(s); let them finish or abort them first")
    sampling = params.sampling()
    states, created = [], []  # every beam made, freed at the end whatever happens (free is idempotent)

    def new_beam(prompt_ids: list[int], token_ids: list[int]) -> Sequence:
        created.append(Sequence(new_seq_id(), "beam-search", prompt_ids, sampling, time.perf_counter(),
                                eos_token_ids=engine.eos_token_ids, max_model_len=engine.max_model_len,
                                token_ids=list(token_ids)))
        return created[-1]

    for ids in check_prompts(engine, prompts, params):
        states.append(_Prompt(ids, [(new_beam(ids, ids), 0.0)]))
    try:
        for step in range(params.max_tokens):
            running = [s for s in states if not s.finished]
            if not running:
                break
            logprobs = _forward(engine, [beam for s in running for beam, _ in s.live], first=step == 0)
            row = 0
            for state in running:
                rows = logprobs[row : row + len(state.live)]
                row += len(state.live)
                _advance(engine, state, rows, params, step + 1, new_beam)
        for state in states:
            for beam, logprob in state.live:  # reached max_tokens
                _finish(state, beam, logprob, FinishReason.LENGTH, params)
    finally:
        for beam in created:
            engine.kv.free(beam)
        engine.kv.take_block_ops()  # copies queued for beams that never ran (an error mid-step) must not run later
    return [_output(engine, state, params) for state in states]


def check_prompts(engine: Engine, prompts: Seq[Prompt], params: BeamSearchParams) -> list[list[int]]:
    """Each prompt's token ids, or the InvalidRequestError or CapacityError beam search would raise for the first
    bad one (naming its position, ``prompt_index``), before any work."""
    sampling = params.sampling()
    checked = []
    for index, prompt in enumerate(check_prompt_list(prompts)):
        try:
            ids = engine.checker.check(prompt, sampling)
            need = engine.kv.num_blocks_needed(len(ids) + params.max_tokens - 1)
            if need > engine.kv.num_blocks:
                raise CapacityError(f"a prompt of {len(ids)} tokens with max_tokens {params.max_tokens} needs up to "
                                    f"{need} KV blocks for one beam, but the cache has {engine.kv.num_blocks}; "
                                    "shorten the prompt, lower max_tokens, or give the KV cache more blocks "
                                    "(--num-kv-blocks, --kv-cache-memory-gb)")
        except InferError as exc:
            raise at_prompt(exc, index, len(prompts)) from None
        checked.append(ids)
    return checked


def _forward(engine: Engine, beams: list[Sequence], first: bool) -> torch.Tensor:
    """Allocate each beam's uncomputed tokens (``first``: the prompts, after a prefix-cache lookup) and run them,
    as the scheduler would: batches of at most --max-num-seqs sequences and --max-num-batched-tokens tokens, a long
    prompt in chunks. Returns the next-token log-probabilities [beams, V], in the order of ``beams``."""
    kv, config = engine.kv, engine.config
    for beam in beams:
        if first:
            beam.num_computed_tokens = kv.match_prefix(beam)  # allocate follows at once, as its contract asks
        if not kv.allocate(beam, beam.num_tokens - beam.num_computed_tokens):
            if first:
                kv.free(beam)
            raise CapacityError(f"beam search ran out of KV blocks ({kv.num_blocks} in the pool) with {len(beams)} "
                                "beams; lower beam_width, max_tokens or the number of prompts, or give the KV cache "
                                "more blocks (--num-kv-blocks, --kv-cache-memory-gb)")
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


def _advance(engine: Engine, state: _Prompt, logprobs: torch.Tensor, params: BeamSearchParams, length: int,
             new_beam: Callable[[list[int], list[int]], Sequence]) -> None:
    """Choose the prompt's next beams from ``logprobs`` [beams, V] (each beam's next-token log-probabilities)."""
    width = params.beam_width
    totals = torch.tensor([logprob for _, logprob in state.live], dtype=torch.float64)[:, None] + logprobs
    num_eos = 0 if params.ignore_eos else len(state.live[0][0].eos_token_ids)
    # HF's count: enough candidates that width of them survive even if every eos id ranks first
    values, flat = totals.flatten().topk(min(max(2, 1 + num_eos) * width, totals.numel()))
    vocab = logprobs.shape[1]
    chosen: list[tuple[int, int, float]] = []  # (beam index, token, cumulative log-probability)
    for rank, (total, index) in enumerate(zip(values.tolist(), flat.tolist())):
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
            engine.kv.free(beam)
    state.live = live
    best_live = max((total for _, total in live), default=-math.inf) / length ** params.length_penalty
    kept = sorted((score for score, *_ in state.done), reverse=True)[:width]  # the hypotheses that would be returned
    state.finished = not live or (len(kept) == width and kept[-1] >= best_live)
    if state.finished:
        for beam, _ in live:
            engine.kv.free(beam)
        state.live = []


def _finish(state: _Prompt, beam: Sequence, logprob: float, reason: FinishReason, params: BeamSearchParams,
            eos: int | None = None) -> None:
    tokens = beam.output_token_ids + ([] if eos is None else [eos])
    state.done.append((logprob / max(1, len(tokens)) ** params.length_penalty, logprob, tokens, reason))


def _output(engine: Engine, state: _Prompt, params: BeamSearchParams) -> BeamSearchOutput:
    best = sorted(state.done, key=lambda hypothesis: hypothesis[0], reverse=True)[: params.beam_width]
    beams = []
    for score, logprob, tokens, reason in best:
        detok = engine.new_detokenizer(state.ids)
        detok.add(tokens)
        detok.flush()
        beams.append(Beam(tokens, detok.text, logprob, score, reason))
    return BeamSearchOutput(state.ids, beams)
