"""The in-process index: lifecycle, pins, leaf-only eviction, coupling with recurrent state,
and hypothesis state-machine runs over random operation sequences."""

from __future__ import annotations

import hashlib
import os

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvtier.index.base import Entry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.policy import POLICIES, make_policy
from kvtier.protocol import SaveDrop
from kvtier.slab import SlotAllocator


def key(path: tuple[int, ...]) -> bytes:
    return hashlib.blake2b(repr(path).encode(), digest_size=16).digest()


def make_index(policy: str = "lru", kv_slots: int = 6, state_slots: int = 3) -> MemoryIndex:
    alloc = SlotAllocator([kv_slots, state_slots])
    return MemoryIndex(
        [
            GroupIndexSpec(0, make_policy(policy, kv_slots), chained=True, coupled_state=1),
            GroupIndexSpec(1, make_policy(policy, state_slots), chained=False),
        ],
        alloc,
    )


def store_chain(idx: MemoryIndex, paths: list[tuple[int, ...]]) -> list[Entry]:
    out = []
    for p in paths:
        e = idx.reserve(0, key(p), key(p[:-1]) if len(p) > 1 else None)
        assert isinstance(e, Entry), e
        idx.commit(e)
        out.append(e)
    return out


def test_writing_chunks_are_invisible_until_committed() -> None:
    idx = make_index()
    e = idx.reserve(0, key((1,)), None)
    assert isinstance(e, Entry)
    assert idx.match(0, [key((1,))]) == 0
    assert idx.reserve(0, key((1,)), None) is SaveDrop.STORED
    assert idx.commit(e) and idx.match(0, [key((1,))]) == 1


def test_a_child_needs_its_parent_stored() -> None:
    idx = make_index()
    assert idx.reserve(0, key((1, 2)), key((1,))) is SaveDrop.NO_PARENT


def test_eviction_takes_leaves_only_and_never_pinned_or_writing() -> None:
    idx = make_index(kv_slots=4)
    chain = store_chain(idx, [(1,), (1, 2), (1, 2, 3)])
    idx.pin(0, [key((1,)), key((1, 2)), key((1, 2, 3))])
    other = idx.reserve(0, key((9,)), None)
    assert isinstance(other, Entry)  # the free slot
    # full now: the only ready chunks are pinned, the other is writing -> nothing may go
    assert idx.reserve(0, key((8,)), None) is SaveDrop.FULL
    idx.unpin(chain)
    e = idx.reserve(0, key((8,)), None)
    assert isinstance(e, Entry)
    assert idx.match(0, [key((1,)), key((1, 2)), key((1, 2, 3))]) == 2  # the leaf went
    idx.check_invariants()


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_a_parent_that_is_the_policys_victim_stays_and_its_leaf_goes(policy: str) -> None:
    """Deterministic: the policy's first choice is a chunk with a stored child; eviction must
    pass over it to the leaf (the state machine below finds this only by chance)."""
    def full_index() -> MemoryIndex:
        idx = make_index(policy, kv_slots=2)
        store_chain(idx, [(1,), (1, 2)])
        idx.touch(0, [key((1, 2))])  # the child is the more recent: the parent is the victim
        return idx

    twin = full_index()  # premise, on a copy (a refused victim may move in the policy's order)
    assert twin.groups[0].policy.victim(lambda _k: True) == key((1,)), \
        "premise: unconstrained, the policy evicts the parent first"
    idx = full_index()
    e = idx.reserve(0, key((5,)), None)  # full: one chunk must go
    assert isinstance(e, Entry)
    assert idx.is_ready(0, key((1,))), "the parent was evicted while its child was stored"
    assert idx.get(0, key((1, 2))) is None  # the leaf went instead
    idx.check_invariants()


def test_abort_drops_the_subtree_even_when_completions_reorder() -> None:
    idx = make_index()
    a = idx.reserve(0, key((1,)), None)
    b = idx.reserve(0, key((1, 2)), key((1,)))
    assert isinstance(a, Entry) and isinstance(b, Entry)
    idx.commit(b)  # the child's write finished first
    idx.abort(a)  # then the parent's failed: the child is an orphan and must go
    assert idx.get(0, key((1, 2))) is None and idx.get(0, key((1,))) is None
    assert idx.stats().free_slots == 6 + 3
    idx.check_invariants()


