"""What a third-party plugin author relies on: the eviction policy's touch contract, errors that name the broken
plugin and say how to get infer running again, name rules, and a plugin template whose rename steps work."""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import tomllib
import types
import zlib
from collections import OrderedDict
from collections.abc import Callable, Hashable
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from infer import hookimpl
from infer.cli import main
from infer.core.config import EngineConfig
from infer.core.errors import PluginError
from infer.core.interfaces import EvictionPolicy
from infer.core.plugins import PluginManager
from infer.core.registry import ARCHITECTURE_NAMES, Registry
from infer.plugins.eviction import LRUPolicy

ROOT = Path(__file__).resolve().parents[1]


def flat(text: str) -> str:
    return " ".join(text.split())


def entry_points_but(*left_out: str) -> str:
    """The installed ``infer`` entry points (shipped, and any others here) without ``left_out``, as an allow-list."""
    return ",".join(sorted({ep.name for ep in metadata.entry_points(group="infer")} - set(left_out)))


def install_fake_plugin(root: Path, dist: str, entry_point: str, plugin_source: str | None) -> None:
    """A distribution in ``root`` (on sys.path) whose ``infer`` entry point is ``<package>.plugin``; without
    ``plugin_source`` the module is missing, as after renaming an editable install's folder."""
    package = dist.replace("-", "_")
    info = root / f"{package}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[infer]\n{entry_point} = {package}.plugin\n")
    if plugin_source is not None:
        (root / package).mkdir()
        (root / package / "__init__.py").write_text("")
        (root / package / "plugin.py").write_text("from infer import hookimpl\n\n\n" + plugin_source)


def assert_no_traceback_from_the_cli(dist: str) -> None:
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code != 0 and dist in result.output and "Traceback" not in result.output


# ---------------------------------------------------------------- 1. EvictionPolicy.touch of keys it does not hold
def touch_contract_violations(policy: EvictionPolicy) -> list[str]:
    """The ways ``policy`` breaks "touch may get any key, never fails, never changes len()"."""
    steps = {
        "touch of a key never inserted": lambda: policy.touch(1000),
        "touch of a removed key": lambda: (policy.insert(1), policy.remove(1), policy.touch(1)),
        "touch of a popped key": lambda: (policy.insert(2), policy.touch(policy.pop())),
    }
    violations = []
    for step, run in steps.items():
        try:
            run()
        except Exception as exc:
            violations.append(f"{step} raised {type(exc).__name__}: {exc}")
        if len(policy) != 0:
            violations.append(f"{step} left len() == {len(policy)}")
    policy.insert(3)  # and the policy still works afterwards
    policy.touch(3)
    if len(policy) != 1 or policy.pop() != 3:
        violations.append("after those touches, insert(3) then pop() did not return 3")
    return violations


def load_failure(root: Path, monkeypatch: pytest.MonkeyPatch, dist: str, entry_point: str,
                 plugin_source: str | None) -> str:
    """The (whitespace-flattened) PluginError of loading every entry point with this fake plugin installed."""
    install_fake_plugin(root, dist, entry_point, plugin_source)
    monkeypatch.syspath_prepend(str(root))
    with pytest.raises(PluginError) as error:
        PluginManager.from_entry_points(allow="").collect()
    return flat(str(error.value))


