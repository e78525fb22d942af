"""JSON Schema to regular expression, for guided decoding: ``schema_to_regex(schema)`` returns a regex whose whole
matches are JSON texts valid under the schema. It keeps to the automaton's dialect (literals, escaped punctuation,
``\\xHH``, ``\\uHHHH``, classes, ``(?:...)``, ``|``, quantifiers with counts up to 1000; no ``\\d``), which Python's
``re`` reads the same way. ``schema_to_rules(schema)`` returns such regexes as the rules of a grammar instead, which
call each other with ``(?&name)``: a recursive ``$ref`` and an open value are then rules of their own, followed at
any depth by plugins/grammar_pda.py.

The texts are a subset of the valid ones, in one shape:

- compact: exactly one optional space may follow each ``,`` and each ``:``; no other whitespace anywhere;
- object properties come in ``properties`` order, each key as its JSON string literal; optional ones may be left
  out; next to ``properties`` no other member is generated (whatever ``additionalProperties`` says); an object
  without ``properties`` holds any members whose values satisfy ``additionalProperties`` (any JSON value when it
  is absent or true, none when false);
- a value the schema leaves open (``true``, ``{}`` or annotations alone, the members of an object without
  ``properties``, the items of an array without ``items``) is any JSON value: with ``schema_to_rules``, nested to
  any depth (a rule of its own); in a regex, whose objects and arrays nest at most ``ANY_DEPTH`` (4) deep, counting
  an open object or array itself. "json object mode" is ``{"type": "object"}``;
- ``enum`` and ``const`` values are their compact JSON, without even the optional spaces, non-ASCII left raw;
- a string is raw characters and the escapes ``\\" \\\\ \\/ \\b \\f \\n \\r \\t \\uXXXX``, never a surrogate pair
  (characters past U+FFFF come raw), so each unit is one character for ``minLength`` and ``maxLength``;
- a ``pattern`` must match the whole string (a leading ``^`` and a trailing ``$`` are dropped; an unanchored
  pattern thus yields some of its matching strings), holds no escapes nor ``"``, ``\\`` or control characters, and
  reads ``\\d`` and ``\\w`` as ASCII;
- ``format`` date, time, date-time (RFC 3339: ``T``, ``Z``, offset required) and uuid check the shape, not the
  calendar (2023-02-31 passes);
- integers are ``-?(0|[1-9][0-9]*)``, numbers add an optional fraction and exponent; ``oneOf`` is read as
  ``anyOf`` where no value can match two branches (json_schema_unions.py), and refused elsewhere;
- ``minimum``, ``maximum``, ``exclusiveMinimum`` and ``exclusiveMaximum`` are enforced digit by digit
  (plugins/number_regex.py): an integer's with no ``-0``; a number's, of any decimal value, with the number
  written without an exponent (but under a lone ``minimum`` 0, which keeps it).

Refused (InvalidRequestError naming the keyword and the JSON path): ``false``, and keywords without a ``type``;
``multipleOf``; ``minProperties``,
``maxProperties``, ``patternProperties``, ``propertyNames``, ``dependentRequired``; ``prefixItems``, ``contains``,
``uniqueItems: true``; ``allOf`` of several branches; keywords beside ``$ref``/``allOf``/``anyOf``/``oneOf``, and
beside ``enum``/``const`` except ``type``; ``pattern`` or ``format`` with another string keyword; refs other than
``#/$defs/...`` and ``#/definitions/...``, and recursive ones (``schema_to_rules`` follows those that recur inside an
object or array, as grammar rules); unknown keywords and formats; keyword values of the
wrong JSON type; numeric bounds no value satisfies, or of more than 20 digits before or after the point; counts over 1000; regexes over
200,000 characters. Annotations (``title``, ``description``, ...)
are ignored.
"""
from __future__ import annotations

import functools
import json
import math
import re
import sys
from decimal import Decimal
from collections.abc import Callable
from typing import Any, NoReturn

from ..core.errors import InvalidRequestError
from .json_schema_unions import json_equal, overlapping_branches
from .number_regex import alternatives, integer_range, number_range

