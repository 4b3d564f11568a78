"""The DRAM index's hold on chunks leaving for a tier, and the tier's own index (catalog):
budget, leaves-first eviction, deletes, and its rebuild from a directory scan."""

from __future__ import annotations

import hashlib

from kvtier.index.base import Entry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.policy.lru import LRUPolicy
from kvtier.slab import SlotAllocator
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.directory import ScanResult, StoredChunk
from kvtier.tiers.disk import ChunkName


def k(i: int) -> bytes:
    return hashlib.blake2b(bytes([i]), digest_size=16).digest()


def dram(slots: int = 4) -> MemoryIndex:
    return MemoryIndex([GroupIndexSpec(0, LRUPolicy(slots))], SlotAllocator([slots]))


def store(ix: MemoryIndex, chain: list[int]) -> list[Entry]:
    out = []
    for n, i in enumerate(chain):
        e = ix.reserve(0, k(i), k(chain[n - 1]) if n else None)
        assert isinstance(e, Entry)
        ix.commit(e)
        out.append(e)
    return out


def test_a_leaving_chunk_stays_readable_and_its_slot_is_kept_until_the_copy_ends() -> None:
    ix = dram()
    store(ix, [0, 1])
    e = ix.begin_leave(0)
    assert e is not None and e.key == k(1) and ix.match(0, [k(0), k(1)]) == 2
    assert ix.begin_leave(0) is None  # its parent has a child; nothing else may leave
    ix.reset()  # doomed, but the copy still reads the slot
    assert ix.allocator.num_free(0) == 3
    assert ix.end_leave(e) and ix.allocator.num_free(0) == 4
    ix.check_invariants()


def test_a_hit_or_a_child_during_the_copy_keeps_the_chunk() -> None:
    ix = dram()
    store(ix, [0, 1])
    e = ix.begin_leave(0)
    assert e is not None
    pins = ix.pin(0, [k(1)])  # a load decided while it was leaving
    assert not ix.end_leave(e) and ix.get(0, k(1)) is e
    ix.unpin(pins)
    ix.check_invariants()
    e = ix.begin_leave(0)
    assert e is not None
    child = ix.reserve(0, k(2), k(1))
    assert isinstance(child, Entry)
    assert not ix.end_leave(e)
    ix.commit(child)
    ix.check_invariants()


def chunk(i: int, parent: int | None, mtime: float = 0.0) -> StoredChunk:
    return StoredChunk(ChunkName(0, k(i), None if parent is None else k(parent)), mtime)


def test_the_rebuild_registers_parents_first_and_deletes_orphans_and_partials() -> None:
    cat = TierCatalog(1, 10)
    found = ScanResult(
        [chunk(3, 2, 5.0), chunk(1, None, 1.0), chunk(2, 1, 2.0), chunk(9, 8, 0.0)],
        partial=[(1, ChunkName(0, k(7), None))])
    assert cat.rebuild(found) == 3
    assert cat.index.match(0, [k(1), k(2), k(3)]) == 3
    assert {op.key for op in cat.take_deletes()} == {k(9), k(7)}
    cat.check_invariants()


def test_over_budget_the_oldest_leaves_go_and_their_files_are_deleted() -> None:
    cat = TierCatalog(1, 3)
    found = ScanResult([chunk(1, None, 1.0), chunk(2, 1, 2.0), chunk(5, None, 9.0),
                        chunk(6, 5, 9.5)], [])
    assert cat.rebuild(found) == 3
    gone = cat.take_deletes()
    assert len(gone) == 1 and gone[0].parent == k(1)  # the old prefix's leaf went first
    e = cat.reserve(0, k(6), k(5))  # stored already
    assert not isinstance(e, Entry)
    cat.check_invariants()
