"""A worker's slab inside the store's pool: map the descriptor the store handed over.

Contract of :func:`store_slab`: the arena must hold the worker's slab layout (the scheduler
half attached with the same layout, so it does); the whole pool is mapped (one mapping, one
pin registration range per :func:`~kvtier.slab.pin_ranges` piece) and the slab's buffer is
the arena's bytes, so the worker's copies go straight between its KV cache and the shared
pool, with no staging copy. The descriptor is closed once mapped (the mapping keeps the
memory). ``map_seconds`` and ``pin_seconds`` of the last call are kept for the logs.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from kvtier.config import format_bytes
from kvtier.slab import HostSlab, Pinner, SlabLayout
from kvtier.store.client import Attachment
from kvtier.store.pool import PoolError, map_pool


@dataclass
class MapTiming:
    map_seconds: float = 0.0
    pin_seconds: float = 0.0


def store_slab(layout: SlabLayout, att: Attachment, pinner: Pinner | None = None,
               pin_step: int = 2**30, timing: MapTiming | None = None) -> HostSlab:
    if layout.total_bytes > att.arena_bytes:
        os.close(att.pool_fd)
        raise PoolError(f"the store's arena holds {format_bytes(att.arena_bytes)}, this "
                        f"worker's slab needs {format_bytes(layout.total_bytes)}")
    t0 = time.perf_counter()
    try:
        mapping = map_pool(att.pool_fd, att.pool_bytes)
    finally:
        os.close(att.pool_fd)
    t1 = time.perf_counter()
    slab = HostSlab(layout, region=(mapping, att.arena_offset), pinner=pinner,
                    pin_step=pin_step)
    if timing is not None:
        timing.map_seconds, timing.pin_seconds = t1 - t0, time.perf_counter() - t1
    return slab


def inside(slab: HostSlab, ptr: int, length: int) -> bool:
    """Whether ``[ptr, ptr+length)`` lies inside the slab's buffer (no staging copy)."""
    base = slab.buffer.data_ptr()
    return base <= ptr and ptr + length <= base + slab.buffer.numel()
