"""Beam search on the KV fork primitive, against HF transformers' beam search and greedy decoding."""
from __future__ import annotations

import re

import pytest
import torch

from infer.core.beam_search import BeamSearchParams, live_beams
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import CapacityError, InvalidRequestError
from infer.core.request import FinishReason, SamplingParams


TEXTS = ["def f(x):", "import os\n", "class A:\n    def", "x = [", "return"]


def with_eos(tiny_model, folder, count: int):
    """A copy of the tiny model whose end-of-sequence ids are the ``count`` tokens its greedy outputs emit most:
    random weights rarely emit the real one, and the stop path must run."""
    import collections
    import json
    import shutil

    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    outputs = engine.generate(TEXTS, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    common = [t for t, _ in collections.Counter(t for o in outputs for t in o.outputs[0].token_ids).most_common(count)]
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = common[0] if count == 1 else common
        (folder / name).write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def eos_model(tiny_model, tmp_path_factory):
    return with_eos(tiny_model, tmp_path_factory.mktemp("eos-model"), 1)


@pytest.fixture(scope="module")
def many_eos_model(tiny_model, tmp_path_factory):
    """30 end-of-sequence ids: more than 2 x width of the best candidates can be eos tokens."""
    return with_eos(tiny_model, tmp_path_factory.mktemp("many-eos-model"), 30)


def hf_beam_search(path, prompt: list[int], width: int, max_new_tokens: int, length_penalty: float,
                   ignore_eos: bool, **options) -> tuple[list[list[int]], list[float]]:
    """HF generate's beam search (early_stopping=False; ``options`` go to generate too, as its logits processors'
    settings): the beams, best first, cut after their end-of-sequence token (HF pads after it), and their scores."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    eos = model.generation_config.eos_token_id
    if ignore_eos:
        model.generation_config.eos_token_id = None
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=max_new_tokens, length_penalty=length_penalty, early_stopping=False,
                             pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             output_scores=True, return_dict_in_generate=True, **options)
    beams = [row[len(prompt):].tolist() for row in out.sequences]
    if not ignore_eos:
        eos_ids = set(eos) if isinstance(eos, list) else {eos}
        beams = [beam[: next((i + 1 for i, t in enumerate(beam) if t in eos_ids), len(beam))] for beam in beams]
    return beams, out.sequences_scores.tolist()


@pytest.mark.parametrize(("width", "length_penalty", "ignore_eos", "kv_cache"), [
    (3, 1.0, True, "paged"), (3, 1.0, True, "radix-cache"), (3, 0.0, False, "paged"), (4, 1.0, False, "paged"),
    (4, 2.0, False, "radix-cache")])
def test_beams_equal_hf_beam_search(eos_model, width, length_penalty, ignore_eos, kv_cache):
    """Tokens and scores of every returned beam equal HF's, hypotheses that stop at the end-of-sequence token
    included (the stop path ran: some beams stop, some run to max_tokens)."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", kv_cache=kv_cache, block_size=4))
    params = BeamSearchParams(beam_width=width, max_tokens=20, length_penalty=length_penalty, ignore_eos=ignore_eos)
    results = engine.beam_search(TEXTS, params)
    reasons = set()
    for text, result in zip(TEXTS, results):
        beams, scores = hf_beam_search(eos_model, engine.tokenize(text), width, 20, length_penalty, ignore_eos)
        assert [b.token_ids for b in result.beams] == beams
        assert [b.score for b in result.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)
        for beam in result.beams:  # an ordinary token ends them here: its text is left out, as generate does
            assert beam.text == engine.tokenizer.decode(beam.token_ids[:-1] if beam.finish_reason is FinishReason.STOP
                                                        else beam.token_ids)
        reasons |= {b.finish_reason for b in result.beams}
    assert reasons == ({FinishReason.LENGTH} if ignore_eos else {FinishReason.LENGTH, FinishReason.STOP})
    stats = engine.kv.stats()  # every beam freed: nothing leaks
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks


