"""The regular-expression automaton under structured output: a pattern becomes a Thompson NFA, trimmed to the
states that can still reach acceptance, and then a DFA over Unicode code points built lazily (subset construction
on demand), so that guided decoding can walk a byte trie of the vocabulary through it.

The dialect is a subset of Python's ``re``, matched whole (like ``re.fullmatch``): literals, ``.`` (anything but
``\\n``), the escapes ``\\d \\D \\w \\W \\s \\S`` with ASCII meanings (``\\d`` = ``[0-9]``, ``\\w`` =
``[A-Za-z0-9_]``, ``\\s`` = ``[ \\t\\n\\r\\f\\v]``, as ``re.ASCII`` has them), ``\\n \\t \\r \\f \\v \\a``, ``\\0``
(with up to two more octal digits), ``\\xHH``, ``\\uHHHH``, ``\\UHHHHHHHH``, an escaped character that is not an
ASCII letter or digit standing for itself, character classes, groups ``( )``, ``(?: )``, ``(?P<name> )``,
alternation, and the quantifiers ``* + ? {m} {m,} {m,n} {,n}`` (lazy ones too: they denote the same language).
``^`` as the first character and ``$`` as the last are accepted and ignored. Everything else (backreferences,
lookarounds, inline flags, atomic groups, possessive quantifiers, ``\\b \\B \\A \\Z \\z``) is refused with an
InvalidRequestError. Surrogate code points never occur in text: no class, ``.`` or complement contains them.
"""
from __future__ import annotations

import re
from bisect import bisect_right
from typing import Any, NoReturn

from ..core.errors import InvalidRequestError

DEAD: int = -1
MAX_CHAR = 0x10FFFF
MAX_REPEAT = 1000
Ranges = list[tuple[int, int]]  # sorted, disjoint, non-adjacent inclusive code point ranges
Node = tuple[Any, ...]  # ("set", Ranges) | ("cat", [Node]) | ("alt", [Node]) | ("rep", Node, min, max or None)
#                         | ("ref", rule name): a grammar's rule call (plugins/grammar_pda.py)


def _normalize(ranges: Ranges) -> Ranges:
    """Sorts and merges ``ranges`` and cuts the surrogates out of them."""
    merged: Ranges = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    out: Ranges = []
    for lo, hi in merged:
        if lo < 0xD800:
            out.append((lo, min(hi, 0xD7FF)))
        if hi > 0xDFFF:
            out.append((max(lo, 0xE000), hi))
    return out


def _negate(ranges: Ranges) -> Ranges:
    """The complement of normalized ``ranges`` over all code points but the surrogates."""
    out, nxt = [], 0
    for lo, hi in ranges:
        if lo > nxt:
            out.append((nxt, lo - 1))
        nxt = hi + 1
    if nxt <= MAX_CHAR:
        out.append((nxt, MAX_CHAR))
    return _normalize(out)


def _hits(ranges: Ranges, lo: int, hi: int) -> bool:
    """Whether normalized ``ranges`` hold some code point of [lo, hi]."""
    i = bisect_right(ranges, (hi, MAX_CHAR + 1)) - 1
    return i >= 0 and ranges[i][1] >= lo


_DIGIT, _WORD, _SPACE = [(48, 57)], _normalize([(48, 57), (65, 90), (95, 95), (97, 122)]), [(9, 13), (32, 32)]
_CLASSES = {"d": _DIGIT, "w": _WORD, "s": _SPACE, "D": _negate(_DIGIT), "W": _negate(_WORD), "S": _negate(_SPACE)}
_DOT = _negate([(10, 10)])
_CHARS = {"n": 10, "t": 9, "r": 13, "f": 12, "v": 11, "a": 7}
_HEX_DIGITS = {"x": 2, "u": 4, "U": 8}
_COUNTS = re.compile(r"\{([0-9]*)(,?)([0-9]*)\}")
_GROUPS = {"?P=": "backreferences", "?=": "lookahead assertions", "?!": "lookahead assertions",
           "?<=": "lookbehind assertions", "?<!": "lookbehind assertions", "?>": "atomic groups",
           "?#": "comments", "?(": "conditional groups", "?<": "(?<name>...) groups (write (?P<name>...))"}


