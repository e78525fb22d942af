"""Stateful property tests of every KV cache (paged with and without prefix caching, radix) under each eviction policy.

A hypothesis state machine plays scheduler and model runner: it admits prompts drawn from a tiny alphabet (so
prefixes repeat), computes prefill chunks, decodes, speculates and rolls back, forks (between steps, and mid-step as
the engine does for n > 1), preempts, finishes and aborts. It keeps its own model of what each physical block
holds: ``content[block]`` is the token context whose KV the block stores (every token from position 0 to the
block's last written position). After every step it checks the invariants against that model.
"""
from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from infer.core.config import EngineConfig
from infer.core.interfaces import KVCache
from infer.core.request import SamplingParams, Sequence
from infer.plugins.eviction import LRUPolicy
from infer.plugins.paged_cache import PagedKVCache, cached_prefix
from infer.plugins.radix_cache import RadixKVCache

BLOCK = 4
NUM_BLOCKS = 20
MAX_LIVE = 5
BASES = ((0, 1, 2, 0, 1, 2, 0, 1), (0, 1, 2, 0, 2, 2), (1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0))  # shared prefixes
CACHES = {"paged": ("paged", True), "paged-no-prefix": ("paged", False), "radix": ("radix-cache", True)}
POLICIES = ("lru", "lfu", "priority")

tokens = st.integers(0, 2)
bases = st.sampled_from(((),) + BASES)
prompts = st.builds(lambda base, tail: list(base) + tail, bases, st.lists(tokens, min_size=1, max_size=10))
priorities = st.integers(0, 2)
namespaces = st.sampled_from([None, None, "a"])  # a LoRA adapter's: its KV is never matched by another's


@dataclass(eq=False)
class Live:
    """A sequence the machine runs, with the positions allocated but not yet computed (``pending``)."""

    seq: Sequence
    pending: int = 0

    @property
    def idle(self) -> bool:
        return not self.pending

    @property
    def decoding(self) -> bool:
        """Everything but the last token is computed: the next step computes one position."""
        return self.seq.num_computed_tokens == self.seq.num_tokens - 1


@dataclass
class Snapshot:
    tables: dict[int, list[int]]
    ref: list[int]
    stats: tuple[int, ...]
    num_free: int
    num_evictable: int
    held: dict[int, int]  # the paged cache's cached blocks that are not leaves


