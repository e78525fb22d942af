"""The CLI and bad input: clear one-line errors, no traceback, non-zero exit; the engine keeps serving."""
from __future__ import annotations

import json
import os
import logging
import math
import re
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

from infer.cli import main
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import ConfigError, InvalidRequestError
from infer.core.request import SamplingParams


def run(*args: str, input: str | bytes | None = None):
    return CliRunner().invoke(main, list(args), input=input)


def test_generate_prints_text(tiny_model):
    result = run("--model", str(tiny_model), "generate", "hello", "--max-tokens", "8", "--ignore-eos")
    assert result.exit_code == 0, result.output
    assert result.output.startswith("hello") and len(result.output.strip()) > len("hello")


def test_generate_json_lines_are_the_engines_completions(tiny_model):
    """--json: one object per completion, in prompt order, equal to what LLM.generate returns."""
    from infer import LLM, SamplingParams

    args = ("--max-tokens", "5", "--n", "2", "--temperature", "0.8", "--seed", "4")
    result = run("--model", str(tiny_model), "--device", "cpu", "generate", "def f():\n", "x =", *args, "--json")
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in result.output.splitlines()]
    expected = LLM(str(tiny_model), device="cpu").generate(["def f():\n", "x ="], SamplingParams(
        max_tokens=5, n=2, temperature=0.8, seed=4))
    assert [(r["prompt_index"], r["index"]) for r in rows] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for row in rows:
        out = expected[row["prompt_index"]].outputs[row["index"]]
        assert (row["text"], row["token_ids"], row["finish_reason"]) == (out.text, out.token_ids, "length")
    assert run("generate", "x", "--json", "--stream").exit_code == 2


def test_generate_reads_stdin_streams_and_prints_stats(tiny_model):
    result = run("--model", str(tiny_model), "generate", "--max-tokens", "4", "--stream", "--stats",
                 input="first prompt\nsecond prompt\n")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert lines[0].startswith("first prompt") and lines[1].startswith("second prompt")
    stats = json.loads(result.output[result.output.index("{"):])
    assert stats["requests_finished"] == 2 and "prefix_hit_rate" in stats


@pytest.mark.parametrize("stream", [[], ["--stream"]], ids=["batch", "stream"])
def test_a_prompt_that_can_never_fit_stops_generate_before_any_output(tiny_model, stream):
    result = run("--model", str(tiny_model), "--max-num-batched-tokens", "8", "generate", "hi",
                 "hello world this is a long prompt with many tokens in it", "--max-tokens", "3", *stream)
    assert result.exit_code == 1 and result.stdout == "", result.output
    assert result.stderr.startswith("Error: prompt 2 of 2: prompt of ") and "--max-num-batched-tokens" in result.stderr
    result = run("--model", str(tiny_model), "--num-kv-blocks", "2", "generate", "hi", "--max-tokens", "40", *stream)
    assert result.exit_code == 1 and result.stdout == ""
    assert "tokens with max_tokens 40 needs up to 3 KV blocks" in result.stderr and "has only 2;" in result.stderr


def test_stream_prints_each_prompts_completion_whole_and_in_order(tiny_model):
    from infer import LLM, SamplingParams

    prompts = ["def f():", "import os", "x = 1"]
    result = run("--model", str(tiny_model), "--device", "cpu", "generate", *prompts, "--max-tokens", "6",
                 "--ignore-eos", "--stream")
    assert result.exit_code == 0, result.output
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = LLM(str(tiny_model), device="cpu").generate(prompts, greedy)
    assert result.stdout == "".join(p + r.outputs[0].text + "\n" for p, r in zip(prompts, expected))


def test_plugins_lists_the_shipped_components():
    result = run("plugins", "--json")
    rows = {(r["kind"], r["name"]) for r in json.loads(result.output)}
    assert {("scheduler", "continuous"), ("kv_cache", "paged"), ("attention_backend", "torch")} <= rows


def test_plugins_lists_the_declared_options_and_the_cli_checks_them_before_loading(tiny_model):
    """The shipped quant methods and the ngram proposer declare their plugin options at registration: infer plugins
    shows them, and a misspelt one stops the command before the model loads (it failed in the factory, if ever)."""
    from infer.plugins.awq import AWQ_OPTIONS

    rows = {r["name"]: r["options"] for r in json.loads(run("plugins", "--json").output)}
    assert rows["awq"] == {key: {"accepts": o.expected(), "default": o.default, "help": o.help}
                           for key, o in AWQ_OPTIONS.items()}
    assert {k: v for k, v in rows["awq"]["fused_max_rows"].items() if k != "help"} == {  # written out, not derived
        "accepts": "an integer >= 0", "default": 64}
    assert rows["fp8"]["backend"]["accepts"] == "one of auto, scaled_mm, triton, emulate"
    assert set(rows["ngram"]) == {"min_n", "max_n"} and rows["paged"] == {}
    listed = run("plugins", "--options").output
    for name in ("awq.fused_max_rows", "fp8.backend", "ngram.max_n", "spec_decode.probe_every"):
        assert name in listed
    missing = str(tiny_model) + "-does-not-exist"  # the check comes first: no model is looked for
    result = run("--model", missing, "--plugin-option", "ngram.max_m=3", "generate", "x")
    assert result.exit_code == 2 and "ngram has no option 'max_m'; did you mean ngram.max_n?" in result.output


