"""Speculative decoding with the shipped target/draft pair: greedy output is token-for-token the output without
speculation, in batches that mix speculative and plain requests; degradation, metrics, CLI and vocabulary checks."""
from __future__ import annotations

import json
import re

import pytest
from click.testing import CliRunner

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import CheckpointError, ConfigError
from infer.core.hookspecs import hookimpl
from infer.core.metrics import StepStats
from infer.core.plugins import PluginManager
from infer.core.request import FinishReason, SamplingParams
from infer.models.tiny import PRETRAINED_DIR

TARGET, DRAFT = PRETRAINED_DIR / "target", PRETRAINED_DIR / "draft"
PROMPTS = [
    "def fibonacci(n):\n",
    "import os\nimport sys\n\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n",
    "    for i in range(",
    "return",
]
GREEDY = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)
PLAIN = SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True, speculative=False)
FORKED = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, n=2)
SAMPLED = SamplingParams(max_tokens=12, temperature=0.8, seed=7)
MIXED = [GREEDY, PLAIN, FORKED, GREEDY, SAMPLED]  # per prompt; the sampled one only has to finish



def engine(**options) -> Engine:
    return Engine(EngineConfig(**{"model": str(TARGET), "device": "cpu", "num_kv_blocks": 128, **options}))


def drained(e: Engine) -> bool:
    s = e.kv.stats()
    return s.used_blocks == 0 and s.free_blocks + s.cached_blocks == s.total_blocks


@pytest.fixture(scope="module")
def reference() -> list[list[list[int]]]:
    outs = engine().generate(PROMPTS + PROMPTS[:1], MIXED)
    return [[c.token_ids for c in o.outputs] for o in outs[:4]]


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("proposer", ["draft-model", "ngram"])
def test_greedy_with_speculation_equals_greedy_without(reference, proposer, k):
    e = engine(proposer=proposer, num_speculative_tokens=k)
    outs = e.generate(PROMPTS + PROMPTS[:1], MIXED)
    assert [[c.token_ids for c in o.outputs] for o in outs[:4]] == reference
    assert len(outs[4].outputs[0].token_ids) == 12
    stats = e.stats
    assert stats.spec_proposed > 0 and stats.spec_rounds > 0
    assert outs[1].metrics["spec_proposed"] == 0  # the opted-out request verified nothing
    assert outs[0].metrics["spec_proposed"] > 0
    assert stats.spec_accepted <= stats.spec_emitted <= stats.spec_accepted + stats.spec_rounds  # EOS may cut one
    assert drained(e)
    if proposer == "draft-model":
        draft_kv = e.spec.proposer.kv.stats()
        assert draft_kv.used_blocks == 0 and not e.spec.proposer.shadows
    else:
        assert not e.spec.proposer.indexes  # each finished sequence's n-gram index was dropped


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("proposer", ["draft-model", "ngram"])
def test_greedy_with_speculation_equals_greedy_without_in_half_precision(proposer, dtype):
    """Each verified position is attended as the decode of that position would be: in bf16 a prefill-shaped call
    over the k + 1 positions rounded differently and flipped near-ties (2 of 6 prompts differed)."""
    prompts = PROMPTS + ["x = [", "if __name__"]
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    plain = engine(dtype=dtype, num_kv_blocks=256).generate(prompts, params)
    spec = engine(dtype=dtype, num_kv_blocks=256, proposer=proposer, num_speculative_tokens=4).generate(prompts, params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]


def test_graceful_degradation_is_visible_and_keeps_outputs(reference):
    big = engine(proposer="ngram", num_speculative_tokens=3, plugin_options={"spec_decode": {"max_batch_size": 2}})
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (6, 6, 20)]
    outs = big.generate(PROMPTS[:3], params)
    assert [o.outputs[0].token_ids for o in outs] == [reference[0][0][:6], reference[1][0][:6], reference[2][0]]
    summary = big.stats.summary()
    assert summary["spec_steps_off_large_batch"] > 0 and summary["spec_steps_on"] > 0  # on once the batch shrank

    low = engine(proposer="draft-model", num_speculative_tokens=3,
                 plugin_options={"spec_decode": {"min_acceptance": 1.0, "probe_every": 4}})
    out = low.generate([PROMPTS[0]], SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0]
    summary = low.stats.summary()
    assert summary["spec_steps_off_low_acceptance"] > 0 and summary["spec_steps_on"] > 0  # probes keep measuring
    assert out.outputs[0].token_ids == engine().generate([PROMPTS[0]], SamplingParams(
        max_tokens=60, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids


def test_logprobs_and_stop_tokens_under_speculation():
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=2)
    plain = engine().generate([PROMPTS[1]], params)[0].outputs[0]
    spec = engine(proposer="draft-model", num_speculative_tokens=4).generate([PROMPTS[1]], params)[0].outputs[0]
    assert spec.token_ids == plain.token_ids and len(spec.logprobs) == len(plain.logprobs) == 24
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.keys() == b.keys() and all(a[t] == pytest.approx(b[t], abs=1e-4) for t in a)
    stop = plain.token_ids[9]
    first = plain.token_ids.index(stop)
    ngram = engine(proposer="ngram", num_speculative_tokens=5)
    shown = ngram.tokenizer.decode(plain.token_ids[:first])  # the stop token's own text is left out
    for strings in ((), ("never appears",)):  # one token at a time, and several per round checked for a string
        stopped = ngram.generate([PROMPTS[1]], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                              stop_token_ids=[stop], stop=strings))
        assert stopped[0].outputs[0].token_ids == plain.token_ids[: first + 1]
        assert stopped[0].outputs[0].text == shown


