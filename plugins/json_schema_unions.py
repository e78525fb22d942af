"""Whether a JSON schema's ``oneOf`` branches can be compiled as ``anyOf``: a grammar cannot exclude a value that
matches two branches, so the compiler takes ``oneOf`` only where no value can: branches of distinct types
(``integer`` counts as a ``number``), of distinct ``const``/``enum`` values, or objects that each require a property
whose ``const``/``enum`` values differ (a discriminator, as Pydantic's tagged unions write)."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from decimal import Decimal
from typing import Any


@dataclass(frozen=True)
class Shape:
    """What a branch says about its values: their types and their values (None: not said), and the values of each
    property it requires."""

    types: frozenset[str] | None
    values: frozenset[Any] | None
    tags: dict[str, frozenset[Any]] = field(default_factory=dict)


def overlapping_branches(branches: list[Any], resolve: Callable[[Any], Any]) -> tuple[int, int] | None:
    """The first two branches that some value may match both of; None where they are disjoint. ``resolve`` follows
    a branch's local ``$ref`` (and a one-schema ``allOf``) to the schema it stands for."""
    shapes = [shape_of(branch, resolve) for branch in branches]
    for i, j in itertools.combinations(range(len(shapes)), 2):
        if not disjoint(shapes[i], shapes[j]):
            return i, j
    return None


def shape_of(schema: Any, resolve: Callable[[Any], Any]) -> Shape:
    schema = resolve(schema)
    if not isinstance(schema, dict):
        return Shape(None, None)
    values = value_set(schema)
    if "type" in schema:
        types = frozenset(schema["type"] if isinstance(schema["type"], list) else [schema["type"]])
    else:
        types = None if values is None else frozenset(kind for kind, _ in values)
    tags = {}
    properties = schema.get("properties") if isinstance(schema.get("properties"), dict) else {}
    for name in schema.get("required") or []:
        if name in properties and (tag := value_set(resolve(properties[name]))) is not None:
            tags[name] = tag
    return Shape(types, values, tags)


def value_set(schema: Any) -> frozenset[Any] | None:
    """The values a schema's ``const``/``enum`` allows, each as (its JSON type, a key equal for equal JSON values);
    None without either."""
    if not isinstance(schema, dict) or not ("const" in schema or "enum" in schema):
        return None
    values = [schema["const"]] if "const" in schema else schema["enum"]
    return frozenset(_key(value) for value in values) if isinstance(values, list) else None


def _key(value: Any) -> tuple[str, Any]:
    """(its JSON type, a key equal for values JSON Schema calls equal: 1 and 1.0 at any depth, keys in any order)."""
    if isinstance(value, bool) or value is None:
        return ("boolean" if value is not None else "null", value)
    if isinstance(value, (int, float)):  # 1 and 1.0 are one JSON value: one kind, equal Decimals
        number = Decimal(repr(value))
        return ("integer" if number == number.to_integral_value() else "number", number)
    if isinstance(value, list):
        return ("array", tuple(map(_key, value)))
    if isinstance(value, dict):
        return ("object", tuple(sorted((str(k), _key(v)) for k, v in value.items())))
    return ("string" if isinstance(value, str) else "unknown", value if isinstance(value, str) else repr(value))


def json_equal(a: Any, b: Any) -> bool:
    """JSON Schema's equality of two instances (1 == 1.0, inside arrays and objects too)."""
    return _key(a) == _key(b)


def _types_overlap(a: frozenset[str], b: frozenset[str]) -> bool:
    return bool(a & b) or ("integer" in a and "number" in b) or ("number" in a and "integer" in b)


def disjoint(a: Shape, b: Shape) -> bool:
    if a.types is not None and b.types is not None and not _types_overlap(a.types, b.types):
        return True
    if a.values is not None and b.values is not None and a.values.isdisjoint(b.values):
        return True
    objects = frozenset({"object"})  # 'required' holds of objects alone: any other value may match both
    return a.types == b.types == objects and any(a.tags[name].isdisjoint(b.tags[name])
                                                 for name in a.tags.keys() & b.tags.keys())
