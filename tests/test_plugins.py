"""The plugin core: entry points, run-time registration, duplicate and unknown names, --plugin resolution."""
from __future__ import annotations

import signal
import types

import pytest
import torch
from click.testing import CliRunner

from infer import hookimpl
from infer.cli import main
from infer.core.admission import check_schedule
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import ConfigError, PluginError
from infer.core.plugins import PluginManager
from infer.core.interfaces import ScheduledSequence, SchedulerOutput
from infer.core.request import SamplingParams, Sequence
from infer.plugins.continuous_scheduler import ContinuousScheduler
from infer.plugins.eviction import LRUPolicy
from infer.plugins.paged_cache import PagedKVCache


def plugin_module(name: str, **hooks) -> types.ModuleType:
    module = types.ModuleType(name)
    for hook_name, function in hooks.items():
        setattr(module, hook_name, hookimpl(function))
    return module


def test_shipped_components_register_through_entry_points(infer_plugins):
    kinds = {(c.kind, c.name): c.source for c in infer_plugins.components()}
    for key in [("scheduler", "continuous"), ("kv_cache", "paged"), ("attention_backend", "torch"),
                ("eviction_policy", "lru"), ("model", "LlamaForCausalLM")]:
        assert kinds[key] == "infer-engine"


def test_a_runtime_plugin_becomes_selectable_by_name(tiny_model, infer_plugins):
    built = []

    class LastInFirstOut(ContinuousScheduler):
        def add(self, seq):
            super().add(seq)
            self.waiting.rotate(1)

    def register_schedulers(register):
        register("lifo", lambda config, kv: built.append(1) or LastInFirstOut(config, kv))

    infer_plugins.register(plugin_module("third_party", register_schedulers=register_schedulers), source="acme")
    config = infer_plugins.resolve_plugin_names(EngineConfig(model=str(tiny_model), device="cpu"), ["lifo"])
    assert config.scheduler == "lifo"
    assert ("scheduler", "lifo", "acme") in {(c.kind, c.name, c.source) for c in infer_plugins.components()}
    engine = Engine(config, infer_plugins)
    out = engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert built == [1] and len(out[0].outputs[0].token_ids) == 4


def test_a_kv_cache_whose_block_tables_are_lists_runs_like_the_shipped_one(tiny_model, infer_plugins):
    """The interface allows any sequence of ints; the shipped caches hand out int32 arrays (copied as is)."""
    from infer.plugins.paged_cache import PagedKVCache

    class ListTables(PagedKVCache):
        def block_table(self, seq):
            return list(super().block_table(seq))

    def register_kv_caches(register):
        register("list-tables", lambda config, n, eviction: ListTables(n, config.block_size, eviction, True))

    infer_plugins.register(plugin_module("lists", register_kv_caches=register_kv_caches), source="acme")
    prompts = ["def fib(n):", "import os\nimport sys\n" * 3, "x"]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outputs = {}
    for kv_cache in ("paged", "list-tables"):
        engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache=kv_cache, block_size=4),
                        infer_plugins)
        outputs[kv_cache] = [r.outputs[0].token_ids for r in engine.generate(prompts, params)]
    assert outputs["list-tables"] == outputs["paged"] and all(len(ids) == 24 for ids in outputs["paged"])


class NeverSchedules(ContinuousScheduler):
    def schedule(self):
        return SchedulerOutput(scheduled=[])


class OverBudget(ContinuousScheduler):
    def schedule(self):
        out = super().schedule()
        out.scheduled += [ScheduledSequence(item.seq, 0) for item in out.scheduled]  # each sequence twice
        return out


class SkipsAllocation(ContinuousScheduler):
    def schedule(self):
        seq = self.waiting.popleft()
        self.running.append(seq)
        return SchedulerOutput(scheduled=[ScheduledSequence(seq, seq.num_tokens)])


@pytest.mark.parametrize(("scheduler", "message"), [
    (NeverSchedules, r"scheduled nothing while 1 sequence\(s\) wait and 0 run: the engine would never finish them"),
    (OverBudget, "scheduled 4 sequences, over max_num_seqs=2"),
    (SkipsAllocation, r"from 'acme' \(with KV cache 'paged' from 'infer-engine'\) scheduled sequence \d+ of request "
                      r"\w+ to compute positions up to 1, but its block table covers 0: a scheduler must "
                      "KVCache.allocate before it schedules")])
