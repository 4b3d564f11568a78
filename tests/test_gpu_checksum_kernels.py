"""The device checksum (:mod:`kvtier.gpu.kernels`: the gather/scatter kernel with ``sums``, the
cache-only pass and :func:`~kvtier.gpu.kernels.stage_sums`) against :mod:`kvtier.checksum`, bit
for bit, on the layout families of ``tests/_families.py``; the moved bytes are those of the
kernel without checksums.

Runs in its own process with ``TRITON_INTERPRET=1`` and no CUDA device visible, like
``tests/test_gpu_kernels.py`` (``tests/test_gpu_interpreted.py`` starts it):

    TRITON_INTERPRET=1 CUDA_VISIBLE_DEVICES= python -m pytest tests/test_gpu_checksum_kernels.py
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from triton.runtime.interpreter import InterpretedFunction

from _families import Family, blocks_per_chunk, materialize, stored_recipes
from _kvcheck import group_storages, poison
from kvtier import checksum, codec
from kvtier.gpu import kernels
from kvtier.layout import GroupLayout
from kvtier.protocol import SKIP

if not isinstance(kernels._move_kernel, InterpretedFunction):
    pytest.fail("kvtier.gpu.kernels was imported without TRITON_INTERPRET=1 in this process; "
                "run this file through tests/test_gpu_interpreted.py", pytrace=False)

RECIPES = {r["name"]: r for r in stored_recipes()}
# Several piece sizes, a state group, several storages, a sliding window.
NAMES = ["v032_flash_BHLNC", "v032_fp8_scales_on_layer", "v032_mamba_hybrid",
         "v032_sliding_window", "v032_sparse_mla_indexer", "v025_rocm_split_kv_fp8"]
OFF = 256


def _family(name: str) -> Family:
    return materialize(RECIPES[name], "cpu")


def _groups(name: str) -> list[tuple[GroupLayout, int]]:
    fam = _family(name)
    _, bpc = blocks_per_chunk(fam.layout)
    return list(zip(fam.layout.groups, bpc))


def _runs(group: GroupLayout) -> list[int]:
    return [s.run for s in group.segments]


def _ids(group: GroupLayout, bpc: int, rng: random.Random) -> np.ndarray:
    n = max(1, min(3, group.num_blocks // bpc // 2))
    return np.array(rng.sample(range(group.num_blocks), n * bpc), dtype=np.int64).reshape(n, bpc)


def _want(stage: torch.Tensor, n: int, cb: int, group: GroupLayout, bpc: int) -> list[int]:
    out = []
    for c in range(n):
        out += checksum.block_sums(stage[OFF + c * cb:OFF + (c + 1) * cb], _runs(group), bpc)
    return out


def _u64(t: torch.Tensor) -> list[int]:
    return [int(x) & checksum.MASK64 for x in t.tolist()]


def _gather(t: kernels.TileTable, ids: np.ndarray, n_bytes: int, sums: bool, programs: int
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    stage = torch.zeros(OFF + n_bytes + 64, dtype=torch.uint8)
    flat = torch.as_tensor(ids.ravel())
    part = torch.full((t.work_items(flat.numel()),), -1, dtype=torch.int64) if sums else None
    t.launch(stage, OFF, flat, True, max_programs=programs, sums=part)
    return stage, part


@pytest.mark.parametrize(("tile", "programs"), [(16384, 64), (1024, 3)])
@pytest.mark.parametrize("name", NAMES)
def test_gather_sums_are_the_checksum_of_the_staged_bytes(name: str, tile: int,
                                                          programs: int) -> None:
    rng = random.Random(name)
    for group, bpc in _groups(name):
        poison(group_storages(group), 3)
        t = kernels.TileTable.build(group, bpc, tile=tile)
        ids = _ids(group, bpc, rng)
        cb = codec.chunk_bytes(group, bpc)
        plain, _ = _gather(t, ids, ids.shape[0] * cb, False, programs)
        stage, part = _gather(t, ids, ids.shape[0] * cb, True, programs)
        assert torch.equal(stage, plain), "with checksums the kernel moved other bytes"
        assert part is not None
        got = _u64(t.block_sums(part, ids.size))
        assert got == _want(stage, ids.shape[0], cb, group, bpc)
        # The cache-only pass over the same blocks gives the same sums and writes nothing.
        before = [s.clone() for s in group_storages(group)]
        again = torch.full_like(part, -1)
        scratch = torch.zeros(8, dtype=torch.uint8)
        t.launch(scratch, 0, torch.as_tensor(ids.ravel()), False, max_programs=programs,
                 sums=again, move=False)
        assert _u64(t.block_sums(again, ids.size)) == got
        assert all(torch.equal(a, b) for a, b in zip(group_storages(group), before))
        assert int(scratch.sum()) == 0


@pytest.mark.parametrize("name", NAMES)
def test_scatter_sums_cover_the_written_positions_and_catch_a_flip(name: str) -> None:
    rng = random.Random(name + "scatter")
    for group, bpc in _groups(name):
        poison(group_storages(group), 5)
        t = kernels.TileTable.build(group, bpc, tile=4096)
        cb = codec.chunk_bytes(group, bpc)
        src = _ids(group, bpc, rng)
        stage, _ = _gather(t, src, src.shape[0] * cb, False, 8)
        stored = []
        seed = checksum.chunk_seed(bytes(range(16)), group.group_id, 0)
        for c in range(src.shape[0]):
            stored.append(checksum.block_checksums(stage[OFF + c * cb:OFF + (c + 1) * cb],
                                                   _runs(group), bpc, seed))
        dst = np.array(rng.sample(range(group.num_blocks), src.size), dtype=np.int64
                       ).reshape(src.shape)
        if bpc > 1:
            dst[0, rng.randrange(bpc)] = SKIP
        # A flipped bit in host memory / on the link: one staged byte of chunk 0.
        flip_at = OFF + rng.randrange(cb)
        stage[flip_at] ^= 0x10
        storages = group_storages(group)
        poison(storages, 6)
        plain_after = _scatter(group, t, dst, stage, None)
        poison(storages, 6)
        part = torch.full((t.work_items(dst.size),), -1, dtype=torch.int64)
        after = _scatter(group, t, dst, stage, part)
        assert all(torch.equal(a, b) for a, b in zip(after, plain_after)), \
            "with checksums the scatter wrote other bytes"
        sums = _u64(t.block_sums(part, dst.size))
        for c in range(dst.shape[0]):
            kept = [j for j in range(bpc) if dst[c, j] != SKIP]
            mine = sums[c * bpc:(c + 1) * bpc]
            assert all(mine[j] == 0 for j in range(bpc) if j not in kept)
            bad = checksum.mismatched_blocks(stored[c], mine, seed, kept)
            flipped = _block_of(group, bpc, flip_at - OFF) if c == 0 else None
            want = [flipped] if flipped in kept else []
            assert bad == want, (c, bad, want)


def _scatter(group: GroupLayout, t: kernels.TileTable, dst: np.ndarray, stage: torch.Tensor,
             part: torch.Tensor | None) -> list[torch.Tensor]:
    t.launch(stage, OFF, torch.as_tensor(dst.ravel()), False, max_programs=8, sums=part)
    return [s.clone() for s in group_storages(group)]


def _block_of(group: GroupLayout, bpc: int, byte: int) -> int:
    """The block position of a byte of a chunk in the codec's format."""
    for seg, off in zip(group.segments, codec.segment_offsets(group, bpc)):
        if off <= byte < off + seg.run * bpc:
            return (byte - off) // seg.run
    raise AssertionError(byte)


