"""An ordered set of keys with O(1) insert (at either end or before a member), move and remove.

The eviction policies are built on it. "Front" is the oldest end (next to go), "back" the
newest. Inserting a chunk just before its parent keeps a prefix's leaves older than their
ancestors, so a policy that walks from the front meets leaves first.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterator


class KeyList:
    __slots__ = ("_next", "_prev")

    _HEAD: object = object()  # sentinel; _next[_HEAD] is the front, _prev[_HEAD] the back

    def __init__(self) -> None:
        self._next: dict[object, object] = {self._HEAD: self._HEAD}
        self._prev: dict[object, object] = {self._HEAD: self._HEAD}

    def __len__(self) -> int:
        return len(self._next) - 1

    def __contains__(self, key: object) -> bool:
        return key in self._next and key is not self._HEAD

    def _link(self, key: Hashable, after: object) -> None:
        if key in self._next:
            raise KeyError(f"{key!r} is already listed")
        nxt = self._next[after]
        self._next[after] = key
        self._prev[key] = after
        self._next[key] = nxt
        self._prev[nxt] = key

    def push_back(self, key: Hashable) -> None:
        self._link(key, self._prev[self._HEAD])

    def push_front(self, key: Hashable) -> None:
        self._link(key, self._HEAD)

    def insert_before(self, key: Hashable, member: Hashable) -> None:
        """Insert ``key`` just older than ``member`` (which must be listed)."""
        self._link(key, self._prev[member])

    def remove(self, key: Hashable) -> None:
        prv = self._prev.pop(key)
        nxt = self._next.pop(key)
        self._next[prv] = nxt
        self._prev[nxt] = prv

    def discard(self, key: Hashable) -> bool:
        if key in self:
            self.remove(key)
            return True
        return False

    def move_to_back(self, key: Hashable) -> None:
        self.remove(key)
        self.push_back(key)

    def front(self) -> Hashable | None:
        k = self._next[self._HEAD]
        return None if k is self._HEAD else k  # type: ignore[return-value]

    def pop_front(self) -> Hashable:
        k = self.front()
        if k is None:
            raise IndexError("pop from an empty KeyList")
        self.remove(k)
        return k

    def iter_from_front(self) -> Iterator[Hashable]:
        """Oldest first. Safe against removal of the key just yielded."""
        k = self._next[self._HEAD]
        while k is not self._HEAD:
            nxt = self._next[k]
            yield k  # type: ignore[misc]
            k = nxt