MAX_REGEX = 200_000
MAX_COUNT = 1000
ANY_DEPTH = 4  # objects and arrays nest at most this deep in an open value of a regex (it grows 4x a level)
ANY_RULE = "any_value"  # schema_to_rules' rule of an open value, nested to any depth (no ref's rule ends so)
ANY_CALL = f"(?&{ANY_RULE})"
_ANNOTATIONS = frozenset({"title", "description", "examples", "default", "$schema", "$id", "$comment", "deprecated",
                          "readOnly", "writeOnly", "$defs", "definitions", "discriminator"})
_TYPES = ("string", "integer", "number", "boolean", "null", "object", "array")
_HAS_TYPE: dict[str, Callable[[Any], bool]] = {
    "string": lambda v: isinstance(v, str), "integer": lambda v: type(v) is int or type(v) is float and v.is_integer(),
    "number": lambda v: type(v) in (int, float), "boolean": lambda v: isinstance(v, bool),
    "null": lambda v: v is None, "object": lambda v: isinstance(v, dict), "array": lambda v: isinstance(v, list)}
_UNIT = r'(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u(?:[0-9a-cA-CeEfF][0-9a-fA-F]{3}|[dD][0-7][0-9a-fA-F]{2}))'
_INT = "(?:0|[1-9][0-9]*)"
_FRACTION_EXPONENT = r"(?:\.[0-9]+)?(?:[eE][+\-]?[0-9]+)?"
_DATE = "[0-9]{4}-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12][0-9]|3[01])"
_TIME = r"(?:[01][0-9]|2[0-3]):[0-5][0-9]:(?:[0-5][0-9]|60)(?:\.[0-9]+)?(?:Z|[+\-](?:[01][0-9]|2[0-3]):[0-5][0-9])"
_FORMATS = {"date": _DATE, "time": _TIME, "date-time": f"{_DATE}T{_TIME}",
            "uuid": "-".join(f"[0-9a-fA-F]{{{n}}}" for n in (8, 4, 4, 4, 12))}
_SPECIAL = frozenset(".^$*+?{}[]\\|()")
_NOT_RAW = '"\\' + "".join(map(chr, range(0x20)))  # what a raw JSON string cannot hold
_RAW = r'[^"\\\x00-\x1f'  # a class of raw characters, to be continued and closed
_TOKEN = re.compile(r"\[\^?(?:\\.|[^\]\\])*\]|\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|.)|\(\?:?|\{[0-9]+(?:,[0-9]*)?\}|.",
                    re.S)
_SHORTHANDS = {"d": "0-9", "w": "0-9A-Za-z_"}
_PUNCTUATION = frozenset(".\\[]{}()|*+?\"/-^$")
MAX_BOUND_DIGITS = 20  # a bound's digits (int64 has 19): the automaton grows with their square
_TOO_LARGE = f"the schema is too large (its regex passes {MAX_REGEX} characters); use fewer optional properties, " \
             "enum values, levels or open values (each {} or object or array left open takes 40,000-80,000)"
_REFUSED = {"multipleOf": "it cannot be enforced; list the values in an 'enum' or drop it",
            **dict.fromkeys(("minProperties", "maxProperties"), "list the properties and mark them 'required'"),
            **dict.fromkeys(("patternProperties", "propertyNames"), "only 'properties' are generated; list them there"),
            "dependentRequired": "make those properties 'required' or leave them optional",
            "prefixItems": "give all elements one 'items' schema ('anyOf' for mixed ones)",
            "contains": "constrain every element through 'items'"}


_KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {key: (check, what) for keys, check, what in (
    ("minLength maxLength minItems maxItems minProperties maxProperties", lambda v: type(v) is int and v >= 0,
     "a non-negative integer"),
    ("minimum maximum exclusiveMinimum exclusiveMaximum multipleOf",
     lambda v: type(v) is int or type(v) is float and math.isfinite(v), "a number"),
    ("additionalProperties items propertyNames contains", lambda v: isinstance(v, (dict, bool)),
     "a schema (an object or a boolean)"),
    ("anyOf oneOf allOf enum prefixItems", lambda v: isinstance(v, list) and bool(v), "a non-empty array"),
    ("properties patternProperties dependentRequired", lambda v: isinstance(v, dict), "an object"),
    ("pattern format $ref", lambda v: isinstance(v, str), "a string"),
    ("required", lambda v: isinstance(v, list) and all(isinstance(n, str) for n in v), "an array of strings"),
    ("type", lambda v: bool(v) and all(isinstance(t, str) and t in _TYPES for t in (v if isinstance(v, list) else [v])),
     f"one of {', '.join(_TYPES)} or a non-empty array of them"),
    ("uniqueItems", lambda v: isinstance(v, bool), "a boolean"), ("const", lambda v: True, "")) for key in keys.split()}


