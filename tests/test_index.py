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


def make_index(policy: str = "lru", kv_slots: int = 6, state_slots: int = 3,
               state_groups: int = 1) -> MemoryIndex:
    """Group 0: full attention (slot class 0); groups 1..state_groups: recurrent state, all
    in slot class 1, as the scheduler lays out a hybrid model."""
    alloc = SlotAllocator([kv_slots, state_slots])
    states = [GroupIndexSpec(1, make_policy(policy, state_slots), chained=False,
                             boundary_state=True) for _ in range(state_groups)]
    return MemoryIndex([GroupIndexSpec(0, make_policy(policy, kv_slots)), *states], alloc)


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


STATES = (1, 2, 3)  # a 4-layer Qwen3-Next on vLLM 0.32: three state groups, one attention


def save_boundary(idx: MemoryIndex, path: tuple[int, ...], with_state: bool = True,
                  commit: bool = True) -> list[Entry] | SaveDrop:
    """Save one chunk as the scheduler does: one job, its state objects first (vLLM lists the
    state groups first), then the chunk; a refusal aborts what the job reserved."""
    k = key(path)
    parent = key(path[:-1]) if len(path) > 1 else None
    groups = [g for g in (*STATES, 0) if (with_state or g == 0) and idx.get(g, k) is None]
    job: list[Entry] = []
    for g in groups:
        e = idx.reserve(g, k, parent if g == 0 else None)
        if not isinstance(e, Entry):
            for done in job:
                idx.abort(done)
            return e
        job.append(e)
    if commit:
        for e in job:
            idx.commit(e)
    return job


def assert_boundaries_whole(idx: MemoryIndex) -> None:
    """Every stored state object has its chunk and all its siblings; every stored chunk has
    all of its boundary's states or none."""
    chunks = set(idx._entries[0])
    per_group = [set(idx._entries[g]) for g in STATES]
    with_state = set().union(*per_group)
    assert with_state <= chunks, f"{len(with_state - chunks)} state objects without their chunk"
    for keys in per_group:
        assert keys == with_state, "a boundary is missing some of its state objects"


def test_a_store_past_capacity_keeps_every_boundary_whole() -> None:
    """Issue 12 item 3. Three state groups in one slot class (7 slots: two whole sets and one
    spare) and four attention slots: chunk evictions and state-class pressure both happen.
    Before the fix only the first state group left with its chunk: orphans and incomplete
    boundaries from the fifth save on."""
    idx = make_index(kv_slots=4, state_slots=7, state_groups=3)
    stored_sets = 0
    for root in range(6):
        for path in [(root,), (root, 1), (root, 1, 2)]:
            job = save_boundary(idx, path)
            assert isinstance(job, list), (path, job)
            idx.check_invariants()
            assert_boundaries_whole(idx)
            stored_sets += 1
            assert all(idx.is_ready(g, key(path)) for g in (0, *STATES)), "the newest is whole"
    assert stored_sets == 18 and idx.evictions > 0
    whole = len(idx._entries[STATES[0]])
    assert whole == 2  # 7 slots hold two sets of three; the spare is never a partial set
    assert idx.allocator.num_free(1) == 1


def test_state_pressure_evicts_the_whole_least_recent_set_and_keeps_its_chunk() -> None:
    idx = make_index(kv_slots=8, state_slots=7, state_groups=3)
    for path in [(1,), (2,)]:
        assert isinstance(save_boundary(idx, path), list)
    idx.touch(0, [key((2,))])
    for g in STATES:
        idx.touch(g, [key((2,))])  # (1,) is now every state policy's victim
    assert isinstance(save_boundary(idx, (3,)), list)  # 1 free slot, 3 needed: one set goes
    assert all(idx.get(g, key((1,))) is None for g in STATES)
    assert idx.is_ready(0, key((1,))), "the chunk stays: only its states made room"
    assert all(idx.is_ready(g, key(p)) for g in STATES for p in [(2,), (3,)])
    assert idx.allocator.num_free(1) == 1
    idx.check_invariants()


