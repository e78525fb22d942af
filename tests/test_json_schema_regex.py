"""schema_to_regex against hand-written JSON texts and a small independent validator, not against its own output."""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from infer.core.errors import InvalidRequestError
from infer.plugins.grammar_pda import PushdownAutomaton
from infer.plugins.json_schema_regex import schema_to_regex, schema_to_rules

UUID = "123e4567-e89b-12d3-a456-426614174000"
PERSON = {"type": "object", "title": "Person", "additionalProperties": False, "required": ["name"], "properties": {
    "name": {"type": "string", "description": "full name"}, "age": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string"}}}}
REFS = {"$defs": {"a/b": {"type": "integer", "minimum": 1},
                  "Point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                            "required": ["x", "y"], "additionalProperties": False}},
        "definitions": {"tag": {"type": "string", "maxLength": 3}},
        "type": "object", "additionalProperties": False, "required": ["n", "p"],
        "properties": {"n": {"$ref": "#/$defs/a~1b"}, "p": {"$ref": "#/$defs/Point"}, "q": {"$ref": "#/$defs/Point"},
                       "t": {"$ref": "#/definitions/tag"}}}
NESTED = {"type": "array", "maxItems": 2, "items": {
    "type": "object", "required": ["id", "kind"], "additionalProperties": False, "properties": {
        "id": {"type": "string", "format": "uuid"},
        "scores": {"type": "array", "items": {"type": "number"}, "minItems": 1, "maxItems": 3},
        "kind": {"enum": ["a", "b"]}}}}

# name: (schema, JSON texts valid under it that the regex must match, texts invalid under it that it must not)
CASES: dict[str, tuple[Any, list[str], list[str]]] = {
    "string": ({"type": "string"},
               ['""', '"hello"', r'"say \"hi\""', r'"caf\u00e9"', '"café 日本 🎉"', r'"tab\tnew\nline\/\\"', r'"\u20AC"'],
               ["hello", '"a"b"', r'"\x"', '"line\nbreak"', "1", r'"\u12"', "'x'", '"open']),
    "string-length": ({"type": "string", "minLength": 2, "maxLength": 4},
                      ['"ab"', '"abcd"', r'"\u00e9\""', '"日本"', '"🎉🎉"'], ['"a"', '"abcde"', r'"\u00e9"', '""']),
    "string-escape-is-one": ({"type": "string", "maxLength": 1}, [r'"\n"', r'"\\"', r'"\u0041"', '"🎉"', '""'],
                             [r'"\n\n"', '"ab"']),
    "pattern": ({"type": "string", "pattern": "^[A-Z]{2}-\\d{3}$"}, ['"AB-123"'],
                ['"AB-12"', '"ab-123"', '"AB-1234"', '"AB-١٢٣"', "1"]),
    "pattern-classes": ({"type": "string", "pattern": "^[^0-9]+x.(ab|cd)*$"}, ['"abxzab"', '"é xycdab"'],
                        ['"1xz"', '"ax"', '"axzabc"']),
    "pattern-unanchored": ({"type": "string", "pattern": "a[b\\-]+?"}, ['"ab"', '"ab-b"'], ['"a"', '"b"', '""']),
    "date": ({"type": "string", "format": "date"}, ['"2024-02-29"', '"1999-12-31"'],
             ['"2024-13-01"', '"24-01-01"', '"2024-1-01"', "2024", '"2024-01-32"']),
    "time": ({"type": "string", "format": "time"}, ['"23:59:60Z"', '"08:00:00.5+02:00"'],
             ['"08:00:00"', '"24:00:00Z"', '"8:00:00Z"']),
    "date-time": ({"type": "string", "format": "date-time"},
                  ['"2024-01-31T08:15:00Z"', '"2024-01-31T08:15:00.123-05:30"'],
                  ['"2024-01-31T08:15Z"', '"2024-01-31"']),
    "uuid": ({"type": "string", "format": "uuid"}, [f'"{UUID}"', f'"{UUID.upper()}"'],
             [f'"{UUID.replace("-", "")}"', f'"{UUID[:-1]}g"']),
    "integer": ({"type": "integer"}, ["0", "-7", "1234567890123"], ["01", "1.5", "+1", '"1"', "-", "--1", ""]),
    "number": ({"type": "number"}, ["0", "-1.5", "3e10", "2.5E-3", "0.0", "-0", "1e+2"],
               [".5", "1.", "01.5", "NaN", "Infinity", "1e", '"1"']),
    "integer-minimum-0": ({"type": "integer", "minimum": 0}, ["0", "42"], ["-1", "1.5"]),
    "integer-minimum-1": ({"type": "integer", "minimum": 1}, ["1", "10"], ["0", "-3"]),
    "integer-exclusive-minimum": ({"type": "integer", "exclusiveMinimum": -1}, ["0", "5"], ["-1"]),
    "integer-tiny-fraction-bound": ({"type": "integer", "exclusiveMinimum": 1e-21}, ["1", "7"], ["0", "-1"]),
    "number-minimum-0": ({"type": "number", "minimum": 0}, ["0.5", "0", "1e-3"], ["-0.5", "-1"]),
    "integer-range": ({"type": "integer", "minimum": -12, "maximum": 305}, ["-12", "-1", "0", "99", "305"],
                      ["-13", "-0", "306", "1000", "007"]),
    "integer-exclusive-range": ({"type": "integer", "exclusiveMinimum": 2.5, "exclusiveMaximum": 10},
                                ["3", "9"], ["2", "10"]),
    "integer-maximum": ({"type": "integer", "maximum": -20}, ["-20", "-100000"], ["-19", "0", "5"]),
    "number-range": ({"type": "number", "minimum": -1, "maximum": 1}, ["0.25", "-1", "1.000", "-0.5", "0"],
                     ["1.01", "-1.5", "2", "1e-3"]),
    "boolean": ({"type": "boolean"}, ["true", "false"], ["True", "1", "null"]),
    "null": ({"type": "null"}, ["null"], ["None", '""']),
    "enum": ({"enum": ["a", 1, None, True, {"x": [1, 2]}, 'q"uote', "a.b*", "é"]},
             ['"a"', "1", "null", "true", '{"x":[1,2]}', r'"q\"uote"', '"a.b*"', '"é"'],
             ['"b"', '"aXb*"', "false", "2", '"a.bb"']),
    "const": ({"const": {"k": "v"}}, ['{"k":"v"}'], ['{"k":"w"}', "{}"]),
    "enum-typed": ({"type": ["string", "null"], "enum": ["a", 1, None]}, ['"a"', "null"], ["1"]),
    "object": (PERSON, ['{"name":"x"}', '{"name": "x", "age": 3}', '{"name":"x","tags":[]}',
                        '{"name":"x", "age":3, "tags":["a", "b"]}', r'{"name":"x","age":0,"tags":["\u00e9"]}'],
               ["{}", '{"age":3}', '{"name":"x","extra":1}', '{"name":"x",}', '{"name":1}', '{"name":"x","age":-1}',
                '{"name":"x","age":1.5}', '{"name":"x""age":1}']),
    "object-optional": ({"type": "object", "additionalProperties": False, "properties": {
        "a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}}},
        ["{}", '{"b":true}', '{"a":1, "c":null}', '{"a":1,"b":false,"c":null}'],
        ["{,}", '{"a":1,}', '{,"a":1}', '{"a":1"b":true}', '{"d":1}']),
    "object-required-middle": ({"type": "object", "required": ["b"], "additionalProperties": False, "properties": {
        "a": {"type": "string"}, "b": {"type": "integer"}, "c": {"type": "array", "items": {"type": "integer"},
                                                                 "maxItems": 2}}},
        ['{"b":1}', '{"a":"x","b":2}', '{"b":1,"c":[]}', '{"a":"", "b":1, "c":[1, 2]}'],
        ['{"a":"x"}', '{"a":"x","c":[]}', "{}", '{"b":1,"c":[1,2,3]}']),
    "object-closed": ({"type": "object", "additionalProperties": False}, ["{}"], ['{"a":1}', "[]", "null"]),
    "object-map": ({"type": "object", "additionalProperties": {"type": "string"}},
                   ["{}", '{"a":"x"}', '{"a": "x", "a b": ""}', r'{"\u00e9":"\n"}'],
                   ['{"a":1}', '{"a":"x",}', '{a:"x"}', "[]", "null"]),
    "object-open": ({"type": "object", "description": "json object mode"},
                    ["{}", '{"a":1}', '{"a": {"b": [1, {"c": null}]}, "d": "e"}', '{"x":[[[true]]]}', '{"":-0.5e3}'],
                    ['{"x":[[[[true]]]]}', "[]", '"x"', '{"a":1,}', '{"a" :1}', '{"a":1} ', "{'a':1}",
                     '{"a":1 "b":2}', '{"a":[1 2]}', '{"a"}', '{1:2}']),
    "any": ({}, ["null", "-1.5", '"x"', "[]", '[1, "a", {"b": false}]', '{"a":{"b":{"c":[1]}}}', "[[[[0]]]]"],
            ["", "[1,]", '{"a"}', "[[[[[0]]]]]", '{"a":{"b":{"c":{"d":{}}}}}', "True", "nan"]),
    "true": (True, ["true", '{"k": [null]}'], ["undefined"]),
    "annotations-only": ({"title": "anything"}, ["1", '["x"]'], ["x"]),
    "array-open": ({"type": "array", "maxItems": 2}, ["[]", '[1, {"a": []}]', '[[[["deep"]]]]'],
                   ['[1, 2, 3]', '[[[[["deeper"]]]]]', "{}"]),
    "array-items-open": ({"type": "array", "items": {}}, ['[null, "x"]'], ["[null,]"]),
    "object-keys": ({"type": "object", "required": ['a"b', "x.y", "é/~"], "additionalProperties": False,
                     "properties": {'a"b': {"type": "null"}, "x.y": {"type": "null"}, "é/~": {"type": "null"}}},
                    [r'{"a\"b":null,"x.y":null,"é/~":null}'], [r'{"a\"b":null,"xzy":null,"é/~":null}']),
    "array-bounds": ({"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 3},
                     ["[1,2]", "[1, 2, 3]"], ["[]", "[1]", "[1,2,3,4]", "[1,,2]", "[1,2,]"]),
    "array": ({"type": "array", "items": {"type": "boolean"}}, ["[]", "[true]", "[true, false, true]"],
              ["[,]", "[true,]", "[1]", "[ true]"]),
    "array-min-1": ({"type": "array", "items": {"type": "null"}, "minItems": 1, "uniqueItems": False},
                    ["[null]", "[null,null]"], ["[]"]),
    "array-max-0": ({"type": "array", "items": {"type": "null"}, "maxItems": 0}, ["[]"], ["[null]"]),
    "array-max-1": ({"type": "array", "items": {"type": "string"}, "maxItems": 1}, ["[]", '["x"]'], ['["x","y"]']),
    "anyOf": ({"anyOf": [{"type": "string", "maxLength": 1}, {"type": "null"}]}, ['"a"', "null", '""'],
              ['"ab"', "1"]),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}], "description": "x"}, ["1", "true"], ["null"]),
    "type-list": ({"type": ["string", "integer", "null"]}, ['"x"', "3", "null"], ["true", "1.5"]),
    "refs": (REFS, ['{"n":1,"p":{"x":1.5,"y":-2}}', '{"n": 7, "p": {"x": 0, "y": 0}, "q": {"x":1,"y":2}, "t": "abc"}'],
             ['{"n":0,"p":{"x":1,"y":2}}', '{"n":1,"p":{"x":1}}', '{"n":1,"p":{"x":1,"y":2},"t":"abcd"}']),
    "allOf-one": ({"allOf": [{"type": "boolean"}], "$comment": "x"}, ["true"], ['"true"']),
    "nested": (NESTED, ["[]", f'[{{"id":"{UUID}","kind":"a"}}]',
                        f'[{{"id": "{UUID}", "scores": [1, 2.5], "kind": "b"}}, {{"id":"{UUID}","kind":"a"}}]'],
               [f'[{{"id":"{UUID}","scores":[],"kind":"a"}}]', f'[{{"id":"{UUID}","kind":"c"}}]',
                f'[{{"id":"{UUID}","kind":"a"}},{{"id":"{UUID}","kind":"a"}},{{"id":"{UUID}","kind":"a"}}]']),
}

DIALECT_TOKEN = re.compile(r'\\(?:x[0-9a-fA-F]{2}|u[0-9a-fA-F]{4}|[.\\\[\]{}()|*+?"/\-^$])|\(\?:'
                           r"|\{([0-9]+)(?:,([0-9]*))?\}|[^\\(]", re.S)


def assert_dialect(regex: str) -> None:
    """Only the automaton's constructs, counts at most 1000, ASCII digits only."""
    i = 0
    while i < len(regex):
        match = DIALECT_TOKEN.match(regex, i)
        assert match, f"not in the dialect at {i}: {regex[i:i + 30]!r}"
        assert all(int(n) <= 1000 for n in match.groups() if n)
        i = match.end()


def resolve(root: Any, ref: str) -> Any:
    for part in ref[2:].split("/"):
        root = root[part.replace("~1", "/").replace("~0", "~")]
    return root


def format_ok(value: str, fmt: str) -> bool:
    if fmt == "uuid":
        return len(value) == 36 and str(uuid.UUID(value)) == value.lower()
    if fmt == "date-time":
        date, _, time = value.partition("T")
        return format_ok(date, "date") and format_ok(time, "time")
    if fmt == "date":
        m = re.fullmatch(r"([0-9]{4})-([0-9]{2})-([0-9]{2})", value)
        return bool(m) and 1 <= int(m[2]) <= 12 and 1 <= int(m[3]) <= 31
    m = re.fullmatch(r"([0-9]{2}):([0-9]{2}):([0-9]{2})(\.[0-9]+)?(Z|[+-]([0-9]{2}):([0-9]{2}))", value)
    return bool(m) and int(m[1]) < 24 and int(m[2]) < 60 and int(m[3]) <= 60 and (
        m[5] == "Z" or int(m[6]) < 24 and int(m[7]) < 60)


def has_type(value: Any, name: str) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return {"string": isinstance(value, str), "number": number, "boolean": isinstance(value, bool),
            "integer": number and float(value).is_integer(), "null": value is None,
            "object": isinstance(value, dict), "array": isinstance(value, list)}[name]


def same(a: Any, b: Any) -> bool:
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def valid(value: Any, schema: Any, root: Any) -> bool:
    """A small JSON Schema validator for the keywords the table uses (oneOf with its real meaning)."""
    if isinstance(schema, bool):
        return schema
    if "$ref" in schema:
        return valid(value, resolve(root, schema["$ref"]), root)
    types = schema.get("type", [])
    if not all([any(has_type(value, t) for t in (types if isinstance(types, list) else [types])) or not types,
                "const" not in schema or same(value, schema["const"]),
                "enum" not in schema or any(same(value, v) for v in schema["enum"]),
                "anyOf" not in schema or any(valid(value, s, root) for s in schema["anyOf"]),
                "oneOf" not in schema or sum(valid(value, s, root) for s in schema["oneOf"]) == 1,
                all(valid(value, s, root) for s in schema.get("allOf", []))]):
        return False
    if isinstance(value, str):
        return (schema.get("minLength", 0) <= len(value) <= schema.get("maxLength", len(value))
                and ("pattern" not in schema or re.search(schema["pattern"], value) is not None)
                and ("format" not in schema or format_ok(value, schema["format"])))
    if has_type(value, "number"):
        return (("minimum" not in schema or value >= schema["minimum"])
                and ("exclusiveMinimum" not in schema or value > schema["exclusiveMinimum"])
                and ("maximum" not in schema or value <= schema["maximum"])
                and ("exclusiveMaximum" not in schema or value < schema["exclusiveMaximum"]))
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        additional = schema.get("additionalProperties", True)
        return (set(schema.get("required", [])) <= value.keys()
                and all(valid(v, properties[k] if k in properties else additional, root) for k, v in value.items()))
    if isinstance(value, list):
        return (schema.get("minItems", 0) <= len(value) <= schema.get("maxItems", len(value))
                and all(valid(v, schema.get("items", True), root) for v in value))
    return True


@pytest.mark.parametrize("name", CASES)
def test_hand_written_texts(name: str) -> None:
    schema, good, bad = CASES[name]
    regex = schema_to_regex(schema)
    assert_dialect(regex)
    for text in good:
        assert valid(json.loads(text), schema, schema), f"the test's own valid text is not valid: {text}"
        assert re.fullmatch(regex, text), f"{name}: should match {text!r}"
    for text in bad:
        assert not re.fullmatch(regex, text), f"{name}: should not match {text!r}"


@pytest.mark.parametrize("name", CASES)
def test_generated_texts_are_valid(name: str) -> None:
    schema = CASES[name][0]

    @settings(max_examples=15, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(schema_to_regex(schema), fullmatch=True))
    def check(text: str) -> None:
        assert valid(json.loads(text), schema, schema), text

    check()


@settings(max_examples=300, deadline=None)
@given(low=st.one_of(st.none(), st.integers(-3000, 3000)), high=st.one_of(st.none(), st.integers(-3000, 3000)),
       exclusive=st.booleans(), half=st.booleans(), values=st.lists(st.integers(-10_000, 10_000), min_size=5,
                                                                    max_size=5),
       fractions=st.lists(st.text("0123456789", max_size=3), min_size=5, max_size=5))
def test_numeric_bounds_match_exactly_the_values_within(low: int | None, high: int | None, exclusive: bool,
                                                        half: bool, values: list[int], fractions: list[str]) -> None:
    """A text matches the bounded schema's regex, by Python's re and by the project's automaton, exactly when its
    value (a Decimal) lies within the bounds: integers under inclusive or exclusive bounds (whole or halves), and
    numbers, written without an exponent, "-0.x" too, under integer minimum and maximum; near the bounds too."""
    from decimal import Decimal

    from infer.plugins.regex_fsm import CharAutomaton

    if low is not None and high is not None and low > high:
        low, high = high, low
    shift = Decimal("0.5") if half else 0
    schemas = {"number": {k: v for k, v in (("minimum", low), ("maximum", high)) if v is not None}}
    names = ("exclusiveMinimum", "exclusiveMaximum") if exclusive else ("minimum", "maximum")
    schemas["integer"] = {k: float(v + shift) if half else v
                          for k, v in zip(names, (low, high)) if v is not None}
    near = [b + d for b in (low, high) if b is not None for d in (-1, 0, 1)]
    for kind, bounds in schemas.items():
        def within(value: Decimal) -> bool:
            return all(value >= Decimal(str(b)) if k == "minimum" else value <= Decimal(str(b)) if k == "maximum"
                       else value > Decimal(str(b)) if k == "exclusiveMinimum" else value < Decimal(str(b))
                       for k, b in bounds.items())

        try:
            pattern = schema_to_regex({"type": kind, **bounds})
        except InvalidRequestError:  # refused only where no integer lies within
            assert kind == "integer" and low is not None and high is not None
            assert not any(within(Decimal(i)) for i in range(low - 2, high + 3))
            continue
        regex, automaton = re.compile(pattern), CharAutomaton.compile(pattern)
        texts = [str(v) for v in values + near]
        if kind == "number":
            texts += [f"{v}.{f}" for v, f in zip(values + near, fractions * 3) if f] + [f"-0.{f}" for f in fractions
                                                                                       if f]
        for text in texts:
            if text.startswith("-") and Decimal(text) == 0:  # never written: "-0" is 0's (documented)
                continue
            assert bool(regex.fullmatch(text)) == within(Decimal(text)) == automaton.fullmatch(text), (kind, bounds,
                                                                                                     text)


@settings(max_examples=400, deadline=None)
@given(low=st.one_of(st.none(), st.integers(-30_000, 30_000)), high=st.one_of(st.none(), st.integers(-30_000, 30_000)),
       scale=st.sampled_from([1, 10, 1000]), strict=st.tuples(st.booleans(), st.booleans()),
       texts=st.lists(st.tuples(st.sampled_from(["", "-"]), st.integers(0, 40), st.text("0123456789", max_size=5)),
                      min_size=8, max_size=8))
def test_decimal_bounds_of_numbers_match_exactly_the_values_within(
        low: int | None, high: int | None, scale: int, strict: tuple[bool, bool],
        texts: list[tuple[str, int, str]]) -> None:
    """A number's decimal bounds, inclusive or exclusive, as the JSON floats a schema holds: a text written without
    an exponent matches, by Python's re and by the project's automaton, exactly when its value (a Decimal) lies
    within them; near the bounds (a step of 10^-k either side, trailing zeros) too. "-0" forms may be left out."""
    from decimal import Decimal

    from infer.plugins.regex_fsm import CharAutomaton

    bounds: dict[str, float] = {}
    for value, name, exclusive in ((low, "minimum", strict[0]), (high, "maximum", strict[1])):
        if value is not None:
            key = "exclusive" + name.capitalize() if exclusive else name
            bounds[key] = value / scale if scale > 1 else value
    reference = {key: Decimal(repr(value)) for key, value in bounds.items()}

    def within(value: Decimal) -> bool:
        return all({"minimum": value >= b, "maximum": value <= b, "exclusiveMinimum": value > b,
                    "exclusiveMaximum": value < b}[key] for key, b in reference.items())

    try:
        pattern = schema_to_regex({"type": "number", **bounds})
    except InvalidRequestError as exc:  # refused only where no number lies within
        assert "no number satisfies" in str(exc)
        assert low is not None and high is not None
        [a, b] = [reference[k] for k in reference]
        assert a > b or a == b and any(strict)
        return
    regex, automaton = re.compile(pattern), CharAutomaton.compile(pattern)
    candidates = [f"{sign}{whole}" + (f".{fraction}" if fraction else "") for sign, whole, fraction in texts]
    for bound in reference.values():
        for step in (Decimal(1), Decimal("0.1"), Decimal("0.001"), Decimal("0.0001"), Decimal(0)):
            for near in (bound - step, bound + step):
                candidates += [format(near, "f"), format(near, "f") + ("0" if "." in format(near, "f") else ".0")]
    for text in candidates:
        value = Decimal(text)
        if text.startswith("-") and value == 0:  # "-0" forms: never a value outside
            assert not regex.fullmatch(text) or within(value), (bounds, text)
            continue
        assert bool(regex.fullmatch(text)) == within(value) == automaton.fullmatch(text), (bounds, text, pattern)


def test_a_pydantic_models_bounded_fields() -> None:
    """Pydantic's own schema of a model with bounded fields (``gt=0``, ``le=99.5``, ``ge=1``): every text generated
    from the regex is one Pydantic validates (the reference), and the texts just past each bound are refused."""
    import pydantic

    class Order(pydantic.BaseModel):
        price: float = pydantic.Field(gt=0, le=99.5)
        quantity: int = pydantic.Field(ge=1, lt=100)

    regex = re.compile(schema_to_regex(Order.model_json_schema()))

    @settings(max_examples=200, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(regex, fullmatch=True))
    def check(text: str) -> None:
        Order.model_validate_json(text)

    check()
    for price, quantity, ok in (("0.001", "1", True), ("99.50", "99", True), ("0", "1", False), ("0.0", "1", False),
                                ("99.51", "1", False), ("1", "0", False), ("1", "100", False), ("-0.5", "5", False)):
        text = f'{{"price": {price}, "quantity": {quantity}}}'
        assert bool(regex.fullmatch(text)) == ok, text
        if not ok:
            with pytest.raises(pydantic.ValidationError):
                Order.model_validate_json(text)


def test_a_pydantic_tagged_union_is_one_of_its_models() -> None:
    """Pydantic's discriminated union is a oneOf of $refs whose models each require a distinct Literal tag: the
    branches cannot overlap, so it compiles, and every generated text validates in Pydantic as exactly the model
    its tag names."""
    from typing import Literal, Union

    import pydantic

    class Cat(pydantic.BaseModel):
        kind: Literal["cat"]
        lives: int = pydantic.Field(ge=0, le=9)

    class Dog(pydantic.BaseModel):
        kind: Literal["dog"]
        good: bool

    class Pet(pydantic.BaseModel):
        pet: Union[Cat, Dog] = pydantic.Field(discriminator="kind")

    schema = Pet.model_json_schema()
    assert "oneOf" in json.dumps(schema) and "discriminator" in json.dumps(schema)
    regex = re.compile(schema_to_regex(schema))

    @settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.from_regex(regex, fullmatch=True))
    def check(text: str) -> None:
        pet = Pet.model_validate_json(text).pet
        assert type(pet).__name__.lower() == json.loads(text)["pet"]["kind"]

    check()


@pytest.mark.parametrize("branches", [
    [{"type": "integer"}, {"type": "number"}],  # 7 is both
    [{"type": "object", "properties": {"a": {"type": "string"}}}, {"type": "object"}],  # {} is both
    [{"const": 1}, {"enum": [2, 1.0]}],  # 1 and 1.0 are one JSON value
    [{"const": [1]}, {"const": [1.0]}],  # inside an array too (compared as JSON text, they were read as anyOf)
    [{"const": {"a": 1, "b": [2]}}, {"enum": [{"b": [2.0], "a": 1.0}]}],  # and an object, in any key order
    [{"type": "object", "properties": {"k": {"const": "a"}}}, {"type": "object", "properties": {"k": {"const": "b"}}}],
    [{"type": ["object", "string"], "properties": {"k": {"const": "a"}}, "required": ["k"]},
     {"type": ["object", "string"], "properties": {"k": {"const": "b"}}, "required": ["k"]}],  # "x" matches both
])  # the fourth: the tags are not required, so {} matches both
def test_one_of_branches_that_may_overlap_are_refused(branches: list[Any]) -> None:
    """A grammar cannot exclude a value that matches two oneOf branches: such a oneOf is refused, saying what to do
    (it was read as anyOf, and such values came out)."""
    with pytest.raises(InvalidRequestError, match=r"'oneOf' branches 0 and 1 may match the same value, .* or write "
                                                  "'anyOf' if a value may match several"):
        schema_to_regex({"oneOf": branches})
    schema_to_regex({"anyOf": branches})


def test_const_and_enum_intersect_by_json_equality() -> None:
    """const 1 is in enum [1.0]: the schema was refused as one no value satisfies."""
    assert re.fullmatch(schema_to_regex({"const": 1, "enum": [1.0, 2]}), "1")
    assert re.fullmatch(schema_to_regex({"const": [1, {"a": 2}], "enum": [[1.0, {"a": 2.0}]]}), '[1,{"a":2}]')
    with pytest.raises(InvalidRequestError):
        schema_to_regex({"const": [1], "enum": [[2]]})


def test_generation_restrictions() -> None:
    """Valid texts the module never generates, and a shape-only format check: the documented restrictions."""
    never = [(PERSON, '{"age":3,"name":"x"}'), (PERSON, '{ "name":"x"}'), (PERSON, '{"name" :"x"}'),
             (PERSON, '{"name":"x"} '), ({"const": {"k": "v"}}, '{"k": "v"}'),
             ({"type": "object"}, '{"a":[[[[1]]]]}'), ({}, "[[[[[1]]]]]"),  # a regex nests open values at most 4 deep
             ({"type": "string", "minLength": 1}, r'"\ud83d\ude00"'), ({"type": "string", "pattern": "ab"}, '"xab"'),
             ({"type": "string", "pattern": "^[^a]$"}, r'"\""'), ({"type": "integer"}, "1.0"),
             ({"type": "integer", "minimum": 0, "maximum": 3}, "-0"), ({"type": "number", "maximum": 5}, "1e0")]
    for schema, text in never:
        assert valid(json.loads(text), schema, schema) and not re.fullmatch(schema_to_regex(schema), text), text
    assert re.fullmatch(schema_to_regex({"type": "string", "format": "date"}), '"2023-02-31"')


def test_json_text_input_and_many_optional_properties() -> None:
    assert schema_to_regex('{"type": "null"}') == "null"
    names = [f"p{i}" for i in range(60)]
    schema = {"type": "object", "properties": {n: {"type": "boolean"} for n in names}}
    regex = schema_to_regex(schema)
    assert len(regex) < 150_000  # quadratic in the number of optional properties, not exponential
    for step in (1, 2, 7, 59):
        text = "{" + ", ".join(f'"{n}": true' for n in names[::step]) + "}"
        assert re.fullmatch(regex, text)
    assert not re.fullmatch(regex, '{"p1":true,"p0":true}')
    required = schema_to_regex({**schema, "required": names})  # all required: linear
    assert len(required) < 3000 and re.fullmatch(required, "{" + ",".join(f'"{n}":false' for n in names) + "}")


def nest(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "null"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema, "maxItems": 1}
    return schema


REFUSALS: list[tuple[Any, str, str]] = [  # schema, keyword or phrase, path
    ({"type": "object", "properties": {"x": {"type": "number", "minimum": 0.5, "exclusiveMaximum": 0.5}}},
     "no number satisfies 'minimum' and 'exclusiveMaximum'", "/properties/x"),
    ({"type": "integer", "minimum": 5, "maximum": 4}, "no integer satisfies 'minimum' and 'maximum'", "the root"),
    ({"type": "number", "exclusiveMinimum": 1, "maximum": 1}, "no number satisfies", "the root"),
    ({"type": "integer", "minimum": True}, "'minimum'", "the root"),
    ({"type": "integer", "maximum": 10 ** 400}, "too many digits", "the root"),
    ({"type": "number", "minimum": 1e-25}, "too many digits", "the root"),
    ({"type": "integer", "multipleOf": 2}, "'multipleOf'", "the root"),
    ({"type": "object", "minProperties": 1}, "'minProperties'", "the root"),
    ({"type": "object", "maxProperties": 1}, "'maxProperties'", "the root"),
    ({"type": "object", "patternProperties": {"^x": {"type": "null"}}}, "'patternProperties'", "the root"),
    ({"type": "object", "propertyNames": {"maxLength": 3}}, "'propertyNames'", "the root"),
    ({"type": "object", "dependentRequired": {"a": ["b"]}}, "'dependentRequired'", "the root"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": ["b"]}, "'required'", "the root"),
    ({"type": "array", "items": {"type": "null"}, "prefixItems": [{"type": "null"}]}, "'prefixItems'", "the root"),
    ({"type": "array", "items": {"type": "null"}, "contains": {"type": "null"}}, "'contains'", "the root"),
    ({"type": "array", "items": {"type": "null"}, "uniqueItems": True}, "'uniqueItems'", "the root"),
    ({"type": "array", "items": {"type": "null"}, "maxItems": 1001}, "'maxItems'", "the root"),
    ({"type": "array", "items": {"type": "null"}, "minItems": 3, "maxItems": 2}, "'minItems'", "the root"),
    ({"type": "string", "maxLength": 5000}, "'maxLength'", "the root"),
    ({"allOf": [{"type": "null"}, {"type": "null"}]}, "'allOf'", "the root"),
    ({"$ref": "http://example.com/s.json"}, "'$ref'", "the root"),
    ({"$defs": {}, "anyOf": [{"type": "null"}, {"$ref": "#/$defs/nope"}]}, "'$ref'", "/anyOf/1"),
    ({"$defs": {"node": {"type": "object", "properties": {"next": {"$ref": "#/$defs/node"}}}}, "$ref": "#/$defs/node"},
     "recursive", "/$defs/node/properties/next"),
    ({"minLength": 3}, "'minLength' without a 'type': give the value a type", "the root"),
    ({"type": "array", "items": {"properties": {}}}, "give the value a type", "/items"),
    ({"type": "object", "additionalProperties": {"maxItems": 1}}, "give the value a type", "/additionalProperties"),
    ({"type": "array", "items": False}, "schema false", "/items"),
    (False, "schema false", "the root"),
    ({"type": "string", "not": {"maxLength": 2}}, "'not'", "the root"),
    ({"type": "object", "properties": {"a": {"if": {"type": "null"}}}}, "'if'", "/properties/a"),
    ({"type": "object", "properties": {"a": {"type": "null"}}, "required": "a"}, "'required'", "the root"),
    ({"type": "string", "minLength": -1}, "'minLength'", "the root"),
    ({"type": "string", "minLength": True}, "'minLength'", "the root"),
    ({"type": "object", "properties": []}, "'properties'", "the root"),
    ({"type": "array", "items": [{"type": "null"}]}, "'items'", "the root"),
    ({"type": "int"}, "'type'", "the root"),
    ({"enum": []}, "'enum'", "the root"),
    ({"type": "object", "properties": {"a/b": {"type": "string", "format": "email"}}}, "'format'", "/properties/a~1b"),
    ({"type": "string", "pattern": '^a"b$'}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "[ -~]+"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "(?=a)a"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "\\s+"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "a{2000}"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "a^b"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "a*+"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "a???"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "\\1"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "(a"}, "'pattern'", "the root"),
    ({"type": "string", "pattern": "[a-z]+", "maxLength": 3}, "'pattern'", "the root"),
    ({"type": "string", "format": "date", "minLength": 3}, "'format'", "the root"),
    ({"enum": ["a", "bbbb"], "maxLength": 3}, "'maxLength'", "the root"),
    ({"type": "string", "anyOf": [{"maxLength": 3}]}, "'type'", "the root"),
    ({"type": "integer", "enum": ["a"]}, "'enum'", "the root"),
    ({"type": "object", "properties": {f"p{i}": {"type": "null"} for i in range(800)}}, "too large", "the root"),
    ({"type": "object", "properties": {"a": {}, "b": {}, "c": {"type": "object"}}}, "or open values", "the root"),
    ("{not json", "not JSON", "the root"),
    (nest(3000), "nests too deeply", "the root"),
]


@pytest.mark.parametrize(("schema", "keyword", "path"), REFUSALS, ids=[r[1] for r in REFUSALS])
def test_refusals_name_the_keyword_and_path(schema: Any, keyword: str, path: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        schema_to_regex(schema)
    message = str(info.value)
    assert message.startswith("invalid JSON schema: ") and keyword in message and f"at {path}:" in message, message


TREE = {"$defs": {"node": {"type": "object", "properties": {
    "v": {"type": "integer", "minimum": 0, "maximum": 9},
    "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
    "$ref": "#/$defs/node"}
LINKED = {"$defs": {"list": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
    "head": {"type": "string", "maxLength": 2}, "tail": {"$ref": "#/$defs/list"}}, "required": ["head", "tail"]}]}},
    "type": "object", "properties": {"items": {"$ref": "#/definitions/wrap"}}, "required": ["items"],
    "definitions": {"wrap": {"$ref": "#/$defs/list"}}}


def reference_regex(rules: dict[str, str]) -> Any:
    """The rules as one pattern of the `regex` module (an independent engine with recursion): each rule a named
    group in a DEFINE block, which its (?&name) calls."""
    import regex

    return regex.compile("(?(DEFINE)" + "".join(f"(?P<{name}>{body})" for name, body in rules.items()
                                               if name != "root") + ")" + rules["root"])


@st.composite
def trees(draw: st.DrawFn, depth: int = 0) -> Any:
    node: dict[str, Any] = {"v": draw(st.integers(-1, 10))} if draw(st.integers(0, 9)) else {}
    if depth < 5 and draw(st.booleans()):
        node["kids"] = draw(st.lists(trees(depth + 1), max_size=3))
    return node


@st.composite
def linked(draw: st.DrawFn, depth: int = 0) -> Any:
    if depth > 6 or draw(st.integers(0, 3)) == 0:
        return None
    return {"head": draw(st.text("ab", max_size=3)), "tail": draw(linked(depth + 1))}


@settings(max_examples=200, deadline=None)
@given(tree=trees(), items=linked(), spaced=st.booleans())
def test_recursive_refs_become_rules_that_accept_exactly_the_valid_texts(tree: Any, items: Any, spaced: bool) -> None:
    """A $ref that recurs inside an object or array is a rule: the pushdown automaton of the rules accepts a value's
    compact JSON exactly when the small validator says it is valid (trees of any depth; a linked list reached through
    a second ref), as the `regex` module reading the same rules does; schema_to_regex still refuses it."""
    separators = (", ", ": ") if spaced else (",", ":")
    for schema, value in ((TREE, tree), (LINKED, {"items": items})):
        rules = schema_to_rules(schema)
        assert len(rules) == 2
        text = json.dumps(value, separators=separators)
        expected = valid(value, schema, schema)
        assert PushdownAutomaton.of_regex_rules(rules).fullmatch(text) == expected, text
        assert (reference_regex(rules).fullmatch(text) is not None) == expected, text
    with pytest.raises(InvalidRequestError, match="recursive"):
        schema_to_regex(TREE)


def depth(value: Any) -> int:
    """How deep ``value``'s objects and arrays nest (a scalar: 0)."""
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-10**9, 10**9) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=4), lambda inner: st.lists(inner, max_size=2) | st.dictionaries(st.text(max_size=3), inner,
                                                                                     max_size=2), max_leaves=12)


