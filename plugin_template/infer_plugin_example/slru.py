"""Segmented LRU: cached KV blocks that were reused at least once outlive blocks that were never reused.

Plain LRU lets a burst of one-off prompts push out a system prompt that every conversation shares, because each
one-off block is "more recent". SLRU keeps two LRU segments: *probation* for blocks never hit since they were
cached, and *protected* for blocks that served a prefix hit. Victims come from probation first (least recent
first), and from protected only when probation is empty.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

from infer.core.interfaces import EvictionPolicy


class SegmentedLRUPolicy(EvictionPolicy):
    """The ``slru`` policy. Keys are whatever the KV cache evicts (block ids, radix nodes); opaque here."""

    def __init__(self) -> None:
        self._probation: OrderedDict[Hashable, None] = OrderedDict()
        self._protected: OrderedDict[Hashable, None] = OrderedDict()
        self._reused: set[Hashable] = set()  # keys hit since their content was cached (cleared on eviction)

    def insert(self, key: Hashable, priority: int = 0) -> None:
        segment = self._protected if key in self._reused else self._probation
        segment[key] = None
        segment.move_to_end(key)

    def restore(self, key: Hashable, priority: int = 0) -> None:
        # a prefix held back for its descendants was last used no later than they were, and the last of them was
        # just evicted as the least recent: the prefix goes to the least recent end of its segment, not the newest
        segment = self._protected if key in self._reused else self._probation
        segment[key] = None
        segment.move_to_end(key, last=False)

    def touch(self, key: Hashable) -> None:
        self._reused.add(key)
        if key in self._probation:
            del self._probation[key]
            self._protected[key] = None
        elif key in self._protected:
            self._protected.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        if key in self._probation:
            del self._probation[key]
        elif key in self._protected:
            del self._protected[key]
        else:
            raise KeyError(f"slru: {key!r} is not evictable")

    def pop(self) -> Hashable:
        for segment in (self._probation, self._protected):
            if segment:
                key, _ = segment.popitem(last=False)
                self._reused.discard(key)  # the next content cached under this key starts on probation
                return key
        raise IndexError("nothing to evict")

    def derive(self, new_key: Hashable, from_key: Hashable) -> None:
        if from_key in self._reused:  # a radix node split in two: its head was hit whenever the whole was
            self._reused.add(new_key)

    def forget(self, key: Hashable) -> None:
        self._reused.discard(key)  # the cache dropped the content without evicting it: the same fresh start

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)