def test_min_tokens_holds_stop_strings_back_under_speculation_as_without(min_tokens: int = 5) -> None:
    """Several tokens accepted at once are detokenized one by one: a stop string ending in the first min_tokens
    tokens' text does not stop the output there, one ending in the next token's does, with or without drafts (stop
    strings from the early text, which the code-like output writes again later; drafts start at min_tokens)."""
    plain_engine, drafted = engine(), engine(proposer="draft-model", num_speculative_tokens=4)  # drafts from token 2
    free = plain_engine.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    early = plain_engine.tokenizer.decode(free[0].outputs[0].token_ids[:min_tokens + 2])  # and the 2 tokens after
    stops = sorted({early[i:i + n] for n in (1, 2) for i in range(len(early) - n + 1)})
    assert stops, "the first tokens have no text to choose stop strings from"
    drafted_stops = 0
    for stop in stops:
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop], min_tokens=min_tokens)
        want = plain_engine.generate([PROMPTS[1]], params)[0].outputs[0]
        got = drafted.generate([PROMPTS[1]], params)[0].outputs[0]
        assert (got.token_ids, got.text, got.finish_reason) == (want.token_ids, want.text, want.finish_reason), stop
        drafted_stops += want.finish_reason is FinishReason.STOP and len(want.token_ids) > min_tokens
    assert drafted_stops, "no stop string ended an output past min_tokens: choose other stop strings"
    assert drafted.stats.spec_accepted > 0  # drafts were accepted: tokens came several per step


def test_configuration_errors_are_clear(tmp_path):
    with pytest.raises(ConfigError, match="need a proposer"):
        engine(num_speculative_tokens=2)
    with pytest.raises(ConfigError, match="--plugin-option spec_decode.probe_every: speculative-decoding options need"):
        engine(plugin_options={"spec_decode": {"probe_every": 4}})
    for bad in ("abc", None, [3], 3.9, 0):  # a clear error, not a traceback from int()
        with pytest.raises(ConfigError, match=re.escape(f"ngram.max_n must be an integer >= 1, got {bad!r}: ")):
            engine(proposer="ngram", num_speculative_tokens=2, plugin_options={"ngram": {"max_n": bad}})
    with pytest.raises(ConfigError, match="ngram.min_n must be at most ngram.max_n, got min_n 3 and max_n 2"):
        engine(proposer="ngram", num_speculative_tokens=2, plugin_options={"ngram": {"min_n": 3, "max_n": 2}})
    with pytest.raises(ConfigError, match="num-speculative-tokens"):
        engine(proposer="ngram")
    for options, message in (
            ({"min_acceptance": True}, r"spec_decode.min_acceptance \(--spec-min-acceptance\) must be a number in "
                                       r"\[0, 1\], got True"),
            ({"min_acceptance": "0.5"}, r"\(--spec-min-acceptance\) must be a number in \[0, 1\], got '0.5'"),
            ({"min_acceptance": 1.5}, r"\(--spec-min-acceptance\) must be a number in \[0, 1\], got 1.5"),
            ({"probe_every": True}, "spec_decode.probe_every must be an integer >= 1, got True"),
            ({"round_graphs": "maybe"}, "spec_decode.round_graphs must be true or false, got 'maybe'"),  # any device
            ({"probe_evry": 4}, "spec_decode has no option 'probe_evry'; did you mean spec_decode.probe_every\\? "
                                "its options: min_acceptance \\(a number in \\[0, 1\\], default 0.0\\)")):
        with pytest.raises(ConfigError, match=message):  # True passed as 1.0 and 1; a misspelt key was ignored
            engine(proposer="draft-model", num_speculative_tokens=2, plugin_options={"spec_decode": options})
    other = tmp_path / "other-draft"
    other.mkdir()
    for f in DRAFT.iterdir():
        (other / f.name).write_bytes(f.read_bytes())
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[-2:]  # same tokens, two ids swapped: a different tokenizer
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(CheckpointError, match="does not share the target's tokenizer") as info:
        engine(proposer="draft-model", num_speculative_tokens=2, draft_model=str(other))
    first, second = sorted((a, b))
    assert f"2 of them with different ids, e.g. {first!r} is {vocab[second]} in the target, {vocab[first]} in the " \
           f"draft; {second!r} is {vocab[first]} in the target" in str(info.value)