@settings(max_examples=150, deadline=None)
@given(value=JSON_VALUES, key=st.text(max_size=3), spaced=st.booleans())
def test_an_open_value_is_any_json_value_nested_to_any_depth_as_a_rule(value: Any, key: str, spaced: bool) -> None:
    """JSON object mode through schema_to_rules: every object json.dumps writes (non-ASCII raw, as the module's
    shape has it; compact or with one space) is accepted however deep it nests, where schema_to_regex's regex stops
    at ANY_DEPTH; a value that is no object is not."""
    separators = (", ", ": ") if spaced else (",", ":")
    automaton = PushdownAutomaton.of_regex_rules(schema_to_rules({"type": "object"}))
    bounded = re.compile(schema_to_regex({"type": "object"}))
    for candidate in ({key: value}, {key: [[[[value]]]]}, value):
        text = json.dumps(candidate, separators=separators, ensure_ascii=False)
        assert automaton.fullmatch(text) == isinstance(candidate, dict), text
        assert (bounded.fullmatch(text) is not None) == (isinstance(candidate, dict) and depth(candidate) <= 4), text


# recursive schemas of other shapes, each with values the small validator judges (valid or not)
BINARY = {"$defs": {"node": {"type": "object", "properties": {  # two recursive refs in one definition
    "v": {"type": "integer", "minimum": 0, "maximum": 9}, "l": {"$ref": "#/$defs/node"}, "r": {"$ref": "#/$defs/node"}},
    "required": ["v"]}}, "$ref": "#/$defs/node"}