def test_a_scheduler_breaking_its_contract_is_named_not_hung(tiny_model, infer_plugins, scheduler, message):
    def register_schedulers(register):
        register("broken", lambda config, kv: scheduler(config, kv))

    infer_plugins.register(plugin_module("broken", register_schedulers=register_schedulers), source="acme")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="broken", max_num_seqs=2),
                    infer_plugins)
    for prompt in ("a", "b")[: 2 if scheduler is OverBudget else 1]:
        engine.add_request(prompt, SamplingParams(max_tokens=4))
    with pytest.raises(PluginError, match="scheduler 'broken' " + message):
        engine.step()


@pytest.mark.parametrize("first_block", [-1, 63, 64])
def test_a_block_id_outside_the_pool_is_blamed_on_the_kv_cache(tiny_model, infer_plugins, first_block):
    """A KV cache whose table names a block outside [0, num_blocks) is refused before a kernel reads or writes
    there (the CPU backends raised IndexError, blamed on the shipped attention backend; a GPU kernel would not). The
    last block of the pool is inside: one request whose table starts there generates what the paged cache does."""
    from infer.plugins.paged_cache import PagedKVCache

    class Moved(PagedKVCache):
        def block_table(self, seq):
            table = list(super().block_table(seq))
            return [first_block] + table[1:] if table else table

    def register_kv_caches(register):
        register("moved", lambda config, n, eviction: Moved(n, config.block_size, eviction, True))

    infer_plugins.register(plugin_module("moved", register_kv_caches=register_kv_caches), source="acme")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    engines = {name: Engine(EngineConfig(model=str(tiny_model), device="cpu", kv_cache=name, num_kv_blocks=64),
                            infer_plugins) for name in ("moved", "paged")}
    if first_block == 63:
        assert engines["moved"].generate(["def f(x):"], params)[0].outputs[0].token_ids == \
            engines["paged"].generate(["def f(x):"], params)[0].outputs[0].token_ids
        return
    with pytest.raises(PluginError, match=rf"KV cache 'moved' from 'acme': the block table of sequence \d+ holds "
                                          rf"block id {first_block}, outside the pool's \[0, 64\)"):
        engines["moved"].generate(["def f(x):"], params)


def test_a_schedule_over_the_token_budget_is_refused_unless_its_sequence_runs_alone() -> None:
    """max_num_batched_tokens bounds a step's activations: several sequences may fill it exactly, not pass it; a
    sequence alone may (an unchunked recompute that grew past the budget has no other way to run)."""
    config = EngineConfig(max_num_batched_tokens=16)
    scheduler = ContinuousScheduler(config, PagedKVCache(8, 4, LRUPolicy(), False))
    seqs = [Sequence(i, f"r{i}", list(range(1, 21)), SamplingParams(), 0.0) for i in range(2)]

    def schedule_of(*counts: int) -> SchedulerOutput:
        return SchedulerOutput(scheduled=[ScheduledSequence(seq, n) for seq, n in zip(seqs, counts)])

    assert check_schedule(schedule_of(10, 6), config, scheduler, True, lambda: 0)
    assert check_schedule(schedule_of(20), config, scheduler, True, lambda: 0)
    with pytest.raises(PluginError, match="scheduled 17 tokens in 2 sequences, over max_num_batched_tokens=16"):
        check_schedule(schedule_of(10, 7), config, scheduler, True, lambda: 0)


@pytest.mark.parametrize("max_num_seqs", [1, 2, 5])
def test_a_schedule_of_max_num_seqs_sequences_passes_and_one_more_is_refused(max_num_seqs: int) -> None:
    """The bound itself: max_num_seqs distinct sequences are what CUDA graphs and buffers are sized for, so
    exactly that many pass and max_num_seqs + 1 are refused (a check off by one would let one more through)."""
    config = EngineConfig(max_num_seqs=max_num_seqs)
    scheduler = ContinuousScheduler(config, PagedKVCache(8, 4, LRUPolicy(), False))
    seqs = [Sequence(i, f"r{i}", [1, 2, 3], SamplingParams(), 0.0) for i in range(max_num_seqs + 1)]

    def schedule_of(count: int) -> SchedulerOutput:
        return SchedulerOutput(scheduled=[ScheduledSequence(seq, 1) for seq in seqs[:count]])

    assert check_schedule(schedule_of(max_num_seqs), config, scheduler, True, lambda: 0)
    with pytest.raises(PluginError, match=f"scheduled {max_num_seqs + 1} sequences, over "
                                          f"max_num_seqs={max_num_seqs}"):
        check_schedule(schedule_of(max_num_seqs + 1), config, scheduler, True, lambda: 0)


