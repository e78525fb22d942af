"""Context-free grammars under structured output: a GBNF grammar (llama.cpp's format) becomes a pushdown automaton
over Unicode code points with the interface of plugins/regex_fsm.py's CharAutomaton (``step``, ``accepting``,
``can_step_within``), so that the fsm backend masks tokens by walking its vocabulary through it.

The dialect: rules ``name ::= body``, a name of ASCII letters, digits, ``-`` and ``_``, the start rule ``root``; a
body runs to the next ``name ::=``. In a body: string literals ``"..."`` (escapes as in a regex: ``\\n \\t \\r \\\\
\\" \\xHH \\uHHHH \\UHHHHHHHH``), character classes ``[...]`` and ``[^...]`` as in a regex, ``.`` (any character,
newline included), rule names, groups ``( )``, alternation ``|`` and the quantifiers ``* + ? {m} {m,} {m,n} {,n}``;
``#`` starts a comment that runs to the end of the line. Refused, naming the rule: a rule used but not defined or
defined twice, no ``root``, a rule that can never be completed (each way through it needs itself again), and left
recursion (a rule that can reach itself before reading a character: write ``list ::= item ("," item)*``, not
``list ::= list "," item | item``). A grammar so ambiguous that a character would take more than MAX_STACKS parser
stacks at once cannot be followed that way: that continuation is cut (a warning says so), so outputs stay sentences
of the grammar, or prefixes of one, without reaching every sentence.

How it runs: each rule is a Thompson NFA whose edges read a character class or call a rule, then a DFA over those
(so alternatives that begin alike share their states). A configuration is the set of the live stacks: each the
return states of the calls in progress, then the state reached. After each
character every stack is closed under epsilon edges, calls (a push) and rule ends (a pop), and only stacks whose
state reads a character next are kept (and the accepting one). Configurations are interned to ints, as a DFA's
states are, with their steps cached. Without left recursion every closure is finite, and every state kept can
still complete its rule (the others are trimmed at compile time), so every configuration but DEAD can reach
acceptance, which is what the masks rely on.
"""
from __future__ import annotations

import logging
import re
from collections import defaultdict
from typing import NoReturn

from ..core.errors import InvalidRequestError
from .regex_fsm import DEAD, MAX_CHAR, CharAutomaton, Node, _hits, _normalize, _Parser, _size

log = logging.getLogger("infer")
ANY_CHAR = _normalize([(0, MAX_CHAR)])  # GBNF's '.': every character (no surrogate is one)
MAX_GRAMMAR_STATES = 100_000  # NFA states of all rules together
MAX_STACKS = 10_000  # stacks in one configuration: a character that would take more leads nowhere (logged)
_RULE_START = re.compile(r"([A-Za-z0-9_-]+)[ \t]*::=")
_NAME = re.compile(r"[A-Za-z0-9_-]+")
Stack = tuple[int, ...]  # the return states of the calls in progress, then the state reached


