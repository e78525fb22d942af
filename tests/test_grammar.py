"""Grammar-structured output (StructuredOutput.grammar, GBNF) against references: the lark package's Earley parser
says which strings are sentences (every string over a grammar's alphabet up to a length, and sentences drawn by a
generator written apart, then mutated), a parse of every completion that the automaton offers for a live prefix
checks that it can be completed; an HF transformers greedy loop masked by a hand-written recognizer of nested
lists; Python's json for a JSON grammar's samples; and each refusal, naming the rule."""
from __future__ import annotations

import functools
import itertools
import json
import os
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lark import Lark
from lark.exceptions import LarkError

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import InvalidRequestError
from infer.core.interfaces import Vocabulary
from infer.core.loader import load_tokenizer
from infer.core.request import FinishReason, SamplingParams, StructuredOutput
from infer.plugins.fsm_output import MAX_FORCED_CHARS, FsmBackend, step
from infer.plugins.grammar_pda import PushdownAutomaton
from infer.plugins.regex_fsm import DEAD
from test_structured_output import PROMPT, masked_greedy, token_table

# Each case: a GBNF grammar, the same language in lark's syntax (written apart), and the alphabet of its sentences.
BALANCED = ('root ::= ( "(" root ")" | "x" )*',
            'start: item*\nitem: "(" start ")" | "x"', "()x")
ARITHMETIC = ("""
root ::= expr
expr ::= term ("+" term)*     # sums of products
term ::= factor ("*" factor)*
factor ::= [0-9]+ | "(" expr ")" | "-" factor
""", 'start: expr\nexpr: term ("+" term)*\nterm: factor ("*" factor)*\nfactor: /[0-9]+/ | "(" expr ")" | "-" factor',
    "1+*(-)")
NESTED_LISTS = ('root ::= list\nlist ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9]+ | list',
                'start: list\nlist: "[" (item ("," item)*)? "]"\nitem: /[0-9]+/ | list', "[],1")
OPTIONAL_CALLS = ("""
root ::= a b a{1,2}
a ::= "x"?
b ::= ("y" a)+ | "z"
""", 'start: a b a a?\na: "x"?\nb: ("y" a)+ | "z"', "xyz")
DEAD_BRANCH = (r'root ::= "x" root? "y"? | "z" "x" [^\x00-\U0010FFFF]', 'start: "x" start? "y"?', "xyz")  # z: no way on
# the textbook's unfactored expressions: both alternatives of e (and of t) begin alike
TEXTBOOK = ('root ::= e\ne ::= t "+" e | t\nt ::= f "*" t | f\nf ::= "(" e ")" | [0-9]',
            'start: e\ne: t "+" e | t\nt: f "*" t | f\nf: "(" e ")" | /[0-9]/', "1+*()")
DEAD_CALL = (r'root ::= "q" (a [^\x00-\U0010FFFF] | "y") | "r" a?' + '\na ::= "x"+',  # q x: a call with no way on
             'start: "q" "y" | "r" a?\na: "x"+', "qrxy")
CASES = {"dead-branch": DEAD_BRANCH, "balanced": BALANCED, "arithmetic": ARITHMETIC, "nested-lists": NESTED_LISTS,
         "optional-calls": OPTIONAL_CALLS, "textbook": TEXTBOOK, "dead-call": DEAD_CALL}


def parser_of(lark_grammar: str) -> Callable[[str], bool]:
    parser = Lark(lark_grammar, parser="earley", lexer="dynamic")

    def accepts(text: str) -> bool:
        try:
            parser.parse(text)
        except LarkError:
            return False
        return True

    return accepts


def state_after(automaton: PushdownAutomaton, text: str) -> int:
    state = automaton.start
    for char in text:
        state = automaton.step(state, ord(char))
    return state