class StrictLRU(EvictionPolicy):
    """An LRU as the old docstrings suggested it: touch moves the key, assuming the policy holds it."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self._order[key] = None

    def touch(self, key: Hashable) -> None:
        self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def pop(self) -> Hashable:
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


def test_every_eviction_policy_accepts_touch_of_keys_it_does_not_hold(infer_plugins):
    entries = list(infer_plugins.registry("eviction_policy"))
    assert {"lru", "lfu", "priority"} <= {entry.name for entry in entries}
    for entry in entries:
        assert touch_contract_violations(entry.factory(EngineConfig())) == [], f"{entry.name} from {entry.source}"


def test_the_contract_check_catches_an_lru_that_assumes_touched_keys_are_held():
    assert [v.split(" raised")[0] for v in touch_contract_violations(StrictLRU())] == [
        "touch of a key never inserted", "touch of a removed key", "touch of a popped key"]


class ForgetfulLRU(LRUPolicy):
    """remove() forgets nothing: pop() later returns blocks that sequences hold again."""

    def remove(self, key: Hashable) -> None:
        pass


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_a_policy_that_pops_a_held_key_is_refused_not_trusted(tiny_model, kv_cache):
    """Trusting pop() would give a block that a running sequence holds to another sequence: wrong tokens, no error."""
    from infer import SamplingParams
    from infer.core.engine import Engine

    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("forgetful")
    module.register_eviction_policies = hookimpl(lambda register: register("forgetful", lambda config: ForgetfulLRU()))
    plugins.register(module, name="forgetful", source="acme")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache=kv_cache, eviction_policy="forgetful",
                                 block_size=4, num_kv_blocks=8), plugins)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    shared = list(range(5, 13))
    engine.generate([shared], SamplingParams(max_tokens=1))  # leaves its prompt's blocks cached
    # the first victim the policy offers is what the hit holds: the prompt's first block 0 (released before the
    # hit, removed again as a prefix of block 1: a forgetful policy still lists it), or the shared prompt's radix node
    held = "0" if kv_cache == "paged" else "RadixNode(tokens=(5, 6, 7, 8, 9, 10, 11, 12), blocks=[0, 1]"
    expected = re.escape(f"eviction policy 'forgetful' ({__name__}.") + ".*" + re.escape(
        f"ForgetfulLRU): pop() returned {held}") + r".*, which is not evictable .* fix the policy's bookkeeping"
    with pytest.raises(PluginError, match=expected):
        engine.generate([shared + [30] * 4, list(range(40, 56))], params)  # a hit holds them; the other evicts


class LazyLRU(EvictionPolicy):
    """LRU with lazy deletion whose pop() forgets to skip removed keys: it may return a cached prefix block that the
    paged cache removed from the policy because blocks cached after it depend on it (not a leaf, not evictable)."""

    def __init__(self) -> None:
        self.order: OrderedDict[Hashable, None] = OrderedDict()
        self.removed: set[Hashable] = set()

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self.removed.discard(key)
        self.order[key] = None
        self.order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        pass

    def remove(self, key: Hashable) -> None:
        if key not in self.order or key in self.removed:
            raise KeyError(key)
        self.removed.add(key)

    def pop(self) -> Hashable:
        key = self.order.popitem(last=False)[0]  # the bug: a removed key is not skipped
        self.removed.discard(key)
        return key

    def __len__(self) -> int:
        return len(self.order) - len(self.removed)


def test_a_policy_that_pops_a_cached_prefix_block_it_was_told_to_remove_is_refused(tiny_model):
    """A finished prompt of 3 full blocks leaves block 2 evictable and blocks 0 and 1 cached but held back (removed
    from the policy) as prefixes of it. A policy whose pop() returns block 0 anyway was trusted: the cache then
    evicted a block it still kept among its held-back prefixes, and a later step failed inside the shipped paged
    cache (a TypeError blamed on 'paged' from 'infer-engine'), or gave a block to two sequences."""
    from infer import SamplingParams
    from infer.core.engine import Engine

    plugins = PluginManager.from_entry_points()
    module = types.ModuleType("lazy")
    module.register_eviction_policies = hookimpl(lambda register: register("lazy", lambda config: LazyLRU()))
    plugins.register(module, name="lazy", source="acme")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", eviction_policy="lazy", block_size=4,
                                 num_kv_blocks=8), plugins)
    engine.generate([list(range(5, 17))], SamplingParams(max_tokens=1))  # 3 full blocks cached
    expected = re.escape(f"eviction policy 'lazy' ({__name__}.LazyLRU): pop() returned 0") + ", which is not evictable"
    with pytest.raises(PluginError, match=expected):
        # 8 blocks: the 5 free ones, block 2 (a leaf), then block 1 is a leaf again, but the policy offers block 0
        engine.generate([list(range(40, 69))], SamplingParams(max_tokens=1))


def test_an_error_raised_in_a_plugins_code_during_a_step_names_the_plugin(infer_plugins, tiny_model, caplog):
    """StrictLRU's touch raises KeyError on a prefix hit of a block it never held. The caller sees that error, as a
    PluginError naming the policy and its package (not a second error from aborting the rest)."""
    from infer import SamplingParams
    from infer.core.engine import Engine

    plugins = runtime_plugin(infer_plugins, "register_eviction_policies", "strict", lambda config: StrictLRU())
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", eviction_policy="strict", block_size=4,
                                 num_kv_blocks=16), plugins)
    shared = list(range(5, 13))
    engine.generate([shared], SamplingParams(max_tokens=1))  # leaves its prompt's blocks cached
    with caplog.at_level("INFO", logger="infer"), pytest.raises(PluginError) as info:
        engine.generate([shared + [30], [40, 41], [50, 51]], SamplingParams(max_tokens=4))
    assert str(info.value).startswith("the eviction policy 'strict' from 'infer-plugin-acme' raised KeyError: ")
    assert isinstance(info.value.__cause__, KeyError)
    assert any(record.exc_info for record in caplog.records)  # the traceback, for -v


def test_an_error_raised_in_a_quant_methods_code_names_the_plugin(infer_plugins, tiny_model):
    """Quant methods and models were not among the components blamed: a bare ValueError reached the caller (and
    a gRPC client saw INTERNAL)."""
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.models.layers import UnquantizedMethod

    class Boom(UnquantizedMethod):
        def apply(self, layer, x):
            raise ValueError("boom in apply")

    plugins = runtime_plugin(infer_plugins, "register_quant_methods", "boom", lambda config, qc: Boom())
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", quant="boom"), plugins)
    assert engine.active["quant"] == "boom"
    with pytest.raises(PluginError, match="^the quant method 'boom' from 'infer-plugin-acme' raised ValueError: "
                                          "boom in apply"):
        engine.generate(["hi"], SamplingParams(max_tokens=2))


def test_a_quant_methods_method_for_gives_each_linear_the_method_it_names(infer_plugins, tiny_model):
    """``QuantMethod.method_for``: a plugin's method may hand linears other method objects (a checkpoint of several
    schemes), or None for a float linear; the model builds each linear so, and computes what the methods compute."""
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.models.layers import Linear, UnquantizedMethod

    class Counting(UnquantizedMethod):
        def __init__(self) -> None:
            super().__init__()
            self.rows = 0

        def apply(self, layer, x):
            self.rows += x.reshape(-1, x.shape[-1]).shape[0]
            return super().apply(layer, x)

    attention, mlp = Counting(), Counting()

    class Split(Counting):
        def method_for(self, prefix):
            return None if prefix == "lm_head" else mlp if ".mlp." in prefix else attention

    plugins = runtime_plugin(infer_plugins, "register_quant_methods", "split", lambda config, qc: Split())
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", quant="split"), plugins)
    methods = {m.prefix: m.method for m in engine.loaded.model.modules() if isinstance(m, Linear)}
    assert type(methods.pop("lm_head")) is UnquantizedMethod and len(methods) > 2
    assert all(method is (mlp if ".mlp." in prefix else attention) for prefix, method in methods.items())
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    plain = Engine(EngineConfig(model=str(tiny_model), device="cpu"))
    for prompt in ([5, 17, 300, 42], [900, 12, 8]):
        assert engine.generate([prompt], params)[0].outputs[0].token_ids == \
            plain.generate([prompt], params)[0].outputs[0].token_ids
    assert attention.rows > 0 and mlp.rows > 0


def test_an_error_raised_in_a_schedulers_admission_names_the_plugin(infer_plugins, tiny_model):
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.plugins.continuous_scheduler import ContinuousScheduler

    class Fragile(ContinuousScheduler):
        def check(self, seq):
            return 1 / 0

    plugins = runtime_plugin(infer_plugins, "register_schedulers", "fragile", Fragile)
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="fragile"), plugins)
    for call in (engine.add_request, engine.check_request):
        with pytest.raises(PluginError, match="^the scheduler 'fragile' from 'infer-plugin-acme' raised "
                                              "ZeroDivisionError: division by zero"):
            call("hi", SamplingParams(max_tokens=2))
    assert not engine.has_unfinished()


def test_the_touch_contract_is_stated_where_plugin_authors_read():
    docstring = flat(EvictionPolicy.touch.__doc__ or "")
    assert "never have been inserted" in docstring and "never fail" in docstring and "len()" in docstring
    hooks = flat((ROOT / "docs" / "plugin-hooks.md").read_text())
    eviction = hooks[hooks.index("### register_eviction_policies"):hooks.index("### register_attention_backends")]
    assert "`touch(key)` may be called with a key that is not evictable" in eviction and "never fail" in eviction
    tutorial = flat((ROOT / "docs" / "writing-a-plugin.md").read_text())
    assert "`touch` may come for a key the policy does not hold" in tutorial


# ---------------------------------------------------------------- 2, 3. broken plugins say who they are
def test_a_misspelled_hook_names_the_plugin_and_the_valid_hooks(tmp_path, monkeypatch):
    message = load_failure(tmp_path, monkeypatch, "infer-plugin-typo", "typo",
                           "@hookimpl\ndef register_eviction_policy(register):\n    pass\n")
    assert "plugin 'typo' from package 'infer-plugin-typo' implements 'register_eviction_policy'" in message
    assert "did you mean 'register_eviction_policies'?" in message and "register_schedulers" in message
    assert "`pip uninstall infer-plugin-typo`" in message
    assert message.endswith(f"INFER_PLUGINS={entry_points_but('typo')}")
    assert_no_traceback_from_the_cli("infer-plugin-typo")


def test_a_misnamed_hook_argument_names_the_expected_one(tmp_path, monkeypatch):
    message = load_failure(tmp_path, monkeypatch, "infer-plugin-argname", "argname",
                           "@hookimpl\ndef register_eviction_policies(reg):\n    pass\n")
    assert "plugin 'argname' from package 'infer-plugin-argname' implements register_eviction_policies(reg), " \
           "but infer calls register_eviction_policies(register)" in message
    assert "`pip uninstall infer-plugin-argname`" in message and "INFER_PLUGINS=" in message
    assert_no_traceback_from_the_cli("infer-plugin-argname")


@pytest.mark.parametrize(("hook", "complaint"), [
    ("def register_schedulers(register):\n    raise RuntimeError('boom')\n",
     "failed in its register_schedulers hook: RuntimeError: boom"),
    ("def register_schedulers(register):\n    return {'mine': object}\n",
     "its register_schedulers hook returned a value of type dict, which infer ignores: a registration hook is a "
     "plain function"),
    ("def register_schedulers():\n    pass\n",
     "implements register_schedulers() without arguments, but infer calls register_schedulers(register)"),
    ("def register_schedulers(register):\n    yield\n",
     "its register_schedulers hook returned a value of type generator"),
    ("async def register_schedulers(register):\n    pass\n",
     "its register_schedulers hook returned a value of type coroutine"),
])
def test_a_broken_registration_hook_names_its_package_and_the_way_out(tmp_path, monkeypatch, hook, complaint):
    dist = f"infer-plugin-broken{zlib.crc32(hook.encode())}"  # a module name of its own: imports are cached
    message = load_failure(tmp_path, monkeypatch, dist, "broken", "@hookimpl\n" + hook)
    assert message.startswith(f"plugin 'broken' from package '{dist}'") and complaint in message
    assert f"`pip uninstall {dist}`" in message and "editable install" not in message  # it imported fine
    assert message.endswith(f"INFER_PLUGINS={entry_points_but('broken')}")
    assert_no_traceback_from_the_cli(dist)


def test_a_module_without_hook_implementations_is_reported(tmp_path, monkeypatch, caplog):
    install_fake_plugin(tmp_path, "infer-plugin-bare", "bare", "def register_schedulers(register):\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    PluginManager.from_entry_points(allow="bare")
    assert "plugin 'bare' from package 'infer-plugin-bare' implements no infer hook" in caplog.text
    assert "@hookimpl" in caplog.text


def test_infer_plugins_warns_about_a_name_that_two_kinds_share(tmp_path, monkeypatch):
    """A third-party scheduler named `lru` makes `--plugin lru` ambiguous for every user: `infer plugins` says so."""
    install_fake_plugin(tmp_path, "infer-plugin-clash", "clash",
                        "@hookimpl\ndef register_schedulers(register):\n    register('lru', lambda config, kv: None)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    result = CliRunner().invoke(main, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    assert "infer: warning: 'lru' names a scheduler and an eviction policy; --plugin lru is ambiguous, so select it " \
           "with --scheduler lru or --eviction-policy lru" in result.stderr


def runtime_plugin(plugins: PluginManager, hook: str, name: str, factory: Callable[..., Any]) -> PluginManager:
    module = types.ModuleType("acme_plugin")
    setattr(module, hook, hookimpl(lambda register: register(name, factory)))
    setattr(getattr(module, hook), "__name__", hook)
    plugins.register(module, name="acme", source="infer-plugin-acme")
    return plugins


def test_a_factory_that_raises_is_named(infer_plugins, tiny_model):
    from infer.core.engine import Engine

    def broken(config: EngineConfig) -> EvictionPolicy:
        raise RuntimeError("no policy today")

    plugins = runtime_plugin(infer_plugins, "register_eviction_policies", "moody", broken)
    with pytest.raises(PluginError, match="the eviction policy factory 'moody' from 'infer-plugin-acme' failed: "
                                          "RuntimeError: no policy today; fix the plugin, or choose another"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", eviction_policy="moody"), plugins)


def test_a_third_party_factorys_own_refusal_says_whose_it_is(infer_plugins, tiny_model):
    from infer.core.engine import Engine

    def picky(config: EngineConfig) -> EvictionPolicy:
        raise PluginError("needs a CUDA device")

    plugins = runtime_plugin(infer_plugins, "register_eviction_policies", "picky", picky)
    with pytest.raises(PluginError) as info:
        Engine(EngineConfig(model=str(tiny_model), device="cpu", eviction_policy="picky"), plugins)
    assert str(info.value) == "the eviction policy 'picky' from 'infer-plugin-acme': needs a CUDA device"


def test_a_plugin_whose_dependency_is_missing_says_so(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="infer")
    message = load_failure(tmp_path, monkeypatch, "infer-plugin-needy", "needy",
                           "import infer_test_absent_dependency\n")
    [logged] = [r for r in caplog.records if r.getMessage() == "plugin 'needy' failed to import"]
    assert logged.levelno == logging.INFO and logged.exc_info is not None  # the traceback, for -v
    assert "failed to import: ModuleNotFoundError: No module named 'infer_test_absent_dependency' (the plugin " \
           "imports 'infer_test_absent_dependency', which is not installed: install the plugin's dependencies) " \
           "(-v logs the traceback)" in message and "editable install" not in message
    assert message.endswith(f"INFER_PLUGINS={entry_points_but('needy')}")


@pytest.mark.parametrize(("hook", "field", "factory", "complaint"), [
    ("register_quant_methods", "quant", lambda config, quant_config: None,
     "the quant method factory 'nothing' from 'infer-plugin-acme' returned NoneType, not an instance of QuantMethod"),
    ("register_models", None, lambda raw, quant, dtype, config: object(),
     "the model factory 'LlamaForCausalLM' from 'infer-plugin-acme' returned object, not an instance of Model"),
])
def test_quant_and_model_factories_are_checked(tmp_path, tiny_model, hook, field, factory, complaint):
    from infer.core.engine import Engine

    plugins = PluginManager.from_entry_points(allow=entry_points_but("llama-family") if field is None else None)
    runtime_plugin(plugins, hook, "nothing" if field else "LlamaForCausalLM", factory)
    config = EngineConfig(model=str(tiny_model), device="cpu", **({field: "nothing"} if field else {}))
    with pytest.raises(PluginError, match=re.escape(complaint)):
        Engine(config, plugins)


@pytest.mark.parametrize("stage", ["building the model", "loading the model's weights", "a step"])
def test_running_out_of_device_memory_while_loading_says_how_to_fit_the_model(tiny_model, stage):
    """torch's OutOfMemoryError (a GPU's; faked here by a model plugin) is the user's capacity, not a plugin's bug,
    whether the model is built, loaded or run."""
    import torch

    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.errors import CapacityError
    from infer.plugins.llama_family import build_llama_family

    def out_of_memory(*args: Any) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def greedy(raw: dict[str, Any], quant: Any, dtype: torch.dtype, config: EngineConfig) -> Any:
        if stage == "building the model":
            out_of_memory()
        model = build_llama_family(raw, quant, dtype, config)
        if stage == "a step":
            model.forward = out_of_memory  # a step's activations do not fit beside the KV pool
        else:
            model.load_weights = out_of_memory  # the first tensor does not fit
        return model

    plugins = PluginManager.from_entry_points(allow=entry_points_but("llama-family"))
    runtime_plugin(plugins, "register_models", "LlamaForCausalLM", greedy)
    if stage != "a step":
        with pytest.raises(CapacityError, match=re.escape(f"out of cpu memory while {stage}; the model does not fit: "
                                                          "use a quantized checkpoint or quantize it as it loads")):
            Engine(EngineConfig(model=str(tiny_model), device="cpu"), plugins)
        return
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), plugins)
    with pytest.raises(CapacityError, match=re.escape("out of cpu memory while running a step; the KV pool leaves "
                                                      "too little room for its activations; lower "
                                                      "--kv-cache-memory-gb")):  # not blamed on the model plugin
        engine.generate([[5, 6, 7]], SamplingParams(max_tokens=2))


def test_a_command_factory_that_returns_no_click_command_is_named(tmp_path, monkeypatch):
    install_fake_plugin(tmp_path, "infer-plugin-cmd", "cmd",
                        "@hookimpl\ndef register_commands(register):\n    register('hello', lambda: print)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    complaint = "the command factory 'hello' from 'infer-plugin-cmd' returned builtin_function_or_method, not an " \
                "instance of Command"
    listing = CliRunner().invoke(main, ["--help"])  # lists the commands that work, and warns about this one
    assert listing.exit_code == 0 and complaint in flat(listing.stderr) and "generate" in listing.stdout
    result = CliRunner().invoke(main, ["hello"])
    assert result.exit_code != 0 and "Traceback" not in result.output and complaint in flat(result.output)


def test_a_crashing_command_factory_shows_its_traceback_with_v_only(tmp_path):
    """Click resolves a subcommand before the group's own code runs, so -v must take effect before that."""
    install_fake_plugin(tmp_path, "infer-plugin-crash", "crash",
                        "@hookimpl\ndef register_commands(register):\n    register('hello', lambda: 1 / 0)\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-P", "-m", "infer.cli", *args], capture_output=True,
                              text=True, env=env, timeout=120)

    quiet, verbose = run("hello"), run("-v", "hello")
    for result in (quiet, verbose):
        assert result.returncode != 0 and "the command factory 'hello' from 'infer-plugin-crash'" in result.stderr
    assert "Traceback" not in quiet.stderr
    assert "Traceback" in verbose.stderr and "ZeroDivisionError" in verbose.stderr
    listing = run("-v", "--help")  # --help answers while the options are parsed: -v is eager, so it logs too
    assert listing.returncode == 0 and "(-v logs the traceback)" in listing.stderr
    assert "Traceback" in listing.stderr and "ZeroDivisionError" in listing.stderr