def test_one_beam_is_greedy_decoding_text_included(eos_model):
    """Width 1 is greedy: the same tokens, and the same text, that of the EOS that ends it left out."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu"))
    greedy = engine.generate(TEXTS, SamplingParams(max_tokens=20, temperature=0.0))
    beams = engine.beam_search(TEXTS, BeamSearchParams(beam_width=1, max_tokens=20))
    pairs = [(g.outputs[0], b.beams[0]) for g, b in zip(greedy, beams)]
    assert [(c.token_ids, c.text, c.finish_reason) for c, _ in pairs] == \
        [(b.token_ids, b.text, b.finish_reason) for _, b in pairs]
    assert {c.finish_reason for c, _ in pairs} == {FinishReason.STOP, FinishReason.LENGTH}


def test_many_eos_ids_leave_width_beams_like_hf(many_eos_model):
    """With more end-of-sequence ids than candidates, HF takes max(2, 1 + ids) x width candidates, so width beams
    survive a step whose best candidates are mostly eos tokens (2 x width left fewer, and other beams won)."""
    engine = Engine(EngineConfig(model=str(many_eos_model), device="cpu", block_size=4))
    results = engine.beam_search(TEXTS, BeamSearchParams(beam_width=2, max_tokens=12))
    for text, result in zip(TEXTS, results):
        beams, scores = hf_beam_search(many_eos_model, engine.tokenize(text), 2, 12, 1.0, False)
        assert [b.token_ids for b in result.beams] == beams
        assert [b.score for b in result.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)


def test_batches_keep_to_the_sequence_and_token_budgets(eos_model, infer_plugins):
    """Beam search runs batches of at most --max-num-seqs sequences and --max-num-batched-tokens tokens (a long
    prompt in chunks), as the scheduler would, with the same beams as an unconstrained engine."""
    import types

    from infer import hookimpl
    from infer.plugins.torch_attention import TorchAttention

    steps: list[tuple[int, int]] = []

    class Recording(TorchAttention):
        def prepare(self, meta):
            steps.append((len(meta.query_lens_cpu), sum(meta.query_lens_cpu)))
            assert min(meta.query_lens_cpu) >= 1  # a full batch leaves a beam for the next, not a 0-token item
            return super().prepare(meta)

    module = types.ModuleType("recording")
    module.register_attention_backends = hookimpl(lambda register: register("recording", lambda c: Recording()))
    infer_plugins.register(module, name="recording", source="tests")
    params = BeamSearchParams(beam_width=4, max_tokens=10)
    prompt = list(range(3, 43))  # 40 tokens: 5 chunks of 8
    expected = Engine(EngineConfig(model=str(eos_model), device="cpu")).beam_search([prompt, TEXTS[0]], params)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", attention="recording", max_num_seqs=3,
                                 max_num_batched_tokens=8), infer_plugins)
    results = engine.beam_search([prompt, TEXTS[0]], params)
    assert [[b.token_ids for b in r.beams] for r in results] == [[b.token_ids for b in r.beams] for r in expected]
    assert max(seqs for seqs, _ in steps) == 3 and max(tokens for _, tokens in steps) == 8


def test_cumulative_logprob_is_the_model_s(eos_model):
    """A beam's cumulative log-probability is the sum of its tokens' log-softmax under a fresh HF forward pass."""
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    model = AutoModelForCausalLM.from_pretrained(str(eos_model), dtype=torch.float32).eval()
    prompt = engine.tokenize(TEXTS[2])
    for beam in engine.beam_search([prompt], BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True))[0].beams:
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt + beam.token_ids])).logits[0], dim=-1)
        total = sum(logprobs[len(prompt) - 1 + i, t].item() for i, t in enumerate(beam.token_ids))
        assert beam.cumulative_logprob == pytest.approx(total, abs=1e-4)


def test_width_one_is_greedy_decoding_end_of_sequence_included(eos_model):
    """A beam of one keeps the best token each step: greedy decoding, which stops at the end-of-sequence token
    (kept as the beam's last token, as generate keeps it)."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu"))
    greedy = engine.generate(TEXTS, SamplingParams(max_tokens=40, temperature=0.0))
    beams = engine.beam_search(TEXTS, BeamSearchParams(beam_width=1, max_tokens=40, length_penalty=0.0))
    for g, b in zip(greedy, beams):
        assert b.beams[0].token_ids == g.outputs[0].token_ids
        assert b.beams[0].finish_reason == g.outputs[0].finish_reason
    assert any(g.outputs[0].finish_reason is FinishReason.STOP for g in greedy)  # the stop path ran


def test_hypotheses_end_at_eos_and_forks_share_blocks(eos_model, infer_plugins):
    """With the end-of-sequence token allowed, a finished hypothesis ends with it and scores by its own length;
    the beams of one prompt share the prompt's blocks (forks), so they hold far fewer than width x the prompt's."""
    import types

    from infer import hookimpl
    from infer.plugins.paged_cache import PagedKVCache

    class PeakTracking(PagedKVCache):
        peak = 0

        def allocate(self, seq, num_tokens):
            done = super().allocate(seq, num_tokens)
            PeakTracking.peak = max(PeakTracking.peak, self.stats().used_blocks)
            return done

    module = types.ModuleType("peak")
    module.register_kv_caches = hookimpl(lambda register: register(
        "peak-paged", lambda config, n, eviction: PeakTracking(n, config.block_size, eviction, True)))
    infer_plugins.register(module, name="peak", source="tests")
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, kv_cache="peak-paged"),
                    infer_plugins)
    prompt = list(range(3, 203))  # 200 tokens: 50 blocks of 4
    result = engine.beam_search([prompt], BeamSearchParams(beam_width=4, max_tokens=24))
    assert 50 < PeakTracking.peak <= 50 + 4 * (24 // 4 + 1)  # unshared, 4 x (50 + 6) blocks
    result += engine.beam_search(TEXTS, BeamSearchParams(beam_width=4, max_tokens=24))
    assert any(b.finish_reason is FinishReason.STOP for output in result for b in output.beams)  # EOS path ran
    for output in result:
        assert len(output.beams) == 4, output
        scores = [b.score for b in output.beams]
        assert scores == sorted(scores, reverse=True)
        for b in output.beams:
            assert b.score == pytest.approx(b.cumulative_logprob / len(b.token_ids))
            stopped = b.finish_reason is FinishReason.STOP
            assert (b.token_ids[-1] in engine.eos_token_ids) == stopped
            assert stopped or len(b.token_ids) == 24


def test_bad_input_is_refused_and_the_pool_stays_clean(tiny_model):
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16))
    with pytest.raises(InvalidRequestError, match="beam_width must be an integer >= 1, got 0"):
        engine.beam_search(["x"], BeamSearchParams(beam_width=0))
    with pytest.raises(InvalidRequestError, match="prompts must be a list of prompts"):
        engine.beam_search("x", BeamSearchParams())
    with pytest.raises(InvalidRequestError, match="prompt 2 of 2: prompt is empty"):
        engine.beam_search(["x", ""], BeamSearchParams())
    with pytest.raises(CapacityError, match="beam search ran out of KV blocks \\(16 in the pool\\)"):
        engine.beam_search([list(range(3, 60))], BeamSearchParams(beam_width=8, max_tokens=64, ignore_eos=True))
    vocab = engine.loaded.model.spec.vocab_size
    # each beam live after 3 tokens writes its own last block beside the prompt's 3 full ones at the 4th
    for width, live in ((14, 14), (2**31 - 1, min(2**31 - 1, vocab**3))):
        with pytest.raises(CapacityError, match=re.escape(
                f"beam_width {width} keeps {live} beams live, each writing its own last KV block beside the 3 of "
                "the prompt they share, but the cache has 16 blocks; lower beam_width")):
            engine.beam_search([list(range(3, 60))], BeamSearchParams(beam_width=width, max_tokens=4))
    assert live_beams(2**31 - 1, vocab, 1) == vocab and live_beams(2**31 - 1, vocab, 4) == 2**31 - 1
    assert live_beams(vocab + 1, vocab, 2) == vocab + 1 and live_beams(5, 1, 64) == 1
    stats = engine.kv.stats()
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks
    assert not engine.kv.take_block_ops()  # no copy queued for a beam that never ran waits for the next step
    with pytest.raises(CapacityError, match="a prompt of 300 tokens with max_tokens 16 needs up to 20 KV blocks for "
                                            "one beam, but the cache has 16; shorten the prompt"):
        engine.beam_search([list(range(3, 303))], BeamSearchParams(max_tokens=16))
    with pytest.raises(InvalidRequestError, match="beam search takes a BeamSearchParams, got SamplingParams"):
        engine.beam_search(["x"], SamplingParams())
    assert not engine.searches and not engine.has_unfinished()
    assert engine.beam_search([]) == [] and engine.start_beam_search([]).result() == []  # as generate([]) is
    for penalty in (10**400, float("nan"), -float("inf")):
        with pytest.raises(InvalidRequestError, match="length_penalty must be a finite number"):
            engine.beam_search(["x"], BeamSearchParams(length_penalty=penalty))
    assert not engine.searches and not engine.has_unfinished()


@pytest.mark.parametrize("penalty", [700, -700, 200.0, -200.0, 1e308, -1e308, 0.5])
def test_any_length_penalty_scores_as_the_formula_says(tiny_model, penalty):
    """The score logprob / length ** penalty, against Decimal arithmetic (the reference), rounded to a float: past
    the floats' range infinite, below it 0; a beam search with such a penalty runs and orders its beams by it."""
    from decimal import Context, Decimal

    from infer.core.beam_search import length_score

    exact = Context(prec=60, Emax=10**9, Emin=-10**9, traps=[])  # past its range: Infinity or 0, as floats
    for logprob, length in ((-5.25, 64), (-0.001, 3), (-80.0, 1), (-1e-300, 2)):
        want = exact.divide(Decimal(logprob), exact.power(Decimal(length), Decimal(penalty)))
        want_float = float(want)  # past the floats' range: inf, below it: 0
        got = length_score(logprob, length, penalty)
        assert got == pytest.approx(want_float, rel=1e-12) or got == want_float == 0, (logprob, length, got, want)
    assert length_score(0.0, 64, penalty) == 0  # every token certain: 0 over any finite power is 0, in range or not
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32))
    [out] = engine.beam_search([[5, 6, 7]], BeamSearchParams(beam_width=2, max_tokens=6, length_penalty=penalty))
    assert len(out.beams) == 2 and out.beams[0].score >= out.beams[1].score
    assert [b.score for b in out.beams] == [length_score(b.cumulative_logprob, len(b.token_ids), penalty)
                                            for b in out.beams]