def test_cli_speculative_generate_on_the_embedded_default():
    from infer.cli import main

    result = CliRunner().invoke(main, ["--device", "cpu", "--plugin", "draft-model", "--num-speculative-tokens", "3",
                                       "--spec-max-batch-size", "8", "generate", "def fibonacci(n):",
                                       "--max-tokens", "24", "--stats"])
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("def fibonacci(n):")
    assert '"spec_proposed"' in result.output and '"spec_steps_on"' in result.output
    result = CliRunner().invoke(main, ["--device", "cpu", "--plugin", "draft-model", "--num-speculative-tokens", "3",
                                       "generate", "def fibonacci(n):", "import os", "--max-tokens", "24", "--json"])
    assert result.exit_code == 0, result.output
    for line in result.stdout.splitlines():  # each request's own acceptance
        metrics = json.loads(line)["metrics"]
        assert metrics["spec_proposed"] > 0 and metrics["e2e_s"] > 0
        assert metrics["spec_acceptance_rate"] == metrics["spec_accepted"] / metrics["spec_proposed"]


def test_per_draft_acceptance_counts_the_drafts_the_target_judged():
    """A round judges its accepted drafts and the first rejected one; the drafts after a rejection were proposed
    but never judged, so accepted / proposed underestimates the per-draft rate that (1 - a^(K+1)) / (1 - a) needs."""
    log, plugins = StepLog(), PluginManager.from_entry_points()
    plugins.register(log, name="step-log")
    e = Engine(EngineConfig(model=str(TARGET), device="cpu", num_kv_blocks=128, proposer="draft-model",
                            num_speculative_tokens=4), plugins)
    for prompt in PROMPTS[:3]:  # one request at a time: one round per step
        e.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    rounds = [(d, a) for d, a in log.rounds if d]
    judged = sum(a + (a < d) for d, a in rounds)
    accepted = sum(a for _, a in rounds)
    assert any(a < d - 1 for d, a in rounds)  # some round left drafts unjudged
    summary = e.stats.summary()
    assert (e.stats.spec_judged, e.stats.spec_judged_accepted, summary["spec_rounds"]) == (judged, accepted,
                                                                                            len(rounds))
    assert summary["spec_per_draft_acceptance"] == round(accepted / judged, 4) > summary["spec_acceptance_rate"]


def test_a_finished_fork_frees_its_draft_kv_before_its_request_ends():
    e = engine(proposer="draft-model", num_speculative_tokens=3)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=3, n=4, stop=["\n"])
    e.add_request("def fibonacci(n):\n", params)
    early = 0
    while e.has_unfinished():
        e.step()
        for req in e.requests.values():
            done = [seq for seq in req.seqs if seq.is_finished]
            early += bool(done)
            assert all(seq.seq_id not in e.spec.proposer.shadows for seq in done)
    assert early, "no completion finished before its siblings: the check above never ran"
    assert drained(e) and e.spec.proposer.kv.stats().used_blocks == 0


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
@pytest.mark.parametrize("proposer", ["draft-model", "ngram"])
def test_stop_strings_cut_the_same_tokens_with_speculation(proposer, kv_cache):
    """Several tokens arrive per step with speculation: those after the one completing a stop string are dropped,
    so that tokens, text and logprobs are the plain run's (a review found the accepted drafts kept)."""
    # max_tokens just past a stop: the step that accepts the draft completing it may also reach max_tokens
    params = [SamplingParams(max_tokens=n, temperature=0.0, stop=["\n", " ("], logprobs=1) for n in (9, 12, 40)]
    results = []
    for spec in ({}, {"proposer": proposer, "num_speculative_tokens": 5}):
        e = engine(kv_cache=kv_cache, **spec)
        outs = e.generate([p for p in PROMPTS for _ in params], params * len(PROMPTS))
        results.append([(c.token_ids, c.text, c.finish_reason, [sorted(x) for x in c.logprobs])
                        for o in outs for c in o.outputs])
        assert drained(e)
    assert results[1] == results[0]
    assert any(len(tokens) < 9 for tokens, *_ in results[0])  # the stop strings did cut


def test_draft_proposals_are_the_draft_models_own_continuation():
    """Each round's drafts equal the draft checkpoint's greedy continuation of the target's tokens, also after a
    rejection rolled the draft back and the target moved on (the round feeds each step's tokens to the next on the
    device: a stale feed would only lower acceptance, which the exactness tests cannot see)."""
    from infer.core.request import Sequence

    k = 4
    target = engine(proposer="draft-model", num_speculative_tokens=k)
    proposer = target.spec.proposer
    draft = Engine(EngineConfig(model=str(DRAFT), device="cpu", num_kv_blocks=128))
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    seqs = [Sequence(i, f"r{i}", ids, GREEDY, 0.0) for i, ids in enumerate(prompts)]

    def draft_greedy(seq: Sequence) -> list[int]:
        params = SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True)
        return draft.generate([list(seq.token_ids)], params)[0].outputs[0].token_ids

    for accepted in (2, 0, 4):  # the target keeps some drafts, then appends a token of its own
        proposal = proposer.propose(seqs, k)
        for seq in seqs:
            assert proposal.token_ids[seq.seq_id] == draft_greedy(seq)
            drafts = proposal.token_ids[seq.seq_id]
            proposer.on_verified(seq, accepted)
            seq.token_ids += drafts[:accepted] + [(drafts[accepted] + 1) % 1000 if accepted < k else 7]
    for seq in seqs:
        proposer.release(seq)
    assert proposer.kv.stats().used_blocks == 0