@pytest.mark.parametrize(("breach", "complaint"), [
    ("none", "schedule() returned NoneType, not a SchedulerOutput"),
    ("twice", "scheduled a sequence twice"),
    ("nothing new", "with 0 new token(s) where 4 are uncomputed (it must be 1 to that)"),
    ("too many", "with 5 new token(s) where 4 are uncomputed"),
    ("swap-in under a copy", "its swap-ins write device block(s) [1] that this step's copy-on-write copies"),
    ("foreign", "which is none of the engine's live requests' sequences"),
])
def test_a_schedule_that_breaks_the_contract_is_refused(infer_plugins, tiny_model, breach, complaint):
    """Each breach would otherwise compute wrong tokens without an error, or fail deep in the runner (a swap-in
    into a block that a copy of the same step reads: the block was freed and taken again, and the copy, run after
    the swap-ins, would move the wrong KV)."""
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.interfaces import ScheduledSequence
    from infer.plugins.continuous_scheduler import ContinuousScheduler

    class Breaking(ContinuousScheduler):
        def schedule(self):
            out = super().schedule()
            first = out.scheduled[0]
            if breach == "none":
                return None
            if breach == "twice":
                out.scheduled.append(ScheduledSequence(first.seq, 1))
            elif breach == "foreign":  # a copy sharing the request's tokens: it ran, and changed them
                out.scheduled.append(ScheduledSequence(dataclasses.replace(first.seq, seq_id=first.seq.seq_id + 100),
                                                       first.num_new_tokens))
            elif breach == "swap-in under a copy":
                out.block_ops.swap_in.append((0, 1))
                out.block_ops.copies.append((1, 2))
            else:
                first.num_new_tokens = 0 if breach == "nothing new" else first.num_new_tokens + 1
            return out

    plugins = runtime_plugin(infer_plugins, "register_schedulers", "breaking", Breaking)
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="breaking"), plugins)
    with pytest.raises(PluginError, match=re.escape(complaint)):
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))


def test_a_scheduler_that_keeps_scheduling_a_finished_sequence_is_refused(infer_plugins, tiny_model):
    """A finish() that sets the status but leaves the sequence among the running ones: the engine ran it in every
    later step (a seat and its KV blocks taken for good, compute wasted) without an error."""
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.request import SequenceStatus
    from infer.plugins.continuous_scheduler import ContinuousScheduler

    class Leaky(ContinuousScheduler):
        def finish(self, seq, reason):
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    plugins = runtime_plugin(infer_plugins, "register_schedulers", "leaky", Leaky)
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="leaky"), plugins)
    [first] = engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))
    assert first.finished
    with pytest.raises(PluginError, match=r"scheduler 'leaky' scheduled sequence \d+, which is finished"):
        engine.generate([[9, 10, 11]], SamplingParams(max_tokens=2))


class MinimalScheduler:
    """A scheduler written from the Scheduler docstrings alone, as a third party would: whole prompts first come
    first served, no preemption (the tests' pools never run short), and none of the shipped one's extras: it
    leaves the KV cache's copy-on-write copies where they are and never checks for sequences finished meanwhile."""

    def __init__(self, config: EngineConfig, kv: Any) -> None:
        from collections import deque

        self.kv, self.max_num_seqs, self.waiting, self.running = kv, config.max_num_seqs, deque(), []

    def add(self, seq: Any) -> None:
        self.waiting.append(seq)

    def schedule(self) -> Any:
        from infer.core.interfaces import ScheduledSequence, SchedulerOutput
        from infer.core.request import SequenceStatus

        out = SchedulerOutput(scheduled=[])
        for seq in self.running:
            assert self.kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
            out.scheduled.append(ScheduledSequence(seq, seq.num_tokens - seq.num_computed_tokens))
        while self.waiting and len(self.running) + self.waiting[0].params.n <= self.max_num_seqs:
            seq = self.waiting.popleft()
            seq.num_computed_tokens = self.kv.match_prefix(seq)
            assert self.kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, seq.num_tokens - seq.num_computed_tokens))
        return out

    def update(self, output: Any, sampled: dict[int, list[int]], now: float) -> list[Any]:
        finished = []
        for item in output.scheduled:
            seq, reason = item.seq, None
            seq.num_computed_tokens += item.num_new_tokens
            for i, token in enumerate(sampled.get(seq.seq_id, ())):
                seq.num_computed_tokens += 1 if i else 0
                seq.append_token(token, now)
                if (reason := seq.check_stop_token()) is not None:
                    break
            self.kv.commit(seq)
            if reason is not None:
                self.finish(seq, reason)
                finished.append(seq)
        return finished

    def fork(self, parent: Any, child: Any) -> None:
        from infer.core.request import SequenceStatus

        child.token_ids, child.num_computed_tokens = list(parent.token_ids), parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.kv.fork(parent, child)
        self.running.append(child)

    def finish(self, seq: Any, reason: Any) -> None:
        from infer.core.request import SequenceStatus

        if seq.is_finished:
            return
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def num_running(self) -> int:
        return len(self.running)

    num_preemptions = 0


