"""--scheduling-policy priority: requests run by SamplingParams.priority (higher first, ties in arrival order), a
request that does not fit preempts lower-priority ones; lpm: the longest cached prefix first. No request's tokens
change (HF greedy is the reference)."""
from __future__ import annotations

import math
import random
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.errors import ConfigError
from infer.core.hookspecs import hookimpl
from infer.core.interfaces import SchedulerOutput
from infer.core.plugins import PluginManager
from infer.core.request import SamplingParams
from infer.plugins.continuous_scheduler import AdmissionReserve, ContinuousScheduler
from infer.server import infer_pb2 as pb


def params(max_tokens: int, priority: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def engine(path: Path, **options: Any) -> Engine:
    return Engine(EngineConfig(model=str(path), device="cpu", **options))


def step(e: Engine, tokens: dict[str, list[int]]) -> list[str]:
    """One step; its tokens added to ``tokens``; returns the requests it finished."""
    finished = []
    for out in e.step():
        tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
        if out.finished:
            finished.append(out.request_id)
    return finished


def run(e: Engine, tokens: dict[str, list[int]] | None = None
        ) -> tuple[list[str], dict[str, list[int]], dict[str, float]]:
    """Step until idle: the order in which requests finished, their tokens (after ``tokens``), and their
    preemption counts."""
    order, tokens, preemptions = [], tokens if tokens is not None else {}, {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                order.append(out.request_id)
                preemptions[out.request_id] = out.metrics["num_preemptions"]
    return order, tokens, preemptions


def watch(e: Engine) -> list[SchedulerOutput]:
    """Every schedule the engine's scheduler returns (its schedule wrapped for the test's observation only)."""
    outs: list[SchedulerOutput] = []
    schedule = e.scheduler.schedule

    def observed() -> SchedulerOutput:
        outs.append(schedule())
        return outs[-1]

    e.scheduler.schedule = observed  # type: ignore[method-assign]
    return outs


@pytest.mark.parametrize("policy, expected", [("fcfs", ["r0", "r1", "r2", "r3", "r4"]),
                                              ("priority", ["r1", "r3", "r2", "r0", "r4"])])
def test_waiting_requests_run_by_priority_then_arrival(tiny_model: Path, hf_greedy: Callable[..., list[int]],
                                                       policy: str, expected: list[str]) -> None:
    e = engine(tiny_model, max_num_seqs=1, num_kv_blocks=64, scheduling_policy=policy)
    prompts = [prompt(6 + i, i) for i in range(5)]
    for i, (p, priority) in enumerate(zip(prompts, [0, 2, 1, 2, 0])):
        e.add_request(p, params(4, priority), request_id=f"r{i}")
    order, tokens, preemptions = run(e)
    assert order == expected
    assert all(tokens[f"r{i}"] == hf_greedy(tiny_model, p, 4) for i, p in enumerate(prompts))
    assert set(preemptions.values()) == {0}  # none is admitted before a more important one: nothing to preempt


@pytest.mark.parametrize("policy, high", [("priority", 1), ("fcfs", 1), ("priority", 0)])
def test_a_request_without_a_seat_preempts_only_a_lower_priority_one(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], policy: str, high: int) -> None:
    e = engine(tiny_model, max_num_seqs=1, num_kv_blocks=64, scheduling_policy=policy)
    low_prompt, high_prompt = prompt(9, 1), prompt(7, 2)
    e.add_request(low_prompt, params(12, 0), request_id="low")
    tokens: dict[str, list[int]] = {}
    for _ in range(3):
        step(e, tokens)
    outs = watch(e)
    e.add_request(high_prompt, params(5, high), request_id="high")
    order, tokens, preemptions = run(e, tokens)
    jumps = policy == "priority" and high > 0
    assert order == (["high", "low"] if jumps else ["low", "high"])
    assert [s.request_id for s in outs[0].preempted] == (["low"] if jumps else [])
    assert [item.seq.request_id for item in outs[0].scheduled] == ["high" if jumps else "low"]
    assert preemptions == {"low": float(jumps), "high": 0.0}
    assert tokens == {"low": hf_greedy(tiny_model, low_prompt, 12), "high": hf_greedy(tiny_model, high_prompt, 5)}


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_a_request_without_blocks_preempts_a_lower_priority_one(tiny_model: Path, hf_greedy: Callable[..., list[int]],
                                                                policy: str) -> None:
    """Seats are free but blocks are not: 10 blocks of 4, the low request holds 7 when a 20-token prompt (5 blocks)
    arrives."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=10, scheduling_policy=policy)
    low_prompt, high_prompt = prompt(20, 3), prompt(20, 4)
    e.add_request(low_prompt, params(16, 0), request_id="low")
    tokens: dict[str, list[int]] = {}
    while e.kv.stats().used_blocks < 7:
        step(e, tokens)
    outs = watch(e)
    e.add_request(high_prompt, params(4, 3), request_id="high")
    order, tokens, preemptions = run(e, tokens)
    if policy == "priority":
        assert [s.request_id for s in outs[0].preempted] == ["low"]
        assert [item.seq.request_id for item in outs[0].scheduled] == ["high"]
        assert order == ["high", "low"] and preemptions == {"low": 1.0, "high": 0.0}
    else:  # the low request keeps running until it ends; the high one waits for its blocks
        assert order == ["low", "high"] and preemptions == {"low": 0.0, "high": 0.0}
    assert tokens == {"low": hf_greedy(tiny_model, low_prompt, 16), "high": hf_greedy(tiny_model, high_prompt, 4)}


@pytest.mark.parametrize("aging_s", [None, 0.05])
def test_a_more_important_prompt_in_chunks_leaves_every_decode_its_token(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], aging_s: float | None) -> None:
    """Chunked prefill, 16 tokens a step: a priority-1 prompt of 60 tokens arrives while two priority-0 requests
    decode. It goes first, but each of its chunks leaves a token for each decode (14-token chunks), so the decodes
    run in every step, as they do beside a prompt of their own priority; all outputs are HF's."""
    e = engine(tiny_model, scheduler="chunked-prefill", max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64,
               scheduling_policy="priority", priority_aging_s=aging_s)
    prompts = {"low0": prompt(6, 70), "low1": prompt(7, 71), "high": prompt(60, 72)}
    tokens: dict[str, list[int]] = {}
    e.add_request(prompts["low0"], params(12, 0), request_id="low0")
    e.add_request(prompts["low1"], params(12, 0), request_id="low1")
    step(e, tokens)
    outs = watch(e)
    e.add_request(prompts["high"], params(3, 1), request_id="high")
    _, tokens, _ = run(e, tokens)
    chunks = [sorted((item.seq.request_id, item.num_new_tokens) for item in out.scheduled) for out in outs[:5]]
    assert chunks == [[("high", 14), ("low0", 1), ("low1", 1)]] * 4 + [[("high", 4), ("low0", 1), ("low1", 1)]]
    assert tokens == {name: hf_greedy(tiny_model, p, 3 if name == "high" else 12) for name, p in prompts.items()}


@pytest.mark.parametrize("aging_s", [None, 0.05])
def test_a_burst_of_important_requests_gets_its_seats_in_one_step(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], aging_s: float | None) -> None:
    """Three seats held by priority-0 requests when three of priority 1 arrive at once: the next step preempts all
    three and starts all three (not one a step), lowest-ranked victims first; every output is HF's."""
    e = engine(tiny_model, max_num_seqs=3, num_kv_blocks=64, scheduling_policy="priority", priority_aging_s=aging_s)
    prompts = {f"low{i}": prompt(8, 30 + i) for i in range(3)} | {f"high{i}": prompt(6, 40 + i) for i in range(3)}
    tokens: dict[str, list[int]] = {}
    for i in range(3):
        e.add_request(prompts[f"low{i}"], params(12, 0), request_id=f"low{i}")
    step(e, tokens)
    outs = watch(e)
    for i in range(3):
        e.add_request(prompts[f"high{i}"], params(4, 1), request_id=f"high{i}")
    _, tokens, preemptions = run(e, tokens)
    assert [s.request_id for s in outs[0].preempted] == ["low2", "low1", "low0"]
    assert [item.seq.request_id for item in outs[0].scheduled] == ["high0", "high1", "high2"]
    assert preemptions == {**{f"low{i}": 1.0 for i in range(3)}, **{f"high{i}": 0.0 for i in range(3)}}
    assert tokens == {name: hf_greedy(tiny_model, p, 12 if name.startswith("low") else 4)
                      for name, p in prompts.items()}


