"""S3-FIFO (Yang et al., SOSP'23): a small FIFO filters one-hit wonders, a main FIFO keeps the
rest with a 2-bit use counter, and a ghost FIFO of recently evicted keys readmits them to main.

Keys the index refuses to evict (pinned, writing, parents) are reinserted at the newest end of
their queue with their counter unchanged, so a refusal is never looked at twice in one scan.
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
        for _ in range(min(self.scan_limit, 2 * len(self._freq) + MAX_FREQ * len(self._main) + 2)):
            from_small = len(self._small) > self.small_capacity or not self._main
            queue = self._small if from_small else self._main
            key = queue.front()
            if key is None:
                return None
            queue.remove(key)
            freq = self._freq[key]
            if from_small and freq > 0:
                self._freq[key] = 0
                self._main.push_back(key)
            elif not from_small and freq > 0:
                self._freq[key] = freq - 1
                self._main.push_back(key)
            elif not evictable(key):
                queue.push_back(key)
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
