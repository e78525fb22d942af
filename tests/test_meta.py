"""Meta-tests, as datasette has them: every hookspec is documented with its exact signature, every hookspec is
called in a real run, and every CLI command and option is documented.

A hookspec added to core/hookspecs.py fails here until docs/plugin-hooks.md shows it and :class:`Recorder` (below)
implements it and sees it called; ``test_an_extra_hookspec_fails_both_checks`` proves that with a simulated one.
"""
from __future__ import annotations

import inspect
import re
import typing
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import click
import pytest

from infer import hookimpl
from infer.core import hookspecs
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.metrics import StepStats
from infer.core.plugins import KINDS, PluginManager
from infer.core.registry import Register
from infer.core.request import RequestOutput, SamplingParams

DOCS = Path(__file__).resolve().parents[1] / "docs"
RECORDED_NAME = "meta-recorder"
WidgetFactory = Callable[[], object]  # the factory type of the simulated extra hookspec


# ---------------------------------------------------------------- the checks
def hookspec_functions(namespace: Iterable[Any]) -> dict[str, Callable[..., Any]]:
    """The functions marked ``@hookspec`` among ``namespace``'s values."""
    marker = f"{hookspecs.hookspec.project_name}_spec"
    return {fn.__name__: fn for fn in namespace if callable(fn) and hasattr(fn, marker)}


class _Source(str):
    """An annotation kept as its source text (``from __future__ import annotations``), shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def signature_line(fn: Callable[..., Any]) -> str:
    """``def name(param: Type, ...) -> Return`` as written in the hookspec."""
    sig = inspect.signature(fn)

    def text(annotation: Any) -> Any:
        return _Source(annotation) if isinstance(annotation, str) else annotation

    params = [p.replace(annotation=text(p.annotation)) for p in sig.parameters.values()]
    return f"def {fn.__name__}{sig.replace(parameters=params, return_annotation=text(sig.return_annotation))}"


def _normalized(text: str) -> str:
    return " ".join(text.replace("``", "`").split())


def undocumented(specs: dict[str, Callable[..., Any]], doc: str) -> list[str]:
    """Hookspecs whose exact signature, or whose contract's first line, is missing from the doc."""
    flat = _normalized(doc)
    missing = []
    for name, fn in specs.items():
        summary = (inspect.getdoc(fn) or "").splitlines()[0:1]
        if signature_line(fn) not in doc or (summary and _normalized(summary[0]) not in flat):
            missing.append(name)
    return missing


def unexercised(specs: Iterable[str], called: Counter[str]) -> list[str]:
    return [name for name in specs if not called[name]]


# ---------------------------------------------------------------- a plugin that implements every hook
class Recorder:
    """Implements every hookspec, records each call, and registers one component of every kind."""

    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self.outputs: list[RequestOutput] = []
        self.steps: list[StepStats] = []

    def _register(self, hook: str, register: Callable[..., None], factory: Callable[..., Any]) -> None:
        self.calls[hook] += 1
        register(RECORDED_NAME, factory)

    @hookimpl
    def register_schedulers(self, register: Any) -> None:
        self._register("register_schedulers", register, lambda config, kv: None)

    @hookimpl
    def register_kv_caches(self, register: Any) -> None:
        self._register("register_kv_caches", register, lambda config, num_blocks, eviction: None)

    @hookimpl
    def register_eviction_policies(self, register: Any) -> None:
        self._register("register_eviction_policies", register, lambda config: None)

    @hookimpl
    def register_attention_backends(self, register: Any) -> None:
        self._register("register_attention_backends", register, lambda config: None)

    @hookimpl
    def register_quant_methods(self, register: Any) -> None:
        self._register("register_quant_methods", register, lambda config, quantization_config: None)

    @hookimpl
    def register_proposers(self, register: Any) -> None:
        self._register("register_proposers", register, lambda config, target, plugins: None)

    @hookimpl
    def register_tool_parsers(self, register: Any) -> None:
        self._register("register_tool_parsers", register, lambda config, tokenizer: None)

    @hookimpl
    def register_reasoning_parsers(self, register: Any) -> None:
        self._register("register_reasoning_parsers", register, lambda config, tokenizer: None)

    @hookimpl
    def register_structured_output_backends(self, register: Any) -> None:
        self._register("register_structured_output_backends", register, lambda config, vocabulary: None)

    @hookimpl
    def register_logits_processors(self, register: Any) -> None:
        self._register("register_logits_processors", register, lambda config, tokenizer: None)

    @hookimpl
    def register_poolers(self, register: Any) -> None:
        self._register("register_poolers", register, lambda config: None)

    @hookimpl
    def register_models(self, register: Any) -> None:
        self._register("register_models", register, lambda hf_config, quant, dtype, config: None)

    @hookimpl
    def register_commands(self, register: Any) -> None:
        self._register("register_commands", register, lambda: click.Command(RECORDED_NAME))

    @hookimpl
    def on_request_finished(self, output: RequestOutput) -> None:
        self.calls["on_request_finished"] += 1
        self.outputs.append(output)

    @hookimpl
    def on_step(self, stats: StepStats) -> None:
        self.calls["on_step"] += 1
        self.steps.append(stats)


