"""The shipped logits processors on batches that mix arguments: the masks built once per distinct arguments and
applied per group give each row what transformers' processors give that row alone (token ids at the vocabulary's
edges 0 and V - 1, rows without a processor left as they were); and a processor's yield holds exactly where a row's
only logit that is not -inf is a NaN."""
from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import LogitsProcessor, ProcessorRow
from infer.core.logits_processors import LogitsProcessors
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams, Sequence
from infer.plugins.logits_processors import MAX_MASKS, AllowedTokens, BadWords, NoRepeatNgram

V = 64
ALLOWED_A = {"token_ids": [0, V - 1, 7, V + 3]}  # V + 3 lies past the vocabulary: ignored
ALLOWED_B = {"token_ids": [1, V - 2]}
WORDS_1 = {"token_ids": [[0], [V - 1], [5, 9], [3, 4, 9], [4, 12]]}
WORDS_2 = {"token_ids": [[V - 1], [2, 11], [3, 4, 13]]}


def shipped_processors() -> LogitsProcessors:
    makers: dict[str, Callable[[], LogitsProcessor]] = {
        "allowed-tokens": AllowedTokens, "bad-words": lambda: BadWords(None), "no-repeat-ngram": NoRepeatNgram}
    return LogitsProcessors(lambda name: makers[name](), lambda: sorted(makers), contextlib.nullcontext)


def transformers_row(row_logits: torch.Tensor, tokens: list[int], calls: dict[str, Any]) -> torch.Tensor:
    """One row through transformers' processors doing what ``calls`` ask, in order, as a batch of its own."""
    from transformers import NoBadWordsLogitsProcessor, PrefixConstrainedLogitsProcessor

    ids, scores = torch.tensor([tokens]), row_logits[None].clone()
    for name, args in calls.items():
        if name == "allowed-tokens":
            allowed = [t for t in args["token_ids"] if t < V]
            scores = PrefixConstrainedLogitsProcessor(lambda batch_id, sent: allowed, num_beams=1)(ids, scores)
        else:
            scores = NoBadWordsLogitsProcessor(args["token_ids"])(ids, scores)
    return scores[0]


def batch(calls: list[dict[str, Any]]) -> tuple[list[Sequence], torch.Tensor]:
    """Sequences whose tokens end in 3, 4 (ending words [3, 4, 9] and [3, 4, 13]) or in 2 (ending [2, 11]), each
    with its calls, and finite random logits for them."""
    tails = [[8, 3, 4], [6, 2], [4, 3, 4], [1, 2]]
    seqs = [Sequence(seq_id=i, request_id=f"r{i}", prompt_token_ids=[10 + i, *tails[i % len(tails)]],
                     params=SamplingParams(logits_processors=call), arrival_time=0.0) for i, call in enumerate(calls)]
    return seqs, torch.randn(len(calls), V, generator=torch.Generator().manual_seed(len(calls)))


@pytest.mark.parametrize("calls", [
    [{"allowed-tokens": ALLOWED_A}, {"allowed-tokens": ALLOWED_A}],  # every row, one mask: broadcast
    [{"allowed-tokens": ALLOWED_A}, {"allowed-tokens": ALLOWED_B}, {"allowed-tokens": ALLOWED_A}],  # one per group
    [{"bad-words": WORDS_1}, {"bad-words": WORDS_1}, {"bad-words": WORDS_1}],
    [{"bad-words": WORDS_1}, {"bad-words": WORDS_2}, {"bad-words": WORDS_1}, {"bad-words": WORDS_2}],
    [{"allowed-tokens": ALLOWED_A}, {}, {"bad-words": WORDS_1, "allowed-tokens": ALLOWED_B},
     {"allowed-tokens": ALLOWED_B}, {"bad-words": WORDS_2}, {"allowed-tokens": ALLOWED_A}, {}],  # some rows each
], ids=["allowed-one-mask", "allowed-two-masks", "words-one-list", "words-two-lists", "mixed-with-plain-rows"])
def test_grouped_rows_get_what_transformers_gives_each_row_alone(calls: list[dict[str, Any]]) -> None:
    processors = shipped_processors()
    seqs, logits = batch(calls)
    for seq in seqs:
        processors.check(seq.params)
    for step in range(2):  # the second step reads the masks kept from the first
        got = processors.apply(logits, seqs)
        assert got is not None and not got.isnan().any()
        for i, (seq, call) in enumerate(zip(seqs, calls)):
            expected = transformers_row(logits[i], seq.token_ids, call)
            assert torch.equal(got[i], expected), (step, i, call)
        assert torch.isneginf(got).any() and got.isfinite().any()


def test_the_masks_of_many_distinct_arguments_stay_right_and_bounded() -> None:
    """A server's requests may each give their own list: masks beyond MAX_MASKS drop the kept ones, never serve a
    row another's mask (arguments objects given here as plain dicts, each its own)."""
    processor = AllowedTokens()
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    for n in range(MAX_MASKS + 40):
        ids = [[n % V, V - 1], [(n * 7) % V], [0, (n + 1) % V]]
        rows = [ProcessorRow(i, [1, 2], 2, {"token_ids": own}) for i, own in enumerate(ids)]
        got = processor.apply(logits.clone(), rows)
        expected = torch.full_like(logits, -math.inf)
        for i, own in enumerate(ids):
            expected[i, own] = logits[i, own]
        assert torch.equal(got, expected), n
        assert len(processor.masks.kept) <= MAX_MASKS


class NanOnly(LogitsProcessor):
    """Bans every token and leaves token 7 NaN: a row whose only logit that is not -inf is a NaN."""

    def apply(self, logits: torch.Tensor, rows: list[ProcessorRow]) -> torch.Tensor:
        logits.fill_(float("-inf"))
        logits[:, 7] = float("nan")
        return logits


def test_a_row_left_only_a_nan_yields_to_the_plain_logits(tiny_model: Path, hf_greedy: Any) -> None:
    """No logit above -inf (a NaN is none): the processors yield and the row samples as without them, transformers'
    greedy tokens; not a row without a token."""
    import types

    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("acme_nan_processors")
    module.register_logits_processors = hookimpl(lambda register: register("nan-only", lambda c, t: NanOnly()))
    plugins.register(module, name="acme", source="infer-plugin-acme")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), plugins)
    prompt = [5, 17, 300, 42]
    rid = engine.add_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True,
                                                    logits_processors=["nan-only"]))
    seq = engine.requests[rid].seqs[0]
    while engine.has_unfinished():
        engine.step()
    assert seq.processors_yielded_steps == 3 and seq.unsampleable_steps == 0
    assert seq.token_ids[len(prompt):] == hf_greedy(tiny_model, prompt, 3)