def shortest_completion(automaton: PushdownAutomaton, state: int, alphabet: str, limit: int) -> str | None:
    """A shortest text over ``alphabet`` that takes ``state`` to acceptance, found by breadth-first search."""
    frontier, seen = [(state, "")], {state}
    for _ in range(limit + 1):
        nxt = []
        for at, text in frontier:
            if automaton.accepting(at):
                return text
            for char in alphabet:
                moved = automaton.step(at, ord(char))
                if moved != DEAD and moved not in seen:
                    seen.add(moved)
                    nxt.append((moved, text + char))
        frontier = nxt
    return None


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_sentences_and_live_prefixes_equal_lark_s_on_every_short_string(case: tuple[str, str, str]) -> None:
    """Every string over the alphabet up to a length: the automaton accepts exactly lark's sentences; a string
    with a sentence after it (within the bound) never leads to DEAD; and from each string the automaton keeps
    live, the completion it finds is a sentence to lark (so no live state is a dead end)."""
    gbnf, lark_grammar, alphabet = case
    automaton, accepts = PushdownAutomaton.compile(gbnf), parser_of(lark_grammar)
    longest = {3: 7, 4: 6, 5: 5, 6: 5}[len(alphabet)]
    strings = ["".join(chars) for n in range(longest + 1) for chars in itertools.product(alphabet, repeat=n)]
    sentences = [text for text in strings if accepts(text)]
    assert [text for text in strings if automaton.fullmatch(text)] == sentences
    assert len(sentences) > 3
    prefixes = {sentence[:i] for sentence in sentences for i in range(len(sentence) + 1)}
    states = {text: state_after(automaton, text) for text in strings}
    assert all(states[text] != DEAD for text in prefixes)
    for text, state in states.items():
        if state != DEAD:
            completion = shortest_completion(automaton, state, alphabet, 12)
            assert completion is not None and accepts(text + completion), text


@st.composite
def nested_lists(draw: st.DrawFn, depth: int = 0) -> str:
    items = draw(st.lists(st.one_of(st.integers(0, 999).map(str), *([nested_lists(depth + 1)] if depth < 4 else [])),
                          max_size=4))
    return "[" + ",".join(items) + "]"


@settings(max_examples=150, deadline=None)
@given(sentence=nested_lists(), edits=st.lists(st.tuples(st.integers(0, 60), st.sampled_from("[],17 ")), max_size=3))
def test_drawn_sentences_are_accepted_and_their_mutants_judged_as_lark_judges_them(
        sentence: str, edits: list[tuple[int, str]]) -> None:
    automaton, accepts = nested_automaton(), nested_parser()
    assert automaton.fullmatch(sentence) and json.loads(sentence) is not None
    assert all(state_after(automaton, sentence[:i]) != DEAD for i in range(len(sentence)))
    mutant = sentence
    for at, char in edits:
        at %= len(mutant) + 1
        mutant = mutant[:at] + char + mutant[at + 1:] if at % 2 else mutant[:at] + char + mutant[at:]
    assert automaton.fullmatch(mutant) == accepts(mutant), mutant


@functools.cache
def nested_automaton() -> PushdownAutomaton:
    return PushdownAutomaton.compile(NESTED_LISTS[0])


@functools.cache
def nested_parser() -> Callable[[str], bool]:
    return parser_of(NESTED_LISTS[1])


# JSON in the style of the grammars shipped with llama.cpp (written here from RFC 8259's grammar): an empty first
# alternative, classes with \x escapes, counted repetitions, whitespace after each value
LLAMA_STYLE_JSON = r'''
root   ::= ws value
value  ::= object | array | string | number | ("true" | "false" | "null") ws
object ::=
  "{" ws (
            string ":" ws value
    ("," ws string ":" ws value)*
  )? "}" ws
array  ::= "[" ws ( value ("," ws value)* )? "]" ws
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" (["\\/bfnrt] | "u" [0-9a-fA-F]{4}) )* "\"" ws
number ::= "-"? ("0" | [1-9] [0-9]*) ("." [0-9]+)? ([eE] [-+]? [0-9]+)? ws
ws ::= | " " | "\n" [ \t]{0,20}
'''
JSON_VALUES = st.recursive(st.none() | st.booleans() | st.integers(-10**6, 10**6) | st.floats(allow_nan=False,
                           allow_infinity=False) | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                          max_size=3), max_leaves=8)