def test_room_is_made_for_the_waiting_requests_that_fit_and_no_more(tiny_model: Path) -> None:
    """Blocks for two: 12 blocks of 4, two priority-0 requests of 16 tokens hold 10 with their outputs; of three
    priority-1 prompts of 20 tokens (5 blocks each) the first two get room (each preempting one), the third, which
    would not fit beside them, waits without preempting anything more."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=12, max_num_seqs=4, scheduling_policy="priority")
    tokens: dict[str, list[int]] = {}
    for i in range(2):
        e.add_request(prompt(16, 50 + i), params(8, 0), request_id=f"low{i}")
    while e.kv.stats().used_blocks < 10:
        step(e, tokens)
    outs = watch(e)
    for i in range(3):
        e.add_request(prompt(20, 60 + i), params(2, 1), request_id=f"high{i}")
    _, tokens, preemptions = run(e, tokens)
    assert [s.request_id for s in outs[0].preempted] == ["low1", "low0"]
    assert [item.seq.request_id for item in outs[0].scheduled] == ["high0", "high1"]
    assert preemptions["high2"] == 0 and e.kv.stats().used_blocks == 0


@pytest.mark.parametrize("policy, aging_s, victim", [("priority", None, "old-low"), ("fcfs", None, "young-high"),
                                                     ("priority", 0.05, "young-high")])
def test_when_running_sequences_run_out_of_blocks_the_lowest_priority_one_goes(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], policy: str, aging_s: float | None,
        victim: str) -> None:
    """Both fit when admitted (4 + 4 of 12 blocks) and both grow to 8: the policy picks which is preempted (fcfs:
    the youngest; with aging, the old one, which arrived 0.3 s before the other, has gained 6 levels)."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=12, scheduling_policy=policy, priority_aging_s=aging_s)
    prompts = {"old-low": prompt(16, 5), "young-high": prompt(16, 6)}
    e.add_request(prompts["old-low"], params(16, 0), request_id="old-low", arrival_time=time.perf_counter() - 0.3)
    tokens: dict[str, list[int]] = {}
    step(e, tokens)
    e.add_request(prompts["young-high"], params(16, 1), request_id="young-high")
    outs = watch(e)
    _, tokens, preemptions = run(e, tokens)
    assert [s.request_id for out in outs for s in out.preempted][:1] == [victim]
    assert preemptions[victim] >= 1 and preemptions[({"old-low", "young-high"} - {victim}).pop()] == 0
    assert tokens == {name: hf_greedy(tiny_model, p, 16) for name, p in prompts.items()}


