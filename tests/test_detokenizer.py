"""Incremental detokenizers against the tokenizer's own one-shot decode."""
from __future__ import annotations

import codecs
import random
from collections.abc import Callable

import pytest
import transformers
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


def test_a_character_the_prompt_left_open_is_completed_by_the_output_or_dropped(tokenizer):
    table = byte_level_table(tokenizer)
    lead, continuation = (table.index(bytes([b])) for b in "é".encode())  # C3 A9: one byte-level token per byte
    ascii_token = ascii_ids(tokenizer)[0]
    prompt = [*ascii_ids(tokenizer)[:3], lead]  # e.g. continuing an earlier output cut inside a character
    cases = {(continuation, ascii_token): "é", (ascii_token,): "", (continuation,): "é", (): ""}
    for output, head in cases.items():
        for split in range(len(output) + 1):  # the completing byte may come in a later add
            detok = ByteLevelDetokenizer(table, prompt)
            text = detok.add(list(output[:split])) if split else ""
            text += detok.add(list(output[split:])) if output[split:] else ""
            text += detok.flush()
            tail = table[ascii_token].decode() if ascii_token in output else ""
            assert text == detok.text == head + tail, (output, split)


def test_a_prompt_character_completed_over_several_adds_or_before_an_invalid_byte_comes_out(tokenizer):
    """The output completes the prompt's open character with its second token (a 3-byte "€" begun by the prompt):
    no add may read the character as broken before then; and an invalid byte right after the completed character
    is the output's own U+FFFD, the character before it kept. Expected: Python's UTF-8 decode of the joined bytes."""
    table = byte_level_table(tokenizer)
    ascii_prompt = ascii_ids(tokenizer)[:3]
    euro = [table.index(bytes([b])) for b in "€".encode()]  # E2 82 AC: one byte-level token per byte
    detok = ByteLevelDetokenizer(table, [*ascii_prompt, euro[0]])
    assert detok.add([euro[1]]) == ""  # still open
    assert detok.add([euro[2]]) + detok.flush() == detok.text == "€"
    lead, continuation = (table.index(bytes([b])) for b in "é".encode())
    for output in ([continuation, continuation], [continuation], [continuation, continuation, continuation]):
        detok = ByteLevelDetokenizer(table, [*ascii_prompt, lead])
        text = detok.add(output) + detok.flush()
        assert text == detok.text == (b"\xc3" + b"\xa9" * len(output)).decode("utf-8", "replace"), output


def test_a_token_outside_the_byte_alphabet_keeps_the_byte_table(tiny_model):
    """An added token of characters the byte alphabet lacks ("日本") decodes to its UTF-8, as the Rust decoder
    does: the table holds those bytes, and the tokenizer keeps the byte-level detokenizer."""
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    tok.add_tokens(["日本"])
    table = byte_level_table(tok)
    assert table is not None and table[tok.convert_tokens_to_ids("日本")] == "日本".encode()
    ids = tok.encode("a日本b", add_special_tokens=False)
    detok = detokenizer_factory(tok)([1, 2])
    assert isinstance(detok, ByteLevelDetokenizer) and detok.add(ids) + detok.flush() == "a日本b"


def test_a_decoder_that_rewrites_text_across_tokens_does_not_take_the_byte_table(tiny_model):
    """A ByteLevel decoder followed by a rewrite (a Sequence decoder, as some tokenizers ship) may change text that
    spans tokens, which no check of single tokens sees: only a plain ByteLevel decoder takes the table, and the
    text is the tokenizer's own decode."""
    from tokenizers import decoders

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    tok.backend_tokenizer.decoder = decoders.Sequence([decoders.ByteLevel(), decoders.Replace("qz", "!")])
    ids = [tok.convert_tokens_to_ids("q"), tok.convert_tokens_to_ids("z")]
    assert tok.decode(ids, skip_special_tokens=True) == "!"  # the rewrite spans the two tokens
    assert byte_level_table(tok) is None
    detok = detokenizer_factory(tok)([1, 2])
    assert detok.add(ids) + detok.flush() == "!"


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_after_an_open_prompt_character_the_text_is_the_completed_character_or_the_output_alone(tokenizer, data):
    """Any context and output: the prompt's open bytes are output only as part of a character the output completes;
    otherwise the text is the output's own decode (the Rust decode of the output ids)."""
    table = byte_level_table(tokenizer)
    prompt = data.draw(st.lists(st.integers(0, len(table) - 1), min_size=1, max_size=6))
    output = data.draw(st.lists(st.integers(0, len(table) - 1), max_size=12))
    detok = ByteLevelDetokenizer(table, prompt)
    text = "".join(run(detok, output, data.draw(st.randoms(use_true_random=False))))
    own = tokenizer.decode(output, skip_special_tokens=True)
    open_bytes = detok_open_bytes(table, prompt)
    joined = (open_bytes + b"".join(table[t] for t in output)).decode("utf-8", "replace")
    assert text == (joined if open_bytes and not joined.startswith("\ufffd") else own)


def detok_open_bytes(table: list[bytes], prompt: list[int]) -> bytes:
    """The context's trailing bytes that Python's UTF-8 decoder holds back: a character begun, not finished."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(table[t] for t in prompt[-5:]))
    return decoder.getstate()[0]


def test_ids_beyond_the_tokenizer_decode_to_nothing(tokenizer, tiny_model):
    """Models often have more embedding rows than tokenizer ids (Qwen2.5: 151,936 against 151,665)."""
    size = len(byte_level_table(tokenizer))
    make = detokenizer_factory(tokenizer, vocab_size=size + 8)
    detok = make([size + 3, 40])  # an unknown id in the prompt's context, too
    ascii_token = ascii_ids(tokenizer)[0]
    assert detok.add([size + 1, ascii_token, size + 7]) + detok.flush() == table_text(tokenizer, ascii_token)


def table_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=True)


def test_factory_picks_the_table_only_for_a_plain_byte_level_decoder(tokenizer, tiny_model):
    assert isinstance(detokenizer_factory(tokenizer)([1, 2]), ByteLevelDetokenizer)
    ids = tokenizer.encode("it 's one , isn't it ?", add_special_tokens=False)

    def text_of(detok: Detokenizer) -> str:
        return detok.add(ids) + detok.flush()

    tokenizer.clean_up_tokenization_spaces = True
    try:  # transformers 5 ignores the flag for BPE (Llama 3's tokenizer_config sets it): decode is the Rust one's
        if int(transformers.__version__.split(".")[0]) >= 5:
            assert isinstance(detokenizer_factory(tokenizer)([1, 2]), ByteLevelDetokenizer)
        assert text_of(detokenizer_factory(tokenizer)([1, 2])) == tokenizer.decode(ids, skip_special_tokens=True)
        tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = True
        cleaned = tokenizer.decode(ids, skip_special_tokens=True)  # space clean-up rewrites text across tokens
        assert cleaned != tokenizer.backend_tokenizer.decode(ids) and byte_level_table(tokenizer) is None
        assert isinstance(detok := detokenizer_factory(tokenizer)([1, 2]), IncrementalDetokenizer)
        assert text_of(detok) == cleaned
    finally:
        tokenizer.clean_up_tokenization_spaces = False
        tokenizer.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output = False
    from tokenizers import decoders

    other = AutoTokenizer.from_pretrained(str(tiny_model))
    other.backend_tokenizer.decoder = decoders.Metaspace()  # SentencePiece-style: not a byte table
    assert byte_level_table(other) is None


@pytest.fixture(scope="module")
def sentencepiece_like():
    """A Llama 2 / Mistral style tokenizer: "▁" for spaces, byte-fallback tokens <0xHH>, a decoder that strips the
    leading space: the window detokenizer's path (no byte table)."""
    import json

    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    model = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    model.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
    model.train_from_iterator(["the price of a quick brown fox jumps over the lazy dog"] * 20,
                              trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>", "<s>", "</s>"]))
    raw = json.loads(model.to_str())
    for byte in range(256):
        raw["model"]["vocab"].setdefault(f"<0x{byte:02X}>", len(raw["model"]["vocab"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(raw)), bos_token="<s>",
                                  eos_token="</s>", unk_token="<unk>", clean_up_tokenization_spaces=False)
    assert byte_level_table(tok) is None
    return tok


@pytest.mark.parametrize("step", [1, 4])
def test_a_prompt_that_ends_mid_character_is_completed_by_the_window_detokenizer(sentencepiece_like, step):
    """The prompt's last bytes open "€" and the output's first byte completes it: the output's text is the
    character and what follows, as the tokenizer decodes them (the character and the space after it were lost)."""
    tok = sentencepiece_like
    byte = {b: tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in (0xE2, 0x82, 0xAC)}
    prompt = tok.encode("the price", add_special_tokens=False) + [byte[0xE2], byte[0x82]]
    output = [byte[0xAC]] + tok.encode("dog", add_special_tokens=False)
    detok = detokenizer_factory(tok)(prompt)
    text = "".join(detok.add(output[i:i + step]) for i in range(0, len(output), step)) + detok.flush()
    assert text == detok.text == tok.decode(prompt + output)[len("the price"):] == "€ dog"


def test_an_invalid_prompt_byte_before_the_open_character_stays_the_prompts(tokenizer):
    """The window detokenizer (a byte-level tokenizer can take that path too: clean_up_tokenization_spaces set): the
    prompt ends in an invalid byte and then "€" begun, which the output completes. The output's text is the character
    and what follows, as the byte table reads them (every trailing U+FFFD of the window was taken for the open
    character, so the invalid byte's came out too)."""
    table = byte_level_table(tokenizer)
    ff, *euro = (table.index(bytes([b])) for b in (0xFF, *"€".encode()))
    prompt = [*ascii_ids(tokenizer)[:3], ff, *euro[:2]]
    output = [euro[2], *ascii_ids(tokenizer)[3:6]]
    windowed, table_read = IncrementalDetokenizer(tokenizer, prompt), ByteLevelDetokenizer(table, prompt)
    texts = [detok.add(output) + detok.flush() for detok in (windowed, table_read)]
    assert texts[0] == texts[1] == "€" + b"".join(table[t] for t in output[1:]).decode()


@pytest.mark.parametrize("name", ["bytes", "window"])
def test_a_second_flush_adds_nothing(tokenizer, sentencepiece_like, name):
    """A finished sequence emitted again (after an interrupted step) is flushed again: nothing more comes out, and
    the text stays the tokenizer's decode."""
    tok = tokenizer if name == "bytes" else sentencepiece_like
    lead = byte_level_table(tok).index(b"\xe2") if name == "bytes" else tok.convert_tokens_to_ids("<0xE2>")
    prompt = tok.encode("the quick", add_special_tokens=False)
    output = tok.encode(" brown fox", add_special_tokens=False) + [lead]  # ends inside a character: held to the end
    detok = detokenizer_factory(tok)(prompt)
    assert isinstance(detok, ByteLevelDetokenizer if name == "bytes" else IncrementalDetokenizer)
    text = detok.add(output) + detok.flush()
    assert text.endswith("\ufffd") and detok.flush() == "" and detok.add([]) == "" and detok.text == text
    context = tok.decode(prompt[-5:], skip_special_tokens=True)
    assert text == tok.decode(prompt[-5:] + output, skip_special_tokens=True)[len(context):]


@pytest.mark.parametrize("name", ["bytes", "window", "window-on-byte-level"])
def test_a_character_split_over_output_tokens_comes_out_whole_once_complete(tokenizer, sentencepiece_like, name):
    """Output tokens one at a time, "€" spelled by three byte tokens between words: nothing of it comes out until
    its last byte (no U+FFFD in the stream), then the character; the text is the tokenizer's decode."""
    tok = sentencepiece_like if name == "window" else tokenizer
    if name == "window":
        euro = [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in "€".encode()]
    else:
        euro = [byte_level_table(tok).index(bytes([b])) for b in "€".encode()]
    prompt = tok.encode("the price", add_special_tokens=False)
    words = [tok.encode(w, add_special_tokens=False) for w in (" of a fox", " dog", " the lazy")]
    output = [*words[0], *euro, *words[1], *euro, *euro, *words[2]]
    detok = ByteLevelDetokenizer(byte_level_table(tok), prompt) if name == "bytes" else \
        IncrementalDetokenizer(tok, prompt)
    deltas = [detok.add([t]) for t in output] + [detok.flush()]
    context = tok.decode(prompt[-5:], skip_special_tokens=True)
    assert "".join(deltas) == detok.text == tok.decode(prompt[-5:] + output, skip_special_tokens=True)[len(context):]
    assert "\ufffd" not in detok.text and detok.text.count("€") == 3
    start = len(words[0])
    assert deltas[start : start + 3] == ["", "", "€"]  # held until complete, then out at once


def test_a_special_token_between_words_keeps_the_window_detokenizers_spaces(sentencepiece_like):
    """A special token has no text: the window stays on the words before it, so the next word's leading space (which
    this decoder strips at the start of a decode) comes out as in the tokenizer's decode."""
    tok = sentencepiece_like
    prompt = tok.encode("the price", add_special_tokens=False)
    output = [*tok.encode(" of a fox", add_special_tokens=False), tok.eos_token_id,
              *tok.encode(" dog", add_special_tokens=False)]
    detok = IncrementalDetokenizer(tok, prompt)
    text = "".join(detok.add([t]) for t in output) + detok.flush()
    context = tok.decode(prompt[-5:], skip_special_tokens=True)
    assert text == tok.decode(prompt[-5:] + output, skip_special_tokens=True)[len(context):]
