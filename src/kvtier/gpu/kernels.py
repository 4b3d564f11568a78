"""Triton gather/scatter between the paged cache and a contiguous device staging area.

A staging area holds ``n`` chunks back to back, each in the byte format of
:mod:`kvtier.codec` (per chunk, segment-major then block): exactly the bytes of the chunk's slot,
so one DMA per chunk (or per run of adjacent slots) moves it to or from the host.

One launch moves every piece of every chunk of a batch of one group. The work is a list of
(tile, block position) items: a *tile* is at most ``TILE`` bytes of one segment's run (static per
group, uploaded once), a *block position* is ``chunk * bpc + j`` with its block id (uploaded per
batch; negative = skip, for loads into blocks that are already there). A persistent grid of at
most ``max_programs`` programs walks the items, so the SMs taken from the model stay bounded.
Addresses are byte offsets from two base pointers (the lowest cache storage of the group, and
the staging tensor), so one launch covers segments in different storages.

Works on CUDA tensors and, with ``TRITON_INTERPRET=1``, on CPU tensors (the CI checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier.layout import GroupLayout

TAB_COLS = 5  # cache offset of the tile, block stride, offset inside the chunk, run, length


# Integer arguments are not specialized (a new value never triggers a compile mid-transfer);
# alignment comes from VEC instead.
@triton.jit(do_not_specialize=["stage_off", "chunk_bytes", "bpc", "n_tiles", "n_work"])
def _move_kernel(cache_ptr, stage_ptr, tab_ptr, ids_ptr, stage_off, chunk_bytes, bpc,
                 n_tiles, n_work, TO_STAGE: tl.constexpr, TILE: tl.constexpr,
                 VEC: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    offs = tl.arange(0, TILE)
    for w in range(pid, n_work, nprog):
        e = w % n_tiles
        p = w // n_tiles
        blk = tl.load(ids_ptr + p)
        row = tab_ptr + e * 5
        src0 = tl.load(row)
        stride = tl.load(row + 1)
        cpos = tl.load(row + 2)
        run = tl.load(row + 3)
        n = tl.load(row + 4)
        c = (p // bpc).to(tl.int64)
        j = (p % bpc).to(tl.int64)
        coff = tl.multiple_of(src0 + blk * stride, VEC)
        soff = tl.multiple_of(stage_off + c * chunk_bytes + cpos + j * run, VEC)
        n = tl.multiple_of(tl.where(blk >= 0, n, 0), VEC)
        mask = offs < n
        if TO_STAGE:
            x = tl.load(cache_ptr + coff + offs, mask=mask)
            tl.store(stage_ptr + soff + offs, x, mask=mask)
        else:
            x = tl.load(stage_ptr + soff + offs, mask=mask)
            tl.store(cache_ptr + coff + offs, x, mask=mask)


def _pow2_divisor(x: int, cap: int = 16) -> int:
    v = cap
    while v > 1 and x % v:
        v //= 2
    return v


@dataclass
class TileTable:
    """The static part of one group's gather/scatter: its tiles on the cache's device."""

    group_id: int
    blocks_per_chunk: int
    chunk_bytes: int
    cache_base: torch.Tensor  # uint8 storage with the lowest address of the group
    tab: torch.Tensor  # (n_tiles, TAB_COLS) int64 on the cache device
    n_tiles: int
    tile: int
    vec: int  # every address and length of the group is a multiple of this

    @classmethod
    def build(cls, group: GroupLayout, blocks_per_chunk: int, tile: int = 16384,
              stage_align: int = 256) -> TileTable:
        """Tiles of at most ``tile`` bytes (a power of two) for chunks of ``blocks_per_chunk``
        blocks; staging offsets must be multiples of ``stage_align``."""
        if tile & (tile - 1):
            raise ValueError(f"tile must be a power of two, got {tile}")
        segs = group.segments
        base_seg = min(segs, key=lambda s: s.storage.data_ptr())
        base = base_seg.storage.data_ptr()
        rows, g = [], stage_align
        chunk_pos = 0
        for s in segs:
            rel = s.storage.data_ptr() + s.offset - base
            for t in range(0, s.run, tile):
                rows.append((rel + t, s.block_stride, chunk_pos + t, s.run,
                             min(tile, s.run - t)))
            for v in (rel, s.block_stride, chunk_pos, s.run):
                g = np.gcd(g, v)
            chunk_pos += s.run * blocks_per_chunk
        g = int(np.gcd(g, min(tile, 16)))
        # Tile starts and lengths are multiples of the gcd too (tile is a power of two >= it).
        vec = _pow2_divisor(int(np.gcd(g, base % 16 or 16)))
        tab = torch.tensor(rows, dtype=torch.int64, device=base_seg.storage.device)
        return cls(group.group_id, blocks_per_chunk, chunk_pos, base_seg.storage, tab,
                   len(rows), min(tile, _next_pow2(max(s.run for s in segs))), vec)

    def launch(self, stage: torch.Tensor, stage_off: int, ids: torch.Tensor, to_stage: bool,
               max_programs: int, num_warps: int = 4) -> None:
        """Move the chunks whose block ids (``ids``: flat int64, ``n_chunks * bpc``, on the
        cache device; negative = skip) are listed, between the cache and
        ``stage[stage_off:]`` on the current stream."""
        n_pos = ids.numel()
        n_work = n_pos * self.n_tiles
        if n_work == 0:
            return
        if stage_off % self.vec:
            raise ValueError(f"staging offset {stage_off} is not a multiple of {self.vec}")
        grid = (max(1, min(n_work, max_programs)),)
        _move_kernel[grid](
            self.cache_base, stage, self.tab, ids, stage_off, self.chunk_bytes,
            self.blocks_per_chunk, self.n_tiles, n_work,
            TO_STAGE=to_stage, TILE=self.tile, VEC=self.vec, num_warps=num_warps,
        )


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
