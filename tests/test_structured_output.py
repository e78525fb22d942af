"""Structured output (SamplingParams.structured_output) against references: a greedy loop over the HF transformers
model whose every step keeps only the tokens that the `regex` module's partial matching (an independent regex
engine) says can continue a match, and EOS once the text is a whole match; Python's json and a hand check for
JSON schemas; token masks against a per-token walk. Also: sampling, n > 1, async scheduling, speculative decoding
beside, and every refusal."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any
from pathlib import Path

import pytest
import regex
import torch

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import InvalidRequestError
from infer.core.request import FinishReason, SamplingParams, StructuredOutput
from infer.models.tiny import PRETRAINED_DIR

PROMPT = [5, 17, 42, 99, 3, 250, 5, 17, 42, 7]


@pytest.fixture(scope="module")
def path(checkpoint: Callable[[str], Path]) -> Path:
    return checkpoint("llama")


@pytest.fixture(scope="module")
def engine(path: Path) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=128))


@pytest.fixture(scope="module")
def token_bytes(engine: Engine) -> list[bytes | None]:
    return token_table(engine)


def token_table(engine: Engine) -> list[bytes | None]:
    """Each token's bytes by the tokenizer's own byte alphabet (transformers' GPT-2 table, not infer's), None for
    special tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_of = {c: b for b, c in bytes_to_unicode().items()}
    tokenizer = engine.tokenizer
    special = set(tokenizer.all_special_ids)
    tokens = tokenizer.convert_ids_to_tokens(list(range(engine.loaded.model.spec.vocab_size)))
    return [None if token is None or t in special else bytes(byte_of[c] for c in token)
            for t, token in enumerate(tokens)]


def readable(data: bytes) -> str | None:
    """``data`` as text, an unfinished last character replaced by the least one its bytes can begin (None: not
    UTF-8): exact for classes that hold all or none of the characters such a beginning spans."""
    for cut in range(len(data), max(len(data) - 4, -1), -1):
        try:
            head = data[:cut].decode("utf-8")
        except UnicodeDecodeError:
            continue
        tail = data[cut:]
        if not tail:
            return head
        size = 2 if tail[0] < 0xE0 else 3 if tail[0] < 0xF0 else 4
        filler = {0xE0: b"\xa0", 0xF0: b"\x90"}.get(tail[0], b"\x80") if len(tail) == 1 else b"\x80"
        try:
            return head + (tail + filler + b"\x80" * (size - len(tail) - 1)).decode("utf-8")
        except UnicodeDecodeError:
            return None
    return None


def reference_greedy(path: Path, pattern: str, table: list[bytes | None], eos: frozenset[int], max_tokens: int,
                     prompt: list[int] = PROMPT) -> list[int]:
    """Greedy decoding of ``prompt`` over the HF model, each step's argmax taken over the tokens whose bytes keep
    the output a prefix of a match (regex's partial fullmatch), and EOS when the output is a whole match."""
    compiled = regex.compile(pattern)
    return masked_greedy(path, lambda text: compiled.fullmatch(text, partial=True) is not None,
                         lambda text: compiled.fullmatch(text) is not None, table, eos, max_tokens, prompt)