@functools.cache
def llama_style_json() -> PushdownAutomaton:
    return PushdownAutomaton.compile(LLAMA_STYLE_JSON)


def json_loads(text: str) -> bool:
    try:
        json.loads(text, parse_constant=lambda name: 1 / 0)  # no NaN, Infinity
    except (ValueError, ZeroDivisionError):
        return False
    return True


@settings(max_examples=200, deadline=None)
@given(value=JSON_VALUES, indent=st.sampled_from([None, 1]), edit=st.tuples(st.integers(0, 80), st.sampled_from(
    '{}[],:" 0e-.\\tn')))
def test_a_llama_style_json_grammar_reads_what_python_s_json_reads(value: object, indent: int | None,
                                                                   edit: tuple[int, str]) -> None:
    """json.dumps's text (ASCII-escaped, compact or indented by one) is a sentence, and a one-character mutant is
    one exactly when json.loads reads it and each run of whitespace is one the grammar's ws allows (a space, or a
    newline and up to 20 spaces or tabs: narrower than RFC 8259's)."""
    automaton = llama_style_json()
    text = json.dumps(value, indent=indent)
    assert automaton.fullmatch(text), text
    at = edit[0] % (len(text) + 1)
    mutant = text[:at] + edit[1] + text[at:]
    between = re.sub(r'"(?:[^"\\]|\\.)*"', '""', mutant)  # exact where json.loads reads the mutant
    spaced = all(re.fullmatch(r" |\n[ \t]{0,20}", run) for run in re.findall(r"[ \t\n\r]+", between))
    assert automaton.fullmatch(mutant) == (json_loads(mutant) and spaced), mutant


def test_the_dialect_reads_as_documented() -> None:
    """Comments, rules over several lines, escapes in literals, negated classes, '.', counts and an empty
    alternative mean what the module's docstring says: checked on chosen strings against Python's own reading."""
    grammar = r'''
    root ::= greeting ws? quoted "\n" any{2} tail   # a comment
    greeting ::=
        "hi" | "hello"
        | ""
    ws ::= [ \t]+
    quoted ::= "\"" [^"\\]{0,3} "\""
    any ::= .
    tail ::= [\x41-\x43]* "\u00e9"
    '''
    automaton = PushdownAutomaton.compile(grammar)
    assert automaton.fullmatch('hello "ab"\n\n\nABCé')
    assert automaton.fullmatch('""\nxyé')
    assert not automaton.fullmatch('hello "abcd"\nxyé')  # {0,3}
    assert not automaton.fullmatch('hi "a\\"\nxyé')  # no backslash in [^"\\]
    assert not automaton.fullmatch('hi "a"\nxyDé')  # D is past \x43
    assert not automaton.fullmatch('hey ""\nxyé')


def test_crlf_lines_tabs_hyphenated_names_and_spaced_quantifiers_read_as_in_llama_cpp() -> None:
    """llama.cpp's GBNF reads CRLF line ends and tabs as space, names with '-' and digits, and a quantifier after
    space: such a grammar accepts, of every short string, exactly lark's sentences of the same language."""
    gbnf = ('root ::= item-list2\r\nitem-list2\t::= "[" ( digit + ( "," digit + ) * ) ? "]"  # a list\r\n'
            'digit ::= [0-9]\r\n')
    automaton, accepts = PushdownAutomaton.compile(gbnf), parser_of('start: "[" (D+ ("," D+)*)? "]"\nD: /[0-9]/')
    strings = ["".join(chars) for n in range(7) for chars in itertools.product("[],1", repeat=n)]
    sentences = [text for text in strings if accepts(text)]
    assert [text for text in strings if automaton.fullmatch(text)] == sentences and len(sentences) > 5


