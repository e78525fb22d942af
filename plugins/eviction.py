"""Eviction policies for cached KV items: lru (default), lfu and priority."""
from __future__ import annotations

import heapq
import itertools
from collections.abc import Hashable

from ..core.hookspecs import EvictionPolicyFactory, hookimpl
from ..core.interfaces import EvictionPolicy
from ..core.registry import Register


class _HeapPolicy(EvictionPolicy):
    """A min-heap over (rank..., last use) with lazy deletion; subclasses define the rank. The last use is a
    logical clock that ``insert`` and ``touch`` advance; it outlives ``remove`` and ``pop`` (``restore`` ranks a
    key by it) and goes with ``forget``, when the key's content does."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], int, int, Hashable]] = []
        self._live: dict[Hashable, int] = {}  # key -> id of its current heap entry
        self._entries = itertools.count()
        self._clock = itertools.count()
        self._last: dict[Hashable, int] = {}
        self._priority: dict[Hashable, int] = {}

    def _rank(self, key: Hashable) -> tuple[int, ...]:
        return ()

    def _push(self, key: Hashable) -> None:
        entry = self._live[key] = next(self._entries)
        heapq.heappush(self._heap, (self._rank(key), self._last[key], entry, key))
        if len(self._heap) > 4 * len(self._live) + 64:  # stale entries (removed, re-ranked): rebuild without them
            self._heap = [(self._rank(k), self._last[k], e, k) for k, e in self._live.items()]
            heapq.heapify(self._heap)

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self._priority[key] = priority
        self._last[key] = next(self._clock)
        self._push(key)

    def restore(self, key: Hashable, priority: int = 0) -> None:
        self._priority[key] = priority
        self._last.setdefault(key, next(self._clock))
        self._push(key)

    def touch(self, key: Hashable) -> None:
        self._last[key] = next(self._clock)
        if key in self._live:
            self._push(key)

    def remove(self, key: Hashable) -> None:
        del self._live[key]

    def pop(self) -> Hashable:
        while self._heap:
            *_, entry, key = heapq.heappop(self._heap)
            if self._live.get(key) == entry:
                del self._live[key]
                return key
        raise IndexError("nothing to evict")

    def derive(self, new_key: Hashable, from_key: Hashable) -> None:
        if from_key in self._last:
            self._last[new_key] = self._last[from_key]

    def forget(self, key: Hashable) -> None:
        self._priority.pop(key, None)
        self._last.pop(key, None)

    def __len__(self) -> int:
        return len(self._live)


class LRUPolicy(_HeapPolicy):
    """Evict the item used (inserted on release, or touched) longest ago; a restored prefix keeps its last use."""


class LFUPolicy(_HeapPolicy):
    """Evict the least frequently reused item; ties go to the least recent. Counts survive re-referencing."""

    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[Hashable, int] = {}

    def _rank(self, key: Hashable) -> tuple[int, ...]:
        return (self._uses.get(key, 0),)

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        super().insert(key, priority)

    def touch(self, key: Hashable) -> None:
        self._uses[key] = self._uses.get(key, 0) + 1
        super().touch(key)

    def derive(self, new_key: Hashable, from_key: Hashable) -> None:
        super().derive(new_key, from_key)
        self._uses[new_key] = self._uses.get(from_key, 0)

    def forget(self, key: Hashable) -> None:
        super().forget(key)
        self._uses.pop(key, None)  # evicted or dropped: the next content under this key starts fresh


class PriorityPolicy(_HeapPolicy):
    """Evict items of the lowest request priority first (SamplingParams.priority); ties go to the least recent."""

    def _rank(self, key: Hashable) -> tuple[int, ...]:
        return (self._priority.get(key, 0),)


@hookimpl
def register_eviction_policies(register: Register[EvictionPolicyFactory]) -> None:
    def factory(cls: type[EvictionPolicy]) -> EvictionPolicyFactory:
        return lambda config: cls()

    register("lru", factory(LRUPolicy))
    register("lfu", factory(LFUPolicy))
    register("priority", factory(PriorityPolicy))