@pytest.mark.parametrize("mode", [{}, {"async_output": True}, {"async_scheduling": True}],
                         ids=["sync", "async-output", "async-scheduling"])
def test_a_scheduler_written_from_the_docstrings_gives_the_shipped_ones_tokens(infer_plugins, tiny_model, mode):
    """n > 1 forks (copy-on-write copies the scheduler never hands over) and stop tokens found a step late under
    async output and scheduling (finished sequences reach ``update`` only if the engine passes them)."""
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.interfaces import Scheduler

    plugins = runtime_plugin(infer_plugins, "register_schedulers", "minimal",
                             type("Minimal", (MinimalScheduler, Scheduler), {}))
    prompts = [[5, 6, 7, 8, 9], [40, 41, 42] * 7, [300, 301]]
    params = SamplingParams(max_tokens=12, n=3, temperature=0.9, seed=11)

    def run(scheduler: str, params: SamplingParams) -> list[list[list[int]]]:
        engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, scheduler=scheduler,
                                     **mode), plugins)
        return [[c.token_ids for c in r.outputs] for r in engine.generate(prompts, params)]

    shipped = run("continuous", params)
    stops = [shipped[0][1][3], shipped[2][0][5]]  # some completions stop early, a step late under async output
    params = SamplingParams(max_tokens=12, n=3, temperature=0.9, seed=11, stop_token_ids=stops)
    expected = run("continuous", params)
    assert any(len(c) < 12 for r in expected for c in r)
    assert run("minimal", params) == expected
    from infer.core.pooling import PoolingParams  # embedding requests: no token sampled at their last prompt chunk

    def embed(scheduler: str) -> list[list[float] | None]:
        engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64, scheduler=scheduler,
                                     **mode), plugins)
        outs = engine.generate(prompts, [PoolingParams(pooling="mean"), params, PoolingParams()])
        assert engine.kv.stats().used_blocks == 0
        return [out.embedding for out in outs]

    shipped_embeddings = embed("continuous")
    assert shipped_embeddings[0] is not None and shipped_embeddings[2] is not None
    assert embed("minimal") == shipped_embeddings