class _Parser:
    """Recursive descent from the pattern to a syntax tree of ``Node`` tuples."""

    def __init__(self, pattern: str) -> None:
        self.p, self.i, self.names = pattern, 0, set[str]()

    def _past_surrogate(self, code: int, start: int) -> int:
        """A \\u escape of a high surrogate joined with the low one escaped right after it (JSON's and JavaScript's
        spelling of a character past U+FFFF); a lone surrogate, which no UTF-8 text holds, is refused."""
        if not 0xD800 <= code <= 0xDFFF:
            return code
        low = self.p[self.i + 2:self.i + 6]
        if code <= 0xDBFF and self.p.startswith("\\u", self.i) and len(low) == 4 and all(
                d in "0123456789abcdefABCDEF" for d in low) and 0xDC00 <= int(low, 16) <= 0xDFFF:
            self.i += 6
            return 0x10000 + ((code - 0xD800) << 10) + (int(low, 16) - 0xDC00)
        self.fail(f"the lone surrogate \\u{code:04X} is no character (no UTF-8 text holds one)",
                  "write the character itself, or a high and a low surrogate escaped one after the other", start)

    def fail(self, what: str, fix: str, pos: int | None = None) -> NoReturn:
        raise InvalidRequestError(f"invalid regex: {what} at position {self.i if pos is None else pos}; {fix}")

    def peek(self, ahead: int = 0) -> str:
        return self.p[self.i + ahead] if self.i + ahead < len(self.p) else ""

    def parse(self) -> Node:
        if (lone := next((i for i, ch in enumerate(self.p) if 0xD800 <= ord(ch) <= 0xDFFF), None)) is not None:
            self.fail(f"the lone surrogate U+{ord(self.p[lone]):04X} is no character (no UTF-8 text holds one)",
                      "write the character itself", lone)
        self.i = 1 if self.p.startswith("^") else 0
        node = self.alternation()
        if self.i < len(self.p):
            self.fail("unbalanced parenthesis ')'", "remove it, escape it as \\), or add the '(' it closes")
        return node

    def alternation(self) -> Node:
        branches = [self.sequence()]
        while self.peek() == "|":
            self.i += 1
            branches.append(self.sequence())
        return branches[0] if len(branches) == 1 else ("alt", branches)

    def sequence(self) -> Node:
        items = []
        while self.peek() not in ("", "|", ")"):
            atom = self.atom()
            counts = self.counts()
            if counts is not None:
                if self.peek() == "?":
                    self.i += 1
                elif self.peek() == "+":
                    self.fail("possessive quantifiers are not supported", "remove the '+' after the quantifier")
                at = self.i
                if self.counts() is not None:
                    self.fail("multiple repeat", "wrap the repeated part in (?:...) before repeating it again", at)
                atom = ("rep", atom, *counts)
            items.append(atom)
        return items[0] if len(items) == 1 else ("cat", items)

    def counts(self) -> tuple[int, int | None] | None:
        """Reads a quantifier at the cursor: its (min, max or None); None, reading nothing, when there is none."""
        c = self.peek()
        if c and c in "*+?":
            self.i += 1
            return int(c == "+"), (1 if c == "?" else None)
        m = _COUNTS.match(self.p, self.i)
        if m is None or not (m[1] or m[2]):
            return None
        lo, hi = int(m[1] or 0), (int(m[3]) if m[3] else None) if m[2] else int(m[1])
        if max(lo, hi or 0) > MAX_REPEAT:
            self.fail(f"repetition count {max(lo, hi or 0)} exceeds the limit of {MAX_REPEAT}", "use a smaller count, "
                      "or * or +")
        if hi is not None and lo > hi:
            self.fail(f"the repetition {{{lo},{hi}}} has its minimum above its maximum", "put the smaller count first")
        self.i = m.end()
        return lo, hi

    def atom(self) -> Node:
        c, start = self.p[self.i], self.i
        if c in "*+?{" and self.counts() is not None:
            self.fail("nothing to repeat", "put the quantifier after a character or group, or escape it", start)
        self.i += 1
        if c == "(":
            return self.group(start)
        if c == "[":
            return ("set", self.char_class(start))
        if c == ".":
            return ("set", _DOT)
        if c == "$" and self.i == len(self.p):
            return ("cat", [])
        if c in "^$":
            where = "first" if c == "^" else "last"
            self.fail(f"'{c}' is only supported as the pattern's {where} character", f"escape it as \\{c}", start)
        item = self.escape(in_class=False) if c == "\\" else ord(c)
        return ("set", _normalize([(item, item)]) if isinstance(item, int) else item)

    def group(self, start: int) -> Node:
        if self.p.startswith("?:", self.i):
            self.i += 2
        elif self.p.startswith("?P<", self.i):
            end = self.p.find(">", self.i)
            name = self.p[self.i + 3:end] if end > 0 else ""
            if not name.isidentifier():
                self.fail(f"bad group name {name!r}", "name the group with a Python identifier and close it with >")
            if name in self.names:
                self.fail(f"redefinition of group name {name!r}", "give each group its own name")
            self.names.add(name)
            self.i = end + 1
        elif self.peek() == "?":
            kind = next((v for k, v in _GROUPS.items() if self.p.startswith(k, self.i)), "inline flags")
            self.fail(f"{kind} are not supported", "rewrite the pattern without them", start)
        node = self.alternation()
        if self.peek() != ")":
            self.fail("missing ), unterminated group", "close the group with ')' or escape the '(' as \\(", start)
        self.i += 1
        return node

    def escape(self, in_class: bool) -> int | Ranges:
        """Reads the escape after a backslash: a code point, or the Ranges of a class escape such as \\d."""
        start = self.i - 1
        c = self.peek()
        if not c:
            self.fail("the pattern ends in a lone backslash", "escape it as \\\\", start)
        self.i += 1
        if c in _CLASSES:
            return _CLASSES[c]
        if c in _CHARS:
            return _CHARS[c]
        if c == "b" and in_class:
            return 8
        if c in _HEX_DIGITS:
            digits = self.p[self.i:self.i + _HEX_DIGITS[c]]
            if len(digits) < _HEX_DIGITS[c] or any(d not in "0123456789abcdefABCDEF" for d in digits):
                self.fail(f"incomplete escape \\{c}{digits}", f"write \\{c} with {_HEX_DIGITS[c]} hex digits", start)
            if int(digits, 16) > MAX_CHAR:
                self.fail(f"escape \\{c}{digits} is beyond U+10FFFF", "use a valid code point", start)
            self.i += len(digits)
            return self._past_surrogate(int(digits, 16), start)
        if c == "0":
            while self.i - start < 4 and self.peek() in tuple("01234567"):
                self.i += 1
            return int(self.p[start + 1:self.i], 8)
        octal = self.p[self.i - 1:self.i + 2]  # \101 is Python's "A": three octal digits
        if c in "123456789" and (in_class or len(octal) == 3 and all(d in "01234567" for d in octal)):
            self.fail(f"octal escapes (\\{octal if len(octal) == 3 else c}) are not supported",
                      "write the character as \\xHH instead", start)
        if c in "123456789":
            self.fail(f"backreferences (\\{c}) are not supported", "repeat the group's pattern instead", start)
        if c in "bBAZz" and not in_class:
            self.fail(f"the assertion \\{c} is not supported", "remove it (the whole text must match anyway)", start)
        if c.isascii() and c.isalnum():
            self.fail(f"bad escape \\{c}", "remove the backslash or escape a punctuation character", start)
        return ord(c)

    def char_class(self, start: int) -> Ranges:
        negate = self.peek() == "^"
        self.i += negate
        ranges: Ranges = []
        first = True
        while True:
            c = self.peek()
            if not c:
                self.fail("unterminated character set", "close it with ']' (a literal ']' goes first or as \\])", start)
            if c == "]" and not first:
                self.i += 1
                break
            first, at = False, self.i
            lo = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("", "]"):
                self.i += 1
                hi = self.class_item()
                if not isinstance(lo, int) or not isinstance(hi, int) or lo > hi:
                    self.fail(f"bad character range {self.p[at:self.i]}", "write a range as low-high", at)
                ranges.append((lo, hi))
            else:
                ranges.extend([(lo, lo)] if isinstance(lo, int) else lo)
        return _negate(_normalize(ranges)) if negate else _normalize(ranges)

    def class_item(self) -> int | Ranges:
        self.i += 1
        return self.escape(in_class=True) if self.p[self.i - 1] == "\\" else ord(self.p[self.i - 1])