class ForgetsStatus(ContinuousScheduler):
    """finish() releases the sequence but leaves its status: the request never ended, and generate spun forever."""

    def finish(self, seq, reason):
        if seq in self.running:
            self.running.remove(seq)
            self.kv.free(seq)


def test_a_scheduler_that_does_not_finish_sequences_is_named_not_hung(tiny_model, infer_plugins):
    def register_schedulers(register):
        register("forgetful", lambda config, kv: ForgetsStatus(config, kv))

    infer_plugins.register(plugin_module("forgetful", register_schedulers=register_schedulers), source="acme")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="forgetful"), infer_plugins)
    engine.add_request("a", SamplingParams(max_tokens=2, ignore_eos=True))
    with pytest.raises(PluginError, match=r"scheduler 'forgetful' has no sequence waiting or running, but 1 "
                                          r"sequence\(s\) of the engine's requests are not finished"):
        for _ in range(10):  # it finishes at its 2nd token; the step after that finds nothing to run
            engine.step()
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="forgetful"), infer_plugins)
    rid = engine.add_request("a", SamplingParams(max_tokens=8))
    engine.step()
    with pytest.raises(PluginError, match="scheduler 'forgetful': finish\\(\\) left sequence 0 RUNNING; it must set "
                                          "seq.status = SequenceStatus.FINISHED"):
        engine.abort(rid)


