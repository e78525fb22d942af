"""The fsm structured-output backend's token masks: each state's allowed tokens equal what the `regex` module's
partial matching (an independent regex engine) says of each token's bytes, non-ASCII characters and tokens that
end inside a UTF-8 character included; the UTF-8 intervals against every code point; the refusals."""
from __future__ import annotations

import itertools
import os
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import regex
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.core.errors import InvalidRequestError
from infer.core.interfaces import Vocabulary
from infer.core.loader import load_tokenizer
from infer.core.request import StructuredOutput
from infer.plugins.fsm_output import MAX_FORCED_CHARS, FsmBackend, FsmMatcher, code_points, split_utf8, step
from infer.plugins.regex_fsm import DEAD
from test_structured_output import readable


@pytest.fixture(scope="module")
def tokenizer(checkpoint: Callable[[str], Path]) -> object:
    return load_tokenizer(checkpoint("llama"))


@pytest.fixture(scope="module")
def backend(tokenizer: object) -> FsmBackend:
    return FsmBackend(Vocabulary(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), torch.device("cpu")))


def readings(data: bytes, pattern: str) -> list[str]:
    """``data`` as text; when it ends inside a character, once per character it could finish as among the least
    one and the pattern's own characters (exact for patterns whose classes list their non-ASCII characters, or hold
    every character such a beginning spans)."""
    least = readable(data)
    if least is None:
        return []
    whole = data.decode("utf-8", "ignore")
    tail = data[len(whole.encode("utf-8")):]
    return [least] + [whole + c for c in set(pattern) if tail and c.encode("utf-8").startswith(tail)]


def oracle(backend: FsmBackend, pattern: str, data: bytes) -> set[int]:
    """The tokens that may follow the output bytes ``data``, by regex's partial fullmatch over each token's bytes
    (an unfinished last character stands for the characters its bytes may begin), and EOS when ``data`` is a whole
    match."""
    compiled = regex.compile(pattern)
    table = backend.index.table
    allowed = {t for t, piece in enumerate(table) if piece and any(
        compiled.fullmatch(text, partial=True) for text in readings(data + piece, pattern))}
    if (whole := readable(data)) is not None and data.decode("utf-8", "ignore") == whole and compiled.fullmatch(whole):
        allowed |= backend.vocabulary.eos_token_ids
    return allowed


@pytest.mark.parametrize("pattern", [
    "[éü日本語]+x?",  # 2- and 3-byte characters only: tokens that end inside one are allowed if it can finish
    "[a-z]{2,5}( [a-z]+)*",
    r'"([^"\\]|\\["\\n])*"',  # a quoted string: almost every token is allowed inside it
    ".{0,3}",
    r"-?(0|[1-9][0-9]*)(\.[0-9]+)?",
])
def test_masks_equal_partial_matching_along_random_walks(backend: FsmBackend, pattern: str) -> None:
    """Walk random allowed tokens; at every state, the mask is exactly the oracle's set. The tokenizer is a byte-
    level BPE trained on English-like text, so it has tokens ending inside a character (its byte alphabet)."""
    grammar = backend.compile(StructuredOutput(regex=pattern))
    rng = random.Random(0)
    eos = backend.vocabulary.eos_token_ids
    for walk in range(3):
        matcher, data = grammar.matcher(), b""
        for _ in range(8):
            allowed = set(torch.nonzero(matcher.allowed()).flatten().tolist())
            assert allowed == oracle(backend, pattern, data), (pattern, data)
            choices = sorted(allowed - eos)
            if not choices:
                break
            token = rng.choice(choices)
            matcher.advance(token)
            data += backend.index.table[token]


@pytest.mark.parametrize("pattern", [r"(de|def|class|import)( [a-z_]+)+\(?",
                                     r"(\n +)+[a-z]*"])  # whitespace runs: tokens past MAX_TOKEN_CHARS too
def test_both_vocabulary_walks_equal_a_walk_of_each_token(backend: FsmBackend, pattern: str) -> None:
    """The character-matrix walk and the byte-order walk (whose skip over a dead prefix leaves out exactly the tokens
    that cannot follow) give the tokens that stepping each token alone gives."""
    grammar = backend.compile(StructuredOutput(regex=pattern))
    start = (grammar.automaton.start, b"")
    alone = []
    for token, data in enumerate(backend.index.table):
        state = start if data else None
        for byte in data or b"":
            state = step(grammar.automaton, state, byte) if state is not None else None
        if state is not None:
            alone.append(token)
    assert sorted(grammar.allowed_ids(start)) == alone and alone  # vectorized over the character matrix
    assert sorted(grammar.walk(start)) == alone  # the byte-order walk, which states inside a character take