class _GrammarParser(_Parser):
    """GBNF text to one ``Node`` per rule, rule calls as ``("ref", name)``; the regex parser reads the classes,
    escapes and quantifiers."""

    def __init__(self, text: str) -> None:
        super().__init__(text)
        self.rules: dict[str, Node] = {}
        self.calls: list[tuple[str, int]] = []  # (rule called, where)

    def fail(self, what: str, fix: str, pos: int | None = None) -> NoReturn:
        pos = self.i if pos is None else pos
        line, column = self.p.count("\n", 0, pos) + 1, pos - self.p.rfind("\n", 0, pos)
        raise InvalidRequestError(f"invalid grammar: {what} at line {line}, column {column}; {fix}")

    def skip_space(self) -> None:
        while self.i < len(self.p):
            if self.p[self.i] == "#":
                end = self.p.find("\n", self.i)
                self.i = len(self.p) if end < 0 else end
            elif self.p[self.i].isspace():
                self.i += 1
            else:
                return

    def parse_rules(self) -> dict[str, Node]:
        if (lone := next((i for i, ch in enumerate(self.p) if 0xD800 <= ord(ch) <= 0xDFFF), None)) is not None:
            self.fail(f"the lone surrogate U+{ord(self.p[lone]):04X} is no character", "write the character itself",
                      lone)
        self.skip_space()
        while self.i < len(self.p):
            start = _RULE_START.match(self.p, self.i)
            if start is None:
                self.fail("expected a rule (name ::= ...)", "start each rule with its name and ::=")
            if start[1] in self.rules:
                self.fail(f"rule {start[1]!r} is defined twice", "merge its definitions with |")
            self.i = start.end()
            self.rules[start[1]] = self.alternation()
            if self.peek() == ")":
                self.fail("unbalanced parenthesis ')'", "remove it, or add the '(' it closes")
        if "root" not in self.rules:
            raise InvalidRequestError("invalid grammar: it has no rule named root; name its start rule root")
        for name, at in self.calls:
            if name not in self.rules:
                self.fail(f"rule {name!r} is used but not defined", f"define it ({name} ::= ...) or fix the name",
                          at)
        return self.rules

    def sequence(self) -> Node:
        items = []
        self.skip_space()
        while self.peek() not in ("", "|", ")") and not _RULE_START.match(self.p, self.i):
            atom = self.atom()
            self.skip_space()
            counts = self.counts()
            if counts is not None:
                at = self.i
                self.skip_space()
                if self.counts() is not None:
                    self.fail("multiple repeat", "wrap the repeated part in ( ) before repeating it again", at)
                atom = ("rep", atom, *counts)
            items.append(atom)
        return items[0] if len(items) == 1 else ("cat", items)

    def atom(self) -> Node:
        c, start = self.p[self.i], self.i
        if c in "*+?{" and self.counts() is not None:
            self.fail("nothing to repeat", "put the quantifier after a literal, class, rule or group", start)
        self.i += 1
        if c == "(":
            node = self.alternation()
            if self.peek() != ")":
                self.fail("missing ), unterminated group", "close the group with ')'", start)
            self.i += 1
            return node
        if c == "[":
            return ("set", self.char_class(start))
        if c == ".":
            return ("set", ANY_CHAR)
        if c == '"':
            return self.literal(start)
        if name := _NAME.match(self.p, start):
            self.i = name.end()
            self.calls.append((name[0], start))
            return ("ref", name[0])
        self.fail(f"unexpected {c!r}", "write text in double quotes, classes in [ ], rules by their names", start)

    def literal(self, start: int) -> Node:
        chars = []
        while (c := self.peek()) != '"':
            if not c:
                self.fail("unterminated string literal", 'close it with " (a quote inside it is \\")', start)
            self.i += 1
            code = self.escape(in_class=False) if c == "\\" else ord(c)
            if not isinstance(code, int):
                self.fail("a class escape (\\d, \\w, \\s, ...) inside a string literal", "write it as a class: [0-9]",
                          self.i - 2)
            chars.append(("set", [(code, code)]))
        self.i += 1
        return ("cat", chars)


class _RuleRegexParser(_Parser):
    """A regex of plugins/regex_fsm.py's dialect in which ``(?&name)`` calls the rule ``name`` (the `regex`
    module's spelling of a recursive call): what plugins/json_schema_regex.py writes for a recursive schema."""

    def group(self, start: int) -> Node:
        if not self.p.startswith("?&", self.i):
            return super().group(start)
        end = self.p.find(")", self.i)
        name, self.i = self.p[self.i + 2:end], end + 1
        return ("ref", name)