class KVMachine(RuleBasedStateMachine):
    def __init__(self, make: Callable[[], KVCache]) -> None:
        super().__init__()
        self.kv = make()
        self.live: dict[int, Live] = {}
        self.content: dict[int, tuple[int, ...]] = {}
        self.namespace: dict[int, str | None] = {}  # block -> the cache namespace of the sequence that wrote it
        self.ids = itertools.count()

    # ------------------------------------------------------------ helpers
    def any_live(self, test: Callable[[Live], bool]) -> bool:
        return any(test(live) for live in self.live.values())

    def pick(self, data: st.DataObject, test: Callable[[Live], bool]) -> Live:
        return data.draw(st.sampled_from([live for live in self.live.values() if test(live)]))

    def new_seq(self, prompt: list[int], priority: int, namespace: str | None = None) -> Sequence:
        return Sequence(next(self.ids), "r", prompt, SamplingParams(priority=priority, lora_adapter=namespace), 0.0)

    def tree_blocks(self) -> Counter[int]:
        """Blocks the cache's own structure holds (the radix tree) -> references it holds on each."""
        if isinstance(self.kv, RadixKVCache):
            return Counter(b for node in self.kv.nodes() for b in node.blocks)
        return Counter()

    def shareable(self) -> set[int]:
        """Blocks a later prompt may match."""
        if isinstance(self.kv, RadixKVCache):
            return set(self.tree_blocks())
        return set(self.kv.key_to_block.values())

    def holders(self) -> Counter[int]:
        """Block -> number of live sequences whose table holds it."""
        count: Counter[int] = Counter()
        for live in self.live.values():
            table = self.kv.block_table(live.seq)
            assert len(set(table)) == len(table), "a block appears twice in one table"
            count.update(table)
        return count

    def snapshot(self, seqs: list[Sequence]) -> Snapshot:
        s = self.kv.stats()
        return Snapshot({seq.seq_id: list(self.kv.block_table(seq)) for seq in seqs}, list(self.kv.ref),
                        (s.free_blocks, s.used_blocks, s.cached_blocks, s.prefix_queries, s.prefix_hits, s.evictions),
                        self.kv.num_free_blocks(), len(self.kv.eviction), dict(getattr(self.kv, "held", {})))

    def allocate(self, seq: Sequence, n: int) -> bool:
        """``kv.allocate``; a refusal must change nothing; on success the runner's block copies are applied."""
        seqs = [live.seq for live in self.live.values()] + [seq]
        before = self.snapshot(seqs)
        if not self.kv.allocate(seq, n):
            assert self.snapshot(seqs) == before, "allocate returned False but changed the cache"
            assert not self.kv.take_block_ops()
            return False
        ops = self.kv.take_block_ops()
        assert not ops.swap_in and not ops.swap_out
        values = [self.content.get(src) for src, _ in ops.copies]  # all reads before any write, as the runner does
        for (_, dst), value in zip(ops.copies, values):
            if value is None:
                self.content.pop(dst, None)
            else:
                self.content[dst] = value
                self.namespace[dst] = seq.cache_namespace
        return True

    def check_matched(self, seq: Sequence, matched: int) -> None:
        """The matched blocks hold the prompt's prefix, and no shareable block holds the next one."""
        assert matched % BLOCK == 0 and 0 <= matched <= seq.num_tokens - 1
        table = self.kv.block_table(seq)
        assert len(table) == matched // BLOCK
        for i, block in enumerate(table):
            assert self.content.get(block) == tuple(seq.token_ids[: (i + 1) * BLOCK]), "matched a wrong block"
            assert self.namespace[block] == seq.cache_namespace, "matched another namespace's block"
        if matched // BLOCK < (seq.num_tokens - 1) // BLOCK:
            following = tuple(seq.token_ids[: matched + BLOCK])
            assert all(self.content.get(b) != following or self.namespace[b] != seq.cache_namespace
                       for b in self.shareable()), "match is not the longest"

    def admit(self, seq: Sequence, chunk: int) -> bool:
        """What the scheduler does: match_prefix, allocate the first chunk, free on refusal."""
        before = self.kv.stats()
        matched = self.kv.match_prefix(seq)
        self.check_matched(seq, matched)
        seq.num_computed_tokens = seq.num_cached_tokens = matched
        if not self.allocate(seq, min(chunk, seq.num_tokens - matched)):
            self.kv.free(seq)
            after = self.kv.stats()
            assert (after.prefix_queries, after.prefix_hits) == (before.prefix_queries, before.prefix_hits)
            seq.num_computed_tokens = seq.num_cached_tokens = 0
            return False
        after = self.kv.stats()  # counted when admission succeeds
        assert (after.prefix_queries, after.prefix_hits) == (before.prefix_queries + seq.num_tokens,
                                                             before.prefix_hits + matched)
        self.live[seq.seq_id] = Live(seq, min(chunk, seq.num_tokens - matched))
        return True

    def write(self, seq: Sequence, start: int, context: list[int]) -> None:
        """The forward pass stores the KV of positions ``start .. len(context)`` (position p: ``context[:p + 1]``)."""
        table, end, holders, tree = self.kv.block_table(seq), len(context), self.holders(), self.tree_blocks()
        for i in range(start // BLOCK, (end - 1) // BLOCK + 1):
            block = table[i]
            assert holders[block] == 1 and not tree[block], f"writing into shared block {block}"
            if isinstance(self.kv, PagedKVCache):
                assert self.kv.block_key[block] is None, f"writing into registered block {block}"
            if i * BLOCK < start:  # the positions before the write must be there already (copy-on-write)
                held = self.content.get(block, ())
                assert len(held) >= start and held[:start] == tuple(context[:start]), "copy-on-write lost data"
            self.content[block] = tuple(context[: min(end, (i + 1) * BLOCK)])
            self.namespace[block] = seq.cache_namespace

    def run(self, live: Live, sampled: int, fork_token: int | None = None) -> None:
        """One step of one sequence: write its pending positions, commit them, sample when the prompt is done.

        With ``fork_token``, a sequence that samples forks a sibling between the forward pass and the commit, as
        the engine does for ``n > 1``; the sibling samples ``fork_token``.
        """
        seq = live.seq
        start, end = seq.num_computed_tokens, seq.num_computed_tokens + live.pending
        self.write(seq, start, seq.token_ids[:end])
        if fork_token is not None and end == seq.num_tokens and len(self.live) < MAX_LIVE:
            child = Sequence(next(self.ids), "r", seq.prompt_token_ids, seq.params, 0.0,
                             token_ids=list(seq.token_ids), num_computed_tokens=start)
            self.kv.fork(seq, child)
            child.num_computed_tokens = end
            child.append_token(fork_token, 0.0)
            self.live[child.seq_id] = Live(child)
        seq.num_computed_tokens = end
        live.pending = 0
        self.kv.commit(seq)
        if end == seq.num_tokens:
            seq.append_token(sampled, 0.0)

    def remove(self, live: Live) -> None:
        self.kv.free(live.seq)
        del self.live[live.seq.seq_id]

    # ------------------------------------------------------------ operations
    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(prompt=prompts, chunk=st.integers(1, 30), priority=priorities, namespace=namespaces)
    def add(self, prompt: list[int], chunk: int, priority: int, namespace: str | None) -> None:
        self.admit(self.new_seq(prompt, priority, namespace), chunk)

    @precondition(lambda self: len(self.live) < MAX_LIVE)
    @rule(data=st.data(), base=bases, priority=priorities)
    def evict(self, data: st.DataObject, base: tuple[int, ...], priority: int) -> None:
        """Run a prompt as large as the free plus cached space (or a block more) to the end: evicts or is refused.
        Its blocks then stay cached, for later prompts to match or evict."""
        room = self.kv.num_free_blocks()
        size = data.draw(st.integers(max(room - 1, 1), room + 1)) * BLOCK
        prompt = (list(base) + data.draw(st.lists(tokens, min_size=size, max_size=size)))[:size]
        free, evictions = self.kv.stats().free_blocks, self.kv.stats().evictions
        seq = self.new_seq(prompt, priority)
        if self.admit(seq, size):
            if len(self.kv.block_table(seq)) - seq.num_cached_tokens // BLOCK > free:
                assert self.kv.stats().evictions > evictions, "took more than the free blocks without evicting"
            self.run(self.live[seq.seq_id], 0)
            self.remove(self.live[seq.seq_id])

    @precondition(lambda self: self.any_live(lambda live: live.idle))
    @rule(data=st.data(), chunk=st.integers(1, 12))
    def schedule(self, data: st.DataObject, chunk: int) -> None:
        """Allocate the next prefill chunk or decode position of an idle sequence."""
        live = self.pick(data, lambda live: live.idle)
        n = min(chunk, live.seq.num_tokens - live.seq.num_computed_tokens)
        if self.allocate(live.seq, n):
            live.pending = n

    @precondition(lambda self: self.any_live(lambda live: live.pending))
    @rule(data=st.data(), sampled=tokens, fork=st.none() | tokens)
    def compute(self, data: st.DataObject, sampled: int, fork: int | None) -> None:
        """The forward pass for one sequence; one that samples may fork (n > 1)."""
        self.run(self.pick(data, lambda live: live.pending), sampled, fork)

    @precondition(lambda self: self.any_live(lambda live: live.pending))
    @rule(sampled=st.lists(tokens, min_size=MAX_LIVE, max_size=MAX_LIVE),
          forks=st.lists(st.none() | tokens, min_size=MAX_LIVE, max_size=MAX_LIVE))
    def step(self, sampled: list[int], forks: list[int | None]) -> None:
        """The forward pass of a whole step: every sequence with allocated positions computes them."""
        for live, token, fork in zip([v for v in self.live.values() if v.pending], sampled, forks):
            self.run(live, token, fork)

    @precondition(lambda self: self.any_live(lambda live: live.idle and live.decoding))
    @rule(data=st.data(), sampled=tokens)
    def append(self, data: st.DataObject, sampled: int) -> None:
        """One decode of one sequence: allocate one more position after the committed ones, compute it."""
        live = self.pick(data, lambda live: live.idle and live.decoding)
        if self.allocate(live.seq, 1):
            live.pending = 1
            self.run(live, sampled)

    @precondition(lambda self: self.any_live(lambda live: live.pending == 1 and live.decoding))
    @rule(data=st.data(), drafts=st.lists(tokens, min_size=1, max_size=6), bonus=tokens)
    def speculate(self, data: st.DataObject, drafts: list[int], bonus: int) -> None:
        """Speculative decoding as the engine drives it: after the decode's slot, slots for k drafts; drafts not
        proposed give theirs back; the forward writes all; the rejected ones are rolled back."""
        live = self.pick(data, lambda live: live.pending == 1 and live.decoding)
        seq, computed = live.seq, live.seq.num_computed_tokens
        if not self.allocate(seq, 1 + len(drafts)):
            return
        proposed = data.draw(st.integers(0, len(drafts)))
        if proposed < len(drafts):
            self.kv.truncate(seq, computed + 1 + proposed)
        self.write(seq, computed, seq.token_ids + drafts[:proposed])
        accepted = data.draw(st.integers(0, proposed))
        self.kv.truncate(seq, computed + 1 + accepted)
        seq.token_ids += drafts[:accepted] + [bonus]
        seq.num_computed_tokens = computed + 1 + accepted
        live.pending = 0
        self.kv.commit(seq)

    @precondition(lambda self: len(self.live) < MAX_LIVE and self.any_live(lambda live: live.idle))
    @rule(data=st.data(), sampled=tokens)
    def fork(self, data: st.DataObject, sampled: int) -> None:
        """Fork between steps (beam search): the child shares every block; a decoding child resamples."""
        parent = self.pick(data, lambda live: live.idle)
        child = Sequence(next(self.ids), "r", parent.seq.prompt_token_ids, parent.seq.params, 0.0,
                         token_ids=list(parent.seq.token_ids), num_computed_tokens=parent.seq.num_computed_tokens)
        self.kv.fork(parent.seq, child)
        assert self.kv.block_table(child) == self.kv.block_table(parent.seq)
        self.live[child.seq_id] = Live(child)
        if self.live[child.seq_id].decoding and child.num_output_tokens:
            child.token_ids[-1] = sampled

    @precondition(lambda self: self.any_live(lambda live: live.idle and live.seq.num_computed_tokens))
    @rule(data=st.data(), following=tokens)
    def truncate(self, data: st.DataObject, following: int) -> None:
        """Roll back to the first ``keep`` computed positions, then a different next token."""
        seq = self.pick(data, lambda live: live.idle and live.seq.num_computed_tokens).seq
        keep = data.draw(st.integers(1, seq.num_computed_tokens))
        self.kv.truncate(seq, keep)
        assert len(self.kv.block_table(seq)) == -(-keep // BLOCK)
        seq.token_ids[keep:] = [following]
        seq.num_computed_tokens = keep

    @precondition(lambda self: self.any_live(lambda live: live.idle))
    @rule(data=st.data())
    def finish(self, data: st.DataObject) -> None:
        self.remove(self.pick(data, lambda live: live.idle))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        """Free at any point, also between allocate and compute (an abort mid-step or mid-prefill)."""
        self.remove(self.pick(data, lambda live: True))

    @precondition(lambda self: self.any_live(lambda live: live.idle))
    @rule(data=st.data(), chunk=st.integers(1, 30))
    def preempt(self, data: st.DataObject, chunk: int) -> None:
        """Preemption by recompute: free, then admit the same tokens again (matching what was just left)."""
        live = self.pick(data, lambda live: live.idle)
        self.remove(live)
        live.seq.num_computed_tokens = 0
        self.admit(live.seq, chunk)

    @precondition(lambda self: self.kv.stats().cached_blocks or self.live)
    @rule(prompt=prompts, namespace=namespaces)
    def match(self, prompt: list[int], namespace: str | None) -> None:
        """A lookup whose admission fails: the match is right, and freeing it restores the counts."""
        seq = self.new_seq(prompt, 0, namespace)
        before = self.kv.stats()
        self.check_matched(seq, self.kv.match_prefix(seq))
        self.kv.free(seq)
        assert self.kv.stats() == before

    @precondition(lambda self: self.kv.stats().cached_blocks > 0)
    @rule()
    def reset(self) -> None:
        """Dropping the prefix cache frees exactly the cached blocks; what live sequences hold stays theirs."""
        before, tables = self.kv.stats(), {seq_id: list(self.kv.block_table(live.seq))
                                           for seq_id, live in self.live.items()}
        assert self.kv.reset_prefix_cache()
        after = self.kv.stats()
        assert (after.cached_blocks, after.used_blocks, after.free_blocks, after.evictions) == (
            0, before.used_blocks, before.free_blocks + before.cached_blocks, before.evictions)
        assert tables == {seq_id: list(self.kv.block_table(live.seq)) for seq_id, live in self.live.items()}

    @precondition(lambda self: all(live.seq.cache_namespace != "a" for live in self.live.values()))
    @rule()
    def drop_namespace(self) -> None:
        """Unloading adapter "a" frees exactly its cached blocks; no later "a" sequence matches what it wrote, and
        the other namespaces' cached blocks and every live sequence's stay."""
        held, tree = self.holders(), self.tree_blocks()
        cached = {b for b in range(NUM_BLOCKS) if (tree[b] > 0 and not held[b] if isinstance(self.kv, RadixKVCache)
                                                   else self.kv.ref[b] == 0 and self.kv.block_key[b] is not None)}
        dropped = {b for b in cached if self.namespace.get(b) == "a"}
        before, tables = self.kv.stats(), {seq_id: list(self.kv.block_table(live.seq))
                                           for seq_id, live in self.live.items()}
        assert self.kv.drop_namespace("a")
        after = self.kv.stats()
        assert (after.cached_blocks, after.used_blocks, after.free_blocks, after.evictions) == (
            before.cached_blocks - len(dropped), before.used_blocks, before.free_blocks + len(dropped),
            before.evictions)
        assert tables == {seq_id: list(self.kv.block_table(live.seq)) for seq_id, live in self.live.items()}
        for block, namespace in self.namespace.items():
            if namespace == "a":  # what the unloaded adapter computed: check_matched refuses a match of it
                self.namespace[block] = "a, unloaded"

    @precondition(lambda self: len(self.live) > 1)
    @rule(now=st.booleans())
    def drain(self, now: bool = True) -> None:
        """Free every sequence: only cached blocks may stay behind."""
        if not now:
            return
        for live in list(self.live.values()):
            self.remove(live)
        s = self.kv.stats()
        assert s.used_blocks == 0 and s.free_blocks + s.cached_blocks == s.total_blocks == NUM_BLOCKS
        if isinstance(self.kv, RadixKVCache):
            assert all(node.lock == 0 for node in self.kv.nodes())

    def teardown(self) -> None:
        self.drain()

    # ------------------------------------------------------------ invariants
    @invariant()
    def blocks_are_accounted_for(self) -> None:
        """ref == holders; free XOR referenced XOR cached; the stats agree."""
        held, tree = self.holders(), self.tree_blocks()
        assert all(n == 1 for n in tree.values()), "a block sits in two tree nodes"
        free = list(self.kv.free_list)
        assert len(set(free)) == len(free), "a block is twice in the free list"
        cached = 0
        for block in range(NUM_BLOCKS):
            assert self.kv.ref[block] == held[block] + tree[block], f"block {block}: ref != holders"
            if isinstance(self.kv, RadixKVCache):
                is_cached = tree[block] > 0 and not held[block]
            else:
                is_cached = self.kv.ref[block] == 0 and self.kv.block_key[block] is not None
            states = (block in free, held[block] > 0, is_cached)
            assert sum(states) == 1, f"block {block} is not exactly one of free/referenced/cached: {states}"
            cached += is_cached
        s = self.kv.stats()
        assert (s.free_blocks, s.used_blocks, s.cached_blocks) == (len(free), len(+held), cached)
        assert s.free_blocks + s.used_blocks + s.cached_blocks == s.total_blocks
        assert self.kv.num_free_blocks() == s.free_blocks + s.cached_blocks

    @invariant()
    def sequences_hold_their_tokens(self) -> None:
        for live in self.live.values():
            seq = live.seq
            for i, block in enumerate(self.kv.block_table(seq)):
                valid = tuple(seq.token_ids[: min(seq.num_computed_tokens, (i + 1) * BLOCK)])
                if len(valid) > i * BLOCK:
                    held = self.content.get(block, ())
                    assert held[: len(valid)] == valid and len(held) <= (i + 1) * BLOCK, f"seq {seq.seq_id} block {i}"

    @invariant()
    def shared_blocks_hold_their_prefix(self) -> None:
        if isinstance(self.kv, RadixKVCache):
            self.check_tree()
            return
        kv = self.kv
        for block, key in enumerate(kv.block_key):
            if key is not None:
                held = self.content[block]
                assert len(held) % BLOCK == 0 and kv.key_to_block[key] == block
                assert kv.prefix_id_to_block[kv.block_prefix_id[block]] == block
                assert cached_prefix(kv, block) == held, f"registered block {block} does not hold its prefix"
                assert block in kv.children[key[0]]
        assert len(kv.key_to_block) == len(kv.prefix_id_to_block) == sum(k is not None for k in kv.block_key)
        assert sum(map(len, kv.children.values())) == len(kv.key_to_block)
        cached = {b for b, (k, r) in enumerate(zip(kv.block_key, kv.ref)) if k is not None and not r}
        leaves = {b for b in cached if not kv.children.get(kv.block_prefix_id[b])}
        # only leaves are evictable: evicting a prefix would drop what was cached after it
        assert len(kv.eviction) == len(leaves) and set(kv.held) == cached - leaves

    def check_tree(self) -> None:
        """Locks count the sequences using each node; the tree's tokens are what its blocks store."""
        kv = self.kv
        assert isinstance(kv, RadixKVCache)
        locks: Counter[int] = Counter()
        for live in self.live.values():
            state = kv.seqs[live.seq.seq_id]
            path = kv._path(state.node)
            assert list(state.table[: state.node.depth]) == [b for n in path for b in n.blocks], "table != locked path"
            locks.update(id(n) for n in path)
        stored = evictable = 0
        stack: list[tuple[object, tuple[int, ...]]] = [(root, ()) for root in kv.roots.values()]
        while stack:
            parent, context = stack.pop()
            for key, node in parent.children.items():  # type: ignore[attr-defined]
                assert node.parent is parent and key == node.tokens[:BLOCK] and node.blocks
                assert len(node.tokens) == BLOCK * len(node.blocks) and node.depth == parent.depth + len(node.blocks)
                path = context + node.tokens
                for j, block in enumerate(node.blocks):
                    held = self.content.get(block, ())
                    assert held == path[: (parent.depth + j + 1) * BLOCK], f"tree block {block} holds other tokens"
                    stored += len(held) - (parent.depth + j) * BLOCK
                assert node.lock == locks[id(node)], "lock count != sequences using the node"
                assert node.evictable == (node.lock == 0 and not node.children)
                evictable += node.evictable
                stack.append((node, path))
        assert kv.num_tree_tokens() == stored, "tree token count != tokens stored in its blocks"
        assert len(kv.eviction) == evictable


@pytest.mark.parametrize("cache,policy", [(c, p) for c in CACHES for p in POLICIES
                                          if CACHES[c][1] or p == "lru"])  # without prefix caching nothing is cached
def test_kv_cache_invariants(cache: str, policy: str, infer_plugins) -> None:
    plugins = infer_plugins.collect()
    name, prefix_caching = CACHES[cache]
    config = EngineConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching, eviction_policy=policy)

    def make() -> KVCache:
        return plugins.registry("kv_cache").get(name)(
            config, NUM_BLOCKS, plugins.registry("eviction_policy").get(policy)(config))

    run_state_machine_as_test(lambda: KVMachine(make), settings=settings(
        max_examples=30, stateful_step_count=40, deadline=None, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.large_base_example]))