def test_utf8_prefix_intervals_equal_every_code_points_encoding() -> None:
    """code_points(prefix) is the least and greatest code point whose UTF-8 starts with prefix (one and two bytes of
    every lead; surrogates, which UTF-8 cannot hold, bound the ED interval)."""
    spans: dict[bytes, list[int]] = {}
    for code in range(0x80, 0x110000):
        if 0xD800 <= code <= 0xDFFF:
            continue
        encoded = chr(code).encode("utf-8")
        for cut in range(1, len(encoded)):
            span = spans.setdefault(encoded[:cut], [code, code])
            span[1] = code
    for prefix, (lo, hi) in spans.items():
        assert code_points(prefix) == (lo, hi), prefix
    for lead in (0x80, 0xBF, 0xC0, 0xC1, 0xF5, 0xFF):  # never a lead byte
        assert code_points(bytes((lead,))) is None
    assert code_points(b"\xe0\x80") is None and code_points(b"\xed\xa0") is None  # overlong; a surrogate


def test_eos_ends_a_whole_output_and_nothing_else_is_taken_after_it(backend: FsmBackend) -> None:
    grammar = backend.compile(StructuredOutput(choice=("yes", "no")))
    matcher = grammar.matcher()
    eos = next(iter(backend.vocabulary.eos_token_ids))
    assert not matcher.allowed()[eos]
    for token in backend.vocabulary.tokenizer.encode("no"):
        matcher.advance(token)
    assert torch.nonzero(matcher.allowed()).flatten().tolist() == [eos]  # "no" has no continuation
    matcher.advance(eos)
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(eos)


def test_a_token_the_mask_disallowed_is_refused(backend: FsmBackend) -> None:
    matcher: FsmMatcher = backend.compile(StructuredOutput(regex="[0-9]+")).matcher()
    letter = backend.vocabulary.tokenizer.encode("a")[0]
    assert not matcher.allowed()[letter]
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(letter)
    with pytest.raises(ValueError, match="not allowed"):
        matcher.advance(next(iter(backend.vocabulary.eos_token_ids)))  # an empty output is no match


def test_a_tokenizer_that_is_not_byte_level_is_refused() -> None:
    class WordTokenizer:  # no backend tokenizer: its tokens are not fixed byte strings
        eos_token_id = 0

    backend = FsmBackend(Vocabulary(WordTokenizer(), 10, frozenset({0}), torch.device("cpu")))
    with pytest.raises(InvalidRequestError, match="byte-level BPE"):
        backend.compile(StructuredOutput(regex="a"))


def finite_patterns(depth: int = 3) -> st.SearchStrategy[tuple[str, frozenset[str]]]:
    """(a regex, the set of strings it matches) for patterns built of literals, alternations, concatenations and
    optional parts; the set is worked out from the tree, apart from the automaton."""
    literal = st.text(alphabet="abé ", min_size=1, max_size=3).map(lambda s: (s, frozenset({s})))

    def grow(inner: st.SearchStrategy[tuple[str, frozenset[str]]]) -> st.SearchStrategy[tuple[str, frozenset[str]]]:
        parts = st.lists(inner, min_size=2, max_size=3)
        alternation = parts.map(lambda ps: ("(?:" + "|".join(p for p, _ in ps) + ")",
                                            frozenset().union(*(words for _, words in ps))))
        concatenation = parts.map(lambda ps: ("".join(f"(?:{p})" for p, _ in ps),
                                              frozenset(map("".join, itertools.product(*(w for _, w in ps))))))
        optional = inner.map(lambda p: (f"(?:{p[0]})?", p[1] | {""}))
        return st.one_of(alternation, concatenation, optional)

    return st.recursive(literal, grow, max_leaves=6)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(pattern=finite_patterns())
def test_forced_text_is_what_every_match_continues_with(backend: FsmBackend, pattern: tuple[str, frozenset[str]]
                                                        ) -> None:
    """After every prefix of a match, forced_text is the longest common prefix of the rest of every match that
    starts with it: "" where two matches part, or where one ends (the output may end there)."""
    regex_text, words = pattern
    grammar = backend.compile(StructuredOutput(regex=regex_text))
    for prefix in {word[:i] for word in words for i in range(len(word) + 1)}:
        state = grammar.automaton.start
        for char in prefix:
            state = grammar.automaton.step(state, ord(char))
        rests = [word[len(prefix):] for word in words if word.startswith(prefix)]
        assert grammar.forced_text(state) == os.path.commonprefix(rests), prefix


