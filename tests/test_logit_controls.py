"""Logit controls (repetition, frequency and presence penalties; min_tokens) against references: HF transformers'
own processors where it has them (repetition_penalty, min_new_tokens), else OpenAI's formula applied in a greedy
loop over the HF model. Also: under async scheduling, beside speculative decoding, and with n > 1."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import FinishReason, SamplingParams

PROMPT = [5, 17, 42, 99, 3, 250, 5, 17, 42, 7]
TOKENS = 24


@pytest.fixture(scope="module")
def path(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def hf(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))


def tokens(engine: Engine, **params: object) -> list[int]:
    return engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, **params))[0] \
        .outputs[0].token_ids


@pytest.mark.parametrize("penalty", [1.5, 0.7])
def test_repetition_penalty_equals_hf(engine: Engine, hf: torch.nn.Module, penalty: float) -> None:
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False, repetition_penalty=penalty)
    assert tokens(engine, repetition_penalty=penalty) == ids[0, len(PROMPT):].tolist()
    assert tokens(engine, repetition_penalty=penalty) != tokens(engine)  # the penalty changed the output here


def test_min_tokens_equals_hf_min_new_tokens(engine: Engine, hf: torch.nn.Module) -> None:
    """A stop token id that greedy decoding reaches at its 3rd token cannot be sampled before min_tokens; after,
    it stops the sequence, as HF's min_new_tokens treats an EOS id."""
    stop = tokens(engine)[2]
    out = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, stop_token_ids=[stop],
                                                   min_tokens=10))[0].outputs[0]
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=10,
                      eos_token_id=[stop, *engine.eos_token_ids], pad_token_id=0)[0, len(PROMPT):].tolist()
    assert out.token_ids == ids[: len(out.token_ids)] and stop not in out.token_ids[:10]
    assert out.finish_reason is FinishReason.STOP and out.token_ids[-1] == stop


def openai_penalized_greedy(hf: torch.nn.Module, frequency: float, presence: float, repetition: float) -> list[int]:
    """Greedy decoding with vLLM's order of controls: repetition (over prompt and output), then
    ``logit -= frequency * count + presence * (count > 0)`` over the output's counts."""
    ids = list(PROMPT)
    for _ in range(TOKENS):
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].float()
        seen = torch.tensor(sorted(set(ids)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / repetition, logits[seen] * repetition)
        counts = torch.bincount(torch.tensor(ids[len(PROMPT):], dtype=torch.long), minlength=logits.numel())
        logits -= frequency * counts + presence * (counts > 0).float()
        ids.append(int(logits.argmax()))
    return ids[len(PROMPT):]


@pytest.mark.parametrize("frequency,presence,repetition", [(1.5, 0.0, 1.0), (0.0, 2.0, 1.0), (-1.0, 0.5, 1.3)])
def test_frequency_and_presence_penalties_follow_the_formula(engine: Engine, hf: torch.nn.Module, frequency: float,
                                                             presence: float, repetition: float) -> None:
    expected = openai_penalized_greedy(hf, frequency, presence, repetition)
    actual = tokens(engine, frequency_penalty=frequency, presence_penalty=presence, repetition_penalty=repetition)
    assert actual == expected
    assert actual != tokens(engine)


def test_controls_under_async_scheduling_and_beside_speculation() -> None:
    """A penalized request reads every token so far: async scheduling runs its steps settled, and speculative
    decoding leaves it alone (no drafts); plain requests beside it keep their outputs. The shipped pair, so that
    the draft model proposes (an n-gram lookup finds little to propose once repeats are penalized)."""
    from infer.models.tiny import PRETRAINED_DIR

    path = PRETRAINED_DIR / "target"
    prompts = ["def fibonacci(n):\n", "import os\nimport sys\n", "class Config:\n", "    for i in range("]
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5),
              SamplingParams(max_tokens=TOKENS, temperature=0.0),
              SamplingParams(max_tokens=TOKENS, temperature=0.8, seed=3, presence_penalty=1.0, min_tokens=TOKENS),
              SamplingParams(max_tokens=TOKENS, temperature=0.0, min_tokens=4)]  # speculates once 4 tokens are out
    configs = {"sync": {}, "async": {"async_scheduling": True},
               "draft": {"proposer": "draft-model", "num_speculative_tokens": 3}}
    results = {name: Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, **options))
               .generate(prompts, params) for name, options in configs.items()}
    expected = [r.outputs[0].token_ids for r in results["sync"]]
    for name in ("async", "draft"):
        assert [r.outputs[0].token_ids for r in results[name]] == expected, name
    alone = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    for i in (0, 3):  # a penalized and a min_tokens row shared their steps' controls with each other
        assert alone.generate([prompts[i]], params[i])[0].outputs[0].token_ids == expected[i]
    speculated = [r.metrics["spec_proposed"] for r in results["draft"]]
    assert speculated[0] == speculated[2] == 0 and speculated[1] > 0 and speculated[3] > 0