def masked_greedy(path: Path, live: Callable[[str], bool], whole: Callable[[str], bool], table: list[bytes | None],
                  eos: frozenset[int], max_tokens: int, prompt: list[int] = PROMPT) -> list[int]:
    """Greedy decoding of ``prompt`` over the HF model, each step's argmax taken over the tokens whose bytes keep
    the output ``live`` (a prefix of some whole output), and EOS when the output is ``whole``."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out: list[int] = []
    data = b""
    for _ in range(max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        allowed = [t for t, piece in enumerate(table) if piece and (text := readable(data + piece)) is not None
                   and live(text)]
        if (text := readable(data)) is not None and data.decode("utf-8", "ignore") == text and whole(text):
            allowed += sorted(eos)
        token = max(allowed, key=lambda t: logits[t].item())
        out.append(token)
        if token in eos:
            break
        data += table[token]
    return out


SPECS = [
    StructuredOutput(regex=r"[0-9]{3}-[a-z]+"),
    StructuredOutput(regex=r"(yes|no|maybe)!?"),
    StructuredOutput(choice=("def", "class Foo", "import os")),
    StructuredOutput(json_schema={"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                                   "age": {"type": "integer", "minimum": -3,
                                                                           "maximum": 120}},
                                  "required": ["name", "age"]}),
    StructuredOutput(json_schema={"type": "object"}),  # "JSON object mode": any object, nested to any depth
    StructuredOutput(json_schema={"$defs": {"node": {  # recursive: a tree of any depth, as a grammar
        "type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9}, "kids": {
            "type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}}, "required": ["v"]}},
        "$ref": "#/$defs/node"}),
]


def pattern_of(spec: StructuredOutput) -> str:
    """The spec as a pattern of the `regex` module; a recursive schema's rules as named groups of a DEFINE block,
    which their (?&name) calls reach."""
    from infer.plugins.fsm_output import escape
    from infer.plugins.json_schema_regex import schema_to_rules

    if spec.choice is not None:
        return "|".join(escape(c) for c in spec.choice)
    if spec.json_schema is None:
        return spec.regex
    rules = schema_to_rules(spec.json_schema)
    return "(?(DEFINE)" + "".join(f"(?P<{name}>{body})" for name, body in rules.items() if name != "root") + ")" + \
        rules["root"] if len(rules) > 1 else rules["root"]


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.kind)
def test_greedy_equals_a_masked_hf_loop(engine: Engine, path: Path, token_bytes: list[bytes | None],
                                        spec: StructuredOutput) -> None:
    out = engine.generate([PROMPT], SamplingParams(max_tokens=24, temperature=0, structured_output=spec))[0]
    completion = out.outputs[0]
    assert completion.token_ids == reference_greedy(path, pattern_of(spec), token_bytes, engine.eos_token_ids, 24)
    if completion.finish_reason is FinishReason.STOP:
        assert regex.fullmatch(pattern_of(spec), completion.text)
    if spec.json_schema is not None and completion.finish_reason is FinishReason.STOP:
        value = json.loads(completion.text)
        if "properties" in json.loads(spec.json_schema):
            assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 6
            assert -3 <= value["age"] <= 120
        assert isinstance(value, dict)


def test_sampled_outputs_match_the_pattern(engine: Engine) -> None:
    """Temperature 1 with n = 3: every completion ends at EOS as a whole match, or at max_tokens as a prefix of
    one."""
    pattern = r"(ab|cd)+[0-9]{1,3}"
    params = SamplingParams(max_tokens=12, temperature=1.0, n=3, seed=7, structured_output=StructuredOutput(
        regex=pattern))
    for out in engine.generate([PROMPT, PROMPT[:4]], params):
        for completion in out.outputs:
            if completion.finish_reason is FinishReason.STOP:
                assert re.fullmatch(pattern, completion.text), completion.text
            else:
                assert regex.fullmatch(pattern, completion.text, partial=True), completion.text


def test_a_recursive_schema_samples_valid_trees(engine: Engine) -> None:
    """Temperature 1.5, n = 8: every completion ended at EOS is a tree the small validator accepts, some of them
    nested (the rules recur), and every one cut by max_tokens a prefix of one (the `regex` module's partial match
    of the rules)."""
    from test_json_schema_regex import valid

    spec = SPECS[5]
    schema = json.loads(spec.json_schema)
    outs = engine.generate([PROMPT, PROMPT[:4]], SamplingParams(max_tokens=40, temperature=1.5, n=8, seed=3,
                                                                structured_output=spec))
    completions = [c for out in outs for c in out.outputs]
    whole = [json.loads(c.text) for c in completions if c.finish_reason is FinishReason.STOP]
    assert whole and all(valid(tree, schema, schema) for tree in whole)
    assert any(kid for tree in whole for kid in tree.get("kids", [])), whole
    for c in completions:
        assert regex.fullmatch(pattern_of(spec), c.text, partial=True), c.text


def test_json_object_mode_samples_json_objects(engine: Engine) -> None:
    """{"type": "object"} at temperature 1: a completion that ends at EOS is a JSON object (json.loads), one cut
    by max_tokens is a prefix of one."""
    spec = StructuredOutput(json_schema={"type": "object"})
    pattern = pattern_of(spec)
    params = SamplingParams(max_tokens=30, temperature=1.0, n=4, seed=3, structured_output=spec)
    texts = []
    for out in engine.generate([PROMPT, '{"name": "Ada", "langs": ['], params):
        for completion in out.outputs:
            texts.append(completion.text)
            if completion.finish_reason is FinishReason.STOP:
                assert isinstance(json.loads(completion.text), dict), completion.text
            else:
                assert regex.fullmatch(pattern, completion.text, partial=True), completion.text
    assert any(len(text) > 2 for text in texts)  # not only "{}"


def test_unstructured_requests_beside_are_unchanged(engine: Engine) -> None:
    plain = SamplingParams(max_tokens=16, temperature=0)
    alone = engine.generate([PROMPT], plain)[0].outputs[0].token_ids
    structured = SamplingParams(max_tokens=16, temperature=0, structured_output=StructuredOutput(regex="[a-z ]+"))
    mixed = engine.generate([PROMPT, PROMPT, PROMPT[:5]], [plain, structured, plain])
    assert mixed[0].outputs[0].token_ids == alone
    assert re.fullmatch("[a-z ]*", mixed[1].outputs[0].text)


def test_async_scheduling_and_speculative_decoding_keep_the_outputs() -> None:
    """On the shipped pair: the same structured greedy outputs synchronously, under async scheduling (the masks
    follow the tokens read back a step late) and with the draft model proposing for the plain request beside, and
    with spec_decode.structured for the structured requests too (their drafts verified under masks walked along
    them), which speculate only then; and with the jump-forward proposer, which drafts the text the grammar forces
    (the regex's four spaces, the rest of a choice once its first token picked it) for the structured requests
    only."""
    model = str(PRETRAINED_DIR / "target")
    prompts = ["def fibonacci(n):", "import os\n", "class Point:"]
    spec = StructuredOutput(regex=r"\n    (return|if|for) [a-z_]+( [=<>+-]+ [a-z0-9_]+)?:?\n")
    params = [SamplingParams(max_tokens=20, temperature=0, structured_output=spec),
              SamplingParams(max_tokens=20, temperature=0),
              SamplingParams(max_tokens=20, temperature=0, structured_output=StructuredOutput(
                  choice=(" # a point", " pass")))]
    results = []
    draft = {"proposer": "draft-model", "num_speculative_tokens": 3}
    drafted = []
    for options in ({}, {"async_scheduling": True}, draft,
                    {**draft, "plugin_options": {"spec_decode": {"structured": True}}},
                    {"proposer": "jump-forward", "num_speculative_tokens": 4}):
        engine = Engine(EngineConfig(model=model, device="cpu", num_kv_blocks=64, **options))
        outs = engine.generate(prompts, params)
        results.append([[c.token_ids for c in out.outputs] for out in outs])
        drafted.append([out.metrics.get("spec_proposed", 0) > 0 for out in outs])
    assert results[0] == results[1] == results[2] == results[3] == results[4]
    assert drafted[2:] == [[False, True, False], [True, True, True], [True, False, True]]
    assert engine.stats.spec_accepted > 0  # forced tokens taken several a step
    assert re.fullmatch(r"\n    (return|if|for) [a-z_]+( [=<>+-]+ [a-z0-9_]+)?:?\n",
                        engine.tokenizer.decode(results[0][0][0], skip_special_tokens=True))


@pytest.mark.parametrize("spec, words", [
    (StructuredOutput(regex="(a"), "regex"),
    (StructuredOutput(regex=r"(a)\1"), "backreference"),
    (StructuredOutput(json_schema={"type": "object", "properties": {"a": {"type": "integer", "multipleOf": 3}}}),
     "multipleOf"),
    (StructuredOutput(json_schema="{not json"), "JSON"),
    (StructuredOutput(regex=".*a.{999}"), "automaton grows past"),  # 2**1000 states: refused, not built per step
    (StructuredOutput(json_schema={"type": "string", "pattern": "^[ab]*a[ab]{15}$"}),  # 2**16 states: not a grammar
     "JSON schema cannot be followed: as a regex, its automaton grows past 20000 states"),
    (StructuredOutput(json_schema={"type": "array", "items": {"type": "string", "maxLength": 1000},
                                   "maxItems": 1000}), "JSON schema cannot be followed.*too large"),
    (StructuredOutput(json_schema={"$defs": {"node": {"type": "object", "properties": {"next": {
        "$ref": "#/$defs/node"}}, "required": ["next"]}}, "$ref": "#/$defs/node"}),  # no finite value: next, next...
     "JSON schema cannot be followed: as a grammar, rule 'node_0' can never be completed"),
    (StructuredOutput(json_schema={"$defs": {"n": {"type": "object", "properties": {"k": {"$ref": "#/$defs/n"}, "s": {
        "type": "string", "pattern": "(" * 400 + "a" + ")" * 400}}}}, "$ref": "#/$defs/n"}), "nest too deeply"),
])
def test_a_spec_the_backend_cannot_follow_is_refused_at_admission(engine: Engine, spec: StructuredOutput,
                                                                  words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        engine.add_request(PROMPT, SamplingParams(structured_output=spec))
    assert not engine.has_unfinished()


@pytest.mark.parametrize("params, words", [
    (SamplingParams(structured_output=StructuredOutput()), "exactly one"),
    (SamplingParams(structured_output=StructuredOutput(regex="a", choice=("b",))), "exactly one"),
    (SamplingParams(structured_output=StructuredOutput(choice=())), "non-empty"),
    (SamplingParams(structured_output=StructuredOutput(choice=("a", ""))), "non-empty"),
    (SamplingParams(structured_output=StructuredOutput(regex=5)), "string"),  # type: ignore[arg-type]
    (SamplingParams(structured_output=StructuredOutput(grammar=b"root ::= x")),  # type: ignore[arg-type]
     "grammar must be a string"),
    (SamplingParams(structured_output=StructuredOutput(regex="a", grammar='root ::= "a"')), "exactly one"),
    (SamplingParams(structured_output=StructuredOutput(grammar="root ::= " + "x" * 100_000)), "grammar has"),
    (SamplingParams(structured_output="[a-z]+"), "infer.StructuredOutput"),  # type: ignore[arg-type]
    (SamplingParams(ignore_eos=True, structured_output=StructuredOutput(regex="a")), "ignore_eos"),
    (SamplingParams(min_tokens=2, structured_output=StructuredOutput(regex="a+")), "min_tokens"),
    (SamplingParams(structured_output=StructuredOutput(regex="a" * 100_001)), "characters"),
])
def test_malformed_specs_are_refused(params: SamplingParams, words: str) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        params.validate()


def test_a_model_without_eos_is_refused(engine: Engine, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(engine.intake, "eos_token_ids", frozenset())
    with pytest.raises(InvalidRequestError, match="EOS"):
        engine.add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(regex="a")))


def test_the_spec_travels_over_grpc(engine: Engine, serve_engine: Any) -> None:
    """Each kind of spec round-trips through the proto; a served request is structured as one run in process;
    a spec the server's backend refuses is INVALID_ARGUMENT with its message."""
    import grpc

    from infer.server.client import build_request
    from infer.server.convert import sampling_params_of

    specs = [SPECS[0], SPECS[2], SPECS[3], StructuredOutput(grammar='root ::= "[" ([0-9] | root)* "]"')]
    for spec in specs:
        params = SamplingParams(max_tokens=9, temperature=0, structured_output=spec)
        assert sampling_params_of(build_request(PROMPT, params)) == params
    want = [engine.generate([PROMPT], SamplingParams(max_tokens=12, temperature=0, structured_output=spec))[0]
            .outputs[0].token_ids for spec in specs]

    async def test(client: Any, port: int) -> None:
        for spec, ids in zip(specs, want):
            done = await client.complete(PROMPT, max_tokens=12, temperature=0.0, structured_output=spec)
            assert list(done.outputs[0].token_ids) == ids
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await client.complete(PROMPT, structured_output=StructuredOutput(regex="(?=a)"))
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT and "lookahead" in refused.value.details()

    serve_engine(engine, test)


def test_generate_regex_choice_and_json_schema_options(path: Path, tmp_path: Path) -> None:
    from click.testing import CliRunner

    from infer.cli.main import main

    schema = tmp_path / "schema.json"
    schema.write_text(SPECS[3].json_schema)
    base = ["--model", str(path), "--num-kv-blocks", "32", "generate", "hello", "--json", "--max-tokens", "24"]
    choices = [part for choice in SPECS[2].choice for part in ("--choice", choice)]
    grammar = tmp_path / "digits.gbnf"
    grammar.write_text('root ::= digit{3} "-" letters  # SPECS[0] as a grammar\ndigit ::= [0-9]\nletters ::= [a-z]+')
    for more, spec in ((["--regex", SPECS[0].regex], SPECS[0]), (choices, SPECS[2]),
                       (["--json-schema", str(schema)], SPECS[3]), (["--grammar", str(grammar)], SPECS[0])):
        result = CliRunner().invoke(main, base + more)
        assert result.exit_code == 0, result.output
        line = json.loads(result.stdout)
        whole = line["finish_reason"] == "stop"  # else cut by --max-tokens: a prefix of a match
        assert regex.fullmatch(pattern_of(spec), line["text"], partial=not whole), line
    for more, words in ((["--regex", "a", "--choice", "b"], "give one of"),
                        (["--regex", "(a"], "invalid regex"),
                        (["--regex", "a+", "--ignore-eos"], "ignore_eos"),
                        (["--json-schema", str(tmp_path / "none.json")], "cannot read"),
                        (["--grammar", str(tmp_path / "none.gbnf")], "cannot read"),
                        (["--regex", "a", "--grammar", str(grammar)], "not --regex and --grammar"),
                        (["--regex", "a", "--beam-width", "2"], "--regex/--choice/--json-schema")):
        result = CliRunner().invoke(main, base + more)
        assert result.exit_code == 2 and words in result.output, result.output


def test_a_backend_that_breaks_its_contract_is_named(path: Path) -> None:
    """A compile result that is no Grammar, a float mask, and a bool mask narrower than the vocabulary: each a
    PluginError naming the backend, before any logits are masked."""
    from infer.core.errors import PluginError
    from infer.core.hookspecs import hookimpl
    from infer.core.interfaces import Grammar, GrammarMatcher, StructuredOutputBackend
    from infer.core.plugins import PluginManager

    masks = {"float": torch.ones(3), "narrow": torch.ones(3, dtype=torch.bool)}

    class WrongMask(GrammarMatcher):
        def __init__(self, mask: torch.Tensor) -> None:
            self.mask = mask

        def allowed(self) -> torch.Tensor:
            return self.mask

        def advance(self, token_id: int) -> None:
            pass

    class Compiled(Grammar):
        def __init__(self, mask: torch.Tensor, reuse: object = True) -> None:
            self.mask, self.reuse = mask, reuse

        def matcher(self) -> GrammarMatcher:
            return WrongMask(self.mask)

        def reusable(self) -> bool:
            return self.reuse  # type: ignore[return-value]

    class Broken(StructuredOutputBackend):
        def compile(self, spec: StructuredOutput) -> Grammar:
            if spec.regex == "reused":
                return Compiled(masks["float"], reuse="yes")
            return Compiled(masks[spec.regex]) if spec.regex in masks else "not a grammar"  # type: ignore[return-value]

    class Plugin:
        @hookimpl
        def register_structured_output_backends(self, register: Any) -> None:
            register("broken", lambda config, vocabulary: Broken())

    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="broken-backend")
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16,
                                 structured_output_backend="broken"), plugins)
    with pytest.raises(PluginError, match="'broken'.*not a Grammar"):
        engine.add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(regex="x")))
    with pytest.raises(PluginError, match="'broken'.*bool"):
        engine.generate([PROMPT], SamplingParams(structured_output=StructuredOutput(regex="float")))
    with pytest.raises(PluginError, match=r"'broken'.*shape \(3,\), not bool"):
        engine.generate([PROMPT], SamplingParams(structured_output=StructuredOutput(regex="narrow")))
    with pytest.raises(PluginError, match=r"'broken': a grammar's reusable\(\) returned 'yes', not a bool"):
        for _ in range(2):  # the second finds the first's grammar in the cache, and asks whether it may reuse it
            engine.add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(regex="reused")))