def test_reset_dooms_pinned_and_writing_entries_until_they_end() -> None:
    idx = make_index()
    (a,) = store_chain(idx, [(1,)])
    pins = idx.pin(0, [key((1,))])
    w = idx.reserve(0, key((2,)), None)
    assert isinstance(w, Entry)
    assert idx.reset() == 2
    assert idx.match(0, [key((1,))]) == 0 and idx.get(0, key((2,))) is None
    s = idx.stats()
    assert s.doomed == 2 and s.free_slots == 6 + 3 - 2
    # a new entry under the same key is independent of the doomed one
    fresh = idx.reserve(0, key((1,)), None)
    assert isinstance(fresh, Entry) and fresh is not a
    assert not idx.commit(w)  # the old write lands: freed, not made visible
    idx.unpin(pins)
    assert idx.stats().doomed == 0
    idx.commit(fresh)
    assert idx.match(0, [key((1,))]) == 1
    idx.check_invariants()


def test_recurrent_state_leaves_with_its_boundary_chunk() -> None:
    idx = make_index(kv_slots=2)
    store_chain(idx, [(1,), (1, 2)])
    st_entry = idx.reserve(1, key((1, 2)), None)
    assert isinstance(st_entry, Entry)
    idx.commit(st_entry)
    assert idx.is_ready(1, key((1, 2)))
    e = idx.reserve(0, key((5,)), None)  # evicts leaf (1,2) -> its state goes too
    assert isinstance(e, Entry)
    assert not idx.is_ready(0, key((1, 2))) and not idx.is_ready(1, key((1, 2)))
    idx.check_invariants()


def test_pin_of_a_chunk_that_is_not_ready_raises() -> None:
    idx = make_index()
    idx.reserve(0, key((1,)), None)
    with pytest.raises(KeyError, match="decide first"):
        idx.pin(0, [key((1,))])
    assert idx.stats().pinned == 0


def test_a_refused_pin_leaves_another_loads_pins_alone() -> None:
    """Two overlapping loads: the first pinned a, a/b; the second asks for a, a/b, a/b/c while
    a/b/c is still writing. Its KeyError must not release the first load's pins (it did: the
    chunks it reads became evictable), and the first load's own unpin must still balance."""
    idx = make_index(kv_slots=3)
    store_chain(idx, [(1,), (1, 2)])
    first = idx.pin(0, [key((1,)), key((1, 2))])
    writing = idx.reserve(0, key((1, 2, 3)), key((1, 2)))
    assert isinstance(writing, Entry)
    with pytest.raises(KeyError, match="decide first"):
        idx.pin(0, [key((1,)), key((1, 2)), key((1, 2, 3))])
    assert [e.pins for e in first] == [1, 1] and idx.stats().pinned == 2
    idx.abort(writing)  # frees its slot; the store is full of the first load's pinned chunks
    assert isinstance(idx.reserve(0, key((7,)), None), Entry)
    assert idx.reserve(0, key((8,)), None) is SaveDrop.FULL  # a/b is pinned, a a parent
    idx.unpin(first)
    assert idx.stats().pinned == 0
    idx.check_invariants()


def test_a_refused_pin_raises_key_error_when_nothing_else_is_pinned() -> None:
    """The refusal is a KeyError, not 'unpinned more often than pinned' from the rollback."""
    idx = make_index()
    store_chain(idx, [(1,)])
    idx.reserve(0, key((1, 2)), key((1,)))
    with pytest.raises(KeyError, match="decide first"):
        idx.pin(0, [key((1,)), key((1, 2))])
    assert idx.stats().pinned == 0
    idx.check_invariants()