class StepLog:
    def __init__(self) -> None:
        self.rounds: list[tuple[int, int]] = []  # per step: (drafts verified, accepted by the verification)

    @hookimpl
    def on_step(self, stats: StepStats) -> None:
        self.rounds.append((stats.num_draft_tokens, stats.num_accepted_tokens))


@pytest.mark.parametrize("cut_by", ["stop token", "stop string", "both"])
def test_acceptance_counts_only_drafts_that_reach_the_output(cut_by):
    """A stop on the first of several accepted drafts: the round's other drafts and its bonus token are not output,
    so neither the request's spec_accepted nor the engine's spec_emitted counts them; the step's
    num_accepted_tokens still says what the verification accepted. "both": a stop token on the second draft cuts
    the round first, then a stop string on the first drops the second from the output."""
    def run(prompt: str, params: SamplingParams) -> tuple[Engine, list[int], dict, list[tuple[int, int]]]:
        log, plugins = StepLog(), PluginManager.from_entry_points()
        plugins.register(log, name="step-log")
        e = Engine(EngineConfig(model=str(TARGET), device="cpu", num_kv_blocks=128, proposer="draft-model",
                                num_speculative_tokens=4), plugins)
        out = e.generate([prompt], params)[0]
        return e, out.outputs[0].token_ids, out.metrics, log.rounds

    def cut_round(prompt: str) -> tuple[int, int, int, str, list[tuple[int, int]]] | None:
        """(step, output index, first draft, its text, steps) of a round whose two or more accepted drafts (three
        for "both", the second new to the output too) start with a token, and a text, new to the output."""
        first, reference, _, rounds = run(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))
        start = 0  # output index of each step's first token
        for step, (drafts, accepted) in enumerate(rounds):
            if drafts and accepted >= 2 + (cut_by == "both") and start < len(reference):
                token, before = reference[start], first.tokenizer.decode(reference[:start])
                text = first.tokenizer.decode([token])
                second_new = cut_by != "both" or reference[start + 1] not in reference[: start + 1]
                if token not in reference[:start] and text.strip() and (before + text).find(text) == len(before) \
                        and second_new:
                    return step, start, token, text, rounds
            start += accepted + 1 if drafts else 1
        return None

    found = next(((prompt, cut) for prompt in PROMPTS if (cut := cut_round(prompt)) is not None), None)
    assert found is not None, "no round with enough accepted drafts whose first token is new to the output"
    prompt, (step, start, first_draft, text, rounds) = found
    reference = run(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[1]
    earlier = [(d, a) for d, a in rounds[:step] if d]
    stop = {"stop token": dict(stop_token_ids=[first_draft]), "stop string": dict(stop=[text]),
            "both": dict(stop_token_ids=[reference[start + 1]], stop=[text])}[cut_by]
    e, tokens, metrics, cut_rounds = run(prompt, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True,
                                                               **stop))
    assert tokens == reference[: start + 1]
    assert cut_rounds[step] == rounds[step]  # StepStats: what the verification accepted, the stop's cut aside
    assert metrics["spec_accepted"] == e.stats.spec_accepted == sum(a for _, a in earlier) + 1
    assert e.stats.spec_emitted == sum(a + 1 for _, a in earlier) + 1


@pytest.mark.parametrize("proposer", ["draft-model", "ngram"])
def test_a_seeded_request_samples_the_same_whatever_speculates_beside_it(proposer):
    """Near its max_tokens a request has room for fewer drafts than its neighbour: the batch's rounds are longer
    than its own, and its draws must not depend on that."""
    e = engine(proposer=proposer, num_speculative_tokens=3)
    seeded = SamplingParams(max_tokens=40, temperature=0.8, seed=123, ignore_eos=True)
    alone = e.generate([PROMPTS[0]], seeded)[0].outputs[0].token_ids
    for neighbour in (GREEDY, SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
                      SamplingParams(max_tokens=60, temperature=0.9, seed=5, ignore_eos=True)):
        beside = e.generate([PROMPTS[0], PROMPTS[1]], [seeded, neighbour])[0].outputs[0].token_ids
        assert beside == alone
    assert e.stats.spec_rounds > 0 and drained(e)


def test_draft_model_proposals_are_the_drafts_greedy_continuations():
    """The proposer's drafts for greedy requests equal the draft model's own greedy continuation of the target's
    tokens, in a first round and in later rounds after rejections and full acceptance (KV rolled back, two-token
    first steps): a wrong draft KV would show only as lower acceptance in the output tests."""
    from infer.core.request import Sequence

    e = engine(proposer="draft-model", num_speculative_tokens=4)
    draft = Engine(EngineConfig(model=str(DRAFT), device="cpu", num_kv_blocks=128))
    proposer = e.spec.proposer
    greedy = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)

    def continuation(tokens: list[int], k: int) -> list[int]:
        return draft.generate([tokens], SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))[0] \
            .outputs[0].token_ids

    seqs = [Sequence(i, f"r{i}", e.tokenize(p), greedy, 0.0, max_model_len=e.max_model_len)
            for i, p in enumerate(PROMPTS[:3])]
    for round_, keep in enumerate([None, 1, 4, 0, 2]):  # drafts kept from the last round (4: all, plus a bonus)
        if keep is not None:
            for seq, drafts in zip(seqs, proposal.token_ids.values()):
                kept = drafts[:keep] + [7 + round_]  # a recovered or bonus token of the target's
                for token in kept:
                    seq.append_token(token, 0.0)
                proposer.on_verified(seq, keep)
        proposal = proposer.propose(seqs, 4)
        assert [proposal.token_ids[s.seq_id] for s in seqs] == [continuation(s.token_ids, 4) for s in seqs], round_
    for seq in seqs:
        proposer.release(seq)
    assert proposer.kv.stats().used_blocks == 0