def test_paged_copy_on_write_covers_every_shared_block_written() -> None:
    """A fork while the parent holds slots beyond its computed tokens: each shared block written gets copied."""
    kv = PagedKVCache(8, 4, LRUPolicy(), True)
    parent = Sequence(0, "r", [1, 2, 3, 4, 5], SamplingParams(), 0.0)
    kv.match_prefix(parent)
    assert kv.allocate(parent, 5)
    parent.num_computed_tokens = 5
    kv.commit(parent)
    parent.append_token(6, 0.0)
    assert kv.allocate(parent, 4)  # a decode slot and three draft slots: blocks 1 and 2 hold uncomputed slots
    child = Sequence(1, "r", parent.prompt_token_ids, parent.params, 0.0, token_ids=list(parent.token_ids),
                     num_computed_tokens=5)
    kv.fork(parent, child)
    assert kv.allocate(child, 4)
    parent_table, child_table = kv.block_table(parent), kv.block_table(child)
    assert parent_table[0] == child_table[0]  # the committed full block stays shared
    assert not set(parent_table[1:]) & set(child_table[1:])
    assert kv.take_block_ops().copies == [(parent_table[1], child_table[1])]  # only the partly kept block moves


def test_paged_copy_on_write_copies_no_block_that_starts_at_the_write() -> None:
    """A shared block whose first position is the first one written holds no computed KV of the writer's: it gets a
    block of its own, and no copy (a copy would move KV that the write overwrites)."""
    kv = PagedKVCache(8, BLOCK, LRUPolicy(), True)
    parent = admitted(kv, 0, [1, 2, 3, 4])
    parent.num_computed_tokens = BLOCK
    kv.commit(parent)
    parent.append_token(5, 0.0)
    assert kv.allocate(parent, BLOCK)  # a decode slot and drafts: block 1, none of it computed
    kv.take_block_ops()
    child = Sequence(1, "r", parent.prompt_token_ids, parent.params, 0.0, token_ids=list(parent.token_ids),
                     num_computed_tokens=BLOCK)
    kv.fork(parent, child)
    assert kv.allocate(child, BLOCK)
    parent_table, child_table = kv.block_table(parent), kv.block_table(child)
    assert parent_table[0] == child_table[0] and parent_table[1] != child_table[1]
    assert kv.take_block_ops().copies == []


