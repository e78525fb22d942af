"""Incremental detokenization: emit only text that can no longer change as more tokens arrive."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so that leading spaces come out right


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.decode = text_decoder(tokenizer)
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly final text (possibly empty while a UTF-8 character is incomplete)."""
        self.ids.extend(token_ids)
        decode = self.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""
        delta = full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""
        decode = self.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        tail = decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += tail
        return tail


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, calling the Rust tokenizer directly when that gives the
    same text (a fast tokenizer without space clean-up): the Python wrapper costs 4x the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)
