"""Copy descriptors never straddle two pinned (registered) host ranges."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.gpu.dma import merge_adjacent, split_at


def test_a_merged_copy_across_a_registration_is_cut_there() -> None:
    # two adjacent 32 MiB slots merged into one copy; a registration starts between them
    mib = 2**20
    desc = (np.array([0, 32 * mib], dtype=np.int64) + 2**30,  # host (dst) side
            np.array([0, 32 * mib], dtype=np.int64), np.array([32 * mib, 32 * mib]))
    merged = merge_adjacent(desc)
    assert len(merged[2]) == 1
    cut = split_at(merged, True, np.array([2**30 + 32 * mib], dtype=np.int64))
    assert cut[2].tolist() == [32 * mib, 32 * mib]
    assert cut[0].tolist() == desc[0].tolist() and cut[1].tolist() == desc[1].tolist()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10_000), st.integers(1, 3000)), min_size=1,
                max_size=20),
       st.lists(st.integers(1, 40_000), max_size=10), st.booleans())
def test_split_covers_the_same_bytes_and_crosses_nothing(
        pieces: list[tuple[int, int]], bounds: list[int], host_is_dst: bool) -> None:
    host = np.array([a for a, _ in pieces], dtype=np.int64)
    other = host + 7
    size = np.array([n for _, n in pieces], dtype=np.int64)
    desc = (host, other, size) if host_is_dst else (other, host, size)
    b = np.array(sorted(set(bounds)), dtype=np.int64)
    d, s, n = split_at(desc, host_is_dst, b)
    h = d if host_is_dst else s
    assert int(n.sum()) == int(size.sum()) and (n > 0).all()
    assert ((d - s) == (desc[0][0] - desc[1][0])).all()  # pairs stay aligned
    for start, length in zip(h.tolist(), n.tolist()):
        assert not any(start < x < start + length for x in b.tolist())