def test_an_incomplete_state_set_is_never_committed() -> None:
    idx = make_index(state_groups=3)
    store_chain(idx, [(1,)])
    k = key((1,))
    part = [idx.reserve(g, k, None) for g in STATES[:2]]  # the third was never reserved
    assert all(isinstance(e, Entry) for e in part)
    assert not idx.commit(part[0])  # type: ignore[arg-type]
    assert idx.get(STATES[1], k) is None  # its sibling went with it: a doomed write
    assert not idx.commit(part[1])  # type: ignore[arg-type]
    assert idx.stats().free_slots == 6 - 1 + 3 and idx.stats().doomed == 0
    # nor without its chunk: a state set of a boundary whose chunk is not stored
    orphan = [idx.reserve(g, key((9,)), None) for g in STATES]
    assert [idx.commit(e) for e in orphan] == [False] * 3  # type: ignore[arg-type]
    assert idx.stats().free_slots == 6 - 1 + 3
    idx.check_invariants()


def test_a_failed_member_takes_its_whole_set_and_a_partial_set_is_a_miss() -> None:
    idx = make_index(state_groups=3)
    job = save_boundary(idx, (1,), commit=False)
    assert isinstance(job, list)
    s1, s2, s3, chunk = job
    idx.commit(s1)
    idx.commit(s2)
    assert not idx.is_ready(STATES[0], key((1,))), "two of three states: a miss"
    assert idx.match(STATES[0], [key((1,))]) == 0
    with pytest.raises(KeyError, match="decide first"):
        idx.pin(STATES[0], [key((1,))])
    idx.abort(s3)  # one member's write failed: the set goes, the chunk stays
    assert all(idx.get(g, key((1,))) is None for g in STATES)
    assert idx.commit(chunk) and idx.is_ready(0, key((1,)))
    assert idx.stats().free_slots == 6 - 1 + 3
    idx.check_invariants()


def test_a_pinned_state_set_stays_whole_until_its_load_ends() -> None:
    idx = make_index(kv_slots=1, state_slots=6, state_groups=3)
    assert isinstance(save_boundary(idx, (1,)), list)
    pins = idx.pin(0, [key((1,))])
    for g in STATES:
        pins += idx.pin(g, [key((1,))])
    assert isinstance(save_boundary(idx, (2,), with_state=False), SaveDrop)  # chunk pinned
    idx.unpin(pins[:1])  # the chunk's load part ended first; its states are still read
    assert isinstance(save_boundary(idx, (2,), with_state=False), list)  # evicts chunk (1,)
    assert all(idx.get(g, key((1,))) is None for g in STATES)  # gone for lookups at once
    assert idx.stats().doomed == 3 and idx.allocator.num_free(1) == 3  # slots still read
    idx.unpin(pins[1:])
    assert idx.stats().doomed == 0 and idx.allocator.num_free(1) == 6
    idx.check_invariants()


def test_pressure_never_takes_a_set_with_one_pinned_member() -> None:
    idx = make_index(kv_slots=4, state_slots=3, state_groups=3)
    assert isinstance(save_boundary(idx, (1,)), list)
    pins = idx.pin(STATES[1], [key((1,))])
    assert save_boundary(idx, (2,)) is SaveDrop.FULL
    assert all(idx.is_ready(g, key((1,))) for g in STATES)
    idx.unpin(pins)
    assert isinstance(save_boundary(idx, (2,)), list)
    assert idx.get(STATES[0], key((1,))) is None
    idx.check_invariants()


def test_reset_counts_every_entry_it_drops() -> None:
    idx = make_index(state_groups=3)
    assert isinstance(save_boundary(idx, (1,)), list)
    assert idx.reset() == 4
    assert idx.stats().free_slots == 6 + 3


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


PATHS = st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple)


