"""The regex automaton of structured output against references: Python's ``re.fullmatch`` for acceptance (with
re.ASCII, the dialect's meaning of \\d \\w \\s), the ``regex`` module's partial matching for liveness, brute force
for ``can_step_within``; every refusal; and the invariant that every state but DEAD can still reach acceptance."""
from __future__ import annotations

import random
import re
from collections import deque
from functools import cache

import pytest
import regex
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from infer.core.errors import InvalidRequestError
from infer.plugins.regex_fsm import DEAD, CharAutomaton

# (pattern, strings to check, matching or not): every construct of the dialect
TABLE: list[tuple[str, list[str]]] = [
    ("", ["", "a"]),
    ("abc", ["abc", "ab", "abcd", "", "abd"]),
    ("a.c", ["abc", "a\nc", "a\u00e9c", "ac", "a\U0001f600c"]),
    (r"\d+", ["0", "123", "", "12a", "\u0663"]),
    (r"\D\W\S", ["a b", "x!y", "1 b", "a_b", "\u00e9\u00e9\u00e9"]),
    (r"\w+", ["a_Z9", "", "a-b", "\u00e9"]),
    (r"\s*", ["", " \t\n\r\f\v", " a", "\u00a0"]),
    (r"\n\t\r\f\v\a\0", ["\n\t\r\f\v\a\0", "\n\t\r\f\v\a"]),
    (r"\x41\u00e9\U0001F600", ["A\u00e9\U0001f600", "A\u00e9"]),
    (r"\012\0", ["\n\0", "\0\0"]),
    (r"\.\\\[\"\/\-\{\}\(\)\*\+\?\|\^\$", ['.\\["/-{}()*+?|^$', "a"]),
    (r"\é", ["\u00e9", "e"]),
    ("[abc]", ["a", "c", "d", "", "ab"]),
    ("[a-cx-z0-9]+", ["abz09", "d", "xyz", "-"]),
    ("[^a-c]", ["d", "a", "\n", "\U0001f600", ""]),
    (r"[\d\s]+", ["1 2", "a"]),
    (r"[^\d\s]", ["a", "1", " "]),
    (r"[\D]", ["a", "1"]),
    (r"[\w.-]+@[\w-]+\.[a-z]{2,}", ["a.b-c@x-y.com", "a@b.c", "@b.co"]),
    ("[]a]", ["]", "a", "b"]),
    (r"[\]\\]", ["]", "\\", "a"]),
    ("[-a]", ["-", "a", "b"]),
    ("[a-]", ["-", "a", "b"]),
    ("[a-c-e]", ["b", "-", "e", "d"]),
    (r"[\x00-\x1f\u00e9]", ["\x05", "\u00e9", " "]),
    (r"[\b]", ["\b", "b"]),
    ("[.*+?]", [".", "*", "a"]),
    ("(ab)+", ["ab", "abab", "", "aba"]),
    ("(?:ab|cd)*e", ["e", "abcde", "abce", "ab"]),
    ("(?P<year>[0-9]{4})-(?P<month>[0-9]{2})", ["2024-01", "2024-1", "24-01"]),
    ("a|b|", ["a", "b", "", "ab"]),
    ("(a|)+b", ["b", "aab", "a"]),
    ("a*?b+?c??", ["b", "aabbc", "c"]),
    ("a{3}", ["aaa", "aa", "aaaa"]),
    ("a{2,}", ["a", "aa", "aaaaa"]),
    ("a{2,4}?", ["a", "aa", "aaaa", "aaaaa"]),
    ("a{,2}", ["", "a", "aa", "aaa"]),
    ("a{,}", ["", "aaaa"]),
    ("a{0}b", ["b", "ab"]),
    ("(a{2}){2}", ["aaaa", "aaa"]),
    ("a{", ["a{", "a"]),
    ("a{x}b{}c{1,2", ["a{x}b{}c{1,2"]),
    ("a{ 1}", ["a{ 1}", "a"]),
    ("x*{", ["xx{", "{"]),
    ("}]", ["}]"]),
    ("^ab$", ["ab", "a"]),
    ("^a|b$", ["a", "b", "ab"]),
    ("$", ["", "a"]),
    (r"a\$", ["a$", "a"]),
    ("((a|b)*c)?d", ["d", "abcd", "cd", "ad"]),
    (r'"(?:[^"\\]|\\.)*"', ['""', '"a\\"b"', '"a"b"', '"\\']),
    (r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?", ["0", "-12.5e+3", "01", "1.", "1e5"]),
]


@cache
def automaton(pattern: str) -> CharAutomaton:
    return CharAutomaton.compile(pattern)


def reference(pattern: str, text: str) -> bool:
    return re.fullmatch(pattern, text, re.ASCII) is not None


def state_after(pattern: str, text: str) -> int:
    a, state = automaton(pattern), automaton(pattern).start
    for ch in text:
        state = a.step(state, ord(ch))
    return state


@pytest.mark.parametrize("pattern, strings", TABLE, ids=[p or "empty" for p, _ in TABLE])
def test_table_against_re(pattern: str, strings: list[str]) -> None:
    assert sum(reference(pattern, s) for s in strings) >= 1, "each row checks a match"
    for s in strings:
        assert automaton(pattern).fullmatch(s) == reference(pattern, s), (pattern, s)


# (pattern, characters that matter to it) for the property tests; `re` and `regex` agree on all of them
PATTERNS: list[tuple[str, str]] = [
    ("a|b*c", "abc"),
    ("(ab|a)*b?", "ab"),
    ("[a-c]{2,4}d?", "abcd"),
    (r"\d+(\.\d*)?", "09.a"),
    (r"[^\s,]+(,[^\s,]+)*", "a, \n"),
    (r"\w+@\w+\.(com|org)", "a@.comrg"),
    (".a.", "a\nb"),
    ("(a|)+b{,2}", "ab"),
    ("x(y{2}|z{1,3})*?", "xyz"),
    (r'"(?:[^"\\]|\\.)*"', '"\\a'),
    ("(?P<n>[0-9]{1,3})(?:-[0-9]{1,3}){0,2}", "0-9a"),
    (r"[\x00-\x7f]*\u00e9", "a\u00e9\x7f"),
    (r"(\s|\S)a", " ab"),
    ("(a*)*b", "ab"),
    ("(a|b)*a(a|b){6}", "ab"),
    (r"[-\w]+[^-\w]", "a-_ !"),
    (r"\D?\W+", "1 a!"),
    (r"([a-c]b*?|)\.", "cb1."),
]
# regex's partial matching misjudges some lazy quantifiers (regex.fullmatch(r"([a-c]b*?|)\.", "c1", partial=True)
# is a match): the liveness oracle leaves them out
EAGER = [(p, chars) for p, chars in PATTERNS if not re.search(r"[*+?}]\?", p)]


def texts(chars: str) -> st.SearchStrategy[str]:
    return st.text(st.one_of(st.sampled_from(chars), st.characters(exclude_categories=["Cs"])), max_size=10)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_random_strings_against_re(data: st.DataObject) -> None:
    pattern, chars = data.draw(st.sampled_from(PATTERNS))
    text = data.draw(texts(chars))
    assert automaton(pattern).fullmatch(text) == reference(pattern, text)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.filter_too_much])