@pytest.fixture(scope="module")
def recorded(tiny_model: Path) -> tuple[Recorder, PluginManager, list[RequestOutput]]:
    """A tiny real run with the recorder registered next to the installed plugins."""
    recorder = Recorder()
    plugins = PluginManager.from_entry_points()
    plugins.register(recorder, name="meta-recorder", source="tests")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=64), plugins)
    outputs = engine.generate(["def add(a, b):", [5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0,
                                                                          ignore_eos=True))
    return recorder, plugins, outputs


# ---------------------------------------------------------------- the meta-tests
def test_every_hookspec_is_documented_with_its_exact_signature():
    specs = hookspec_functions(vars(hookspecs).values())
    assert len(specs) >= 10
    missing = undocumented(specs, (DOCS / "plugin-hooks.md").read_text(encoding="utf-8"))
    assert not missing, ("document these hooks in docs/plugin-hooks.md with their exact signature and contract: "
                         + "; ".join(signature_line(specs[name]) for name in missing))


def test_every_factory_type_is_documented_as_hookspecs_defines_it():
    """The factory aliases that the registration hooks' signatures name: plugin-hooks.md lists each as defined."""
    import inspect

    source = inspect.getsource(hookspecs)
    lines = [line for line in source.splitlines() if line.split(" = ")[0].endswith("Factory")]
    assert len(lines) >= 10
    doc = (DOCS / "plugin-hooks.md").read_text(encoding="utf-8")
    missing = [line for line in lines if line not in doc]
    assert not missing, f"add these lines to docs/plugin-hooks.md's list of factory types: {missing}"


def unresolved(hint: Any) -> list[Any]:
    """The parts of a resolved type hint still written as text (a forward reference, a string), at any depth."""
    if isinstance(hint, (str, typing.ForwardRef)):
        return [hint]
    return [part for arg in typing.get_args(hint) for part in unresolved(arg)]


def test_every_hookspec_and_factory_type_resolves_with_the_hookspec_namespace():
    """A plugin author's tooling calls typing.get_type_hints on the hookspecs, whose names hookspecs.py imports for
    type checkers only: with hookspec_namespace() every annotation resolves, forward references inside the factory
    types included, to the classes that the docs name."""
    import types

    import torch

    from infer.core.interfaces import KVCache, EvictionPolicy, Model, QuantMethod

    namespace = hookspecs.hookspec_namespace()
    specs = hookspec_functions(vars(hookspecs).values())
    assert len(specs) >= 10
    for name, fn in specs.items():
        hints = typing.get_type_hints(fn, localns=namespace)
        assert set(hints) == {*inspect.signature(fn).parameters, "return"}, name
        assert not unresolved(list(hints.values())), f"{name}: {unresolved(list(hints.values()))}"
    factories = {name: alias for name, alias in vars(hookspecs).items() if name.endswith("Factory")}
    assert len(factories) >= 10
    resolved = typing.get_type_hints(types.SimpleNamespace(__annotations__=factories), vars(hookspecs), namespace)
    assert not unresolved(list(resolved.values())), unresolved(list(resolved.values()))
    assert resolved["KVCacheFactory"] == Callable[[EngineConfig, int, EvictionPolicy], KVCache]
    assert resolved["ModelFactory"] == Callable[[dict[str, Any], QuantMethod | None, torch.dtype, EngineConfig], Model]
    assert typing.get_type_hints(hookspecs.register_kv_caches, localns=namespace)["register"] == \
        Register[Callable[[EngineConfig, int, EvictionPolicy], KVCache]]
    assert typing.get_type_hints(hookspecs.on_step, localns=namespace) == {"stats": StepStats, "return": type(None)}


def test_every_hookspec_is_called_in_a_real_run(recorded):
    recorder, _, _ = recorded
    specs = hookspec_functions(vars(hookspecs).values())
    missing = unexercised(specs, recorder.calls)
    assert not missing, f"add these hooks to Recorder in tests/test_meta.py and make a real run call them: {missing}"


def test_the_recorded_calls_carry_real_objects(recorded):
    recorder, plugins, outputs = recorded
    for kind in KINDS:  # each register callback fed the registry of its own kind
        assert plugins.registry(kind).entry(RECORDED_NAME).source == "tests"
    assert all(recorder.calls[hook] == 1 for hook in KINDS.values())  # registration hooks: once per collection
    assert sorted(o.request_id for o in recorder.outputs) == sorted(o.request_id for o in outputs)
    assert all(o.finished for o in recorder.outputs)
    assert len(recorder.steps) == recorder.steps[-1].step and recorder.steps[-1].kv.total_blocks == 64
    assert sum(s.num_decode_tokens + s.num_prefill_tokens for s in recorder.steps) >= 2 * 3


def test_an_extra_hookspec_fails_both_checks(recorded):
    """Simulate a hookspec added without docs and without a test: both meta-checks name it."""
    recorder, _, _ = recorded

    @hookspecs.hookspec
    def register_widgets(register: Register[WidgetFactory]) -> None:
        """Register widgets."""

    specs = {**hookspec_functions(vars(hookspecs).values()), **hookspec_functions([register_widgets])}
    doc = (DOCS / "plugin-hooks.md").read_text(encoding="utf-8")
    assert undocumented(specs, doc) == ["register_widgets"]
    assert unexercised(specs, recorder.calls) == ["register_widgets"]
    documented = doc + "\n```python\ndef register_widgets(register: Register[WidgetFactory]) -> None\n```\n" \
                       "Register widgets.\n"
    assert undocumented(specs, documented) == []
    # a changed signature or contract is caught too
    assert undocumented(specs, documented.replace("Register[WidgetFactory]", "Register[Any]")) == ["register_widgets"]
    assert undocumented(specs, documented.replace("Register widgets.", "")) == ["register_widgets"]


def test_every_cli_command_and_option_is_documented():
    from infer.cli import main

    doc = (DOCS / "cli.md").read_text(encoding="utf-8")
    sections = dict(re.findall(r"^## `infer ([\w-]+)`\n(.*?)(?=^## |\Z)", doc, flags=re.M | re.S))
    sections[""] = doc.split("## `infer ", 1)[0]  # the group options come first
    ctx = click.Context(main)
    commands = {"": main} | {name: main.get_command(ctx, name) for name in main.list_commands(ctx)}
    missing = []
    for name, command in commands.items():
        if name not in sections:
            missing.append(f"infer {name}")
            continue
        for param in command.params:
            for opt in getattr(param, "opts", []):
                if opt.startswith("--") and f"`{opt}" not in sections[name]:
                    missing.append(f"infer {name} {opt}".replace("  ", " "))
    assert not missing, f"document in docs/cli.md: {', '.join(missing)}"


def test_every_cli_option_has_help_text():
    """`infer COMMAND --help` explains every option (`infer client --max-tokens` showed only its default)."""
    from infer.cli import main

    def commands(command: click.Command, path: str, ctx: click.Context) -> Iterable[tuple[str, click.Command]]:
        yield path, command
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                yield from commands(command.get_command(ctx, name), f"{path} {name}", ctx)

    found = list(commands(main, "infer", click.Context(main)))
    assert len(found) >= 10
    bare = [f"{path} {param.opts[0]}" for path, command in found for param in command.params
            if isinstance(param, click.Option) and not (param.help or "").strip()]
    assert not bare, f"give these options a help text: {', '.join(bare)}"


def test_each_component_options_help_names_every_shipped_component_of_its_kind():
    """`infer --help` names the shipped choices of --scheduler, --quant, ...: a component shipped later than the
    help text was missing from it (`--quant` did not name auto-round)."""
    from infer.cli import main
    from infer.core.config import COMPONENT_FIELDS
    from infer.core.registry import SHIPPED_SOURCE

    helps = {param.opts[0]: param.help or "" for param in main.params if isinstance(param, click.Option)}
    plugins = PluginManager.from_entry_points().collect()
    unnamed = []
    for kind, field in COMPONENT_FIELDS.items():
        option = f"--{field.replace('_', '-')}"
        shipped = [c.name for c in plugins.components() if c.kind == kind and c.source == SHIPPED_SOURCE]
        assert shipped, kind
        unnamed += [f"{option} {name}" for name in shipped
                    if not re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", helps[option])]
    assert not unnamed, f"name these in the options' help texts: {', '.join(unnamed)}"


def test_every_shipped_quant_method_option_is_documented():
    """docs/quantization.md's options table names every option the shipped quant methods declare, and no other."""
    plugins = PluginManager.from_entry_points().collect()
    declared = {f"{entry.name}.{key}" for entry in plugins.registry("quant_method") for key in entry.options}
    table = (DOCS / "quantization.md").read_text(encoding="utf-8").split("## Options", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `([\w-]+\.\w+)` \|", table, flags=re.M))
    assert declared and documented == declared


def test_the_shipped_entry_points_are_listed_in_the_hook_docs():
    """Users build INFER_PLUGINS allow-lists from this list; it must match pyproject.toml."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    shipped = list(tomllib.loads((root / "pyproject.toml").read_text())["project"]["entry-points"]["infer"])
    text = " ".join((root / "docs" / "plugin-hooks.md").read_text().split())
    listed = re.search(r"The shipped entry points are (.*?): an allow-list", text).group(1)
    assert re.findall(r"`([a-z0-9-]+)`", listed) == shipped


def test_every_group_option_reaches_the_engine_config():
    """EngineArgs.from_kwargs drops a click parameter that FIELD_OF_OPTION does not map: a new option would be
    accepted and do nothing. Each maps to an EngineConfig field (or a plugin option), or is one of the four that
    EngineArgs reads itself."""
    import dataclasses

    import click

    from infer.cli.options import FIELD_OF_OPTION, engine_options
    from infer.core.config import EngineConfig

    @click.command()
    @engine_options
    def group(**kwargs: object) -> None:
        """Never invoked."""

    handled_by_engine_args = {"plugins", "plugin_option", "no_prefix_caching", "no_cuda_graphs"}
    assert {p.name for p in group.params} - set(FIELD_OF_OPTION) == handled_by_engine_args
    fields = {f.name for f in dataclasses.fields(EngineConfig)}
    assert all(target in fields or target.startswith("plugin_options.") for target in FIELD_OF_OPTION.values())


def test_the_public_component_classes_have_their_documented_constructors():
    """writing-a-plugin.md's table of shipped classes to build on: each imports from its documented path, takes
    the documented constructor arguments, and is what its documented registered names build."""
    import importlib

    text = (DOCS / "writing-a-plugin.md").read_text()
    rows = re.findall(r"^\| `(infer\.[\w.]+)`((?:, `\w+`)*) \| `\(([^)]*)\)` \| (.+) \|$", text, re.M)
    assert len(rows) == 5, rows
    plugins = PluginManager.from_entry_points().collect()
    config = EngineConfig()
    eviction = plugins.registry("eviction_policy").get("lru")(config)
    kv = plugins.registry("kv_cache").get("paged")(config, 8, eviction)
    arguments = {"scheduler": (config, kv), "kv_cache": (config, 8, eviction), "eviction_policy": (config,),
                 "attention_backend": (config,)}
    for path, more, params, registered in rows:
        module_name, first = path.rsplit(".", 1)
        module = importlib.import_module(module_name)
        classes = [getattr(module, name) for name in [first] + re.findall(r"`(\w+)`", more)]
        documented = [p.strip().split("=")[0] for p in params.split(",") if p.strip()]
        for cls in classes:
            assert list(inspect.signature(cls).parameters) == documented, (cls, documented)
        built = [plugins.registry(kind).get(name)(*arguments[kind]) for name in re.findall(r"`([\w-]+)`", registered)
                 for kind in arguments if name in plugins.registry(kind)]
        assert {type(component) for component in built} == set(classes), (path, built)


def test_the_interfaces_module_exports_every_plugin_abc():
    """Plugins import every ABC from ``infer.core.interfaces``; the reply-reading ones live in reply_interfaces.py
    (to keep each file on a screen or two) and must stay exported, as must anything public added to either."""
    from infer.core import interfaces, reply_interfaces

    def public(module: Any) -> set[str]:
        return {name for name, value in vars(module).items() if not name.startswith("_")
                and getattr(value, "__module__", None) == module.__name__
                and (inspect.isclass(value) or callable(value))}

    constants = {"QUANTIZED_TENSOR_NAMES", "Model"}
    from_request = {"Sequence", "SequenceStatus", "FinishReason"}  # what schedulers read and set, re-exported
    assert public(interfaces) | public(reply_interfaces) | constants | from_request == set(interfaces.__all__)
    assert all(getattr(interfaces, name) is not None for name in interfaces.__all__)