@pytest.mark.parametrize("chunked, kv_cache, aging_s", [(False, "paged", None), (True, "paged", None),
                                                       (True, "radix-cache", None), (False, "paged", 0.004),
                                                       (True, "radix-cache", 0.004)])
@pytest.mark.parametrize("seed", range(3))
def test_random_priorities_and_arrivals_keep_every_output_and_preempt_only_downwards(
        tiny_model: Path, chunked: bool, kv_cache: str, aging_s: float | None, seed: int) -> None:
    """Random prompts, priorities and arrival steps on a small pool: every request ends with the tokens it has
    alone (a run with room for all, fcfs), no step preempts a sequence more important than one it schedules (with
    aging: one earlier in the order of arrival time less priority x aging_s, arrivals 10 ms apart per step), and the
    pool drains."""
    rng = random.Random(seed)
    requests = [(f"r{i}", prompt(rng.randrange(3, 30), 100 * seed + i), params(rng.randrange(1, 12),
                                                                                rng.randrange(3)), rng.randrange(8))
                for i in range(10)]
    reference = engine(tiny_model, num_kv_blocks=256)
    for rid, p, sp, _ in requests:
        reference.add_request(p, sp, request_id=rid)
    _, expected, _ = run(reference)
    scheduler = "chunked-prefill" if chunked else "continuous"
    e = engine(tiny_model, block_size=4, num_kv_blocks=12, max_num_seqs=3, max_num_batched_tokens=32,
               scheduler=scheduler, scheduling_policy="priority", kv_cache=kv_cache, priority_aging_s=aging_s)
    outs = watch(e)
    tokens: dict[str, list[int]] = {}
    start = time.perf_counter() - 10  # arrival times 10 ms apart per step, whatever a step takes: a fixed order
    for i in range(400):
        for rid, p, sp, arrival in requests:
            if arrival == i:
                e.add_request(p, sp, request_id=rid, arrival_time=start + 0.01 * arrival)
        step(e, tokens)
        if i >= 8 and not e.has_unfinished():
            break
    assert not e.has_unfinished() and tokens == expected
    preempted = sum(len(out.preempted) for out in outs)
    assert preempted > 0 or aging_s is not None  # the pool is small enough to preempt (with aging: in 4 of 6 runs)
    for out in outs:
        if aging_s is None:
            lowest = min((item.seq.params.priority for item in out.scheduled), default=3)
            assert all(s.params.priority <= lowest for s in out.preempted)
        else:
            last = max((aged(item.seq, aging_s) for item in out.scheduled), default=(-math.inf, 0.0, 0))
            assert all(aged(s, aging_s) > last for s in out.preempted)
    stats = e.kv.stats()
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.total_blocks


