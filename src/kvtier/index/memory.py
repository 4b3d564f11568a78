"""The in-process index: plain dicts in the scheduler process, answered at once."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvtier.index.base import Entry, Index, IndexStats
from kvtier.policy.base import EvictionPolicy
from kvtier.protocol import SaveDrop
from kvtier.slab import SlotAllocator


@dataclass
class GroupIndexSpec:
    """How one group's chunks are kept.

    ``chained``: a chunk is useful only with all its ancestors (full attention): a child needs
    its parent stored, and only leaves may leave. Otherwise chunks are independent (sliding
    window, recurrent state).

    ``boundary_state``: this group's object under a key is one of the recurrent states of the
    boundary that key ends (one per state group). The objects of every boundary-state group
    under one key are one unit, the boundary's *state set*: visible, pinnable and evictable
    only whole, committed only with every member and every chained group's chunk of that key
    stored, and gone, every member, as soon as one member or one of those chunks leaves.
    """

    slot_class: int
    policy: EvictionPolicy
    chained: bool = True
    boundary_state: bool = False


class MemoryIndex(Index):
    def __init__(self, groups: Sequence[GroupIndexSpec], allocator: SlotAllocator,
                 on_free: Callable[[int, bytes], None] | None = None) -> None:
        self.groups = list(groups)
        self.allocator = allocator
        self.on_free = on_free  # (group, key) of every entry whose slot is freed
        self._entries: list[dict[bytes, Entry]] = [{} for _ in self.groups]
        self._doomed: set[Entry] = set()
        self._pinned_entries = 0
        self.evictions = 0
        self._state_groups = tuple(g for g, s in enumerate(self.groups) if s.boundary_state)
        self._chunk_groups = tuple(g for g, s in enumerate(self.groups) if s.chained)
        if set(self._state_groups) & set(self._chunk_groups):
            raise ValueError("a boundary-state group cannot be chained")

    # -- lookups --------------------------------------------------------------------------
    def match(self, group: int, keys: Sequence[bytes]) -> int:
        state = self.groups[group].boundary_state
        entries = self._entries[group]
        n = 0
        for k in keys:
            e = entries.get(k)
            if e is None or not e.ready or (state and not self.is_ready(group, k)):
                break
            n += 1
        return n

    def is_ready(self, group: int, key: bytes) -> bool:
        """Ready; for a boundary-state group, only with every member of its state set ready
        (a boundary missing one of its states is a miss, never a partial restore)."""
        if self.groups[group].boundary_state:
            return all(self._ready(s, key) for s in self._state_groups)
        return self._ready(group, key)

    def _ready(self, group: int, key: bytes) -> bool:
        e = self._entries[group].get(key)
        return e is not None and e.ready

    def get(self, group: int, key: bytes) -> Entry | None:
        return self._entries[group].get(key)

    # -- writes ---------------------------------------------------------------------------
    def reserve(self, group: int, key: bytes, parent_key: bytes | None) -> Entry | SaveDrop:
        spec = self.groups[group]
        entries = self._entries[group]
        if key in entries:
            return SaveDrop.STORED
        parent = None
        if spec.chained and parent_key is not None:
            parent = entries.get(parent_key)
            if parent is None:
                return SaveDrop.NO_PARENT
        slot = self.allocator.allocate(spec.slot_class)
        if slot is None and self._evict_one(group, protect=parent):
            slot = self.allocator.allocate(spec.slot_class)
        if slot is None:
            return SaveDrop.FULL
        entry = Entry(group, key, slot, parent)
        entries[key] = entry
        if parent is not None:
            if parent.children is None:
                parent.children = []
            parent.children.append(entry)
        return entry

    def commit(self, entry: Entry) -> bool:
        if entry.doomed:
            self._release_doomed(entry, write_ended=True)
            return False
        if entry.ready:
            raise ValueError(f"{entry} committed twice")
        entry.ready = True
        if self.groups[entry.group].boundary_state and not self._state_set_whole(entry.key):
            self._remove(entry)  # an incomplete state set is never stored: drop what was written
            return False
        parent = entry.parent.key if entry.parent is not None else None
        self.groups[entry.group].policy.insert(entry.key, parent)
        return True

    def abort(self, entry: Entry) -> None:
        if entry.doomed:
            self._release_doomed(entry, write_ended=True)
            return
        if entry.ready:
            raise ValueError(f"{entry} is ready; abort is for writes")
        entry.ready = True  # its write is over; what remains is to drop it and its subtree
        self._drop_subtree(entry)

    def discard(self, entry: Entry) -> None:
        if entry.doomed or self._entries[entry.group].get(entry.key) is not entry:
            return
        if not entry.ready:
            raise ValueError(f"{entry} is being written; abort is for writes")
        self._drop_subtree(entry)

    # -- pins and hits --------------------------------------------------------------------
    def pin(self, group: int, keys: Sequence[bytes]) -> list[Entry]:
        # check every key before taking any pin: a refusal leaves every pin as it was, and
        # never releases a pin that another load holds on the same chunks
        entries = self._entries[group]
        pinned = []
        for k in keys:
            e = entries.get(k)
            if e is None or not self.is_ready(group, k):
                raise KeyError(f"chunk {k.hex()[:8]} of group {group} is not ready; decide first")
            pinned.append(e)
        for e in pinned:
            if e.pins == 0:
                self._pinned_entries += 1
            e.pins += 1
        return pinned

    def unpin(self, entries: Sequence[Entry]) -> None:
        for e in entries:
            if e.pins <= 0:
                raise ValueError(f"{e} unpinned more often than pinned")
            e.pins -= 1
            if e.pins == 0:
                self._pinned_entries -= 1
                if e.doomed:
                    self._release_doomed(e, write_ended=False)

    def touch(self, group: int, keys: Sequence[bytes]) -> None:
        policy = self.groups[group].policy
        entries = self._entries[group]
        for k in reversed(keys):
            e = entries.get(k)
            if e is not None and e.ready and not e.leaving:
                policy.touch(k)

    # -- leaving for a lower tier ---------------------------------------------------------
    def begin_leave(self, group: int) -> Entry | None:
        """The chunk eviction would take next in ``group``, held for a copy to a lower tier:
        it leaves the policy (no eviction takes it twice) and gets a pin (its slot is not
        reused, a reset dooms it without freeing the slot), but stays READY and visible, so
        hits still load it. None if nothing may leave. End with :meth:`end_leave`."""
        key = self.groups[group].policy.victim(lambda k: self._evictable(group, k))
        if key is None:
            return None
        e = self._entries[group][key]  # type: ignore[index]
        e.leaving = True
        self.pin(group, [e.key])
        return e

    def end_leave(self, entry: Entry) -> bool:
        """The copy ended (or was not needed): the chunk leaves and its slot is freed, unless a
        load pinned it or a child was stored under it meanwhile (then it stays, back in the
        policy). Returns whether it left."""
        entry.leaving = False
        self.unpin([entry])
        if entry.doomed:
            return True
        if entry.pins or entry.children:
            parent = entry.parent.key if entry.parent is not None else None
            self.groups[entry.group].policy.insert(entry.key, parent)
            return False
        self._remove(entry)
        self.evictions += 1
        return True

    # -- removal --------------------------------------------------------------------------
    def _evictable(self, group: int, key: object) -> bool:
        e = self._entries[group].get(key)  # type: ignore[arg-type]
        if e is None or not e.ready or e.pins:
            return False
        spec = self.groups[group]
        if spec.boundary_state:  # a state set leaves whole: every member ready and unpinned
            return all(self._ready(s, e.key) and not self._entries[s][e.key].pins
                       for s in self._state_groups)
        return not (spec.chained and e.children)

    def _evict_one(self, group: int, protect: Entry | None = None) -> bool:
        def ok(key: object) -> bool:
            return (protect is None or key != protect.key) and self._evictable(group, key)

        key = self.groups[group].policy.victim(ok)
        if key is None:
            return False
        self._remove(self._entries[group][key])  # type: ignore[index]
        self.evictions += 1
        return True

    def _remove(self, e: Entry) -> None:
        """Forget a ready, unpinned entry with no stored children and free its slot."""
        spec = self.groups[e.group]
        del self._entries[e.group][e.key]
        spec.policy.remove(e.key)
        self._detach(e)
        self.allocator.free(spec.slot_class, e.slot)
        if self.on_free is not None:
            self.on_free(e.group, e.key)
        if spec.chained or spec.boundary_state:
            self._drop_state_set(e.key)

    def _state_set_whole(self, key: bytes) -> bool:
        """Every member of ``key``'s state set and every chained chunk of ``key`` is stored
        (ready or writing): the set may become visible once its writes end."""
        return all(key in self._entries[g] for g in self._state_groups + self._chunk_groups)

    def _drop_state_set(self, key: bytes) -> None:
        """A member of ``key``'s state set or its boundary chunk left: every member goes.

        Callers remove their own entry from the dicts first, so the recursion through
        :meth:`_remove` and :meth:`_doom` ends once the set is empty.
        """
        for g in self._state_groups:
            s = self._entries[g].get(key)
            if s is None:
                continue
            if s.ready and not s.pins:
                self._remove(s)
            else:
                self._doom(s)

    def _detach(self, e: Entry) -> None:
        p = e.parent
        if p is not None and p.children is not None:
            p.children.remove(e)
            if not p.children:
                p.children = None
        e.parent = None

    def _drop_subtree(self, root: Entry) -> None:
        """Drop ``root`` and every stored descendant: none is useful without it."""
        stack = [root]
        order = []
        while stack:
            e = stack.pop()
            order.append(e)
            stack.extend(e.children or ())
        for e in reversed(order):  # leaves first
            if e.ready and not e.pins:
                self._remove(e)
            else:
                self._doom(e)

    def _doom(self, e: Entry) -> None:
        """Make ``e`` invisible now; free its slot when its last pin or write ends."""
        spec = self.groups[e.group]
        if self._entries[e.group].get(e.key) is e:
            del self._entries[e.group][e.key]
        spec.policy.remove(e.key)
        for c in list(e.children or ()):
            self._detach(c)
        self._detach(e)
        e.doomed = True
        self._doomed.add(e)
        if spec.chained or spec.boundary_state:
            self._drop_state_set(e.key)
        if e.ready and not e.pins:
            self._release_doomed(e, write_ended=False)

    def _release_doomed(self, e: Entry, write_ended: bool) -> None:
        if write_ended:
            e.ready = True  # the write is over either way; what remains is the pins
        if e.pins or not e.ready or e not in self._doomed:
            return
        self._doomed.discard(e)
        self.allocator.free(self.groups[e.group].slot_class, e.slot)
        if self.on_free is not None:
            self.on_free(e.group, e.key)

    def reset(self) -> int:
        dropped = sum(len(es) for es in self._entries)  # counted first: dooms cascade
        for group in range(len(self.groups)):
            for e in list(self._entries[group].values()):
                if self._entries[group].get(e.key) is e:
                    self._doom(e)
        return dropped

    # -- accounting -----------------------------------------------------------------------
    def stats(self) -> IndexStats:
        stored = sum(1 for es in self._entries for e in es.values() if e.ready)
        writing = sum(1 for es in self._entries for e in es.values() if not e.ready)
        # state groups share one slot class: count each class once
        free = sum(self.allocator.num_free(c) for c in {g.slot_class for g in self.groups})
        return IndexStats(stored=stored, writing=writing, pinned=self._pinned_entries,
                          doomed=len(self._doomed), evictions=self.evictions, free_slots=free)

    def num_stored(self, group: int) -> int:
        return len(self._entries[group])

    def check_invariants(self) -> None:
        """Raise AssertionError if the index is inconsistent (for tests and soak runs)."""
        used: dict[int, set[int]] = {}
        for g, es in enumerate(self._entries):
            spec = self.groups[g]
            cls = used.setdefault(spec.slot_class, set())
            for key, e in es.items():
                assert e.key == key and e.group == g and not e.doomed, e
                assert e.slot not in cls, f"slot {e.slot} of class {spec.slot_class} used twice"
                cls.add(e.slot)
                if spec.chained and e.parent is not None:
                    assert es.get(e.parent.key) is e.parent, f"{e} is an orphan"
                    assert e in (e.parent.children or []), f"{e} missing from its parent"
                assert not e.pins or e.ready, f"{e} pinned while writing"
                assert (e.key in spec.policy) == (e.ready and not e.leaving), \
                    f"{e} policy membership wrong"
        for e in self._doomed:
            cls = used.setdefault(self.groups[e.group].slot_class, set())
            assert e.slot not in cls, f"doomed {e} shares a slot"
            cls.add(e.slot)
        for spec in self.groups:
            n_used = len(used.get(spec.slot_class, ()))
            total = self.allocator.num_slots(spec.slot_class)
            assert n_used + self.allocator.num_free(spec.slot_class) == total, (
                f"class {spec.slot_class}: {n_used} used + "
                f"{self.allocator.num_free(spec.slot_class)} free != {total}"
            )
            assert len(spec.policy) <= total
        self._check_state_sets()
        pinned = sum(1 for es in self._entries for e in es.values() if e.pins) + sum(
            1 for e in self._doomed if e.pins)
        assert pinned == self._pinned_entries, (pinned, self._pinned_entries)

    def _check_state_sets(self) -> None:
        """A ready or pinned state object has every member of its set and its chunk stored."""
        keys = set().union(*(self._entries[g] for g in self._state_groups))
        for key in keys:
            members = [self._entries[g].get(key) for g in self._state_groups]
            if not any(m is not None and m.ready for m in members):
                continue  # writes in flight: the set is judged when they commit
            assert all(m is not None for m in members), f"state set {key.hex()[:8]} incomplete"
            for g in self._chunk_groups:
                assert key in self._entries[g], f"state set {key.hex()[:8]} without chunk g{g}"
            if any(m is not None and m.pins for m in members):
                assert all(m is not None and m.ready for m in members), \
                    f"state set {key.hex()[:8]} pinned while not whole"
