"""The `paged` KV cache: a block pool with reference counts, copy-on-write fork, and exact block-chain prefix
caching."""
from __future__ import annotations

from array import array
from collections import deque

from ..core.config import EngineConfig
from ..core.hookspecs import KVCacheFactory, hookimpl
from ..core.interfaces import BlockOps, EvictionPolicy, KVCache, KVStats, not_evictable
from ..core.registry import Register
from ..core.request import Sequence


BlockKey = tuple[int, tuple[int, ...]]  # (id of the prefix before the block, the block's own tokens)
ROOT = 0  # the prefix id of the empty prefix
UNREACHABLE = -1  # a prefix whose cached block was evicted: what follows it can never be looked up
NO_BLOCKS = array("i")  # the table of a sequence that holds none (read only)


class PagedKVCache(KVCache):
    """Invariant: every block is free XOR referenced (ref > 0) XOR cached (ref == 0, registered). A cached block
    is in the eviction policy when it is a leaf (no registered block follows it), else in ``held``: the policy
    ranks only leaves, so no eviction drops blocks cached after the evicted one (a low-priority request reusing a
    high-priority prefix used to demote it, and its eviction took the high-priority blocks along). When every
    cached block is a prefix of blocks that sequences hold, the lowest-priority held one goes.

    A registered full block has a key (the id of the prefix before it, its own tokens) and a prefix id of its own,
    never reused. Dict lookups compare keys exactly and ids name one prefix each, so a match is exact by
    induction from the root: no hash of the prefix is trusted (a crafted prompt cannot collide into another's KV).
    Evicting a block unregisters its descendants too, so every registered block is reachable from the root. Each
    cache namespace (a LoRA adapter) has a root of its own, a prefix id that no block takes.
    """

    isolates_namespaces = True

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy, prefix_caching: bool,
                 eviction_name: str | None = None) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.eviction, self.prefix_caching, self.eviction_name = eviction, prefix_caching, eviction_name
        self.reuses_prefixes = prefix_caching
        self.ref = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        self.block_prefix_id = [ROOT] * num_blocks  # of registered blocks
        self.key_to_block: dict[BlockKey, int] = {}
        self.prefix_id_to_block: dict[int, int] = {}  # the live prefix ids
        self.children: dict[int, set[int]] = {}  # prefix id -> registered blocks whose key starts with it
        # cached blocks with cached descendants (block -> its priority): only leaves are evictable, else evicting a
        # prefix would drop every block cached after it, whatever the policy ranks them
        self.held: dict[int, int] = {}
        # registered block -> the highest priority of the sequences that computed or released it: a prefix that a
        # high-priority request uses keeps its rank when a low-priority one reuses it last
        self.top_priority: dict[int, int] = {}
        self.next_prefix_id = ROOT + 1
        self.roots: dict[str | None, int] = {None: ROOT}  # cache namespace -> its root's prefix id
        self.free_list: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, array[int]] = {}  # int32 arrays: the runner copies them into a batch as is
        self.chains: dict[int, list[int]] = {}  # seq_id -> the prefix id after each of its committed full blocks
        # seq_id -> matched tokens of a sequence matched but not yet allocated: its table lists the matched blocks,
        # which it does not hold (no reference, no use recorded) until allocate succeeds
        self.pending_match: dict[int, int] = {}
        self.ops = BlockOps()
        self.counters = KVStats(num_blocks, num_blocks, 0, 0)

    # ------------------------------------------------------------ queries
    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.eviction) + len(self.held)

    def block_table(self, seq: Sequence) -> array[int]:
        return self.tables.get(seq.seq_id, NO_BLOCKS)

    def stats(self) -> KVStats:
        cached = len(self.eviction) + len(self.held)
        free = len(self.free_list)
        c = self.counters
        return KVStats(self.num_blocks, free, self.num_blocks - free - cached, cached,
                       c.prefix_queries, c.prefix_hits, c.evictions)

    def take_block_ops(self) -> BlockOps:
        ops, self.ops = self.ops, BlockOps()
        return ops

    # ------------------------------------------------------------ block pool
    def _take_block(self) -> int:
        if self.free_list:
            block = self.free_list.popleft()
        else:
            block = self._pop_cached()
            self._unregister(block)
            self.counters.evictions += 1
        self.ref[block] = 1
        return block

    def _pop_cached(self) -> int:
        """A cached block to drop: the leaf the policy picks, else (every cached block is a prefix of blocks that
        sequences hold) the lowest-priority held one. Callers check the capacity first."""
        if len(self.eviction):
            return self._pop_evictable()
        block = min(self.held, key=self.held.__getitem__)
        del self.held[block]
        return block

    def _pop_evictable(self) -> int:
        block = self.eviction.pop()
        if not (isinstance(block, int) and 0 <= block < self.num_blocks and self.ref[block] == 0
                and self.block_key[block] is not None and block not in self.held):  # held: removed from the policy
            raise not_evictable(self.eviction, block, self.eviction_name)
        return block

    def _register(self, block: int, key: BlockKey, priority: int) -> int:
        prefix_id, self.next_prefix_id = self.next_prefix_id, self.next_prefix_id + 1
        self.block_key[block], self.block_prefix_id[block] = key, prefix_id
        self.key_to_block[key], self.prefix_id_to_block[prefix_id] = block, block
        self.children.setdefault(key[0], set()).add(block)
        self.top_priority[block] = priority
        parent = self.prefix_id_to_block.get(key[0])
        if parent is not None and self.ref[parent] == 0 and parent not in self.held:  # another's cached prefix
            self.eviction.remove(parent)  # not a leaf any more
            self.held[parent] = self.top_priority[parent]
        return prefix_id

    def _unregister(self, block: int) -> None:
        """Forget a block's key, and its registered descendants' keys: no lookup can reach them any more (their
        prefix id dies with it). Descendants that only the cache held go back to the free list."""
        parent = self.block_key[block][0]  # type: ignore[index]
        siblings = self.children[parent]
        siblings.discard(block)
        if not siblings:
            del self.children[parent]
            parent_block = self.prefix_id_to_block.get(parent)
            if parent_block is not None and parent_block in self.held:  # a leaf now: evictable, unused since
                self.eviction.restore(parent_block, self.held.pop(parent_block))
        stack = [block]
        while stack:
            b = stack.pop()
            del self.key_to_block[self.block_key[b]]  # type: ignore[index]
            del self.prefix_id_to_block[self.block_prefix_id[b]]
            self.top_priority.pop(b, None)
            stack.extend(self.children.pop(self.block_prefix_id[b], ()))
            self.block_key[b], self.block_prefix_id[b] = None, ROOT
            if b != block and self.ref[b] == 0:
                if self.held.pop(b, None) is None:
                    self.eviction.remove(b)
                self.free_list.append(b)
                self.counters.evictions += 1
            self.eviction.forget(b)  # its content can never be matched again, even while a sequence holds it

    def _release(self, block: int, priority: int) -> None:
        self.ref[block] -= 1
        if self.block_key[block] is not None:
            priority = self.top_priority[block] = max(self.top_priority[block], priority)
        if self.ref[block] == 0:
            if self.block_key[block] is None:
                self.free_list.append(block)
            elif self.children.get(self.block_prefix_id[block]):
                # released like a leaf (the policy records the use, which ranks it once it is a leaf: restore) but
                # held back from eviction while blocks cached after it depend on it
                self.eviction.insert(block, priority)
                self.eviction.remove(block)
                self.held[block] = priority
            else:
                self.eviction.insert(block, priority)

    def _acquire_cached(self, block: int) -> None:
        self.eviction.touch(block)  # a prefix hit counts as a use (LFU) even while referenced
        if self.ref[block] == 0 and self.held.pop(block, None) is None:
            self.eviction.remove(block)
        self.ref[block] += 1

    # ------------------------------------------------------------ KVCache
    def reset_prefix_cache(self) -> bool:
        evictions = self.counters.evictions  # dropped on request: not evictions
        while len(self.eviction) or self.held:  # unregistering a leaf can turn its held parent into a leaf
            block = self._pop_cached()
            self._unregister(block)  # its cached descendants go too
            self.free_list.append(block)
        self.counters.evictions = evictions
        return True

    def drop_namespace(self, namespace: str) -> bool:
        evictions = self.counters.evictions  # dropped on request: not evictions
        root = self.roots.get(namespace)
        firsts = list(self.children.get(root, ())) if root is not None else []
        if any(self.ref[block] for block in firsts):  # a live sequence holds its first block whatever else it holds
            raise RuntimeError(f"drop_namespace({namespace!r}) while a live sequence holds its blocks; the caller "
                               "must wait until that namespace's sequences are freed")
        self.roots.pop(namespace, None)
        for block in firsts:
            if self.held.pop(block, None) is None:
                self.eviction.remove(block)
            self._unregister(block)  # its cached descendants go too
            self.free_list.append(block)
        self.counters.evictions = evictions
        return True

    def _root(self, seq: Sequence) -> int:
        namespace = seq.cache_namespace
        if namespace not in self.roots:
            self.roots[namespace] = self.next_prefix_id
            self.next_prefix_id += 1
        return self.roots[namespace]

    def match_prefix(self, seq: Sequence) -> int:
        if seq.seq_id in self.tables:  # the scheduler's bug: matching again would leak what it holds
            raise RuntimeError(f"match_prefix on sequence {seq.seq_id}, which holds blocks: free it first")
        table = array("i")
        chain: list[int] = []
        if self.prefix_caching and not seq.needs_prompt_logits:
            tokens, size, prefix = seq.token_ids, self.block_size, self._root(seq)
            for i in range((len(tokens) - 1) // size):  # leave at least one token to compute
                block = self.key_to_block.get((prefix, tuple(tokens[i * size : (i + 1) * size])))
                if block is None:
                    break
                table.append(block)
                prefix = self.block_prefix_id[block]
                chain.append(prefix)
        self.tables[seq.seq_id] = table
        self.chains[seq.seq_id] = chain
        self.pending_match[seq.seq_id] = len(table) * self.block_size
        return len(table) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        table = self.tables.get(seq.seq_id) or array("i")
        if num_tokens == 1 and table and seq.seq_id not in self.pending_match:  # a decode: the general case, shortened
            index = seq.num_computed_tokens // self.block_size
            if index < len(table):
                block = table[index]
                if self.ref[block] == 1 and self.block_key[block] is None:
                    return True  # a private block with room
            elif index == len(table):
                if not self.num_free_blocks():
                    return False
                table.append(self._take_block())
                return True
        start, size = seq.num_computed_tokens, self.block_size
        needed = self.num_blocks_needed(start + num_tokens)
        new_blocks = max(needed - len(table), 0)
        # every existing block the write touches must be private and unregistered: copy-on-write the others
        shared = [i for i in range(start // size, min(needed, len(table)))
                  if self.ref[table[i]] > 1 or self.block_key[table[i]] is not None]
        matched = seq.seq_id in self.pending_match  # its matched blocks stop being evictable once held
        held_from_cache = sum(self.ref[b] == 0 for b in table) if matched else 0
        if new_blocks + len(shared) + held_from_cache > self.num_free_blocks():
            return False  # a failed admission leaves no trace: no reference taken, no use counted
        if matched:
            for block in table:
                self._acquire_cached(block)
        self.tables[seq.seq_id] = table
        self.chains.setdefault(seq.seq_id, [])
        for i in shared:
            old, table[i] = table[i], self._take_block()
            if i * size < start:  # the block keeps positions before `start`: their KV must come along
                self.ops.copies.append((old, table[i]))
            self._release(old, seq.params.priority)
        for _ in range(new_blocks):
            table.append(self._take_block())
        if seq.seq_id in self.pending_match:
            self.counters.count_prompt_lookup(seq, self.pending_match.pop(seq.seq_id))
        return True

    def commit(self, seq: Sequence) -> None:
        if not self.prefix_caching:
            return
        table, chain, size = self.tables[seq.seq_id], self.chains[seq.seq_id], self.block_size
        full = min(seq.num_computed_tokens // size, len(table))
        root = self._root(seq)
        prefix = chain[-1] if chain else root
        for i in range(len(chain), full):
            if prefix != root and prefix not in self.prefix_id_to_block:
                prefix = UNREACHABLE  # the prefix's cached block was evicted, and its id is never reused
            if prefix != UNREACHABLE:
                key, block = (prefix, tuple(seq.token_ids[i * size : (i + 1) * size])), table[i]
                if self.block_key[block] == key:  # matched at admission
                    prefix = self.block_prefix_id[block]
                elif (other := self.key_to_block.get(key)) is not None:  # the same prefix, cached by another
                    prefix = self.block_prefix_id[other]
                elif self.block_key[block] is None:
                    prefix = self._register(block, key, seq.params.priority)
                else:  # not reached: allocate copies registered blocks before any write into them
                    prefix = UNREACHABLE
            chain.append(prefix)

    def free(self, seq: Sequence) -> None:
        if self.pending_match.pop(seq.seq_id, None) is not None:  # matched, never allocated: holds nothing
            self.tables.pop(seq.seq_id, None)
            self.chains.pop(seq.seq_id, None)
            return
        self.chains.pop(seq.seq_id, None)
        table = self.tables.get(seq.seq_id, NO_BLOCKS)
        while table:  # tail first: evicted before its prefix; an interrupted free leaves the rest in the table
            self._release(table.pop(), seq.params.priority)
        self.tables.pop(seq.seq_id, None)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        if child.seq_id in self.tables:  # its blocks would leak
            raise RuntimeError(f"fork into sequence {child.seq_id}, which holds blocks: fork into a new one")
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref[block] += 1
        self.tables[child.seq_id] = array("i", table)
        self.chains[child.seq_id] = list(self.chains[parent.seq_id])

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        table = self.tables[seq.seq_id]
        keep = self.num_blocks_needed(num_tokens)
        for block in reversed(table[keep:]):
            self._release(block, seq.params.priority)
        del table[keep:]
        del self.chains[seq.seq_id][num_tokens // self.block_size :]


@hookimpl
def register_kv_caches(register: Register[KVCacheFactory]) -> None:
    def factory(config: EngineConfig, num_blocks: int, eviction: EvictionPolicy) -> KVCache:
        return PagedKVCache(num_blocks, config.block_size, eviction, config.enable_prefix_caching,
                            config.eviction_policy)

    register("paged", factory)


def cached_prefix(kv: PagedKVCache, block: int) -> tuple[int, ...]:
    """The whole token prefix a registered block stands for, read back through its ancestors' keys (tests)."""
    tokens: list[int] = []
    while True:
        key = kv.block_key[block]
        assert key is not None, f"block {block} is not registered"
        prefix, own = key
        tokens[:0] = own
        if prefix in kv.roots.values():
            return tuple(tokens)
        block = kv.prefix_id_to_block[prefix]  # KeyError: an unreachable registered block