@given(st.data())
def test_generated_matches_accepted(data: st.DataObject) -> None:
    pattern = data.draw(st.sampled_from([p for p, _ in PATTERNS + TABLE if p not in ("", "$")]))
    text = data.draw(st.from_regex(re.compile(pattern, re.ASCII), fullmatch=True))
    assume(not any(0xD800 <= ord(c) <= 0xDFFF for c in text))
    assert automaton(pattern).fullmatch(text)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_liveness_against_regex_partial(data: st.DataObject) -> None:
    pattern, chars = data.draw(st.sampled_from(EAGER))
    text = data.draw(texts(chars))
    live = regex.fullmatch(pattern, text, flags=regex.ASCII | regex.V0, partial=True) is not None
    assert (state_after(pattern, text) != DEAD) == live, (pattern, text)


@pytest.mark.parametrize("pattern, prefixes", [
    (".", [""]), ("[^a-z\u00e0-\u00ff]x", ["", "!"]), (r"\S|\d", [""]), (r"[\W\d]*a", ["", "!"]),
    ("(ab|cd|[x-z]{2})+", ["", "a", "ab", "x"]), ("\u0100|[\u00f0-\u00f8]q", ["", "\u00f5"]),
    (r"[^\u0000-\uffff]", [""]),
])
def test_can_step_within_brute_force(pattern: str, prefixes: list[str]) -> None:
    a = automaton(pattern)
    rng = random.Random(0)
    windows = [(0, 300), (90, 130), (0, 0), (10, 10), (0xD700, 0xD900), (0xDF00, 0xE100), (0xFF00, 0xFFFF + 200),
               (0x10FFFF - 100, 0x10FFFF), (300, 200)] + [(lo, lo + rng.randrange(50)) for lo in
                                                          (rng.randrange(0x300) for _ in range(30))]
    for prefix in prefixes:
        state = state_after(pattern, prefix)
        assert state != DEAD
        for lo, hi in windows:
            brute = any(a.step(state, c) != DEAD for c in range(lo, hi + 1))
            assert a.can_step_within(state, lo, hi) == brute, (pattern, prefix, lo, hi)
    assert not a.can_step_within(DEAD, 0, 0x10FFFF)