@pytest.mark.parametrize(("chunk_bytes", "tile_words"), [(8, 4), (4096, 64), (4104, 64),
                                                          (1 << 16, 2048)])
def test_stage_sums_of_contiguous_chunks(chunk_bytes: int, tile_words: int) -> None:
    buf = torch.randint(0, 256, (64 + 3 * chunk_bytes,), dtype=torch.uint8,
                        generator=torch.Generator().manual_seed(chunk_bytes))
    got = _u64(kernels.stage_sums(buf, 64, 3, chunk_bytes, max_programs=2, tile_words=tile_words))
    want = [checksum.block_sums(buf[64 + c * chunk_bytes:64 + (c + 1) * chunk_bytes], None, 1)[0]
            for c in range(3)]
    assert got == want
    assert kernels.stage_sums(buf, 64, 0, chunk_bytes).numel() == 0
    with pytest.raises(checksum.ChecksumError):
        kernels.stage_sums(buf, 4, 1, chunk_bytes)


def test_checksums_need_whole_words_and_sums() -> None:
    group, bpc = _groups("v032_flash_BHLNC")[0]
    t = kernels.TileTable.build(group, bpc)
    ids = torch.arange(bpc, dtype=torch.int64)
    with pytest.raises(ValueError, match="pass sums"):
        t.launch(torch.zeros(8, dtype=torch.uint8), 0, ids, True, 4, move=False)
    with pytest.raises(ValueError, match="int64"):
        t.launch(torch.zeros(t.chunk_bytes, dtype=torch.uint8), 0, ids, True, 4,
                 sums=torch.zeros(1, dtype=torch.int64))
    t.vec = 4  # a group whose pieces are only 4-byte aligned
    with pytest.raises(checksum.ChecksumError, match="stage_sums"):
        t.launch(torch.zeros(t.chunk_bytes, dtype=torch.uint8), 0, ids, True, 4,
                 sums=torch.zeros(t.work_items(bpc), dtype=torch.int64))
