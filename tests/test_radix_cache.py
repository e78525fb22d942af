"""The `radix-cache` KV cache in the engine: greedy outputs identical to HF transformers and to the `paged` path,
prefix hits on shared prefixes and multi-turn chats, exact outputs under eviction, preemption, chunking and n > 1."""
from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from click.testing import CliRunner

from infer.cli import main
from infer.core.config import EngineConfig
from infer.core.engine import Engine
from infer.core.request import SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


def make_engine(path: Path, kv_cache: str, **options) -> Engine:
    options.setdefault("num_kv_blocks", 256)
    return Engine(EngineConfig(model=str(path), device="cpu", kv_cache=kv_cache, **options))


def random_tokens(rng: random.Random, n: int, vocab: int = 1000) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def generate(engine: Engine, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [result.outputs[0].token_ids for result in engine.generate(prompts, params)]


def test_shared_prefix_waves_match_hf_and_paged_and_hit_the_cache(tiny_model, hf_greedy):
    rng = random.Random(0)
    system = random_tokens(rng, 70)  # four full blocks and a partial one
    waves = [[system + random_tokens(rng, rng.randint(1, 20)) for _ in range(3)] for _ in range(2)]
    radix, paged = make_engine(tiny_model, "radix-cache"), make_engine(tiny_model, "paged")
    hits = []
    for wave in waves:
        before = radix.kv.stats()
        outputs = generate(radix, wave)
        after = radix.kv.stats()
        hits.append(after.prefix_hits - before.prefix_hits)
        assert outputs == generate(paged, wave)
        assert outputs == [hf_greedy(tiny_model, prompt, MAX_TOKENS) for prompt in wave]
    assert hits[0] == 2 * 64  # the first wave's first request computes the prefix, and the others wait a step for it
    assert hits[1] >= 3 * 64, "the second wave must reuse the system prompt's full blocks"
    assert radix.stats.prefix_hit_rate > 0
    stats = radix.kv.stats()
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.total_blocks
    assert radix.kv.num_tree_tokens() == 16 * stats.cached_blocks


def test_multi_turn_chat_hits_at_least_as_often_as_paged(tiny_model):
    rng = random.Random(1)
    turns = [random_tokens(rng, rng.randint(5, 30)) for _ in range(4)]
    rates = {}
    for kv_cache in ("radix-cache", "paged"):
        engine, history, replies = make_engine(tiny_model, kv_cache), [], []
        for user in turns:
            history += user
            reply = generate(engine, [history])[0]
            history += reply
            replies.append(reply)
        stats = engine.kv.stats()
        rates[kv_cache] = (stats.prefix_hits / stats.prefix_queries, replies)
    assert rates["radix-cache"][1] == rates["paged"][1]
    assert rates["radix-cache"][0] >= rates["paged"][0] and rates["radix-cache"][0] > 0.5


@pytest.mark.parametrize("scheduler", ["continuous", "chunked-prefill"])
def test_small_cache_evicts_and_preempts_with_exact_outputs(scheduler, tiny_model, hf_greedy):
    rng = random.Random(2)
    bases = [random_tokens(rng, 40), random_tokens(rng, 70)]
    prompts = [rng.choice(bases) + random_tokens(rng, rng.randint(1, 40)) for _ in range(10)]
    engine = make_engine(tiny_model, "radix-cache", scheduler=scheduler, num_kv_blocks=20,
                         max_num_batched_tokens=64 if scheduler == "chunked-prefill" else 8192)
    outputs = generate(engine, prompts)
    stats = engine.kv.stats()
    assert stats.evictions > 0 and stats.prefix_hits > 0
    assert engine.scheduler.num_preemptions > 0 or scheduler == "chunked-prefill"
    assert outputs == [hf_greedy(tiny_model, prompt, MAX_TOKENS) for prompt in prompts]
    assert stats.used_blocks == 0 and stats.free_blocks + stats.cached_blocks == stats.total_blocks


def test_n_greedy_forks_share_the_prompt_and_match_hf(tiny_model, hf_greedy):
    rng = random.Random(3)
    prompt = random_tokens(rng, 45)
    engine = make_engine(tiny_model, "radix-cache")
    result = engine.generate([prompt], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, n=3))
    expected = hf_greedy(tiny_model, prompt, MAX_TOKENS)
    assert [out.token_ids for out in result[0].outputs] == [expected] * 3
    again = generate(engine, [prompt + expected])  # the forks left the prompt and their decodes in the tree
    assert engine.kv.stats().prefix_hits >= 48 and again == [hf_greedy(tiny_model, prompt + expected, MAX_TOKENS)]


def test_cli_selects_radix_cache_with_plugin(tiny_model, caplog):
    caplog.set_level(logging.INFO, logger="infer")
    result = CliRunner().invoke(main, ["-v", "--model", str(tiny_model), "--plugin", "radix-cache", "generate",
                                       "hello", "hello there", "--max-tokens", "4", "--ignore-eos", "--stats"])
    assert result.exit_code == 0, result.output
    assert "kv_cache radix-cache" in caplog.text  # the engine-ready line names the cache that ran
    assert json.loads(result.output[result.output.index("{"):])["requests_finished"] == 2