def test_a_factory_must_return_an_instance_of_its_kind(tiny_model, infer_plugins):
    from infer.plugins.eviction import LRUPolicy

    def register_eviction_policies(register):
        register("as-class", lambda config: LRUPolicy)  # the class, not an instance

    infer_plugins.register(plugin_module("cls", register_eviction_policies=register_eviction_policies),
                           source="acme-evict")
    with pytest.raises(PluginError, match="eviction policy factory 'as-class' from 'acme-evict' returned ABCMeta, "
                                          "not an instance of EvictionPolicy"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", eviction_policy="as-class"), infer_plugins)


def test_llm_takes_component_names_like_the_cli(tiny_model, infer_plugins):
    from infer import LLM
    from infer.core.errors import ConfigError

    assert LLM(str(tiny_model), infer_plugins, plugin=["radix-cache"], device="cpu").engine.config.kv_cache == \
        "radix-cache"
    chosen = LLM(str(tiny_model), infer_plugins, plugin=["radix-cache", "lfu"], kv_cache="paged", device="cpu")
    assert (chosen.engine.config.kv_cache, chosen.engine.config.eviction_policy) == ("paged", "lfu")
    with pytest.raises(ConfigError, match="plugins= takes a PluginManager, not list"):
        LLM(str(tiny_model), plugins=["radix-cache"], device="cpu")
    with pytest.raises(ConfigError, match=r"\(enable_prefix_caching=False\) nothing is cached"):
        LLM(str(tiny_model), infer_plugins, plugin=["lfu"], enable_prefix_caching=False, device="cpu")


def test_duplicate_names_name_both_packages(infer_plugins):
    def register_kv_caches(register):
        register("paged", lambda config, n, eviction: None)

    infer_plugins.register(plugin_module("dup", register_kv_caches=register_kv_caches), source="acme-kv")
    with pytest.raises(PluginError, match="duplicate kv cache name 'paged': infer ships a kv cache .* and 'acme-kv' "
                                          "registers another; a shipped name is never overridden, so rename"):
        infer_plugins.collect()


def test_a_shipped_name_taken_first_by_a_plugin_blames_the_plugin():
    """Registered before infer's own entry points (as one whose name sorts first is), a plugin's clash with a
    shipped name still fails in the plugin's hook: the way out given is the plugin's, never one that drops infer's
    component (which would let the plugin's replace it)."""
    def register_eviction_policies(register):
        register("lru", lambda: None)

    plugins = PluginManager()
    plugins.register(plugin_module("aaa", register_eviction_policies=register_eviction_policies), name="aaa",
                     source="acme-evict")
    plugins.load_entry_points(None)
    with pytest.raises(PluginError, match="duplicate eviction policy name 'lru': infer ships") as caught:
        plugins.collect()
    assert str(caught.value).endswith("; fix the plugin") and "INFER_PLUGINS" not in str(caught.value)


def test_duplicate_alias_is_an_error_too(infer_plugins):
    def register_schedulers(register):
        register("my-chunked", lambda config, kv: None, aliases=("chunked",))

    infer_plugins.register(plugin_module("alias", register_schedulers=register_schedulers), source="acme")
    with pytest.raises(PluginError, match="duplicate scheduler name 'chunked'"):
        infer_plugins.collect()


def test_register_kept_past_its_hook_is_refused(infer_plugins):
    """A component registered after start-up would appear after infer read the registries (and `infer plugins`
    printed them): the callback works only while its hook runs."""
    kept = []

    def register_schedulers(register):
        register("early", lambda config, kv: None)
        kept.append(register)

    infer_plugins.register(plugin_module("late", register_schedulers=register_schedulers), source="acme-late")
    assert "early" in infer_plugins.registry("scheduler")
    with pytest.raises(PluginError, match=r"'acme-late' called register\('later', ...\) after its "
                                          "register_schedulers hook returned; .* call register inside the hook"):
        kept[0]("later", lambda config, kv: None)
    assert "later" not in infer_plugins.registry("scheduler")


def test_unknown_names_list_the_choices(infer_plugins):
    with pytest.raises(PluginError, match="unknown kv cache 'nope'; registered kv caches: .*paged"):
        infer_plugins.registry("kv_cache").get("nope")
    with pytest.raises(PluginError, match="unknown plugin 'nope'; registered components: .*continuous.*paged"):
        infer_plugins.resolve_plugin_names(EngineConfig(), ["nope"])
    with pytest.raises(PluginError, match=r"unknown plugin 'radix-cahce' \(did you mean 'radix-cache'\?\)"):
        infer_plugins.resolve_plugin_names(EngineConfig(), ["radix-cahce"])


def test_a_name_under_two_kinds_asks_for_the_explicit_option(infer_plugins):
    def register_kv_caches(register):
        register("turbo", lambda config, n, eviction: None)

    def register_schedulers(register):
        register("turbo", lambda config, kv: None)

    infer_plugins.register(plugin_module("turbo", register_kv_caches=register_kv_caches,
                                         register_schedulers=register_schedulers), source="acme")
    with pytest.raises(PluginError, match="registered as scheduler and kv cache; use --scheduler turbo or "
                                          "--kv-cache turbo"):
        infer_plugins.resolve_plugin_names(EngineConfig(), ["turbo"])


def test_allow_list_loads_only_named_entry_points(monkeypatch):
    only = PluginManager.from_entry_points(allow="continuous,paged")
    assert {c.kind for c in only.components()} == {"scheduler", "kv_cache"}
    monkeypatch.setenv("INFER_PLUGINS", "paged")
    assert {c.name for c in PluginManager.from_entry_points().components()} == {"paged"}
    with pytest.raises(PluginError, match="not installed: missing-one"):
        PluginManager.from_entry_points(allow="paged,missing-one")


def test_event_hooks_observe_steps_and_finished_requests(tiny_model, infer_plugins):
    seen = {"steps": 0, "finished": []}
    phases = ("schedule", "execute", "sample", "postprocess")
    durations = []

    def on_step(stats):
        seen["steps"] += 1
        times = [getattr(stats, f"{phase}_s") for phase in phases]
        assert min(times) >= 0 and sum(times) == pytest.approx(stats.duration_s, rel=1e-9, abs=0)
        durations.append(stats.duration_s)
        stats.kv.free_blocks = -1  # a misbehaving observer changes its own snapshot only

    def on_request_finished(output):
        seen["finished"].append(output.request_id)

    infer_plugins.register(plugin_module("observer", on_step=on_step, on_request_finished=on_request_finished))
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), infer_plugins)
    engine.add_request("hi", SamplingParams(max_tokens=3, ignore_eos=True), request_id="r1")
    while engine.has_unfinished():
        engine.step()
    assert seen == {"steps": 3, "finished": ["r1"]}
    summary = engine.stats.summary()  # the phases' totals, as `infer generate --stats` prints them
    assert summary["kv_blocks_free"] == engine.kv.stats().free_blocks >= 0
    total = sum(summary[f"time_{phase}_s"] for phase in phases)
    assert total == pytest.approx(sum(durations), abs=4e-4)  # each total is rounded to 0.1 ms


def test_on_request_finished_has_every_sequence_of_an_n_request(tiny_model, infer_plugins):
    """Sequences of an n > 1 request that finish in different steps: the observer sees one entry for each, with the
    finish reason the caller got, not only those of the request's last step."""
    observed = []

    def on_request_finished(output):
        observed.append(output)

    infer_plugins.register(plugin_module("n-observer", on_request_finished=on_request_finished))
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), infer_plugins)
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=16, stop_token_ids=tuple(range(0, 256, 2)))
    [result] = engine.generate(["hello there"], params)
    assert len({len(c.token_ids) for c in result.outputs}) > 1  # they did finish in different steps
    [output] = observed
    assert [c.index for c in output.outputs] == [0, 1, 2, 3]
    assert [c.finish_reason for c in output.outputs] == [c.finish_reason for c in result.outputs]
    assert any(not c.token_ids for c in output.outputs)  # those finished earlier: an empty last delta