def test_surrogates_never_step() -> None:
    for pattern in (".", r"[^a]", r"\S", r"\W", r"\D", r"[\x00-\U0010FFFF]"):
        a = automaton(pattern)
        assert a.step(a.start, 0xD800) == DEAD and not a.can_step_within(a.start, 0xD800, 0xDFFF)
        assert a.step(a.start, 0xE000) != DEAD and a.step(a.start, 0xD7FF) != DEAD
        assert a.can_step_within(a.start, 0xDFFF, 0xE000)


@pytest.mark.parametrize("pattern, word", [
    (r"(a)\1", "backreference"), ("(?P<x>a)(?P=x)", "backreference"), ("(?=a)a", "lookahead"),
    ("(?!a)b", "lookahead"), ("(?<=a)b", "lookbehind"), ("(?<!a)b", "lookbehind"), ("(?i)a", "inline flags"),
    ("(?i:a)", "inline flags"), ("(?>a)", "atomic"), ("(?<n>a)", "(?P<name>"), (r"\bfoo", r"\b"), (r"a\B", r"\B"),
    (r"\Aa", r"\A"), (r"a\Z", r"\Z"), (r"a\z", r"\z"), ("(ab", "missing )"), ("ab)", "unbalanced"),
    ("((a)", "missing )"), ("*a", "nothing to repeat"), ("a|+", "nothing to repeat"), ("(?:)?", None),
    ("{2}", "nothing to repeat"), ("^*", "nothing to repeat"), ("a**", "multiple repeat"),
    ("a{2}{3}", "multiple repeat"), ("a*??", "multiple repeat"), ("a{3,2}", "{3,2}"), ("a{1001}", "1000"),
    ("a{2,5000}", "5000"), ("a*+", "possessive"), ("a++", "possessive"), ("a?+", "possessive"),
    ("a{1,2}+", "possessive"), (r"\q", "bad escape"), (r"\x4", "incomplete"), (r"\u12g4", "incomplete"),
    (r"\U00110000", "U+10FFFF"), ("a\\", "backslash"), (r"[\8]", "octal"), ("[z-a]", "bad character range"),
    (r"[\d-z]", "bad character range"), (r"[a-\w]", "bad character range"), ("[abc", "unterminated"),
    ("[]", "unterminated"), ("[^]", "unterminated"), ("a^b", "'^'"), ("a$b", "'$'"), ("(a$)", "'$'"),
    (r"[^\s\S]", "matches no text"), (r"a[^\x00-\U0010FFFF]", "matches no text"), ("(?P<1>a)", "group name"),
    ("(?P<a>x)(?P<a>y)", "redefinition"), ("(?P<a", "group name"), ("(?#c)", "comments"), ("(?(1)a)", "conditional"),
    ("(a{1000}){1000}", "too large (1001002 states)"),
])
def test_refusals(pattern: str, word: str | None) -> None:
    if word is None:  # a control: accepted
        assert CharAutomaton.compile(pattern).fullmatch("")
        return
    with pytest.raises(InvalidRequestError, match=r"^invalid regex: ") as info:
        CharAutomaton.compile(pattern)
    assert word in str(info.value)


def test_position_and_limits() -> None:
    with pytest.raises(InvalidRequestError, match="at position 3"):
        CharAutomaton.compile("abc(?=d)")
    with pytest.raises(InvalidRequestError, match="too large"):
        CharAutomaton.compile("[a-z]{20}", max_nfa_states=10)
    CharAutomaton.compile("a{1000}b{1000}")
    for bad in (None, b"abc", 3):
        with pytest.raises(InvalidRequestError, match="must be a string"):
            CharAutomaton.compile(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError, match="nest too deeply"):
        CharAutomaton.compile("(" * 5000 + ")" * 5000)


def test_step_cache_and_dead() -> None:
    a = CharAutomaton.compile("(a|b)*a(a|b){12}")  # its minimal DFA has 2^13 states: built only where walked
    assert a.num_states() == 1 and not a.accepting(DEAD) and a.step(DEAD, ord("a")) == DEAD
    state = a.start
    for ch in "ab" * 20:
        state = a.step(state, ord(ch))
        assert a.step(state, ord("c")) == DEAD
    built = a.num_states()
    assert built <= 41
    assert a.fullmatch("ab" * 20) == reference("(a|b)*a(a|b){12}", "ab" * 20)
    assert a.num_states() == built  # the same walk reuses cached transitions and interned states
    assert a.step(a.start, ord("a")) == a.step(a.start, ord("a"))


