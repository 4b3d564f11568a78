"""Slab geometry, the slot allocator and host memory (private; shared in test_shm.py)."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvtier.config import ConfigError
from kvtier.gpu.pinning import CudaPinner
from kvtier.slab import HostSlab, SlabError, SlotAllocator, lay_out_slab, pin_ranges
from kvtier.testing.pinning import RecordingPinner
from tests.test_huge_pages import anon_huge_bytes, thp_available

MiB = 2**20


def test_every_kv_group_gets_the_same_slot_count_and_state_its_share() -> None:
    layout = lay_out_slab(1024 * MiB, [1 * MiB, 3 * MiB], num_shards=2, state_slot_bytes=5 * MiB,
                     state_bytes=256 * MiB)
    g0, g1, state = layout.classes
    assert g0.num_slots == g1.num_slots > 0
    assert state.num_slots == (128 * MiB) // (5 * MiB)
    assert layout.total_bytes <= 1024 * MiB
    # classes do not overlap inside a shard, shards do not overlap
    assert g0.offset + g0.bytes <= g1.offset and g1.offset + g1.bytes <= state.offset
    assert layout.offset(0, 0, shard=1) == layout.shard_bytes


def test_slots_are_aligned_and_never_overlap() -> None:
    layout = lay_out_slab(64 * MiB, [1000, 5000, 123457])
    seen = []
    for ci, c in enumerate(layout.classes):
        for s in range(c.num_slots):
            off = layout.offset(ci, s)
            assert off % 4096 == 0
            seen.append((off, off + c.slot_bytes))
    seen.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(seen))


def test_too_small_a_slab_is_a_clear_error() -> None:
    with pytest.raises(SlabError, match="holds no chunk"):
        lay_out_slab(1 * MiB, [2 * MiB])
    with pytest.raises(SlabError, match="raise state_size"):
        lay_out_slab(64 * MiB, [MiB], state_slot_bytes=40 * MiB, state_bytes=8 * MiB)


def test_allocator_is_lifo_o1_and_catches_double_free() -> None:
    a = SlotAllocator([3, 1])
    got = [a.allocate(0) for _ in range(3)]
    assert sorted(got) == [0, 1, 2] and a.allocate(0) is None and not a.can_allocate(0)
    a.free(0, got[1])
    assert a.num_free(0) == 1 and a.allocate(0) == got[1]
    a.free(0, 0)
    with pytest.raises(ValueError, match="freed twice"):
        a.free(0, 0)
    assert a.allocate(1) == 0 and a.allocate(1) is None


def test_pin_ranges_cover_everything_in_bounded_steps_without_splitting_slots() -> None:
    layout = lay_out_slab(200 * MiB, [3 * MiB, 5 * MiB], num_shards=2)
    step = 16 * MiB
    ranges = pin_ranges(layout, step)
    assert sum(n for _, n in ranges) == sum(c.bytes for c in layout.classes) * 2
    for off, n in ranges:
        assert n <= step
        shard_off = off % layout.shard_bytes
        c = next(c for c in layout.classes if c.offset <= shard_off < c.offset + c.bytes)
        assert (shard_off - c.offset) % c.stride == 0 and n % c.stride == 0


def test_private_slab_views_are_disjoint_and_writable() -> None:
    layout = lay_out_slab(8 * MiB, [100_000, 200_000])
    slab = HostSlab(layout)
    a, b = slab.view(0, 0), slab.view(1, layout.classes[1].num_slots - 1)
    a.fill_(1)
    b.fill_(2)
    assert int(slab.view(0, 0).sum()) == 100_000 and int(b.sum()) == 400_000
    slab.close()


def test_private_slab_slots_start_on_pages() -> None:
    """The disk tier reads a chunk straight into its slot only where the slot starts on a
    page (O_DIRECT): every slot of a private slab does."""
    layout = lay_out_slab(8 * MiB, [100_000, 200_000])
    slab = HostSlab(layout)
    for cls, c in enumerate(layout.classes):
        assert {slab.view(cls, i).data_ptr() % 4096 for i in range(c.num_slots)} == {0}
    slab.close()


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are off on this kernel")
def test_private_slab_memory_is_huge_pages() -> None:
    """A disk read or write of a 2 MiB slot is one device request only where the slot's
    memory is physically contiguous (kvtier.huge_pages): the private slab is huge pages."""
    layout = lay_out_slab(16 * MiB, [2 * MiB])
    slab = HostSlab(layout)
    slab.buffer.fill_(1)
    assert anon_huge_bytes(slab.buffer.data_ptr()) >= 4 * MiB
    slab.close()


def test_a_slab_larger_than_the_host_is_refused_with_numbers() -> None:
    layout = lay_out_slab(2**50, [MiB])
    with pytest.raises(ConfigError, match=r"1PiB|1024TiB|more than this process can take"):
        HostSlab(layout)


def test_a_model_with_only_recurrent_state_uses_all_of_dram_size() -> None:
    (state,) = lay_out_slab(64 * MiB, [], state_slot_bytes=MiB).classes
    # not a quarter: there is no KV to leave room for (64 slots less the one that makes
    # room for the checksum table)
    assert state.num_slots == 63
    (state,) = lay_out_slab(64 * MiB, [], state_slot_bytes=MiB, state_bytes=8 * MiB).classes
    assert state.num_slots == 63
    _, state = lay_out_slab(64 * MiB, [MiB], state_slot_bytes=MiB).classes
    assert state.num_slots == 15  # beside KV: a quarter by default (16 less the table's room)


def test_checksum_tables_are_inside_each_shard_and_apart_from_every_slot() -> None:
    layout = lay_out_slab(40 * MiB, [3 * MiB, 5 * MiB], num_shards=2, state_slot_bytes=MiB,
                          checksum_entries=[16, 4, 1])
    assert layout.total_bytes <= 40 * MiB
    regions = []
    for c in layout.classes:
        regions.append((c.offset, c.offset + c.bytes))
        regions.append((c.sums_offset, c.sums_offset + c.sums_bytes))
        assert c.sums_offset % 8 == 0 and c.sums_bytes == 8 * c.sums_entries * c.num_slots
    regions.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(regions)), regions
    assert regions[-1][1] <= layout.shard_bytes
    slab = HostSlab(layout)
    for cls, c in enumerate(layout.classes):
        for shard in range(2):
            t = slab.sums(cls, shard)
            assert t.shape == (c.num_slots, c.sums_entries) and t.dtype == torch.int64
            t.fill_(cls * 10 + shard + 1)
        for shard in range(2):  # no table overlaps another's
            assert int(slab.sums(cls, shard).min()) == int(slab.sums(cls, shard).max()) \
                == cls * 10 + shard + 1
    slab.close()


def test_pinning_without_cuda_is_an_error_not_a_silent_no_op() -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA present: pinning is exercised by the GPU tests")
    with pytest.raises(SlabError, match="CUDA is not available"):
        HostSlab(lay_out_slab(4 * MiB, [MiB]), pinner=CudaPinner())


def test_a_pinner_gets_exactly_the_pin_ranges_and_releases_them_at_close() -> None:
    layout = lay_out_slab(40 * MiB, [3 * MiB, 5 * MiB], num_shards=2)
    pinner = RecordingPinner()
    slab = HostSlab(layout, pin_step=8 * MiB, pinner=pinner)
    base = slab.buffer.data_ptr()
    want = {base + off: n for off, n in pin_ranges(layout, 8 * MiB)}
    assert pinner.pinned == want and len(want) > 2
    assert slab.registered == sorted(want)
    slab.close()
    assert pinner.pinned == {} and slab.registered == []
    slab.close()  # twice is harmless: nothing is unregistered again


def test_a_refused_registration_is_an_error_with_numbers_and_undoes_the_others() -> None:
    layout = lay_out_slab(40 * MiB, [3 * MiB], num_shards=1)
    pinner = RecordingPinner(refuse=2)
    with pytest.raises(SlabError, match=r"at offset \d+ failed \(cudaError 2\); lower dram_size"):
        HostSlab(layout, pin_step=6 * MiB, pinner=pinner)
    assert pinner.calls == 3 and pinner.pinned == {}
