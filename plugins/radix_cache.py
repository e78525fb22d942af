"""The `radix-cache` KV cache: a radix tree over token ids at block granularity, in the manner of RadixAttention.

Each tree node holds a whole number of full blocks: their tokens and their physical block ids. The tree holds one
reference to each of its blocks. A live sequence's block table is the blocks of one root path (its *locked path*,
ending at ``_SeqState.node``) followed by private blocks that only it and its forks hold. Every node counts the
sequences whose locked path passes through it (``lock``). Unlocked nodes are held by the tree alone: they are the
``cached`` blocks, and the unlocked leaves are what the eviction policy chooses from. Evicting a leaf may make its
parent an evictable leaf, so every cached block can be reclaimed.
"""
from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from ..core.config import EngineConfig
from ..core.errors import ConfigError
from ..core.hookspecs import KVCacheFactory, hookimpl
from ..core.interfaces import BlockOps, EvictionPolicy, KVCache, KVStats, not_evictable
from ..core.registry import Register
from ..core.request import Sequence


@dataclass(eq=False)
class RadixNode:
    """An edge of the tree: ``len(tokens) == block_size * len(blocks)``. Hashed by identity (an eviction key)."""

    tokens: tuple[int, ...]
    blocks: list[int]
    parent: RadixNode | None = field(repr=False)
    depth: int  # blocks from the root to the end of this node
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)  # by the child's first block
    lock: int = 0  # live sequences whose locked path passes through this node
    priority: int | None = None  # the highest of the sequences that released it (read by the `priority` policy)
    evictable: bool = False  # in the eviction policy; true exactly when unlocked, childless and not the root


@dataclass(eq=False)
class _SeqState:
    table: array[int]  # int32: the runner copies it into a batch as is
    node: RadixNode  # invariant: table[:node.depth] are the blocks of the path root..node


