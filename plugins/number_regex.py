"""Regexes of the JSON numbers within bounds, for JSON schemas' ``minimum``/``maximum``/``exclusive...``: integers
as JSON writes them (no leading zeros, no ``-0``), and numbers without an exponent under decimal bounds, inclusive
or exclusive (``-0``, ``-0.0`` only where negative values are within too). Built digit by digit: a number's integer
part is compared first, then the digits of its fraction, ``0.f`` against the bound's as decimals (a shorter one
padded with zeros).
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from decimal import Decimal

ANY_FRACTION = r"(?:\.[0-9]+)?"
# a bound on the digits f of a fraction 0.f: the bound's own digits (trailing zeros stripped: "" is 0), and
# whether it is exclusive
DigitBound = tuple[str, bool]


def integer_range(low: float, high: float) -> str:
    """A regex of the JSON integers in [low, high] (bounds integers or infinite), written as JSON writes them (no
    ``-0``, no leading zeros)."""
    parts = []
    if high >= 0:
        parts.append(_magnitudes(max(low, 0), high))
    if low < 0:
        parts.append("-" + _magnitudes(max(1, -high), -low))
    return alternatives(parts)


def number_range(low: Decimal | None, low_strict: bool, high: Decimal | None, high_strict: bool) -> str | None:
    """A regex of the JSON numbers without an exponent above ``low`` and below ``high`` (None: unbounded; strict:
    exclusive), or None when there are none."""
    if low is not None and high is not None and (low > high or low == high and (low_strict or high_strict)):
        return None
    parts = []
    if high is None or high > 0 or high == 0 and not high_strict:  # written without a sign
        at_least = (low, low_strict) if low is not None and low >= 0 else (Decimal(0), False)
        parts.append(_magnitude_range(*at_least, high, high_strict))
    if low is None or low < 0:  # "-" and the magnitude
        above = (-high, high_strict) if high is not None and high <= 0 else (Decimal(0), False)
        magnitude = _magnitude_range(*above, None if low is None else -low, low_strict)
        parts.append(None if magnitude is None else "-" + magnitude)
    found = [part for part in parts if part is not None]
    return alternatives(found) if found else None


def _magnitude_range(low: Decimal, low_strict: bool, high: Decimal | None, high_strict: bool) -> str | None:
    """Non-negative numbers (no sign) from ``low`` >= 0 to ``high``: by their integer part, then their fraction."""
    low_int, low_digits = _split(low)
    if high is None:
        parts = [_with_fraction(str(low_int), (low_digits, low_strict), None),
                 _magnitudes(low_int + 1, math.inf) + ANY_FRACTION]
    else:
        high_int, high_digits = _split(high)
        if low_int == high_int:
            parts = [_with_fraction(str(low_int), (low_digits, low_strict), (high_digits, high_strict))]
        else:
            parts = [_with_fraction(str(low_int), (low_digits, low_strict), None),
                     _magnitudes(low_int + 1, high_int - 1) + ANY_FRACTION if high_int - low_int > 1 else None,
                     _with_fraction(str(high_int), None, (high_digits, high_strict))]
    found = [part for part in parts if part is not None]
    return alternatives(found) if found else None


def _split(value: Decimal) -> tuple[int, str]:
    """The integer part of ``value`` >= 0 and its fraction's digits, trailing zeros stripped."""
    integer = int(value)
    text = format(value - integer, "f")
    return integer, text.partition(".")[2].rstrip("0")


def _with_fraction(integer: str, low: DigitBound | None, high: DigitBound | None) -> str | None:
    """``integer`` and an optional fraction whose digits lie within the bounds; None when none do."""
    digits, bare = _fraction_digits(low, high)
    if digits is None:
        return integer if bare else None
    return integer + (rf"(?:\.{digits})?" if bare else rf"\.{digits}")