def test_paged_refused_allocate_changes_nothing() -> None:
    kv = PagedKVCache(2, 4, LRUPolicy(), True)
    seq = Sequence(0, "r", list(range(12)), SamplingParams(), 0.0)
    assert not kv.allocate(seq, 12)
    assert kv.tables == {} and kv.match_prefix(seq) == 0


def test_evicting_a_prefix_block_unregisters_what_follows_it() -> None:
    """Found by the state machine: with `priority` eviction a prefix block can go before the block after it; that
    block must leave the cache with it, or a later prompt with the same prefix misses what the cache holds."""
    from infer.plugins.eviction import PriorityPolicy

    kv = PagedKVCache(6, BLOCK, PriorityPolicy(), True)
    seqs = itertools.count()

    def run(prompt: list[int], priority: int) -> Sequence:
        seq = Sequence(next(seqs), "r", prompt, SamplingParams(priority=priority), 0.0)
        seq.num_computed_tokens = kv.match_prefix(seq)
        assert kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
        seq.num_computed_tokens = seq.num_tokens
        kv.commit(seq)
        return seq

    a, b = [1, 2, 3, 4], [5, 6, 7, 8]
    kv.free(run(a + b + [9], priority=9))  # caches A, then A+B after it
    kv.free(run(a + [10] * 5, priority=0))  # a hit on A, which goes back to the cache with a lower priority
    kv.free(run([0] * 5 * BLOCK, priority=5))  # evicts the priority-0 blocks, A first
    kv.free(run(a + [11], priority=0))  # caches A again, as a new prefix
    probe = Sequence(next(seqs), "r", a + b + [12], SamplingParams(), 0.0)
    assert kv.match_prefix(probe) == BLOCK  # A; the block of A+B left the cache when A did
    assert all(cached_prefix(kv, block) for block in kv.key_to_block.values())