def test_forced_text_stops_inside_a_character_at_a_class_and_after_the_end(backend: FsmBackend) -> None:
    tokenizer = backend.vocabulary.tokenizer
    matcher = backend.compile(StructuredOutput(regex='é"(x|y)[0-9]"')).matcher()
    assert matcher.forced_text() == 'é"'
    lead = backend.index.table.index(b"\xc3")  # the first byte of é, a token of its own in a byte-level vocabulary
    matcher.advance(lead)
    assert matcher.forced_text() == ""  # inside a character: nothing said
    matcher.advance(backend.index.table.index(b"\xa9"))
    assert matcher.forced_text() == '"'
    for token in tokenizer.encode('"x', add_special_tokens=False):
        matcher.advance(token)
    assert matcher.forced_text() == ""  # a digit comes next: a class, not one character
    for token in tokenizer.encode('1"', add_special_tokens=False):
        matcher.advance(token)
    matcher.advance(next(iter(backend.vocabulary.eos_token_ids)))
    assert matcher.forced_text() == ""
    long = backend.compile(StructuredOutput(regex="a" * 100)).matcher()
    assert long.forced_text() == "a" * MAX_FORCED_CHARS


@pytest.mark.parametrize("pattern, prefix", [(".{0,3}", b""), (".{0,3}", b"\xc3"), ("(a|é)+", b"a\xc3"),
                                             ("[0-9]+x?", b"12")])
def test_advance_takes_exactly_the_tokens_the_mask_allows(backend: FsmBackend, pattern: str, prefix: bytes) -> None:
    """From a state, and mid-character, a matcher's advance succeeds for every token its mask allows (EOS too) and
    raises ValueError for every other id, a lone continuation byte or EOS inside a character included."""
    grammar = backend.compile(StructuredOutput(regex=pattern))
    table = backend.index.table
    matcher = grammar.matcher()
    for byte in prefix:
        matcher.advance(table.index(bytes((byte,))))
    mask = matcher.allowed()
    assert set(torch.nonzero(mask).flatten().tolist()) == oracle(backend, pattern, prefix)
    for token in range(backend.vocabulary.size):
        walker = matcher.copy()
        try:
            walker.advance(token)
        except ValueError:
            assert not mask[token], (token, table[token])
        else:
            assert mask[token], (token, table[token])


def test_a_vocabulary_wider_than_the_tokenizer_never_allows_the_ids_past_it(tokenizer: object) -> None:
    """Logits may be wider than the tokenizer (a padded embedding): masks span the logits' width, the ids past the
    tokenizer are never allowed, and advancing one is refused like any other disallowed token."""
    size = len(tokenizer)
    wide = FsmBackend(Vocabulary(tokenizer, size + 8, frozenset({tokenizer.eos_token_id}), torch.device("cpu")))
    matcher = wide.compile(StructuredOutput(regex=".*")).matcher()
    mask = matcher.allowed()
    assert mask.shape == (size + 8,) and mask[:size].any() and not mask[size:].any()
    for token in range(size, size + 8):
        with pytest.raises(ValueError, match="not allowed"):
            matcher.copy().advance(token)


def test_choices_with_regex_metacharacters_match_only_themselves(backend: FsmBackend) -> None:
    choices = ("a.b", "1+1", "(x)", "[y]", "c|d", "e*", "^$")
    grammar = backend.compile(StructuredOutput(choice=choices))
    automaton = grammar.automaton
    for text in (*choices, "axb", "11", "111", "x", "y", "c", "d", "", "eee", "c|"):
        state = automaton.start
        for char in text:
            state = automaton.step(state, ord(char)) if state != DEAD else DEAD
        assert (state != DEAD and automaton.accepting(state)) == (text in choices), text


def test_split_utf8_equals_decoding_each_cut_of_encoded_text() -> None:
    """Every cut of text mixing 1- to 4-byte characters: the whole characters before it and the bytes of the one it
    splits; None for bytes that start inside a character or are not UTF-8."""
    text = "aé日😀bü語🎉"
    encoded = text.encode("utf-8")
    starts = [len(text[:i].encode("utf-8")) for i in range(len(text) + 1)]
    for cut in range(len(encoded) + 1):
        whole = max(s for s in starts if s <= cut)
        assert split_utf8(encoded[:cut]) == ([ord(c) for c in encoded[:whole].decode("utf-8")], encoded[whole:cut])
    for data in (b"\x80", b"\xa9a", b"\xc0\x80", b"a\xff", b"\xe6\x97\xa5\x80"):
        assert split_utf8(data) is None, data