def test_radix_cache_refuses_no_prefix_caching():
    """The radix tree is a prefix cache: asking it for no prefix reuse is a contradiction, not a silent no-op."""
    from infer.core.config import EngineConfig
    from infer.core.errors import ConfigError
    from infer.core.plugins import PluginManager

    factory = PluginManager.from_entry_points().collect().registry("kv_cache").get("radix-cache")
    config = EngineConfig(enable_prefix_caching=False)
    with pytest.raises(ConfigError, match="--kv-cache paged --no-prefix-caching"):
        factory(config, 16, None)


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_priority_eviction_keeps_a_high_priority_prefix_that_a_low_one_reused(tiny_model, kv_cache):
    """H (priority 2) caches S + h; L (priority 0) reuses S; then pressure evicts two blocks. The paged cache gave S
    L's priority and, evicting it, dropped H's h blocks cached after it; only leaves are evictable now."""
    def params(priority: int) -> SamplingParams:
        return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, priority=priority)

    e = make_engine(tiny_model, kv_cache, block_size=4, num_kv_blocks=12, eviction_policy="priority")
    shared, high, low, medium = list(range(10, 18)), list(range(20, 28)), list(range(30, 34)), list(range(40, 48))
    e.generate([shared + high + [99]], params(2))
    e.generate([shared + low + [98]], params(0))
    e.generate([medium + [97]], params(1))
    e.generate([list(range(200, 225))], params(0))  # 7 blocks: two cached ones must go
    before = e.kv.stats().prefix_hits
    e.generate([shared + high + [99]], params(0))
    assert e.kv.stats().prefix_hits - before == 16  # all four blocks of S + h still cached


def cached_tokens(engine: Engine, tokens: list[int]) -> int:
    """Tokens of ``tokens`` a new request would find in the prefix cache (a probe that holds nothing after)."""
    from infer.core.request import Sequence

    probe = Sequence(10**6, "probe", tokens, SamplingParams(max_tokens=1), 0.0, max_model_len=engine.max_model_len)
    found = engine.kv.match_prefix(probe)
    engine.kv.free(probe)
    return found


def one_token(priority: int = 0) -> SamplingParams:
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, priority=priority)


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_a_request_short_of_one_block_evicts_one(tiny_model, kv_cache):
    """The radix cache evicted whole leaf nodes: a request one block short dropped a 10-block prompt's prefix and
    left 9 of the blocks unused on the free list."""
    rng = random.Random(1)
    old, new = random_tokens(rng, 41), random_tokens(rng, 27)  # 10 full blocks cached; then 7 blocks, 6 free
    e = make_engine(tiny_model, kv_cache, block_size=4, num_kv_blocks=16)
    e.generate([old], one_token())
    e.generate([new], one_token())
    assert e.kv.stats().evictions == 1 and cached_tokens(e, old) == 36


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_the_older_prompt_is_evicted_before_the_newer(tiny_model, kv_cache, policy):
    """A prefix block that becomes a leaf when the block after it is evicted keeps the rank of its last use: the
    paged cache ranked it as new, so eviction took the newer prompt's tail while half the older one stayed."""
    rng = random.Random(2)
    older, newer, pressure = random_tokens(rng, 17), random_tokens(rng, 17), random_tokens(rng, 29)
    e = make_engine(tiny_model, kv_cache, block_size=4, num_kv_blocks=12, eviction_policy=policy)
    for prompt in (older, newer, pressure):  # 4, 4, then 8 blocks: four evictions
        e.generate([prompt], one_token())
    assert e.kv.stats().evictions == 4
    assert (cached_tokens(e, older), cached_tokens(e, newer)) == (0, 16)


@pytest.mark.parametrize("kv_cache", ["paged", "radix-cache"])
def test_a_shared_prefix_keeps_the_highest_priority_of_its_users(tiny_model, kv_cache):
    """A priority-0 request reusing a priority-5 prefix made it the first to go, before a priority-1 prefix."""
    rng = random.Random(3)
    a, b, c, pressure = (random_tokens(rng, n) for n in (9, 9, 9, 13))
    e = make_engine(tiny_model, kv_cache, block_size=4, num_kv_blocks=8, eviction_policy="priority")
    for prompt, priority in ((a, 5), (b, 5), (c, 1), (a, 0), (pressure, 9)):  # the last needs two evictions
        e.generate([prompt], one_token(priority))
    assert [cached_tokens(e, p) for p in (a, b, c)] == [8, 8, 0]


@pytest.mark.parametrize("name", ["lru", "lfu", "priority"])
def test_a_policy_keeps_no_more_than_a_bounded_heap_of_stale_entries(name):
    """Every release of a held prefix block inserts and removes it: a long-running server without evictions must
    not grow the heap without bound. The ranking survives the rebuilds."""
    from infer.plugins.eviction import LFUPolicy, LRUPolicy, PriorityPolicy

    policy = {"lru": LRUPolicy, "lfu": LFUPolicy, "priority": PriorityPolicy}[name]()
    policy.insert("old")
    for i in range(100_000):
        policy.insert(i % 7)
        policy.touch(i % 7)
        policy.remove(i % 7)
    assert len(policy._heap) <= 4 * len(policy) + 65 and len(policy) == 1
    policy.insert("new", priority=1)
    assert [policy.pop(), policy.pop()] == ["old", "new"]