def test_a_cached_block_that_another_sequence_extends_stops_being_evictable() -> None:
    """A and B compute the same first block at once; A ends first, so its copy is the cached one (evictable, a
    leaf), and B's commit caches its second block after A's first. The first block is a prefix now: under LRU it is
    older, but the policy ranks leaves only, so one eviction takes B's second block and the first stays matchable
    (taking the first would drop the second with it)."""
    kv = PagedKVCache(6, BLOCK, LRUPolicy(), True)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = admitted(kv, 0, prefix[:BLOCK] + [9]), admitted(kv, 1, prefix + [9])
    for seq in (a, b):
        seq.num_computed_tokens = seq.num_tokens
        kv.commit(seq)
        kv.free(seq)
    assert kv.stats().cached_blocks == 2
    pressure = admitted(kv, 2, [0] * (4 * BLOCK + 1))  # every free block and one cached block
    assert kv.counters.evictions == 1
    assert matched_tokens(kv, 3, prefix + [7]) == BLOCK
    kv.free(pressure)


def test_a_block_after_an_evicted_prefix_is_not_cached() -> None:
    """B's first block is cached as A's copy, which is evicted before B computes its second: nothing can reach the
    second through the prefix any more, so it is not cached (every registered block is reachable from a root)."""
    kv = PagedKVCache(7, BLOCK, LRUPolicy(), True)
    prefix = [1, 2, 3, 4, 5, 6, 7, 8]
    a, b = admitted(kv, 0, prefix[:BLOCK] + [9]), admitted(kv, 1, prefix + [9])
    a.num_computed_tokens = a.num_tokens
    kv.commit(a)
    kv.free(a)
    b.num_computed_tokens = BLOCK  # B's first chunk: its first block is the one A cached
    kv.commit(b)
    kv.free(admitted(kv, 2, [0] * (3 * BLOCK + 1)))  # takes every free block and evicts A's
    assert kv.counters.evictions == 1 and kv.stats().cached_blocks == 0
    b.num_computed_tokens = b.num_tokens
    kv.commit(b)
    live_prefixes = set(kv.roots.values()) | set(kv.prefix_id_to_block)
    assert all(key[0] in live_prefixes for key in kv.key_to_block)
    assert matched_tokens(kv, 3, prefix + [7]) == 0
    kv.free(b)
    assert kv.stats().cached_blocks == 0


def test_a_rollback_into_a_cached_block_caches_the_new_context_not_the_old_one() -> None:
    """A sequence rolls back into the middle of its second block, which is cached, and goes on with other tokens:
    the block is copied on write, and what it caches from there follows the new tokens. A prompt of the old second
    block and the new third must not match the third (its KV was computed after other tokens)."""
    kv = PagedKVCache(8, BLOCK, LRUPolicy(), True)
    old = [1] * BLOCK + [2] * BLOCK + [3]
    seq = admitted(kv, 0, old)
    seq.num_computed_tokens = len(old)
    kv.commit(seq)
    keep = BLOCK + 2
    kv.truncate(seq, keep)
    new = old[:keep] + [5, 5] + [6] * BLOCK + [7]
    seq.token_ids[keep:] = new[keep:]
    seq.num_computed_tokens = keep
    assert kv.allocate(seq, len(new) - keep)
    seq.num_computed_tokens = len(new)
    kv.commit(seq)
    computed = [old, new]  # the contexts whose KV some block holds

    def longest_computed(prompt: list[int]) -> int:
        """Whole blocks of ``prompt`` (less its last token) that one computed context begins with."""
        blocks = (len(prompt) - 1) // BLOCK
        return max(next((i for i in range(blocks, -1, -1) if context[: i * BLOCK] == prompt[: i * BLOCK]), 0)
                   for context in computed) * BLOCK

    for probe_id, probe in enumerate([old[: 2 * BLOCK] + [6] * BLOCK + [7], new, new[: 2 * BLOCK] + [9]], 1):
        assert matched_tokens(kv, probe_id, probe) == longest_computed(probe), probe
    assert all(list(cached_prefix(kv, block)) in [c[: len(cached_prefix(kv, block))] for c in computed]
               for block in kv.key_to_block.values())
    kv.free(seq)


def admitted(kv: KVCache, seq_id: int, prompt: list[int], params: SamplingParams | None = None) -> Sequence:
    """A sequence matched against the cache and allocated for the rest of its prompt."""
    seq = Sequence(seq_id, "r", prompt, params or SamplingParams(), 0.0)
    seq.num_computed_tokens = kv.match_prefix(seq)
    assert kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    return seq


def test_lfu_forgets_the_uses_of_a_block_dropped_while_held() -> None:
    """A block registered after another request's cached prefix leaves the cache when that prefix is evicted, even
    while a sequence holds it; the uses LFU counted for its old content must not carry over to the next one."""
    from infer.plugins.eviction import LFUPolicy

    lfu = LFUPolicy()
    kv = PagedKVCache(8, BLOCK, lfu, True)
    seqs = itertools.count()

    def admit(prompt: list[int]) -> Sequence:
        return admitted(kv, next(seqs), prompt)

    def compute(seq: Sequence) -> None:
        seq.num_computed_tokens = seq.num_tokens
        kv.commit(seq)

    x, z = [1] * BLOCK, [3] * BLOCK
    first, holder = admit(x + [9]), admit(x + z + [9])  # both prefill before either caches anything
    compute(first)  # caches x
    compute(holder)  # x is cached already: holder's z block is registered after first's x block
    z_block = kv.block_table(holder)[1]
    kv.free(first)  # first's x block is evictable now; holder still holds its z block
    for _ in range(3):  # prefix hits on x + z: three uses of the z block
        hit = admit(x + z + [7])
        assert kv.block_table(hit)[1] == z_block
        compute(hit)
        kv.free(hit)
    kv.free(admit(list(range(10, 11 + 4 * BLOCK))))  # needs every free block and evicts x: z goes with it
    assert kv.match_prefix(probe := Sequence(next(seqs), "r", x + z + [7], SamplingParams(), 0.0)) == 0
    kv.free(probe)
    kv.free(holder)  # z's block is free now, and its next content is new
    fresh = next(b for b in range(8) if b != z_block and kv.ref[b] == 0)
    lfu.insert(z_block)  # what caching new content in the two blocks tells the policy
    lfu.insert(fresh)
    assert lfu.pop() == z_block  # one use each: the older goes first, as with any new content


