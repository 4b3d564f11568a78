"""Copy descriptors for moving chunks, and the driver calls that run them as DMA.

A *descriptor* is one contiguous copy ``(dst address, src address, bytes)``. For a batch of
chunks of one group this module builds, with NumPy and no Python loop over pieces:

- :func:`piece_descriptors`: one descriptor per (chunk, segment, block) piece between the paged
  cache and the chunk's host slot, in the byte format of :mod:`kvtier.codec` (per chunk,
  segment-major then block); SKIP positions of a load are dropped;
- :func:`chunk_descriptors`: one descriptor per chunk between a contiguous staging area and the
  chunks' slots;
- :func:`merge_adjacent`: neighbouring descriptors whose sources and destinations both continue
  each other become one (consecutive block ids in a block-outer layout, adjacent slots).

:class:`Driver` runs a descriptor list on a CUDA stream: ``cuMemcpyBatchAsync`` (one driver call
for the whole list; resolved through ``cuGetProcAddress`` with the CUDA 12.8 signature, which
drivers for CUDA 13 still serve) or, where that is missing, one ``cuMemcpyAsync`` per
descriptor. Copies use the copy engines, never SMs. Nothing here allocates device memory.

:func:`run_on_host` executes a descriptor list with ``memmove`` on host addresses: the CPU
tests use it to check the descriptors byte for byte against the reference codec.
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

import numpy as np

from kvtier.layout import GroupLayout

# CUmemcpySrcAccessOrder: the source is read in stream order (after earlier work on the stream).
SRC_ACCESS_ORDER_STREAM = 1
CUDA_VERSION_BATCH = 12080  # the cuMemcpyBatchAsync signature with failIdx


class DmaError(RuntimeError):
    """A driver call failed, or the driver lacks what was asked for."""


@dataclass(frozen=True)
class SegmentTable:
    """Per segment of one group: absolute address of block 0, block stride, run, and the
    offset of the segment's first block inside one chunk of ``blocks_per_chunk`` blocks."""

    base: np.ndarray  # int64, storage address + segment offset
    stride: np.ndarray  # int64
    run: np.ndarray  # int64
    chunk_off: np.ndarray  # int64
    blocks_per_chunk: int
    chunk_bytes: int

    @classmethod
    def of(cls, group: GroupLayout, blocks_per_chunk: int) -> SegmentTable:
        segs = group.segments
        run = np.array([s.run for s in segs], dtype=np.int64)
        chunk_off = np.concatenate(([0], np.cumsum(run * blocks_per_chunk)[:-1])).astype(np.int64)
        return cls(
            base=np.array([s.storage.data_ptr() + s.offset for s in segs], dtype=np.int64),
            stride=np.array([s.block_stride for s in segs], dtype=np.int64),
            run=run,
            chunk_off=chunk_off,
            blocks_per_chunk=blocks_per_chunk,
            chunk_bytes=int(run.sum()) * blocks_per_chunk,
        )

    @property
    def min_piece(self) -> int:
        return int(self.run.min())


Descriptors = tuple[np.ndarray, np.ndarray, np.ndarray]  # (dst, src, size), int64 each


def piece_descriptors(table: SegmentTable, ids: np.ndarray, slots: np.ndarray,
                      to_host: bool) -> Descriptors:
    """Descriptors between the cache and the slots for ``ids`` (``(n_chunks, bpc)`` int64,
    negative = skip) and ``slots`` (``(n_chunks,)`` host addresses). ``to_host``: a save
    (cache -> slot), else a load (slot -> cache). Order: chunk, segment, block."""
    bpc = ids.shape[1]
    ids3 = ids[:, None, :]  # (n, 1, bpc)
    cache = table.base[None, :, None] + ids3 * table.stride[None, :, None]
    host = (slots[:, None, None] + table.chunk_off[None, :, None]
            + np.arange(bpc, dtype=np.int64)[None, None, :] * table.run[None, :, None])
    size = np.broadcast_to(table.run[None, :, None], cache.shape)
    keep = np.broadcast_to(ids3 >= 0, cache.shape).ravel()
    cache, host, size = cache.ravel(), host.ravel(), np.ascontiguousarray(size).ravel()
    if not keep.all():
        cache, host, size = cache[keep], host[keep], size[keep]
    return (host, cache, size) if to_host else (cache, host, size)


def chunk_descriptors(stage_addr: int, chunk_bytes: int, slots: np.ndarray,
                      to_host: bool) -> Descriptors:
    """Chunk ``c`` of a staging area at ``stage_addr`` <-> slot ``slots[c]``."""
    stage = stage_addr + np.arange(len(slots), dtype=np.int64) * chunk_bytes
    size = np.full(len(slots), chunk_bytes, dtype=np.int64)
    slots = slots.astype(np.int64, copy=False)
    return (slots, stage, size) if to_host else (stage, slots, size)


def merge_adjacent(desc: Descriptors) -> Descriptors:
    """Merge runs of descriptors that continue each other on both sides (order kept)."""
    dst, src, size = desc
    if len(size) < 2:
        return desc
    cont = (src[1:] == src[:-1] + size[:-1]) & (dst[1:] == dst[:-1] + size[:-1])
    if not cont.any():
        return desc
    starts = np.flatnonzero(np.concatenate(([True], ~cont)))
    return dst[starts], src[starts], np.add.reduceat(size, starts)


