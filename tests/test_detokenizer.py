"""Incremental detokenizers against the tokenizer's own one-shot decode."""
from __future__ import annotations

import random
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from infer.core.detokenizer import (ByteLevelDetokenizer, Detokenizer, IncrementalDetokenizer, byte_level_table,
                                    detokenizer_factory)

ADDED = ["héllo", "ĠĠzz", "a b", "<tool>"]  # outside the byte alphabet, inside it, with a raw space, plain ASCII


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    tok.add_tokens(ADDED)
    tok.add_special_tokens({"additional_special_tokens": ["<|special|>"]})
    return tok


def implementations(tokenizer) -> dict[str, Callable[[list[int]], Detokenizer]]:
    table = byte_level_table(tokenizer)
    assert table is not None, "the tiny models' byte-level BPE must take the table path"
    return {"bytes": lambda prompt: ByteLevelDetokenizer(table, prompt),
            "rust-decode": lambda prompt: IncrementalDetokenizer(tokenizer, prompt)}


def run(detok: Detokenizer, output: list[int], rng: random.Random) -> list[str]:
    chunks, start = [], 0
    while start < len(output):
        step = rng.randint(1, 3)
        chunks.append(detok.add(output[start : start + step]))
        start += step
    return chunks + [detok.flush()]


@pytest.mark.parametrize("name", ["bytes", "rust-decode", "python-decode"])
def test_incremental_text_equals_one_decode(tokenizer, name):
    tokenizer.clean_up_tokenization_spaces = name == "python-decode"
    try:
        make = (lambda prompt: IncrementalDetokenizer(tokenizer, prompt)) if name == "python-decode" \
            else implementations(tokenizer)[name]
        rng = random.Random(4)
        special, added = sorted(tokenizer.all_special_ids), tokenizer.convert_tokens_to_ids(ADDED)
        for trial in range(30):  # random ids split multi-byte characters and mix in special and added tokens
            prompt = [rng.randrange(3, 1000) for _ in range(7)]
            output = [rng.randrange(len(tokenizer)) for _ in range(40)]
            output[::9] = [special[trial % len(special)]] * len(output[::9])
            output[4::11] = [added[trial % len(added)]] * len(output[4::11])
            context = tokenizer.decode(prompt[-5:], skip_special_tokens=True)
            full = tokenizer.decode(prompt[-5:] + output, skip_special_tokens=True)
            if context.endswith("\ufffd"):  # the context ends inside a character: see the test below
                continue
            assert full.startswith(context)
            detok = make(prompt)
            chunks = run(detok, output, rng)
            assert "".join(chunks) == detok.text == full[len(context) :]
    finally:
        tokenizer.clean_up_tokenization_spaces = False


def ascii_ids(tokenizer) -> list[int]:
    table = byte_level_table(tokenizer)
    return [i for i, b in enumerate(table) if b and max(b) < 0x80]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_byte_table_text_equals_the_rust_decode_for_any_output(tokenizer, data):
    """Any output ids (lone continuation bytes, split characters, special and added tokens) after an ASCII
    context: the emitted text is the output's part of the tokenizer's decode of context + output."""
    table = byte_level_table(tokenizer)
    prompt = data.draw(st.lists(st.sampled_from(ascii_ids(tokenizer)), min_size=1, max_size=8))
    output = data.draw(st.lists(st.integers(0, len(table) - 1), max_size=30))
    detok = ByteLevelDetokenizer(table, prompt)
    text = "".join(run(detok, output, data.draw(st.randoms(use_true_random=False))))
    context = tokenizer.decode(prompt[-5:], skip_special_tokens=True)
    assert text == detok.text == tokenizer.decode(prompt[-5:] + output, skip_special_tokens=True)[len(context) :]


def test_byte_table_completes_a_character_the_prompt_left_open(tokenizer):
    table = byte_level_table(tokenizer)
    e_acute = "é".encode()  # C3 A9: one byte-level token per byte
    first, second = (table.index(bytes([b])) for b in e_acute)
    detok = ByteLevelDetokenizer(table, [*ascii_ids(tokenizer)[:3], first])
    assert detok.add([second]) == "é"
    detok = ByteLevelDetokenizer(table, [first])  # a lone lead byte then ASCII: replaced, as the Rust decode does
    ascii_token = ascii_ids(tokenizer)[0]
    assert detok.add([ascii_token]) + detok.flush() == "\ufffd" + table[ascii_token].decode()


def test_factory_picks_the_table_only_for_a_plain_byte_level_decoder(tokenizer, tiny_model):
    assert isinstance(detokenizer_factory(tokenizer)([1, 2]), ByteLevelDetokenizer)
    tokenizer.clean_up_tokenization_spaces = True  # space clean-up rewrites text across tokens: no table
    try:
        assert byte_level_table(tokenizer) is None
        assert isinstance(detokenizer_factory(tokenizer)([1, 2]), IncrementalDetokenizer)
    finally:
        tokenizer.clean_up_tokenization_spaces = False
    from tokenizers import decoders

    other = AutoTokenizer.from_pretrained(str(tiny_model))
    other.backend_tokenizer.decoder = decoders.Metaspace()  # SentencePiece-style: not a byte table
    assert byte_level_table(other) is None