def test_lfu_ranks_the_head_of_a_split_radix_node_by_the_uses_of_the_whole() -> None:
    """A prompt that diverges inside a cached radix node cuts it in two; the new head served every use of the
    whole node, so LFU must not rank it as new content (which would evict a hot shared prefix early)."""
    from infer.plugins.eviction import LFUPolicy

    lfu = LFUPolicy()
    kv = RadixKVCache(16, BLOCK, lfu)
    seqs = itertools.count()

    def run(prompt: list[int]) -> None:
        seq = admitted(kv, next(seqs), prompt)
        seq.num_computed_tokens = seq.num_tokens
        kv.commit(seq)
        kv.free(seq)

    a, b, c = [1] * BLOCK, [2] * BLOCK, [3] * BLOCK
    for _ in range(3):
        run(a + b + [9])  # one node a + b: cached, then two hits (LFU counts 5: three inserts, two touches)
    run(a + c + [9])  # cuts it: head a, with children b (the old node) and c
    head = kv.root.children[tuple(a)]
    assert head.tokens == tuple(a) and len(head.children) == 2
    lfu.insert("used four times")
    for _ in range(3):
        lfu.touch("used four times")
    lfu.insert(head)  # what the cache tells the policy once b and c are gone and head is an unlocked leaf
    order = [lfu.pop() for _ in range(4)]  # c (one use), then by count
    assert order.index("used four times") < order.index(head), order