def schema_to_regex(schema: dict[str, Any] | bool | str) -> str:
    """A regex (the dialect above) whose whole matches are exactly the JSON texts this module generates for
    ``schema``: each one valid under it. A str is parsed as JSON first. InvalidRequestError for whatever cannot be
    expressed, naming the keyword and its JSON path (a recursive ``$ref`` among them: see ``schema_to_rules``)."""
    return schema_to_rules(schema, recursion=False)["root"]


def schema_to_rules(schema: dict[str, Any] | bool | str, recursion: bool = True) -> dict[str, str]:
    """As ``schema_to_regex``, but a ``$ref`` that reaches itself again inside an object's properties or an array's
    items becomes a rule of its own: ``{"root": regex, name: regex, ...}``, where ``(?&name)`` in a regex calls
    rule ``name`` (the `regex` module's spelling), for plugins/grammar_pda.py. Without recursion, root alone. A ref
    that reaches itself through ``$ref``/``allOf``/``anyOf``/``oneOf`` alone (before any ``{`` or ``[``) matches
    no finite text and is refused."""
    try:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                _fail("", f"the text is not JSON ({exc}); send the schema as a JSON object")
            except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits())
                _fail("", f"an integer in it has more than {sys.get_int_max_str_digits()} digits; write it "
                          "shorter (no schema needs such a bound)")
        compiler = _Compiler(schema, recursion)
        return {"root": compiler.build(schema, ""), **compiler.rules}
    except RecursionError:
        _fail("", "the schema nests too deeply; flatten it")


def _fail(path: str, message: str) -> NoReturn:
    raise InvalidRequestError(f"invalid JSON schema: at {path or 'the root'}: {message}") from None


def _bound(value: float, key: str, path: str, fraction: bool) -> Decimal:
    """A numeric bound as the decimal the schema wrote (a float's shortest repr), if it has few enough digits
    (those of its ``fraction`` too: an integer's bound is rounded inward)."""
    bound = Decimal(repr(value)) if type(value) is float else Decimal(value)
    if abs(bound) >= 10 ** MAX_BOUND_DIGITS or fraction and -bound.normalize().as_tuple().exponent > MAX_BOUND_DIGITS:
        _fail(path, f"{key!r} {value} has too many digits to enforce (at most {MAX_BOUND_DIGITS} before or after "
                    "the point); use a shorter bound or drop it")
    return bound


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _SPECIAL else c for c in text)


def _dumps(value: Any, path: str) -> str:
    try:
        text = json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):
        _fail(path, f"{value!r} is not a JSON value; use only JSON values")
    if any(0xD800 <= ord(ch) <= 0xDFFF for ch in text):
        _fail(path, f"{value!r:.60} holds a lone surrogate, which no UTF-8 text holds, so it cannot be generated; "
                    "remove it")
    return text


def _repeat(atom: str, low: int, high: int | None) -> str:
    if high == 0:
        return ""
    quantifier = {(0, None): "*", (1, None): "+", (0, 1): "?", (1, 1): ""}.get((low, high))
    if quantifier is None:
        quantifier = f"{{{low}}}" if low == high else f"{{{low},{'' if high is None else high}}}"
    return atom + quantifier


def _bounds(schema: dict[str, Any], path: str, low_key: str, high_key: str) -> tuple[int, int | None]:
    low, high = schema.get(low_key, 0), schema.get(high_key)
    for key in (low_key, high_key):
        if schema.get(key, 0) > MAX_COUNT:
            _fail(path, f"{key!r} {schema[key]} passes {MAX_COUNT}, the automaton's largest count; lower it")
    if high is not None and low > high:
        _fail(path, f"{low_key!r} {low} exceeds {high_key!r} {high}; nothing satisfies both")
    return low, high