def test_two_packages_with_one_entry_point_name_are_named(tmp_path, monkeypatch):
    """Two plugin packages made from the template without renaming the entry point: a clear PluginError naming
    both packages (not pluggy's ValueError), also from the CLI."""
    for dist in ("infer-plugin-one", "infer-plugin-two"):
        info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        (info / "entry_points.txt").write_text(f"[infer]\nexample = {dist.replace('-', '_')}.plugin\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(PluginError, match="'infer-plugin-one' and 'infer-plugin-two'.*rename it"):
        PluginManager.from_entry_points(allow="")
    result = CliRunner().invoke(main, ["plugins"])
    assert result.exit_code != 0 and "infer-plugin-one" in result.output and "Traceback" not in result.output
    # an allow-list that leaves the clashing name out is the way to run until one package renames it
    assert {c.name for c in PluginManager.from_entry_points(allow="paged").collect().components()} == {"paged"}


def test_loading_the_shipped_plugins_does_not_import_torch():
    """`infer --help`, `infer plugins` and `infer client` load every plugin; torch (1.5 s) loads with a model."""
    import subprocess
    import sys

    code = ("import sys; from infer.core.plugins import PluginManager; "
            "PluginManager.from_entry_points().collect(); print(sorted(m for m in ('torch', 'transformers', 'triton') "
            "if m in sys.modules))")
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_plugin_options_are_checked_against_their_declaration() -> None:
    """read_plugin_options: defaults, kinds (an int where a float is asked; never a bool for a number), ranges,
    choices, and a misspelt key refused with the closest declared one (it used to be ignored silently)."""
    from infer.core.plugin_options import PluginOption, read_plugin_options

    declared = {"rate": PluginOption(0.5, "a share", minimum=0, maximum=1),
                "mode": PluginOption("a", "m", choices=("a", "b")),
                "size": PluginOption(None, "unset by default", kind=int, minimum=1),
                "on": PluginOption(True, "a switch")}

    def read(**given: object) -> dict[str, object]:
        return read_plugin_options(EngineConfig(plugin_options={"ns": given}), "ns", declared)

    assert read() == {"rate": 0.5, "mode": "a", "size": None, "on": True}
    assert read(rate=1, mode="b", size=3, on=False) == {"rate": 1.0, "mode": "b", "size": 3, "on": False}
    assert type(read(rate=1)["rate"]) is float
    for key, bad, expected in (("rate", True, r"a number in \[0, 1\]"), ("rate", 1.5, r"a number in \[0, 1\]"),
                               ("rate", float("nan"), r"a number in \[0, 1\]"), ("mode", "c", "one of a, b"),
                               ("size", 0, "an integer >= 1"), ("size", 2.0, "an integer >= 1"),
                               ("on", 1, "true or false")):
        with pytest.raises(ConfigError, match=f"--plugin-option ns.{key} must be {expected}, got "):
            read(**{key: bad})
    with pytest.raises(ConfigError, match=r"ns has no option 'rat'; did you mean ns.rate\? its options: "
                                          r"rate \(a number in \[0, 1\], default 0.5\); "
                                          r"mode \(one of a, b, default 'a'\)"):
        read(rat=0.3)


def test_the_caller_s_signal_handler_timeout_is_not_blamed_on_a_plugin(tiny_model, infer_plugins):
    """A caller's signal handler (a SIGALRM deadline) that raises TimeoutError can fire while a plugin's code runs:
    the error is the caller's own, so it comes out as raised, not as a PluginError telling the user to fix the
    plugin. (SIGUSR1 stands in for SIGALRM, which pytest-timeout uses.)"""

    class Interrupted(ContinuousScheduler):
        own_error = False

        def schedule(self):
            if self.own_error:
                raise TimeoutError("the plugin's own")
            signal.raise_signal(signal.SIGUSR1)  # as a real alarm would, mid-way through the plugin's code
            return super().schedule()

    def deadline(signum, frame):
        raise TimeoutError("the caller's deadline")

    infer_plugins.register(plugin_module("alarmed", register_schedulers=lambda register: register(
        "alarmed", lambda config, kv: Interrupted(config, kv))), source="acme-alarm")
    engine = Engine(infer_plugins.resolve_plugin_names(EngineConfig(model=str(tiny_model), device="cpu"),
                                                       ["alarmed"]), infer_plugins)
    previous = signal.signal(signal.SIGUSR1, deadline)
    try:
        with pytest.raises(TimeoutError, match="the caller's deadline"):
            engine.generate(["hello"], SamplingParams(max_tokens=2))
        Interrupted.own_error = True
        with pytest.raises(PluginError, match="the scheduler 'alarmed' from 'acme-alarm' raised TimeoutError: the "
                                              "plugin's own"):
            engine.generate(["hello"], SamplingParams(max_tokens=2))
    finally:
        signal.signal(signal.SIGUSR1, previous)


@pytest.mark.parametrize(("wrong", "got"), [(lambda out: out.flatten(1), r"shape \[\d+, \d+\], torch.float32"),
                                           (lambda out: out.double(), r"shape \[\d+, \d+, \d+\], torch.float64"),
                                           (lambda out: None, "NoneType")])
def test_an_attention_backend_s_wrong_output_is_its_own_error(tiny_model, infer_plugins, wrong, got):
    """The model's reshape or o_proj failed on it, and the error blamed the model (or passed a wrong dtype on)."""
    from infer.plugins.torch_attention import TorchAttention

    class Wrong(TorchAttention):
        def forward(self, q, k, v, kv_cache, meta, scale):
            return wrong(super().forward(q, k, v, kv_cache, meta, scale))

    infer_plugins.register(plugin_module("wrong_attention", register_attention_backends=lambda register: register(
        "wrong", lambda config: Wrong())), source="acme-attention")
    config = EngineConfig(model=str(tiny_model), device="cpu", dtype="float32")
    engine = Engine(infer_plugins.resolve_plugin_names(config, ["wrong"]), infer_plugins)
    with pytest.raises(PluginError, match=f"the attention backend 'wrong' from 'acme-attention' raised TypeError: "
                                          f"forward returned {got}; it must return q's shape "
                                          r"\[\d+, \d+, \d+\] and dtype torch.float32"):
        engine.generate(["hello"], SamplingParams(max_tokens=2))


@pytest.mark.parametrize("options", [{}, {"async_scheduling": True},
                                     {"proposer": "ngram", "num_speculative_tokens": 3}],
                         ids=["sync", "async-scheduling", "speculative"])
def test_nan_logits_are_warned_of_once_per_sequence(tiny_model, infer_plugins, options, caplog):
    """An attention backend whose output is NaN (right shape and dtype) made every logit NaN, and argmax sampled
    token 0 each step with no word of it; a float16 model that overflows does the same. Each such sequence is warned
    of once, and counted each step (one request's overflow must not fail the others': tests/test_lora.py)."""
    import logging

    from infer.plugins.torch_attention import TorchAttention

    class Nan(TorchAttention):
        def forward(self, q, k, v, kv_cache, meta, scale):
            return torch.full_like(super().forward(q, k, v, kv_cache, meta, scale), float("nan"))

    infer_plugins.register(plugin_module("nan_attention", register_attention_backends=lambda register: register(
        "nan", lambda config: Nan())), source="acme-attention")
    config = EngineConfig(model=str(tiny_model), device="cpu", dtype="float32", **options)
    engine = Engine(infer_plugins.resolve_plugin_names(config, ["nan"]), infer_plugins)
    with caplog.at_level(logging.WARNING, logger="infer"):
        rid = engine.add_request("hello", SamplingParams(max_tokens=12, temperature=0.5, ignore_eos=True))
        seq = engine.requests[rid].seqs[0]
        while engine.has_unfinished():
            engine.step()
    warned = [r.getMessage() for r in caplog.records if "has no token to sample" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"request {rid} (sequence {seq.seq_id}): its logits hold NaN "
                                                     "or are all -inf")
    assert "try --dtype bfloat16 or float32" in warned[0]
    if "proposer" in options:  # every step counts, the verifications of drafts too
        assert seq.spec_proposed > 0 and seq.unsampleable_steps == engine.steps_taken
    else:
        assert seq.unsampleable_steps == 12


def test_an_observer_that_raises_is_named(tiny_model, infer_plugins):
    """An observer's exception is a PluginError naming the observer and its package, as a component's is (it came
    out raw: nothing said which installed plugin failed)."""

    class Failing:
        @hookimpl
        def on_step(self, stats):
            if stats.num_seqs:
                raise RuntimeError("observer bug")

        @hookimpl
        def on_request_finished(self, output):
            raise KeyError(output.request_id)

    infer_plugins.register(Failing(), name="failing-observer", source="acme-metrics")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), infer_plugins)
    engine.add_request("a", SamplingParams(max_tokens=4), request_id="r1")
    with pytest.raises(PluginError, match="the observer 'failing-observer' from 'acme-metrics' raised RuntimeError in "
                                          r"on_step: observer bug \(-v logs the traceback\); fix the plugin") as info:
        engine.step()
    assert isinstance(info.value.__cause__, RuntimeError)
    with pytest.raises(PluginError, match="'failing-observer' from 'acme-metrics' raised KeyError in "
                                          "on_request_finished: 'r1'"):
        engine.abort("r1")