class PushdownAutomaton(CharAutomaton):
    """A grammar's automaton; a state is an interned configuration (a frozenset of stacks of the rules' DFA
    states). Use ``compile`` or ``of_regex_rules``."""

    def __init__(self, rules: dict[str, Node]) -> None:
        self._eps: list[list[int]] = []
        self._edges: list[list[tuple[list[tuple[int, int]], int]]] = []
        self._calls: list[list[tuple[int, int]]] = []  # per NFA state: (called rule's start state, return state)
        self.start_of: dict[str, int] = {}
        end_of: dict[str, int] = {}
        for name in rules:
            self.start_of[name] = self._new()
        owner = list(rules)  # the rule each NFA state belongs to: the starts first
        for name, body in rules.items():
            end_of[name] = self._emit(body, self.start_of[name])
            owner += [name] * (len(self._eps) - len(owner))
        self._ends = frozenset(end_of.values())
        self._check_and_trim(rules, owner, end_of)
        root_start = self._determinize(end_of)
        self._sets: list[frozenset[Stack]] = []  # type: ignore[assignment]
        self._ids: dict[frozenset[Stack], int] = {}  # type: ignore[assignment]
        self._trans: list[dict[int, int]] = []
        self._accepts: list[bool] = []
        self._unions: list[list[tuple[int, int]]] = []
        self.work = 0
        self.cut = False  # whether a continuation was cut for taking more than MAX_STACKS stacks
        self.start = self._intern_stacks([(root_start,)])

    @classmethod
    def compile(cls, text: str, max_states: int = MAX_GRAMMAR_STATES) -> PushdownAutomaton:  # type: ignore[override]
        """Parses GBNF ``text``; InvalidRequestError (message "invalid grammar: ...") when it is not in the
        dialect, is too large or is refused (see the module's docstring)."""
        if not isinstance(text, str):
            raise InvalidRequestError(f"invalid grammar: it must be a string, not {type(text).__name__}")
        try:
            rules = _GrammarParser(text).parse_rules()
        except RecursionError:
            raise InvalidRequestError("invalid grammar: its groups nest too deeply; flatten it") from None
        if (size := sum(1 + _size(body) for body in rules.values())) > max_states:
            raise InvalidRequestError(f"invalid grammar: it is too large ({size} states); simplify it or lower its "
                                      "repetition counts")
        return cls(rules)

    @classmethod
    def of_regex_rules(cls, rules: dict[str, str], max_states: int = MAX_GRAMMAR_STATES) -> PushdownAutomaton:
        """The automaton of rules written as regexes with ``(?&name)`` calls (every name defined, ``root`` the
        start); refused as ``compile`` refuses a grammar."""
        try:
            nodes = {name: _RuleRegexParser(text).parse() for name, text in rules.items()}
        except RecursionError:
            raise InvalidRequestError("invalid grammar: its groups nest too deeply; flatten them") from None
        if (size := sum(1 + _size(body) for body in nodes.values())) > max_states:
            raise InvalidRequestError(f"invalid grammar: it is too large ({size} states); simplify it")
        return cls(nodes)

    def _new(self) -> int:
        self._calls.append([])
        return super()._new()

    def _emit(self, node: Node, src: int) -> int:
        if node[0] != "ref":
            return super()._emit(node, src)
        dst = self._new()
        self._calls[src].append((node[1], dst))  # the rule's name for now: _check_and_trim makes it its start
        return dst

    def _completing(self, rules: dict[str, Node], end_of: dict[str, int], read: bool) -> tuple[set[str], list[bool]]:
        """The rules that can be completed (reading characters when ``read``, else none), and the NFA states reached
        from the rules' starts on the way (each rule's part of the NFA is its own, so one search serves all)."""
        done: set[str] = set()
        seen = [False] * len(self._eps)
        blocked: dict[str, list[int]] = defaultdict(list)  # rule -> return states that wait for it to complete
        ended = {end: name for name, end in end_of.items()}
        stack = [self.start_of[name] for name in rules]
        for s in stack:
            seen[s] = True
        while stack:
            s = stack.pop()
            targets = self._eps[s] + ([t for _, t in self._edges[s]] if read else [])
            if (name := ended.get(s)) is not None and name not in done:
                done.add(name)
                targets += blocked.pop(name, [])
            for rule, back in self._calls[s]:
                (targets if rule in done else blocked[rule]).append(back)
            for t in targets:
                if not seen[t]:
                    seen[t] = True
                    stack.append(t)
        return done, seen

    def _check_and_trim(self, rules: dict[str, Node], owner: list[str], end_of: dict[str, int]) -> None:
        calls_of: dict[str, set[str]] = defaultdict(set)
        for s, calls in enumerate(self._calls):
            calls_of[owner[s]].update(rule for rule, _ in calls)
        used, todo = {"root"}, ["root"]  # the rules reachable from root
        while todo:
            for rule in calls_of[todo.pop()] - used:
                used.add(rule)
                todo.append(rule)
        productive, _ = self._completing(rules, end_of, read=True)
        if stuck := sorted(used - productive):
            raise InvalidRequestError(f"invalid grammar: rule {stuck[0]!r} can never be completed (each way "
                                      "through it needs itself, or another such rule, again); give it an "
                                      "alternative that ends")
        _, before_any_char = self._completing(rules, end_of, read=False)
        first_calls: dict[str, set[str]] = defaultdict(set)  # rule -> rules it calls before reading a character
        for s, reached in enumerate(before_any_char):
            if reached:
                first_calls[owner[s]].update(rule for rule, _ in self._calls[s])
        if cycle := _cycle(first_calls, sorted(used)):
            raise InvalidRequestError(f"invalid grammar: rule {cycle[0]!r} is left-recursive ({' -> '.join(cycle)} "
                                      "before any character is read); rewrite it with repetition, as in "
                                      'list ::= item ("," item)*')
        # keep only states that can still complete their rule: backwards from each rule's end
        back: list[list[int]] = [[] for _ in self._eps]
        for s in range(len(self._eps)):
            for t in self._eps[s] + [t for _, t in self._edges[s]]:
                back[t].append(s)
            for rule, ret in self._calls[s]:
                if rule in productive:
                    back[ret].append(s)
        live = [False] * len(self._eps)
        todo_states = list(self._ends)
        for s in todo_states:
            live[s] = True
        while todo_states:
            for s in back[todo_states.pop()]:
                if not live[s]:
                    live[s] = True
                    todo_states.append(s)
        self._eps = [[t for t in out if live[t]] for out in self._eps]
        self._edges = [[(r, t) for r, t in out if live[t]] for out in self._edges]
        self._calls = [[(self.start_of[rule], t) for rule, t in out if live[t] and rule in productive]
                       for out in self._calls]

    def _determinize(self, end_of: dict[str, int]) -> int:
        """Replaces each rule's NFA by a DFA over characters and calls (subset construction), so that alternatives
        that begin alike (``e ::= t "+" e | t``) share one state, and one stack, instead of one each: without it
        such a grammar's stacks multiply at every level it nests. Returns root's start; ``_final[s]``: whether the
        rule of DFA state ``s`` may end there."""
        ids: dict[frozenset[int], int] = {}
        sets: list[frozenset[int]] = []

        def state_of(nfa_states: set[int]) -> int:
            closed, todo = set(nfa_states), list(nfa_states)
            while todo:
                for t in self._eps[todo.pop()]:
                    if t not in closed:
                        closed.add(t)
                        todo.append(t)
            key = frozenset(closed)
            if key not in ids:
                if len(sets) >= MAX_GRAMMAR_STATES:
                    raise InvalidRequestError(f"invalid grammar: its rules' automata grow past {MAX_GRAMMAR_STATES} "
                                              "states; simplify it")
                ids[key] = len(sets)
                sets.append(key)
            return ids[key]

        starts = {nfa: state_of({nfa}) for nfa in self.start_of.values()}
        edges: list[list[tuple[list[tuple[int, int]], int]]] = []
        calls: list[list[tuple[int, int]]] = []
        while len(edges) < len(sets):
            nfa_states = sets[len(edges)]
            out = [(ranges, t) for s in nfa_states for ranges, t in self._edges[s]]
            points = sorted({p for ranges, _ in out for lo, hi in ranges for p in (lo, hi + 1)})
            by_targets: dict[frozenset[int], list[tuple[int, int]]] = {}
            for lo, nxt in zip(points, points[1:]):
                if targets := frozenset(t for ranges, t in out if _hits(ranges, lo, lo)):
                    by_targets.setdefault(targets, []).append((lo, nxt - 1))
            edges.append([(_normalize(ranges), state_of(set(targets))) for targets, ranges in by_targets.items()])
            returns: dict[int, set[int]] = {}
            for s in nfa_states:
                for start, back in self._calls[s]:
                    returns.setdefault(start, set()).add(back)
            calls.append([(starts[start], state_of(backs)) for start, backs in returns.items()])
        self._eps, self._edges, self._calls = [[] for _ in sets], edges, calls
        self._final = [bool(nfa_states & self._ends) for nfa_states in sets]
        return starts[self.start_of["root"]]

    def _close(self, stacks: list[Stack]) -> frozenset[Stack]:
        """``stacks`` and every stack reached from them without reading (the rules' DFAs have no epsilon edges):
        calls and returns; then those that read a character next, or accept."""
        seen, todo = set(stacks), list(stacks)
        while todo:
            stack = todo.pop()
            state, below = stack[-1], stack[:-1]
            moves = [below + (back, start) for start, back in self._calls[state]]
            if below and self._final[state]:
                moves.append(below)  # the rule called last is complete: go on from its return state
            for move in moves:
                if move not in seen:
                    seen.add(move)
                    todo.append(move)
            if len(seen) > MAX_STACKS:  # cut: the outputs stay prefixes of sentences, but cannot go this way
                if not self.cut:
                    log.warning("structured output: a grammar is too ambiguous to follow everywhere (a character "
                                "would take more than %d parser stacks at once), so outputs cannot continue that "
                                "way; merge rules that match the same text where they are called from one place",
                                MAX_STACKS)
                self.cut = True
                return frozenset()
        self.work += len(seen)
        return frozenset(s for s in seen if self._edges[s[-1]] or len(s) == 1 and self._final[s[0]])

    def _intern_stacks(self, stacks: list[Stack]) -> int:
        key = self._close(stacks)
        if not key:
            return DEAD
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self._sets)
            self._sets.append(key)
            self._trans.append({})
            self._accepts.append(any(len(stack) == 1 and self._final[stack[0]] for stack in key))
            self._unions.append(_normalize([r for s in key for ranges, _ in self._edges[s[-1]] for r in ranges]))
        return sid

    def _after(self, state: int, char: int) -> int:
        """The configuration after code point ``char`` (DEAD when the stacks that read it are cut)."""
        return self._intern_stacks([stack[:-1] + (t,) for stack in self._sets[state]
                                    for ranges, t in self._edges[stack[-1]] if _hits(ranges, char, char)])

    def only_char(self, state: int) -> int | None:
        """The code point that alone can come next from ``state``, if one alone can."""
        union = self._unions[state] if state >= 0 else []
        return union[0][0] if len(union) == 1 and union[0][0] == union[0][1] else None

    def determinize(self, max_states: int, max_work: int, max_cells: int) -> tuple[list[int], list[list[int]]]:
        raise NotImplementedError("a grammar's configurations are unbounded: its masks walk the vocabulary")


def _cycle(edges: dict[str, set[str]], nodes: list[str]) -> list[str] | None:
    """A cycle of ``edges`` through some of ``nodes`` (its first node repeated at its end), or None."""
    done: set[str] = set()
    for first in nodes:
        if first in done:
            continue
        path, branches = [first], [iter(sorted(edges.get(first, ())))]
        while path:
            nxt = next(branches[-1], None)
            if nxt is None:
                done.add(path.pop())
                branches.pop()
            elif nxt in path:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in done:
                path.append(nxt)
                branches.append(iter(sorted(edges.get(nxt, ()))))
    return None