def _bad_folders(tmp_path, tiny_model):
    unsupported = tmp_path / "unsupported"
    shutil.copytree(tiny_model, unsupported)
    config = json.loads((unsupported / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (unsupported / "config.json").write_text(json.dumps(config))
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(tiny_model / "config.json", no_weights)
    pickle_only = tmp_path / "pickle-only"
    shutil.copytree(no_weights, pickle_only)
    (pickle_only / "pytorch_model.bin").write_bytes(b"not loaded")
    truncated = tmp_path / "truncated"  # an interrupted download
    shutil.copytree(tiny_model, truncated)
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    no_tokenizer = tmp_path / "no-tokenizer"
    shutil.copytree(tiny_model, no_tokenizer)
    for file in no_tokenizer.glob("tokenizer*"):
        file.unlink()
    return unsupported, no_weights, pickle_only, truncated, no_tokenizer


# (command line, message, exit status): 2 for an option's value or options together, 1 for a prompt it refuses
BAD_REQUESTS = [
    (["generate", ""], "prompt is empty", 1),
    (["generate", "hi", "--max-tokens", "2000"], "exceeds the model's context length 1024", 1),
    (["generate", "hi", "--max-tokens", "0"], r"max_tokens \(--max-tokens\) must be a positive integer", 2),
    (["generate", "hi", "--temperature", "-1"], r"temperature \(--temperature\) must be a number >= 0", 2),
    (["generate", "hi", "--temperature", "nan"], r"temperature \(--temperature\) must be a number >= 0", 2),
    (["generate", "hi", "--top-p", "0"], r"top_p \(--top-p\) must be a number in \(0, 1\]", 2),
    (["generate", "hi", "--top-p", "1.5"], r"top_p \(--top-p\) must be a number in \(0, 1\]", 2),
    (["generate", "hi", "--seed", str(2**63)], r"seed \(--seed\) must be an integer in \[0, 2\*\*63\)", 2),
    (["generate", "hi", "--beam-width", "-1"], r"beam_width \(--beam-width\) must be an integer >= 1, got -1", 2),
    (["generate", "hi", "--length-penalty", "2"], "--length-penalty scores beam search's hypotheses; add --beam-width",
     2),
    (["generate", "a\udcffb"], r"the prompt is not valid UTF-8 text \(character 2 is '\\udcff'", 1),
    (["--kv-cache-memory-gb", "inf", "generate", "hi"], "kv-cache-memory-gb .* must be a finite number", 2),
    (["--swap-space-gb", "nan", "--preemption", "swap", "generate", "hi"], "swap-space-gb .* must be a finite", 2),
    (["--swap-space-gb", "1e7", "--preemption", "swap", "generate", "hi"], r"the swap space \(.* GiB\) exceeds? "
     "the memory this machine has available", 2),
    (["--num-kv-blocks", "1000000000", "generate", "hi"], r"the KV pool \(1000000000 blocks, .* GiB\) exceeds the "
     "memory this machine has available", 2),
    (["--device", "cuda:abc", "generate", "hi"], "device must be auto, cpu, cuda or cuda:N, got 'cuda:abc'", 2),
    (["--seed", str(2**70), "generate", "hi"], r"seed must be in \[0, 2\*\*63\)", 2),
    (["--seed", "-1", "generate", "hi"], r"seed must be in \[0, 2\*\*63\)", 2),
    (["--max-num-seqs", "0", "generate", "hi"], "max-num-seqs must be a positive integer, got 0", 2),
    (["--cpu-threads", "0", "generate", "hi"], r"cpu-threads must be in \[1, 1024\]", 2),
    (["--kv-admission-reserve", "2", "generate", "hi"], r"kv-admission-reserve must be a number in \[0, 1\]", 2),
    (["--kv-cache", "nope", "generate", "hi"], "unknown kv cache 'nope'; registered kv caches:", 2),
    (["--plugin", "nope", "generate", "hi"], "unknown plugin 'nope'", 2),
    (["generate", "--stream", "hi", ""], "prompt 2 of 2: prompt is empty", 1),
]


@pytest.mark.parametrize("args,message,status", BAD_REQUESTS)
def test_bad_requests_fail_cleanly(tiny_model, args, message, status):
    result = run("--model", str(tiny_model), *args)
    assert result.exit_code == status
    assert "Traceback" not in result.output
    assert __import__("re").search(message, result.output), result.output


def test_bad_models_and_plugins_fail_cleanly(tmp_path, tiny_model):
    unsupported, no_weights, pickle_only, truncated, no_tokenizer = _bad_folders(tmp_path, tiny_model)
    cases = [
        (["--model", str(no_tokenizer)], "has no tokenizer \\(none of tokenizer.json, .*copy the tokenizer files"),
        (["--model", str(truncated)], "is not a readable safetensors file .* fetch it again"),
        (["--model", str(tiny_model), "--max-model-len", "100000"], "exceeds the 1024 positions the model supports"),
        (["--model", str(tiny_model), "--proposer", "draft-model", "--num-speculative-tokens", "2", "--draft-model",
          str(tmp_path / "nope")], "draft model folder .* does not exist; pass --draft-model DIR"),
        (["--plugin", "nope"], "unknown plugin 'nope'; registered components:"),
        (["--model", str(tmp_path / "missing")], "does not exist"),
        (["--model", str(unsupported)], "unsupported architecture 'GPT2LMHeadModel'; supported: .*LlamaForCausalLM"),
        (["--model", str(no_weights)], "has no \\*.safetensors weight files"),
        (["--model", str(pickle_only)], "refuses pickle files"),
    ]
    for options, message in cases:
        result = run(*options, "generate", "hi")
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert __import__("re").search(message, result.output), result.output


def test_an_attention_backend_the_device_cannot_run_is_a_usage_error(tiny_model, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # the suite's interpreter would run it on CPU tensors
    result = run("--model", str(tiny_model), "--device", "cpu", "--attention", "triton", "generate", "hi")
    assert result.exit_code == 2 and "the triton attention backend needs a CUDA GPU" in result.stderr
    assert "drop --attention for the device's default (cpu on a CPU)" in result.stderr


def test_engine_keeps_serving_after_bad_requests(tiny_model):
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    bad = [("", SamplingParams()), ([], SamplingParams()), ("hi", SamplingParams(max_tokens=5000)),
           ("hi", SamplingParams(max_tokens=0)), ("hi", SamplingParams(temperature=-0.5)),
           ("hi", SamplingParams(temperature=math.nan)), ("hi", SamplingParams(top_p=0.0)),
           ([5, 10**9], SamplingParams())]
    good = engine.add_request("hello", SamplingParams(max_tokens=6, ignore_eos=True))
    for prompt, params in bad:
        with pytest.raises(InvalidRequestError):
            engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
    assert engine.stats.requests_finished == 1 and good not in engine.requests


def test_fresh_install_generates_with_the_embedded_default():
    infer = shutil.which("infer") or pytest.fail("the `infer` console script is not installed")
    proc = subprocess.run([infer, "generate", "hello", "--max-tokens", "8"], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("hello") and "demo model" in proc.stderr


def test_the_design_card_example_runs_on_the_embedded_default(caplog):
    """`infer --plugin radix-cache --quant awq generate ...`: RTN int4 on load, picking a group size that divides."""
    caplog.set_level(logging.INFO, logger="infer")
    result = run("-v", "--plugin", "radix-cache", "--quant", "awq", "generate", "def f():", "--max-tokens", "8")
    assert result.exit_code == 0, result.output
    assert "kv_cache radix-cache" in caplog.text and "quant awq" in caplog.text  # the engine-ready line
    assert "awq: quantizing on load with round-to-nearest (int4, group 128, or 64/32" in caplog.text
    assert result.output.startswith("def f():")


def test_the_size_check_counts_the_parameters_a_built_model_has(tiny_model_factory):
    """make-tiny-model's memory check counts parameters before building: against the safetensors of built ones."""
    import math

    from safetensors import safe_open

    from infer.models.tiny import parameter_count

    for arch, hidden, layers, tied in (("llama", 64, 2, False), ("llama", 128, 3, True), ("mixtral", 64, 2, False)):
        path = tiny_model_factory(arch, hidden_size=hidden, num_layers=layers, intermediate_size=2 * hidden,
                                  tie_word_embeddings=tied)
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            built = sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        experts = 4 if arch == "mixtral" else 0
        assert parameter_count(hidden, layers, 2 * hidden, tied, vocab_size=vocab, experts=experts) == built


@pytest.mark.parametrize("args,message", [
    (["--hidden-size", "0"], "hidden-size must be >= 1, got 0"),
    (["--num-layers", "0"], "num-layers must be >= 1, got 0"),
    (["--hidden-size", "30"], "hidden-size 30 must split into 4 heads of an even size"),
    (["--num-layers", "100000000"], "hidden size 64 x 100000000 layers has "),  # it allocated until killed
])
def test_make_tiny_model_checks_sizes_before_writing(tmp_path, args, message):
    result = run("make-tiny-model", str(tmp_path / "m"), *args)
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output
    assert list(tmp_path.iterdir()) == []  # neither the folder nor its temporary stand-in


@pytest.mark.parametrize("group, command", [
    (["--model", "m", "--plugin", "radix-cache"], ["make-tiny-model", "{tmp}/out"]),
    (["--seed", "3", "--no-prefix-caching", "--plugin-option", "awq.group_size=32"], ["client", "hi"]),
    (["--kv-cache", "paged"], ["plugins"]),
])
def test_commands_that_build_no_engine_refuse_the_group_options(tmp_path, group, command):
    """They would be ignored without a word: `infer --seed 3 client` would not seed anything."""
    result = run(*group, *(arg.format(tmp=tmp_path) for arg in command))
    assert result.exit_code == 2 and f"the options before `{command[0]}`" in result.output
    given = sorted(arg for arg in group if arg.startswith("--"))
    assert f"({', '.join(given)}) configure an engine" in result.output and not (tmp_path / "out").exists()


def test_make_tiny_model_does_not_overwrite_a_folder(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    result = run("make-tiny-model", str(tmp_path))
    assert result.exit_code != 0 and "already exists and is not an empty folder" in result.output
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_make_tiny_model_refuses_unusable_paths_and_seeds_cleanly(tmp_path):
    (tmp_path / "a-file").write_text("")
    result = run("make-tiny-model", str(tmp_path / "a-file" / "m"))
    assert result.exit_code == 2 and "a-file is a file, so" in result.output and "Traceback" not in result.output
    result = run("make-tiny-model", str(tmp_path / "m"), "--seed", str(2**64))
    assert result.exit_code == 2 and "Invalid value for '--seed'" in result.output
    result = run("make-tiny-model", str(tmp_path / "m"), "--hidden-size", str(2**24))  # 64 GiB of embeddings
    assert result.exit_code == 2 and "lower --hidden-size or --num-layers" in result.output, result.output
    assert "Traceback" not in result.output and {p.name for p in tmp_path.iterdir()} == {"a-file"}
    result = run("make-tiny-model", str(tmp_path / "m"))
    assert result.exit_code == 0 and {p.name for p in tmp_path.iterdir()} == {"a-file", "m"}
    mask = os.umask(0o077)
    os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "m", *(tmp_path / "m").iterdir())}
    assert modes == {name: (0o777 if name == "m" else 0o666) & ~mask for name in modes}  # as mkdir and open give


def test_ctrl_c_in_any_command_exits_130_and_says_so(tiny_model, tmp_path):
    """Commands without their own report (here quantize, mid-calibration) end as generate does, not with click's
    "Aborted!" and status 1; quantize leaves no OUT folder."""
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.Popen([sys.executable, "-P", "-m", "infer.cli", "-v", "quantize", str(tiny_model), str(out),
                             "--num-samples", "99999999", "--seq-len", "16"], stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None and "calibration text holds" in proc.stderr.readline()  # calibration begins
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and err.strip().endswith("interrupted") and "Aborted" not in err, err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == []


def test_stdin_lines_may_end_in_crlf_after_a_byte_order_mark(tiny_model):
    """What a Windows editor saves: a BOM first, CRLF line ends; neither reaches the prompts."""
    result = run("--model", str(tiny_model), "generate", "--json", "--max-tokens", "1",
                 input="\ufeffok\r\nx\r\n")
    assert result.exit_code == 0 and [json.loads(line)["prompt"] for line in result.output.splitlines()] == ["ok", "x"]


def test_stdin_bytes_that_are_not_utf8_name_their_line_whatever_the_locale(tiny_model, chat_model):
    """A strict UTF-8 stdin (a UTF-8 locale's, CliRunner's) failed the read itself with a traceback: now the line is
    named, and in a chat the turns before it get their replies."""
    result = run("--model", str(tiny_model), "generate", "--max-tokens", "1", input=b"ok\ndef f\xff(\n")
    assert result.exit_code == 1 and not isinstance(result.exception, UnicodeDecodeError), result.output
    assert "character 6 is '\\udcff'" in result.output and "(stdin line 2)" in result.output
    chat = run("--model", str(chat_model), "--num-kv-blocks", "64", "chat", "--max-tokens", "2", "--temperature", "0",
               input=b"hi\nbad \xff\n")
    assert chat.exit_code == 1 and chat.stdout.count("\n") == 1, chat.output  # the reply to "hi"
    assert "turn refused: chat message" in chat.stderr and "not valid UTF-8 text" in chat.stderr


def test_ctrl_c_while_streaming_exits_130_and_says_so(tiny_model):
    import signal
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-P", "-m", "infer.cli", "--model", str(tiny_model), "generate",
                             "--stream", "--ignore-eos", "--max-tokens", "1000", "hello"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stdout.read(5) == "hello"  # streaming has begun
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted: printed 0 of 1 prompts' completions in full" in err, err
    assert "Traceback" not in err


def test_conflicting_plugin_choices_are_refused(tiny_model):
    result = run("--model", str(tiny_model), "--plugin", "lru", "--plugin", "lfu", "generate", "hi")
    assert result.exit_code != 0 and "--plugin lru and --plugin lfu both choose the eviction policy" in result.output


@pytest.mark.parametrize("option,plugin,explicit", [
    ("eviction_policy", "lfu", "lru"), ("kv_cache", "radix-cache", "paged"),
    ("scheduler", "chunked-prefill", "continuous"), ("attention", "cpu", "torch")])
def test_an_explicit_component_option_wins_over_plugin(infer_plugins, option, plugin, explicit):
    """`infer --plugin X --OPTION Y` (and a bench arm that sets --OPTION over a group --plugin) runs Y."""
    from infer.cli.options import EngineArgs

    args = EngineArgs.from_kwargs({"plugins": [plugin], option: explicit})
    assert getattr(args.build(infer_plugins), option) == explicit
    assert getattr(EngineArgs.from_kwargs({"plugins": [plugin]}).build(infer_plugins), option) == plugin


def test_plugin_options_reach_the_config_and_bench_arms_merge_them(infer_plugins):
    from infer.bench.arms import parse_arms
    from infer.cli.options import EngineArgs, parse_plugin_options

    assert parse_plugin_options(("awq.fused_max_rows=8", "fp8.backend=emulate", "x.flag=true", 'x.s="7"')) == {
        "plugin_options.awq.fused_max_rows": 8, "plugin_options.fp8.backend": "emulate",
        "plugin_options.x.flag": True, "plugin_options.x.s": "7"}
    options = parse_plugin_options(("awq.fused_max_rows=8", "awq.group_size=64"))
    base = EngineArgs.from_kwargs({"plugin_option": options})
    a, b = parse_arms(["", "--plugin-option awq.fused_max_rows=64"], base)
    assert a.args.build(infer_plugins).plugin_options == {"awq": {"fused_max_rows": 8, "group_size": 64}}
    assert b.args.build(infer_plugins).plugin_options == {"awq": {"fused_max_rows": 64, "group_size": 64}}
    result = run("--plugin-option", "awq-fused_max_rows=8", "generate", "hi")
    assert result.exit_code == 2 and "'awq-fused_max_rows=8' is not NAMESPACE.KEY=VALUE" in result.output
    # a component name may hold '.', a key may not: the key is what follows the last '.'
    dotted = parse_plugin_options(("my.policy.window=3",))
    assert dotted == {"plugin_options.my.policy.window": 3}
    assert EngineArgs.from_kwargs({"plugin_option": dotted}).build(infer_plugins).plugin_options == {
        "my.policy": {"window": 3}}


def test_a_plugin_option_namespace_no_component_claims_is_warned(infer_plugins, caplog):
    from infer.cli.options import EngineArgs, parse_plugin_options

    for option, warned in (("aqw.k=1", True), ("awq.fused_max_rows=1", False), ("ngram.min_n=1", False),
                           ("lfu.k=1", False)):
        caplog.clear()
        EngineArgs.from_kwargs({"plugin_option": parse_plugin_options((option,))}).build(infer_plugins)
        assert ("--plugin-option aqw.* (plugin_options['aqw']): no registered component is named 'aqw'"
                in caplog.text) is warned


def test_swap_space_without_swap_preemption_is_warned(infer_plugins, caplog):
    from infer.cli.options import EngineArgs

    for preemption, warned in (("recompute", True), ("swap", False)):
        caplog.clear()
        EngineArgs.from_kwargs({"swap_space_gb": 1.0, "preemption_mode": preemption}).build(infer_plugins)
        assert ("--swap-space-gb is unused" in caplog.text) is warned
    caplog.clear()
    with pytest.raises(ConfigError, match="swap-space-gb must be >= 0"):  # the error alone, not a warning first
        EngineArgs.from_kwargs({"swap_space_gb": -2.0}).build(infer_plugins)
    assert "unused" not in caplog.text


def test_llm_checks_its_components_as_the_cli_does(tiny_model, caplog):
    from infer import LLM

    with pytest.raises(ConfigError, match="an eviction policy picks the cached prefix blocks to drop"):
        LLM(model=str(tiny_model), device="cpu", eviction_policy="lfu", enable_prefix_caching=False)
    with caplog.at_level("WARNING", logger="infer"):
        llm = LLM(model=str(tiny_model), device="cpu", plugin=["radix-cache"], kv_cache="paged",
                  plugin_options={"aqw": {"k": 1}})
    assert llm.engine.config.kv_cache == "paged"  # the explicit field wins, with a warning
    assert "--kv-cache paged overrides --plugin radix-cache" in caplog.text
    assert "no registered component is named 'aqw'" in caplog.text


def install_command_plugin(root, monkeypatch, module: str, entry_point: str, registration: str) -> None:
    """A one-module distribution on sys.path whose ``register_commands`` hook runs ``registration``."""
    (root / f"{module}.py").write_text("import click\nfrom infer import hookimpl\n\n\n@hookimpl\n"
                                       f"def register_commands(register):\n    {registration}\n")
    info = root / f"{module}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module.replace('_', '-')}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[infer]\n{entry_point} = {module}\n")
    monkeypatch.syspath_prepend(str(root))


def test_a_plugin_command_cannot_shadow_a_builtin(tmp_path, monkeypatch):
    install_command_plugin(tmp_path, monkeypatch, "shadowing_plugin", "shadowing",
                           "register('generate', lambda: click.Command('generate'))")
    result = run("plugins")  # the built-in keeps working; the warning names the plugin
    assert result.exit_code == 0 and "registers a command 'generate', the name of a built-in" in result.output


def test_a_plugin_command_alias_cannot_shadow_a_builtin_either(tmp_path, monkeypatch):
    install_command_plugin(tmp_path, monkeypatch, "alias_plugin", "aliasing",
                           "register('hello', lambda: click.Command('hello'), aliases=('plugins',))")
    result = run("plugins")  # the built-in runs: the alias never did, and nothing said so
    assert result.exit_code == 0 and "registers the command 'hello' with an alias 'plugins', the name of a " \
        "built-in infer command, so it cannot run by that name" in " ".join(result.output.split())


def test_a_broken_plugin_command_breaks_only_itself(tmp_path, monkeypatch):
    install_command_plugin(tmp_path, monkeypatch, "broken_command_plugin", "shaky", "register('shaky', lambda: 1 / 0)")
    listing = run("--help")
    assert listing.exit_code == 0 and "generate" in listing.stdout and "shaky" not in listing.stdout
    assert "warning: the command factory 'shaky' from 'broken-command-plugin' failed: ZeroDivisionError" \
        in listing.stderr
    assert run("plugins").exit_code == 0  # other commands do not build it
    failed = run("shaky")
    assert failed.exit_code == 1 and "the command factory 'shaky' from 'broken-command-plugin' failed" in failed.stderr


def test_include_stop_str_keeps_the_stop_string(tiny_model):
    args = ["--model", str(tiny_model), "generate", "def a():", "--max-tokens", "12", "--temperature", "0",
            "--ignore-eos", "--json"]
    free = json.loads(run(*args).stdout)["text"]
    stop = free[4:6]
    cut, kept = (json.loads(run(*args, "--stop", stop, *extra).stdout)["text"]
                 for extra in ([], ["--include-stop-str"]))
    assert cut == free[: free.index(stop)] and kept == free[: free.index(stop) + 2]
    refused = run(*args[:-1], "--beam-width", "2", "--include-stop-str")
    assert refused.exit_code == 2 and "--include-stop-str" in refused.stderr


def test_an_unknown_command_is_clicks_usage_error():
    result = run("nosuchcmd")
    assert result.exit_code == 2 and "No such command 'nosuchcmd'" in result.stderr


def test_generate_on_a_terminal_says_it_reads_prompts_from_it(tiny_model):
    """Without PROMPTS on a terminal it would wait without a word (a new user's report)."""
    import pty
    import select
    import sys
    import time

    leader, follower = pty.openpty()
    proc = subprocess.Popen([sys.executable, "-P", "-m", "infer.cli", "--model", str(tiny_model), "generate",
                             "--max-tokens", "2"], stdin=follower, stdout=follower, stderr=follower)
    os.close(follower)
    seen, deadline = b"", time.monotonic() + 60
    try:
        while b"Ctrl-D ends them" not in seen and time.monotonic() < deadline and proc.poll() is None:
            if select.select([leader], [], [], 0.5)[0]:
                seen += os.read(leader, 4096)
        os.write(leader, b"\x04")  # end of input: no prompt, so a usage error
        assert proc.wait(60) == 2
    finally:
        proc.kill()
        os.close(leader)
    assert b"infer: reading prompts from the terminal, one per line; Ctrl-D ends them" in seen


def test_generate_names_the_bad_prompt_and_prints_nothing(tiny_model):
    result = run("--model", str(tiny_model), "generate", "def a():", "x=1\n" * 600, "--max-tokens", "4")
    assert result.exit_code != 0 and "prompt 2 of 2:" in result.output and "def a():" not in result.output


@pytest.mark.parametrize("options,message", [
    (["--proposer", "ngram", "--num-speculative-tokens", "2", "--draft-model", "x"],
     "--draft-model is read by the draft-model proposer only"),
    (["--spec-min-acceptance", "0.5"], "--spec-min-acceptance: speculative-decoding options need a proposer"),
    (["--eviction-policy", "lfu", "--no-prefix-caching"], "enable_prefix_caching=False) nothing is cached"),
    (["--plugin", "lfu", "--no-prefix-caching"], "enable_prefix_caching=False) nothing is cached"),
])
def test_options_that_would_be_ignored_are_refused(tiny_model, options, message):
    result = run("--model", str(tiny_model), *options, "generate", "hi")
    assert result.exit_code != 0 and message in result.output and "Traceback" not in result.output


def test_generate_seed_reproduces_a_prompt_whatever_the_batch(tiny_model):
    alone = run("--model", str(tiny_model), "generate", "hello", "--temperature", "1.0", "--seed", "3",
                "--max-tokens", "12", "--ignore-eos", "--json")
    batched = run("--model", str(tiny_model), "generate", "other words first", "hello", "--temperature", "1.0",
                  "--seed", "3", "--max-tokens", "12", "--ignore-eos", "--json")
    assert alone.exit_code == 0 and batched.exit_code == 0, alone.output + batched.output
    [one] = [json.loads(line) for line in alone.output.splitlines()]
    two = [json.loads(line) for line in batched.output.splitlines()]
    assert len(one["token_ids"]) == 12 and two[1]["token_ids"] == one["token_ids"] and two[1]["text"] == one["text"]


# The option parsers, read through a command that only records what it receives (no engine, no model)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _recording_command(*decorators: Callable[[Callable[..., Any]], Callable[..., Any]]
                       ) -> tuple[click.Command, list[dict[str, Any]]]:
    """A click command with ``decorators`` (sampling_options, structured_output_options, ...) and the keywords
    each of its runs received."""
    received: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> None:
        received.append(kwargs)

    for decorate in reversed(decorators):
        record = decorate(record)
    return click.command("record")(record), received


def _cli_section(command: str) -> str:
    """docs/cli.md's section of ``infer COMMAND``."""
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    return re.search(rf"^## `infer {command}`\n(.*?)(?=^## )", text, flags=re.M | re.S).group(1)


def _documented_defaults(command: str) -> dict[str, str]:
    """``--option`` -> the ``[default: X]`` of its row in docs/cli.md's section of ``infer COMMAND``."""
    section = _cli_section(command)
    return dict(re.findall(r"^\| `(--[\w-]+)[^`]*` \|[^\n]*?\[default: ([^\]]+)\]", section, flags=re.M))


def test_sampling_and_max_tokens_defaults_are_the_documented_ones():
    from infer.cli.options import sampling_options

    command, received = _recording_command(sampling_options)
    assert CliRunner().invoke(command, []).exit_code == 0
    documented = _documented_defaults("generate")
    sampling = received[0]["sampling"]
    assert sampling.pop("logit_bias") == () and sampling.pop("logits_processors") == ()
    assert sampling == {name: float(documented["--" + name.replace("_", "-")]) for name in sampling}
    assert len(sampling) == 8  # temperature, top_p, top_k, min_p, the three penalties, min_tokens
    for name in ("generate", "chat"):
        max_tokens = next(p for p in main.commands[name].params if p.name == "max_tokens")
        assert max_tokens.default == int(_documented_defaults(name)["--max-tokens"]), name


def test_every_logit_bias_given_reaches_the_command():
    from infer.cli.options import sampling_options

    command, received = _recording_command(sampling_options)
    result = CliRunner().invoke(command, ["--logit-bias", "6=-100", "--logit-bias", "5=100", "--logit-bias", "9=0.5"])
    assert result.exit_code == 0, result.output
    assert received[0]["sampling"]["logit_bias"] == ((6, -100.0), (5, 100.0), (9, 0.5))


def test_a_refused_value_names_its_option_after_the_field():
    """The engine's message names the parameter (as the Python API and gRPC see it); the command line adds the option
    that sets it, for each command that has one: `--include-stop-str` for include_stop_str_in_output too."""
    from infer.cli.main import option_error
    from infer.core.errors import InvalidRequestError

    command = main.commands["generate"]
    ctx = click.Context(command)
    for message, expected in (
            ("invalid sampling parameters: min_tokens must be ...", "min_tokens (--min-tokens) must be ..."),
            ("invalid sampling parameters: include_stop_str_in_output must be True or False",
             "include_stop_str_in_output (--include-stop-str) must be"),
            ("invalid sampling parameters: logits_processors may name at most 8", "logits_processors "
             "(--logits-processor) may name"),
            ("length_penalty must be a finite number", "length_penalty (--length-penalty) must"),
            ("invalid sampling parameters: structured_output cannot", "invalid sampling parameters: structured_output "
             "cannot"),  # no option of that name: as it was
            ("prompt is empty", "prompt is empty")):
        error = option_error(InvalidRequestError(message), ctx)
        assert error.exit_code == 2 and expected in error.message, (message, error.message)


def test_every_logits_processor_given_reaches_the_command_in_order():
    from infer.cli.options import sampling_options

    command, received = _recording_command(sampling_options)
    result = CliRunner().invoke(command, ["--logits-processor", 'no-repeat-ngram={"size": 3}',
                                          "--logits-processor", "mine"])
    assert result.exit_code == 0, result.output
    assert received[0]["sampling"]["logits_processors"] == (("no-repeat-ngram", '{"size":3}'), ("mine", "{}"))
    for bad, message in (("x={size: 3}", "the arguments after = are not JSON"), ("x=[3]", "is not NAME or NAME=JSON"),
                         ("=", "is not NAME or NAME=JSON")):
        result = CliRunner().invoke(command, ["--logits-processor", bad])
        assert result.exit_code == 2 and message in result.output, result.output


def test_generate_runs_a_logits_processor_and_names_an_unknown_one():
    """The embedded model: with no token twice (size 1), as the processor promises; an unknown name is refused."""
    result = run("generate", "def f(x):", "--max-tokens", "12", "--ignore-eos", "--json",
                 "--logits-processor", 'no-repeat-ngram={"size": 1}')
    assert result.exit_code == 0, result.output
    ids = json.loads(result.stdout.splitlines()[0])["token_ids"]
    assert len(ids) == 12 and len(set(ids)) == 12
    result = run("generate", "hi", "--logits-processor", "no-repeat")
    assert result.exit_code != 0 and "unknown logits processor 'no-repeat' (did you mean 'no-repeat-ngram'?)" in \
        result.stderr


def test_structure_files_are_read_whole_as_utf8(tmp_path):
    from infer.cli.options import structured_output_options

    command, received = _recording_command(structured_output_options)
    schema = '{"enum": ["café", "naïve", "😀"]}\n'
    grammar = 'root ::= "é" | "😀"  # non-ASCII literals\n'
    (tmp_path / "schema.json").write_bytes(schema.encode())
    (tmp_path / "rules.gbnf").write_bytes(grammar.encode())
    for option, name, text in (("--json-schema", "schema.json", schema), ("--grammar", "rules.gbnf", grammar)):
        result = CliRunner().invoke(command, [option, str(tmp_path / name)])
        assert result.exit_code == 0, result.output
        structured = received.pop()["structured_output"]
        assert (structured.json_schema if option == "--json-schema" else structured.grammar) == text


def test_structure_files_that_are_not_utf8_or_not_json_are_usage_errors(tmp_path):
    from infer.cli.options import structured_output_options

    command, received = _recording_command(structured_output_options)
    (tmp_path / "latin1").write_bytes('{"enum": ["café"]}'.encode("latin-1"))
    (tmp_path / "not.json").write_text('{"type": "object",', encoding="utf-8")
    for args, message in ((["--grammar", str(tmp_path / "latin1")], "give a UTF-8 GBNF file"),
                          (["--json-schema", str(tmp_path / "latin1")], "give a UTF-8 JSON file"),
                          (["--json-schema", str(tmp_path / "not.json")], "is not JSON")):
        result = CliRunner().invoke(command, args)
        assert result.exit_code == 2 and message in result.output, result.output
        assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert received == []


@pytest.mark.parametrize("args,expected", [
    (["--kv-admission-reserve", "auto"], {"kv_admission_reserve": "auto"}),
    (["--kv-admission-reserve", "0.25"], {"kv_admission_reserve": 0.25}),
    (["--kv-cache-dtype", "fp8", "--seed", "7", "--max-num-seqs", "3"],
     {"kv_cache_dtype": "fp8", "seed": 7, "max_num_seqs": 3}),
    (["--freeze-gc", "--no-prefix-caching", "--no-cuda-graphs"],
     {"freeze_gc": True, "enable_prefix_caching": False, "cuda_graphs": False}),
    (["--chat-template", "t.jinja", "--sanitize-chat-control-tokens"],
     {"chat_template": "t.jinja", "sanitize_chat_control_tokens": True}),
    (["--proposer", "ngram", "--num-speculative-tokens", "2", "--spec-min-acceptance", "0.5",
      "--spec-max-batch-size", "4"],
     {"proposer": "ngram", "num_speculative_tokens": 2,
      "plugin_options": {"spec_decode": {"min_acceptance": 0.5, "max_batch_size": 4}}}),
])
def test_group_options_reach_the_engine_config(infer_plugins, args, expected):
    """Each group option as docs/cli.md names it ends in its EngineConfig field (the command line parsed by the
    group's own options, not a dict handed to EngineArgs)."""
    from infer.cli.options import EngineArgs, engine_options

    command, received = _recording_command(engine_options)
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 0, result.output
    config = EngineArgs.from_kwargs(received[0]).build(infer_plugins)
    assert {field: getattr(config, field) for field in expected} == expected


# what docs/cli.md's `--beam-width` row says is refused with it, each with a value that is not its default
BESIDE_BEAM_SEARCH = {
    "--temperature": ["0.5"], "--top-p": ["0.5"], "--top-k": ["3"], "--min-p": ["0.1"], "--n": ["2"],
    "--stop": ["x"], "--include-stop-str": [], "--seed": ["1"], "--stream": [], "--repetition-penalty": ["1.2"],
    "--frequency-penalty": ["0.5"], "--presence-penalty": ["0.5"], "--min-tokens": ["1"], "--logit-bias": ["5=1"],
    "--regex": ["a"], "--choice": ["a"], "--json-schema": ["{schema}"], "--grammar": ["{grammar}"],
    "--logprobs": ["1"], "--prompt-logprobs": ["1"], "--stats": []}


def test_every_option_documented_as_refused_beside_beam_search_is(tmp_path):
    row = next(line for line in _cli_section("generate").splitlines() if line.startswith("| `--beam-width W` |"))
    refused = row[row.index(", so ") + 5: row.index("are refused with it")]
    stats = row[row.index("are refused with it"): row.index("bypasses the scheduler")]
    penalties = {"--repetition-penalty", "--frequency-penalty", "--presence-penalty"} if "the penalties" in refused \
        else set()
    assert set(re.findall(r"`(--[\w-]+)`", refused + stats)) | penalties == set(BESIDE_BEAM_SEARCH)
    (tmp_path / "schema.json").write_text('{"type": "string"}')
    (tmp_path / "rules.gbnf").write_text('root ::= "a"')
    for option, values in BESIDE_BEAM_SEARCH.items():
        given = [value.format(schema=tmp_path / "schema.json", grammar=tmp_path / "rules.gbnf") for value in values]
        result = run("generate", "hi", "--beam-width", "2", option, *given)
        assert result.exit_code == 2 and option in result.stderr.split("drop ")[-1], (option, result.output)


@pytest.mark.parametrize("args,message", [
    (["--lora", "sql="], "'sql=' is not NAME=DIR"),
    (["--lora", "=adapters/sql"], "'=adapters/sql' is not NAME=DIR"),
    (["--lora", "sql"], "'sql' is not NAME=DIR"),
    (["--plugin-option", "my.policy.=3"], "'my.policy.=3' is not NAMESPACE.KEY=VALUE"),  # the key: after the last .
    (["--plugin-option", ".window=3"], "'.window=3' is not NAMESPACE.KEY=VALUE"),
    (["--kv-admission-reserve", "most"], "'most' is neither a number in [0, 1] nor auto"),
])
def test_malformed_group_option_values_are_usage_errors(args, message):
    from infer.cli.options import engine_options

    command, received = _recording_command(engine_options)
    result = CliRunner().invoke(command, args)
    assert result.exit_code == 2 and message in result.output, result.output
    assert received == []


def test_generate_stats_go_to_stderr_and_completions_alone_to_stdout(tiny_model):
    from infer import LLM, SamplingParams

    result = run("--model", str(tiny_model), "--device", "cpu", "generate", "hello", "x =", "--max-tokens", "3",
                 "--ignore-eos", "--stats")
    assert result.exit_code == 0, result.output
    expected = LLM(str(tiny_model), device="cpu").generate(["hello", "x ="], SamplingParams(
        max_tokens=3, temperature=0.0, ignore_eos=True))
    assert result.stdout == "".join(p + r.outputs[0].text + "\n" for p, r in zip(["hello", "x ="], expected))
    stats = json.loads(result.stderr[result.stderr.index("{"):])
    assert stats["requests_finished"] == 2 and stats["output_tokens"] == 6


def test_completions_that_finish_out_of_order_print_in_prompt_order(capsys):
    """generate prints each prompt's completions once it and every earlier prompt are done, whatever order the
    engine finishes them in."""
    from infer.cli.main import print_in_order
    from infer.core.request import CompletionOutput, RequestOutput

    def result(text: str) -> RequestOutput:
        return RequestOutput("r", [1], [CompletionOutput(0, [5], text)], True)

    finished = [(2, result("c")), (1, result("b")), (3, result("d")), (0, result("a"))]
    print_in_order(4, iter(finished), lambda i, r: [f"{i}:{out.text}" for out in r.outputs], "generating",
                   "completions")
    assert capsys.readouterr().out == "0:a\n1:b\n2:c\n3:d\n"


@pytest.mark.parametrize("option,kind", [
    ("--attention", "attention backend"), ("--quant", "quant method"), ("--proposer", "proposer"),
    ("--tool-parser", "tool parser"), ("--reasoning-parser", "reasoning parser"),
    ("--structured-output-backend", "structured output backend")])
def test_an_unknown_component_name_is_refused_before_the_model_is_looked_for(tmp_path, option, kind):
    result = run("--model", str(tmp_path / "no-such-model"), option, "nope", "generate", "x")
    assert result.exit_code == 2 and f"unknown {kind} 'nope'; registered {kind}" in result.stderr, result.output


@pytest.mark.parametrize("args,input,message", [
    (["--stream", "--n", "2", "x"], None, "--stream prints one completion at a time; use it with --n 1"),
    (["--stream", "--json", "x"], None, "--stream prints text as it comes; --json prints whole completions"),
    ([], "", "give at least one PROMPT argument or lines on stdin"),
    ([], "\n   \n\n", "give at least one PROMPT argument or lines on stdin"),  # blank lines are no prompts
    (["--logprobs", "1", "x"], None, "--logprobs and --prompt-logprobs print with --json; add it"),
    (["--prompt-logprobs", "1", "x"], None, "--logprobs and --prompt-logprobs print with --json; add it"),
])
def test_generate_usage_errors_come_before_the_model_is_looked_for(tmp_path, args, input, message):
    result = run("--model", str(tmp_path / "no-such-model"), "generate", *args, input=input)
    assert result.exit_code == 2 and message in result.stderr, result.output


def test_generate_length_penalty_reaches_beam_search(tiny_model):
    """docs/cli.md: a beam's score is its log-probability / length ** --length-penalty."""
    result = run("--model", str(tiny_model), "--device", "cpu", "generate", "def f():", "--beam-width", "2",
                 "--max-tokens", "4", "--ignore-eos", "--length-penalty", "2", "--json")
    assert result.exit_code == 0, result.output
    beams = [json.loads(line) for line in result.stdout.splitlines()]
    assert len(beams) == 2
    for beam in beams:
        assert len(beam["token_ids"]) == 4
        assert beam["score"] == pytest.approx(beam["cumulative_logprob"] / 4 ** 2, rel=1e-9)


def test_stdin_lines_lose_their_line_end_and_byte_order_mark():
    """CliRunner's stdin turns CRLF into LF itself; a real stdin (newline="\\n" on POSIX) keeps the CR for
    stdin_text to drop."""
    from infer.cli.main import stdin_text

    assert [stdin_text(line) for line in ("\ufeffok\r\n", "x\r\n", "y\n", "z", "\ufeff\n")] == ["ok", "x", "y", "z", ""]


def test_generate_json_reports_each_prompts_cached_tokens_as_the_engine_does(tiny_model):
    from infer import LLM, SamplingParams

    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    result = run("--model", str(tiny_model), "--device", "cpu", "--max-num-seqs", "1", "generate", prompt, prompt,
                 "--max-tokens", "2", "--json")
    assert result.exit_code == 0, result.output
    expected = LLM(str(tiny_model), device="cpu", max_num_seqs=1).generate([prompt, prompt], SamplingParams(
        max_tokens=2, temperature=0.0))
    cached = [json.loads(line)["num_cached_tokens"] for line in result.stdout.splitlines()]
    assert cached == [r.num_cached_tokens for r in expected] and cached[1] > 0  # the second hits the first's blocks


def test_generate_beam_search_runs_the_prompts_in_groups_of_max_num_seqs_over_width(tiny_model, monkeypatch):
    """docs/cli.md: the prompts run in groups of --max-num-seqs / W, each printed when it is done."""
    calls: list[int] = []
    beam_search = Engine.beam_search

    def counted(self: Engine, prompts: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(len(prompts))
        return beam_search(self, prompts, *args, **kwargs)

    monkeypatch.setattr(Engine, "beam_search", counted)
    result = run("--model", str(tiny_model), "--device", "cpu", "--max-num-seqs", "4", "generate", "a", "b", "c",
                 "d", "e", "--beam-width", "2", "--max-tokens", "2")
    assert result.exit_code == 0, result.output
    assert calls == [2, 2, 1] and len(result.stdout.splitlines()) == 5


def test_make_tiny_model_writes_what_make_tiny_model_writes(tmp_path):
    """Its options reach the model: the same files as infer.models.tiny.make_tiny_model's with the documented MLP
    (twice the hidden size)."""
    from safetensors.torch import load_file

    from infer.models.tiny import make_tiny_model

    result = run("make-tiny-model", str(tmp_path / "cli"), "--arch", "qwen2", "--hidden-size", "32", "--num-layers",
                 "1", "--tie-word-embeddings", "--seed", "5")
    assert result.exit_code == 0, result.output
    make_tiny_model(tmp_path / "api", "qwen2", hidden_size=32, num_layers=1, intermediate_size=64,
                    tie_word_embeddings=True, seed=5)
    configs = [json.loads((tmp_path / name / "config.json").read_text()) for name in ("cli", "api")]
    assert configs[0] == configs[1] and configs[0]["intermediate_size"] == 64 and configs[0]["tie_word_embeddings"]
    written, expected = (load_file(tmp_path / name / "model.safetensors") for name in ("cli", "api"))
    assert written.keys() == expected.keys() and all(written[k].equal(expected[k]) for k in expected)


TQDM_BAR = re.compile(r"\d+/\d+ \[\d\d:\d\d")  # tqdm's counter and timer: "1/1 [00:00<00:00, 431.56it/s]"


def test_make_tiny_model_draws_no_progress_bar_where_stderr_is_no_terminal(tmp_path):
    """CliRunner's stderr is no terminal: transformers' "Writing model shards" bar (save_pretrained) stays off, and
    transformers' process-wide switch is back on after the command."""
    from transformers.utils import logging as hf_logging

    assert hf_logging.is_progress_bar_enabled()  # else transformers would draw no bar anyway
    result = run("make-tiny-model", str(tmp_path / "m"))
    assert result.exit_code == 0, result.output
    assert "Writing model shards" not in result.stderr and not TQDM_BAR.search(result.stderr), result.stderr
    assert hf_logging.is_progress_bar_enabled()


def test_the_progress_bar_switch_leaves_huggingface_hubs_own_as_it_was(monkeypatch):
    """transformers' disable/enable_progress_bar turn huggingface_hub's global bars off and on too: one that was off
    before the command stays off."""
    import io
    import sys

    from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars
    from transformers.utils import logging as hf_logging

    from infer.cli.terminal import transformers_bars_on_terminal_only

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    disable_progress_bars()
    try:
        with transformers_bars_on_terminal_only():
            assert not hf_logging.is_progress_bar_enabled()
        assert hf_logging.is_progress_bar_enabled() and are_progress_bars_disabled()
    finally:
        enable_progress_bars()


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_make_tiny_model_keeps_its_progress_bar_on_a_terminal(tmp_path):
    """With stderr on a (pseudo-)terminal the bar is transformers' own, as it draws it without infer."""
    import fcntl
    import struct
    import sys
    import termios

    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # tqdm fits its bar in 0 columns
    proc = subprocess.Popen([sys.executable, "-P", "-m", "infer.cli", "make-tiny-model", str(tmp_path / "m")],
                            stdout=subprocess.DEVNULL, stderr=follower)
    os.close(follower)
    drawn = b""
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the command closed the terminal
            break
        if not chunk:
            break
        drawn += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, drawn.decode(errors="replace")
    text = drawn.decode(errors="replace")
    assert "Writing model shards" in text and TQDM_BAR.search(text), text


def test_plugins_json_lists_each_components_aliases():
    from infer.core.plugins import PluginManager

    rows = json.loads(run("plugins", "--json").stdout)
    expected = PluginManager.from_entry_points().collect().components()
    assert {(r["kind"], r["name"]): r["aliases"] for r in rows} == {(c.kind, c.name): list(c.aliases)
                                                                      for c in expected}
    assert any(r["aliases"] for r in rows)  # some shipped component has an alias, so the test sees them


def test_make_tiny_model_needs_room_for_its_float32_weights_twice(tmp_path, monkeypatch):
    """The check counts 4 bytes per parameter, held twice while written: refused below that, written above it."""
    from infer.models.tiny import parameter_count

    params = parameter_count(64, 2, 128, False)  # the default llama: hidden 64, 2 layers, an MLP twice as wide
    for available, written in ((2 * 4 * params - 1, False), (2 * 4 * params + 2**20, True)):
        monkeypatch.setattr("infer.core.loader.host_memory_available", lambda available=available: available)
        result = run("make-tiny-model", str(tmp_path / str(available)))
        assert (result.exit_code == 0) is written and (tmp_path / str(available)).exists() is written, result.output
        if not written:
            assert result.exit_code == 2 and "lower --hidden-size or --num-layers" in result.stderr