def test_generate_beam_width_prints_the_beams(eos_model):
    import json

    from click.testing import CliRunner

    from infer.cli import main

    expected = Engine(EngineConfig(model=str(eos_model), device="cpu")).beam_search(
        TEXTS[:2], BeamSearchParams(beam_width=3, max_tokens=12, length_penalty=0.5))
    result = CliRunner().invoke(main, ["--model", str(eos_model), "--device", "cpu", "generate", *TEXTS[:2],
                                       "--beam-width", "3", "--max-tokens", "12", "--length-penalty", "0.5", "--json"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["prompt_index"], d["index"], d["token_ids"], d["finish_reason"]) for d in lines] == [
        (p, rank, b.token_ids, b.finish_reason.value) for p, out in enumerate(expected)
        for rank, b in enumerate(out.beams)]
    plain = CliRunner().invoke(main, ["--model", str(eos_model), "--device", "cpu", "generate", TEXTS[0],
                                      "--beam-width", "3", "--max-tokens", "12", "--length-penalty", "0.5"])
    assert plain.stdout == TEXTS[0] + expected[0].beams[0].text + "\n"
    refused = CliRunner().invoke(main, ["--model", str(eos_model), "generate", "x", "--beam-width", "2",
                                        "--temperature", "0.7", "--seed", "1", "--min-tokens", "2"])
    assert refused.exit_code == 2 and "--beam-width ranks whole beams by the model's own log-probabilities, with " \
        "no sampling, logit controls or per-token output: drop --temperature, --min-tokens, --seed" \
        in " ".join(refused.output.split())  # the sampling options first, as --help lists them
    refused = CliRunner().invoke(main, ["--model", str(eos_model), "generate", "x", "--beam-width", "2",
                                        "--logprobs", "2"])  # not "add --json", which would be refused next
    assert refused.exit_code == 2 and "drop --logprobs" in refused.output and "--json" not in refused.output


def test_generate_beam_width_runs_prompts_in_groups_and_names_a_bad_stdin_line(eos_model):
    """Prompts run in groups that fill --max-num-seqs (printed as each group is done): the same beams as one call;
    a bad prompt stops the command before any work, naming its stdin line."""
    import json

    from click.testing import CliRunner

    from infer.cli import main

    lines = ["def f(x):", "import os", "class A:", "x = [", "return"]
    expected = Engine(EngineConfig(model=str(eos_model), device="cpu")).beam_search(
        lines, BeamSearchParams(beam_width=2, max_tokens=8))
    result = CliRunner().invoke(main, ["--model", str(eos_model), "--device", "cpu", "--max-num-seqs", "4",
                                       "generate", "--beam-width", "2", "--max-tokens", "8", "--json"],
                                input="\n".join(lines) + "\n")
    assert result.exit_code == 0, result.output
    printed = [json.loads(line) for line in result.stdout.splitlines()]
    assert [(d["prompt_index"], d["prompt"], d["index"], d["token_ids"]) for d in printed] == [
        (p, lines[p], rank, b.token_ids) for p, out in enumerate(expected) for rank, b in enumerate(out.beams)]
    bad = CliRunner().invoke(main, ["--model", str(eos_model), "--device", "cpu", "generate", "--beam-width", "2"],
                             input="fine\n\n" + "x" * 10 ** 6 + "\n")
    assert bad.exit_code == 1 and "prompt 2 of 2:" in bad.output and "(stdin line 3)" in bad.output


@pytest.mark.gpu
def test_beam_search_on_cuda_equals_the_cpu(eos_model):
    """On CUDA (the triton backend, CUDA graphs for the beams' decode steps, copy-on-write block copies on the
    device) the beams equal the CPU's, both in float32."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    expected = Engine(EngineConfig(model=str(eos_model), device="cpu", num_kv_blocks=256)).beam_search(TEXTS, params)
    # an explicit KV pool: gpu_check.sh runs the gpu tests in 8 processes that share the card
    engine = Engine(EngineConfig(model=str(eos_model), device="cuda", dtype="float32", num_kv_blocks=256,
                                 max_num_seqs=32))  # a short ladder of decode graphs to capture
    results = engine.beam_search(TEXTS, params)
    assert [[b.token_ids for b in r.beams] for r in results] == [[b.token_ids for b in r.beams] for r in expected]
    assert [b.score for r in results for b in r.beams] == pytest.approx(
        [b.score for r in expected for b in r.beams], rel=1e-4, abs=1e-4)


# ---------------------------------------------------------------- beside requests
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)
TWO = SamplingParams(max_tokens=14, temperature=0.0, n=2)
BESIDE = [pytest.param({"kv_cache": "paged"}, id="paged"), pytest.param({"kv_cache": "radix-cache"}, id="radix"),
          pytest.param({"async_scheduling": True}, id="async-scheduling")]


def beams_of(results) -> list[list[tuple[list[int], FinishReason]]]:
    return [[(b.token_ids, b.finish_reason) for b in r.beams] for r in results]


def tokens_of(output) -> list[list[int]]:
    return [c.token_ids for c in output.outputs]


def drained(engine: Engine) -> bool:
    """Every block free or cached, none referenced, no search or request left."""
    stats = engine.kv.stats()
    return stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.total_blocks \
        and not engine.searches and not engine.has_unfinished()


def collect(outputs, into: dict) -> None:
    """Merge step() deltas into full outputs by request id."""
    from infer.core.outputs import append_output

    for out in outputs:
        if out.request_id in into:
            append_output(into[out.request_id], out)
        else:
            into[out.request_id] = out


def alone(model, options: dict, prompts, params) -> list:
    """Each request run by itself on a fresh engine: its greedy tokens per completion."""
    engine = Engine(EngineConfig(model=str(model), device="cpu", **{"block_size": 4, **options}))
    return [tokens_of(engine.generate([p], [sp])[0]) for p, sp in zip(prompts, params)]


@pytest.mark.parametrize("options", BESIDE)
def test_beside_requests_beams_and_requests_equal_their_runs_alone(eos_model, options):
    """Requests submitted before a beam search (an n > 1 one, a stream) and during one run beside it: the search
    returns exactly its beams alone, each request its greedy tokens alone, and the KV pool drains. The requests
    share prompts with the beams, so prefix-cache hits cross between them."""
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    solo = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    want_first, want_second = solo.beam_search(TEXTS[:3], params), solo.beam_search(TEXTS[3:], params)
    assert drained(solo)
    # before the first search: a plain request, an n > 1 one and a stream (read after the search)
    ids = [engine.add_request(TEXTS[0], GREEDY), engine.add_request(TEXTS[1], TWO)]
    stream = engine.stream(TEXTS[2], GREEDY)
    got_first = engine.beam_search(TEXTS[:3], params)  # drives the requests too: their deltas go to step()
    assert beams_of(got_first) == beams_of(want_first)
    assert [r.beams[0].score for r in got_first] == pytest.approx([r.beams[0].score for r in want_first], abs=1e-5)
    outputs: dict = {}
    collect(engine.step(), outputs)
    assert all(rid in outputs for rid in ids)  # they advanced while the search ran
    # a second search, stepped by step() and by the stream's reads, with requests added while it runs
    search = engine.start_beam_search(TEXTS[3:], params)
    collect(engine.step(), outputs)
    late = [engine.add_request(TEXTS[3], GREEDY), engine.add_request(TEXTS[4], TWO)]
    streamed = [next(stream), next(stream)]  # each read steps the engine: the search goes on
    while not search.done:
        collect(engine.step(), outputs)
    assert beams_of(search.result()) == beams_of(want_second)
    streamed += list(stream)  # its request has finished: the deltas made meanwhile are still read
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    expected = alone(eos_model, options, [TEXTS[0], TEXTS[1], TEXTS[3], TEXTS[4], TEXTS[2]],
                     [GREEDY, TWO, GREEDY, TWO, GREEDY])
    got = [tokens_of(outputs[rid]) for rid in ids + late] + [[[t for d in streamed for t in d.outputs[0].token_ids]]]
    assert got == expected
    assert drained(engine)


@pytest.mark.parametrize(("prompts", "blocks", "held_back"), [([TEXTS[0] * 4, TEXTS[1] * 4, TEXTS[3] * 6], 24, False),
                                                             ([TEXTS[0] * 2], 12, True)],
                         ids=["three-requests", "one-request"])
@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_beams_and_requests_competing_for_a_tiny_pool_both_finish(eos_model, prompts, blocks, held_back, preemption):
    """A pool too small for the requests and the beams at once: the search waits for blocks the requests hold, the
    requests are preempted and wait for blocks the beams hold (the scheduler scheduling nothing meanwhile is no
    error), and both finish with their outputs alone; nothing leaks. Swapped out in a step that schedules nothing,
    a request's KV reaches the host still (that step's swap was dropped: its output went wrong without an error)."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    requests = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(prompts)
    options = {"num_kv_blocks": blocks, "preemption_mode": preemption,
               "num_swap_blocks": 64 if preemption == "swap" else None}
    want = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options)).beam_search(
        [TEXTS[2]], params)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    ids = engine.add_requests(prompts, requests)
    outputs: dict = {}
    collect(engine.step(), outputs)  # the requests hold their prompts' blocks first
    search = engine.start_beam_search([TEXTS[2]], params)
    idle = 0  # steps in which every request waited for the beams' blocks
    while engine.has_unfinished():
        collect(engine.step(), outputs)
        idle += not engine.scheduler.num_running() and engine.scheduler.num_waiting() > 0
    assert beams_of(search.result()) == beams_of(want)
    assert search.waits > 0 and engine.scheduler.num_preemptions > 0  # each gave way to the other
    assert (engine.stats.beam_search_waits, engine.stats.beam_searches_finished) == (search.waits, 1)
    assert (idle > 0) == held_back  # one request: preempted, it waits for the beams with nothing running
    assert [tokens_of(outputs[rid]) for rid in ids] == alone(eos_model, options, prompts, requests)
    assert drained(engine)


