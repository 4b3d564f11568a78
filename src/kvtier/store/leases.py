"""What one client holds in its namespace's index: writes, lookup leases and load pins.

Contract (docs/design.md §2.7, issue 18; the seed's crash was a read lease that expired
under a long load):

- A lookup (``match``/``is_ready`` that finds a chunk ready) takes a *lease*: one index pin
  with a deadline ``ttl`` seconds away; looking the chunk up again moves the deadline. A
  lease keeps the chunk from eviction by every engine of the namespace between the lookup
  and the load that the engine decides on it.
- A load's ``pin`` takes a *hard pin* first and then drops the lease: the chunk is never
  unprotected in between, and a hard pin has no deadline: it ends only with ``unpin`` or
  with the client's connection. So nothing under an active load ever expires.
- :meth:`expire` drops leases past their deadline (never a hard pin).
- :meth:`release_all` (the connection closed: the engine exited or was killed) aborts its
  writes and drops its leases and pins, so a dead engine leaks no slot and no pin.

Handles: every write or pin the client holds has an int handle, valid while held.
"""

from __future__ import annotations

import itertools
from collections import Counter

from kvtier.index.base import Entry
from kvtier.index.memory import MemoryIndex

LeaseKey = tuple[int, bytes]


class ClientHolds:
    def __init__(self, index: MemoryIndex) -> None:
        self.index = index
        self._ids = itertools.count(1)
        self.handles: dict[int, Entry] = {}
        self._handle_of: dict[int, int] = {}  # id(entry) -> handle
        self.writes: set[int] = set()
        self.pins: Counter[int] = Counter()
        self.leases: dict[LeaseKey, tuple[Entry, float]] = {}

    def handle(self, e: Entry) -> int:
        h = self._handle_of.get(id(e))
        if h is None:
            h = next(self._ids)
            self.handles[h] = e
            self._handle_of[id(e)] = h
        return h

    def _forget_if_unheld(self, h: int) -> None:
        if h not in self.writes and not self.pins[h]:
            self.pins.pop(h, None)
            e = self.handles.pop(h)
            del self._handle_of[id(e)]

    # -- leases -----------------------------------------------------------------------------
    def lease(self, e: Entry, deadline: float) -> None:
        key = (e.group, e.key)
        held = self.leases.get(key)
        if held is not None and held[0] is e:
            self.leases[key] = (e, deadline)
            return
        self.index.pin(e.group, [e.key])
        if held is not None:  # the key was re-created: the old entry's lease ends
            self.index.unpin([held[0]])
        self.leases[key] = (e, deadline)

    def expire(self, now: float) -> int:
        gone = [k for k, (_, t) in self.leases.items() if t <= now]
        for k in gone:
            self.index.unpin([self.leases.pop(k)[0]])
        return len(gone)

    # -- writes and pins --------------------------------------------------------------------
    def add_write(self, e: Entry) -> int:
        h = self.handle(e)
        self.writes.add(h)
        return h

    def end_write(self, h: int) -> Entry:
        e = self.handles[h]
        self.writes.discard(h)
        self._forget_if_unheld(h)
        return e

    def pin(self, group: int, keys: list[bytes]) -> list[tuple[int, int]]:
        """Hard pins on ready chunks (KeyError if one is not), then their leases end."""
        entries = self.index.pin(group, keys)
        out = []
        for e in entries:
            h = self.handle(e)
            self.pins[h] += 1
            out.append((h, e.slot))
            held = self.leases.pop((e.group, e.key), None)
            if held is not None:
                self.index.unpin([held[0]])
        return out

    def unpin(self, handles: list[int]) -> None:
        for h in handles:
            if not self.pins[h]:
                raise ValueError(f"handle {h} unpinned more often than pinned")
            self.pins[h] -= 1
            self.index.unpin([self.handles[h]])
            self._forget_if_unheld(h)

    def release_all(self) -> tuple[int, int, int]:
        """Abort writes, drop pins and leases; returns (writes, pins, leases) released."""
        writes, pins, leases = len(self.writes), sum(self.pins.values()), len(self.leases)
        for h in list(self.writes):
            e = self.end_write(h)
            if not e.ready or e.doomed:
                self.index.abort(e)
        for h, n in list(self.pins.items()):
            for _ in range(n):
                self.unpin([h])
        for e, _ in self.leases.values():
            self.index.unpin([e])
        self.leases.clear()
        return writes, pins, leases