def test_an_allow_list_without_the_backend_still_runs_plain_requests(path: Path) -> None:
    """The backend is built at the first structured request: an INFER_PLUGINS list written before it existed
    keeps working, and a structured request is refused naming the entry point to add."""
    from infer.core.plugins import PluginManager

    plugins = PluginManager.from_entry_points("continuous,paged,eviction,attention-backends,llama-family")
    engine = Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=16), plugins)
    assert engine.generate([PROMPT], SamplingParams(max_tokens=3))[0].finished
    with pytest.raises(InvalidRequestError, match="fsm-output"):
        engine.add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(regex="a")))


def counting_engine(path: Path, compiled: list[StructuredOutput], **options: Any) -> Engine:
    """An engine whose fsm backend records each spec it compiles in ``compiled``."""
    from infer.core.hookspecs import hookimpl
    from infer.core.plugins import PluginManager
    from infer.plugins.fsm_output import FsmBackend

    class Counting(FsmBackend):
        def compile(self, spec: StructuredOutput):  # type: ignore[no-untyped-def]
            compiled.append(spec)
            return super().compile(spec)

    class Plugin:
        @hookimpl
        def register_structured_output_backends(self, register: Any) -> None:
            register("counting", lambda config, vocabulary: Counting(vocabulary))

    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="counting-backend")
    return Engine(EngineConfig(model=str(path), device="cpu", num_kv_blocks=64, structured_output_backend="counting",
                               **options), plugins)