def test_an_older_search_restarts_a_younger_one_that_holds_the_blocks_it_needs(eos_model):
    """Two searches that cannot both fit: the older one takes the younger one's blocks (the younger begins again,
    waiting behind it), and both return their beams alone."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    options = {"num_kv_blocks": 10}  # either fits alone, not both
    solo = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    want = [solo.beam_search([TEXTS[0]], params), solo.beam_search([TEXTS[4]], params)]
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    older = engine.start_beam_search([TEXTS[0]], params)
    engine.step()
    younger = engine.start_beam_search([TEXTS[4]], params)
    steps = 1
    while not older.done:
        engine.step()
        steps += 1
    assert steps == params.max_tokens  # it never waited for the younger: a token each step, as alone
    while engine.has_unfinished():
        engine.step()
    assert [beams_of(older.result()), beams_of(younger.result())] == [beams_of(w) for w in want]
    assert younger.restarts > 0 and older.restarts == 0
    assert engine.stats.beam_search_restarts == younger.restarts and engine.stats.beam_searches_finished == 2
    assert drained(engine)


def test_one_token_beams_wider_than_the_pool_are_not_refused(tiny_model):
    """max_tokens 1: no beam ever feeds a token of its own (the search ends at its first choice), so 14 beams of a
    57-token prompt run on 16 blocks of 16 (3 shared full blocks + 14 would be 17), as HF's beam search gives them;
    with max_tokens 2 each of the 14 beams writes its own block, and the width is refused."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16, block_size=16))
    prompt = list(range(3, 60))
    params = BeamSearchParams(beam_width=14, max_tokens=1, ignore_eos=True)
    [result] = engine.beam_search([prompt], params)
    beams, scores = hf_beam_search(tiny_model, prompt, 14, 1, 1.0, True)
    assert [b.token_ids for b in result.beams] == beams
    assert [b.score for b in result.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)
    with pytest.raises(CapacityError, match="beam_width 14 keeps 14 beams live"):
        engine.beam_search([prompt], BeamSearchParams(beam_width=14, max_tokens=2, ignore_eos=True))
    whole = list(range(3, 3 + 16 * 16))  # a prompt that fills the pool, for one token: its beams fit
    [alone] = engine.beam_search([whole], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True))
    assert [b.token_ids for b in alone.beams] == hf_beam_search(tiny_model, whole, 2, 1, 1.0, True)[0]
    stats = engine.kv.stats()
    assert stats.free_blocks + stats.cached_blocks == stats.total_blocks


def test_a_search_that_cannot_fit_fails_alone_and_the_requests_go_on(tiny_model):
    """A search whose beams outgrow the pool fails with CapacityError (its blocks freed), at its start when one
    beam, or its live beams' own blocks, cannot fit, else when the beams outgrow the pool; the requests beside it
    finish as they would alone."""
    options = {"num_kv_blocks": 16, "block_size": 16}
    requests = [SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)] * 2
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", **options))
    ids = engine.add_requests(TEXTS[:2], requests)
    outputs: dict = {}
    collect(engine.step(), outputs)
    with pytest.raises(CapacityError, match="needs up to 20 KV blocks for one beam, but the cache has 16"):
        engine.start_beam_search([list(range(3, 303))], BeamSearchParams(max_tokens=16))
    with pytest.raises(CapacityError, match="beam_width 16 keeps 16 beams live"):
        engine.start_beam_search([list(range(3, 60))], BeamSearchParams(beam_width=16, max_tokens=64))
    search = engine.start_beam_search([list(range(3, 60))], BeamSearchParams(beam_width=8, max_tokens=64,
                                                                          ignore_eos=True))
    while not search.done:
        collect(engine.step(), outputs)  # the search's error is its own: step() does not raise it
    with pytest.raises(CapacityError, match="beam search ran out of KV blocks \\(16 in the pool\\)"):
        search.result()
    with pytest.raises(CapacityError, match="beam search ran out of KV blocks \\(16 in the pool\\)"):
        engine.beam_search([list(range(3, 60))], BeamSearchParams(beam_width=8, max_tokens=64, ignore_eos=True))
    assert not engine.searches  # the search waited for the requests' blocks, then outgrew the pool alone
    assert (engine.stats.beam_searches_failed, engine.stats.beam_searches_finished) == (2, 0)  # refused: not counted
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert [tokens_of(outputs[rid]) for rid in ids] == alone(tiny_model, options, TEXTS[:2], requests)
    assert drained(engine) and not engine.kv.take_block_ops()


