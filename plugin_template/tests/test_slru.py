"""Behaviour of the slru policy, alone and inside a real engine.

The fixtures ``infer_plugins`` (a fresh plugin manager loaded from the installed entry points) and ``tiny_model``
(a tiny random-weight Llama folder) come from infer's pytest plugin, ``infer.testing``, which pytest loads by
itself once infer-engine is installed.
"""
from __future__ import annotations

import random

import pytest

from infer import LLM, SamplingParams
from infer.core.config import EngineConfig
from infer_plugin_example import SegmentedLRUPolicy

BLOCK = 16  # infer's default KV block size


def test_registered_through_the_entry_point(infer_plugins):
    entry = infer_plugins.registry("eviction_policy").entry("slru")
    assert entry.source == "infer-plugin-example"
    assert "segmented-lru" in entry.aliases
    assert isinstance(entry.factory(EngineConfig()), SegmentedLRUPolicy)
    # --plugin NAME finds it by name, whatever its kind
    assert infer_plugins.resolve_plugin_names(EngineConfig(), ["slru"]).eviction_policy == "slru"


def test_never_reused_keys_are_evicted_first():
    policy = SegmentedLRUPolicy()
    for key in "abcd":
        policy.insert(key)
    policy.touch("b")  # a prefix hit on b: b is protected from now on
    policy.remove("b")  # ... and referenced by the request that hit it
    policy.insert("b")  # ... and evictable again when that request finishes
    policy.touch("d")
    assert len(policy) == 4
    assert [policy.pop() for _ in range(4)] == ["a", "c", "b", "d"]
    with pytest.raises(IndexError):
        policy.pop()


def test_eviction_forgets_reuse():
    policy = SegmentedLRUPolicy()
    policy.insert("a")
    policy.touch("a")
    policy.insert("b")
    assert policy.pop() == "b"
    assert policy.pop() == "a"
    policy.insert("a")  # new content under an old key starts on probation again
    policy.insert("c")
    assert policy.pop() == "a"


def test_forget_drops_reuse():
    policy = SegmentedLRUPolicy()
    policy.insert("a")
    policy.touch("a")
    policy.remove("a")
    policy.forget("a")  # the cache dropped a's content while a request held it
    policy.insert("a")
    policy.insert("c")
    assert policy.pop() == "a"  # on probation, like any new content


def test_the_head_of_a_split_node_keeps_the_reuse_of_the_whole():
    policy = SegmentedLRUPolicy()
    policy.insert("whole")
    policy.touch("whole")  # a prefix hit: protected
    policy.derive("head", "whole")  # the radix cache cut it in two
    policy.insert("fresh")
    policy.insert("head")  # once its children are gone
    assert policy.pop() == "fresh"  # the head is protected, like the whole it came from


def test_a_restored_prefix_goes_before_newer_keys():
    """The cache held a prefix back while its child was cached; once the child is evicted, the prefix (used no
    later than the child) must go before keys used since, not outlive them as a fresh insert would."""
    policy = SegmentedLRUPolicy()
    policy.insert("child")
    policy.insert("newer")
    assert policy.pop() == "child"
    policy.restore("prefix")
    assert [policy.pop(), policy.pop()] == ["prefix", "newer"]


def test_remove_of_an_unknown_key_is_an_error():
    with pytest.raises(KeyError):
        SegmentedLRUPolicy().remove("nope")


def cached_tokens_after_a_burst(model: str, policy: str) -> int:
    """A shared 2-block prefix is used twice, then 4 one-off prompts overflow an 8-block KV pool; how much of
    the shared prefix does the next request still find in the cache?"""
    rng = random.Random(0)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(3, 1000) for _ in range(n)]

    llm = LLM(model=model, device="cpu", num_kv_blocks=8, eviction_policy=policy)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    shared = tokens(2 * BLOCK)
    llm.generate([shared + tokens(8)], params)
    llm.generate([shared + tokens(8)], params)  # a prefix hit: the shared blocks were reused
    for _ in range(4):
        llm.generate([tokens(3 * BLOCK)], params)  # one-off prompts, 12 cacheable blocks in all
    [last] = llm.generate([shared + tokens(8)], params)
    return last.num_cached_tokens


def test_a_reused_prefix_survives_a_burst_of_one_off_prompts(tiny_model):
    assert cached_tokens_after_a_burst(str(tiny_model), "lru") == 0  # plain LRU lost it
    assert cached_tokens_after_a_burst(str(tiny_model), "slru") == 2 * BLOCK