class IndexMachine(RuleBasedStateMachine):
    """Random store / lookup / pin / complete / fail / evict / reset sequences, with one to
    three recurrent-state groups sharing a slot class. A write is a job (a list of entries)
    that commits or fails whole, as the scheduler's save jobs do."""

    writing = Bundle("writing")
    pinned = Bundle("pinned")

    def __init__(self) -> None:
        super().__init__()
        self.idx: MemoryIndex | None = None
        self.live_writes: dict[int, list[Entry]] = {}
        self.live_pins: dict[int, list[Entry]] = {}

    @rule(policy=st.sampled_from(sorted(POLICIES)), kv=st.integers(1, 6), state=st.integers(1, 7),
          state_groups=st.integers(1, 3))
    @precondition(lambda self: self.idx is None)
    def start(self, policy: str, kv: int, state: int, state_groups: int) -> None:
        self.idx = make_index(policy, kv, state, state_groups)
        self.capacity = (kv, state)
        self.states = tuple(range(1, state_groups + 1))

    def _job(self, job: list[Entry]) -> object:
        if not job:
            return multiple()
        self.live_writes[id(job)] = job
        return multiple(job)

    @rule(target=writing, path=PATHS)
    @precondition(lambda self: self.idx is not None)
    def reserve(self, path: tuple[int, ...]) -> object:
        assert self.idx is not None
        parent = key(path[:-1]) if len(path) > 1 else None
        e = self.idx.reserve(0, key(path), parent)
        return self._job([e] if isinstance(e, Entry) else [])

    @rule(target=writing, path=PATHS, members=st.one_of(st.just(3), st.integers(0, 2)))
    @precondition(lambda self: self.idx is not None)
    def save_request(self, path: tuple[int, ...], members: int) -> object:
        """A request that saves every chunk of ``path`` with its boundary's states (a step
        ended at every boundary); the last job stays in flight. ``members`` below the number
        of state groups plays a caller that reserves only part of a set (the index drops it)."""
        assert self.idx is not None
        for n in range(1, len(path)):
            job = self._save(path[:n], members)
            for e in job or ():
                self.idx.commit(e)
            if job is None:
                return multiple()  # the scheduler drops the chunks after a refused one
        return self._job(self._save(path, members) or [])

    def _save(self, path: tuple[int, ...], members: int) -> list[Entry] | None:
        """One save job, states first as vLLM lists them; None if refused (nothing held)."""
        assert self.idx is not None
        k = key(path)
        parent = key(path[:-1]) if len(path) > 1 else None
        groups = [g for g in (*self.states[:members], 0) if self.idx.get(g, k) is None]
        job: list[Entry] = []
        for g in groups:
            e = self.idx.reserve(g, k, parent if g == 0 else None)
            if not isinstance(e, Entry):
                for done in job:
                    self.idx.abort(done)
                return None
            job.append(e)
        return job

    @rule(job=consumes(writing))
    def commit(self, job: list[Entry]) -> None:
        assert self.idx is not None
        self.live_writes.pop(id(job), None)
        for e in job:
            self.idx.commit(e)

    @rule(job=consumes(writing))
    def fail(self, job: list[Entry]) -> None:
        assert self.idx is not None
        self.live_writes.pop(id(job), None)
        for e in job:
            self.idx.abort(e)

    @rule(target=pinned, path=PATHS)
    @precondition(lambda self: self.idx is not None)
    def lookup_and_pin(self, path: tuple[int, ...]) -> object:
        """Pin the longest stored prefix, and its boundary's state set where it is whole."""
        assert self.idx is not None
        keys = [key(path[: i + 1]) for i in range(len(path))]
        n = self.idx.match(0, keys)
        if n == 0:
            return multiple()
        self.idx.touch(0, keys[:n])
        entries = self.idx.pin(0, keys[:n])
        boundary = keys[n - 1]
        if all(self.idx.is_ready(g, boundary) for g in self.states):
            for g in self.states:
                entries += self.idx.pin(g, [boundary])
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
        self.idx.check_invariants()  # includes: every ready state set whole, with its chunk
        for g, cap in enumerate(self.capacity):
            assert self.idx.allocator.num_free(g) <= cap
        # pinned or writing chunks are never evicted: each is live, or doomed with its slot held
        held = [e for es in self.live_pins.values() for e in es] + [
            e for job in self.live_writes.values() for e in job]
        for e in held:
            live = self.idx.get(e.group, e.key) is e
            assert live or e in self.idx._doomed, f"{e} was evicted while pinned or writing"
        # a state set is visible whole or not at all, in every one of its groups alike
        for k in set().union(*(self.idx._entries[g] for g in self.states)):
            assert len({self.idx.is_ready(g, k) for g in self.states}) == 1

    def teardown(self) -> None:
        if self.idx is None:
            return
        # end every write and pin still in flight: the index must return to zero
        idx = self.idx
        for job in self.live_writes.values():
            for e in job:
                idx.abort(e)
        for entries in self.live_pins.values():
            idx.unpin(entries)
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
