"""Eviction policies for cached KV items: lru (default), lfu and priority."""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from collections.abc import Hashable

from ..core.hookspecs import EvictionPolicyFactory, hookimpl
from ..core.interfaces import EvictionPolicy
from ..core.registry import Register


class LRUPolicy(EvictionPolicy):
    """Evict the item that became evictable (or was touched) longest ago."""

    def __init__(self) -> None:
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        del self._order[key]

    def pop(self) -> Hashable:
        if not self._order:
            raise IndexError("nothing to evict")
        return self._order.popitem(last=False)[0]

    def __len__(self) -> int:
        return len(self._order)


class _HeapPolicy(EvictionPolicy):
    """A min-heap over (rank..., insertion counter) with lazy deletion; subclasses define the rank."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple[int, ...], int, Hashable]] = []
        self._live: dict[Hashable, int] = {}  # key -> counter of its current heap entry
        self._counter = itertools.count()
        self._priority: dict[Hashable, int] = {}

    def _rank(self, key: Hashable) -> tuple[int, ...]:
        raise NotImplementedError

    def _push(self, key: Hashable) -> None:
        count = next(self._counter)
        self._live[key] = count
        heapq.heappush(self._heap, (self._rank(key), count, key))

    def insert(self, key: Hashable, priority: int = 0) -> None:
        self._priority[key] = priority
        self._push(key)

    def touch(self, key: Hashable) -> None:
        if key in self._live:
            self._push(key)

    def remove(self, key: Hashable) -> None:
        del self._live[key]

    def pop(self) -> Hashable:
        while self._heap:
            _, count, key = heapq.heappop(self._heap)
            if self._live.get(key) == count:
                del self._live[key]
                self.forget(key)
                return key
        raise IndexError("nothing to evict")

    def forget(self, key: Hashable) -> None:
        self._priority.pop(key, None)

    def __len__(self) -> int:
        return len(self._live)


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

