"""Calibration text: a fixed local default (the Python standard library's sources, which every machine has), or a
file of text lines or JSONL; tokenized, concatenated and cut into equal-length samples."""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from ..core.errors import ConfigError, InvalidRequestError


def default_texts() -> Iterator[str]:
    """The standard library's *.py files in a fixed order (the corpus of the tiny models' tokenizer)."""
    from ..models.tiny import stdlib_corpus

    for path in stdlib_corpus(max_files=10_000):
        yield path.read_text(encoding="utf-8", errors="replace")


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def _jsonl_text(line: str, where: str) -> str:
    try:
        value = json.loads(line)
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(f"{where} is not a whole JSON value ({exc}); a .jsonl/.json calibration file is "
                                  "JSON Lines: one JSON string, or object with a 'text' field, per line (not one JSON "
                                  "document such as an array)") from exc
    if isinstance(value, dict) and isinstance(value.get("text"), str):
        return value["text"]
    if isinstance(value, str):
        return value
    raise InvalidRequestError(f"{where} must be a JSON string or an object with a string 'text' field")


def read_texts(path: Path) -> list[str]:
    """Calibration texts from ``path``: JSONL when the suffix is .jsonl/.json or the first line is a JSON object,
    else one text per non-empty line (code that opens with a ``{`` line stays text)."""
    try:
        lines = [line for line in path.read_text(encoding="utf-8-sig").splitlines() if line.strip()]  # BOM or not
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"cannot read calibration file {str(path)!r}: {exc}") from exc
    if not lines:
        raise InvalidRequestError(f"calibration file {str(path)!r} holds no text")
    if path.suffix in (".jsonl", ".json") or _is_json_object(lines[0]):
        lines = [_jsonl_text(line, f"{path.name} line {i + 1}") for i, line in enumerate(lines)]
        if not any(text.strip() for text in lines):
            raise InvalidRequestError(f"calibration file {str(path)!r} holds only empty texts")
    return lines


def token_samples(tokenizer: Any, texts: Iterable[str], num_samples: int, seq_len: int) -> list[list[int]]:
    """Up to ``num_samples`` samples of ``seq_len`` tokens cut from the concatenated texts (fewer when the texts
    are short; one shorter sample when they hold under ``seq_len`` tokens)."""
    if num_samples < 1 or seq_len < 2:
        raise ConfigError(f"need num_samples >= 1 and seq_len >= 2, got {num_samples} and {seq_len}")
    ids: list[int] = []
    needed = num_samples * seq_len
    for text in texts:
        ids.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
        if len(ids) >= needed:
            break
    if len(ids) < 2:
        raise InvalidRequestError(f"the calibration text holds {len(ids)} token(s); give at least a few sentences")
    if len(ids) < seq_len:
        return [ids]
    return [ids[i: i + seq_len] for i in range(0, min(len(ids), needed) - seq_len + 1, seq_len)]