SAME_NAMES = {"$defs": {"node": {"type": "object", "properties": {"a": {"$ref": "#/$defs/node"}}}},  # two "node"s
              "definitions": {"node": {"type": "array", "items": {"anyOf": [{"type": "integer"},
                                                                             {"$ref": "#/definitions/node"}]}}},
              "type": "object", "properties": {"o": {"$ref": "#/$defs/node"}, "l": {"$ref": "#/definitions/node"}},
              "required": ["o", "l"]}
ODD_NAMES = {"$defs": {"3d-node": {"type": "object", "properties": {"k": {"$ref": "#/$defs/3d-node"}}},
                       "\u0663d point": {"type": "array", "items": {"$ref": "#/$defs/\u0663d point"}, "maxItems": 2}},
             "type": "array", "items": {"anyOf": [{"$ref": "#/$defs/3d-node"}, {"$ref": "#/$defs/\u0663d point"}]}}
ARRAYS_ONLY = {"$defs": {"list": {"type": "array", "items": {"anyOf": [{"type": "integer"},
                                                                      {"$ref": "#/$defs/list"}]}}},
               "$ref": "#/$defs/list"}
RECURSIVE_VALUES: list[tuple[Any, list[Any]]] = [
    (BINARY, [{"v": 1}, {"v": 1, "l": {"v": 2}, "r": {"v": 3, "r": {"v": 4}}}, {"v": 1, "r": {"v": 2, "l": {}}},
              {"v": 1, "l": {"v": 10}}, {"v": 0, "l": {"v": 1, "l": {"v": 2, "r": {"v": 3}}}}, {}]),
    (SAME_NAMES, [{"o": {}, "l": []}, {"o": {"a": {"a": {}}}, "l": [1, [2, [3]], []]}, {"o": {"a": []}, "l": []},
                  {"o": {}, "l": [{}]}, {"o": {"a": {"a": {"a": {}}}}, "l": [[[]]]}, {"o": [], "l": []}]),
    (ODD_NAMES, [[], [{}], [{"k": {"k": {}}}, []], [[[], [[]]]], [[[], [], []]], [{"k": []}], [[{}]]]),
    (ARRAYS_ONLY, [[], [1, [2, [3, []]]], [[[[[0]]]]], [1, [2, {}]], [[], "x"], {}]),
]