def test_a_failing_observer_is_reported_once(tiny_model, infer_plugins, caplog):
    """generate's clean-up aborts the other requests, whose observers fail the same way: that is not news."""

    class Failing:
        @hookimpl
        def on_request_finished(self, output):
            raise RuntimeError("observer bug")

    infer_plugins.register(Failing(), name="failing-observer", source="acme-metrics")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), infer_plugins)
    with pytest.raises(PluginError, match="raised RuntimeError in on_request_finished: observer bug"):
        engine.generate(["a", "b", "c"], [SamplingParams(max_tokens=n) for n in (1, 5, 5)])
    assert "could not abort" not in caplog.text


@pytest.mark.parametrize("async_output", [False, True])
def test_every_observer_sees_the_event_and_the_step_is_recorded_when_one_raises(tiny_model, async_output):
    """pluggy stops at the first observer that raises: the others missed the finished request, and the step in which
    it finished was neither recorded nor seen by on_step (its stats read 2 steps of 3)."""

    class Counter:
        def __init__(self) -> None:
            self.finished = self.steps = 0

        @hookimpl
        def on_request_finished(self, output):
            self.finished += 1

        @hookimpl
        def on_step(self, stats):
            self.steps += 1

    class Flaky:
        @hookimpl
        def on_request_finished(self, output):
            raise RuntimeError("observer bug")

    counted, errors = [], []
    for flaky in (False, True):
        plugins, counter = PluginManager.from_entry_points(), Counter()
        plugins.register(counter, name="counter", source="acme-count")
        if flaky:
            plugins.register(Flaky(), name="flaky", source="acme-flaky")  # registered last: pluggy calls it first
        engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", async_output=async_output), plugins)
        engine.add_request("a", SamplingParams(max_tokens=3, ignore_eos=True))
        try:
            while engine.has_unfinished():
                engine.step()
        except PluginError as exc:
            errors.append((flaky, str(exc).split(" in ")[0]))
        counted.append((counter.finished, counter.steps, engine.stats.steps, engine.has_unfinished()))
        assert engine.deferred is None
    assert errors == [(True, "the observer 'flaky' from 'acme-flaky' raised RuntimeError")]
    assert counted[0] == counted[1] and counted[0][:2] == (1, engine.stats.steps)


