"""A worker's slab inside the store's pool: map the descriptor the store handed over.

Contract of :func:`store_slab`: the arena must hold the worker's slab layout (the scheduler
half attached with the same layout, so it does); the whole pool is mapped (one mapping, one
pin registration range per :func:`~kvtier.slab.pin_ranges` piece) and the slab's buffer is
the arena's bytes, so the worker's copies go straight between its KV cache and the shared
pool, with no staging copy. The descriptor is closed once mapped (the mapping keeps the
memory). ``map_seconds`` and ``pin_seconds`` of the last call are kept for the logs.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.config import format_bytes
from kvtier.log import get_logger
from kvtier.slab import HostSlab, Pinner, SlabLayout, pin_region
from kvtier.store.client import Attachment, StoreClient, StoreDown, StoreRefused
from kvtier.store.pool import PoolError, map_pool, pool_identity

logger = get_logger("store")

RETRY_SECONDS = 1.0
"""A new epoch's pool that could not be mapped (store not reachable, pinning refused) is
tried again at most this often: each plan meanwhile fails its jobs at once."""


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


class _Move:
    """The slab's next pool being made ready: the old pool's pins undone, the new pool
    mapped and pinned, the old one unmapped last (so the new mapping never reuses its
    addresses: an address kept from the old pool can never silently name new bytes).
    :meth:`run` runs on a thread of its own when pinning (tens of seconds for 64 GiB: never
    on the step path), inline otherwise (an mmap: microseconds)."""

    def __init__(self, epoch: int, att: Attachment, layout: SlabLayout,
                 release: tuple[Callable[[], None], Callable[[], None]],
                 pinner: Pinner | None, pin_step: int) -> None:
        self.epoch, self.att, self.layout = epoch, att, layout
        self.release, self.pinner, self.pin_step = release, pinner, pin_step
        self.pool = pool_identity(att.pool_fd)
        self.mapping: mmap.mmap | None = None
        self.registered: list[int] = []
        self.timing = MapTiming()
        self.error = ""
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self.pinner is None:
            self.run()
            return
        self._thread = threading.Thread(target=self.run, name="kvtier-store-pin", daemon=True)
        self._thread.start()

    @property
    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def run(self) -> None:
        att = self.att
        unpin, unmap = self.release
        try:
            unpin()
            if self.layout.total_bytes > att.arena_bytes:
                raise PoolError(f"the store's arena holds {format_bytes(att.arena_bytes)}, "
                                f"this worker's slab needs {format_bytes(self.layout.total_bytes)}")
            t0 = time.perf_counter()
            self.mapping = map_pool(att.pool_fd, att.pool_bytes)
            t1 = time.perf_counter()
            if self.pinner is not None:
                base = _address(self.mapping) + att.arena_offset
                self.registered = pin_region(self.pinner, base, self.layout, self.pin_step)
            self.timing = MapTiming(t1 - t0, time.perf_counter() - t1)
        except Exception as e:  # reported by follow; the plans meanwhile fail their jobs
            self.error = f"{type(e).__name__}: {e}"
            if self.mapping is not None:
                self.mapping.close()
                self.mapping = None
        finally:
            os.close(att.pool_fd)
            unmap()

    def discard(self) -> None:
        """Release what a finished move made (nobody took it)."""
        if self.pinner is not None:
            for ptr in self.registered:
                self.pinner.unregister(ptr)
        self.registered = []
        if self.mapping is not None:
            self.mapping.close()
            self.mapping = None


def _address(mapping: mmap.mmap) -> int:
    """The address of a mapping's first byte."""
    import ctypes

    return ctypes.addressof(ctypes.c_char.from_buffer(mapping))


class StoreMapping:
    """A worker's side of the store's epochs: the slab follows the pool the plans refer to.

    :meth:`slab` (the worker's ``slab_factory``) maps the store's pool and, with a ``pinner``
    (a worker whose KV cache is on a GPU), pins it in :func:`~kvtier.slab.pin_ranges` pieces
    of ``pin_step`` bytes, as a private slab is; ``timing`` has the map and pin seconds. With
    no store reachable it gives a private slab (not pinned) that nothing will use: the
    scheduler half plans no job while its index is down.

    :meth:`follow` is called with each plan's ``store_epoch`` before the plan runs. On an
    epoch the slab does not map it lets every job in flight finish on the old mapping
    (``drain``: loads promised against the old pool read it), connects, and, if the store
    hands over another pool than the one mapped, moves the slab there: the old pins are
    undone and the old mapping closed, the new pool mapped and pinned, then the slab takes
    it and the transfer engine is told (``moved``: :meth:`~kvtier.transfer.TransferEngine.
    slab_moved`). Without a pinner that is an mmap, done at once. With one it takes tens of
    seconds for a large pool (34.6 s for 64 GiB on an H200), so it runs on a thread of its
    own and the engine steps on: until it is done every plan gets False (its jobs must then
    fail without touching the slab, :attr:`kvtier.worker.OffloadWorker.refusing`; the slab's
    buffer is empty meanwhile, so nothing can read or write a pool the plan does not name).
    The choice of failing the jobs over telling the scheduler half "not on your epoch yet":
    a failed load already means recompute and a failed save an aborted chunk, at any
    scheduler, under any number of ranks, with no new state in the protocol; an epoch
    acknowledgement would have the scheduler hold every rank's jobs until all ranks
    answered, a handshake of its own for a window that only a store restart opens. The one
    exception is where a failed promised load stops the engine (vLLM 0.25.1 with several
    KV-cache groups): there the scheduler half promises no store hit until every worker
    reported the epoch mapped (:func:`kvtier.vllm.store_link.loads_wait_for_epoch`), and a
    refusal can only meet saves, verifies and loads promised before the store went away.
    """

    def __init__(self, client: StoreClient, spec: dict[str, Any], pinner: Pinner | None = None,
                 pin_step: int = 2**30, clock: Callable[[], float] = time.monotonic) -> None:
        self.client = client
        self.spec = spec
        self.pinner = pinner
        self.pin_step = pin_step
        self.epoch = -1  # of the plans whose pool the slab maps (-1: not known yet)
        self.timing = MapTiming()  # of the pool the slab maps now
        self.why = ""  # why the last follow returned False
        self.moves = 0  # pools the slab moved to, ever
        self._clock = clock
        self._slab: HostSlab | None = None
        self._pool: tuple[int, int] | None = None  # identity of the pool mapped (None: none)
        self._vacant = False  # the slab maps nothing: a move under way, or the last one failed
        self._move: _Move | None = None
        self._retry_at = 0.0
        self.attached_at_start = False  # slab() mapped the store's pool (else a private slab)

    def slab(self, layout: SlabLayout) -> HostSlab:
        try:
            att = self.client.connect(self.spec)
        except (StoreDown, StoreRefused):
            self._slab = HostSlab(layout)
            return self._slab
        self._pool = pool_identity(att.pool_fd)
        self.attached_at_start = True
        self._slab = store_slab(layout, att, pinner=self.pinner, pin_step=self.pin_step,
                                timing=self.timing)
        self.client.close()  # attached again at the next epoch; holds nothing meanwhile
        return self._slab

    @property
    def moving(self) -> bool:
        """A new pool is being mapped and pinned."""
        return self._move is not None

    def follow(self, epoch: int, drain: Callable[[], object],
               moved: Callable[[], object] = lambda: None,
               pool: tuple[int, int] | None = None) -> bool:
        """Whether the plan of ``epoch`` may run its jobs on the slab (False: they must fail;
        :attr:`why` says why). Epoch 0 (the scheduler's index is down) runs on the pool
        mapped (loads promised before the store went away read it), unless none is.

        ``pool``: the identity (:func:`~kvtier.store.pool.pool_identity`) of the pool the
        plan's scheduler half attached to (``StepPlan.store_pool``; None: not checked). A
        store that restarted again between the scheduler's attach and the worker's hands the
        worker a pool the plan does not name: its jobs then fail (the plan's slots are of a
        pool no longer there) and the slab does not move until a plan names the pool the
        store hands over."""
        if self._slab is None:
            return True
        if self._move is not None and not self._finish(moved):
            return False
        if self._vacant:
            self.why = self.why or "the slab maps no pool"
        elif epoch == 0:
            return True
        elif epoch == self.epoch:
            if pool is None or pool == self._pool:
                return True
            self.why = f"the plan's pool of epoch {epoch} is not the one this worker maps"
            return False
        if epoch == 0:
            return False
        now = self._clock()
        if now < self._retry_at:
            return False
        drain()
        try:
            att = self.client.connect(self.spec)
        except (StoreDown, StoreRefused) as e:
            self._retry_at = now + RETRY_SECONDS
            self.why = f"the store's pool of epoch {epoch} cannot be mapped ({e})"
            return False
        self.client.close()
        handed = pool_identity(att.pool_fd)
        if pool is not None and handed != pool:
            os.close(att.pool_fd)
            self._retry_at = now + RETRY_SECONDS
            self.why = (f"the store hands over another pool than the plan's of epoch {epoch} "
                        f"(it restarted again)")
            return False
        if not self._vacant and handed == self._pool:
            os.close(att.pool_fd)  # the pool mapped is this epoch's (the first plan's, often)
            self.epoch = epoch
            return True
        self._pool, self._vacant = None, True
        self._move = _Move(epoch, att, self._slab.layout, self._slab.vacate(), self.pinner,
                           self.pin_step)
        self._move.start()
        return self._finish(moved) and epoch == self.epoch

    def _finish(self, moved: Callable[[], object]) -> bool:
        """Hand the slab a finished move's pool (False: still running, or it failed)."""
        move, slab = self._move, self._slab
        assert move is not None and slab is not None
        if not move.done:
            self.why = f"the store's pool of epoch {move.epoch} is still being mapped and pinned"
            return False
        self._move = None
        if move.error:
            self._retry_at = self._clock() + RETRY_SECONDS
            self.why = f"the store's pool of epoch {move.epoch} could not be mapped ({move.error})"
            logger.warning("kvtier: %s; its jobs fail until it is (tried again every %.0f s)",
                           self.why, RETRY_SECONDS)
            return False
        assert move.mapping is not None
        slab.occupy((move.mapping, move.att.arena_offset), move.registered, self.pinner)
        self._pool, self._vacant, self.epoch = move.pool, False, move.epoch
        self.timing, self.why = move.timing, ""
        self.moves += 1
        moved()
        logger.info("kvtier: the slab moved to the store's pool of epoch %d (mapped in %.2f s, "
                    "pinned in %.2f s)", move.epoch, move.timing.map_seconds,
                    move.timing.pin_seconds)
        return True

    def close(self) -> None:
        """Wait for a move under way and release what it made (the slab closes its own)."""
        if self._move is not None:
            self._move.wait()
            self._move.discard()
            self._move = None
