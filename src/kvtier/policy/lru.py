"""Least recently used: one recency list, oldest leaves first."""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.policy.base import Evictable, EvictionPolicy
from kvtier.policy.keylist import KeyList


class LRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int, **kw: int) -> None:
        super().__init__(capacity, **kw)
        self._list = KeyList()

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        if parent is not None and parent in self._list:
            self._list.insert_before(key, parent)
        else:
            self._list.push_back(key)

    def touch(self, key: Hashable) -> None:
        if key in self._list:
            self._list.move_to_back(key)

    def remove(self, key: Hashable) -> None:
        self._list.discard(key)

    def victim(self, evictable: Evictable) -> Hashable | None:
        return pick_from_front(self._list, evictable, self.scan_limit)

    def __len__(self) -> int:
        return len(self._list)

    def __contains__(self, key: object) -> bool:
        return key in self._list


def pick_from_front(keys: KeyList, evictable: Evictable, limit: int) -> Hashable | None:
    """Remove and return the oldest evictable key, looking at no more than ``limit`` keys."""
    for n, key in enumerate(keys.iter_from_front()):
        if n >= limit:
            return None
        if evictable(key):
            keys.remove(key)
            return key
    return None
