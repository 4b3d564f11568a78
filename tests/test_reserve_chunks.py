"""``Index.reserve_chunks``: a request's saves of one step reserved at once, with the same
answers from the in-process index and from the node-wide store's (one round trip, the store's
``reserve_chunks`` op), both real: chunk order, a refused group aborts its chunk's others, a
FULL ends the answer and nothing past it is reserved, and a store that is gone answers FULL."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _store import StoreProcess
from kvtier.index.base import ChunkReserve, Entry, Index
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.policy import make_policy
from kvtier.protocol import SaveDrop
from kvtier.slab import SlotAllocator
from kvtier.store.client import StoreClient
from kvtier.store.index import StoreIndex

# class 0: 4 slots for group 0 (chained) and group 1; class 1: 1 slot for group 2
SLOTS = [4, 1]
GROUPS = [[0, True, False], [0, False, False], [1, False, False]]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StoreProcess]:
    s = StoreProcess(tmp_path_factory.mktemp("reserve")).start()
    yield s
    s.stop()


def _memory_index() -> MemoryIndex:
    return MemoryIndex([GroupIndexSpec(int(c), make_policy("lru", SLOTS[int(c)]), chained=ch,
                                       boundary_state=b) for c, ch, b in GROUPS],
                       SlotAllocator(SLOTS))


@pytest.fixture(params=["memory", "store"])
def index(request: pytest.FixtureRequest) -> Iterator[Index]:
    if request.param == "memory":
        yield _memory_index()
        return
    store: StoreProcess = request.getfixturevalue("store")
    spec = {"namespace": os.urandom(16), "arena_bytes": 2**20, "slots": SLOTS,
            "groups": GROUPS}
    idx = StoreIndex(StoreClient(store.url), spec)
    assert idx.up
    yield idx
    idx.client.close()


def _writing(index: Index) -> int:
    return index.stats().writing


def _shape(answer: list[Any]) -> list[Any]:
    return [got if isinstance(got, SaveDrop) else [(e.group, e.key) for e in got]
            for got in answer]


def test_chunks_are_reserved_in_order_a_child_after_its_parent(index: Index) -> None:
    got = index.reserve_chunks([ChunkReserve(b"a", None, [0, 1]),
                                ChunkReserve(b"ab", b"a", [0, 1])])
    assert _shape(got) == [[(0, b"a"), (1, b"a")], [(0, b"ab"), (1, b"ab")]]
    slots = [e.slot for chunk in got for e in chunk]  # type: ignore[union-attr]
    assert len(set(slots)) == 4 and _writing(index) == 4
    for chunk in got:
        for e in chunk:  # type: ignore[union-attr]
            assert index.commit(e)
    assert index.match(0, [b"a", b"ab"]) == 2


def test_a_refused_group_aborts_its_chunks_earlier_groups_and_the_next_chunk_goes_on(
        index: Index) -> None:
    (pre,) = index.reserve_chunks([ChunkReserve(b"s", None, [1])])
    assert isinstance(pre, list)
    index.commit(pre[0])
    got = index.reserve_chunks([ChunkReserve(b"s", None, [0, 1]),  # group 1 is stored
                                ChunkReserve(b"n", b"s", [0]),  # so no parent in group 0
                                ChunkReserve(b"t", None, [0])])
    assert _shape(got) == [SaveDrop.STORED, SaveDrop.NO_PARENT, [(0, b"t")]]
    assert index.get(0, b"s") is None  # aborted with its chunk
    assert _writing(index) == 1


def test_a_full_ends_the_answer_and_nothing_past_it_is_reserved(index: Index) -> None:
    got = index.reserve_chunks([ChunkReserve(b"x", None, [2]),
                                ChunkReserve(b"y", None, [2]),  # class 1 is full: FULL
                                ChunkReserve(b"z", None, [0])])  # would fit: never asked
    assert _shape(got) == [[(2, b"x")], SaveDrop.FULL]
    assert index.get(0, b"z") is None and _writing(index) == 1
    # a chunk whose later group is FULL: its earlier group's entry is aborted too
    assert _shape(index.reserve_chunks([ChunkReserve(b"w", None, [0, 2])])) == [SaveDrop.FULL]
    assert index.get(0, b"w") is None and _writing(index) == 1
    index.abort(got[0][0])  # type: ignore[index]
    index.check_invariants()


def test_nothing_asked_costs_nothing(index: Index) -> None:
    assert index.reserve_chunks([]) == []


def test_a_store_that_is_gone_answers_full_for_the_first_chunk_only(tmp_path: Path) -> None:
    s = StoreProcess(tmp_path).start()
    idx = StoreIndex(StoreClient(s.url, timeout=1.0),
                     {"namespace": b"g" * 16, "arena_bytes": 2**20, "slots": SLOTS,
                      "groups": GROUPS}, retry_seconds=60)
    try:
        assert idx.up
        s.kill()
        got = idx.reserve_chunks([ChunkReserve(b"a", None, [0]), ChunkReserve(b"b", b"a", [0])])
        assert got == [SaveDrop.FULL] and not idx.up
        assert idx.reserve_chunks([ChunkReserve(b"c", None, [0])]) == [SaveDrop.FULL]
    finally:
        idx.client.close()
        s.stop()


def test_every_entry_is_a_handle_the_store_knows(store: StoreProcess) -> None:
    """What reserve_chunks hands out is committed and aborted like a single reserve's."""
    idx = StoreIndex(StoreClient(store.url), {"namespace": os.urandom(16), "arena_bytes": 2**20,
                                              "slots": SLOTS, "groups": GROUPS})
    try:
        (a, b) = idx.reserve_chunks([ChunkReserve(b"a", None, [0, 1]),
                                     ChunkReserve(b"ab", b"a", [0])])
        assert isinstance(a, list) and isinstance(b, list)
        assert idx.holds()["writes"] == 3
        for e in a:
            assert idx.commit(e)
        idx.abort(b[0])
        idx.flush()
        assert idx.holds()["writes"] == 0
        assert [idx.is_ready(g, b"a") for g in (0, 1)] == [True, True]
        assert isinstance(idx.get(0, b"a"), Entry) and idx.get(0, b"ab") is None
    finally:
        idx.client.close()