def aged(seq: Any, aging_s: float) -> tuple[float, float, int]:
    """Where a sequence stands in the aged priority order (earliest first): a level per aging_s seconds waited;
    ties by arrival, then by sequence id."""
    return seq.arrival_time - seq.params.priority * aging_s, seq.arrival_time, seq.seq_id


@pytest.mark.parametrize("aging_s, late_priority, expected", [
    (None, 1, ["busy", "late-high", "early-low"]),  # no aging: the more important one goes first, however late
    (0.05, 1, ["busy", "early-low", "late-high"]),  # 0.3 s waited is 6 levels: ahead of a request one level higher
    (0.05, 16, ["busy", "late-high", "early-low"]),  # but not of one 16 levels (0.8 s) higher
])
def test_with_aging_a_request_gains_a_level_per_aging_interval_it_waited(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], aging_s: float | None, late_priority: int,
        expected: list[str]) -> None:
    e = engine(tiny_model, max_num_seqs=1, num_kv_blocks=64, scheduling_policy="priority", priority_aging_s=aging_s)
    prompts = {"busy": prompt(6, 20), "early-low": prompt(7, 21), "late-high": prompt(5, 22)}
    early = time.perf_counter() - 0.3  # they came in 0.3 s before the late one (added now)
    e.add_request(prompts["busy"], params(4, 40), request_id="busy", arrival_time=early)
    e.add_request(prompts["early-low"], params(3, 0), request_id="early-low", arrival_time=early)
    e.add_request(prompts["late-high"], params(3, late_priority), request_id="late-high")
    order, tokens, preemptions = run(e)
    assert order == expected and set(preemptions.values()) == {0}
    assert tokens == {name: hf_greedy(tiny_model, p, 4 if name == "busy" else 3) for name, p in prompts.items()}


@pytest.mark.parametrize("aging_s, high, preempts", [(None, 1, True), (0.05, 1, False), (0.05, 100, True)])
def test_with_aging_a_running_request_that_aged_past_a_newcomer_keeps_its_seat(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], aging_s: float | None, high: int,
        preempts: bool) -> None:
    e = engine(tiny_model, max_num_seqs=1, num_kv_blocks=64, scheduling_policy="priority", priority_aging_s=aging_s)
    low_prompt, high_prompt = prompt(9, 23), prompt(7, 24)
    e.add_request(low_prompt, params(10, 0), request_id="low", arrival_time=time.perf_counter() - 0.3)
    tokens: dict[str, list[int]] = {}
    step(e, tokens)
    outs = watch(e)
    e.add_request(high_prompt, params(4, high), request_id="high")
    order, tokens, preemptions = run(e, tokens)
    assert [s.request_id for s in outs[0].preempted] == (["low"] if preempts else [])
    assert order == (["high", "low"] if preempts else ["low", "high"])
    assert preemptions == {"low": float(preempts), "high": 0.0}
    assert tokens == {"low": hf_greedy(tiny_model, low_prompt, 10), "high": hf_greedy(tiny_model, high_prompt, 4)}