def test_a_min_tokens_request_speculates_from_the_step_after_its_min_tokens_are_out() -> None:
    """Before min_tokens tokens are out each step adds one token and verifies no drafts; the step that starts with
    exactly min_tokens out is free of the control, so it verifies drafts (the shipped pair always proposes)."""
    from infer.models.tiny import PRETRAINED_DIR

    engine = Engine(EngineConfig(model=str(PRETRAINED_DIR / "target"), device="cpu", num_kv_blocks=64,
                                 proposer="draft-model", num_speculative_tokens=3))
    for min_tokens in (1, 3):
        rid = engine.add_request("def fibonacci(n):\n", SamplingParams(max_tokens=TOKENS, temperature=0.0,
                                                                         min_tokens=min_tokens))
        seq = engine.requests[rid].seqs[0]
        steps = []
        while seq.num_output_tokens <= min_tokens:
            engine.step()
            steps.append((seq.num_output_tokens, seq.spec_proposed))
        assert steps[:min_tokens] == [(k, 0) for k in range(1, min_tokens + 1)]
        assert len(steps) == min_tokens + 1 and steps[-1][1] > 0, steps
        while engine.has_unfinished():
            engine.step()


def test_many_controlled_requests_at_once_equal_each_alone(engine: Engine) -> None:
    """Eight penalized requests fill the controls' first table rows; four more arrive 4 steps later, so the table
    grows while the first rows hold counts; later requests reuse released rows. Each output equals the request's
    own run alone."""
    prompts = [[(7 * i + j) % 900 + 3 for j in range(5 + i)] for i in range(12)]
    params = SamplingParams(max_tokens=16, temperature=0.0, repetition_penalty=1.3, frequency_penalty=1.5,
                            min_tokens=2)
    ids = engine.add_requests(prompts[:8], params)
    tokens: dict[str, list[int]] = {}
    for step in range(4):
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    ids += engine.add_requests(prompts[8:], params)
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    together = [tokens[i] for i in ids]
    assert together == [engine.generate([p], params)[0].outputs[0].token_ids for p in prompts]
    assert not engine.runner.controls.slots and len(engine.runner.controls.free) == 16  # every row released


def test_rows_with_different_penalties_in_one_batch_each_equal_their_run_alone(engine: Engine) -> None:
    """One batch, each row with one kind of penalty only: every row gets its own, none is dropped for another's."""
    kinds = [dict(), dict(repetition_penalty=1.5), dict(frequency_penalty=1.5), dict(presence_penalty=1.5),
             dict(logit_bias={300: 4.0})]  # an uncontrolled row first: the controlled rows are not batch rows 0..
    alone = [tokens(engine, **kind) for kind in kinds]
    assert all(own != alone[0] for own in alone[1:])  # each control changes this output
    batch = engine.generate([PROMPT] * len(kinds), [SamplingParams(max_tokens=TOKENS, temperature=0.0, **kind)
                                           for kind in kinds])
    assert [out.outputs[0].token_ids for out in batch] == alone


def test_logit_bias_equals_hf_sequence_bias(engine: Engine, hf: torch.nn.Module) -> None:
    """OpenAI's logit_bias against HF's SequenceBiasLogitsProcessor with one-token sequences: greedy's first token
    banned, another favoured."""
    first = tokens(engine)[0]
    bias = {first: -100.0, 300: 2.5, 42: -2.0}  # 300 favoured, not forced: the bias's size matters
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False,
                      sequence_bias={(token,): value for token, value in bias.items()})[0, len(PROMPT):].tolist()
    assert tokens(engine, logit_bias=bias) == ids and first not in ids and 300 in ids and set(ids) != {300}