@pytest.mark.parametrize(("breach", "complaint"), [
    ("out of vocabulary", "proposed [1024, 1024] for sequence 0: drafts are a list of at most k=2 token ids in [0, "
                          "1024)"),
    ("too many", "proposed [5, 5, 5] for sequence 0"),
    ("float token", "proposed [5.0, 5.0]"),
    ("probs shape", "gave probabilities of shape (2, 7) for 2 draft(s) of sequence 0; they must be [>= 2, 1024]"),
])
def test_a_proposal_that_breaks_the_contract_is_refused_and_frees_its_slots(infer_plugins, tiny_model, breach,
                                                                           complaint):
    """A bad draft id used to reach the embedding (IndexError here; on CUDA a device assert)."""
    import torch

    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.interfaces import Proposal, Proposer

    class Breaking(Proposer):
        def propose(self, seqs, k):
            token = {"out of vocabulary": 1024, "float token": 5.0}.get(breach, 5)
            n = k + 1 if breach == "too many" else k
            probs = torch.full((k, 7), 1 / 7) if breach == "probs shape" else None
            return Proposal({s.seq_id: [token] * n for s in seqs}, {s.seq_id: probs for s in seqs})

    plugins = runtime_plugin(infer_plugins, "register_proposers", "breaking",
                             lambda config, target, plugins: Breaking())
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", proposer="breaking",
                                 num_speculative_tokens=2), plugins)
    with pytest.raises(PluginError, match=re.escape(f"proposer 'breaking' {complaint}")):
        engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=6, temperature=0.0))
    assert engine.kv.stats().used_blocks == 0  # generate aborted the request; no draft slot was left behind


@pytest.mark.parametrize(("probs", "complaint"), [
    ("logits", "draft 0's probabilities hold negative values"),
    ("unnormalized", "draft 0's probabilities sum to 1024, not 1"),
    ("nan", "draft 0's probabilities hold 1 non-finite value(s)"),
    ("zero at the draft", "draft 0 is token 5, to which its probabilities give 0"),
    ("uniform", None),  # a proper distribution the drafts may come from: verified, no error
])
def test_draft_probabilities_that_are_no_distribution_of_the_drafts_are_refused(infer_plugins, tiny_model, probs,
                                                                               complaint):
    """Rejection sampling is exact only for the q the drafts were drawn from: probabilities that cannot be one
    (logits, unnormalized weights, a NaN, zero where the draft is) biased a sampled request's output silently. They
    are read back with the verification; the step's draft slots go back before the PluginError."""
    import torch

    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.interfaces import Proposal, Proposer

    def distribution(k: int, vocab: int) -> torch.Tensor:
        q = torch.full((k, vocab), 1 / vocab)
        if probs == "logits":
            q = torch.randn(k, vocab, generator=torch.Generator().manual_seed(0))
        elif probs == "unnormalized":
            q = torch.ones(k, vocab)
        elif probs == "nan":
            q[0, 9] = float("nan")
        elif probs == "zero at the draft":
            q[:, 5], q[:, 6] = 0.0, 2 / vocab
        return q

    class Improper(Proposer):
        def propose(self, seqs, k):
            return Proposal({s.seq_id: [5] * k for s in seqs}, {s.seq_id: distribution(k, 1024) for s in seqs})

    plugins = runtime_plugin(infer_plugins, "register_proposers", "improper",
                             lambda config, target, plugins: Improper())
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", proposer="improper", block_size=4,
                                 num_speculative_tokens=5), plugins)
    params = SamplingParams(max_tokens=6, temperature=0.9, seed=3)
    if complaint is None:
        [out] = engine.generate([[5, 6, 7, 8, 9, 10]], params)
        assert len(out.outputs[0].token_ids) == 6 and engine.stats.spec_proposed > 0
        return
    engine.add_request([5, 6, 7, 8, 9, 10], params, request_id="r")
    engine.step()  # the prefill: nothing drafts
    with pytest.raises(PluginError, match=re.escape(f"proposer 'improper' gave sequence 0 draft probabilities its "
                                                    f"drafts cannot have been drawn from: {complaint}")):
        engine.step()
    [seq] = engine.requests["r"].seqs
    assert len(engine.kv.block_table(seq)) == -(-(seq.num_computed_tokens + 1) // 4)  # no slot past the next token


def test_a_proposer_that_raises_gives_back_the_draft_slots(infer_plugins, tiny_model):
    """The KV slots reserved for a step's drafts go back when the proposer raises (a plugin bug, a draft model's
    forward pass failing), as they do when its proposal breaks the contract: the request keeps only its own."""
    from infer import SamplingParams
    from infer.core.engine import Engine
    from infer.core.interfaces import Proposer

    class Raising(Proposer):
        def propose(self, seqs, k):
            raise RuntimeError("draft model failed")

    plugins = runtime_plugin(infer_plugins, "register_proposers", "raising",
                             lambda config, target, plugins: Raising())
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", proposer="raising", block_size=4,
                                 num_speculative_tokens=5), plugins)
    engine.add_request([5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=8, temperature=0.0), request_id="r")
    engine.step()  # the prefill: nothing drafts
    with pytest.raises(PluginError, match="draft model failed"):
        engine.step()
    [seq] = engine.requests["r"].seqs
    assert len(engine.kv.block_table(seq)) == -(-(seq.num_computed_tokens + 1) // 4)  # no slot past the next token


@pytest.mark.parametrize("attribute", ["block_size", "num_blocks"])
def test_a_kv_cache_without_its_block_geometry_is_refused(infer_plugins, tiny_model, attribute):
    from infer.core.engine import Engine
    from infer.plugins.paged_cache import PagedKVCache

    def factory(config: EngineConfig, num_blocks: int, eviction: EvictionPolicy) -> PagedKVCache:
        kv = PagedKVCache(num_blocks, config.block_size, eviction, True)
        setattr(kv, attribute, getattr(kv, attribute) + 1)  # a cache that misstates its geometry
        return kv

    plugins = runtime_plugin(infer_plugins, "register_kv_caches", "shapeless", factory)
    with pytest.raises(PluginError, match="KV cache 'shapeless' has block_size .* not the .* its factory was given"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache="shapeless", num_kv_blocks=64), plugins)