def test_an_error_in_inherited_code_or_beside_another_component_names_its_component(tiny_model, infer_plugins):
    """Blame knew a component by its class's module alone: an error in a method it inherits from a shipped class
    came out raw, and of two components defined in one module the first was named for both."""
    from infer.plugins.eviction import LRUPolicy

    class ShortestFirst(ContinuousScheduler):  # writing-a-plugin.md's suggestion, with a bug
        def add(self, seq):
            super().add(seq)
            self.waiting = sorted(self.waiting, key=lambda s: s.num_prompt_tokens)  # a list: no popleft

    class Fifo(ContinuousScheduler):
        pass

    class BrokenPop(LRUPolicy):  # in the same module as Fifo
        def pop(self):
            raise RuntimeError("pop is broken")

    def register_schedulers(register):
        register("shortest-first", lambda config, kv: ShortestFirst(config, kv))
        register("fifo2", lambda config, kv: Fifo(config, kv))

    def register_eviction_policies(register):
        register("broken-pop", lambda config: BrokenPop())

    infer_plugins.register(plugin_module("acme", register_schedulers=register_schedulers,
                                         register_eviction_policies=register_eviction_policies), source="acme")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="shortest-first"), infer_plugins)
    with pytest.raises(PluginError, match="the scheduler 'shortest-first' from 'acme' raised AttributeError"):
        engine.generate(["a b c", "a"], SamplingParams(max_tokens=2))
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu", scheduler="fifo2", eviction_policy="broken-pop",
                                 block_size=4, num_kv_blocks=6), infer_plugins)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    engine.generate([list(range(10, 22))], params)  # its blocks stay cached: the next prompt needs them evicted
    with pytest.raises(PluginError, match="the eviction policy 'broken-pop' from 'acme' raised RuntimeError: pop is"):
        engine.generate([list(range(40, 52))], params)