def _pattern_escape(char: str, path: str) -> str:
    if char in _SHORTHANDS:
        return _SHORTHANDS[char]
    if char not in _PUNCTUATION and char not in "xu":
        _fail(path, f"'pattern' escape \\{char} is not supported; use a class such as [0-9] or [ \\-] instead")
    return "\\" + char


def _pattern(pattern: str, path: str) -> str:
    """``pattern`` in the dialect, as a group that matches only characters needing no escape in JSON (or "")."""
    pattern = pattern[1:] if pattern.startswith("^") else pattern
    if pattern.endswith("$") and (len(pattern) - 1 - len(pattern[:-1].rstrip("\\"))) % 2 == 0:
        pattern = pattern[:-1]
    out: list[str] = []
    atoms: list[str] = []
    state = "start"
    for token in _TOKEN.findall(pattern):
        lazy = state == "repeat" and token == "?"  # laziness does not change what matches
        repeat = not lazy and (token[0] in "*+?" or token[0] == "{" and len(token) > 1)
        if repeat and state in ("repeat", "lazy"):
            _fail(path, f"'pattern' repeats a repeat ({token} after a quantifier); group it with (?:...) first")
        state = "lazy" if lazy else "repeat" if repeat else "other"
        if lazy or repeat or token in ("|", ")", "(", "(?:", "["):  # a lone "[" is unclosed: re.compile refuses
            if token[0] == "{" and max(map(int, re.findall("[0-9]+", token))) > MAX_COUNT:
                _fail(path, f"'pattern' count {token} passes {MAX_COUNT}, the automaton's largest; lower it")
            out.append("" if lazy else "(?:" if token[0] == "(" else token)
            continue
        if token == "(?":
            _fail(path, "'pattern' groups other than (...) and (?:...) are not supported; rewrite the group")
        if token in ("^", "$"):
            _fail(path, "'pattern' may hold ^ and $ only at its start and end; remove the others")
        if token[0] == "[":
            body = re.sub(r"\\(.)", lambda m: _pattern_escape(m[1], path), token[1:-1])
            negated = _RAW + "\\" * body.startswith("^-") + body[1:] + "]"  # "\x1f-" must not start a range
            piece = negated if body.startswith("^") else f"[{body}]"
        elif token == ".":  # ECMA-262's dot skips U+2028 and U+2029 too
            piece = _RAW + "\\u2028\\u2029]"
        elif token[0] == "\\":
            piece = _pattern_escape(token[1], path) + token[2:]
            piece = f"[{piece}]" if token[1] in _SHORTHANDS else piece
        else:
            piece = _escape(token)
        out.append(piece)
        atoms.append(piece)
    regex = "".join(out)
    try:
        re.compile(regex)
    except re.error as exc:
        _fail(path, f"'pattern' is not a valid regular expression ({exc}); fix it")
    if any(re.fullmatch(atom, char) for atom in atoms for char in _NOT_RAW):
        _fail(path, "'pattern' can match '\"', '\\' or a control character, which this module cannot generate; "
                    "leave them out of the pattern")
    return f"(?:{regex})" if regex else ""


@functools.cache
def _any_value(depth: int) -> str:
    """Any JSON value (in the shape above) whose objects and arrays nest at most ``depth`` deep."""
    scalar = f'(?:"{_UNIT}*"|-?{_INT}{_FRACTION_EXPONENT}|true|false|null)'
    if depth == 0:
        return scalar
    inner = _any_value(depth - 1)
    return f"(?:{scalar}|{_open_object(inner)}|{_open_array(inner)})"


def _is_open(schema: Any) -> bool:
    """Whether ``schema`` allows any value (its open object or array counts as the first level of ANY_DEPTH)."""
    return schema is True or isinstance(schema, dict) and all(key in _ANNOTATIONS for key in schema)