def test_a_draft_with_a_shorter_context_is_warned_about_at_load(tmp_path, caplog):
    """Past the draft's context a sequence gets no drafts: said at load, not left to a silently lower speedup."""
    import logging
    import shutil

    draft = tmp_path / "short_draft"
    shutil.copytree(PRETRAINED_DIR / "draft", draft)
    config = json.loads((draft / "config.json").read_text())
    config["max_position_embeddings"] = 32
    (draft / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING, logger="infer"):
        Engine(EngineConfig(model=str(PRETRAINED_DIR / "target"), device="cpu", num_kv_blocks=64,
                            proposer="draft-model", draft_model=str(draft), num_speculative_tokens=2))
    assert any("the draft model's context (32 tokens) is shorter than the target's" in r.message
               for r in caplog.records)


def test_the_draft_is_built_for_the_targets_context(tmp_path):
    """LongRoPE picks its table by the served context: a LongRoPE draft beside a target served within the original
    context turns by short_factor as the target does, and by long_factor beside one served past it."""
    import torch

    from infer.models.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "m", "phi3", max_position_embeddings=64)
    config = json.loads((path / "config.json").read_text())
    config.update(original_max_position_embeddings=16, rope_scaling={
        "type": "longrope", "short_factor": [1.0] * 8, "long_factor": [float(2 + i) for i in range(8)]})
    (path / "config.json").write_text(json.dumps(config))
    tables = []
    for context in (None, 64):
        e = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=32, max_model_len=context,
                                proposer="draft-model", draft_model=str(path), num_speculative_tokens=2))
        target, draft = e.loaded.model, e.spec.proposer.draft.model
        assert draft.spec.max_model_len == target.spec.max_model_len == (context or 16)
        assert torch.equal(draft.rotary.cos, target.rotary.cos)
        tables.append(target.rotary.cos)
    assert not torch.equal(tables[0], tables[1][:16])  # short_factor, then long_factor


def test_new_drafts_prefill_within_the_token_budget():
    """A draft shadow prefills its sequence's whole context, even where the target served most of it from the
    prefix cache: six requests on a cached prefix used to put all their contexts into one draft forward, whatever
    the step's token budget. Within the budget the rest draft in later rounds; the outputs stay the target's."""
    base = PROMPTS[1] * 3
    prompts = [base + tail for tail in ("x = 1", "def f(", "return", "import", "class A:", "for i in")]
    plain = engine(max_num_batched_tokens=128).generate(prompts, GREEDY)
    e = engine(max_num_batched_tokens=128, proposer="draft-model", num_speculative_tokens=3)
    e.generate([base], SamplingParams(max_tokens=1, temperature=0.0))  # the prefix, cached for the target
    runner, sizes = e.spec.proposer.runner, []
    prepare = runner.prepare

    def recording(out, kv, *args, **kwargs):
        sizes.append(sum(item.num_new_tokens for item in out.scheduled))
        return prepare(out, kv, *args, **kwargs)

    runner.prepare = recording  # instrumentation only: the proposer builds one batch per round
    spec = e.generate(prompts, GREEDY)
    assert e.stats.prefix_hit_rate > 0.5
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    longest = max(len(e.tokenize(p)) for p in prompts) + 1
    assert sizes and max(sizes) <= max(128, longest) < sum(len(e.tokenize(p)) for p in prompts), sizes
    assert e.stats.spec_proposed > 0 and drained(e)


def test_the_draft_model_is_built_with_the_engine_s_plugins(infer_plugins):
    """The draft loads through the engine's PluginManager: a backend registered in this process only (not an
    installed entry point) serves the draft too. The proposer built its own manager from the entry points, which
    did not know it."""
    import types

    from infer.plugins.torch_attention import TorchAttention

    built: list[TorchAttention] = []

    def counting(config: EngineConfig) -> TorchAttention:
        built.append(TorchAttention())
        return built[-1]

    module = types.ModuleType("acme_attention")
    module.register_attention_backends = hookimpl(lambda register: register("counted-torch", counting))
    module.register_attention_backends.__name__ = "register_attention_backends"
    infer_plugins.register(module, name="acme", source="infer-plugin-acme")
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    baseline = engine(proposer="draft-model", num_speculative_tokens=3, attention="torch").generate(PROMPTS[:2], params)
    e = Engine(EngineConfig(model=str(TARGET), device="cpu", num_kv_blocks=128, proposer="draft-model",
                            num_speculative_tokens=3, attention="counted-torch"), infer_plugins)
    assert len(built) == 2  # the target's backend and the draft's
    assert [r.outputs[0].token_ids for r in e.generate(PROMPTS[:2], params)] == \
        [r.outputs[0].token_ids for r in baseline]