class RadixKVCache(KVCache):
    """Invariant: a block is free XOR held by a live sequence (ref > tree's share) XOR held by the tree alone.
    Each cache namespace (a LoRA adapter) has a tree of its own; ``root`` is the base model's."""

    isolates_namespaces = True
    reuses_prefixes = True

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy,
                 eviction_name: str | None = None) -> None:
        self.num_blocks, self.block_size, self.eviction = num_blocks, block_size, eviction
        self.eviction_name = eviction_name
        self.root = RadixNode((), [], None, 0)
        self.roots: dict[str | None, RadixNode] = {None: self.root}  # cache namespace -> its tree's root
        self.ref = [0] * num_blocks  # holders: sequence tables, plus one when the tree holds the block
        self.free_list: deque[int] = deque(range(num_blocks))
        self.seqs: dict[int, _SeqState] = {}
        # seq_id -> the matched path's end, for a sequence matched but not yet allocated: its table lists the path's
        # blocks, which it does not hold (no reference, no lock, no use recorded) until allocate succeeds
        self.pending_match: dict[int, RadixNode] = {}
        self.cached = 0  # blocks of unlocked nodes
        self.ops = BlockOps()
        self.counters = KVStats(num_blocks, num_blocks, 0, 0)

    # ------------------------------------------------------------ queries
    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return len(self.free_list) + self.cached

    def block_table(self, seq: Sequence) -> array[int]:
        state = self.seqs.get(seq.seq_id)
        return state.table if state else array("i")

    def stats(self) -> KVStats:
        free, c = len(self.free_list), self.counters
        return KVStats(self.num_blocks, free, self.num_blocks - free - self.cached, self.cached,
                       c.prefix_queries, c.prefix_hits, c.evictions)

    def take_block_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        return ops

    def nodes(self) -> Iterator[RadixNode]:
        """Every node but the roots, parents before children."""
        stack = [child for root in self.roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def num_tree_tokens(self) -> int:
        return sum(len(node.tokens) for node in self.nodes())

    # ------------------------------------------------------------ tree
    def _key(self, tokens: list[int] | tuple[int, ...], block: int) -> tuple[int, ...]:
        return tuple(tokens[block * self.block_size : (block + 1) * self.block_size])

    def _split(self, node: RadixNode, m: int) -> RadixNode:
        """Cut ``node`` after its first ``m`` blocks; return the new head. ``node`` keeps its identity as the tail."""
        size, parent = self.block_size, node.parent
        assert parent is not None and 0 < m < len(node.blocks)
        head = RadixNode(node.tokens[: m * size], node.blocks[:m], parent, parent.depth + m,
                         lock=node.lock, priority=node.priority)
        self.eviction.derive(head, node)  # the head served every use of the whole (LFU keeps the count)
        parent.children[node.tokens[:size]] = head
        node.tokens, node.blocks, node.parent = node.tokens[m * size :], node.blocks[m:], head
        head.children[node.tokens[:size]] = node
        return head

    def _walk(self, node: RadixNode, tokens: list[int], end: int) -> RadixNode:
        """Descend from ``node`` over ``tokens`` blocks ``node.depth .. end``; split a node matched partly."""
        i = node.depth
        while i < end:
            child = node.children.get(self._key(tokens, i))
            if child is None:
                break
            m = 1
            while m < len(child.blocks) and i + m < end and self._key(child.tokens, m) == self._key(tokens, i + m):
                m += 1
            node = self._split(child, m) if m < len(child.blocks) else child
            i += m
        return node

    def _ancestor_at(self, node: RadixNode, depth: int) -> RadixNode:
        """The node of ``node``'s path that ends at ``depth`` blocks, splitting one if the cut falls inside it."""
        while node.parent is not None and node.parent.depth >= depth:
            node = node.parent
        return self._split(node, depth - node.parent.depth) if node.depth > depth else node  # type: ignore[union-attr]

    def _path(self, node: RadixNode) -> list[RadixNode]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent  # type: ignore[assignment]
        return path[::-1]

    def _set_evictable(self, node: RadixNode, used: bool = True) -> None:
        """``used``: a sequence released the node now (a use); else it lost its last child or its tail blocks to an
        eviction, and keeps the rank of its last use (``EvictionPolicy.restore``)."""
        if node.parent is None or node.lock or node.evictable:
            return
        if node.children:  # released like a leaf (the policy records the use, which ranks it once it is a leaf:
            if used:  # restore) but held back while cached nodes depend on it
                priority = 0 if node.priority is None else node.priority
                self.eviction.insert(node, priority)
                self.eviction.remove(node)
            return
        node.evictable = True
        priority = 0 if node.priority is None else node.priority
        (self.eviction.insert if used else self.eviction.restore)(node, priority)

    def _lock(self, lower: RadixNode, upper: RadixNode) -> None:
        """One more sequence uses the nodes from ``lower`` up to, not including, its ancestor ``upper``."""
        node = lower
        while node is not upper:
            if node.lock == 0:
                if node.evictable:
                    node.evictable = False
                    self.eviction.remove(node)
                self.cached -= len(node.blocks)
            node.lock += 1
            node = node.parent  # type: ignore[assignment]

    def _unlock(self, lower: RadixNode, upper: RadixNode, priority: int) -> None:
        node = lower
        while node is not upper:
            node.lock -= 1
            node.priority = priority if node.priority is None else max(node.priority, priority)
            if node.lock == 0:
                self.cached += len(node.blocks)
                self._set_evictable(node)
            node = node.parent  # type: ignore[assignment]

    def _move_lock(self, state: _SeqState, node: RadixNode, priority: int) -> None:
        """Move the end of a sequence's locked path to ``node``, a descendant or an ancestor of the current end."""
        if node.depth >= state.node.depth:
            self._lock(node, state.node)
        else:
            self._unlock(state.node, node, priority)
        state.node = node

    def _evict_one(self) -> None:
        """Evict the last block of the leaf the policy picks: a request short of one block does not drop a whole
        prompt's cached prefix. A longer leaf stays, one block shorter, with its rank."""
        node = self.eviction.pop()
        if not (isinstance(node, RadixNode) and node.evictable and node.lock == 0 and not node.children):
            raise not_evictable(self.eviction, node, self.eviction_name)
        node.evictable = False
        self.cached -= 1
        self.counters.evictions += 1
        self._release(node.blocks.pop())
        if node.blocks:
            node.tokens = node.tokens[: -self.block_size]
            node.depth -= 1
            self._set_evictable(node, used=False)
            return
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[: self.block_size]]
        self.eviction.forget(node)
        self._set_evictable(parent, used=False)

    # ------------------------------------------------------------ block pool
    def _take_block(self) -> int:
        while not self.free_list:
            self._evict_one()  # raises IndexError only if callers skipped the capacity check
        block = self.free_list.popleft()
        self.ref[block] = 1
        return block

    def _release(self, block: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            self.free_list.append(block)

    def _insert(self, state: _SeqState, seq: Sequence) -> None:
        """Put the sequence's committed full blocks in the tree and lock them; adopt blocks the tree already has."""
        full = min(seq.num_computed_tokens // self.block_size, len(state.table))
        if full <= state.node.depth:
            return
        node = self._walk(state.node, seq.token_ids, full)
        self._adopt(state, node)
        if full > node.depth:
            node = self._add_child(state, node, seq.token_ids, full)
        self._move_lock(state, node, seq.params.priority)

    def _adopt(self, state: _SeqState, node: RadixNode) -> None:
        """Swap the sequence's blocks between its locked end and ``node``, a descendant holding the same tokens
        (hence the same KV), for the tree's blocks. The caller then moves the lock."""
        i = node.depth
        while node is not state.node:
            for block in reversed(node.blocks):
                i -= 1
                if state.table[i] != block:
                    self.ref[block] += 1
                    self._release(state.table[i])
                    state.table[i] = block
            node = node.parent  # type: ignore[assignment]

    def _add_child(self, state: _SeqState, node: RadixNode, tokens: list[int], full: int) -> RadixNode:
        """Insert the sequence's private blocks ``node.depth .. full`` as a child of ``node``; return it.

        Forks may hold some of these blocks (a fork shares the partial and uncommitted blocks of its parent). A
        fork holding a run of them from the first has the same tokens up to there, so it adopts the tree's path
        and locks the part it holds. A block held by anyone else stays private, with all blocks after it.
        """
        size, first = self.block_size, node.depth
        blocks = state.table[first:full]
        sharers: list[tuple[_SeqState, int]] = []  # (fork, how many of ``blocks`` it holds from the first)
        if self.ref[blocks[0]] > 1:
            for other in self.seqs.values():
                n = 0
                while (other is not state and other.node.depth <= first and n < len(blocks)
                       and first + n < len(other.table) and other.table[first + n] == blocks[n]):
                    n += 1
                if n:
                    sharers.append((other, n))
        cut = 0
        while cut < len(blocks) and self.ref[blocks[cut]] == 1 + sum(n > cut for _, n in sharers):
            cut += 1
        if cut == 0:
            return node
        child = RadixNode(tuple(tokens[first * size : (first + cut) * size]), list(blocks[:cut]), node, first + cut)
        node.children[child.tokens[:size]] = child
        for block in child.blocks:
            self.ref[block] += 1
        self.cached += cut  # unlocked until locked below and by the caller
        for other, n in sorted(sharers, key=lambda item: -item[1]):
            self._adopt(other, node)
            self._move_lock(other, self._ancestor_at(child, first + min(n, cut)), 0)
        return child

    # ------------------------------------------------------------ KVCache
    def reset_prefix_cache(self) -> bool:
        evictions = self.counters.evictions  # dropped on request: not evictions
        while len(self.eviction):
            self._evict_one()  # a leaf; its parent may become one
        self.counters.evictions = evictions
        return True

    def drop_namespace(self, namespace: str) -> bool:
        root = self.roots.get(namespace)
        stack = list(root.children.values()) if root is not None else []
        if any(node.lock for node in stack):  # a live sequence locks its whole path from the root
            raise RuntimeError(f"drop_namespace({namespace!r}) while a live sequence uses its tree; the caller must "
                               "wait until that namespace's sequences are freed")
        self.roots.pop(namespace, None)
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.evictable:
                self.eviction.remove(node)
            self.eviction.forget(node)
            self.cached -= len(node.blocks)
            for block in node.blocks:
                self._release(block)  # the tree's share: the block goes back to the free list
        return True

    def _root(self, seq: Sequence) -> RadixNode:
        namespace = seq.cache_namespace
        if namespace not in self.roots:
            self.roots[namespace] = RadixNode((), [], None, 0)
        return self.roots[namespace]

    def match_prefix(self, seq: Sequence) -> int:
        if seq.seq_id in self.seqs:  # the scheduler's bug: matching again would leak what it holds
            raise RuntimeError(f"match_prefix on sequence {seq.seq_id}, which holds blocks: free it first")
        usable = 0 if seq.needs_prompt_logits else max((seq.num_tokens - 1) // self.block_size, 0)  # leave one
        node = self._walk(self._root(seq), seq.token_ids, usable)
        self.seqs[seq.seq_id] = _SeqState(array("i", [block for n in self._path(node) for block in n.blocks]),
                                          self._root(seq))
        matched = node.depth * self.block_size
        self.pending_match[seq.seq_id] = node
        return matched

    def _hold_match(self, seq: Sequence, state: _SeqState, node: RadixNode, path: list[RadixNode]) -> None:
        """Admission succeeds: hold and lock the matched path (``path`` ends at ``node``), count each node's use."""
        for n in path:
            self.eviction.touch(n)  # a prefix hit counts as a use (LFU) even while locked
        for block in state.table:
            self.ref[block] += 1
        self._move_lock(state, node, seq.params.priority)

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        state = self.seqs.get(seq.seq_id) or _SeqState(array("i"), self._root(seq))
        pending = self.pending_match.get(seq.seq_id)
        if pending is not None:  # the matched path's unlocked blocks stop being evictable once held
            path = self._path(pending)
            held_from_cache = sum(len(n.blocks) for n in path if n.lock == 0)
            needed = self.num_blocks_needed(seq.num_computed_tokens + max(num_tokens, 0)) - len(state.table)
            if max(needed, 0) + held_from_cache > self.num_free_blocks():
                return False  # a failed admission leaves no trace: no reference, lock or use
            self._hold_match(seq, state, pending, path)
        table, size = state.table, self.block_size
        start = seq.num_computed_tokens
        end = start + max(num_tokens, 0)
        first = start // size
        stop = min(len(table), self.num_blocks_needed(end)) if end > start else first
        depth = state.node.depth
        # every block written to must be private (not in the tree, not shared with a fork), and the locked path
        # must end before the first written block: tree blocks from there on are replaced by private copies
        cow = [i for i in range(first, max(stop, depth)) if i < depth or self.ref[table[i]] > 1]
        new_blocks = max(self.num_blocks_needed(end) - len(table), 0)
        if new_blocks + len(cow) > self.num_free_blocks():
            return False
        fresh = [self._take_block() for _ in range(len(cow) + new_blocks)]  # evicts while our path is locked
        for i, block in zip(cow, fresh):
            old, table[i] = table[i], block
            if not start <= i * size < (i + 1) * size <= end:  # the copy keeps what the write leaves in place
                self.ops.copies.append((old, block))
            self._release(old)
        if first < depth:
            self._move_lock(state, self._ancestor_at(state.node, cow[0]), seq.params.priority)
        table.extend(fresh[len(cow) :])
        self.seqs[seq.seq_id] = state
        if pending is not None:
            self.counters.count_prompt_lookup(seq, self.pending_match.pop(seq.seq_id).depth * self.block_size)
        return True

    def commit(self, seq: Sequence) -> None:
        state = self.seqs.get(seq.seq_id)
        if state is not None:
            self._insert(state, seq)

    def free(self, seq: Sequence) -> None:
        state = self.seqs.pop(seq.seq_id, None)
        if self.pending_match.pop(seq.seq_id, None) is not None:  # matched, never allocated: holds nothing
            return
        if state is None:
            return
        self._insert(state, seq)  # a finished (or preempted) sequence leaves its prefix in the tree
        self._unlock(state.node, self._root(seq), seq.params.priority)
        for block in reversed(state.table):
            self._release(block)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self.seqs:  # its blocks would leak
            raise RuntimeError(f"fork into sequence {child.seq_id}, which holds blocks: fork into a new one")
        state = self.seqs[parent.seq_id]
        self._insert(state, parent)  # shared full blocks become tree blocks, so only the partial one is private
        twin = _SeqState(array("i", state.table), self._root(child))
        for block in twin.table:
            self.ref[block] += 1
        self._move_lock(twin, state.node, child.params.priority)
        self.seqs[child.seq_id] = twin

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        state = self.seqs[seq.seq_id]
        keep = self.num_blocks_needed(num_tokens)
        for block in reversed(state.table[keep:]):
            self._release(block)
        del state.table[keep:]
        if state.node.depth > keep:
            self._move_lock(state, self._ancestor_at(state.node, keep), seq.params.priority)


@hookimpl
def register_kv_caches(register: Register[KVCacheFactory]) -> None:
    def factory(config: EngineConfig, num_blocks: int, eviction: EvictionPolicy) -> KVCache:
        if not config.enable_prefix_caching:
            raise ConfigError("the radix-cache KV cache is a prefix cache, so --no-prefix-caching contradicts it; "
                              "for a run without prefix reuse use --kv-cache paged --no-prefix-caching")
        return RadixKVCache(num_blocks, config.block_size, eviction, config.eviction_policy)

    register("radix-cache", factory)