def test_logit_bias_pairs_are_checked_and_compare_as_sets() -> None:
    from infer.core.errors import InvalidRequestError

    for bias, message in (([(5, 1.0), (5, 2.0)], "names token 5 twice"), ({-1: 1.0}, "got -1"),
                          ([(5, 1.0, 2.0)], "got the entry (5, 1.0, 2.0)"), ({5: True}, "got True for token 5")):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            SamplingParams(logit_bias=bias).validate()  # type: ignore[arg-type]
    assert SamplingParams(logit_bias={9: 1.0, 4: -2.0}) == SamplingParams(logit_bias={4: -2.0, 9: 1.0})


def test_a_biased_request_does_not_speculate_and_keeps_its_bias() -> None:
    from infer.models.tiny import PRETRAINED_DIR

    path, prompt = PRETRAINED_DIR / "target", "def fibonacci(n):\n"
    plain = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    base = plain.generate([prompt], SamplingParams(max_tokens=TOKENS, temperature=0.0))[0].outputs[0].token_ids
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, logit_bias={base[2]: -3.0, base[5]: -5.0})
    expected = plain.generate([prompt], params)[0].outputs[0].token_ids
    assert expected != base
    drafted = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, proposer="draft-model",
                                  num_speculative_tokens=3)).generate([prompt], params)[0]
    assert drafted.outputs[0].token_ids == expected and drafted.metrics["spec_proposed"] == 0


def test_logit_bias_comes_before_the_repetition_penalty_as_in_hf(engine: Engine, hf: torch.nn.Module) -> None:
    """Biased prompt tokens under a repetition penalty: (logit + bias) / r, HF's processor order (and vLLM's)."""
    bias = {PROMPT[0]: 3.0, PROMPT[1]: -3.0, PROMPT[3]: 2.0}
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False, repetition_penalty=1.3,
                      sequence_bias={(token,): value for token, value in bias.items()})[0, len(PROMPT):].tolist()
    assert tokens(engine, logit_bias=bias, repetition_penalty=1.3) == ids


def test_logit_bias_from_the_command_line(path: Path) -> None:
    from click.testing import CliRunner

    from infer.cli import main

    args = ["--model", str(path), "--device", "cpu", "generate", "hello", "--max-tokens", "4", "--json"]
    forced = CliRunner().invoke(main, [*args, "--logit-bias", "5=100"])
    assert forced.exit_code == 0, forced.output
    assert json.loads(forced.stdout.splitlines()[-1])["token_ids"] == [5] * 4
    for values, message in ((["5"], "is not TOKEN=BIAS"), (["5=101"], "values must be numbers in [-100, 100], got "
                             "101.0 for token 5"), (["5=1", "5=2"], "token 5 is given twice"),
                            (["2000=1"], "logit_bias's token ids must be below the model's vocabulary size")):
        refused = CliRunner().invoke(main, [*args, *(arg for v in values for arg in ("--logit-bias", v))])
        assert refused.exit_code == 2 and message in " ".join(refused.output.split()), refused.output


@pytest.mark.parametrize("min_tokens", [1, 2])
@pytest.mark.parametrize("penalty", [1.0, 1.5])
@pytest.mark.parametrize("stop_at", [-1, 0])
def test_min_tokens_ends_exactly_where_hf_lets_a_stop_token_through(engine: Engine, hf: torch.nn.Module,
                                                                    min_tokens: int, penalty: float,
                                                                    stop_at: int) -> None:
    """The stop token is the one HF's own greedy run (with the same penalty) emits at index ``min_tokens`` (or
    the index before, the last one it is masked at): masked before ``min_tokens`` and allowed from it, alone or
    beside a penalty, as HF's min_new_tokens does."""
    free = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False,
                       repetition_penalty=penalty)[0, len(PROMPT):].tolist()
    stop = free[min_tokens + stop_at]
    out = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, stop_token_ids=[stop],
                                                   min_tokens=min_tokens, repetition_penalty=penalty))[0].outputs[0]
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=min_tokens,
                      repetition_penalty=penalty, eos_token_id=[stop, *engine.eos_token_ids],
                      pad_token_id=0)[0, len(PROMPT):].tolist()
    assert out.token_ids == ids and stop not in out.token_ids[:min_tokens]
    assert (out.token_ids[-1] == stop) == (out.finish_reason is FinishReason.STOP)  # else it ran to max_tokens
    if stop_at == 0 and stop not in free[:min_tokens]:  # nothing earlier stops it: it ends at index min_tokens
        assert len(out.token_ids) == min_tokens + 1


