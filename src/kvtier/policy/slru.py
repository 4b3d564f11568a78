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

The adaptation needs ghost hits, and the first shift gives none in time: when a new set of
sessions starts, every new chunk sits in probation while protected still holds the old
sessions, which never return, and the new chunks fall out of probation before their first
reuse (the replay's round 2: 83% restored against LRU's 99%; on the H200 1.14x slower than
native). A burst of new chunks looks the same whether it is a new working set or a one-pass
scan; what differs is the protected keys' history. So each protected key keeps its reuse
interval (counted in inserts, an average of the last gaps between its uses), and a key idle
for more than ``expiry_factor`` times its interval is taken as dead: it moves to the oldest
end of probation and goes before any new chunk. A hot set used throughout the traffic
(a system prompt between one-off prompts) is never idle that long, so scans of any length
churn probation only, as before. A hot set idle for longer than that, through a burst of
new chunks, is lost once; when it comes back it keeps the interval it came back after as
the floor of its own, so the next burst of that length leaves it alone. Expired keys have
their own memory apart from the ghost (the burst that expired them also pushes them out of
a ghost of ``capacity`` keys). The first gap counts too (save to first use): a chunk used
once right after its save and then idle through a long burst is lost once, the price of
telling a dead working set from a hot one before the new one's first reuse.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable

from kvtier.policy.base import Evictable, EvictionPolicy
from kvtier.policy.keylist import KeyList
from kvtier.policy.lru import pick_from_front


class SLRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int, protected_fraction: float = 0.8,
                 expiry_factor: float = 2.0, **kw: int) -> None:
        super().__init__(capacity, **kw)
        self.max_protected = max(1, int(capacity * protected_fraction))
        self.protected_capacity = self.max_protected  # adapts within [0, max_protected]
        self._probation = KeyList()
        self._protected = KeyList()
        self._demoted: set[Hashable] = set()  # keys in probation that had been protected
        self._ghost = KeyList()  # keys evicted from probation, newest at the back
        self._ghost_demoted: set[Hashable] = set()  # ghosts that had been protected
        self.ghost_capacity = max(1, capacity)
        self.expiry_factor = expiry_factor
        self._clock = 0  # inserts so far: the unit of idle time and of reuse intervals
        self._born: dict[Hashable, int] = {}  # probation key -> clock when saved
        self._last_use: dict[Hashable, int] = {}  # protected key -> clock of its last use
        self._interval: dict[Hashable, int] = {}  # protected key -> mean gap between uses
        self._floor: dict[Hashable, int] = {}  # protected key -> interval it came back after
        self._expiries: list[tuple[int, int, Hashable]] = []  # lazy heap (clock, seq, key)
        self._seq = 0
        self._expired_last_use: dict[Hashable, int] = {}  # expired, in probation -> last use
        self._expired_ghost: dict[Hashable, int] = {}  # evicted expired key -> last use

    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        self._clock += 1
        last_use = self._expired_ghost.pop(key, None)
        if last_use is not None:  # taken for dead, yet it came back: trust this interval
            self._adapt(was_protected=True)
            self._floor[key] = self._clock - last_use
            self._protect(key, since=last_use)
            return
        if self._ghost.discard(key):  # reused beyond probation's reach: keep it
            self._adapt(was_protected=key in self._ghost_demoted)
            self._ghost_demoted.discard(key)
            self._protect(key, since=None)
            return
        self._born[key] = self._clock
        if parent is not None and parent in self._probation:
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
            self._record_use(key, self._last_use[key])
        elif key in self._probation:
            self._probation.remove(key)
            self._demoted.discard(key)
            expired_use = self._expired_last_use.pop(key, None)  # hit before it went
            born = self._born.pop(key, None)
            self._protect(key, since=expired_use if expired_use is not None else born)

    def _protect(self, key: Hashable, since: int | None) -> None:
        self._protected.push_back(key)
        self._record_use(key, since)
        while len(self._protected) > self.protected_capacity:
            old = self._protected.pop_front()
            self._forget_use(old)
            self._probation.push_back(old)
            self._demoted.add(old)

    def _record_use(self, key: Hashable, since: int | None) -> None:
        """A use of protected ``key`` now; ``since`` is its previous use (or save), if known.
        Uses within one insert (a prefix's chunks, concurrent requests) are one use."""
        gap = self._clock - since if since is not None else 0
        if gap > 0:
            old = self._interval.get(key)
            self._interval[key] = gap if old is None else (old + gap + 1) // 2
        self._last_use[key] = self._clock
        deadline = self._deadline(key)
        if deadline is not None:
            self._seq += 1
            heapq.heappush(self._expiries, (deadline, self._seq, key))
            if len(self._expiries) > 4 * len(self._protected) + 64:  # drop stale entries
                self._expiries = [e for e in self._expiries
                                  if e[2] in self._protected and self._deadline(e[2]) == e[0]]
                heapq.heapify(self._expiries)

    def _deadline(self, key: Hashable) -> int | None:
        interval = max(self._interval.get(key, 0), self._floor.get(key, 0))
        if interval == 0:  # no gap seen yet: no evidence of a rhythm, never expires
            return None
        return self._last_use[key] + int(self.expiry_factor * interval)

    def _forget_use(self, key: Hashable) -> None:
        self._last_use.pop(key, None)
        self._interval.pop(key, None)
        self._floor.pop(key, None)

    def _expire(self) -> None:
        """Move every protected key past its deadline to the oldest end of probation. Heap
        entries of keys used again since, demoted or gone are stale and dropped."""
        while self._expiries and self._expiries[0][0] < self._clock:
            deadline, _, key = heapq.heappop(self._expiries)
            if key not in self._protected or self._deadline(key) != deadline:
                continue
            self._protected.remove(key)
            self._probation.push_front(key)
            self._demoted.add(key)
            self._expired_last_use[key] = self._last_use[key]
            self._forget_use(key)

    def remove(self, key: Hashable) -> None:
        if self._probation.discard(key):
            self._demoted.discard(key)
            self._born.pop(key, None)
            self._expired_last_use.pop(key, None)
        elif self._protected.discard(key):
            self._forget_use(key)

    def victim(self, evictable: Evictable) -> Hashable | None:
        self._expire()
        key = pick_from_front(self._probation, evictable, self.scan_limit)
        if key is not None:
            self._born.pop(key, None)
            last_use = self._expired_last_use.pop(key, None)
            if last_use is not None:
                self._demoted.discard(key)
                self._remember_expired(key, last_use)
                return key
            self._ghost.push_back(key)
            if key in self._demoted:
                self._demoted.discard(key)
                self._ghost_demoted.add(key)
            while len(self._ghost) > self.ghost_capacity:
                self._ghost_demoted.discard(self._ghost.pop_front())
            return key
        key = pick_from_front(self._protected, evictable, self.scan_limit)
        if key is not None:
            self._forget_use(key)
        return key

    def _remember_expired(self, key: Hashable, last_use: int) -> None:
        """Expired keys have a memory of their own, apart from the ghost: a hot set taken
        for dead during a long scan returns after the scan's length, which has pushed it
        out of the ghost by then."""
        self._expired_ghost[key] = last_use
        while len(self._expired_ghost) > self.ghost_capacity:
            del self._expired_ghost[next(iter(self._expired_ghost))]

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected
