"""Speculative decoding is exact: the rejection sampler and the engine draw from the target's distribution, and
random aborts during speculation leak no KV block, in the target's cache or the draft's."""
from __future__ import annotations

import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.hookspecs import hookimpl
from infer.core.request import SamplingParams, SequenceStatus
from infer.spec_decode.rejection import expected_tokens_per_round, greedy_accept, rejection_sample

SYMBOLS = ["<|pad|>", "<|bos|>", "<|eos|>", "a", "b", "c", "d", "e"]  # a small vocabulary: 8 ids


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's test of counts against probs; cells expected below ``min_expected`` are pooled into one."""
    expected = probs.double() * counts.sum()
    small = expected < min_expected
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().view(1)])
    exp = torch.cat([expected[~small], expected[small].sum().view(1)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()
    df = int(keep.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.double), stat / 2))  # P(chi2_df > stat)


def make_small_vocab_model(out: Path, hidden: int, layers: int, seed: int, symbols: list[str] = SYMBOLS,
                           merges: list[tuple[str, str]] | None = None) -> Path:
    """A random Llama over ``symbols`` with a word-level tokenizer, or with ``merges`` a byte-level BPE one (its
    symbols after the three special ones printable ASCII, the merges' results among them); large init so that
    distributions are far from flat."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    ids = {s: i for i, s in enumerate(symbols)}
    if merges is None:
        tok = Tokenizer(models.WordLevel(ids, unk_token="<|pad|>"))
        tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    else:
        tok = Tokenizer(models.BPE(ids, merges))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(symbols[:3])
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|pad|>", bos_token="<|bos|>", eos_token="<|eos|>",
                            clean_up_tokenization_spaces=False).save_pretrained(str(out))
    config = LlamaConfig(vocab_size=len(symbols), hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=2 * hidden, max_position_embeddings=256,
                         initializer_range=0.4, eos_token_id=2, bos_token_id=1, pad_token_id=0)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(str(out))
    return out



def masked_law(model: Path, prompt: list[int], mask_of: Callable[[list[int]], torch.Tensor], top_k: int = 0
               ) -> Callable[[list[list[int]]], torch.Tensor]:
    """The law of the next token after each context (the output so far) by HF transformers at temperature 0.9,
    masked by ``mask_of(context)`` (then top-k among what it allows), as [contexts, V]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32).eval()

    def law(contexts: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + c for c in contexts])).logits[:, -1] / 0.9
        masks = torch.stack([mask_of(c) for c in contexts])
        logits = logits.masked_fill(~masks, float("-inf"))
        if top_k:
            logits = logits.masked_fill(logits < logits.topk(top_k, dim=-1).values[:, -1:], float("-inf"))
        return torch.softmax(logits, -1)

    return law


def assert_first_three_follow(outputs: list[list[int]], law: Callable[[list[list[int]]], torch.Tensor], vocab: int,
                              n: int) -> None:
    """Chi-square tests: the first two tokens of ``outputs`` jointly, and the third (of those not ended by EOS, id
    2, before it), follow ``law``; more than n / 4 outputs reach a third token."""
    p1 = law([[]])[0]
    p2 = law([[a] for a in range(vocab)]) * p1[:, None]  # [t1, t2]; rows of disallowed t1 are 0 through p1
    p2 = torch.nan_to_num(p2)
    counts12 = torch.bincount(torch.tensor([t[0] * vocab + (t[1] if len(t) > 1 else 2) for t in outputs]),
                              minlength=vocab * vocab)
    joint12 = p2.clone()
    joint12[2] = 0
    joint12[2, 2] = p1[2]  # EOS first: the output ends there (counted as EOS twice)
    assert chi_square_p(counts12, joint12.flatten()) > 0.01
    p3 = torch.nan_to_num(law([[a, b] for a in range(vocab) for b in range(vocab)]).view(vocab, vocab, vocab))
    live = p2.clone()
    live[2], live[:, 2] = 0, 0
    third = torch.bincount(torch.tensor([t[2] for t in outputs if len(t) >= 3 and 2 not in t[:2]]), minlength=vocab)
    assert chi_square_p(third, (live[..., None] * p3).sum((0, 1)) / live.sum()) > 0.01
    assert int(third.sum()) > n // 4  # enough outputs reach a third token for the test above to mean something


@pytest.fixture(scope="module")
def small_pair(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("small-vocab")
    return (make_small_vocab_model(root / "target", 32, 2, seed=0),
            make_small_vocab_model(root / "draft", 16, 1, seed=1))


# ---------------------------------------------------------------- the rejection sampler alone
@pytest.mark.parametrize("point_mass", [False, True], ids=["draft-probs", "point-mass"])
def test_rejection_sampler_emits_target_samples(point_mass):
    gen = torch.Generator().manual_seed(0)
    rows, k, vocab = 50_000, 3, 6
    p_row = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    q_row = torch.softmax(1.5 * torch.randn(vocab, generator=gen), -1)
    draft = torch.multinomial(q_row, rows * k, replacement=True, generator=gen).view(rows, k)
    q = torch.nn.functional.one_hot(draft, vocab).float() if point_mass else q_row.expand(rows, k, vocab)
    out = rejection_sample(p_row.expand(rows, k + 1, vocab), q, draft, torch.full((rows,), k),
                           torch.rand(rows, k, generator=gen), torch.empty(rows, vocab).exponential_(generator=gen))
    m, nxt = out.num_accepted, out.next_token
    for j in range(k + 1):  # the token at position j, given j accepted drafts before it; j == k: the bonus token
        token = torch.where(m > j, draft[:, j % k], nxt)[m >= j]
        assert chi_square_p(torch.bincount(token, minlength=vocab), p_row) > 0.01, f"position {j}"
    if not point_mass:  # i.i.d. acceptance a = sum min(p, q): E[tokens per round] = (1 - a^(k+1)) / (1 - a)
        a = torch.minimum(p_row, q_row).sum().item()
        assert (m + 1).double().mean().item() == pytest.approx(expected_tokens_per_round(a, k), abs=0.02)


def test_rejection_sampler_respects_draft_counts_and_greedy_rule():
    target = [[4, 5, 6, 7], [4, 9, 6, 7], [1, 2]]  # the target's argmax before each draft, then after the last
    drafts = [[4, 5, 6], [4, 5, 6], [1]]
    out = [greedy_accept(d, t) for d, t in zip(drafts, target)]
    assert out == [(3, 7), (1, 9), (1, 2)]  # bonus, correction, bonus after a short row
    # a draft the target gives no mass is always rejected and never re-emitted
    p = torch.tensor([[[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    q = torch.tensor([[[1.0, 0.0, 0.0]]])
    out = rejection_sample(p, q, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([[0.0]]), torch.ones(1, 3))
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [1]


def scan_lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The ngram contract by brute force: the latest earlier match of the longest suffix of min_n..max_n tokens
    whose continuation has k tokens, else the longest continuation among that suffix's matches."""
    length = len(tokens)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        follows = [tokens[s + n : s + n + k] for s in range(length - n - 1, -1, -1)
                   if tokens[s : s + n] == tokens[length - n :]]
        full = [f for f in follows if len(f) == k]
        if full or follows:
            return full[0] if full else max(follows, key=len)
    return []


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60), sizes=st.sampled_from([(1, 3), (2, 4), (3, 3)]),
       k=st.integers(1, 5))
def test_ngram_index_finds_what_a_full_scan_finds(tokens, sizes, k):
    """The proposer indexes each sequence as it grows (a lookup used to scan the whole context: 330 us per
    sequence and step at 4k tokens); every lookup along the way must equal the scan's."""
    from infer.spec_decode.ngram import NgramProposer

    min_n, max_n = sizes
    ngram, grown = NgramProposer(min_n, max_n), []
    for token in tokens:
        grown.append(token)
        assert ngram.lookup(grown, k, key=7) == scan_lookup(grown, k, min_n, max_n)
    cut = grown[: len(grown) // 2]  # a shorter list under the same key: indexed afresh, not misread
    assert ngram.lookup(cut, k, key=7) == scan_lookup(cut, k, min_n, max_n)


def test_ngram_lookup_and_degradation_policy():
    from infer.spec_decode.ngram import NgramProposer
    from infer.spec_decode.policy import OFF_ACCEPTANCE, OFF_BATCH, ON, SpecPolicy

    ngram = NgramProposer(min_n=1, max_n=3)
    assert ngram.lookup([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest match of the longest suffix
    assert ngram.lookup([5, 5, 5], 4) == [5]  # no match has 4 followers: the longest continuation
    assert ngram.lookup([1, 2, 3], 2) == []
    policy = SpecPolicy(min_acceptance=0.5, max_batch_size=4, probe_every=3, warmup_rounds=2)
    assert policy.decide(5) == OFF_BATCH and policy.decide(4) == ON
    policy.observe(proposed=10, accepted=1, rounds=2)
    assert [policy.decide(1) for _ in range(6)] == [OFF_ACCEPTANCE, OFF_ACCEPTANCE, ON] * 2  # probes keep measuring
    for _ in range(10):
        policy.observe(proposed=10, accepted=9, rounds=2)
    assert policy.decide(1) == ON


# ---------------------------------------------------------------- through the engine
def test_engine_sampling_with_speculation_draws_the_target_distribution(small_pair):
    """Joint law of the first two sampled tokens and the law of the third (the first and second come from a
    verification round with K=2), against the target's exact distributions computed by HF transformers."""
    from transformers import AutoModelForCausalLM

    target, draft = small_pair
    prompt, vocab, n = [3, 4, 5, 6], len(SYMBOLS), 20_000
    engine = Engine(EngineConfig(model=str(target), device="cpu", proposer="draft-model", draft_model=str(draft),
                                 num_speculative_tokens=2, max_num_seqs=50, num_kv_blocks=2100, seed=1,
                                 enable_prefix_caching=False))
    params = SamplingParams(max_tokens=4, temperature=0.9, ignore_eos=True, n=50)
    outs = engine.generate([prompt] * (n // 50), params)
    tokens = torch.tensor([c.token_ids[:3] for o in outs for c in o.outputs])
    assert engine.stats.spec_rounds > 0 and 0.05 < engine.stats.acceptance_rate < 0.95

    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(hf(torch.tensor([prompt])).logits[0, -1] / 0.9, -1)
        ctx = torch.tensor([prompt + [a] for a in range(vocab)])
        p2 = torch.softmax(hf(ctx).logits[:, -1] / 0.9, -1)  # [t1, t2]
        ctx = torch.tensor([prompt + [a, b] for a in range(vocab) for b in range(vocab)])
        p3 = torch.softmax(hf(ctx).logits[:, -1] / 0.9, -1).view(vocab, vocab, vocab)
    joint12 = p1[:, None] * p2
    counts12 = torch.bincount(tokens[:, 0] * vocab + tokens[:, 1], minlength=vocab * vocab)
    assert chi_square_p(counts12, joint12.flatten()) > 0.01
    law3 = (joint12[..., None] * p3).sum((0, 1))
    assert chi_square_p(torch.bincount(tokens[:, 2], minlength=vocab), law3) > 0.01


class NoRepeat:
    """A structured-output backend for SYMBOLS: never the token just sampled (nor pad or bos); EOS always. Its
    matchers copy, so its requests speculate."""

    def __init__(self) -> None:
        from infer.core.interfaces import Grammar, GrammarMatcher, StructuredOutputBackend

        class Matcher(GrammarMatcher):
            def __init__(self, last: int | None = None) -> None:
                self.last = last

            def allowed(self) -> torch.Tensor:
                return no_repeat_mask(self.last)

            def advance(self, token_id: int) -> None:
                if not no_repeat_mask(self.last)[token_id]:
                    raise ValueError(f"token {token_id} is not allowed after {self.last}")
                self.last = token_id

            def copy(self) -> GrammarMatcher:
                return Matcher(self.last)

        class Compiled(Grammar):
            def matcher(self) -> GrammarMatcher:
                return Matcher()

        class Backend(StructuredOutputBackend):
            def compile(self, spec: Any) -> Grammar:
                return Compiled()

        self.backend = Backend()

    @hookimpl
    def register_structured_output_backends(self, register: Any) -> None:
        register("no-repeat", lambda config, vocabulary: self.backend)


def no_repeat_mask(last: int | None) -> torch.Tensor:
    mask = torch.ones(len(SYMBOLS), dtype=torch.bool)
    mask[[0, 1]] = False
    if last is not None:
        mask[last] = False
    return mask


@pytest.mark.parametrize("proposer, guided, top_k", [("draft-model", True, 0), ("draft-model", True, 4),
                                                     ("draft-model", False, 0), ("ngram", True, 0)],
                         ids=["draft-model-guided", "draft-model-guided-top-k", "draft-model-unguided", "ngram"])
def test_structured_sampling_with_speculation_draws_the_masked_target_distribution(small_pair, proposer, guided,
                                                                                   top_k):
    """A structured request speculates: its drafts are verified at positions masked by copies of its matcher, so
    the first three tokens follow the target's distribution renormalized over what the grammar allows at each
    (the grammar first, then top-k among what it allows), computed by HF transformers, and greedy equals the
    plain step's. Guided, the draft model draws its drafts
    under the grammar too (q masked and renormalized); unguided (and ngram, which cannot be guided), drafts the
    grammar refuses are cut and rejected."""
    from infer.core.plugins import PluginManager
    from infer.core.request import StructuredOutput

    target, draft = small_pair
    plugins = PluginManager.from_entry_points()
    plugins.register(NoRepeat(), name="no-repeat")
    prompt, vocab, n = [3, 4, 5, 6], len(SYMBOLS), 10_000
    spec = StructuredOutput(regex="any")
    engine = Engine(EngineConfig(model=str(target), device="cpu", proposer=proposer,
                                 draft_model=str(draft) if proposer == "draft-model" else None,
                                 num_speculative_tokens=3, max_num_seqs=50, num_kv_blocks=1100, seed=1,
                                 enable_prefix_caching=False, structured_output_backend="no-repeat",
                                 plugin_options={"spec_decode": {"structured": True, "guided": guided}}), plugins)
    params = SamplingParams(max_tokens=5, temperature=0.9, top_k=top_k, n=50, structured_output=spec)
    outs = engine.generate([prompt] * (n // 50), params)  # tokens 2-4: one round of 3 drafts (and the bonus)
    assert (engine.stats.spec_grammar_refused == 0) == (proposer == "draft-model" and guided)
    rows = [c.token_ids for o in outs for c in o.outputs if len(c.token_ids) >= 3 and 2 not in c.token_ids[:2]]
    assert engine.stats.spec_rounds > 0 and 0.05 < engine.stats.acceptance_rate < 0.95
    assert engine.stats.spec_judged > engine.stats.spec_rounds  # rounds verified more than one draft
    assert all(a != b for row in rows for a, b in zip(row, row[1:]))

    outputs = [c.token_ids for o in outs for c in o.outputs]
    assert_first_three_follow(outputs, masked_law(target, prompt, lambda c: no_repeat_mask(c[-1] if c else None),
                                                  top_k), vocab, n)
    greedy = SamplingParams(max_tokens=12, temperature=0, structured_output=spec)
    plain = Engine(EngineConfig(model=str(target), device="cpu", num_kv_blocks=64,
                                structured_output_backend="no-repeat"), plugins)
    assert engine.generate([prompt], greedy)[0].outputs[0].token_ids == \
        plain.generate([prompt], greedy)[0].outputs[0].token_ids


def test_a_bad_mask_first_read_when_verifying_drafts_is_a_plugin_error(small_pair) -> None:
    """The matcher state after a draft is first asked for its mask by the verification (ngram drafts unguided):
    a mask that is not bool [V] there is the same PluginError naming the backend as on the plain path."""
    from infer.core.errors import PluginError
    from infer.core.interfaces import Grammar, GrammarMatcher, StructuredOutputBackend
    from infer.core.plugins import PluginManager
    from infer.core.request import StructuredOutput

    class Matcher(GrammarMatcher):  # first token forced to 'b' (id 4), after it a mask one token short
        def __init__(self, taken: int = 0) -> None:
            self.taken = taken

        def allowed(self) -> torch.Tensor:
            if self.taken:
                return torch.ones(len(SYMBOLS) - 1, dtype=torch.bool)
            return torch.arange(len(SYMBOLS)) == 4

        def advance(self, token_id: int) -> None:
            self.taken += 1

        def copy(self) -> GrammarMatcher:
            return Matcher(self.taken)

    class Backend(StructuredOutputBackend):
        def compile(self, spec: Any) -> Grammar:
            return type("Compiled", (Grammar,), {"matcher": lambda self: Matcher()})()

    class Plugin:
        @hookimpl
        def register_structured_output_backends(self, register: Any) -> None:
            register("short-after-one", lambda config, vocabulary: Backend())

    target, _ = small_pair
    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="short-after-one")
    engine = Engine(EngineConfig(model=str(target), device="cpu", proposer="ngram", num_speculative_tokens=2,
                                 num_kv_blocks=64, enable_prefix_caching=False,
                                 structured_output_backend="short-after-one",
                                 plugin_options={"spec_decode": {"structured": True}}), plugins)
    params = SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="any"))
    engine.add_request([3, 4, 5, 3, 4, 5, 3], params)  # after the forced 'b', 'a b' recurs: ngram drafts 'c a'
    engine.step()
    with pytest.raises(PluginError, match=r"'short-after-one'.*shape \(7,\), not bool \[8\]") as raised:
        engine.step()
    assert any(entry.name == "masks" for entry in raised.traceback)  # raised verifying the drafts, as meant


def test_jump_forward_drafts_keep_sampling_exact(tmp_path: Path) -> None:
    """The jump-forward proposer drafts the tokens of the text the grammar forces: under ``(dab|ce)+`` the token
    ``ab`` after ``d`` (which the target may refuse for ``a``, then ``b``) and ``e`` after ``c``. The first three
    tokens still follow the target's law under the grammar's masks (worked out here from the pattern, apart from
    the fsm backend), computed by HF transformers."""
    from infer.core.request import StructuredOutput

    symbols = ["<|pad|>", "<|bos|>", "<|eos|>", "a", "b", "ab", "c", "d", "e"]
    target = make_small_vocab_model(tmp_path, 32, 2, seed=0, symbols=symbols, merges=[("a", "b")])
    prompt, vocab, n = [7, 8, 6], len(symbols), 10_000  # "dec": the target likes d first, then a more than ab
    engine = Engine(EngineConfig(model=str(target), device="cpu", proposer="jump-forward", num_speculative_tokens=3,
                                 max_num_seqs=50, num_kv_blocks=1100, seed=1, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=5, temperature=0.9, n=50, structured_output=StructuredOutput(regex="(dab|ce)+"))
    outputs = [c.token_ids for o in engine.generate([prompt] * (n // 50), params) for c in o.outputs]
    assert 0.3 < engine.stats.acceptance_rate < 0.9  # ab drafted and refused, e drafted and taken
    assert sum(t[:2] == [7, 3] for t in outputs) > n // 10  # "d" then "a": the residual drawn after a rejection

    def mask_of(context: list[int]) -> torch.Tensor:
        text = "".join(symbols[t] for t in context)
        mask = torch.tensor([i > 2 and re.fullmatch("(dab|ce)*(d|da|c)?", text + symbols[i]) is not None
                             for i in range(vocab)])
        mask[2] = re.fullmatch("(dab|ce)+", text) is not None
        return mask

    assert_first_three_follow(outputs, masked_law(target, prompt, mask_of), vocab, n)


def test_a_draft_guide_stays_put_past_a_stop_token_or_a_refused_draft():
    """What walk_drafts cuts, the guide does not walk into: after EOS, or after a draft its grammar refuses (a
    proposer that drew outside the mask), its mask stays the last state's and nothing raises."""
    from infer.core.request import Sequence
    from infer.core.structured_output import DraftGuide

    seq = Sequence(0, "r", [3, 4], SamplingParams(max_tokens=10), 0.0, eos_token_ids=frozenset({2}))
    refused = DraftGuide(NoRepeat().backend.compile(None).matcher(), seq, lambda mask: mask)
    refused.advance(5)
    refused.advance(5)  # a repeat: refused
    refused.advance(6)
    assert refused.stopped and torch.equal(refused.allowed(), no_repeat_mask(5))
    stopped = DraftGuide(NoRepeat().backend.compile(None).matcher(), seq, lambda mask: mask)
    stopped.advance(7)
    stopped.advance(2)  # EOS
    stopped.advance(3)
    assert stopped.stopped and torch.equal(stopped.allowed(), no_repeat_mask(7))


# ---------------------------------------------------------------- KV bookkeeping under aborts
@pytest.fixture(scope="module")
def abort_engine(small_pair) -> Engine:
    target, draft = small_pair
    return Engine(EngineConfig(model=str(target), device="cpu", proposer="draft-model", draft_model=str(draft),
                               num_speculative_tokens=3, block_size=4, num_kv_blocks=28, max_num_seqs=6))


def check_tables(engine: Engine) -> None:
    """Every running sequence holds exactly the blocks of its computed tokens: rejected drafts were rolled back."""
    kv, draft = engine.kv, engine.spec.proposer
    for req in engine.requests.values():
        for seq in req.seqs:
            if seq.status is SequenceStatus.RUNNING:
                assert len(kv.block_table(seq)) == kv.num_blocks_needed(seq.num_computed_tokens)
    for shadow in draft.shadows.values():
        assert len(draft.kv.block_table(shadow.seq)) == draft.kv.num_blocks_needed(shadow.seq.num_computed_tokens)


ops = st.lists(st.one_of(
    st.tuples(st.just("add"), st.integers(1, 12), st.integers(2, 24), st.booleans(), st.booleans()),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 7)),
), min_size=3, max_size=25)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=ops, seed=st.integers(0, 1000))
def test_random_aborts_during_speculation_leak_no_blocks(abort_engine, ops, seed):
    engine = abort_engine
    added: list[str] = []
    for op in ops:
        if op[0] == "add":
            _, length, max_tokens, greedy, speculative = op
            prompt = [3 + (seed + i) % 5 for i in range(length)]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0 if greedy else 1.0, ignore_eos=True,
                                    speculative=speculative, seed=seed)
            added.append(engine.add_request(prompt, params))
        elif op[0] == "step":
            for _ in range(op[1]):
                engine.step()
                check_tables(engine)
        elif added:  # abort one, typically right after a verification step
            rid = added[op[1] % len(added)]
            if rid in engine.requests:
                engine.abort(rid)
                check_tables(engine)
    while engine.has_unfinished():
        engine.step()
        check_tables(engine)
    assert_drained(engine)


def assert_drained(engine: Engine) -> None:
    stats, draft_kv = engine.kv.stats(), engine.spec.proposer.kv.stats()
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.total_blocks
    assert draft_kv.used_blocks == 0 and draft_kv.free_blocks == draft_kv.total_blocks
    assert not engine.spec.proposer.shadows
    assert math.isfinite(engine.stats.acceptance_rate)


def test_aborts_right_after_verification_and_preemptions_release_both_caches(abort_engine):
    engine = abort_engine
    preemptions = engine.scheduler.num_preemptions
    ids = [engine.add_request([3 + i % 5] * 10, SamplingParams(max_tokens=24, temperature=float(i % 2),
                                                              ignore_eos=True)) for i in range(8)]
    for _ in range(3):
        engine.step()
        check_tables(engine)
    speculating = [rid for rid in ids if sum(s.spec_proposed for s in engine.requests[rid].seqs)]
    assert len(speculating) >= 2
    for rid in speculating[:2]:
        engine.abort(rid)
        check_tables(engine)
    while engine.has_unfinished():
        engine.step()
        check_tables(engine)
    assert engine.scheduler.num_preemptions > preemptions  # 6 x 9 blocks do not fit in 28
    assert_drained(engine)


def test_training_corpus_keeps_token_ids_above_int16(tmp_path):
    """train_pair stored ids as int16: a --vocab-size above 32768 failed to convert."""
    from infer.spec_decode.train_pair import load_corpus

    class WideTokenizer:
        eos_token_id = 40000

        def __len__(self) -> int:
            return 50000

        def encode(self, text: str) -> list[int]:
            return [39999, len(text)]

    files = [tmp_path / f"{i}.py" for i in range(41)]  # every 40th file is held out: file 0 and file 40
    for path in files:
        path.write_text("abc")
    train, val = load_corpus(WideTokenizer(), files)
    assert val.tolist() == [39999, 3, 40000] * 2 and train.tolist() == [39999, 3, 40000] * 39


def test_train_pair_writes_a_pair_that_speculates_exactly(tmp_path):
    """A two-step run of the training script (its own smoke settings): the pair it writes loads, the draft passes
    the vocabulary check, and greedy speculation gives the target's own tokens; --out is required."""
    from infer import LLM
    from infer.spec_decode.train_pair import argument_parser, main

    with pytest.raises(SystemExit) as exit_info:  # parsing only: a default --out replaced the shipped pair
        argument_parser().parse_args(["--target-steps", "1"])
    assert exit_info.value.code == 2
    main(["--out", str(tmp_path), "--target-steps", "2", "--draft-steps", "2", "--seq-len", "32", "--batch", "2"])
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = ["def f(x):", "import os\n"]
    plain = LLM(str(tmp_path / "target"), device="cpu").generate(prompts, params)
    spec = LLM(str(tmp_path / "target"), device="cpu", proposer="draft-model", draft_model=str(tmp_path / "draft"),
               num_speculative_tokens=3)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in plain]
    assert spec.engine.stats.spec_proposed > 0


def test_draft_probabilities_with_a_negative_value_are_improper_even_when_they_sum_to_one():
    from infer.spec_decode.rejection import describe_improper, improper_drafts

    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0], [1.2, -0.2, 0.0, 0.0]],
                      [[0.5, 0.5, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]])
    draft = torch.tensor([[0, 0], [1, 3]])
    assert improper_drafts(q, draft, torch.tensor([2, 2])).tolist() == [True, False]
    assert improper_drafts(q, draft, torch.tensor([1, 2])).tolist() == [False, False]  # padding is not judged
    assert describe_improper(q[0], [0, 0]) == "draft 1's probabilities hold negative values (down to -0.2)"


def test_a_rejection_where_q_covers_p_up_to_rounding_resamples_from_p():
    """q within the sum tolerance of 1 may exceed p everywhere: max(0, p - q) is then all zero, and the token after
    a rejection is drawn from p itself (here the exponential race favours token 1), not read off a zero row."""
    p = torch.tensor([[[0.5, 0.5], [0.5, 0.5]]])
    q = torch.tensor([[[0.505, 0.505]]])
    out = rejection_sample(p, q, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([[0.999]]),
                           torch.tensor([[1.0, 0.5]]))
    assert out.num_accepted.tolist() == [0] and out.next_token.tolist() == [1]