def test_aborting_a_search_midway_frees_its_blocks_and_the_requests_finish(eos_model):
    params = BeamSearchParams(beam_width=4, max_tokens=30, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    search = engine.start_beam_search(TEXTS[:2], params)
    for _ in range(5):
        engine.step()
    assert engine.kv.stats().used_blocks > 0
    engine.abort_beam_search(search)
    engine.abort_beam_search(search)  # idempotent
    assert engine.stats.summary()["beam_searches_aborted"] == 1
    assert search.done and engine.kv.stats().used_blocks == 0 and not engine.has_unfinished()
    assert search.length == 5  # its best hypotheses so far: those of a search that ends after 5 tokens
    cut = engine.beam_search(TEXTS[:2], BeamSearchParams(beam_width=4, max_tokens=5, ignore_eos=True))
    for got, want in zip(search.result(), cut, strict=True):  # the second search's prompt is a prefix-cache hit:
        assert [b.token_ids for b in got.beams] == [b.token_ids for b in want.beams]  # float32 sums in another order
        assert [b.score for b in got.beams] == pytest.approx([b.score for b in want.beams], rel=1e-6, abs=0)
        assert {b.finish_reason for b in got.beams} == {FinishReason.ABORT}
    rid = engine.add_request(TEXTS[2], GREEDY)
    search = engine.start_beam_search(TEXTS[:2], params)
    outputs: dict = {}
    for _ in range(5):
        collect(engine.step(), outputs)
    engine.abort_beam_search(search)
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert tokens_of(outputs[rid]) == alone(eos_model, {}, [TEXTS[2]], [GREEDY])[0]
    assert drained(engine)


def test_ctrl_c_in_a_beam_step_ends_that_search_and_the_engine_goes_on(eos_model, monkeypatch):
    """A KeyboardInterrupt in a search's forward left it half-stepped: its next step failed with an unrelated
    ValueError from the runner. Now the search ends with the interrupt (its result() raises it) and frees its
    blocks, and the engine's requests go on."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, max_num_batched_tokens=16))
    search = engine.start_beam_search(TEXTS[:2], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    execute, calls = engine.runner.execute, []

    def execute_with_ctrl_c(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return execute(*args, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", execute_with_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        for _ in range(5):
            engine.step()
    assert search.done and not engine.searches.active and engine.kv.stats().used_blocks == 0
    with pytest.raises(KeyboardInterrupt):
        search.result()
    assert engine.stats.summary()["beam_searches_failed"] == 1
    assert tokens_of(engine.generate([TEXTS[2]], [GREEDY])[0]) == alone(eos_model, {}, [TEXTS[2]], [GREEDY])[0]


def run_beside_midflight(engine: Engine) -> None:
    """Requests mid-flight (two steps in) when a beam search starts: the beams and the requests' tokens equal
    their runs alone on the same engine, and the pool drains."""
    params = BeamSearchParams(beam_width=4, max_tokens=20)
    want_beams = engine.beam_search(TEXTS[:2], params)
    want = [tokens_of(engine.generate([text], [GREEDY])[0]) for text in TEXTS]
    ids = [engine.add_request(text, GREEDY) for text in TEXTS]
    outputs: dict = {}
    for _ in range(2):
        collect(engine.step(), outputs)
    assert engine.in_flight is not None or not engine.async_scheduling  # a step's tokens are on the device
    got_beams = engine.beam_search(TEXTS[:2], params)
    collect(engine.step(), outputs)  # with the deltas that the search's steps made (the requests may be done)
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert beams_of(got_beams) == beams_of(want_beams)
    assert [tokens_of(outputs[rid]) for rid in ids] == want
    assert drained(engine)


@pytest.mark.gpu
def test_beside_requests_on_cuda_with_async_scheduling_equal_their_runs_alone(eos_model):
    """On CUDA, async scheduling keeps a step in flight: a beam step settles it first, so that the beams' forward
    passes never overlap it (CUDA graphs and staged inputs included)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    engine = Engine(EngineConfig(model=str(eos_model), device="cuda", dtype="float32", num_kv_blocks=256,
                                 max_num_seqs=32, enable_prefix_caching=False))
    assert engine.async_scheduling and engine.runner.graphs is not None
    run_beside_midflight(engine)


def test_beside_requests_midflight_with_async_scheduling_on_the_cpu(eos_model):
    run_beside_midflight(Engine(EngineConfig(model=str(eos_model), device="cpu", async_scheduling=True,
                                             enable_prefix_caching=False, block_size=4)))


def test_a_search_of_several_prompts_short_at_its_first_step_waits_and_returns_its_beams_alone(eos_model):
    """Requests hold most of a tiny pool when a two-prompt search starts: the first prompt's beam gets its blocks,
    the second's does not, so the search waits at its first step (keeping the first's blocks, giving back the
    second's prefix-cache match) and then returns its beams alone; the requests finish as alone, nothing leaks."""
    params = BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True)
    requests = [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * 2
    prompts, options = [TEXTS[0] * 4, TEXTS[1] * 4], {"num_kv_blocks": 14}
    want = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options)).beam_search(
        [TEXTS[2], TEXTS[3] * 6], params)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    ids = engine.add_requests(prompts, requests)
    outputs: dict = {}
    collect(engine.step(), outputs)
    search = engine.start_beam_search([TEXTS[2], TEXTS[3] * 6], params)
    collect(engine.step(), outputs)
    assert search.waits > 0 and not search.done  # its first step found blocks for one prompt only
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert beams_of(search.result()) == beams_of(want)
    assert [tokens_of(outputs[rid]) for rid in ids] == alone(eos_model, options, prompts, requests)
    assert drained(engine)


def test_a_search_starts_from_the_prefix_cache(eos_model):
    """A search's prompt whose blocks are cached is looked up as a request's is: every full block but the last
    token's comes from the cache, and the beams are those of a cold engine."""
    params = BeamSearchParams(beam_width=3, max_tokens=6)
    prompt = TEXTS[2] * 3
    want = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4)).beam_search([prompt], params)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0))
    before, size = engine.kv.stats(), len(engine.tokenize(prompt))
    assert beams_of(engine.beam_search([prompt], params)) == beams_of(want)
    after = engine.kv.stats()
    assert (after.prefix_queries - before.prefix_queries, after.prefix_hits - before.prefix_hits) == (
        size, (size - 1) // 4 * 4)


@pytest.mark.parametrize(("blocks", "restarted"), [(14, [False, False, True]), (12, None)])
def test_the_oldest_search_restarts_the_youngest_first(eos_model, blocks, restarted):
    """Three searches that cannot all fit: the oldest takes the blocks of the youngest that holds some (in 14
    blocks the middle one keeps its own, the youngest's being enough), and every search returns its beams alone."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    options = {"num_kv_blocks": blocks}
    prompts = [TEXTS[0], TEXTS[4], TEXTS[1]]
    solo = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    want = [beams_of(solo.beam_search([p], params)) for p in prompts]
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    searches = []
    for prompt in prompts:
        searches.append(engine.start_beam_search([prompt], params))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert [beams_of(s.result()) for s in searches] == want
    assert restarted is None or [s.restarts > 0 for s in searches] == restarted
    assert drained(engine)


def test_a_request_waiting_without_blocks_does_not_make_the_oldest_search_wait(eos_model):
    """Two searches hold the whole pool and a request waits, holding no blocks: the oldest search, short of
    blocks, restarts the younger rather than wait for the request (which could never give it any), and the
    searches and the request all end with their outputs alone."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    options = {"num_kv_blocks": 10}
    solo = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    want = [beams_of(solo.beam_search([TEXTS[0]], params)), beams_of(solo.beam_search([TEXTS[4]], params))]
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    older = engine.start_beam_search([TEXTS[0]], params)
    engine.step()
    younger = engine.start_beam_search([TEXTS[4]], params)
    for _ in range(3):
        engine.step()
    rid = engine.add_request(TEXTS[3], GREEDY)
    outputs: dict = {}
    collect(engine.step(), outputs)
    assert engine.scheduler.num_waiting() == 1 and not engine.scheduler.num_running()  # no block for it
    for _ in range(300):
        if not engine.has_unfinished():
            break
        collect(engine.step(), outputs)
    assert not engine.has_unfinished()  # no one waited forever
    assert [beams_of(older.result()), beams_of(younger.result())] == want
    assert tokens_of(outputs[rid]) == alone(eos_model, options, [TEXTS[3]], [GREEDY])[0]
    assert drained(engine)


def test_a_search_that_cannot_fit_is_refused_at_its_start_and_a_younger_one_keeps_its_progress(tiny_model):
    """A search whose live beams alone outnumber the pool's blocks (16 beams, each writing its own last block, beside
    the prompt's 3 shared ones: 19 of 16) is refused when it starts, before any step: the search started after it
    returns the beams it has alone, never restarted for it."""
    options = {"num_kv_blocks": 16, "block_size": 16}
    small = BeamSearchParams(beam_width=2, max_tokens=40, ignore_eos=True)
    want = Engine(EngineConfig(model=str(tiny_model), device="cpu", **options)).beam_search([TEXTS[0]], small)
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", **options))
    younger = engine.start_beam_search([TEXTS[0]], small)
    engine.step()
    with pytest.raises(CapacityError, match="beam_width 16 keeps 16 beams live, each writing its own last KV block "
                                            "beside the 3 of the prompt they share, but the cache has 16 blocks"):
        engine.start_beam_search([list(range(3, 60))], BeamSearchParams(beam_width=16, max_tokens=64,
                                                                        ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert beams_of(younger.result()) == beams_of(want) and younger.restarts == 0
    assert drained(engine)


def test_a_search_that_outgrows_the_whole_pool_mid_run_fails_without_restarting_a_younger_one(tiny_model):
    """12 beams of a 48-token prompt (3 shared blocks) fit the 16-block pool at the start; once their tokens cross a
    block boundary they need more blocks than the pool has: the step that finds that fails the search at once,
    restarting no younger search (that would not give it room), and the younger one returns its beams alone."""
    options = {"num_kv_blocks": 16, "block_size": 16}
    small = BeamSearchParams(beam_width=1, max_tokens=40, ignore_eos=True)
    want = Engine(EngineConfig(model=str(tiny_model), device="cpu", **options)).beam_search([TEXTS[0]], small)
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", **options))
    big = engine.start_beam_search([list(range(3, 51))], BeamSearchParams(beam_width=12, max_tokens=64,
                                                                          ignore_eos=True))
    younger = engine.start_beam_search([TEXTS[0]], small)
    while not big.done:
        restarts = younger.restarts
        engine.step()
    assert younger.restarts == restarts and 16 <= big.length < 64  # none at the failing step; past a block edge
    with pytest.raises(CapacityError, match="beam search ran out of KV blocks \\(16 in the pool\\) with 12 beams"):
        big.result()
    while engine.has_unfinished():
        engine.step()
    assert beams_of(younger.result()) == beams_of(want)
    assert drained(engine)


def test_a_beam_search_call_interrupted_mid_way_leaves_no_search_behind(eos_model, monkeypatch):
    """Ctrl-C (or any error) in one of the steps that Engine.beam_search drives stops its search and frees its
    beams: the engine is left idle with its pool drained, and the same search run again returns its beams."""
    params = BeamSearchParams(beam_width=3, max_tokens=12)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    want = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4)).beam_search(TEXTS[:2], params)
    steps, step = [0], engine._step

    def interrupted():
        steps[0] += 1
        if steps[0] == 4:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "_step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        engine.beam_search(TEXTS[:2], params)
    assert drained(engine)
    assert beams_of(engine.beam_search(TEXTS[:2], params)) == beams_of(want)


def test_a_search_that_needs_the_whole_pool_waits_for_the_requests_blocks(eos_model):
    """Beams that need every block of the pool at once, while requests hold some: the search waits for them
    (needing no more than the pool is not outgrowing it) and returns its beams alone, the requests their tokens."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    requests = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 2
    prompts, options = [TEXTS[4], TEXTS[1]], {"num_kv_blocks": 9}
    want = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options)).beam_search(
        [TEXTS[0]], params)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    ids = engine.add_requests(prompts, requests)
    outputs: dict = {}
    collect(engine.step(), outputs)
    search = engine.start_beam_search([TEXTS[0]], params)
    while engine.has_unfinished():
        collect(engine.step(), outputs)
    assert beams_of(search.result()) == beams_of(want) and search.waits > 0
    assert [tokens_of(outputs[rid]) for rid in ids] == alone(eos_model, options, prompts, requests)
    assert drained(engine)


def test_a_search_that_fits_alone_is_not_refused_beside_younger_ones(eos_model):
    """The oldest search, short of blocks, counts what its beams need: beams that share a partial last block need
    one copy fewer than their number (the last writes in place), so it restarts the younger search, not fails."""
    params = BeamSearchParams(beam_width=4, max_tokens=16, ignore_eos=True)
    options = {"num_kv_blocks": 10}
    want = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options)).beam_search(
        [TEXTS[4]], params)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, **options))
    searches = []
    for prompt in (TEXTS[0], TEXTS[4], TEXTS[1]):  # the third alone outgrows the pool: it may fail
        searches.append(engine.start_beam_search([prompt], params))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert beams_of(searches[1].result()) == beams_of(want)


# ---------------------------------------------------------------- from a mutation audit of beam search
@pytest.mark.parametrize(("field", "value"), [("beam_width", True), ("beam_width", 2.0), ("max_tokens", False),
                                              ("length_penalty", True)])
def test_a_bool_or_float_count_and_a_bool_penalty_are_refused(tiny_model, field, value):
    """A bool is an int to isinstance, and 2.0 compares as 2: neither is a count of beams or tokens, nor is a bool
    a length penalty; each is refused before any work, as an integer or a finite number is asked for."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16))
    with pytest.raises(InvalidRequestError, match=f"{field} must be"):
        engine.beam_search(["x"], BeamSearchParams(**{field: value}))
    assert not engine.searches and engine.kv.stats().used_blocks == 0


def test_a_prompt_past_the_context_length_with_max_tokens_is_refused_as_generate_refuses_it(tiny_model):
    """The context-length check counts max_tokens: a prompt that fits alone but not with its max_tokens is refused
    with generate's message, and one that fits with them runs to max_tokens."""
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", max_model_len=32))
    prompt = list(range(3, 23))  # 20 tokens: 12 more fit
    with pytest.raises(InvalidRequestError) as refused:
        engine.generate([prompt], SamplingParams(max_tokens=13))
    with pytest.raises(InvalidRequestError, match="exceeds the model's context length 32") as beam_refused:
        engine.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=13))
    assert str(beam_refused.value) == str(refused.value)
    [out] = engine.beam_search([prompt], BeamSearchParams(beam_width=2, max_tokens=12, ignore_eos=True))
    assert [len(b.token_ids) for b in out.beams] == [12, 12]


