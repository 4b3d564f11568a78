"""What reading a chunk from a lower tier costs: measured bandwidth and per-chunk latency,
seeded by a start-up probe of the tier itself and refined by every promotion.

Every tier has its own :class:`TierCost` (the disk's and the remote store's rates differ by
orders of magnitude). The planner (:func:`kvtier.planner.promotion_gain`, asked by
:class:`kvtier.tiers.stack.TierStack`) promotes only when restoring through the tiers beats
both recomputing the tokens and the shorter hit DRAM holds: a promotion costs its reads
(:func:`stacked_read_seconds`), one engine step of deferral, then the load from DRAM like any
hit. A tier whose part would not pay is left out of the promotion (the hit then ends where
the tiers above it end), so a slow remote store never holds back what the disk restores.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from kvtier.huge_pages import huge_page_buffer
from kvtier.tiers.seam import ChunkStore, TierJob, TierJobKind, TierOp, TierRunner

PAGE = 4096

PROBE_KEY = bytes(range(16))


@dataclass
class TierCost:
    gbps: float  # sequential read bandwidth of one rank
    latency_s: float  # per chunk read, beyond its bytes
    alpha: float = 0.2

    def read_seconds(self, nbytes: int, chunks: int) -> float:
        return chunks * self.latency_s + nbytes / (self.gbps * 1e9)

    def observe(self, nbytes: int, chunks: int, seconds: float) -> None:
        """A promotion of ``chunks`` chunks, ``nbytes`` bytes, took ``seconds`` on one rank."""
        if nbytes <= 0 or seconds <= 0 or chunks <= 0:
            return
        transfer = max(seconds - chunks * self.latency_s, seconds * 0.1)
        self.gbps += self.alpha * (nbytes / transfer / 1e9 - self.gbps)


def stacked_read_seconds(reads: Iterable[tuple[TierCost, int, int]]) -> float:
    """Seconds to read ``(cost, bytes, chunks)`` from each tier of one promotion: every tier
    reads on its own I/O thread, all at once, so the slowest tier's time."""
    return max((c.read_seconds(nbytes, chunks) for c, nbytes, chunks in reads if chunks),
               default=0.0)


def probe(store: ChunkStore, chunk_bytes: int, chunks: int | None = None,
          group: int = 0) -> TierCost:
    """Write and read ``chunks`` chunks of ``chunk_bytes`` and a one-page chunk through
    ``store``: the read time of the small one is the latency, the rest the bandwidth. The
    chunks are read as promotions read them: one job through a
    :class:`~kvtier.tiers.seam.TierRunner`, ``store.max_in_flight`` at once, into page-aligned
    memory like the slab's slots (default: twice that depth, at least 4, so the queue is kept
    full). The probe chunks are deleted again (they live under a key no chunk hashes to)."""
    n = chunks or max(4, 2 * store.max_in_flight)
    _, slots = huge_page_buffer((n + 1) * chunk_bytes)  # as the slab's
    slots = slots.view(n + 1, chunk_bytes)
    slots.copy_(torch.randint(0, 256, slots.shape, dtype=torch.uint8))
    small = slots[0, :PAGE]
    keys = [PROBE_KEY[:-1] + bytes([i]) for i in range(n + 1)]
    ops = [TierOp(group, i, k) for i, k in enumerate(keys) if i]
    runner = TierRunner(store, lambda g, s: slots[s], name="probe")
    try:
        store.put(group, keys[0], None, small)
        _run(runner, TierJob(0, TierJobKind.DEMOTE, ops))
        t0 = time.perf_counter()
        store.get(group, keys[0], None, small)
        latency = time.perf_counter() - t0
        seconds = _run(runner, TierJob(1, TierJobKind.PROMOTE, ops))
    finally:
        runner.stop()
        for k in keys:
            store.delete(group, k, None)
    transfer = max(seconds - n * latency, seconds * 0.1)
    return TierCost(gbps=n * chunk_bytes / transfer / 1e9, latency_s=latency)


def _run(runner: TierRunner, job: TierJob) -> float:
    """Run one job on ``runner`` and wait for it: its seconds; raises if it failed."""
    runner.submit(job)
    runner.drain()
    (done,) = runner.poll()
    if not done.ok:
        raise OSError(f"the {done.kind} of the tier's probe failed: {done.error}")
    return done.seconds