@pytest.mark.parametrize("schema, values", RECURSIVE_VALUES, ids=["binary", "same-names", "odd-names", "arrays-only"])
def test_recursive_schemas_of_other_shapes_accept_exactly_the_valid_texts(schema: Any, values: list[Any]) -> None:
    """Two recursive refs in one definition, two definitions named alike (under $defs and definitions), names that
    are not identifiers, and a recursion through arrays alone: the automaton of the rules, and the `regex` module
    reading them, accept each value's compact JSON exactly when the small validator says it is valid."""
    rules = schema_to_rules(schema)
    automaton, reference = PushdownAutomaton.of_regex_rules(rules), reference_regex(rules)
    assert len(rules) > 1
    for value in values:
        text, expected = json.dumps(value, separators=(",", ":"), ensure_ascii=False), valid(value, schema, schema)
        assert automaton.fullmatch(text) == expected, text
        assert (reference.fullmatch(text) is not None) == expected, text
    assert any(valid(value, schema, schema) for value in values) and not all(valid(v, schema, schema) for v in values)


@pytest.mark.parametrize("schema, path", [
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "$ref": "#/$defs/a"}, "/$defs/a/anyOf/0"),
    ({"$defs": {"a": {"anyOf": [{"$ref": "#/$defs/a"}, {"type": "null"}]}}, "type": "object",  # inside an object
      "properties": {"x": {"$ref": "#/$defs/a"}}}, "/$defs/a/anyOf/0"),
    ({"$defs": {"a": {"anyOf": [{"type": "object", "properties": {"x": {"type": "null"}}}, {"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "/$defs/a/anyOf/1"),  # an object closed before the recursion
    ({"$defs": {"a": {"allOf": [{"$ref": "#/$defs/b"}]}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"},
     "/$defs/b"),
    ({"$defs": {"a": {"anyOf": [{"type": "array", "items": {"type": "null"}}, {"$ref": "#/$defs/a"}]}},
      "$ref": "#/$defs/a"}, "/$defs/a/anyOf/1"),
])
def test_a_ref_that_reaches_itself_before_any_bracket_is_refused(schema: Any, path: str) -> None:
    """No finite value matches such a ref (an array or object closed before the recursion does not count, one
    that holds the first ref does not make the inner recursion finite)."""
    with pytest.raises(InvalidRequestError, match=f"at {re.escape(path)}: .*reaches itself through"):
        schema_to_rules(schema)


def test_surrogates_in_a_schema() -> None:
    """A pattern's surrogate-pair escape is its one character; a lone surrogate in a value is refused by name (the
    message blamed character classes and maxLength)."""
    from infer.plugins.regex_fsm import CharAutomaton  # the fsm dialect joins the pair; Python's re does not

    assert CharAutomaton.compile(schema_to_regex({"type": "string", "pattern": r"^\ud83d\ude00$"})).fullmatch(
        '"\U0001F600"')
    with pytest.raises(InvalidRequestError, match=r"'\\ud800' holds a lone surrogate, which no UTF-8 text holds"):
        schema_to_regex({"enum": ["\ud800"]})
