"""Incremental detokenization: emit only text that can no longer change as more tokens arrive.

Two implementations with one contract (``add``, ``flush``, ``text``); :func:`detokenizer_factory` picks one per
tokenizer. Both produce ``tokenizer.decode(ids, skip_special_tokens=True)`` of the output, decoded after a few
prompt tokens of context.
"""
from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from typing import Any, Protocol

CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so that leading spaces come out right


class Detokenizer(Protocol):
    text: str  # everything emitted so far (the engine may cut it at a stop string)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; return the newly final text (possibly empty while a UTF-8 character is incomplete)."""

    def flush(self) -> str:
        """At the end: whatever is still held back (an incomplete character decodes as U+FFFD)."""


class IncrementalDetokenizer:
    """Any tokenizer: decode a window before and after the new tokens, emit the difference. Text once emitted
    stays: where a byte-fallback decoder would later read a run of byte tokens as invalid (U+FFFD for all of it), the
    bytes emitted before keep their text, so the whole may differ from one decode of the tokens."""

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.decode = text_decoder(tokenizer)
        self.ids = list(prompt_token_ids[-CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        if full.endswith("\ufffd"):
            return ""
        delta = full[_shared(prefix, full) :]
        if not delta:
            return ""
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        decode = self.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset])
        full = decode(self.ids[self.prefix_offset :])
        tail = full[_shared(prefix, full) :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += tail
        return tail


def _shared(prefix: str, full: str) -> int:
    """Where the new text starts in ``full``: past ``prefix``, the window decoded before, but before a character the
    window left open (its U+FFFD at the end of ``prefix``) that ``full`` completes: the prompt ended mid-character."""
    if full.startswith(prefix):
        return len(prefix)
    for n in range(len(prefix) - 1, len(prefix.rstrip("\ufffd")) - 1, -1):  # the fewest U+FFFD: an invalid byte
        if full.startswith(prefix[:n]):  # before the open character stays the prompt's
            return n
    return len(prefix)


class ByteLevelDetokenizer:
    """Byte-level BPE (GPT-2, Llama 3, Qwen): each token is a fixed byte string, so decoding is a table lookup and
    an incremental UTF-8 decoder, one per sequence; no window is decoded twice.

    A prompt whose last bytes leave a character open: if the output's first bytes complete it, the character is
    output; if they cannot, the prompt's bytes are dropped (they are the prompt's text, not a U+FFFD of the output).
    """

    def __init__(self, token_bytes: list[bytes], prompt_token_ids: list[int]) -> None:
        self.token_bytes = token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        context = codecs.getincrementaldecoder("utf-8")("replace")
        context.decode(b"".join(token_bytes[t] for t in prompt_token_ids[-CONTEXT_TOKENS:]))
        self.open = self.pending = context.getstate()[0]  # the open character's bytes; then with output bytes
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        table = self.token_bytes
        data = table[token_ids[0]] if len(token_ids) == 1 else b"".join(table[t] for t in token_ids)
        if self.open:
            data = self._resolve_open(data, final=False)
        delta = self.utf8.decode(data)
        self.text += delta
        return delta

    def flush(self) -> str:
        tail = self.utf8.decode(self._resolve_open(b"", final=True) if self.open else b"", final=True)
        self.text += tail
        return tail

    def _resolve_open(self, data: bytes, final: bool) -> bytes:
        """The bytes to decode now: none while the prompt's open character may still complete; then all of them
        if it did, or only the output's if it cannot."""
        self.pending += data
        probe = codecs.getincrementaldecoder("utf-8")("replace")
        text = probe.decode(self.pending, final=final)
        if not text and not final:
            return b""  # still a prefix of a valid character
        pending, open_bytes, self.open, self.pending = self.pending, self.open, b"", b""
        return pending[len(open_bytes) :] if text.startswith("\ufffd") else pending


def detokenizer_factory(tokenizer: Any, vocab_size: int = 0) -> Callable[[list[int]], Detokenizer]:
    """``factory(prompt_token_ids)`` -> a new detokenizer: the byte-level one when the tokenizer qualifies (see
    :func:`byte_level_table`), else the window-decoding one. ``vocab_size``: the model's, which may exceed the
    tokenizer's (padding rows): ids the tokenizer does not know decode to nothing, as in its own decode."""
    table = byte_level_table(tokenizer)
    if table is not None:
        table += [b""] * (vocab_size - len(table))
        return lambda prompt: ByteLevelDetokenizer(table, prompt)
    return lambda prompt: IncrementalDetokenizer(tokenizer, prompt)


def text_decoder(tokenizer: Any) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=True)``, calling the Rust tokenizer directly when that gives the
    same text (a fast tokenizer without space clean-up): the Python wrapper costs 4x the decode itself."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return lambda ids: backend.decode(ids, skip_special_tokens=True)
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _byte_of_char() -> dict[str, int]:
    """GPT-2's byte-level alphabet: printable Latin-1 bytes stand for themselves, the other 68 bytes are moved to
    U+0100 onwards, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + i): b for i, b in enumerate(moved)}}


# every pattern that transformers' clean_up_tokenization rewrites (" ." to ".", " n't" to "n't", ...)
SPACE_CLEANUP_PROBE = "a . b , c ! d ? e ' f n't g 'm h 's i 've j 're"


def cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether ``tokenizer.decode`` rewrites spaces that its Rust decoder keeps. The clean_up_tokenization_spaces
    flag alone does not say: transformers 5 ignores it for BPE tokenizers (Llama 3's config sets it). False for a
    tokenizer without a Rust backend: there is no decoder to compare with, and it is not byte-level either."""
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return False
    if not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return False
    ids = tokenizer.encode(SPACE_CLEANUP_PROBE, add_special_tokens=False)
    return tokenizer.decode(ids, skip_special_tokens=True) != \
        tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=True)


def byte_level_table(tokenizer: Any) -> list[bytes] | None:
    """The bytes of every token id (special tokens: none, as skip_special_tokens drops them), or None unless the
    tokenizer is a fast one whose decoder is exactly ByteLevel, without space clean-up (:func:`cleans_up_spaces`).
    A token holding a character outside the byte alphabet decodes to its own UTF-8, as the Rust decoder does.
    Checked against the tokenizer's own decode for every id, and for every added token between two others; any
    difference gives None."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or cleans_up_spaces(tokenizer):
        return None
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    byte_of = _byte_of_char()
    added = backend.get_added_tokens_decoder()
    size = backend.get_vocab_size(with_added_tokens=True)
    table = []
    for token_id in range(size):
        token = backend.id_to_token(token_id)
        if token is None or (token_id in added and added[token_id].special):
            table.append(b"")
        elif all(c in byte_of for c in token):
            table.append(bytes(byte_of[c] for c in token))
        else:
            table.append(token.encode("utf-8"))
    decode = backend.decode  # one call per id: faster here than decode_batch's thread pool (0.07 s for 128k ids)
    plain = next((i for i in range(size) if i not in added and table[i]), 0)
    checks = [[i] for i in range(size)] + [[plain, i, plain] for i in added]
    ok = all(b"".join(table[i] for i in ids).decode("utf-8", "replace") == decode(ids, skip_special_tokens=True)
             for ids in checks)
    return table if ok else None