def test_a_refused_runtime_plugin_leaves_the_manager_usable(infer_plugins):
    module = types.ModuleType("half")
    module.register_eviction_policies = hookimpl(lambda reg: None)
    with pytest.raises(PluginError, match="implements register_eviction_policies\\(reg\\)"):
        infer_plugins.register(module, name="half", source="acme")
    assert "lru" in infer_plugins.registry("eviction_policy")  # pluggy's half-registered plugin was dropped


def test_an_import_failure_suggests_uninstalling_or_the_allow_list(tmp_path, monkeypatch):
    message = load_failure(tmp_path, monkeypatch, "infer-plugin-renamed", "renamed", None)
    assert "plugin 'renamed' from package 'infer-plugin-renamed' failed to import" in message
    assert "`pip uninstall infer-plugin-renamed`" in message and "editable install" in message
    assert message.endswith(f"INFER_PLUGINS={entry_points_but('renamed')}")
    PluginManager.from_entry_points(allow=entry_points_but("renamed")).collect()  # the suggested allow-list works


# ---------------------------------------------------------------- 4. unknown names under an allow-list
def test_unknown_names_under_an_allow_list_name_it_and_the_shipped_provider():
    limited = PluginManager.from_entry_points(allow="paged")
    cases = [("scheduler", "continuous", "continuous"), ("eviction_policy", "lfu", "eviction"),
             ("model", "LlamaForCausalLM", "llama-family")]
    for kind, name, entry_point in cases:
        with pytest.raises(PluginError) as error:
            limited.registry(kind).get(name)
        assert (f"INFER_PLUGINS=paged limited loading to those entry points, and infer's own entry point "
                f"{entry_point!r} provides {name!r}: use INFER_PLUGINS=paged,{entry_point}") in str(error.value)
    with pytest.raises(PluginError, match="INFER_PLUGINS=paged limited loading.*if a plugin left out provides"):
        limited.registry("scheduler").get("no-such-scheduler")
    with pytest.raises(PluginError, match="unknown plugin 'lfu'.*entry point 'eviction' provides 'lfu'"):
        limited.resolve_plugin_names(EngineConfig(), ["lfu"])
    with pytest.raises(PluginError) as error:
        PluginManager.from_entry_points(allow="").registry("scheduler").get("no-such-scheduler")
    assert "INFER_PLUGINS" not in str(error.value)


def test_an_unsupported_architecture_under_an_allow_list_names_the_shipped_provider(tiny_model):
    from infer.core.config import EngineConfig as Config
    from infer.core.engine import Engine
    from infer.core.errors import CheckpointError

    limited = PluginManager.from_entry_points(allow="continuous,paged,eviction,attention-backends")
    with pytest.raises(CheckpointError, match="unsupported architecture 'LlamaForCausalLM'; supported: \\(none\\); "
                                              "INFER_PLUGINS=.*infer's own entry point 'llama-family' provides"):
        Engine(Config(model=str(tiny_model), device="cpu"), limited)


# ---------------------------------------------------------------- 5. duplicates: advice that works
def test_a_name_one_package_registers_twice_asks_it_to_rename_one(tmp_path, monkeypatch):
    twice = ("@hookimpl\ndef register_eviction_policies(register):\n    register('mine', lambda config: None)\n"
             "    register('mine2', lambda config: None, aliases=('mine',))\n")
    install_fake_plugin(tmp_path, "infer-plugin-twice", "twice", twice)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as error:  # not "registered by both X and X; uninstall one of them"
        PluginManager.from_entry_points().collect()
    assert flat(str(error.value)).startswith(
        "duplicate eviction policy name 'mine': 'infer-plugin-twice' (entry point 'twice') registers it twice (as "
        "names or aliases); the plugin must rename one; fix the plugin, or uninstall it: `pip uninstall "
        "infer-plugin-twice`")


def test_duplicate_names_name_both_entry_points_and_allow_lists_that_work(tmp_path, monkeypatch):
    twin = "@hookimpl\ndef register_eviction_policies(register):\n    register('twin', lambda config: None)\n"
    install_fake_plugin(tmp_path, "infer-plugin-twin-a", "twin-a", twin)
    install_fake_plugin(tmp_path, "infer-plugin-twin-b", "twin-b", twin)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError) as error:
        PluginManager.from_entry_points(allow="").collect()
    message = flat(str(error.value))
    assert ("registered by both 'infer-plugin-twin-a' (entry point 'twin-a') and 'infer-plugin-twin-b' "
            "(entry point 'twin-b')") in message
    assert "`infer plugins`" not in message  # it fails with this same error
    allow_lists = re.findall(r"INFER_PLUGINS=([\w.,-]+)", message)
    assert allow_lists == [entry_points_but("twin-a"), entry_points_but("twin-b")]
    for allow in allow_lists:
        assert "twin" in PluginManager.from_entry_points(allow=allow).registry("eviction_policy")


# ---------------------------------------------------------------- 6, 7. names, aliases, plurals
def test_a_bad_name_from_an_installed_plugin_says_how_to_run_without_it(tmp_path, monkeypatch):
    message = load_failure(tmp_path, monkeypatch, "infer-plugin-badname", "badname",
                           "@hookimpl\ndef register_eviction_policies(register):\n"
                           "    register('Bad Name!', lambda config: None)\n")
    assert "the eviction policy name 'Bad Name!'" in message and "`pip uninstall infer-plugin-badname`" in message
    assert message.endswith(f"INFER_PLUGINS={entry_points_but('badname')}")