def run_on_host(desc: Descriptors) -> None:
    """Execute descriptors on host memory (CPU tensors; tests only)."""
    for d, s, n in zip(*desc):
        ctypes.memmove(int(d), int(s), int(n))


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_uint), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    _fields_ = [
        ("srcAccessOrder", ctypes.c_uint),
        ("srcLocHint", _MemLocation),
        ("dstLocHint", _MemLocation),
        ("flags", ctypes.c_uint),
    ]


_BATCH_FN = ctypes.CFUNCTYPE(
    ctypes.c_int,  # CUresult
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,  # dsts, srcs, sizes
    ctypes.c_size_t,  # count
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,  # attrs, attrsIdxs, numAttrs
    ctypes.c_void_p,  # failIdx
    ctypes.c_void_p,  # stream
)
_COPY_FN = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p)


class Driver:
    """The CUDA driver's copy calls through ctypes (the process's CUDA context must be current
    on the calling thread: torch makes it so once it has touched the device).

    ``mode``: ``"batch"`` (cuMemcpyBatchAsync) or ``"loop"`` (cuMemcpyAsync per descriptor);
    default: ``KVTIER_DMA`` from the environment, else batch where the driver has it.
    ``flags``: the batch's CUmemcpyFlags (1 = CU_MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE).
    """

    def __init__(self, mode: str | None = None, flags: int = 0) -> None:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            raise DmaError(f"cannot load the CUDA driver (libcuda.so.1): {e}") from e
        self._copy = _COPY_FN(self._proc(lib, b"cuMemcpyAsync", 12000))
        self._batch = None
        mode = mode or os.environ.get("KVTIER_DMA") or "batch"
        if mode not in ("batch", "loop"):
            raise DmaError(f"unknown DMA mode {mode!r} (batch or loop)")
        if mode == "batch":
            try:
                self._batch = _BATCH_FN(self._proc(lib, b"cuMemcpyBatchAsync",
                                                   CUDA_VERSION_BATCH))
            except DmaError:
                self._batch = None
        self.mode = "batch" if self._batch is not None else "loop"
        self._attrs = _MemcpyAttributes(srcAccessOrder=SRC_ACCESS_ORDER_STREAM, flags=flags)
        self._attrs_idx = ctypes.c_size_t(0)
        self._fail_idx = ctypes.c_size_t(0)

    @staticmethod
    def _proc(lib: ctypes.CDLL, name: bytes, version: int) -> int:
        pfn = ctypes.c_void_p()
        status = ctypes.c_int(0)
        try:
            get = lib.cuGetProcAddress_v2
            get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                            ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
            err = get(name, ctypes.byref(pfn), version, 0, ctypes.byref(status))
        except AttributeError:
            get = lib.cuGetProcAddress
            get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                            ctypes.c_uint64]
            err = get(name, ctypes.byref(pfn), version, 0)
        if err != 0 or not pfn.value:
            raise DmaError(f"the CUDA driver has no {name.decode()} for version {version} "
                           f"(CUresult {err}, status {status.value})")
        return int(pfn.value)

    def run(self, desc: Descriptors, stream: int) -> int:
        """Enqueue every descriptor on ``stream`` (a raw CUstream, never the legacy NULL
        stream); returns the number of driver calls. Raises :class:`DmaError`."""
        dst, src, size = desc
        n = len(size)
        if n == 0:
            return 0
        if self._batch is None:
            for d, s, k in zip(dst.tolist(), src.tolist(), size.tolist()):
                err = self._copy(d, s, k, stream)
                if err:
                    raise DmaError(f"cuMemcpyAsync({d:#x} <- {s:#x}, {k}) failed: CUresult {err}")
            return n
        dst = np.ascontiguousarray(dst, dtype=np.int64)
        src = np.ascontiguousarray(src, dtype=np.int64)
        size = np.ascontiguousarray(size, dtype=np.int64)
        err = self._batch(dst.ctypes.data, src.ctypes.data, size.ctypes.data, n,
                          ctypes.addressof(self._attrs), ctypes.byref(self._attrs_idx), 1,
                          ctypes.byref(self._fail_idx), stream)
        if err:
            raise DmaError(f"cuMemcpyBatchAsync of {n} copies failed: CUresult {err} "
                           f"(first failing copy {self._fail_idx.value})")
        return 1


def split_at(desc: Descriptors, host_is_dst: bool, bounds: np.ndarray) -> Descriptors:
    """Cut descriptors so that none crosses a host-memory registration boundary.

    The slab is pinned in bounded steps (one ``cudaHostRegister`` each); merged copies of
    adjacent slots can otherwise span two registrations, which a copy engine descriptor must
    not. ``bounds``: sorted addresses where a registration starts (the first one excluded).
    """
    dst, src, size = desc
    if bounds.size == 0 or size.size == 0:
        return desc
    host = dst if host_is_dst else src
    first = np.searchsorted(bounds, host, side="right")
    last = np.searchsorted(bounds, host + size - 1, side="right")
    if not (first != last).any():
        return desc
    out_d, out_s, out_n = [], [], []
    for d, s, n, a, b in zip(dst.tolist(), src.tolist(), size.tolist(), first.tolist(),
                             last.tolist()):
        h = d if host_is_dst else s
        cuts = [int(x) - h for x in bounds[a:b]] + [n]
        pos = 0
        for c in cuts:
            out_d.append(d + pos)
            out_s.append(s + pos)
            out_n.append(c - pos)
            pos = c
    return (np.array(out_d, dtype=np.int64), np.array(out_s, dtype=np.int64),
            np.array(out_n, dtype=np.int64))