def test_an_observer_class_registered_twice_blames_the_instance_that_raised(tiny_model, infer_plugins):
    class Exporter:
        def __init__(self, fail: bool) -> None:
            self.fail = fail

        @hookimpl
        def on_step(self, stats):
            if self.fail:
                raise ValueError("export failed")

    infer_plugins.register(Exporter(False), name="exporter-good", source="pkg-good")
    infer_plugins.register(Exporter(True), name="exporter-bad", source="pkg-bad")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), infer_plugins)
    engine.add_request("a", SamplingParams(max_tokens=2))
    with pytest.raises(PluginError, match="the observer 'exporter-bad' from 'pkg-bad' raised ValueError"):
        engine.step()


def test_a_badly_declared_plugin_option_is_the_author_s_error() -> None:
    from infer.core.plugin_options import PluginOption, read_plugin_options

    for bad in (None, []):
        with pytest.raises(TypeError, match="its kind must be bool, int, float or str"):
            PluginOption(bad, "an option")
    capped = {"k": PluginOption(2, "at most four", maximum=4)}
    with pytest.raises(ConfigError, match="ns.k must be an integer <= 4, got 5"):
        read_plugin_options(EngineConfig(plugin_options={"ns": {"k": 5}}), "ns", capped)


def test_plugin_option_declarations_are_checked_where_they_are_declared() -> None:
    """A default the option itself would refuse (out of range, not a choice, not finite, the wrong kind) is the
    author's TypeError; a text option given a number says how to quote it on the command line."""
    from infer.core.plugin_options import PluginOption, read_plugin_options

    for default, extra in ((-5, {"minimum": 0}), ("z", {"choices": ("a", "b")}), (64, {"kind": str}),
                           (float("inf"), {})):
        with pytest.raises(TypeError, match=f"its default {default!r} is not "):
            PluginOption(default, "an option", **extra)
    text = {"s": PluginOption("a", "a text")}
    with pytest.raises(ConfigError, match="ns.s must be a string, got 123 \\(the command line reads VALUE as JSON when "
                                          "it parses: quote text that looks like a number"):
        read_plugin_options(EngineConfig(plugin_options={"ns": {"s": 123}}), "ns", text)


def test_options_under_an_alias_or_a_name_of_two_kinds(infer_plugins) -> None:
    """Options under an alias were silently ignored (with a warning that no component had that name); a name that
    declares options under two kinds could take none of them (each kind refused the other's keys)."""
    from infer.cli.options import EngineArgs, parse_plugin_options
    from infer.core.plugin_options import PluginOption

    with pytest.raises(ConfigError, match="'prompt-lookup' is an alias of the proposer 'ngram', whose options are read "
                                          "under its name only: use --plugin-option ngram.KEY=VALUE"):
        EngineArgs.from_kwargs({"plugin_option": parse_plugin_options(("prompt-lookup.max_n=3",))}).build(
            infer_plugins)
    with pytest.raises(ConfigError, match="spec_decode has no option 'min_acceptence'; did you mean "
                                          "spec_decode.min_acceptance"):  # checked before anything is built too
        EngineArgs.from_kwargs({"plugin_option": parse_plugin_options(("spec_decode.min_acceptence=0.5",)),
                                "proposer": "ngram"}).build(infer_plugins)

    def register_eviction_policies(register):
        register("dual", lambda config: None, options={"a": PluginOption(1, "a")})

    def register_proposers(register):
        register("dual", lambda config, target, plugins: None, options={"b": PluginOption(1, "b")})

    fresh = PluginManager.from_entry_points()  # infer_plugins collected its components above
    fresh.register(plugin_module("dual", register_eviction_policies=register_eviction_policies,
                                 register_proposers=register_proposers), source="acme-dual")
    with pytest.raises(PluginError, match="'dual' declares plugin options as a eviction_policy .* and as a proposer"):
        fresh.collect()


def test_a_decorated_observer_or_one_without_self_is_still_named(tiny_model, infer_plugins):
    import functools

    def logged(method):
        @functools.wraps(method)
        def wrapper(*args, **kwargs):
            return method(*args, **kwargs)
        return wrapper

    class Decorated:
        @hookimpl
        @logged
        def on_step(this, stats):
            raise ValueError("decorated")

    infer_plugins.register(Decorated(), name="decorated", source="acme-deco")
    engine = Engine(EngineConfig(model=str(tiny_model), device="cpu"), infer_plugins)
    engine.add_request("a", SamplingParams(max_tokens=2))
    with pytest.raises(PluginError, match="the observer 'decorated' from 'acme-deco' raised ValueError"):
        engine.step()