def test_min_tokens_masks_the_models_eos_unless_eos_is_ignored(path: Path, tmp_path: Path) -> None:
    """A checkpoint whose EOS is the token greedy decoding emits third: min_tokens holds it back (as HF's
    min_new_tokens does); with ignore_eos, EOS is an ordinary token and min_tokens masks nothing."""
    import json
    import shutil

    from transformers import AutoModelForCausalLM

    plain = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))
    eos = plain.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0] \
        .outputs[0].token_ids[2]
    copy = tmp_path / "eos"
    shutil.copytree(path, copy)
    for name in ("config.json", "generation_config.json"):
        if (copy / name).exists():
            fields = json.loads((copy / name).read_text())
            fields["eos_token_id"] = eos
            (copy / name).write_text(json.dumps(fields))
    engine = Engine(EngineConfig(model=str(copy), device="cpu", num_kv_blocks=64))
    assert engine.eos_token_ids == {eos}
    held = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, min_tokens=10))[0].outputs[0]
    hf = AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    ids = hf.generate(torch.tensor([PROMPT]), max_new_tokens=TOKENS, do_sample=False, min_new_tokens=10,
                      eos_token_id=eos, pad_token_id=0)[0, len(PROMPT):].tolist()
    assert held.token_ids == ids[: len(held.token_ids)] and eos not in held.token_ids[:10]
    ignored = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, min_tokens=10,
                                                       ignore_eos=True))[0].outputs[0]
    assert ignored.token_ids[2] == eos and ignored.token_ids == plain.generate(
        [PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True))[0].outputs[0].token_ids


def test_every_sequence_of_an_n_request_applies_its_own_penalties(engine: Engine) -> None:
    params = SamplingParams(max_tokens=TOKENS, temperature=0.0, repetition_penalty=1.5, n=3)
    outputs = engine.generate([PROMPT], params)[0].outputs
    assert [o.token_ids for o in outputs] == [tokens(engine, repetition_penalty=1.5)] * 3


def test_logprobs_stay_those_of_the_raw_distribution(engine: Engine) -> None:
    """min_tokens masks the greedy token (a stop token id here), so another is sampled; the logprobs returned
    still rank the masked one with its raw value."""
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, logprobs=3))[0].outputs[0]
    first = plain.token_ids[0]
    masked = engine.generate([PROMPT], SamplingParams(max_tokens=2, temperature=0.0, logprobs=3, min_tokens=2,
                                                      stop_token_ids=[first]))[0].outputs[0]
    assert masked.token_ids[0] != first
    assert masked.logprobs[0] == pytest.approx(plain.logprobs[0])


def test_a_min_tokens_row_beside_an_uncontrolled_row_is_masked_and_keeps_raw_logprobs(engine: Engine,
                                                                                    hf: torch.nn.Module) -> None:
    """A plain request, then one whose min_tokens masks the greedy token, in one batch: the second row (not the
    batch's first) is masked, and its logprobs are HF's log-softmax of the raw logits (the controls work on a copy)."""
    first = tokens(engine)[0]
    masked_params = SamplingParams(max_tokens=2, temperature=0.0, logprobs=3, min_tokens=2, stop_token_ids=[first])
    outs = engine.generate([PROMPT, PROMPT], [SamplingParams(max_tokens=2, temperature=0.0), masked_params])
    masked = outs[1].outputs[0]
    assert outs[0].outputs[0].token_ids[0] == first and masked.token_ids[0] != first
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0, -1].float().log_softmax(-1)
    assert set(masked.logprobs[0]) == {*ref.topk(3).indices.tolist(), masked.token_ids[0]}
    for token, value in masked.logprobs[0].items():
        assert value == pytest.approx(ref[token].item(), abs=1e-4)


def test_min_tokens_bans_what_the_logits_have_of_eos_ids_beyond_them() -> None:
    """A checkpoint may name an EOS id past its vocabulary (the engine keeps generation_config's ids as they are):
    before min_tokens the stop and EOS ids inside the logits are -inf, and nothing else changes."""
    from infer.core.logit_controls import LogitControls
    from infer.core.request import Sequence

    vocab = 16
    seq = Sequence(0, "a", [1, 2, 3], SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[5]), 0.0,
                   eos_token_ids=frozenset({7, vocab + 100}))
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(0))
    out = LogitControls(torch.device("cpu")).apply(logits, [seq])
    expected = logits.clone()
    expected[0, [5, 7]] = float("-inf")
    assert out is not None and torch.equal(out, expected)


