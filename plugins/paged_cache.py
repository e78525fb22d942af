"""The `paged` KV cache: a block pool with reference counts, copy-on-write fork, and chained-hash prefix caching."""
from __future__ import annotations

from collections import deque

from ..core.config import EngineConfig
from ..core.hookspecs import KVCacheFactory, hookimpl
from ..core.interfaces import BlockOps, EvictionPolicy, KVCache, KVStats
from ..core.registry import Register
from ..core.request import Sequence


BlockKey = tuple[int | None, tuple[int, ...]]


def block_key(previous: BlockKey | None, tokens: list[int]) -> BlockKey:
    """The cache key of a full block: the hash of the key before it, and the block's own tokens.

    Dict lookups compare the tokens exactly, so a hash collision cannot hand out a block with other tokens; the
    prefix before it is identified by a 64-bit chained hash.
    """
    return (None if previous is None else hash(previous), tuple(tokens))


class PagedKVCache(KVCache):
    """Invariant: every block is free XOR referenced (ref > 0) XOR cached (ref == 0, hashed, in the policy)."""

    def __init__(self, num_blocks: int, block_size: int, eviction: EvictionPolicy, prefix_caching: bool) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        self.eviction, self.prefix_caching = eviction, prefix_caching
        self.ref = [0] * num_blocks
        self.block_hash: list[BlockKey | None] = [None] * num_blocks
        self.hash_to_block: dict[BlockKey, int] = {}
        self.free_list: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.hashes: dict[int, list[BlockKey]] = {}  # seq_id -> keys of its committed full blocks
        self.pending_match: dict[int, int] = {}  # seq_id -> matched tokens, counted when admission succeeds
        self.ops = BlockOps()
        self.counters = KVStats(num_blocks, num_blocks, 0, 0)

    # ------------------------------------------------------------ queries
    def num_blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def num_free_blocks(self) -> int:
        return len(self.free_list) + len(self.eviction)

    def block_table(self, seq: Sequence) -> list[int]:
        return self.tables.get(seq.seq_id, [])

    def stats(self) -> KVStats:
        cached = len(self.eviction)
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
            block = self.eviction.pop()  # raises IndexError only if callers skipped the capacity check
            del self.hash_to_block[self.block_hash[block]]  # type: ignore[index]
            self.block_hash[block] = None
            self.counters.evictions += 1
        self.ref[block] = 1
        return block

    def _release(self, block: int, priority: int) -> None:
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if self.block_hash[block] is not None:
                self.eviction.insert(block, priority)
            else:
                self.free_list.append(block)

    def _acquire_cached(self, block: int) -> None:
        self.eviction.touch(block)  # a prefix hit counts as a use (LFU) even while referenced
        if self.ref[block] == 0:
            self.eviction.remove(block)
        self.ref[block] += 1

    # ------------------------------------------------------------ KVCache
    def match_prefix(self, seq: Sequence) -> int:
        assert seq.seq_id not in self.tables, "match_prefix on a sequence that holds blocks"
        table: list[int] = []
        hashes: list[BlockKey] = []
        if self.prefix_caching:
            tokens, size = seq.token_ids, self.block_size
            previous: BlockKey | None = None
            for i in range((len(tokens) - 1) // size):  # leave at least one token to compute
                h = block_key(previous, tokens[i * size : (i + 1) * size])
                block = self.hash_to_block.get(h)
                if block is None:
                    break
                self._acquire_cached(block)
                table.append(block)
                hashes.append(h)
                previous = h
        self.tables[seq.seq_id] = table
        self.hashes[seq.seq_id] = hashes
        self.pending_match[seq.seq_id] = len(table) * self.block_size
        return len(table) * self.block_size

    def allocate(self, seq: Sequence, num_tokens: int) -> bool:
        table = self.tables.get(seq.seq_id, [])
        start, size = seq.num_computed_tokens, self.block_size
        needed = self.num_blocks_needed(start + num_tokens)
        new_blocks = max(needed - len(table), 0)
        # every existing block the write touches must be private and unhashed: copy-on-write the others
        shared = [i for i in range(start // size, min(needed, len(table)))
                  if self.ref[table[i]] > 1 or self.block_hash[table[i]] is not None]
        if new_blocks + len(shared) > self.num_free_blocks():
            return False
        self.tables[seq.seq_id] = table
        self.hashes.setdefault(seq.seq_id, [])
        for i in shared:
            old, table[i] = table[i], self._take_block()
            if i * size < start:  # the block keeps positions before `start`: their KV must come along
                self.ops.copies.append((old, table[i]))
            self._release(old, seq.params.priority)
        for _ in range(new_blocks):
            table.append(self._take_block())
        if seq.seq_id in self.pending_match:
            self.counters.prefix_queries += seq.num_tokens
            self.counters.prefix_hits += self.pending_match.pop(seq.seq_id)
        return True

    def commit(self, seq: Sequence) -> None:
        if not self.prefix_caching:
            return
        table, hashes, size = self.tables[seq.seq_id], self.hashes[seq.seq_id], self.block_size
        full = min(seq.num_computed_tokens // size, len(table))
        previous = hashes[-1] if hashes else None
        for i in range(len(hashes), full):
            h = block_key(previous, seq.token_ids[i * size : (i + 1) * size])
            hashes.append(h)
            previous = h
            block = table[i]
            if self.block_hash[block] is None and h not in self.hash_to_block:
                self.block_hash[block] = h
                self.hash_to_block[h] = block

    def free(self, seq: Sequence) -> None:
        self.pending_match.pop(seq.seq_id, None)
        self.hashes.pop(seq.seq_id, None)
        for block in reversed(self.tables.pop(seq.seq_id, [])):  # tail first: evicted before its prefix
            self._release(block, seq.params.priority)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        assert child.seq_id not in self.tables, "fork into a sequence that holds blocks"
        table = self.tables[parent.seq_id]
        for block in table:
            self.ref[block] += 1
        self.tables[child.seq_id] = list(table)
        self.hashes[child.seq_id] = list(self.hashes[parent.seq_id])

    def truncate(self, seq: Sequence, num_tokens: int) -> None:
        table = self.tables[seq.seq_id]
        keep = self.num_blocks_needed(num_tokens)
        for block in reversed(table[keep:]):
            self._release(block, seq.params.priority)
        del table[keep:]
        del self.hashes[seq.seq_id][num_tokens // self.block_size :]


@hookimpl
def register_kv_caches(register: Register[KVCacheFactory]) -> None:
    def factory(config: EngineConfig, num_blocks: int, eviction: EvictionPolicy) -> KVCache:
        return PagedKVCache(num_blocks, config.block_size, eviction, config.enable_prefix_caching)

    register("paged", factory)
