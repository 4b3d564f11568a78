"""Blocks <-> chunk-major bytes: the reference codec (plain torch, CPU or CUDA tensors).

Byte format of one chunk of a group (``C`` blocks, segments ``s_0 .. s_k`` in layout order)::

    [s_0: block 0 | block 1 | ... | block C-1][s_1: block 0 | ... ] ... [s_k: ...]

and ``n`` chunks are ``n`` such runs back to back (chunk-major). Keeping one segment's blocks
together lets a chunk whose block ids are consecutive move as one piece per segment.

Contract: ``block_ids`` are the blocks of whole chunks in order; duplicates, negative or
out-of-range ids and a count that is not a multiple of ``blocks_per_chunk`` raise
:class:`CodecError` before a byte moves. Nothing outside the listed blocks (in the cache) or
outside ``[0, n * chunk_bytes)`` (in the buffer) is read or written.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

import torch

from kvtier.layout import GroupLayout


class CodecError(ValueError):
    """Block ids or buffers that do not fit the layout."""


def chunk_bytes(group: GroupLayout, blocks_per_chunk: int) -> int:
    return group.bytes_per_block * blocks_per_chunk


def segment_offsets(group: GroupLayout, blocks_per_chunk: int) -> list[int]:
    """Byte offset of each segment's first block inside one chunk."""
    offsets, pos = [], 0
    for s in group.segments:
        offsets.append(pos)
        pos += s.run * blocks_per_chunk
    return offsets


def block_id_list(block_ids: Sequence[int]) -> list[int]:
    """``block_ids`` as a list of Python ints (from a list, a NumPy array or a 1-D integer
    tensor); anything that is not an integer (floats, bools, strings) is a CodecError."""
    if isinstance(block_ids, torch.Tensor):
        if block_ids.dim() != 1 or block_ids.dtype.is_floating_point or \
                block_ids.dtype == torch.bool or block_ids.is_complex():
            raise CodecError(f"block ids must be a 1-D integer tensor, got {block_ids!r}")
        return [int(b) for b in block_ids.tolist()]
    out = []
    for b in block_ids:
        if isinstance(b, bool) or not hasattr(b, "__index__"):
            raise CodecError(f"block ids must be integers, got {b!r} in {list(block_ids)!r}")
        out.append(operator.index(b))
    return out


def check_block_ids(group: GroupLayout, block_ids: Sequence[int], blocks_per_chunk: int) -> int:
    """Validate ids; return the number of chunks they make."""
    ids = block_id_list(block_ids)
    n = len(ids)
    if blocks_per_chunk <= 0:
        raise CodecError(f"blocks_per_chunk must be positive, got {blocks_per_chunk}")
    if n % blocks_per_chunk:
        raise CodecError(f"{n} block ids is not a whole number of {blocks_per_chunk}-block chunks")
    if len(set(ids)) != n:
        raise CodecError(f"duplicate block ids in {ids}")
    limit = group.num_blocks
    bad = [b for b in ids if not 0 <= b < limit]
    if bad:
        raise CodecError(f"block ids {bad} are outside [0, {limit}) for group {group.group_id}")
    return n // blocks_per_chunk


def _index_tensors(group: GroupLayout, ids: list[int]) -> dict[torch.device, torch.Tensor]:
    """One index tensor per device the group's segments live on."""
    out: dict[torch.device, torch.Tensor] = {}
    for seg in group.segments:
        dev = seg.storage.device
        if dev not in out:
            out[dev] = torch.as_tensor(ids, dtype=torch.long, device=dev)
    return out


def _check_buffer(buf: torch.Tensor, need: int) -> torch.Tensor:
    if buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous():
        raise CodecError("the byte buffer must be a contiguous 1-D uint8 tensor")
    if buf.numel() < need:
        raise CodecError(f"the byte buffer holds {buf.numel()} bytes, {need} needed")
    return buf[:need]


def gather(
    group: GroupLayout, block_ids: Sequence[int], blocks_per_chunk: int, out: torch.Tensor
) -> None:
    """Copy the listed blocks of every segment into ``out`` in chunk-major format."""
    n_chunks = check_block_ids(group, block_ids, blocks_per_chunk)
    cb = chunk_bytes(group, blocks_per_chunk)
    out = _check_buffer(out, n_chunks * cb).view(n_chunks, cb)
    if n_chunks == 0:
        return
    idx_on = _index_tensors(group, block_id_list(block_ids))
    for seg, off in zip(group.segments, segment_offsets(group, blocks_per_chunk)):
        idx = idx_on[seg.storage.device]
        rows = seg.blocks().index_select(0, idx)  # (n*C, run) on the cache device
        width = seg.run * blocks_per_chunk
        out[:, off : off + width].copy_(rows.view(n_chunks, width), non_blocking=False)


def scatter(
    group: GroupLayout, block_ids: Sequence[int], blocks_per_chunk: int, src: torch.Tensor
) -> None:
    """Write ``src`` (chunk-major format) back into the listed blocks of every segment."""
    n_chunks = check_block_ids(group, block_ids, blocks_per_chunk)
    cb = chunk_bytes(group, blocks_per_chunk)
    src = _check_buffer(src, n_chunks * cb).view(n_chunks, cb)
    if n_chunks == 0:
        return
    idx_on = _index_tensors(group, block_id_list(block_ids))
    for seg, off in zip(group.segments, segment_offsets(group, blocks_per_chunk)):
        dev = seg.storage.device
        idx = idx_on[dev]
        width = seg.run * blocks_per_chunk
        rows = src[:, off : off + width].to(dev).reshape(n_chunks * blocks_per_chunk, seg.run)
        seg.blocks().index_copy_(0, idx, rows)


def scatter_positions(
    group: GroupLayout, block_ids: Sequence[int], blocks_per_chunk: int, src: torch.Tensor,
    skip: int = -1,
) -> None:
    """Like :func:`scatter` for one chunk, writing only the positions whose id is not ``skip``
    (blocks already in the prefix cache, or outside a sliding window)."""
    block_ids = block_id_list(block_ids)
    if len(block_ids) != blocks_per_chunk:
        raise CodecError(f"{len(block_ids)} ids for a {blocks_per_chunk}-block chunk")
    keep = [i for i, b in enumerate(block_ids) if b != skip]
    ids = [block_ids[i] for i in keep]
    if len(set(ids)) != len(ids):
        raise CodecError(f"duplicate block ids in {list(block_ids)}")
    bad = [b for b in ids if not 0 <= b < group.num_blocks]
    if bad:
        raise CodecError(f"block ids {bad} are outside [0, {group.num_blocks})")
    src = _check_buffer(src, chunk_bytes(group, blocks_per_chunk))
    if not ids:
        return
    for seg, off in zip(group.segments, segment_offsets(group, blocks_per_chunk)):
        dev = seg.storage.device
        rows = src[off : off + seg.run * blocks_per_chunk].view(blocks_per_chunk, seg.run)
        pos = torch.as_tensor(keep, dtype=torch.long, device=rows.device)
        idx = torch.as_tensor(ids, dtype=torch.long, device=dev)
        seg.blocks().index_copy_(0, idx, rows.index_select(0, pos).to(dev))