def test_a_left_recursion_off_the_first_rule_and_a_wide_first_call_graph() -> None:
    """A left-recursive cycle that does not pass the first rule searched is found, naming the cycle; and a first-call
    graph of 2**18 paths but few rules (each rule reaches the next through two) is checked without walking them (past
    a "q": the configuration that reads on would take a stack per path, more than MAX_STACKS)."""
    with pytest.raises(InvalidRequestError, match=re.escape("rule 'b' is left-recursive (b -> c -> b before")):
        PushdownAutomaton.compile('root ::= a\na ::= b\nb ::= c "x" | "y"\nc ::= b "z"')
    rules = [f'r{i} ::= a{i} | b{i}\na{i} ::= r{i + 1} "a"\nb{i} ::= r{i + 1} "b"' for i in range(18)]
    began = time.perf_counter()
    automaton = PushdownAutomaton.compile('root ::= "q" r0 | "p"\n' + "\n".join(rules) + '\nr18 ::= "z"')
    assert time.perf_counter() - began < 2 and automaton.fullmatch("p") and not automaton.fullmatch("q")


def test_the_size_limit_counts_the_states_built() -> None:
    """The least max_states that compiles a grammar is the count of states the refusal one below it names: a grammar
    of exactly max_states states is compiled, and one more than allowed is refused."""
    text = 'root ::= ("ab" | c){2,3}\nc ::= [x-z]+ "."'

    def compiles(limit: int) -> bool:
        try:
            return PushdownAutomaton.compile(text, max_states=limit).fullmatch("abx.")
        except InvalidRequestError:
            return False

    least = next(limit for limit in range(1, 500) if compiles(limit))
    with pytest.raises(InvalidRequestError, match=f"too large \\({least} states\\)"):
        PushdownAutomaton.compile(text, max_states=least - 1)


@pytest.mark.parametrize("grammar, words", [
    ('root ::= root "a" | "b"', "rule 'root' is left-recursive (root -> root"),
    ('root ::= a\na ::= b "x" | "w"\nb ::= "y"? a', "left-recursive (a -> b -> a"),
    ('root ::= "x" a\na ::= "y" a', "rule 'a' can never be completed"),
    ('root ::= a', "rule 'a' is used but not defined at line 1, column 10"),
    ('start ::= "a"', "no rule named root"),
    ('root ::= "a"\nroot ::= "b"', "rule 'root' is defined twice at line 2, column 1"),
    ('root ::= "a"\nroot ::= "b"\nx ::= "c"', "rule 'root' is defined twice at line 2, column 1"),
    ('root ::= "a"\n  "\\d"', "class escape (\\d, \\w, \\s, ...) inside a string literal at line 2, column 4"),
    ('root ::= "\ud800"', "the lone surrogate U+D800 is no character at line 1, column 11"),
    ('root ::= {2} "a"', "nothing to repeat at line 1, column 10"),
    ('root ::= "a" * *', "multiple repeat at line 1, column 15"),
    ("root ::= " + "(" * 5000 + '"a"' + ")" * 5000, "its groups nest too deeply"),
    ('root ::= ("a"', "missing ), unterminated group at line 1, column 10"),
    ('root ::= "a")', "unbalanced parenthesis"),
    ('root ::= "a', "unterminated string literal"),
    ('root ::= "a"**', "multiple repeat"),
    ('root ::= * "a"', "nothing to repeat"),
    ('root ::= @', "unexpected '@' at line 1, column 10"),
    ('root ::= "\\d"', "class escape"),
    ('root ::= "a\\b"', "\\b is not supported at line 1, column 12"),  # no backspace: not in the dialect
    ('root ::= [b-a]', "bad character range"),
    ("root ::= \"a\"\n  x", "rule 'x' is used but not defined at line 2, column 3"),
    ('root ::= "a"{1001}', "exceeds the limit"),
    ('root ::= ("ab"{1000}){1000}', "too large"),
    ("ro ot ::= 'a'", "expected a rule"),
])
def test_a_grammar_outside_the_dialect_is_refused_naming_why(grammar: str, words: str) -> None:
    with pytest.raises(InvalidRequestError, match="invalid grammar: .*" + re.escape(words)):
        PushdownAutomaton.compile(grammar)