class RecordingLRU(LRUPolicy):
    """The shipped LRU, recording every call the cache makes."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, object]] = []

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self.calls.append(("insert", priority))
        super().insert(key, priority)

    def touch(self, key: Hashable) -> None:
        self.calls.append(("touch", None))
        super().touch(key)

    def remove(self, key: Hashable) -> None:
        self.calls.append(("remove", None))
        super().remove(key)


@pytest.mark.parametrize("cache", ["paged", "radix"])
def test_a_failed_admission_leaves_no_trace(cache: str) -> None:
    """A request that matches a cached prefix but cannot get its other blocks waits at the head of the queue and is
    matched again every step: no reference, use (LFU) or priority may change until its admission succeeds."""
    policy = RecordingLRU()
    kv: KVCache = PagedKVCache(6, BLOCK, policy, True) if cache == "paged" else RadixKVCache(6, BLOCK, policy)
    ids = itertools.count()

    def admit(prompt: list[int], priority: int) -> Sequence | None:
        seq = Sequence(next(ids), "r", prompt, SamplingParams(priority=priority), 0.0)
        seq.num_computed_tokens = kv.match_prefix(seq)
        if not kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens):
            kv.free(seq)
            return None
        return seq

    shared = [1] * BLOCK + [2] * BLOCK
    cached = admit(shared + [3], priority=5)
    assert cached is not None
    cached.num_computed_tokens = cached.num_tokens
    kv.commit(cached)
    kv.free(cached)  # the two shared blocks stay cached
    holder = admit(list(range(100, 100 + 3 * BLOCK)), priority=0)  # holds 3 of the 4 other blocks
    assert holder is not None
    before = (list(kv.ref), kv.stats(), len(policy.calls))
    for _ in range(3):  # needs the 2 cached blocks plus 2 more; one is free
        assert admit(shared + list(range(200, 200 + 2 * BLOCK)), priority=0) is None
    assert (list(kv.ref), kv.stats(), len(policy.calls)) == before
    kv.free(holder)
    waiter = admit(shared + list(range(200, 200 + 2 * BLOCK)), priority=0)  # now it fits: the use is counted once
    assert waiter is not None and kv.num_blocks_needed(waiter.num_tokens) == len(kv.block_table(waiter))
    assert [c for c, _ in policy.calls[before[2]:]].count("touch") >= 1


def test_reset_drops_every_cached_block_even_prefixes_of_held_ones() -> None:
    """Emptying ``held`` can turn a held parent into a leaf after the eviction policy was drained: reset must keep
    going until both are empty, or the parent stays cached and matchable (bench arms start cold on a reset)."""
    from infer.plugins.eviction import LRUPolicy

    kv = PagedKVCache(8, BLOCK, LRUPolicy(), True)
    x, y, z = [1] * BLOCK, [2] * BLOCK, [3] * BLOCK
    # both prefill before either caches anything
    first, second = admitted(kv, 0, x + y + [9]), admitted(kv, 1, x + y + z + [9])
    for seq in (first, second):
        seq.num_computed_tokens = seq.num_tokens
        kv.commit(seq)  # second's z block registers under first's y block
    kv.free(first)  # first's x and y blocks: cached, and not leaves (held)
    assert kv.reset_prefix_cache()
    assert not kv.held and not len(kv.eviction) and not kv.key_to_block and kv.stats().cached_blocks == 0
    probe = Sequence(99, "r", x + [5], SamplingParams(), 0.0)
    assert kv.match_prefix(probe) == 0


@pytest.mark.parametrize("make", [lambda: PagedKVCache(8, BLOCK, LRUPolicy(), True),
                                  lambda: RadixKVCache(8, BLOCK, LRUPolicy())], ids=["paged", "radix"])
def test_drop_namespace_of_a_live_sequence_is_refused_and_changes_nothing(make) -> None:
    """The contract says no live sequence has the namespace; a caller that breaks it gets an error (under
    ``python -O`` too), and the cache keeps that sequence's blocks and its namespace's cached prefixes."""
    kv = make()
    live = admitted(kv, 0, [1] * BLOCK + [2] * BLOCK + [9], SamplingParams(lora_adapter="a"))
    live.num_computed_tokens = live.num_tokens
    kv.commit(live)
    before = (list(kv.ref), kv.stats(), list(kv.block_table(live)))
    with pytest.raises(RuntimeError, match=r"drop_namespace\('a'\) while a live sequence"):
        kv.drop_namespace("a")
    assert (list(kv.ref), kv.stats(), list(kv.block_table(live))) == before
    kv.free(live)
    probe = Sequence(1, "r", [1] * BLOCK + [2] * BLOCK + [7], SamplingParams(lora_adapter="a"), 0.0)
    assert kv.match_prefix(probe) == 2 * BLOCK  # its prefix is still cached under "a"


@pytest.mark.parametrize("make", [lambda: PagedKVCache(8, BLOCK, LRUPolicy(), True),
                                  lambda: RadixKVCache(8, BLOCK, LRUPolicy())], ids=["paged", "radix"])
def test_matching_or_forking_into_a_sequence_that_holds_blocks_is_refused(make) -> None:
    """A scheduler that matches a sequence twice, or forks into one that holds blocks, would leak them: an error
    (under ``python -O`` too), and the cache is unchanged."""
    kv = make()
    parent = admitted(kv, 0, [1] * BLOCK + [9])
    child = admitted(kv, 1, [2] * BLOCK + [9])
    before = (list(kv.ref), kv.stats())
    with pytest.raises(RuntimeError, match="match_prefix on sequence 0, which holds blocks"):
        kv.match_prefix(parent)
    with pytest.raises(RuntimeError, match="fork into sequence 1, which holds blocks"):
        kv.fork(parent, child)
    assert (list(kv.ref), kv.stats()) == before


BOTH_CACHES = pytest.mark.parametrize("make", [lambda blocks: PagedKVCache(blocks, BLOCK, LRUPolicy(), True),
                                               lambda blocks: RadixKVCache(blocks, BLOCK, LRUPolicy())],
                                      ids=["paged", "radix"])


def run_to_end(kv: KVCache, seq_id: int, prompt: list[int], priority: int = 0) -> None:
    """Admit ``prompt``, compute it in one step, commit it and free it: its full blocks stay cached."""
    seq = admitted(kv, seq_id, prompt, SamplingParams(priority=priority))
    seq.num_computed_tokens = seq.num_tokens
    kv.commit(seq)
    kv.free(seq)


def matched_tokens(kv: KVCache, seq_id: int, prompt: list[int]) -> int:
    """Tokens of ``prompt`` a new request would find cached (a probe that holds nothing after)."""
    probe = Sequence(seq_id, "r", prompt, SamplingParams(), 0.0)
    found = kv.match_prefix(probe)
    kv.free(probe)
    return found


@BOTH_CACHES
def test_a_prompt_of_whole_cached_blocks_leaves_its_last_block_to_compute(make) -> None:
    """A prompt whose every block is cached must still compute a position to sample from: the match stops at the
    last full block before the final token, even where the cached node runs on past it."""
    kv = make(8)
    prompt = list(range(1, 1 + 3 * BLOCK))
    run_to_end(kv, 0, prompt + [99])  # caches the three full blocks of ``prompt`` (one radix node)
    assert matched_tokens(kv, 1, prompt) == (len(prompt) - 1) // BLOCK * BLOCK
    assert matched_tokens(kv, 2, prompt + [7]) == len(prompt)


@BOTH_CACHES
def test_an_admission_that_needs_every_free_and_cached_block_is_accepted(make) -> None:
    """The capacity check counts the matched cached blocks and the new ones against the free plus cached blocks:
    a request that needs exactly all of them fits."""
    kv = make(6)
    shared = [1] * BLOCK + [2] * BLOCK
    run_to_end(kv, 0, shared + [3])  # 2 cached blocks, 4 free
    prompt = shared + list(range(10, 10 + 3 * BLOCK + 1))
    assert kv.num_blocks_needed(len(prompt)) == kv.num_free_blocks() == 6
    seq = Sequence(1, "r", prompt, SamplingParams(), 0.0)
    seq.num_computed_tokens = kv.match_prefix(seq)
    assert seq.num_computed_tokens == len(shared)
    assert kv.allocate(seq, seq.num_tokens - seq.num_computed_tokens)
    assert len(kv.block_table(seq)) == 6 and kv.num_free_blocks() == 0


@BOTH_CACHES
def test_a_copy_on_write_with_no_block_left_is_refused(make) -> None:
    """A fork's first write into the partial block it shares needs a block for the copy: with none free or cached,
    allocate refuses and changes nothing (it must not count only the new blocks and fail deep in eviction)."""
    kv = make(4)
    prompt = [1] * BLOCK + [2]
    parent = admitted(kv, 0, prompt)
    parent.num_computed_tokens = parent.num_tokens
    kv.commit(parent)
    child = Sequence(1, "r", prompt, SamplingParams(), 0.0, token_ids=prompt + [7],
                     num_computed_tokens=len(prompt))
    kv.fork(parent, child)  # shares the full block and the partial one
    filler = admitted(kv, 2, list(range(10, 10 + BLOCK + 3)))  # holds the other two blocks
    assert kv.num_free_blocks() == 0
    before = (list(kv.ref), [list(kv.block_table(s)) for s in (parent, child, filler)], kv.stats())
    assert not kv.allocate(child, 1)  # position 5 lies in the shared partial block: a copy is needed
    assert (list(kv.ref), [list(kv.block_table(s)) for s in (parent, child, filler)], kv.stats()) == before
    assert not kv.take_block_ops()
    kv.free(filler)
    assert kv.allocate(child, 1) and kv.block_table(child)[1] != kv.block_table(parent)[1]


@BOTH_CACHES
def test_a_prompt_cached_in_chunks_is_evicted_before_a_newer_prompt(make) -> None:
    """A prompt committed chunk by chunk is cached as a chain (radix: one node per chunk). When eviction takes its
    last block, the block before it becomes evictable with the rank of its own last use, older than the newer
    prompt's: LRU takes the whole older prompt first."""
    kv = make(8)
    older, newer = [1] * BLOCK + [2] * BLOCK + [9], [3] * BLOCK + [4] * BLOCK + [9]
    seq = admitted(kv, 0, older)
    for computed in (BLOCK, len(older)):  # two prefill chunks, each committed
        seq.num_computed_tokens = computed
        kv.commit(seq)
    kv.free(seq)
    run_to_end(kv, 1, newer)
    assert kv.stats().cached_blocks == 4
    pressure = admitted(kv, 2, list(range(10, 10 + 6 * BLOCK)))  # 4 free blocks: evicts 2 cached ones
    assert kv.stats().evictions == 2
    assert (matched_tokens(kv, 3, older), matched_tokens(kv, 4, newer)) == (0, 2 * BLOCK)
    kv.free(pressure)