@pytest.mark.parametrize("policy, aging_s", [("fcfs", None), ("priority", None), ("priority", 1.0)])
def test_a_request_held_back_for_a_shared_prefix_preempts_none_of_its_own_priority(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], policy: str, aging_s: float | None) -> None:
    """B shares A's prompt prefix, so it waits a step for A to compute it, and C, behind it, takes the last seat
    meanwhile. With one priority, aging or not, B then waits for a seat as under fcfs: it preempts no request of
    its own priority, whose prefill would be thrown away."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=64, max_num_seqs=3, scheduling_policy=policy,
               priority_aging_s=aging_s)
    outs = watch(e)
    tokens: dict[str, list[int]] = {}
    shared = prompt(12, 31)
    prompts = {"R": prompt(5, 30), "A": shared + prompt(3, 32), "B": shared + prompt(3, 33), "C": prompt(9, 34)}
    e.add_request(prompts["R"], params(12, 0), request_id="R")
    step(e, tokens)
    for name in "ABC":
        e.add_request(prompts[name], params(6, 0), request_id=name)
    step(e, tokens)
    assert {item.seq.request_id for item in outs[-1].scheduled} == {"R", "A", "C"}  # B held back a step
    _, tokens, preemptions = run(e, tokens)
    assert not any(out.preempted for out in outs) and set(preemptions.values()) == {0}
    assert tokens == {name: hf_greedy(tiny_model, p, 12 if name == "R" else 6) for name, p in prompts.items()}


@pytest.mark.parametrize("options, message", [
    ({"priority_aging_s": 1.0}, "only --scheduling-policy priority reads .this engine's is fcfs.; add"),
    ({"priority_aging_s": 0.0, "scheduling_policy": "priority"}, "priority-aging-s must be a number of seconds in "
                                                                 r"\(0, 1e\+09\], got 0.0"),
    ({"priority_aging_s": -2, "scheduling_policy": "priority"}, "must be a number of seconds in .* got -2"),
    ({"priority_aging_s": 1e300, "scheduling_policy": "priority"}, "must be a number of seconds in .* got 1e\\+300"),
    ({"priority_aging_s": math.nan, "scheduling_policy": "priority"}, "must be a finite number or None, got nan"),
    ({"priority_aging_s": math.inf, "scheduling_policy": "priority"}, "must be a finite number or None, got inf"),
    ({"priority_aging_s": True, "scheduling_policy": "priority"}, "must be a finite number or None, got True"),
])
def test_priority_aging_needs_the_priority_policy_and_a_positive_interval(
        tiny_model: Path, options: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        EngineConfig(model=str(tiny_model), device="cpu", **options).validate()


def test_the_policy_must_be_known_and_followed_by_the_scheduler(tiny_model: Path) -> None:
    with pytest.raises(ConfigError, match="scheduling-policy must be one of fcfs, priority, lpm, got 'lifo'"):
        engine(tiny_model, scheduling_policy="lifo")

    class ArrivalOrder(ContinuousScheduler):
        scheduling_policies = ("fcfs",)

    class PriorityOrder(ContinuousScheduler):
        scheduling_policies = ("fcfs", "priority")
        follows_priority_aging = False

    class Plugin:
        @hookimpl
        def register_schedulers(self, register: Any) -> None:
            register("arrival-order", lambda config, kv: ArrivalOrder(config, kv))
            register("priority-order", lambda config, kv: PriorityOrder(config, kv))

    plugins = PluginManager.from_entry_points()
    plugins.register(Plugin(), name="acme-schedulers")
    config = EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16, scheduler="arrival-order")
    assert Engine(config, plugins).generate([[5, 6]], params(2, 0))[0].finished
    with pytest.raises(ConfigError, match="'arrival-order' follows the scheduling policies fcfs, not 'priority'"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16, scheduler="arrival-order",
                            scheduling_policy="priority"), plugins)
    with pytest.raises(ConfigError, match="'priority-order' does not follow --priority-aging-s .it does not set "
                                          "Scheduler.follows_priority_aging.; drop the option"):
        Engine(EngineConfig(model=str(tiny_model), device="cpu", num_kv_blocks=16, scheduler="priority-order",
                            scheduling_policy="priority", priority_aging_s=1.0), plugins)


def test_nothing_is_preempted_for_a_request_that_would_not_fit_anyway(tiny_model: Path) -> None:
    """Two seats: a priority-5 request runs beside a priority-0 one when an n=2 request of priority 3 arrives. It
    needs both seats, one of which a more important request holds: preempting the priority-0 one gains nothing."""
    e = engine(tiny_model, max_num_seqs=2, num_kv_blocks=64, scheduling_policy="priority")
    e.add_request(prompt(8, 7), params(10, 5), request_id="top")
    e.add_request(prompt(8, 8), params(10, 0), request_id="low")
    e.step()
    e.add_request(prompt(8, 9), SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2, priority=3),
                  request_id="pair")
    order, _, preemptions = run(e)
    assert preemptions["low"] == 0 and order.index("pair") > order.index("top")


def test_a_request_over_the_step_budget_left_by_running_decodes_preempts_lower_ones(
        tiny_model: Path, hf_greedy: Callable[..., list[int]]) -> None:
    """16 tokens a step without chunking: a running decode leaves 15, so a 16-token prompt of higher priority
    preempts it to start at once (else it waits for the decode's request to end)."""
    e = engine(tiny_model, max_num_batched_tokens=16, num_kv_blocks=64, scheduling_policy="priority")
    low_prompt, high_prompt = prompt(8, 10), prompt(16, 11)
    tokens: dict[str, list[int]] = {}
    e.add_request(low_prompt, params(10, 0), request_id="low")
    step(e, tokens)
    outs = watch(e)
    e.add_request(high_prompt, params(3, 1), request_id="high")
    order, tokens, preemptions = run(e, tokens)
    assert [item.seq.request_id for item in outs[0].scheduled] == ["high"] and preemptions["low"] == 1
    assert tokens == {"low": hf_greedy(tiny_model, low_prompt, 10), "high": hf_greedy(tiny_model, high_prompt, 3)}


def test_blocks_a_request_shares_with_running_ones_are_not_made_room_for(tiny_model: Path) -> None:
    """The arriving prompt extends a running one's 16 tokens (4 cached blocks of 4) by 4: it needs one block of its
    own, and 2 are free, so nothing is preempted although its whole prompt takes 5."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=8, scheduling_policy="priority")
    shared = prompt(16, 12)
    e.add_request(shared, params(8, 0), request_id="low")
    while e.kv.stats().used_blocks < 6:
        e.step()
    outs = watch(e)
    e.add_request(shared + prompt(4, 13), params(1, 1), request_id="high")
    e.step()
    assert not outs[0].preempted
    assert {item.seq.request_id: item.num_new_tokens for item in outs[0].scheduled} == {"low": 1, "high": 4}
    run(e)


def test_making_room_for_a_more_important_request_is_no_kv_shortage_to_the_adaptive_reserve(tiny_model: Path) -> None:
    """--kv-admission-reserve auto goes back to its start at a preemption for want of blocks; one that made room for
    a higher-priority request says nothing about the pool, so the reserve keeps falling."""
    e = engine(tiny_model, max_num_seqs=1, num_kv_blocks=64, scheduling_policy="priority", kv_admission_reserve="auto")
    e.add_request(prompt(8, 14), params(10, 0), request_id="low")
    for _ in range(3):
        e.step()
    before = e.scheduler.reserve.value
    outs = watch(e)
    e.add_request(prompt(8, 15), params(2, 1), request_id="high")
    e.step()
    assert [s.request_id for s in outs[0].preempted] == ["low"]
    assert e.scheduler.reserve.value < before < AdmissionReserve.START


@pytest.mark.parametrize("policy, cap, kv_cache, expected", [
    ("lpm", 128, "paged", ["a2", "a3", "b1", "b2"]), ("lpm", 128, "radix-cache", ["a2", "a3", "b1", "b2"]),
    ("fcfs", 128, "paged", ["b1", "a2", "b2", "a3"]), ("lpm", 4, "paged", ["a2", "a3", "b1", "b2"]),
    ("lpm", 3, "paged", ["b1", "a2", "b2", "a3"])])  # over the cap: arrival order
def test_lpm_admits_the_requests_whose_prefix_is_cached_first(tiny_model: Path, hf_greedy: Callable[..., list[int]],
                                                              policy: str, cap: int, kv_cache: str,
                                                              expected: list[str]) -> None:
    """One seat. a1 ran, so its 32-token prefix is cached; then b1, a2, b2 and a3 arrive together, a* sharing a1's
    prefix and b* another: lpm runs a2 and a3 first (their 32 tokens cached), then b1, whose blocks b2 then reuses."""
    e = engine(tiny_model, max_num_seqs=1, block_size=4, num_kv_blocks=64, scheduling_policy=policy,
               kv_cache=kv_cache)
    e.scheduler.lpm_max_waiting = cap
    a, b = prompt(32, 20), prompt(32, 21)
    prompts = {"a2": a + prompt(5, 22), "b1": b + prompt(6, 23), "b2": b + prompt(7, 24), "a3": a + prompt(3, 25)}
    e.generate([a + prompt(4, 26)], params(2, 0))
    for rid in ("b1", "a2", "b2", "a3"):
        e.add_request(prompts[rid], params(3, 0), request_id=rid)
    cached: dict[str, int] = {}
    order: list[str] = []
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                order.append(out.request_id)
                cached[out.request_id] = out.num_cached_tokens
    assert order == expected
    assert cached == {"a2": 32, "a3": 32, "b1": 0, "b2": 32}
    assert tokens == {rid: hf_greedy(tiny_model, p, 3) for rid, p in prompts.items()}


def test_infer_client_sends_its_priority_to_a_server_that_schedules_by_it(tiny_model: Path, serve_engine: Any
                                                                          ) -> None:
    """One seat, a long request of priority 0 running: `infer client --priority 1` preempts it (the server's
    stats count the preemption), so the client's short request ends while the long one still runs."""
    import asyncio

    import grpc
    from click.testing import CliRunner

    from infer.cli.main import main

    e = engine(tiny_model, max_num_seqs=1, num_kv_blocks=128, scheduling_policy="priority")

    async def test(client: Any, port: int) -> None:
        stream = client.generate("x", request_id="long", max_tokens=1000, temperature=0.0, ignore_eos=True)
        await stream.read()  # the long request runs
        cli = await asyncio.to_thread(CliRunner().invoke, main, [
            "client", "hi", "--target", f"127.0.0.1:{port}", "--priority", "1", "--max-tokens", "3",
            "--temperature", "0"])
        assert cli.exit_code == 0, cli.output
        assert (await client.stats()).preemptions == 1
        await client.abort("long")
        last = None
        while (message := await stream.read()) is not grpc.aio.EOF:
            last = message
        assert last is not None and last.outputs[0].finish_reason == pb.FINISH_REASON_ABORT

    serve_engine(e, test)
    for args, words in ((["--priority", str(2**31)], "priority (--priority) must be an integer in (-2**31, 2**31)"),
                        (["--priority", "2", "--beam-width", "2"], "drop --priority")):
        result = CliRunner().invoke(main, ["client", "hi", "--target", "127.0.0.1:1", *args])
        assert result.exit_code == 2 and words in result.output, result.output


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_a_request_waits_a_step_for_the_prefix_another_computes_in_this_one(
        tiny_model: Path, hf_greedy: Callable[..., list[int]], prefix_caching: bool) -> None:
    """Four prompts sharing 32 tokens (8 blocks of 4) arrive together: one computes the prefix, and the others,
    held back a step, find it cached; without prefix caching there is nothing to wait for."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=128, enable_prefix_caching=prefix_caching)
    shared = prompt(32, 30)
    prompts = {f"r{i}": shared + prompt(3 + i, 31 + i) for i in range(4)}
    outs = watch(e)
    for rid, p in prompts.items():
        e.add_request(p, params(3, 0), request_id=rid)
    cached, tokens = {}, {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                cached[out.request_id] = out.num_cached_tokens
    first = [item.seq.request_id for item in outs[0].scheduled]
    if prefix_caching:
        assert first == ["r0"] and [item.seq.request_id for item in outs[1].scheduled] == ["r0", "r1", "r2", "r3"]
        assert cached == {"r0": 0, "r1": 32, "r2": 32, "r3": 32}
    else:
        assert first == ["r0", "r1", "r2", "r3"] and set(cached.values()) == {0}
    assert tokens == {rid: hf_greedy(tiny_model, p, 3) for rid, p in prompts.items()}


def test_a_request_waits_for_a_chunked_prefix_until_its_last_block_is_computed(
        tiny_model: Path, hf_greedy: Callable[..., list[int]]) -> None:
    """16 tokens a step: the first request computes the shared 40 tokens over three steps; the second waits (a
    request that shares nothing runs meanwhile), then finds all 40 cached."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=128, scheduler="chunked-prefill", max_num_batched_tokens=16)
    shared = prompt(40, 40)
    prompts = {"first": shared + prompt(3, 41), "second": shared + prompt(5, 42), "other": prompt(6, 43)}
    outs = watch(e)
    for rid, p in prompts.items():
        e.add_request(p, params(2, 0), request_id=rid)
    results: dict[str, Any] = {}
    tokens: dict[str, list[int]] = {}
    while e.has_unfinished():
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
            if out.finished:
                results[out.request_id] = out
    admitted = {}
    for i, out in enumerate(outs):
        for item in out.scheduled:
            admitted.setdefault(item.seq.request_id, i)
    assert admitted["other"] < admitted["second"] and admitted["second"] >= 3  # after the prefix's third chunk
    assert results["second"].num_cached_tokens == 40 and results["first"].num_cached_tokens == 0
    assert tokens == {rid: hf_greedy(tiny_model, p, 2) for rid, p in prompts.items()}


def first_schedules(e: Engine, requests: dict[str, tuple[list[int], SamplingParams]], steps: int = 2
                    ) -> list[list[str]]:
    """Add ``requests`` together and return the request ids each of the next ``steps`` schedules holds."""
    outs = watch(e)
    for rid, (p, sp) in requests.items():
        e.add_request(p, sp, request_id=rid)
    for _ in range(steps):
        e.step()
    return [[item.seq.request_id for item in out.scheduled] for out in outs[:steps]]


def test_only_a_block_with_the_same_prefix_and_for_a_reusable_request_is_waited_for(tiny_model: Path) -> None:
    """A prompt whose first block is another's second (the same tokens after another prefix), and one that asks
    for prompt logprobs (a prefix cache never serves it), run at once; one sharing the prefix waits."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=128)
    a, b, c = prompt(4, 50), prompt(4, 51), prompt(4, 52)
    requests = {"ab": (a + b + c, params(2, 0)), "b": (b + c + a, params(2, 0)),
                "logprobs": (a + b + c + a, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)),
                "waits": (a + b + b, params(2, 0))}
    assert first_schedules(e, requests)[0] == ["ab", "b", "logprobs"]


def test_a_request_admitted_in_this_step_is_waited_for_beside_running_ones(tiny_model: Path) -> None:
    """A decode runs when two prompts sharing 16 tokens arrive: the second waits for the blocks the first,
    admitted in the same step, computes."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=128)
    e.add_request(prompt(5, 60), params(6, 0), request_id="running")
    e.step()
    shared = prompt(16, 61)
    schedules = first_schedules(e, {"first": (shared + [7], params(2, 0)), "second": (shared + [8], params(2, 0))})
    assert schedules == [["running", "first"], ["running", "first", "second"]]


def test_a_waiting_request_keeps_its_place_in_the_queue(tiny_model: Path) -> None:
    """Three seats: the request that waited for another's prefix is admitted before a later one when a seat
    frees."""
    e = engine(tiny_model, block_size=4, num_kv_blocks=128, max_num_seqs=3)
    shared = prompt(16, 70)
    schedules = first_schedules(e, {"long": (prompt(6, 71), params(8, 0)), "first": (shared + [5], params(1, 0)),
                                    "second": (shared + [6], params(2, 0)), "later": (prompt(7, 72), params(4, 0)),
                                    "last": (prompt(7, 73), params(2, 0))})
    assert schedules == [["long", "first", "later"], ["long", "later", "second"]]