def test_an_unused_rule_is_not_judged() -> None:
    """Only the rules root reaches are checked: an unused left-recursive one does not refuse the grammar."""
    assert PushdownAutomaton.compile('root ::= "a"\nspare ::= spare "b"').fullmatch("a")
    assert PushdownAutomaton.compile('root ::= "a"\nstuck ::= "b" stuck').fullmatch("a")  # never completed, unused


def test_alternatives_that_begin_alike_share_one_stack_at_any_depth() -> None:
    """Each rule is determinized, so the textbook grammar's stacks do not multiply as its parentheses nest: 60 deep
    is followed (with an NFA per rule, four stacks a level: cut past 6), and lark agrees at a depth it can parse."""
    automaton, accepts = PushdownAutomaton.compile(TEXTBOOK[0]), parser_of(TEXTBOOK[1])
    for depth in (7, 60):
        text = "(" * depth + "1+2*3" + ")" * depth
        assert automaton.fullmatch(text) and not automaton.fullmatch(text[:-1]) and not automaton.cut
    assert accepts("(" * 7 + "1+2*3" + ")" * 7)


def test_a_too_ambiguous_continuation_is_cut_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Two rules of one language (b and c) double the stacks at each character; past MAX_STACKS that continuation
    leads nowhere (DEAD), with one warning (a second continuation cut, by 'b', warns no more): no text outside the
    grammar is ever allowed, and no step fails."""
    automaton = PushdownAutomaton.compile('root ::= b | c\nb ::= [ab] root?\nc ::= [ab] root?')
    states = [automaton.start]
    for _ in range(40):
        states.append(automaton.step(states[-1], ord("a")))
    cut = states.index(DEAD)
    assert 10 < cut and all(automaton.accepting(state) for state in states[1:cut])
    assert automaton.step(states[cut - 1], ord("b")) == DEAD
    assert automaton.cut and len(caplog.records) == 1 and "too ambiguous" in caplog.records[0].message
    assert automaton.step(automaton.start, ord("c")) == DEAD and automaton.fullmatch("ab")


# ---------------------------------------------------------------- masks and forced text (the fsm backend)
@pytest.fixture(scope="module")
def path(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def backend(path: Path) -> FsmBackend:
    tokenizer = load_tokenizer(path)
    return FsmBackend(Vocabulary(tokenizer, len(tokenizer), frozenset({tokenizer.eos_token_id}), torch.device("cpu")))


def test_masks_equal_a_hand_written_recognizer_along_random_walks(backend: FsmBackend) -> None:
    """Walk random allowed tokens of the nested lists; at every state the mask holds exactly the tokens whose text
    keeps the output a prefix of a sentence, by the hand recognizer, and EOS once it is whole."""
    grammar = backend.compile(StructuredOutput(grammar=NESTED_LISTS[0]))
    table, eos, rng = backend.index.table, backend.vocabulary.eos_token_ids, random.Random(0)
    for _ in range(4):
        matcher, text = grammar.matcher(), ""
        for _ in range(10):
            allowed = set(torch.nonzero(matcher.allowed()).flatten().tolist())
            want = {t for t, piece in enumerate(table) if piece and nested_list_reading(text + piece.decode(
                "utf-8", "replace")) is not None} | (eos if nested_list_reading(text) == "whole" else set())
            assert allowed == want, text
            if not allowed - eos:
                break
            token = rng.choice(sorted(allowed - eos))
            matcher.advance(token)
            text += table[token].decode("utf-8")


def test_masks_stay_right_as_the_table_grows_past_its_first_rows(backend: FsmBackend) -> None:
    """Each nesting depth is a configuration of its own: 80 brackets deep the table has grown past its first 64
    rows, and every mask on the way is the hand recognizer's; so is each again once the mask cache is emptied
    (under MASK_CACHE_BYTES masks are evicted and computed anew), from rows built before the table grew."""
    grammar = backend.compile(StructuredOutput(grammar=NESTED_LISTS[0]))
    table, eos = backend.index.table, backend.vocabulary.eos_token_ids
    bracket = next(t for t, piece in enumerate(table) if piece == b"[")
    matcher, text, on_the_way = grammar.matcher(), "", []
    for _ in range(80):
        on_the_way.append((matcher.copy(), text))
        matcher.advance(bracket)
        text += "["
    for emptied in (False, True):
        if emptied:
            assert len(grammar.filled) > 64 and grammar.automaton.num_states() > 80
            backend.masks.clear()
        for at, prefix in on_the_way:
            allowed = set(torch.nonzero(at.allowed()).flatten().tolist())
            assert allowed == {t for t, piece in enumerate(table) if piece and nested_list_reading(
                prefix + piece.decode("utf-8", "replace")) is not None} - eos, (emptied, len(prefix))


def test_a_configuration_first_met_by_a_long_token_or_forced_text_gets_its_row() -> None:
    """A token past MAX_TOKEN_CHARS, and the forced text of jump-forward, step the automaton outside the masks'
    pass, so the configuration they reach may have no row yet: its mask builds it (counted: with 100 "a"s to
    write, after 64 the 64-"a" token no longer fits and the 1-"a" token does, as after 64 more... until 100)."""
    from infer.plugins.fsm_output import TokenIndex

    backend = FsmBackend(Vocabulary(None, 3, frozenset({0}), torch.device("cpu")))
    backend.index = TokenIndex([None, b"a", b"a" * 64])
    grammar = backend.compile(StructuredOutput(grammar='root ::= "a"{100}'))
    matcher = grammar.matcher()
    assert torch.nonzero(matcher.allowed()).flatten().tolist() == [1, 2]
    matcher.advance(2)
    assert torch.nonzero(matcher.allowed()).flatten().tolist() == [1]  # 36 left
    forced = backend.compile(StructuredOutput(grammar='root ::= "b" "a"{100}'))
    text = forced.matcher().forced_text()
    assert text == "b" + "a" * 63  # MAX_FORCED_CHARS of the 101
    assert sorted(forced.allowed_ids((state_after(forced.automaton, text), b""))) == [1]  # 37 left


@pytest.mark.parametrize("prefix", ["", '{"', '{"a": [1, {"b": [', '{"ab": -'])
def test_the_growing_table_and_the_byte_walk_equal_a_walk_of_each_token(backend: FsmBackend, prefix: str) -> None:
    """A grammar's masks come from a table grown as configurations are met (vectorized over the vocabulary), or,
    inside a character, from the byte-order walk: both give the tokens that stepping each token alone gives."""
    grammar = backend.compile(StructuredOutput(grammar=JSON_GRAMMAR))
    start = (state_after(grammar.automaton, prefix), b"")
    alone = tokens_alone(backend, grammar.automaton, start)
    assert sorted(grammar.allowed_ids(start)) == alone and alone
    assert sorted(grammar.walk(start)) == alone


def tokens_alone(backend: FsmBackend, automaton: PushdownAutomaton, start: tuple[int, bytes]) -> list[int]:
    """The tokens whose bytes, stepped one by one from ``start``, keep the output live."""
    alone = []
    for token, data in enumerate(backend.index.table):
        state = start if data else None
        for byte in data or b"":
            state = step(automaton, state, byte) if state is not None else None
        if state is not None:
            alone.append(token)
    return alone


@pytest.mark.parametrize("prefix", ["", "é", "é日", "é日ü"])
def test_masks_of_wide_characters_equal_a_walk_of_each_token(backend: FsmBackend, prefix: str) -> None:
    """A grammar of characters of two and three bytes, which byte-level tokens split: the tokens that end inside a
    character are allowed where a character that their bytes begin can come next, as stepping each token alone
    says (from each configuration: each allows other characters)."""
    grammar = backend.compile(StructuredOutput(grammar='root ::= ("é" "日" "ü")+'))
    start = (state_after(grammar.automaton, prefix), b"")
    alone = tokens_alone(backend, grammar.automaton, start)
    assert sorted(grammar.allowed_ids(start)) == alone and any(len(backend.index.table[t]) == 1 for t in alone)


def test_masks_down_a_deep_nesting_equal_a_count_of_the_brackets(backend: FsmBackend) -> None:
    """Down 150 levels of brackets, each level a configuration of its own (so the table grows past its first rows
    several times), each mask holds exactly the tokens of brackets and x that never close more than are open,
    by a count of the depth, and EOS at depth 0; then back up, closing."""
    grammar = backend.compile(StructuredOutput(grammar=BALANCED[0]))
    table, eos = backend.index.table, backend.vocabulary.eos_token_ids

    def live(depth: int, piece: bytes) -> bool:
        for char in piece.decode("utf-8", "replace"):
            depth += {"(": 1, ")": -1, "x": 0}.get(char, -10**6)
            if depth < 0:
                return False
        return True

    matcher, moves = grammar.matcher(), [(depth, b"(") for depth in range(150)] + [(d, b")") for d in range(150, 0, -1)]
    for depth, move in [*moves, (0, b"x")]:
        allowed = set(torch.nonzero(matcher.allowed()).flatten().tolist())
        want = {t for t, piece in enumerate(table) if piece and live(depth, piece)} | (eos if depth == 0 else set())
        assert allowed == want, depth
        matcher.advance(table.index(move))


def test_forced_text_is_what_every_sentence_continues_with(backend: FsmBackend) -> None:
    """After every prefix of a sentence of a finite grammar, forced_text is the longest common prefix of the rest
    of every sentence that starts with it: "" where two part, or where one ends."""
    grammar = backend.compile(StructuredOutput(grammar='root ::= "ab" ("cd" | "ce") tail\ntail ::= "xy" ("z" | "")'))
    sentences = ["abcdxy", "abcdxyz", "abcexy", "abcexyz"]
    for prefix in {sentence[:i] for sentence in sentences for i in range(len(sentence) + 1)}:
        rests = [sentence[len(prefix):] for sentence in sentences if sentence.startswith(prefix)]
        assert grammar.forced_text(state_after(grammar.automaton, prefix)) == os.path.commonprefix(rests), prefix


def test_forced_text_is_the_common_prefix_of_the_rests_up_to_its_cap(backend: FsmBackend) -> None:
    """After every prefix of a sentence of a finite grammar, forced_text is the longest common prefix of the rests
    of the sentences that start with it, cut at MAX_FORCED_CHARS: alternatives of characters that are not
    neighbours ("d" or "f") force nothing, and a literal longer than the cap is forced up to it."""
    grammar = backend.compile(StructuredOutput(grammar='root ::= "ab" ("cd" | "cf") "x"{70} ("y" | [0-1])'))
    sentences = [f"abc{c}{'x' * 70}{end}" for c in "df" for end in "y01"]
    for prefix in {sentence[:i] for sentence in sentences for i in range(len(sentence) + 1)}:
        rests = [sentence[len(prefix):] for sentence in sentences if sentence.startswith(prefix)]
        want = os.path.commonprefix(rests)[:MAX_FORCED_CHARS]
        assert grammar.forced_text(state_after(grammar.automaton, prefix)) == want, prefix


# ---------------------------------------------------------------- in the engine


@pytest.fixture(scope="module")
def engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64))


def nested_list_reading(text: str) -> str | None:
    """A hand-written recognizer of NESTED_LISTS: "whole", "live" (a prefix of a sentence) or None."""
    depth, expect = 0, "open"
    for char in text:
        if char == "[" and expect in ("open", "item", "item or close"):
            depth, expect = depth + 1, "item or close"
        elif char in "0123456789" and expect in ("item", "item or close", "digits"):
            expect = "digits"
        elif char == "," and expect in ("digits", "after item"):
            expect = "item"
        elif char == "]" and expect in ("item or close", "digits", "after item"):
            depth -= 1
            expect = "end" if depth == 0 else "after item"
        else:
            return None
    return "whole" if expect == "end" else "live"


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT[3:]], ids=["prompt", "shorter-prompt"])
def test_greedy_equals_an_hf_loop_masked_by_a_hand_written_recognizer(engine: Engine, path: Path,
                                                                      prompt: list[int]) -> None:
    spec = StructuredOutput(grammar=NESTED_LISTS[0])
    out = engine.generate([prompt], SamplingParams(max_tokens=24, temperature=0, structured_output=spec))[0]
    want = masked_greedy(path, lambda text: nested_list_reading(text) is not None,
                         lambda text: nested_list_reading(text) == "whole", token_table(engine), engine.eos_token_ids,
                         24, prompt)
    assert out.outputs[0].token_ids == want


JSON_GRAMMAR = r'''
root ::= object
value ::= object | array | string | number | "true" | "false" | "null"
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" [a-z ]{0,6} "\""
number ::= "-"? ( "0" | [1-9] [0-9]{0,3} )
ws ::= " "?
'''


def test_sampled_outputs_are_sentences_and_cut_ones_live_prefixes(engine: Engine) -> None:
    """Temperature 1.5, n = 4, two prompts, a JSON grammar and the nested lists: each completion ended at EOS is
    a sentence (Python's json reads the JSON ones; lark's parser and the hand recognizer the lists), each cut by
    max_tokens a live prefix (the lists)."""
    json_spec, lists_spec = StructuredOutput(grammar=JSON_GRAMMAR), StructuredOutput(grammar=NESTED_LISTS[0])
    outs = engine.generate([PROMPT, PROMPT[:4]] * 2, [
        SamplingParams(max_tokens=40, temperature=1.5, n=4, seed=seed, structured_output=spec)
        for seed, spec in enumerate((json_spec, json_spec, lists_spec, lists_spec))])
    stops = 0
    for out in outs[:2]:
        for completion in out.outputs:
            if completion.finish_reason is FinishReason.STOP:
                stops += 1
                assert isinstance(json.loads(completion.text), dict), completion.text
    for out in outs[2:]:
        for completion in out.outputs:
            reading = nested_list_reading(completion.text)
            if completion.finish_reason is FinishReason.STOP:
                stops += 1
                assert reading == "whole" and nested_parser()(completion.text), completion.text
            else:
                assert reading is not None, completion.text
    assert stops >= 4


def test_speculation_and_async_scheduling_keep_the_outputs(path: Path) -> None:
    """The same greedy outputs plain, under async scheduling, with jump-forward drafts (the text the grammar
    forces: a JSON grammar's punctuation) and with ngram drafts verified under masks walked along them."""
    params = [SamplingParams(max_tokens=30, temperature=0, structured_output=StructuredOutput(grammar=JSON_GRAMMAR)),
              SamplingParams(max_tokens=30, temperature=0, structured_output=StructuredOutput(grammar=NESTED_LISTS[0])),
              SamplingParams(max_tokens=12, temperature=0)]
    results, proposed = [], []
    for options in ({}, {"async_scheduling": True}, {"proposer": "jump-forward", "num_speculative_tokens": 4},
                    {"proposer": "ngram", "num_speculative_tokens": 3,
                     "plugin_options": {"spec_decode": {"structured": True}}}):
        engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, **options))
        outs = engine.generate([PROMPT] * 3, params)
        results.append([out.outputs[0].token_ids for out in outs])
        proposed.append(engine.stats.spec_proposed)
    assert results[0] == results[1] == results[2] == results[3]
    assert proposed[2] > 0


def test_a_grammar_the_backend_refuses_fails_at_admission(engine: Engine) -> None:
    left_recursive = StructuredOutput(grammar='root ::= root "a" | "b"')
    with pytest.raises(InvalidRequestError, match="left-recursive"):
        engine.add_request(PROMPT, SamplingParams(structured_output=left_recursive))
    with pytest.raises(InvalidRequestError, match="grammar must be a string"):
        engine.add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(grammar=5)))  # type: ignore
    assert not engine.has_unfinished()