def test_priority_ranks_the_head_of_a_split_radix_node_by_the_priority_of_the_whole() -> None:
    """A priority-0 prompt that diverges inside a priority-5 cached node cuts it in two. The head served the
    priority-5 request too, so once it is a leaf it ranks with priority 5, as the unsplit node did (it must not
    rank as if only the priority-0 request had used it)."""
    from infer.plugins.eviction import PriorityPolicy

    kv = RadixKVCache(8, BLOCK, PriorityPolicy())
    a, b, c, f = ([t] * BLOCK for t in (1, 2, 3, 4))
    run_to_end(kv, 0, a + b + [9], priority=5)  # one node a + b
    run_to_end(kv, 1, f + [9], priority=5)  # used after a + b
    run_to_end(kv, 2, a + c + [9], priority=0)  # cuts a + b: head a, tails b and c
    assert kv.stats().cached_blocks == 4
    pressure = admitted(kv, 3, list(range(10, 10 + 7 * BLOCK)))  # 4 free blocks: evicts 3 cached ones
    # by (priority, last use): c (0), b (5, used first), then f (5) before a (5, used last)
    assert kv.stats().evictions == 3
    assert (matched_tokens(kv, 4, a + b + [9]), matched_tokens(kv, 5, f + [9])) == (BLOCK, 0)
    kv.free(pressure)


def test_radix_caches_the_full_blocks_a_fork_shares_when_they_are_committed() -> None:
    """n > 1: the engine forks after the forward pass and before the commit, so the commit finds each prompt block
    held by the sequence and its fork. The blocks enter the tree (the fork adopts them), and a new prompt with the
    same prefix matches them while both still run."""
    kv = RadixKVCache(8, BLOCK, LRUPolicy())
    prompt = [1] * BLOCK + [2] * BLOCK + [9]
    parent = admitted(kv, 0, prompt)
    child = Sequence(1, "r", prompt, parent.params, 0.0, token_ids=list(prompt), num_computed_tokens=0)
    kv.fork(parent, child)
    parent.num_computed_tokens = child.num_computed_tokens = len(prompt)
    kv.commit(parent)
    assert matched_tokens(kv, 2, prompt[: 2 * BLOCK] + [7]) == 2 * BLOCK
    assert list(kv.block_table(parent)) == list(kv.block_table(child))
    kv.free(parent)
    kv.free(child)
    assert kv.stats().used_blocks == 0 and kv.stats().cached_blocks == 2


def test_radix_caches_every_committed_block_when_a_fork_shares_only_the_first() -> None:
    """A fork that holds fewer of the blocks a commit covers (it rolled back to its first block) shares those, not
    the ones after: the commit caches every full block the sequence computed, and a new prompt matches them all at
    once, not only after the sequence's next commit or its end."""
    kv = RadixKVCache(8, BLOCK, LRUPolicy())
    prompt = [1] * BLOCK + [2] * BLOCK + [9]
    parent = admitted(kv, 0, prompt)
    child = Sequence(1, "r", prompt, parent.params, 0.0, token_ids=list(prompt), num_computed_tokens=0)
    kv.fork(parent, child)
    kv.truncate(child, BLOCK)
    assert list(kv.block_table(child)) == list(kv.block_table(parent))[:1]
    parent.num_computed_tokens = len(prompt)
    kv.commit(parent)
    full_blocks = len(prompt) // BLOCK
    assert matched_tokens(kv, 2, prompt[: full_blocks * BLOCK] + [7]) == full_blocks * BLOCK
    kv.free(child)
    kv.free(parent)
    assert kv.stats().used_blocks == 0 and kv.stats().cached_blocks == full_blocks


class ForgetTrackingLRU(LRUPolicy):
    """The shipped LRU, recording which keys the cache ranked and which it said are gone for good."""

    def __init__(self) -> None:
        super().__init__()
        self.ranked: set[Hashable] = set()
        self.forgotten: set[Hashable] = set()

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self.ranked.add(key)
        super().insert(key, priority)

    def restore(self, key: Hashable, priority: int = 0) -> None:
        self.ranked.add(key)
        super().restore(key, priority)

    def forget(self, key: Hashable) -> None:
        self.forgotten.add(key)
        super().forget(key)


def test_radix_tells_the_policy_to_forget_every_node_it_evicts() -> None:
    """An evicted radix node is gone for good (nodes are keys by identity): the policy must be told to forget it,
    or it keeps its rank (LFU: its counts) and the node itself alive for the life of the server."""
    policy = ForgetTrackingLRU()
    kv = RadixKVCache(4, BLOCK, policy)
    for i in range(6):  # each caches one block; with 4 blocks the later ones evict the earlier
        run_to_end(kv, i, [10 + i] * BLOCK + [9])
    assert kv.stats().evictions > 0
    live = set(kv.nodes())
    assert policy.ranked - live <= policy.forgotten
    assert kv.reset_prefix_cache() and not list(kv.nodes())
    assert policy.ranked <= policy.forgotten


def test_paged_tells_the_policy_to_forget_every_block_it_evicts_or_drops() -> None:
    """An evicted or dropped block's content can never be matched again: the policy must forget its rank (LFU: its
    counts), or the block id, reused for other tokens, inherits the uses of the old ones."""
    policy = ForgetTrackingLRU()
    kv = PagedKVCache(4, BLOCK, policy, True)
    forgotten_by_eviction: set[Hashable] = set()
    for i in range(6):  # each caches one block; with 4 blocks the later ones evict the earlier
        cached = set(kv.key_to_block.values())
        run_to_end(kv, i, [10 + i] * BLOCK + [9])
        forgotten_by_eviction |= cached - set(kv.key_to_block.values())
    assert kv.stats().evictions > 0 and forgotten_by_eviction
    assert forgotten_by_eviction <= policy.forgotten
    assert kv.reset_prefix_cache() and not kv.key_to_block
    assert policy.ranked <= policy.forgotten


def test_when_only_prefixes_of_held_blocks_are_cached_the_lowest_priority_one_goes() -> None:
    """Two cached first blocks (priorities 0 and 5), each extended by a running sequence's second block: no cached
    block is a leaf, so an eviction takes the held prefix of the lowest priority, the documented order."""
    kv = PagedKVCache(10, BLOCK, LRUPolicy(), True)
    prompts = {0: [1, 2, 3, 4, 5, 6, 7, 8], 5: [11, 12, 13, 14, 15, 16, 17, 18]}
    pairs = [(admitted(kv, 2 * i, p[:BLOCK] + [9], SamplingParams(priority=prio)),
              admitted(kv, 2 * i + 1, p + [9], SamplingParams(priority=prio)))
             for i, (prio, p) in enumerate(prompts.items())]
    for first, second in pairs:  # the first ends, its block cached; the second's next block extends it and runs on
        for seq in (first, second):
            seq.num_computed_tokens = seq.num_tokens
            kv.commit(seq)
        kv.free(first)
    assert not len(kv.eviction) and kv.stats().cached_blocks == 2
    pressure = admitted(kv, 4, [0] * (2 * BLOCK + 1))  # the two free blocks and one cached
    assert kv.counters.evictions == 1
    lowest = min(prompts)
    assert {prio: matched_tokens(kv, 5 + prio, p + [7]) for prio, p in prompts.items()} == \
        {prio: 0 if prio == lowest else 2 * BLOCK for prio in prompts}
    kv.free(pressure)