def _open_object(value: str) -> str:
    """An object of any members whose values match ``value``."""
    member = f'"{_UNIT}*": ?{value}'
    return rf"\{{(?:{member}(?:, ?{member})*)?\}}"


def _open_array(item: str) -> str:
    return rf"\[(?:{item}(?:, ?{item})*)?\]"


class _Compiler:
    def __init__(self, root: Any, recursion: bool) -> None:
        self.root, self.recursion = root, recursion
        self.expanding: dict[int, int] = {}  # the refs being built -> how many containers were open at their start
        self.containers = 0  # objects and arrays being built: a recursion inside one is no left recursion
        self.rules: dict[str, str] = {}  # the recursive refs' rules, once built
        self.rule_names: dict[int, str] = {}  # a recursive ref's target -> its rule's name

    def build(self, schema: Any, path: str) -> str:
        """The regex for ``schema``, found at ``path`` (a JSON pointer) in the root."""
        if schema is False:
            _fail(path, "schema false matches nothing; remove the value or give it a type")
        if schema is True:
            return self._open(ANY_DEPTH)
        if not isinstance(schema, dict):
            _fail(path, f"a schema must be an object or a boolean, not {_dumps(schema, path)[:60]}")
        keys = {key: value for key, value in schema.items() if key not in _ANNOTATIONS}
        for key, value in keys.items():
            if key not in _KINDS:
                _fail(path, f"keyword {key!r} is not supported; remove it or say it with supported keywords")
            if not _KINDS[key][0](value):
                _fail(path, f"{key!r} must be {_KINDS[key][1]}, not {_dumps(value, path)[:60]}")
            if key in _REFUSED:
                _fail(path, f"{key!r} is not supported: {_REFUSED[key]}")
        applicator = next((k for k in ("$ref", "allOf", "anyOf", "oneOf", "enum", "const") if k in keys), None)
        values = applicator in ("enum", "const")
        other = next((k for k in keys if k != applicator and not (values and k in ("type", "enum", "const"))), None)
        if applicator and other:
            _fail(path, f"{other!r} cannot be combined with {applicator!r}; " + (
                f"list only values that satisfy {other!r} and drop it" if values else "move it into the branches"
                if applicator != "$ref" else "move it into the referenced schema"))
        regex = self._dispatch(keys, path)
        if len(regex) > MAX_REGEX:
            _fail(path, _TOO_LARGE)
        return regex

    def _open(self, depth: int) -> str:
        """Any JSON value: with recursion, a call of a rule of its own, nested to any depth; else nested at most
        ``depth`` deep."""
        if not self.recursion:
            return _any_value(depth)
        if ANY_RULE not in self.rules:
            self.rules[ANY_RULE] = f"(?:{_any_value(0)}|{_open_object(ANY_CALL)}|{_open_array(ANY_CALL)})"
        return ANY_CALL

    def _dispatch(self, schema: dict[str, Any], path: str) -> str:
        if "$ref" in schema:
            return self._ref(schema["$ref"], path)
        if "allOf" in schema:
            if len(schema["allOf"]) > 1:
                _fail(path, "'allOf' with several branches is not supported; merge them into one schema")
            return self.build(schema["allOf"][0], f"{path}/allOf/0")
        for key in ("anyOf", "oneOf"):
            if key in schema:
                if key == "oneOf" and (pair := overlapping_branches(schema[key], self._target)) is not None:
                    _fail(path, f"'oneOf' branches {pair[0]} and {pair[1]} may match the same value, which a "
                                "grammar cannot exclude; give the branches distinct types, or each a required "
                                "property with a distinct 'const' (a discriminator), or write 'anyOf' if a value "
                                "may match several")
                return alternatives(self.build(s, f"{path}/{key}/{i}") for i, s in enumerate(schema[key]))
        if "enum" in schema or "const" in schema:
            return self._values(schema, path)
        if "type" not in schema:
            if not schema:  # annotations alone: any value
                return self._open(ANY_DEPTH)
            _fail(path, f"{next(iter(schema))!r} without a 'type': give the value a type")
        types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
        builders: dict[str, Callable[[dict[str, Any], str], str]] = {
            "string": self._string, "integer": lambda s, p: self._number(s, p, True), "number": self._number,
            "boolean": lambda s, p: "(?:true|false)", "null": lambda s, p: "null", "object": self._object,
            "array": self._array}
        return alternatives(self._inside(builders[t], schema, path) if t in ("object", "array")
                            else builders[t](schema, path) for t in types)

    def _inside(self, build: Callable[[dict[str, Any], str], str], schema: dict[str, Any], path: str) -> str:
        """``build(schema, path)`` of an object or array, counted in ``containers`` while it runs."""
        self.containers += 1
        try:
            return build(schema, path)
        finally:
            self.containers -= 1

    def _target(self, schema: Any, path: str = "") -> Any:
        """The schema a local ``$ref`` (or an ``allOf`` of one schema) stands for, followed to the end."""
        for _ in range(64):  # a chain of refs that loops is refused where it is built
            if isinstance(schema, dict) and isinstance(schema.get("$ref"), str):
                schema = self._lookup(schema["$ref"], path)
            elif isinstance(schema, dict) and isinstance(schema.get("allOf"), list) and len(schema["allOf"]) == 1:
                schema = schema["allOf"][0]
            else:
                break
        return schema

    def _lookup(self, ref: str, path: str) -> Any:
        if not ref.startswith(("#/$defs/", "#/definitions/")):
            _fail(path, f"'$ref' {ref!r} is not supported: only #/$defs/NAME and #/definitions/NAME are; inline it")
        target = self.root
        for part in ref[2:].split("/"):
            part = part.replace("~1", "/").replace("~0", "~")
            if not isinstance(target, dict) or part not in target:
                _fail(path, f"'$ref' {ref!r} points to nothing; add the definition or fix the reference")
            target = target[part]
        return target

    def _ref(self, ref: str, path: str) -> str:
        target = self._lookup(ref, path)
        name = self.rule_names.get(id(target))
        if name is not None and name in self.rules:
            return f"(?&{name})"
        if id(target) in self.expanding:
            if not self.recursion:
                _fail(path, f"'$ref' {ref!r} is recursive: recursive schemas cannot be a regular expression; bound "
                            "the depth by writing the levels out")
            if self.expanding[id(target)] == self.containers:
                _fail(path, f"'$ref' {ref!r} reaches itself through $ref, allOf, anyOf or oneOf alone, so no finite "
                            "value matches it; put the recursion inside an object's properties or an array's items")
            word = re.sub(r"\W", "_", ref.rsplit("/", 1)[-1], flags=re.ASCII)
            word = word if word[:1].isalpha() or word[:1] == "_" else "_" + word  # an identifier, as `regex` wants
            name = self.rule_names.setdefault(id(target), f"{word}_{len(self.rule_names)}")
            return f"(?&{name})"
        self.expanding[id(target)] = self.containers
        try:
            body = self.build(target, ref[1:])
        finally:
            del self.expanding[id(target)]
        if (name := self.rule_names.get(id(target))) is None:
            return body
        self.rules[name] = body
        return f"(?&{name})"

    def _values(self, schema: dict[str, Any], path: str) -> str:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        texts = [_dumps(value, path) for value in values]
        if "const" in schema and "enum" in schema:  # JSON equality: const 1 is in enum [1.0]
            texts = [text for text in texts if any(json_equal(schema["const"], value) for value in schema["enum"])]
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            texts = [text for text in texts if any(_HAS_TYPE[t](json.loads(text)) for t in types)]
        if not texts:
            _fail(path, "no value of 'enum'/'const' satisfies the schema; list at least one that does")
        return alternatives(_escape(text) for text in texts)

    def _number(self, schema: dict[str, Any], path: str, integer: bool = False) -> str:
        keys = [key for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum") if key in schema]
        if not keys:
            return "-?" + _INT + ("" if integer else _FRACTION_EXPONENT)
        if not integer and keys == ["minimum"] and schema["minimum"] == 0:
            return _INT + _FRACTION_EXPONENT
        bounds = {key: _bound(schema[key], key, path, fraction=not integer) for key in keys}
        if integer:
            low, high = -math.inf, math.inf
            if "minimum" in bounds:
                low = math.ceil(bounds["minimum"])
            if "exclusiveMinimum" in bounds:
                low = max(low, math.floor(bounds["exclusiveMinimum"]) + 1)
            if "maximum" in bounds:
                high = math.floor(bounds["maximum"])
            if "exclusiveMaximum" in bounds:
                high = min(high, math.ceil(bounds["exclusiveMaximum"]) - 1)
            regex = integer_range(low, high) if low <= high else None
        else:  # the tighter bound of each side; of equal ones the exclusive
            low = max(((bounds[k], k == "exclusiveMinimum") for k in ("minimum", "exclusiveMinimum") if k in bounds),
                      default=(None, False))
            high = min(((bounds[k], k != "exclusiveMaximum") for k in ("maximum", "exclusiveMaximum") if k in bounds),
                       default=(None, True))
            regex = number_range(low[0], low[1], high[0], not high[1])
        if regex is None:
            _fail(path, f"no {'integer' if integer else 'number'} satisfies {' and '.join(map(repr, keys))} "
                        f"({', '.join(f'{k} {schema[k]}' for k in keys)}); widen the bounds")
        return regex

    def _string(self, schema: dict[str, Any], path: str) -> str:
        keys = [key for key in ("pattern", "format", "minLength", "maxLength") if key in schema]
        if keys and keys[0] in ("pattern", "format") and len(keys) > 1:
            _fail(path, f"{keys[0]!r} cannot be combined with {keys[1]!r}; keep one (a pattern can hold {{m,n}})")
        if "pattern" in schema:
            return f'"{_pattern(schema["pattern"], path)}"'
        if "format" in schema:
            if schema["format"] not in _FORMATS:
                _fail(path, f"'format' {schema['format']!r} is not supported (only {', '.join(_FORMATS)}); "
                            "use a 'pattern'")
            return f'"{_FORMATS[schema["format"]]}"'
        return '"' + _repeat(_UNIT, *_bounds(schema, path, "minLength", "maxLength")) + '"'

    def _object(self, schema: dict[str, Any], path: str) -> str:
        properties, required = schema.get("properties", {}), schema.get("required", [])
        for name in required:
            if name not in properties:
                _fail(path, f"'required' names {name!r}, which is not in 'properties'; add it there or drop it")
        parts = [(_escape(_dumps(name, path)) + ": ?" + self.build(value, f"{path}/properties/" + name.replace(
            "~", "~0").replace("/", "~1")), name not in required) for name, value in properties.items()]
        if not parts:
            additional = schema.get("additionalProperties", True)
            if additional is False:
                return r"\{\}"
            return _open_object(self._open(ANY_DEPTH - 1) if _is_open(additional) else
                                self.build(additional, f"{path}/additionalProperties"))
        # one alternative per property that can come first (those before it are all optional), then the rest in order
        last_first = next((i for i, (_, optional) in enumerate(parts) if not optional), len(parts) - 1)
        alternatives: list[str] = []
        tail, size = "", 0
        for i in range(len(parts) - 1, -1, -1):
            if i <= last_first:
                alternatives.append(parts[i][0] + tail)
                size += len(alternatives[-1])
                if size > MAX_REGEX:
                    _fail(path, _TOO_LARGE)
            tail = f"(?:, ?{parts[i][0]})" + "?" * parts[i][1] + tail
        optional = all(optional for _, optional in parts)
        return r"\{(?:" + "|".join(reversed(alternatives)) + ")" + "?" * optional + r"\}"

    def _array(self, schema: dict[str, Any], path: str) -> str:
        if schema.get("uniqueItems"):
            _fail(path, "'uniqueItems' true is not supported: the automaton cannot compare elements; drop it")
        items = schema.get("items", True)
        item = self._open(ANY_DEPTH - 1) if _is_open(items) else self.build(items, f"{path}/items")
        low, high = _bounds(schema, path, "minItems", "maxItems")
        if high == 0:
            return r"\[\]"
        rest = _repeat(f"(?:, ?{item})", max(low - 1, 0), None if high is None else high - 1)
        return rf"\[{item}{rest}\]" if low else rf"\[(?:{item}{rest})?\]"