def test_a_live_request_keeps_its_grammar_past_the_cache(path: Path) -> None:
    """More distinct specs queued than the grammar cache holds: each is compiled once, at admission."""
    from infer.core.structured_output import CACHED_GRAMMARS

    compiled: list[StructuredOutput] = []
    engine = counting_engine(path, compiled, max_num_seqs=4)
    specs = [StructuredOutput(regex=f"x{i}y") for i in range(CACHED_GRAMMARS + 16)]
    outs = engine.generate([PROMPT] * len(specs), [SamplingParams(max_tokens=8, structured_output=s) for s in specs])
    assert len(compiled) == len(specs) and not engine.structured.pinned
    assert all(f"x{i}y".startswith(out.outputs[0].text) for i, out in enumerate(outs))


def test_a_tokenizer_that_cleans_up_spaces_is_refused_naming_the_flag(path: Path, tmp_path: Path) -> None:
    """Refused where decode cleans up; transformers 5 ignores the flag for BPE tokenizers (Llama 3's config sets
    it), and such a tokenizer's text is its tokens' bytes: followed, as without the flag."""
    import shutil

    import transformers

    config = json.loads((path / "tokenizer_config.json").read_text())
    engines = {}
    for name, flags in (("flag", {"clean_up_tokenization_spaces": True}), ("forced", {
            "clean_up_tokenization_spaces": True,
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output": True})):
        shutil.copytree(path, copy := tmp_path / name)
        (copy / "tokenizer_config.json").write_text(json.dumps({**config, **flags}))
        engines[name] = Engine(EngineConfig(model=str(copy), device="cpu", num_kv_blocks=16))
    with pytest.raises(InvalidRequestError, match="clean_up_tokenization_spaces"):
        engines["forced"].add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(regex="a")))
    if int(transformers.__version__.split(".")[0]) >= 5:
        out = engines["flag"].generate([PROMPT], SamplingParams(max_tokens=8, structured_output=StructuredOutput(
            regex="a ?, ?b")))[0].outputs[0]
        assert out.text in ("a,b", "a ,b", "a, b", "a , b") and out.finish_reason is FinishReason.STOP


def test_an_empty_regex_allows_only_eos_and_a_schema_that_is_not_json_is_refused(engine: Engine) -> None:
    out = engine.generate([PROMPT], SamplingParams(max_tokens=4, structured_output=StructuredOutput(regex="")))[0]
    assert (out.outputs[0].text, out.outputs[0].finish_reason) == ("", FinishReason.STOP)
    assert out.outputs[0].token_ids[-1] in engine.eos_token_ids
    with pytest.raises(InvalidRequestError, match="not JSON"):
        engine.add_request(PROMPT, SamplingParams(structured_output=StructuredOutput(json_schema={"enum": {1}})))


def test_the_grammar_cache_keeps_the_most_recently_used_specs(path: Path) -> None:
    """CACHED_GRAMMARS finished specs stay compiled; past that, the least recently used is dropped, not the oldest."""
    from infer.core.structured_output import CACHED_GRAMMARS

    compiled: list[StructuredOutput] = []
    engine = counting_engine(path, compiled, max_num_seqs=4)
    specs = [StructuredOutput(regex=f"x{i}y") for i in range(CACHED_GRAMMARS + 1)]

    def run(*chosen: StructuredOutput) -> None:
        engine.generate([PROMPT] * len(chosen), [SamplingParams(max_tokens=1, structured_output=s) for s in chosen])

    run(*specs[:CACHED_GRAMMARS])
    run(specs[0])
    assert compiled == specs[:CACHED_GRAMMARS]
    run(specs[CACHED_GRAMMARS])
    run(specs[0])
    assert compiled == specs
    run(specs[1])
    assert compiled == specs + [specs[1]]


def test_finished_sequences_leave_no_structured_state(thinking_model: Path, tmp_path: Path) -> None:
    """A chat under a reasoning parser (thinking off), with jump-forward drafts: once its sequences finish, no
    per-sequence matcher, count, copy answer or reasoning gate is left behind."""
    from infer import ChatPrompt

    template = tmp_path / "chat.jinja"
    template.write_text("{%- for m in messages %}<|{{ m.role }}|>\n{{ m.content }}\n{%- endfor %}<|assistant|>\n"
                        "<think>\n\n</think>\n\n")
    engine = Engine(EngineConfig(model=str(thinking_model), device="cpu", num_kv_blocks=64, chat_template=str(template),
                                 reasoning_parser="qwen3", proposer="jump-forward", num_speculative_tokens=2))
    spec = StructuredOutput(regex="[a-z] is a long answer")
    [out] = engine.generate([ChatPrompt.of([{"role": "user", "content": "hi"}])],
                            SamplingParams(max_tokens=12, temperature=0, n=2, structured_output=spec))
    assert engine.stats.spec_proposed > 0 and out.finished
    structured = engine.structured
    assert (structured.matchers, structured.taken, structured.walkable, structured.gates) == ({}, {}, {}, {})


def fsm_structured_outputs(engine: Engine) -> Any:
    """The engine's StructuredOutputs over a fresh fsm backend of its vocabulary, apart from the engine."""
    from infer.core.interfaces import Vocabulary
    from infer.core.structured_output import StructuredOutputs
    from infer.plugins.fsm_output import FsmBackend

    size = engine.loaded.model.spec.vocab_size
    vocabulary = Vocabulary(engine.tokenizer, size, engine.eos_token_ids, torch.device("cpu"))
    return StructuredOutputs(lambda: FsmBackend(vocabulary), "fsm", size)


def structured_sequence(engine: Engine, structured: Any, spec: StructuredOutput, max_tokens: int) -> Any:
    from infer.core.request import Sequence

    structured.admit(spec)
    return Sequence(0, "r", list(PROMPT), SamplingParams(max_tokens=max_tokens, structured_output=spec), 0.0,
                    eos_token_ids=engine.eos_token_ids)


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_a_draft_walk_verifies_no_draft_past_the_length_limit(engine: Engine, max_tokens: int) -> None:
    """walk_drafts stops at the draft that reaches max_tokens (its sequence stops there), so at most
    max_tokens - num_output_tokens drafts are worth verifying; within the limit, every draft the grammar allows is."""
    structured = fsm_structured_outputs(engine)
    seq = structured_sequence(engine, structured, StructuredOutput(regex="abcd"), max_tokens)
    drafts = [engine.tokenizer.convert_tokens_to_ids(c) for c in "abcd"]
    walk = structured.walk_drafts(seq, drafts)
    assert walk.verified == min(max_tokens, len(drafts)) and not walk.refused


@pytest.mark.parametrize("max_tokens, stop", [(9, "eos"), (2, "b")])
def test_a_draft_guide_forces_no_text_past_a_stop(engine: Engine, max_tokens: int, stop: str) -> None:
    """A proposer drafting under draft_guide: the grammar forces "bcd" after "a", but once a draft stops the
    sequence (EOS, or the token that reaches max_tokens) no text follows, so none is forced."""
    structured = fsm_structured_outputs(engine)
    seq = structured_sequence(engine, structured, StructuredOutput(regex="abcd"), max_tokens)
    guide = structured.draft_guide(seq)
    guide.advance(engine.tokenizer.convert_tokens_to_ids("a"))
    assert guide.forced_text() == "bcd"
    guide.advance(min(engine.eos_token_ids) if stop == "eos" else engine.tokenizer.convert_tokens_to_ids(stop))
    assert guide.forced_text() == ""


def nested_digit_lists(text: str) -> tuple[bool, bool]:
    """(whether ``text`` is a prefix of a sentence of LISTS, whether it is one), read by hand."""
    depth, previous = 0, ""
    for i, char in enumerate(text):
        if char == "[":
            ok, depth = previous in ("", "[", ","), depth + 1
        elif char == "]":
            ok, depth = previous in ("[", "]") or previous.isdigit(), depth - 1
        elif char == ",":
            ok = depth > 0 and (previous == "]" or previous.isdigit())
        else:
            ok = char in "0123456789" and previous in ("[", ",")
        if not ok or depth < 0 or (depth == 0 and i < len(text) - 1):
            return False, False
        previous = char
    return True, bool(text) and depth == 0


LISTS = 'root ::= list\nlist ::= "[" (item ("," item)*)? "]"\nitem ::= [0-9] | list\n'


def test_a_grammar_grown_past_its_bound_serves_its_requests_and_later_ones_get_a_new_compile(path: Path) -> None:
    """A pushdown automaton keeps the configurations its outputs reached; once it holds more than its bound
    (lowered here on the live grammar), a new request gets a fresh compile while the requests under way keep the
    grown one, and it leaves the cache when the last of them ends."""
    compiled: list[StructuredOutput] = []
    engine = counting_engine(path, compiled, max_num_seqs=4)
    spec = StructuredOutput(grammar=LISTS)
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=3, structured_output=spec)
    texts = [out.outputs[0] for out in engine.generate([PROMPT] * 2, params)]
    first = engine.structured.grammars[spec]
    assert len(compiled) == 1 and first.reusable()  # both requests shared one compile
    first.max_reused_configurations = 0
    engine.add_request(PROMPT, params, request_id="a")
    second = engine.structured.grammars[spec]
    assert len(compiled) == 2 and second is not first
    outs: dict[str, list[str]] = {}
    for _ in range(2):
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out.outputs[0].text)
    second.max_reused_configurations = 0  # grown while "a" runs: "b" gets a third compile, "a" keeps its own
    engine.add_request(PROMPT, params, request_id="b")
    third = engine.structured.grammars[spec]
    assert len(compiled) == 3 and third is not second
    assert engine.structured.matchers[engine.requests["a"].seqs[0].seq_id].grammar is second
    third.max_reused_configurations = 0
    while engine.has_unfinished():
        for out in engine.step():
            outs.setdefault(out.request_id, []).append(out.outputs[0].text)
    assert spec not in engine.structured.grammars and not engine.structured.pinned  # dropped with its last request
    for completion in texts:
        prefix, whole = nested_digit_lists(completion.text)
        assert prefix and whole == (completion.finish_reason is FinishReason.STOP)
    assert all(nested_digit_lists("".join(parts))[0] for parts in outs.values()) and set(outs) == {"a", "b"}


def test_logit_controls_still_apply_under_the_structured_mask(engine: Engine) -> None:
    """logit_bias with a choice: the mask applies to the biased logits, so a +100 bias on the first token of the
    choice the greedy output skips makes that choice the output (both stay allowed by the mask)."""
    choices = ("red", "blue")
    spec = StructuredOutput(choice=choices)
    plain = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, structured_output=spec))[0]
    picked = plain.outputs[0].text
    assert picked in choices
    other = choices[1 - choices.index(picked)]
    first = engine.tokenizer.encode(other, add_special_tokens=False)[0]
    biased = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0, structured_output=spec,
                                                      logit_bias={first: 100.0}))[0]
    assert biased.outputs[0].text == other
