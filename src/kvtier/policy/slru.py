"""Segmented LRU: new chunks enter a probation segment; a hit promotes to a protected one.

One-pass scans churn probation only, so a hot set that was hit at least once survives them.
Protected holds at most ``protected_capacity`` keys; its overflow is demoted to the newest end
of probation. Victims come from probation first, then protected.

A ghost list remembers the keys last evicted from probation (keys only, up to ``capacity`` of
them): a key saved again while remembered was reused, only further apart than probation
holds, so it enters protected directly (2Q's A1out). Without it a working set whose reuse
distance exceeds probation is never kept once protected is full of an earlier one (seen on
the H200: after the pool filled with one workload's prefixes, the next workload's prefixes,
each reused after ~16 GB of other saves against ~10 GB of probation, got no hit at all). A
one-pass scan never comes back, so it still churns probation only.

The ghost alone still costs every key of the new working set one miss (it must fall out of
probation before it is remembered), and protected stays full of the old set until the new
one displaces it key by key: on the H200's agent-session runs (a new set of sessions every
round on one server) round 2 on restored 83% of the reusable tokens where LRU restores 99%
(`tools/policy_replay.py`). So the protected segment's size adapts as ARC's target does
(Megiddo and Modha, FAST'03): a ghost hit on a key that was only ever in probation says
probation is too short, and protected shrinks by max(1, demoted ghosts / plain ghosts); a
ghost hit on a key that had been protected and was demoted says protected is too short, and
it grows by the inverse ratio, up to ``protected_fraction`` of the capacity. Scans make no
ghost hits, so they move neither.
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.policy.base import Evictable, EvictionPolicy
from kvtier.policy.keylist import KeyList
from kvtier.policy.lru import pick_from_front


class SLRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int, protected_fraction: float = 0.8, **kw: int) -> None:
        super().__init__(capacity, **kw)
        self.max_protected = max(1, int(capacity * protected_fraction))
        self.protected_capacity = self.max_protected  # adapts within [0, max_protected]
        self._probation = KeyList()
        self._protected = KeyList()
        self._demoted: set[Hashable] = set()  # keys in probation that had been protected
        self._ghost = KeyList()  # keys evicted from probation, newest at the back
        self._ghost_demoted: set[Hashable] = set()  # ghosts that had been protected
        self.ghost_capacity = max(1, capacity)

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        if self._ghost.discard(key):  # reused beyond probation's reach: keep it
            self._adapt(was_protected=key in self._ghost_demoted)
            self._ghost_demoted.discard(key)
            self._protect(key)
        elif parent is not None and parent in self._probation:
            self._probation.insert_before(key, parent)
        else:
            self._probation.push_back(key)

    def _adapt(self, was_protected: bool) -> None:
        demoted = len(self._ghost_demoted)
        plain = len(self._ghost) + 1 - demoted  # the key just taken out counted in
        if was_protected:
            step = max(1, plain // max(1, demoted))
            self.protected_capacity = min(self.max_protected, self.protected_capacity + step)
        else:
            step = max(1, demoted // max(1, plain))
            self.protected_capacity = max(0, self.protected_capacity - step)

    def touch(self, key: Hashable) -> None:
        if key in self._protected:
            self._protected.move_to_back(key)
        elif key in self._probation:
            self._probation.remove(key)
            self._demoted.discard(key)
            self._protect(key)

    def _protect(self, key: Hashable) -> None:
        self._protected.push_back(key)
        while len(self._protected) > self.protected_capacity:
            old = self._protected.pop_front()
            self._probation.push_back(old)
            self._demoted.add(old)

    def remove(self, key: Hashable) -> None:
        if self._probation.discard(key):
            self._demoted.discard(key)
        else:
            self._protected.discard(key)

    def victim(self, evictable: Evictable) -> Hashable | None:
        key = pick_from_front(self._probation, evictable, self.scan_limit)
        if key is not None:
            self._ghost.push_back(key)
            if key in self._demoted:
                self._demoted.discard(key)
                self._ghost_demoted.add(key)
            while len(self._ghost) > self.ghost_capacity:
                self._ghost_demoted.discard(self._ghost.pop_front())
            return key
        return pick_from_front(self._protected, evictable, self.scan_limit)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected
