"""A worker's slab inside the store's pool: map the descriptor the store handed over.

Contract of :func:`store_slab`: the arena must hold the worker's slab layout (the scheduler
half attached with the same layout, so it does); the whole pool is mapped (one mapping, one
pin registration range per :func:`~kvtier.slab.pin_ranges` piece) and the slab's buffer is
the arena's bytes, so the worker's copies go straight between its KV cache and the shared
pool, with no staging copy. The descriptor is closed once mapped (the mapping keeps the
memory). ``map_seconds`` and ``pin_seconds`` of the last call are kept for the logs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from kvtier.config import format_bytes
from kvtier.slab import HostSlab, Pinner, SlabLayout
from kvtier.store.client import Attachment, StoreClient, StoreDown, StoreRefused
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


class StoreMapping:
    """A worker's side of the store's epochs: the slab follows the pool the plans refer to.

    :meth:`slab` (the worker's ``slab_factory``) maps the store's pool, or, with no store
    reachable, gives a private slab that nothing will use: the scheduler half plans no job
    while its index is down. :meth:`follow` is called with each plan's ``store_epoch``
    before the plan runs; on a new epoch it first lets every job in flight finish on the old
    mapping (``drain``: loads promised against the old pool read it), then attaches and
    moves the slab onto the new pool. CPU only: a pinned (registered) slab is not moved.
    """

    def __init__(self, client: StoreClient, spec: dict[str, Any]) -> None:
        self.client = client
        self.spec = spec
        self.epoch = -1  # of the plans whose pool the slab maps (-1: not known yet)
        self.timing = MapTiming()
        self._slab: HostSlab | None = None

    def slab(self, layout: SlabLayout) -> HostSlab:
        try:
            att = self.client.connect(self.spec)
        except (StoreDown, StoreRefused):
            self._slab = HostSlab(layout)
            return self._slab
        self._slab = store_slab(layout, att, timing=self.timing)
        self.client.close()  # attached again at the next epoch; holds nothing meanwhile
        return self._slab

    def follow(self, epoch: int, drain: Callable[[], object]) -> bool:
        """Map the pool of ``epoch``; False if the store cannot be reached (the plan then
        carries no job for it: the scheduler is attached only while the store answers)."""
        if epoch == self.epoch or epoch == 0 or self._slab is None:
            return True
        drain()
        try:
            att = self.client.connect(self.spec)
        except (StoreDown, StoreRefused):
            return False
        rebind(self._slab, att)
        self.client.close()
        self.epoch = epoch
        return True


def rebind(slab: HostSlab, att: Attachment) -> None:
    """Move ``slab`` onto the pool of ``att`` (its old mapping is closed once unused)."""
    if slab.registered:
        os.close(att.pool_fd)
        raise PoolError("a pinned slab cannot move to a new pool")
    try:
        mapping = map_pool(att.pool_fd, att.pool_bytes)
    finally:
        os.close(att.pool_fd)
    old = slab._mmap
    # vLLM calls the worker's step hooks under torch.inference_mode; the transfer thread
    # writes the slab outside it, which an inference tensor refuses
    with torch.inference_mode(False):
        slab.buffer = torch.frombuffer(mapping, dtype=torch.uint8,
                                       count=slab.layout.total_bytes, offset=att.arena_offset)
    slab._mmap = mapping
    if old is not None:
        with contextlib.suppress(BufferError):
            old.close()
