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

With ``sums`` (:meth:`TileTable.launch`), the same launch also computes the restore checksum
of :mod:`kvtier.checksum` while it moves: every work item writes the partial sum of the words it
moved (what it wrote to staging, or what it read from staging) to its own entry, and
:meth:`TileTable.block_sums` adds them up per (chunk, block position): bit for bit
:func:`kvtier.checksum.block_sums`. ``move=False`` reads the cache only (the DMA path: the
checksum of the blocks before they are copied out, or after they were copied in), and
:func:`stage_sums` checksums whole chunks of a contiguous device region. Without ``sums`` the
kernel is compiled without any of it (a constexpr), as before.

Works on CUDA tensors and, with ``TRITON_INTERPRET=1``, on CPU tensors (the CI checks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kvtier import checksum
from kvtier.layout import GroupLayout

TAB_COLS = 5  # cache offset of the tile, block stride, offset inside the chunk, run, length


@triton.jit
def _term_sum(x, pos):
    """Sum of kvtier.checksum's term(w, i) over words ``x`` (int64) at positions ``pos``."""
    y = x.to(tl.uint64, bitcast=True) * 0x9E3779B97F4A7C15  # WORD_MULT
    y = y ^ (y >> 32)
    z = pos.to(tl.uint64) + 0x2545F4914F6CDD1D  # POS_OFFSET: r(i) = fmix64(i + R0) | 1
    z = z ^ (z >> 33)
    z = z * 0xFF51AFD7ED558CCD
    z = z ^ (z >> 33)
    z = z * 0xC4CEB9FE1A85EC53
    z = z ^ (z >> 33)
    return tl.sum(y * (z | 1), axis=0)


# Integer arguments are not specialized (a new value never triggers a compile mid-transfer);
# alignment comes from VEC instead.
@triton.jit(do_not_specialize=["stage_off", "chunk_bytes", "bpc", "n_tiles", "n_work"])
def _move_kernel(cache_ptr, stage_ptr, tab_ptr, ids_ptr, sum_ptr, stage_off, chunk_bytes, bpc,
                 n_tiles, n_work, TO_STAGE: tl.constexpr, TILE: tl.constexpr,
                 VEC: tl.constexpr, CHECKSUM: tl.constexpr, MOVE: tl.constexpr):
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
        if CHECKSUM:
            # Whole words (VEC >= 8): move them as int64 and sum their terms; the word index
            # inside the chunk is the staging offset inside the chunk / 8.
            wofs = tl.arange(0, TILE // 8)
            wmask = wofs < n // 8
            cw = (cache_ptr + coff).to(tl.pointer_type(tl.int64), bitcast=True)
            sw = (stage_ptr + soff).to(tl.pointer_type(tl.int64), bitcast=True)
            if TO_STAGE or not MOVE:
                x = tl.load(cw + wofs, mask=wmask, other=0)
                if MOVE:
                    tl.store(sw + wofs, x, mask=wmask)
            else:
                x = tl.load(sw + wofs, mask=wmask, other=0)
                tl.store(cw + wofs, x, mask=wmask)
            part = _term_sum(x, (cpos + j * run) // 8 + wofs)
            tl.store(sum_ptr + w, part.to(tl.int64, bitcast=True))
        else:
            mask = offs < n
            if TO_STAGE:
                x = tl.load(cache_ptr + coff + offs, mask=mask)
                tl.store(stage_ptr + soff + offs, x, mask=mask)
            else:
                x = tl.load(stage_ptr + soff + offs, mask=mask)
                tl.store(cache_ptr + coff + offs, x, mask=mask)


@triton.jit(do_not_specialize=["off", "chunk_bytes", "tiles_per_chunk", "n_work"])
def _stage_sum_kernel(buf_ptr, sum_ptr, off, chunk_bytes, tiles_per_chunk, n_work,
                      TILE_WORDS: tl.constexpr):
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    wofs = tl.arange(0, TILE_WORDS)
    nwords = chunk_bytes // 8
    for w in range(pid, n_work, nprog):
        c = (w // tiles_per_chunk).to(tl.int64)
        first = (w % tiles_per_chunk).to(tl.int64) * TILE_WORDS
        base = (buf_ptr + off + c * chunk_bytes).to(tl.pointer_type(tl.int64), bitcast=True)
        mask = first + wofs < nwords
        x = tl.load(base + first + wofs, mask=mask, other=0)
        tl.store(sum_ptr + w, _term_sum(x, first + wofs).to(tl.int64, bitcast=True))


def stage_sums(buf: torch.Tensor, off: int, n_chunks: int, chunk_bytes: int,
               max_programs: int = 64, tile_words: int = 2048) -> torch.Tensor:
    """Unseeded checksum sums (int64, one per chunk, on ``buf``'s device) of ``n_chunks``
    chunks of ``chunk_bytes`` at ``buf[off:]``: :func:`kvtier.checksum.block_sums` of each
    with one block. ``off`` and ``chunk_bytes`` are multiples of 8; on the current stream."""
    if off % 8 or chunk_bytes % 8 or (buf.data_ptr() + off) % 8:
        raise checksum.ChecksumError("device checksums need 8-byte aligned chunks of whole words")
    tiles = max(1, -(-chunk_bytes // (8 * tile_words)))
    n_work = n_chunks * tiles
    part = torch.zeros(max(n_work, 1), dtype=torch.int64, device=buf.device)
    if n_work:
        _stage_sum_kernel[(max(1, min(n_work, max_programs)),)](
            buf, part, off, chunk_bytes, tiles, n_work, TILE_WORDS=tile_words)
    return part[:n_work].view(n_chunks, tiles).sum(1)


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
               max_programs: int, num_warps: int = 4, sums: torch.Tensor | None = None,
               move: bool = True) -> None:
        """Move the chunks whose block ids (``ids``: flat int64, ``n_chunks * bpc``, on the
        cache device; negative = skip) are listed, between the cache and
        ``stage[stage_off:]`` on the current stream.

        ``sums``: an int64 tensor of at least :meth:`work_items` entries on the cache device;
        each work item writes its checksum partial there (skipped positions write 0), for
        :meth:`block_sums`. ``move=False`` (with ``sums``): read the cache, write nothing."""
        n_pos = ids.numel()
        n_work = n_pos * self.n_tiles
        if n_work == 0:
            return
        if stage_off % self.vec:
            raise ValueError(f"staging offset {stage_off} is not a multiple of {self.vec}")
        if sums is not None:
            self._check_sums(sums, n_work)
        elif not move:
            raise ValueError("move=False only computes checksums: pass sums")
        grid = (max(1, min(n_work, max_programs)),)
        _move_kernel[grid](
            self.cache_base, stage, self.tab, ids, sums if sums is not None else ids,
            stage_off, self.chunk_bytes, self.blocks_per_chunk, self.n_tiles, n_work,
            TO_STAGE=to_stage, TILE=self.tile, VEC=self.vec, CHECKSUM=sums is not None,
            MOVE=move, num_warps=num_warps,
        )

    def work_items(self, n_positions: int) -> int:
        """Entries of ``sums`` a launch over ``n_positions`` block positions writes."""
        return n_positions * self.n_tiles

    def _check_sums(self, sums: torch.Tensor, n_work: int) -> None:
        if self.vec < 8:
            raise checksum.ChecksumError(
                f"group {self.group_id} has pieces aligned to {self.vec} bytes only: checksum "
                "its staged chunks with stage_sums instead")
        if sums.dtype != torch.int64 or sums.numel() < n_work or not sums.is_contiguous():
            raise ValueError(f"sums must be a contiguous int64 tensor of {n_work} entries")

    def block_sums(self, sums: torch.Tensor, n_positions: int) -> torch.Tensor:
        """Per (chunk, block position) checksum sums, int64 ``(n_positions,)`` (``n_chunks *
        bpc``, in the order of the launch's ids), from a launch's ``sums``."""
        return sums[: n_positions * self.n_tiles].view(n_positions, self.n_tiles).sum(1)


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