@pytest.mark.parametrize("name", ["lru", "lfu", "priority"])
def test_a_restored_key_keeps_the_rank_of_its_last_use_across_heap_rebuilds(name):
    """``restore`` ranks a key by its last use, older than the key inserted after it; rebuilding the heap to drop
    stale entries must rank it the same way (not by when it was restored)."""
    from infer.plugins.eviction import LFUPolicy, LRUPolicy, PriorityPolicy

    policy = {"lru": LRUPolicy, "lfu": LFUPolicy, "priority": PriorityPolicy}[name]()
    policy.insert("restored")
    policy.remove("restored")  # held back (a prefix of cached blocks), then evictable again unused:
    policy.insert("newer")
    policy.restore("restored")
    for i in range(1000):  # stale entries: the heap is rebuilt many times
        policy.insert(i % 7)
        policy.remove(i % 7)
        policy.forget(i % 7)
    assert [policy.pop(), policy.pop()] == ["restored", "newer"]


class ReferencePolicy:
    """The shipped policies' documented order, recomputed from scratch at each pop: the evictable key of the lowest
    rank goes first (lru: none; lfu: its uses, inserts and touches counted; priority: the priority it was last
    inserted or restored with), ties to the least recent use (insert and touch advance a clock; restore keeps the
    key's last use, or takes a new one after forget), then to the earliest ranking."""

    def __init__(self, name: str) -> None:
        self.name, self.clock, self.pushes = name, 0, 0
        self.last: dict[int, int] = {}
        self.uses: dict[int, int] = {}
        self.priority: dict[int, int] = {}
        self.pushed: dict[int, int] = {}  # key -> when it was last ranked (the tie-break of equal last uses)
        self.live: set[int] = set()

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _rank(self, key: int) -> None:
        self.pushes += 1
        self.pushed[key] = self.pushes
        self.live.add(key)

    def insert(self, key: int, priority: int = 0) -> None:
        self.uses[key] = self.uses.get(key, 0) + 1
        self.priority[key], self.last[key] = priority, self._tick()
        self._rank(key)

    def restore(self, key: int, priority: int = 0) -> None:
        self.priority[key] = priority
        if key not in self.last:
            self.last[key] = self._tick()
        self._rank(key)

    def touch(self, key: int) -> None:
        self.uses[key] = self.uses.get(key, 0) + 1
        self.last[key] = self._tick()
        if key in self.live:
            self._rank(key)

    def remove(self, key: int) -> None:
        self.live.remove(key)

    def pop(self) -> int:
        def order(key: int) -> tuple[int, ...]:
            rank = {"lru": (), "lfu": (self.uses.get(key, 0),), "priority": (self.priority.get(key, 0),)}[self.name]
            return rank + (self.last[key], self.pushed[key])
        key = min(self.live, key=order)
        self.live.remove(key)
        return key

    def derive(self, new_key: int, from_key: int) -> None:
        if from_key in self.last:
            self.last[new_key] = self.last[from_key]
        self.uses[new_key] = self.uses.get(from_key, 0)

    def forget(self, key: int) -> None:
        for memory in (self.last, self.uses, self.priority):
            memory.pop(key, None)

    def __len__(self) -> int:
        return len(self.live)


@pytest.mark.parametrize("name", ["lru", "lfu", "priority"])
def test_each_registered_policy_evicts_in_its_documented_order(name, infer_plugins):
    """Random calls, as a cache makes them (remove and forget only what the contract allows), to the policy the
    registry gives for ``name`` and to a reference model of its documented order: every pop agrees, across the
    heap's rebuilds (thousands of calls on a handful of keys leave many stale entries)."""
    policy = infer_plugins.collect().registry("eviction_policy").get(name)(EngineConfig())
    model, rng = ReferencePolicy(name), random.Random(name)
    for _ in range(10_000):
        key, live = rng.randrange(8), sorted(model.live)
        op = "pop" if rng.random() < 0.01 else rng.choice(["insert", "touch", "touch", "touch", "remove", "restore",
                                                            "derive", "forget"])  # rare pops: stale entries pile up
        if op in ("insert", "restore") and key not in model.live:
            priority = rng.randrange(3)
            getattr(policy, op)(key, priority)
            getattr(model, op)(key, priority)
        elif op == "touch":
            policy.touch(key)
            model.touch(key)
        elif op == "remove" and live:
            key = rng.choice(live)
            policy.remove(key)
            model.remove(key)
        elif op == "pop":
            if not live:
                with pytest.raises(IndexError):
                    policy.pop()
            else:
                assert policy.pop() == model.pop()
        elif op == "derive" and key not in model.live:
            source = rng.randrange(8)
            policy.derive(key, source)
            model.derive(key, source)
        elif op == "forget" and key not in model.live:
            policy.forget(key)
            model.forget(key)
        assert len(policy) == len(model)
    while len(model):
        assert policy.pop() == model.pop()