class IndexMachine(RuleBasedStateMachine):
    """Random store / lookup / pin / complete / fail / evict / reset sequences."""

    writing = Bundle("writing")
    pinned = Bundle("pinned")

    def __init__(self) -> None:
        super().__init__()
        self.idx: MemoryIndex | None = None
        self.live_writes: dict[int, Entry] = {}
        self.live_pins: dict[int, list[Entry]] = {}

    @rule(policy=st.sampled_from(sorted(POLICIES)), kv=st.integers(1, 6), state=st.integers(1, 3))
    @precondition(lambda self: self.idx is None)
    def start(self, policy: str, kv: int, state: int) -> None:
        self.idx = make_index(policy, kv, state)
        self.capacity = (kv, state)

    @rule(target=writing, path=st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple))
    @precondition(lambda self: self.idx is not None)
    def reserve(self, path: tuple[int, ...]) -> object:
        assert self.idx is not None
        parent = key(path[:-1]) if len(path) > 1 else None
        e = self.idx.reserve(0, key(path), parent)
        if isinstance(e, Entry):
            self.live_writes[id(e)] = e
            return multiple(e)
        return multiple()

    @rule(target=writing, path=st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple))
    @precondition(lambda self: self.idx is not None)
    def reserve_state(self, path: tuple[int, ...]) -> object:
        assert self.idx is not None
        if not self.idx.is_ready(0, key(path)):
            return multiple()
        e = self.idx.reserve(1, key(path), None)
        if isinstance(e, Entry):
            self.live_writes[id(e)] = e
            return multiple(e)
        return multiple()

    @rule(e=consumes(writing))
    def commit(self, e: Entry) -> None:
        assert self.idx is not None
        self.live_writes.pop(id(e), None)
        self.idx.commit(e)

    @rule(e=consumes(writing))
    def fail(self, e: Entry) -> None:
        assert self.idx is not None
        self.live_writes.pop(id(e), None)
        self.idx.abort(e)

    @rule(target=pinned, path=st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple))
    @precondition(lambda self: self.idx is not None)
    def lookup_and_pin(self, path: tuple[int, ...]) -> object:
        assert self.idx is not None
        keys = [key(path[: i + 1]) for i in range(len(path))]
        n = self.idx.match(0, keys)
        if n == 0:
            return multiple()
        self.idx.touch(0, keys[:n])
        entries = self.idx.pin(0, keys[:n])
        self.live_pins[id(entries)] = entries
        return multiple(entries)

    @rule(entries=consumes(pinned))
    def load_complete(self, entries: list[Entry]) -> None:
        assert self.idx is not None
        self.live_pins.pop(id(entries), None)
        self.idx.unpin(entries)

    @rule()
    @precondition(lambda self: self.idx is not None)
    def reset(self) -> None:
        assert self.idx is not None
        self.idx.reset()

    @invariant()
    def consistent(self) -> None:
        if self.idx is None:
            return
        self.idx.check_invariants()
        for g, cap in enumerate(self.capacity):
            assert self.idx.allocator.num_free(g) <= cap
        # pinned or writing chunks are never evicted: each is live, or doomed with its slot held
        held = [e for es in self.live_pins.values() for e in es] + list(self.live_writes.values())
        for e in held:
            live = self.idx.get(e.group, e.key) is e
            assert live or e in self.idx._doomed, f"{e} was evicted while pinned or writing"

    def teardown(self) -> None:
        if self.idx is None:
            return
        # drain whatever is still in flight through the bundles' leftovers: the index must
        # return to zero once every write and pin ends
        idx = self.idx
        for es in idx._entries:
            for e in list(es.values()):
                if not e.ready:
                    idx.abort(e) if e.parent is None or e.parent.ready else None
        pinned = [e for es in idx._entries for e in es.values() if e.pins] + [
            e for e in idx._doomed if e.pins
        ]
        for e in pinned:
            idx.unpin([e] * e.pins)
        for e in list(idx._doomed):
            if not e.ready:
                idx.commit(e)
        idx.reset()
        for es in idx._entries:
            for e in list(es.values()):
                idx.abort(e) if not e.ready else None
        idx.reset()
        s = idx.stats()
        assert s.stored == 0 and s.writing == 0 and s.pinned == 0 and s.doomed == 0, s
        assert s.free_slots == sum(self.capacity)


IndexMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=60, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestIndexStateMachine = IndexMachine.TestCase


def test_property_runs_are_derandomized_outside_soak() -> None:
    """tests/conftest.py's profile: the same examples every CI run, random ones in soak."""
    soak = os.environ.get("KVTIER_SOAK") == "1"
    assert settings.default.derandomize is not soak
    assert IndexMachine.TestCase.settings.derandomize is not soak
