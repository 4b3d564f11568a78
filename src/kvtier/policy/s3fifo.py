"""S3-FIFO (Yang et al., SOSP'23): a small FIFO filters one-hit wonders, a main FIFO keeps the
rest with a 2-bit use counter, and a ghost FIFO of recently evicted keys readmits them to main.

Keys the index refuses to evict (pinned, writing, parents) are set aside for the rest of the
search and put back at the newest end of their queue, counter unchanged, when it ends: a
refusal is never looked at twice in one search. When the queue S3-FIFO would take from holds
only refused keys the search continues in the other one, so a victim is offered whenever any
listed key may go (within ``scan_limit`` refusals).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.policy.base import Evictable, EvictionPolicy
from kvtier.policy.keylist import KeyList

MAX_FREQ = 3


class S3FIFOPolicy(EvictionPolicy):
    def __init__(self, capacity: int, small_fraction: float = 0.1, **kw: int) -> None:
        super().__init__(capacity, **kw)
        self.small_capacity = max(1, int(capacity * small_fraction))
        self.ghost_capacity = max(1, capacity - self.small_capacity)
        self._small = KeyList()
        self._main = KeyList()
        self._ghost = KeyList()
        self._freq: dict[Hashable, int] = {}

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        self._freq[key] = 0
        if self._ghost.discard(key):
            self._main.push_back(key)
        else:
            self._small.push_back(key)

    def touch(self, key: Hashable) -> None:
        if key in self._freq:
            self._freq[key] = min(self._freq[key] + 1, MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        if self._freq.pop(key, None) is not None and not self._small.discard(key):
            self._main.discard(key)

    def victim(self, evictable: Evictable) -> Hashable | None:
        refused_small: list[Hashable] = []
        refused_main: list[Hashable] = []
        try:
            return self._search(evictable, refused_small, refused_main)
        finally:
            for key in refused_small:
                self._small.push_back(key)
            for key in refused_main:
                self._main.push_back(key)

    def _search(self, evictable: Evictable, refused_small: list[Hashable],
                refused_main: list[Hashable]) -> Hashable | None:
        """One S3-FIFO eviction over the keys not yet refused; refused keys are moved out of
        their queue into ``refused_*`` (the caller puts them back). Every step either ages a
        key (at most ``MAX_FREQ + 1`` times per key) or sets one aside, so it terminates."""
        while self._small or self._main:
            if len(refused_small) + len(refused_main) >= self.scan_limit:
                return None
            small_over = len(self._small) + len(refused_small) > self.small_capacity
            from_small = not self._main or (small_over and bool(self._small))
            queue = self._small if from_small else self._main
            key = queue.pop_front()
            freq = self._freq[key]
            if freq > 0:
                # small: seen again while on probation -> main; main: one more lap
                self._freq[key] = 0 if from_small else freq - 1
                self._main.push_back(key)
            elif not evictable(key):
                (refused_small if from_small else refused_main).append(key)
            else:
                del self._freq[key]
                if from_small:
                    self._ghost.push_back(key)
                    while len(self._ghost) > self.ghost_capacity:
                        self._ghost.pop_front()
                return key
        return None

    def __len__(self) -> int:
        return len(self._freq)

    def __contains__(self, key: object) -> bool:
        return key in self._freq