@pytest.mark.parametrize("block_size", [4, 16])
def test_a_prompt_whose_one_beam_fills_the_pool_exactly_runs(eos_model, block_size):
    """One beam holds the prompt and every token but the last (the last is never run through the model): a pool of
    exactly ceil((prompt + max_tokens - 1) / block_size) blocks is enough, and the search returns greedy decoding;
    one block fewer is refused at the start."""
    prompt, max_tokens = list(range(3, 3 + 3 * block_size - 4)), 5  # prompt + max_tokens - 1 = 3 blocks exactly
    want = Engine(EngineConfig(model=str(eos_model), device="cpu")).generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids
    params = BeamSearchParams(beam_width=1, max_tokens=max_tokens, ignore_eos=True)
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=block_size, num_kv_blocks=3,
                                 enable_prefix_caching=False))
    assert engine.beam_search([prompt], params)[0].beams[0].token_ids == want
    assert drained(engine)
    with pytest.raises(CapacityError, match="needs up to 4 KV blocks for one beam, but the cache has 3"):
        engine.beam_search([prompt + [3]], params)


def test_blocks_short_counts_the_blocks_that_allocating_the_beams_takes(eos_model):
    """At every step, the blocks that blocks_short says the beams need for their next token (a new block for each
    beam whose token starts one, one copy per beam sharing a partial last block but the last) are exactly those
    that allocating them takes from the pool (the reference: the pool's own count)."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, enable_prefix_caching=False))
    search = engine.start_beam_search([TEXTS[0], TEXTS[2]], BeamSearchParams(beam_width=4, max_tokens=14,
                                                                             ignore_eos=True))
    engine.step()
    counted = []
    while not search.done:
        beams = [beam for state in search.states for beam, _ in state.live]
        search.short = beams  # as if none had its blocks yet (the step below allocates them again: no-ops)
        need, free = search.blocks_short(), engine.kv.stats().free_blocks
        assert not search.short_of_blocks(beams)
        assert free - engine.kv.stats().free_blocks == need
        counted.append(need)
        search.short = []
        engine.step()
    assert max(counted) > min(counted)  # steps that start blocks and steps that only copy partial ones
    assert drained(engine)


@pytest.mark.parametrize("penalty", [1e308, -1e308])
def test_tied_scores_keep_the_order_the_hypotheses_finished_in(eos_model, penalty):
    """A penalty so far from 0 that every score leaves the floats' range ties them all (0 or -inf); they come out
    in the order they finished: at max_tokens with ignore_eos, best cumulative log-probability first, which is
    HF's order with length_penalty 0 (the beams themselves do not depend on the penalty when none stops early)."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    params = BeamSearchParams(beam_width=4, max_tokens=8, length_penalty=penalty, ignore_eos=True)
    for text, result in zip(TEXTS[:3], engine.beam_search(TEXTS[:3], params)):
        beams, cumulative = hf_beam_search(eos_model, engine.tokenize(text), 4, 8, 0.0, True)
        assert len({b.score for b in result.beams}) == 1  # tied
        assert [b.token_ids for b in result.beams] == beams
        assert [b.cumulative_logprob for b in result.beams] == pytest.approx(cumulative, abs=1e-5)


def test_a_beam_wider_than_the_vocabulary_keeps_every_token(eos_model):
    """beam_width past the vocabulary's size: fewer beams, one per token, every token of the vocabulary ranked by
    its log-probability under a fresh HF forward pass (an end-of-sequence token among them stopped there)."""
    from transformers import AutoModelForCausalLM

    engine = Engine(EngineConfig(model=str(eos_model), device="cpu"))
    prompt = engine.tokenize(TEXTS[0])
    model = AutoModelForCausalLM.from_pretrained(str(eos_model), dtype=torch.float32).eval()
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
    vocab = logprobs.shape[0]
    [out] = engine.beam_search([prompt], BeamSearchParams(beam_width=vocab + 100, max_tokens=1))
    assert sorted(b.token_ids[0] for b in out.beams) == list(range(vocab))
    assert [b.score for b in out.beams] == sorted((b.score for b in out.beams), reverse=True)
    assert [b.score for b in out.beams] == pytest.approx([logprobs[b.token_ids[0]].item() for b in out.beams],
                                                         abs=1e-5)
    assert {b.finish_reason for b in out.beams if b.token_ids[0] in engine.eos_token_ids} == {FinishReason.STOP}
    for beam in out.beams:  # a token that leaves a character open reads as U+FFFD, as the tokenizer decodes it
        tokens = beam.token_ids[:-1] if beam.finish_reason is FinishReason.STOP else beam.token_ids
        assert beam.text == engine.tokenizer.decode(tokens, skip_special_tokens=True)
    assert drained(engine)


def test_a_prompt_that_finishes_early_frees_its_beams_at_once(eos_model):
    """A prompt whose hypotheses are done (early stopping) gives its beams' blocks back in that step, while the
    search's other prompts go on: after every step the pool holds exactly the blocks of the unfinished prompts'
    beams (the reference: the pool's own count of blocks in use)."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4, enable_prefix_caching=False))
    search = engine.start_beam_search(TEXTS, BeamSearchParams(beam_width=3, max_tokens=30))
    early = False
    while not search.done:
        engine.step()
        unfinished = [state for state in search.states if not state.finished]
        held = {block for state in unfinished for beam, _ in state.live for block in engine.kv.block_table(beam)}
        assert engine.kv.stats().used_blocks == len(held)
        early |= not search.done and len(unfinished) < len(TEXTS)
    assert early  # some prompt finished while others went on
    assert drained(engine)


def test_an_error_mid_allocation_drops_the_copies_queued_for_the_failed_search(eos_model, monkeypatch):
    """An error while a step allocates its beams' blocks, after a shared partial block's copy was queued, fails
    that search and frees its beams; the queued copy goes with them: it must not run later (the next scheduler step
    would run it, into blocks that others get, after a swap-in that filled one, say)."""
    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", block_size=4))
    search = engine.start_beam_search(TEXTS[:2], BeamSearchParams(beam_width=3, max_tokens=8, ignore_eos=True))
    allocate = engine.kv.allocate

    def allocate_then_fail(seq, num_tokens):
        done = allocate(seq, num_tokens)
        if engine.kv.ops.copies:  # a copy-on-write copy is queued: fail before a forward pass runs it
            raise RuntimeError("allocation failed")
        return done

    monkeypatch.setattr(engine.kv, "allocate", allocate_then_fail)
    schedule, late = engine._schedule, []

    def schedule_recording():  # the copies a scheduler step runs: none of the search's may reach one
        out = schedule()
        late.extend(out.block_ops.copies)
        return out

    monkeypatch.setattr(engine, "_schedule", schedule_recording)
    for _ in range(8):
        if search.done:
            break
        engine.step()
    with pytest.raises(RuntimeError, match="allocation failed"):
        search.result()
    assert search.length >= 1 and engine.stats.beam_searches_failed == 1
    assert not late and not engine.kv.take_block_ops() and drained(engine)


def test_without_a_search_async_scheduling_still_schedules_over_the_tokens_in_flight(eos_model, monkeypatch):
    """A beam step settles the step in flight first (the beams' forward passes must not overlap it); without an
    active search nothing settles early: async scheduling schedules each step while the previous one's tokens are
    still PENDING placeholders, and only the steps beside a search see them read back."""
    from infer.core.runner import PENDING_TOKEN

    engine = Engine(EngineConfig(model=str(eos_model), device="cpu", async_scheduling=True, block_size=4))
    schedule, pending = engine.scheduler.schedule, []

    def recording():
        pending.append((bool(engine.searches), any(seq.token_ids[-1] == PENDING_TOKEN
                                                   for req in engine.requests.values() for seq in req.seqs)))
        return schedule()

    monkeypatch.setattr(engine.scheduler, "schedule", recording)
    long = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    engine.add_request(TEXTS[0], long)
    for _ in range(4):
        engine.step()
    search = engine.start_beam_search(TEXTS[1:3], BeamSearchParams(beam_width=2, max_tokens=4))
    engine.add_request(TEXTS[3], long)
    while engine.has_unfinished():
        engine.step()
    assert search.done
    assert any(p for searching, p in pending if not searching)  # overlapped
    assert not any(p for searching, p in pending if searching)  # settled first


def markov_model(tiny_model, folder, logits: dict, eos: list[int], floor: float = -20.0):
    """A copy of the tiny model whose next-token logits depend on the last token only, as ``logits`` says:
    ``logits[c]`` maps tokens to their logits after context token ``c`` (``logits[None]`` after any other
    token), every token not named getting ``floor``. The attention and MLP outputs are zeroed, so the residual
    stream is the last token's embedding, a one-hot row per named context; the head's columns are the tables."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    weights = load_file(str(folder / "model.safetensors"))
    vocab, hidden = weights["model.embed_tokens.weight"].shape
    contexts = [None, *(c for c in logits if c is not None)]
    assert len(contexts) <= hidden
    embed, head = torch.zeros(vocab, hidden), torch.full((vocab, hidden), floor)
    embed[:, 0] = 1.0
    for dim, context in enumerate(contexts):
        if context is not None:
            embed[context] = torch.nn.functional.one_hot(torch.tensor(dim), hidden).float()
        for token, value in logits.get(context, {}).items():
            head[token, dim] = value
    for name in weights:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights["model.embed_tokens.weight"], weights["lm_head.weight"] = embed, head
    weights["model.norm.weight"] = torch.full((hidden,), hidden ** -0.5)  # a one-hot row normalises to itself
    save_file(weights, str(folder / "model.safetensors"))
    for name in ("config.json", "generation_config.json"):
        config = json.loads((folder / name).read_text())
        config["eos_token_id"] = eos
        (folder / name).write_text(json.dumps(config))
    return folder


def test_one_more_candidate_per_eos_id_keeps_a_beam_that_ranks_below_every_eos(tiny_model, tmp_path):
    """HF keeps (1 + number of eos ids) x width candidates: with 30 eos ids and width 2, a step whose best
    candidate is an ordinary token and whose next 60 are all eos tokens still keeps a second beam, the 62nd
    candidate (30 x width would keep one). On a model whose next token depends on the last only, that beam goes on
    at almost no cost and, scored by its length, ends best: the beams and scores equal HF's."""
    eos = list(range(200, 230))
    a, b, x, y, y2 = 20, 21, 22, 23, 24
    spread = {token: -0.05 * i for i, token in enumerate(range(30, 130))}  # ~ -4.6 a token: a poor path
    table = {
        6: {a: 10.0, b: 9.9, **{e: 5.0 - 0.05 * i for i, e in enumerate(eos)}},
        a: {x: 10.0, **{e: 9.5 - 0.02 * i for i, e in enumerate(eos)}},  # best: a x; then a's eos tokens
        b: {y: 8.0, **{e: 9.49 - 0.02 * i for i, e in enumerate(eos)}},  # b's eos tokens; b y below them all
        x: spread, None: spread, y: {y2: 30.0}, y2: {y2: 30.0},
    }
    model = markov_model(tiny_model, tmp_path / "markov", table, eos)
    engine = Engine(EngineConfig(model=str(model), device="cpu", block_size=4))
    [out] = engine.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=5))
    beams, scores = hf_beam_search(model, [5, 6], 2, 5, 1.0, False)
    assert [b.token_ids for b in out.beams] == beams
    assert [b.score for b in out.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)
    assert out.beams[0].token_ids == [b, y, y2, y2, y2]  # the beam that ranked 62nd


def test_a_live_beam_that_only_ties_the_worst_kept_hypothesis_stops_the_search_as_hf_does(tiny_model, tmp_path):
    """HF's early_stopping=False stops when no live beam scores better than the worst of the width best finished
    hypotheses; a tie stops it. Here a beam's two best tokens, an eos and another, have the same logit: the eos
    finishes a hypothesis that ties the live beam exactly (same log-probability, same length), and the search
    stops with it, though the live beam would have gone on to a better one."""
    e1, e2, a, b, c, d = 200, 201, 20, 21, 22, 23
    table = {6: {e1: 10.0, a: 9.0, b: 8.0}, a: {e2: 5.0, c: 5.0}, b: {d: 30.0}, c: {e2: 30.0}, d: {d: 30.0}}
    model = markov_model(tiny_model, tmp_path / "markov", table, [e1, e2])
    engine = Engine(EngineConfig(model=str(model), device="cpu", block_size=4))
    [out] = engine.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=5))
    beams, scores = hf_beam_search(model, [5, 6], 2, 5, 1.0, False)
    assert [b.token_ids for b in out.beams] == beams == [[e1], [a, e2]]  # not [a, c, e2], which scores better
    assert [b.score for b in out.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)


def test_an_eos_ranked_just_below_the_width_best_candidates_finishes_nothing(tiny_model, tmp_path):
    """Only an eos token among the best ``width`` candidates finishes a hypothesis (HF's top_num_beam_mask): after
    one that does (ranked 1 of width 2), the next eos, ranked 2, is passed over on the way to the second ordinary
    token, though as a hypothesis it would have scored second best of all here."""
    e0, e1, a, b = 200, 201, 20, 21
    spread = {token: -0.05 * i for i, token in enumerate(range(30, 130))}  # ~ -3 a token: a poor path
    table = {6: {a: 10.0, e0: 9.5, e1: 9.0, b: 8.5}, None: spread}
    model = markov_model(tiny_model, tmp_path / "markov", table, [e0, e1])
    engine = Engine(EngineConfig(model=str(model), device="cpu", block_size=4))
    [out] = engine.beam_search([[5, 6]], BeamSearchParams(beam_width=2, max_tokens=3))
    beams, scores = hf_beam_search(model, [5, 6], 2, 3, 1.0, False)
    assert [b.token_ids for b in out.beams] == beams
    assert [b.score for b in out.beams] == pytest.approx(scores, rel=1e-6, abs=1e-5)
    assert beams[0] == [e0] and [e1] not in beams