@pytest.mark.gpu
def test_controls_on_cuda_equal_the_cpu(path: Path) -> None:
    """The CUDA defaults (triton attention, CUDA graphs, async scheduling) in float32 give the CPU's tokens, for
    penalized, min_tokens and plain requests in one batch."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    prompts = [PROMPT, PROMPT[:4], [9, 8, 7, 6, 5, 4, 3, 2]]
    params = [SamplingParams(max_tokens=TOKENS, temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.5),
              SamplingParams(max_tokens=TOKENS, temperature=0.0),
              SamplingParams(max_tokens=TOKENS, temperature=0.0, presence_penalty=1.0, min_tokens=TOKENS)]
    outputs = {device: [r.outputs[0].token_ids for r in Engine(EngineConfig(
        model=str(path), device=device, dtype="float32", num_kv_blocks=64)).generate(prompts, params)]
        for device in ("cpu", "cuda")}
    assert outputs["cuda"] == outputs["cpu"]


def test_integer_biases_equal_float_ones(engine: Engine) -> None:
    """OpenAI's logit_bias is often written with integers ({id: 100}); they bias as the same floats do."""
    forced = tokens(engine)[0] + 1
    assert tokens(engine, logit_bias={forced: 100, 7: -100}) == tokens(engine, logit_bias={forced: 100.0, 7: -100.0})
    assert tokens(engine, logit_bias={forced: 100})[0] == forced


@pytest.mark.parametrize("min_tokens", [1, 3])
def test_a_stop_string_that_starts_inside_the_min_tokens_text_and_ends_after_it_stops(engine: Engine,
                                                                                      min_tokens: int) -> None:
    """The stop string is the last character of the first min_tokens tokens' text and the first of the next
    token's: it ends past them, so it counts. The reference reads every occurrence in each greedy prefix's text and
    takes the first that ends past that text."""
    free = tokens(engine)
    texts = [engine.tokenizer.decode(free[:k]) for k in range(len(free) + 1)]
    floor = len(texts[min_tokens])
    assert floor and len(texts[min_tokens + 1]) > floor, "choose a prompt whose early tokens have text"
    stop = texts[min_tokens + 1][floor - 1: floor + 1]

    def first_counted(text: str) -> int | None:  # where the first occurrence ending past `floor` starts
        starts = [j for j in range(len(text) - len(stop) + 1) if text.startswith(stop, j) and j + len(stop) > floor]
        return starts[0] if starts else None

    k = next(k for k in range(1, len(free) + 1) if first_counted(texts[k]) is not None)
    out = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, stop=[stop],
                                                   min_tokens=min_tokens))[0].outputs[0]
    assert out.token_ids == free[:k] and out.finish_reason is FinishReason.STOP
    assert out.text == texts[k][: first_counted(texts[k])]


@pytest.mark.parametrize("min_tokens", [0, 2, 5])
def test_a_stop_string_ends_the_output_only_after_min_tokens(engine: Engine, min_tokens: int) -> None:
    """As in vLLM (its detokenizer checks stop strings once more than min_tokens tokens are out): a stop string
    that ends in the text of the first min_tokens tokens does not stop the output. The reference: the greedy
    tokens (stop strings never change them) decoded prefix by prefix with the tokenizer."""
    free = tokens(engine)
    texts = [engine.tokenizer.decode(free[:k]) for k in range(len(free) + 1)]
    stop = texts[2][-2:] if len(texts[2]) >= 2 else texts[2]  # the end of the first two tokens' text
    assert stop, "the first two greedy tokens have no text"
    floor = len(texts[min_tokens])
    ends = [k for k in range(1, len(free) + 1)
            if (j := texts[k].find(stop, max(0, floor - len(stop) + 1))) != -1 and j + len(stop) <= len(texts[k])]
    assert ends, f"the stop string {stop!r} does not come back after token {min_tokens}: choose another"
    k = ends[0]
    out = engine.generate([PROMPT], SamplingParams(max_tokens=TOKENS, temperature=0.0, stop=[stop],
                                                   min_tokens=min_tokens))[0].outputs[0]
    assert out.token_ids == free[:k] and out.finish_reason is FinishReason.STOP
    assert out.text == texts[k][: texts[k].find(stop, max(0, floor - len(stop) + 1))]