def _size(node: Node) -> int:
    """The number of NFA states ``CharAutomaton._emit`` makes for ``node`` (a grammar's rule call, one)."""
    if node[0] in ("set", "ref"):
        return 1
    if node[0] in ("cat", "alt"):
        return sum(map(_size, node[1])) + (node[0] == "alt")
    body, lo, hi = _size(node[1]), node[2], node[3]
    return lo * body + 1 + (body if hi is None else (hi - lo) * body)


class CharAutomaton:
    """A DFA over Unicode code points, built lazily (subset construction on demand) from a trimmed Thompson NFA of
    a regex. Whole-match semantics: a string is accepted iff the pattern matches all of it (like re.fullmatch).
    Every state but DEAD can still reach acceptance. A DFA state is the frozenset of the NFA states it stands for
    (only those with a character edge, and the accepting one), interned to an int id."""

    def __init__(self, tree: Node) -> None:
        """The automaton of a parsed, size-checked pattern: use ``compile``."""
        self._eps: list[list[int]] = []  # per NFA state: epsilon targets, and below, (Ranges, target) edges
        self._edges: list[list[tuple[Ranges, int]]] = []
        start = self._new()
        self._accept = accept = self._emit(tree, start)
        live, stack, back = [False] * len(self._eps), [accept], [list[int]() for _ in self._eps]
        live[accept] = True
        for s, (eps, edges) in enumerate(zip(self._eps, self._edges)):
            for t in eps + [t for _, t in edges]:
                back[t].append(s)
        while stack:
            for s in back[stack.pop()]:
                if not live[s]:
                    live[s] = True
                    stack.append(s)
        if not live[start]:
            raise InvalidRequestError("invalid regex: the pattern matches no text; remove the character class that "
                                      "excludes every character (such as [^\\s\\S])")
        self._eps = [[t for t in out if live[t]] for out in self._eps]
        self._edges = [[(r, t) for r, t in out if live[t]] for out in self._edges]
        self._sets: list[frozenset[int]] = []
        self._ids: dict[frozenset[int], int] = {}
        self._trans: list[dict[int, int]] = []
        self._accepts: list[bool] = []
        self._unions: list[Ranges] = []
        self.work = 0  # NFA states visited while building DFA states: what determinize() bounds
        self.start: int = self._intern([start])

    @classmethod
    def compile(cls, pattern: str, max_nfa_states: int = 100_000) -> CharAutomaton:
        """Parses ``pattern``; InvalidRequestError (message "invalid regex: ...") when it is not in the dialect, its
        NFA would exceed ``max_nfa_states``, or it matches no text."""
        if not isinstance(pattern, str):
            raise InvalidRequestError(f"invalid regex: the pattern must be a string, not {type(pattern).__name__}")
        try:
            tree = _Parser(pattern).parse()
            if (size := 1 + _size(tree)) > max_nfa_states:
                raise InvalidRequestError(f"invalid regex: the pattern is too large ({size} states); simplify it or "
                                          "lower its repetition counts")
            return cls(tree)
        except RecursionError:
            raise InvalidRequestError("invalid regex: the groups nest too deeply; flatten the pattern") from None

    def _new(self) -> int:
        self._eps.append([])
        self._edges.append([])
        return len(self._eps) - 1

    def _emit(self, node: Node, src: int) -> int:
        """Thompson construction: adds ``node`` after NFA state ``src``; returns the state it ends in. It never adds
        an edge into ``src``, so fragments (the branches of an alternation) can share their entry state."""
        if node[0] == "set":
            dst = self._new()
            if node[1]:
                self._edges[src].append((node[1], dst))
            return dst
        if node[0] == "cat":
            for item in node[1]:
                src = self._emit(item, src)
            return src
        if node[0] == "alt":
            dst = self._new()
            for branch in node[1]:
                self._eps[self._emit(branch, src)].append(dst)
            return dst
        _, body, lo, hi = node
        for _ in range(lo):
            src = self._emit(body, src)
        end = self._new()
        self._eps[src].append(end)
        if hi is None:
            self._eps[self._emit(body, end)].append(end)
        for _ in range(hi - lo if hi is not None else 0):
            src = self._emit(body, src)
            self._eps[src].append(end)
        return end

    def _intern(self, targets: list[int]) -> int:
        seen, stack = set(targets), list(targets)
        self.work += len(targets)
        while stack:
            self.work += 1
            for t in self._eps[stack.pop()]:
                if t not in seen:
                    seen.add(t)
                    stack.append(t)
        key = frozenset(s for s in seen if self._edges[s] or s == self._accept)
        sid = self._ids.get(key)
        if sid is None:
            sid = self._ids[key] = len(self._sets)
            self._sets.append(key)
            self._trans.append({})
            self._accepts.append(self._accept in key)
            self._unions.append(_normalize([r for s in key for ranges, _ in self._edges[s] for r in ranges]))
        return sid

    def step(self, state: int, char: int) -> int:
        """The state after code point ``char``; DEAD when no match can follow."""
        if state < 0:
            return DEAD
        row = self._trans[state]
        nxt = row.get(char)
        if nxt is None:
            nxt = row[char] = self._after(state, char) if _hits(self._unions[state], char, char) else DEAD
        return nxt

    def _after(self, state: int, char: int) -> int:
        """The state that ``state``'s edges for ``char`` reach (some edge of it holds ``char``)."""
        return self._intern([t for s in self._sets[state] for r, t in self._edges[s] if _hits(r, char, char)])

    def classes(self) -> list[int]:
        """The alphabet's partition: code points ``c`` and ``d`` with the same ``bisect_right(bounds, c)`` step
        every state alike (no range of the pattern starts or ends between them). ``bounds[0] == 0``."""
        points = {0} | {p for out in self._edges for ranges, _ in out for lo, hi in ranges for p in (lo, hi + 1)}
        return sorted(p for p in points if p <= MAX_CHAR)

    def determinize(self, max_states: int, max_work: int, max_cells: int) -> tuple[list[int], list[list[int]]]:
        """Every DFA state, built now: (the partition's bounds, ``table[state][k]``: the state after any code point
        of class k, DEAD included). InvalidRequestError when it takes more than ``max_states`` states, ``max_work``
        NFA visits or ``max_cells`` table cells (states x classes, checked before each row: each distinct character
        of the pattern adds classes, so a long literal of distinct characters is quadratic): such a pattern would
        stall the engine while it generates."""
        bounds = self.classes()
        table: list[list[int]] = []
        while len(table) < len(self._sets):
            state = len(table)
            if (state + 1) * len(bounds) > max_cells:
                raise InvalidRequestError(
                    f"invalid regex: its automaton's table grows past {max_cells} cells ({state + 1} states x "
                    f"{len(bounds)} character classes so far); simplify it: every distinct character or range adds "
                    "a class, and every state a row (a long literal or class of many distinct characters, repeated)")
            table.append([self.step(state, point) for point in bounds])
            if len(self._sets) > max_states or self.work > max_work:
                raise InvalidRequestError(
                    f"invalid regex: its automaton grows past {max_states} states (or {max_work} steps to build); "
                    "simplify it: nested or long bounded repetitions of wide classes (.{0,1000}, [^x]{1,500}) "
                    "multiply states")
        return bounds, table

    def accepting(self, state: int) -> bool:
        """Whether the text read so far is a whole match."""
        return state >= 0 and self._accepts[state]

    def can_step_within(self, state: int, lo: int, hi: int) -> bool:
        """Whether some code point in [lo, hi] leads from ``state`` to a state other than DEAD."""
        return state >= 0 and lo <= hi and _hits(self._unions[state], lo, hi)

    def fullmatch(self, text: str) -> bool:
        """Whether the pattern matches all of ``text``."""
        state = self.start
        for ch in text:
            state = self.step(state, ord(ch))
            if state < 0:
                return False
        return self.accepting(state)

    def num_states(self) -> int:
        """The DFA states built so far."""
        return len(self._sets)