def _fraction_digits(low: DigitBound | None, high: DigitBound | None) -> tuple[str | None, bool]:
    """The digit strings f, with 0.f within the bounds (None: unbounded): a regex of the non-empty ones (None:
    none), and whether the empty one (no fraction: 0) is within."""
    if low == ("", False):  # at least 0: no bound
        low = None
    bare = low is None and (high is None or high[0] != "" or not high[1])
    if low is None and high is None:
        return "[0-9]+", True
    if high is not None and high[0] == "":  # at most 0 (or below it): zeros, where that is within
        return ("0+", True) if bare else (None, False)
    if high is None and low is not None and low[0] == "":  # above 0
        return "0*[1-9][0-9]*", False
    tails: dict[str, list[str]] = {}
    for digit in "0123456789":  # the first digit against each bound's: above it (free), at it, or past it
        if _breaks(digit, low, above=True) or _breaks(digit, high, above=False):
            continue
        rest, empty = _fraction_digits(_after(digit, low), _after(digit, high))
        if rest is not None or empty:
            tail = "" if rest is None else rest if not empty else f"(?:{rest})?"
            tails.setdefault(tail, []).append(digit)
    return alternatives(_digit_set(digits) + tail for tail, digits in tails.items()) if tails else None, bare


def _breaks(digit: str, bound: DigitBound | None, above: bool) -> bool:
    """Whether a first ``digit`` puts the fraction past ``bound`` (below it where the bound is a lower one)."""
    return bound is not None and digit != _first(bound) and (digit > _first(bound)) != above


def _after(digit: str, bound: DigitBound | None) -> DigitBound | None:
    """The bound on the digits after a first ``digit`` that does not break it: the bound's own rest where the digit
    is the bound's first (0 past its end), None where the digit already clears it."""
    if bound is None or digit != _first(bound):
        return None
    return bound[0][1:], bound[1]


def _first(bound: DigitBound) -> str:
    return bound[0][:1] or "0"


def _digit_set(digits: list[str]) -> str:
    """A class of ``digits`` (ascending)."""
    if int(digits[-1]) - int(digits[0]) == len(digits) - 1:
        return _digit_class(digits[0], digits[-1])
    return "[" + "".join(digits) + "]"


def _magnitudes(low: float, high: float) -> str:
    """Non-negative integers in [low, high] without leading zeros (low finite, high possibly infinite)."""
    low = int(low)
    if high == math.inf:  # every length from low's up: low's own length from low, longer ones whole
        longer = f"[1-9][0-9]{{{len(str(low))},}}"
        return alternatives([_magnitudes(low, 10 ** len(str(low)) - 1), longer])
    high = int(high)
    parts = []
    for length in range(len(str(low)), len(str(high)) + 1):
        first, last = max(low, 10 ** (length - 1) if length > 1 else 0), min(high, 10 ** length - 1)
        if first <= last:
            parts.append(_same_length(str(first), str(last)))
    return alternatives(parts)


def _same_length(low: str, high: str) -> str:
    """Digit strings of one length from ``low`` to ``high``, by their first digit."""
    if not low:
        return ""
    rest = len(low) - 1
    if low[0] == high[0]:
        return low[0] + _same_length(low[1:], high[1:])
    if low[1:] == "0" * rest and high[1:] == "9" * rest:
        return _digit_class(low[0], high[0]) + _any_digits(rest)
    parts = [low[0] + _same_length(low[1:], "9" * rest)]
    if int(high[0]) - int(low[0]) > 1:
        parts.append(_digit_class(str(int(low[0]) + 1), str(int(high[0]) - 1)) + _any_digits(rest))
    parts.append(high[0] + _same_length("0" * rest, high[1:]))
    return alternatives(parts)


def _digit_class(low: str, high: str) -> str:
    return low if low == high else f"[{low}-{high}]"


def _any_digits(count: int) -> str:
    return "" if count == 0 else "[0-9]" if count == 1 else f"[0-9]{{{count}}}"


def alternatives(parts: Iterable[str]) -> str:
    """One regex of the ``parts`` (each a regex), each once."""
    unique = list(dict.fromkeys(parts))
    return unique[0] if len(unique) == 1 else "(?:" + "|".join(unique) + ")"