def reaches_acceptance(a: CharAutomaton, state: int, chars: list[int]) -> bool:
    seen, queue = {state}, deque([state])
    while queue:
        s = queue.popleft()
        if a.accepting(s):
            return True
        for c in chars:
            t = a.step(s, c)
            if t != DEAD and t not in seen:
                seen.add(t)
                queue.append(t)
    return False


@pytest.mark.parametrize("pattern, chars", PATTERNS + [
    ("a[^\\x00-\\U0010FFFF]|b", "ab"), ("(a[^\\s\\S]*)*c|a(b|[^\\s\\S])", "abc"), ("(x[^\\s\\S])?y", "xy"),
])
def test_every_live_state_can_accept(pattern: str, chars: str) -> None:
    a = automaton(pattern)
    rng = random.Random(pattern)
    alphabet = sorted({ord(c) for c in chars})
    for _ in range(30):
        state = a.start
        for _ in range(12):
            assert reaches_acceptance(a, state, alphabet), pattern
            options = [t for t in (a.step(state, c) for c in alphabet) if t != DEAD]
            if not options:
                break
            state = rng.choice(options)


@pytest.mark.parametrize("pattern", [r"[a-c]x|[b-d]y", r"[^\"\\]{0,5}\"", r"(ab|é.)+[0-9]?", r"\w+@\w+\.(com|org)"])
def test_determinize_builds_every_state_and_classes_step_alike(pattern: str) -> None:
    """Every code point of a class steps each state as the class's table entry says; the table holds every
    state reachable from the start (the lazily built automaton grows no further)."""
    import bisect
    import random

    automaton = CharAutomaton.compile(pattern)
    bounds, table = automaton.determinize(1000, 10**6, 10**7)
    assert len(table) == automaton.num_states() and bounds[0] == 0
    rng = random.Random(0)
    points = [rng.choice([rng.randrange(0, 0x250), rng.randrange(0, 0x110000)]) for _ in range(300)]
    for state in range(len(table)):
        for point in points + bounds:
            if 0xD800 <= point <= 0xDFFF:
                continue
            assert table[state][bisect.bisect_right(bounds, point) - 1] == automaton.step(state, point)
    assert automaton.num_states() == len(table)


def test_determinize_refuses_automata_past_its_bounds() -> None:
    with pytest.raises(InvalidRequestError, match="grows past 50 states"):
        CharAutomaton.compile("[ab]*a[ab]{8}").determinize(50, 10**6, 10**7)  # 2**9 states
    with pytest.raises(InvalidRequestError, match="100 steps"):
        CharAutomaton.compile("[ab]*a[ab]{8}").determinize(10**6, 100, 10**7)


def test_a_literal_of_many_distinct_characters_is_refused_before_its_table_is_built() -> None:
    """Each distinct character adds a class and each character a state: a 6,000-character literal of distinct
    CJK characters, within the state and work bounds, took 30 s and 4 GB to build (states x classes cells)."""
    from infer.plugins.fsm_output import MAX_DFA_CELLS

    literal = "".join(map(chr, range(0x4E00, 0x4E00 + 6000)))
    with pytest.raises(InvalidRequestError, match=r"table grows past 4000000 cells \(667 states x 6002 character "
                                                  r"classes so far\); simplify it"):  # refused at row 667 of 6001
        CharAutomaton.compile(literal).determinize(20_000, 4_000_000, MAX_DFA_CELLS)
    bounds, table = CharAutomaton.compile(literal[:500]).determinize(20_000, 4_000_000, MAX_DFA_CELLS)
    assert len(table) == 501 and len(bounds) == 502  # a short one is still built whole


def test_surrogate_escapes_join_into_one_character_and_lone_ones_are_refused() -> None:
    """JSON's and JavaScript's spelling of a character past U+FFFF, a high and a low surrogate escaped one after
    the other, is that one character (in a class's range too); a lone surrogate, no UTF-8 text's character, is
    refused by name, as is Python's three-digit octal escape (it was read as a backreference)."""
    assert CharAutomaton.compile(r"\ud83d\ude00+").fullmatch("\U0001F600\U0001F600")
    ranged = CharAutomaton.compile(r"[\ud83d\ude00-\ud83d\ude4f]")
    assert ranged.fullmatch("\U0001F642") and not ranged.fullmatch("a")
    for pattern, message in ((r"\ud800", r"the lone surrogate \\uD800 is no character"),
                             ("a\udc00", "the lone surrogate U\\+DC00 is no character .* at position 1"),
                             (r"\ude00\ud83d", r"the lone surrogate \\uDE00"),
                             (r"\101", r"octal escapes \(\\101\) are not supported .* write the character as \\xHH")):
        with pytest.raises(InvalidRequestError, match=message):
            CharAutomaton.compile(pattern)