@pytest.mark.parametrize(("name", "aliases", "complaint"), [
    ("ok-name", "xyz", "aliases='xyz'; aliases must be a list or tuple of names"),
    ("ok-name", ("fine", 3), "aliases must be a list or tuple of names"),
    ("Bad Name!", (), "the eviction policy name 'Bad Name!', which infer cannot select by name"),
    ("MyPolicy", (), "the eviction policy name 'MyPolicy'"),
    ("-dash", (), "starting with a letter or digit"),
    ("ok-name", ("ok name",), "'ok name'"),
    ("ok-name", ("ok-name",), "leave out the name itself"),
    ("ok-name", ("b", "b"), "list each alias once"),
])
def test_register_refuses_bad_names_and_aliases(infer_plugins, name, aliases, complaint):
    module = types.ModuleType("bad_names")
    module.register_eviction_policies = hookimpl(lambda register: register(name, lambda config: None, aliases))
    infer_plugins.register(module, name="bad-names", source="infer-plugin-bad")
    with pytest.raises(PluginError) as error:
        infer_plugins.collect()
    assert str(error.value).startswith("'infer-plugin-bad' registered") and complaint in str(error.value)


def test_every_shipped_name_passes_and_architectures_keep_their_capitals(infer_plugins):
    names = {(c.kind, c.name) for c in infer_plugins.components()}  # would raise on a refused shipped name
    assert ("model", "LlamaForCausalLM") in names and ("scheduler", "chunked-prefill") in names
    models: Registry[object] = Registry("model", names=ARCHITECTURE_NAMES)
    models.register("Gemma3ForCausalLM", object, ["gemma3.text"], source="acme")
    assert models.get("gemma3.text") is object


def test_kinds_are_pluralized_in_english(infer_plugins):
    with pytest.raises(PluginError, match="registered eviction policies: lfu, lru, "):
        infer_plugins.registry("eviction_policy").get("nope")
    with pytest.raises(PluginError, match="registered kv caches: paged"):
        infer_plugins.registry("kv_cache").get("nope")


# ---------------------------------------------------------------- 8. the template's README, followed as written
TEMPLATE = ROOT / "plugin_template"


def rename_block(readme: str) -> str:
    blocks = [block for block in re.findall(r"```bash\n(.*?)```", readme, flags=re.S) if "mv infer_plugin_" in block]
    assert len(blocks) == 1, "plugin_template/README.md should show the rename as one bash block"
    return blocks[0]


def test_the_template_readme_links_survive_copying_and_uninstalls_before_renaming():
    readme = (TEMPLATE / "README.md").read_text()
    assert "](../" not in readme, "links out of plugin_template/ break once the folder is copied"
    block = rename_block(readme)
    lines = [line.strip() for line in block.splitlines()]
    uninstall = lines.index("pip uninstall -y infer-plugin-example")
    assert uninstall < next(i for i, line in enumerate(lines) if line.startswith("mv "))
    assert lines.index("pip install -e .") > uninstall


def test_the_template_rename_commands_work_on_a_copy(tmp_path):
    copy = tmp_path / "infer-plugin-mything"
    shutil.copytree(TEMPLATE, copy, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", ".*cache"))
    readme = (copy / "README.md").read_text()
    stubs = "pip() { :; }\ninfer() { :; }\nset -e\n"  # no installs here: test_plugin_template.py installs
    done = subprocess.run(["bash", "-c", stubs + rename_block(readme)], cwd=copy, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert (copy / "README.md").read_text() == readme, "the rename must leave the README's instructions intact"
    leftovers = [str(path.relative_to(copy)) for path in copy.rglob("*") if path.is_file()
                 and path.name != "README.md" and re.search(r"infer.plugin.example", path.read_text())]
    assert leftovers == []
    project = tomllib.loads((copy / "pyproject.toml").read_text())
    assert project["project"]["name"] == "infer-plugin-mything"
    assert project["project"]["entry-points"]["infer"] == {"mything": "infer_plugin_mything.plugin"}
    assert project["tool"]["setuptools"]["packages"] == ["infer_plugin_mything"]
    imported = subprocess.run([sys.executable, "-c", "import infer_plugin_mything.plugin"], cwd=copy,
                              capture_output=True, text=True, timeout=120)
    assert imported.returncode == 0, imported.stderr


def test_registered_options_must_be_plugin_options(infer_plugins):
    plugins = runtime_plugin(infer_plugins, "register_eviction_policies", "typed", lambda config: None)
    module = types.ModuleType("acme_options")

    def register_eviction_policies(register):
        register("untyped", lambda config: None, options={"window": 64})

    module.register_eviction_policies = hookimpl(register_eviction_policies)
    plugins.register(module, name="acme-options", source="infer-plugin-options")
    with pytest.raises(PluginError, match="registered eviction policy 'untyped' with options=\\{'window': 64\\}; "
                                          "options maps each key \\(a non-empty name without '.'.*\\) to an "
                                          "infer.core.plugin_options.PluginOption"):
        plugins.collect()


def test_a_raising_registration_hook_logs_its_traceback_for_v(tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="infer")
    message = load_failure(tmp_path, monkeypatch, "infer-plugin-raising", "raising",
                           "@hookimpl\ndef register_schedulers(register):\n    raise RuntimeError('no schedulers')\n")
    assert "failed in its register_schedulers hook: RuntimeError: no schedulers (-v logs the traceback)" in message
    [logged] = [r for r in caplog.records if "failed in its register_schedulers hook" in r.getMessage()]
    assert logged.levelno == logging.INFO and isinstance(logged.exc_info[1], RuntimeError)


def test_an_installed_observer_that_raises_names_its_way_out(tmp_path, monkeypatch, tiny_model):
    from infer.core.engine import Engine
    from infer.core.request import SamplingParams

    install_fake_plugin(tmp_path, "infer-plugin-noisy", "noisy",
                        "@hookimpl\ndef on_step(stats):\n    raise RuntimeError('noisy observer')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=32),
                    PluginManager.from_entry_points(allow=""))
    with pytest.raises(PluginError) as info:
        engine.generate(["hi"], SamplingParams(max_tokens=2))
    message = flat(str(info.value))
    assert message.startswith("the observer 'noisy' from 'infer-plugin-noisy' raised RuntimeError in on_step")
    assert "`pip uninstall infer-plugin-noisy`" in message and message.endswith(
        f"INFER_PLUGINS={entry_points_but('noisy')}")