def test_jump_forward_spells_special_token_text_as_text_within_the_vocabulary() -> None:
    """A pattern's literal ``<|eos|>`` is text, not EOS: its drafts spell it back; an id past the model's vocabulary
    (a tokenizer may hold more) cuts the drafts before it."""
    from infer.core.loader import load_tokenizer
    from infer.spec_decode.jump_forward import JumpForwardProposer

    tokenizer = load_tokenizer(TARGET)
    text = 'a<|eos|>b": '
    tokens = JumpForwardProposer(tokenizer, len(tokenizer)).spell(text)
    assert tokenizer.eos_token_id not in tokens and tokenizer.decode(tokens) == text
    limit = sorted(tokens)[len(tokens) // 2]  # a vocabulary that stops inside the text's ids
    cut = JumpForwardProposer(tokenizer, limit).spell(text)
    assert cut == tokens[: next(i for i, t in enumerate(tokens) if t >= limit)]


def test_steps_in_which_nothing_could_draft_count_in_no_speculation_state():
    """A prefill-only step counted as "on" (and, while acceptance was low, could spend the rule's probe)."""
    e = engine(proposer="ngram", num_speculative_tokens=2)
    e.add_request("def fibonacci(n):\n", SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    e.step()  # the prefill, which samples the first token: no sequence decodes yet
    assert e.stats.summary()["spec_steps_on"] == 0
    e.step()  # the first decode: it could draft
    assert e.stats.summary()["spec_steps_on"] == 1
    while e.has_unfinished():
        e.step()
    # and the prefill stays uncounted (as does a last step with room for no draft under max_tokens)
    assert 1 <= e.stats.summary()["spec_steps_on"] <= e.stats.summary()["steps"] - 1


def test_a_draft_with_fewer_ids_than_its_target_drafts_exactly(tmp_path):
    """gemma-3-1b (262144 ids) for the 4B and larger (262208, one tokenizer): the draft's logits widen to the
    target's vocabulary (the extra ids never drafted, q zero there), and a sequence holding an id the draft has no
    embedding for decodes without drafts. Here the target gains 64 random rows; one prompt holds such an id."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    wide = tmp_path / "wide_target"
    shutil.copytree(TARGET, wide)
    config = json.loads((wide / "config.json").read_text())
    vocab = config["vocab_size"]
    config["vocab_size"] = vocab + 64
    (wide / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(wide / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        if name in tensors:
            rows = tensors[name]
            tensors[name] = torch.cat([rows, torch.randn(64, rows.shape[1], generator=gen).to(rows.dtype) * rows.std()])
    save_file(tensors, str(wide / "model.safetensors"))
    options = dict(model=str(wide), device="cpu", num_kv_blocks=128)
    prompts = [[5, 9, 100, 7, 300, 41, 8, 2], [700, 3, vocab + 10, 90], [11, 12, 13, 14, 15]]
    sampled = SamplingParams(max_tokens=16, temperature=0.9, seed=3)
    plain = Engine(EngineConfig(**options))
    expected = [r.outputs[0].token_ids for r in plain.generate(prompts, [GREEDY, GREEDY, sampled])]
    spec = Engine(EngineConfig(**options, proposer="draft-model", draft_model=str(DRAFT), num_speculative_tokens=3))
    got = [r.outputs[0].token_ids for r in spec.generate(prompts, [GREEDY, GREEDY, sampled])]
    assert got[:2] == expected[:2]  # greedy: exact; the sampled one draws from the target's distribution
    assert len(got[2]) == 16 and spec.stats.spec_accepted > 0


def test_acceptance_average_weights_the_newest_step_by_the_smoothing():
    from infer.spec_decode.policy import SpecPolicy

    policy, expected = SpecPolicy(smoothing=0.2), None
    for proposed, accepted in ((10, 10), (10, 0), (4, 3)):
        rate = accepted / proposed
        expected = rate if expected is None else 0.2 * rate + 0.8 * expected
        policy.observe(proposed, accepted, rounds=1)
        assert policy.acceptance == pytest.approx(expected)


def test_a_new_stretch_of_low_acceptance_waits_a_full_probe_period():
    """Steps at good acceptance restart the probe count: after a recovery, low acceptance turns speculation off
    for probe_every - 1 steps before the next probe, as it did the first time."""
    from infer.spec_decode.policy import OFF_ACCEPTANCE, ON, SpecPolicy

    policy = SpecPolicy(min_acceptance=0.5, probe_every=3, warmup_rounds=1)
    policy.observe(proposed=10, accepted=0, rounds=1)
    assert policy.decide(1) == OFF_ACCEPTANCE  # one step into the first low stretch
    for _ in range(10):
        policy.observe(proposed=10, accepted=10, rounds=1)
    assert policy.decide(1) == ON
    for _ in range(20):
        policy.observe(proposed=10, accepted=0, rounds=1)
    assert [policy.decide(1) for _ in range(3)] == [OFF_ACCEPTANCE, OFF_ACCEPTANCE, ON]


def test_jump_forward_drafts_at_most_k_tokens_of_a_long_forced_text():
    """A grammar may force more text than k tokens (a long JSON key): the proposer drafts its first k tokens,
    not a list the decoder refuses as a broken proposal."""
    from infer.core.loader import load_tokenizer
    from infer.core.request import Sequence
    from infer.spec_decode.jump_forward import JumpForwardProposer

    class Forcing:
        def forced_text(self) -> str:
            return '{"a_rather_long_property_name": '

    tokenizer = load_tokenizer(TARGET)
    spelled = tokenizer.encode(Forcing().forced_text(), add_special_tokens=False)
    assert len(spelled) > 3
    proposer = JumpForwardProposer(tokenizer, len(tokenizer))
    seq = Sequence(0, "r", [5, 6], GREEDY, 0.0)
    for k in (1, 3):
        assert proposer.propose_guided([seq], k, {0: Forcing()}).token_ids == {0: spelled[:k]}


def test_jump_forward_keeps_the_most_recently_spelled_texts(monkeypatch):
    """The spelling cache is bounded (CACHED_TEXTS) and evicts the least recently used text."""
    from infer.spec_decode import jump_forward

    class CountingTokenizer:
        def __init__(self) -> None:
            self.encoded: list[str] = []

        def encode(self, text: str, **_: object) -> list[int]:
            self.encoded.append(text)
            return [ord(c) for c in text]

    monkeypatch.setattr(jump_forward, "CACHED_TEXTS", 2)
    tokenizer = CountingTokenizer()
    proposer = jump_forward.JumpForwardProposer(tokenizer, 1000)
    for text in ("a", "b", "a", "c"):  # "a" used again before "c" arrives: "b" is the one evicted
        assert proposer.spell(text) == [ord(text)]
    assert list(proposer.spelled) == ["a", "c"]
    proposer.spell("a")
    proposer.spell("b")
    assert tokenizer.encoded == ["a", "b", "c", "b"]


def test_drafts_stay_within_the_step_token_budget():
    """Drafts take what max_num_batched_tokens leaves after the step's scheduled tokens (prefill chunks, plain
    decodes), shared among the decoding sequences: the verified positions never exceed the budget. The proposer
    here always drafts all it may (the last token repeated)."""
    from infer.core.interfaces import Proposal

    budget = 8
    e = engine(proposer="ngram", num_speculative_tokens=4, max_num_batched_tokens=budget, scheduler="chunked-prefill")
    e.spec.proposer.propose = lambda seqs, k: Proposal({seq.seq_id: [seq.token_ids[-1]] * k for seq in seqs})
    sizes, propose = [], e.spec.propose

    def recording(out):
        propose(out)
        sizes.append((out.num_tokens, sum(len(item.draft_token_ids) for item in out.scheduled)))

    e.spec.propose = recording
    e.generate([PROMPTS[0], PROMPTS[2], PROMPTS[3]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert any(drafts for _, drafts in sizes)
    assert all(tokens + drafts <= budget for tokens, drafts in sizes), sizes


def test_seeded_verification_draws_differ_by_fork_and_round_and_from_the_drafts():
    """A seeded request's verification draws are reproducible from its seed, fork and round position (whatever the
    batch's K), and are a stream of their own: reused across forks or rounds they correlate the samples, reused
    from the draft's draws (same seed, same round) they correlate the recovered token with the rejected draft."""
    import torch

    from infer.core.request import Sequence

    e = engine(proposer="draft-model", num_speculative_tokens=3)
    params, vocab, cpu = SamplingParams(max_tokens=20, temperature=0.8, seed=11), e.spec.vocab_size, torch.device("cpu")

    def verification_noise(index, tokens, k=3):
        return e.spec._randoms([Sequence(0, "r", tokens, params, 0.0, index)], k, vocab, cpu)[1][0]

    noise = verification_noise(0, [5, 6, 7])
    assert torch.equal(verification_noise(0, [5, 6, 7], k=5), noise)  # the batch's K does not shift the stream
    assert not torch.equal(verification_noise(1, [5, 6, 7]), noise)
    assert not torch.equal(verification_noise(0, [5, 6, 7, 8]), noise)
    seq, proposer = Sequence(0, "r", [5, 6, 7], params, 0.0), e.spec.proposer
    proposer._reseed([seq])
    assert not torch.equal(torch.empty(vocab).exponential_(generator=proposer._generator(seq)), noise)


def test_a_proposer_that_drafts_nothing_leaves_no_reserved_slot_behind():
    """The slots reserved for a step's drafts go back when the proposer drafts none for a sequence: after each
    step a running sequence holds just the blocks of its computed tokens."""
    from infer.core.interfaces import Proposal
    from infer.core.request import SequenceStatus

    e = engine(proposer="ngram", num_speculative_tokens=4, block_size=4)
    e.spec.proposer.propose = lambda seqs, k: Proposal({})
    for prompt in PROMPTS[:2]:
        e.add_request(prompt, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    while e.has_unfinished():
        e.step()
        for req in e.requests.values():
            for seq in req.seqs:
                if seq.status is SequenceStatus.RUNNING:
                    assert len(e.kv.block_table(seq)) == e.kv.num_blocks_needed(seq.num_computed_tokens)
    assert drained(e)


def test_no_draft_is_proposed_that_could_not_reach_the_output():
    """A round emits its accepted drafts and one more token: a sequence with n tokens left before max_tokens is
    given at most n - 1 drafts to verify."""
    e = engine(proposer="ngram", num_speculative_tokens=4)
    rounds, propose = [], e.spec.proposer.propose

    def recording(seqs, k):
        rounds.extend((seq.params.max_tokens - seq.num_output_tokens, k) for seq in seqs)
        return propose(seqs, k)

    e.spec.proposer.propose = recording
    e.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert any(k < 4 for _, k in rounds)
    assert all(k <= left - 1 for left, k in rounds), rounds


def test_the_acceptance_rule_warms_up_over_sequence_rounds():
    """``warmup_rounds`` counts verified sequence-rounds, as spec_rounds does, not steps."""
    e = engine(proposer="draft-model", num_speculative_tokens=3,
               plugin_options={"spec_decode": {"min_acceptance": 0.1}})
    e.generate(PROMPTS[:3], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    assert e.spec.policy.rounds == e.stats.spec_rounds > e.stats.steps


def test_a_prompt_served_from_the_prefix_cache_samples_its_first_token_without_drafts():
    """With all but the last prompt token cached, the prefill is a one-token step that looks like a decode: its
    first token must still come from the sampler (a seeded request's first token is the same as without
    speculation and without the cache), not from a verification round."""
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, ignore_eos=True)
    e = engine(proposer="ngram", num_speculative_tokens=3)
    prompt = e.tokenize(PROMPTS[1] * 2)[: 2 * e.config.block_size + 1]
    first = engine(enable_prefix_caching=False).generate([prompt], params)[0].outputs[0].token_ids[0]
    for _ in range(2):  # the second time from the cache
        assert e.generate([prompt], params)[0].outputs[0].token_ids[0] == first
    assert e.stats.prefix_hit_rate > 0


def test_a_sampled_request_with_fewer_drafts_verified_last_in_the_batch():
    """The batch's rounds are as long as its longest: a sequence with fewer drafts, verified after one with more,
    repeats its own last row (its rows end the logits), and samples as it does alone."""
    from infer.core.interfaces import Proposal

    e = engine(proposer="ngram", num_speculative_tokens=3)
    e.spec.proposer.propose = lambda seqs, k: Proposal({seq.seq_id: [seq.token_ids[-1]] * k for seq in seqs})
    short = SamplingParams(max_tokens=4, temperature=0.8, seed=9, ignore_eos=True)
    alone = e.generate([PROMPTS[3]], short)[0].outputs[0].token_ids
    beside = e.generate([PROMPTS[0], PROMPTS[3]], [SamplingParams(max_tokens=12, temperature=0.8, seed=1), short])
    assert beside[1].outputs[0].token_ids == alone and e.stats.spec_proposed > 0


def test_the_proposer_hears_how_many_of_its_drafts_were_accepted():
    """``Proposer.on_verified(seq, m)``: m is the number of leading drafts equal to the target's own greedy tokens
    (a proposer keeping state, a draft's KV say, rolls back the rest)."""
    e = engine(proposer="draft-model", num_speculative_tokens=4)
    proposer, rounds, pending = e.spec.proposer, [], {}
    propose, on_verified = proposer.propose, proposer.on_verified

    def recording_propose(seqs, k):
        proposal = propose(seqs, k)
        pending.update({seq.seq_id: (seq.num_tokens, proposal.token_ids.get(seq.seq_id, [])) for seq in seqs})
        return proposal

    def recording_on_verified(seq, m):
        rounds.append((*pending[seq.seq_id], m))
        on_verified(seq, m)

    proposer.propose, proposer.on_verified = recording_propose, recording_on_verified
    prompt = e.tokenize(PROMPTS[0])
    out = e.generate([prompt], GREEDY)[0].outputs[0].token_ids
    full = prompt + engine().generate([prompt], GREEDY)[0].outputs[0].token_ids
    assert out == full[len(prompt):]

    def agreeing(start, drafts):
        return next((j for j, t in enumerate(drafts) if t != full[start + j]), len(drafts))

    assert any(0 < m < len(drafts) for _, drafts, m in rounds)
    assert all(m == agreeing(start, drafts) for start, drafts, m in rounds), rounds


def test_a_one_token_chunk_of_a_recompute_gets_no_drafts():
    """A preempted sequence recomputed in chunks may get a one-token chunk mid-context (the step's budget left
    one): like a decode it has outputs and one new token, but it samples nothing, so no draft may follow it."""
    from infer.core.interfaces import ScheduledSequence, SchedulerOutput
    from infer.core.request import Sequence

    e = engine(proposer="ngram", num_speculative_tokens=3, scheduler="chunked-prefill")
    prompt = e.tokenize(PROMPTS[1])
    seq = Sequence(0, "r", prompt, GREEDY, 0.0, token_ids=prompt + prompt[:4])  # the ngram finds these 4 earlier

    def drafts_at(computed: int) -> list[int]:
        seq.num_computed_tokens = computed
        out = SchedulerOutput([ScheduledSequence(seq, 1)])
        e.spec.propose(out)
        e.kv.free(seq)
        return out.scheduled[0].draft_token_ids

    assert drafts_at(seq.num_tokens - 1) == prompt[4:7]  # at its last token it drafts
    assert drafts_at(len(prompt)) == []
