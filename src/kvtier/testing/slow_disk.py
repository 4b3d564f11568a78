"""TEST ONLY: a :class:`~kvtier.tiers.seam.ChunkStore` that wraps another and takes as long
as a disk of ``gbps`` GB/s and ``latency_s`` per chunk would (sleeping the difference), so the
planner's choice between a slow tier and recomputing is tested on the real data path."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from kvtier.tiers.seam import ChunkStore


class SlowChunkStore(ChunkStore):
    def __init__(self, inner: ChunkStore, gbps: float, latency_s: float = 0.0) -> None:
        self.inner = inner
        self.gbps = gbps
        self.latency_s = latency_s

    def _wait(self, t0: float, nbytes: int) -> None:
        due = t0 + self.latency_s + nbytes / (self.gbps * 1e9)
        rest = due - time.perf_counter()
        if rest > 0:
            time.sleep(rest)

    def put(self, group: int, key: bytes, parent: bytes | None, data: torch.Tensor) -> int:
        t0 = time.perf_counter()
        n = self.inner.put(group, key, parent, data)
        self._wait(t0, n)
        return n

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        t0 = time.perf_counter()
        n = self.inner.get(group, key, parent, out)
        self._wait(t0, n)
        return n

    def delete(self, group: int, key: bytes, parent: bytes | None) -> None:
        self.inner.delete(group, key, parent)

    def close(self) -> None:
        self.inner.close()


def slow_engine_disk(gbps: float, latency_s: float = 0.0) -> None:
    """TEST ONLY: every disk tier opened in this process from now on is slowed to ``gbps``
    (both the scheduler's start-up probe, which seeds the planner's cost model, and the
    workers' stores). For an engine whose core and worker run in this process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, one rank): call it before the engine is built.
    Reads and writes then move one chunk at a time (the wrapper's ``max_in_flight`` is 1)."""
    import kvtier.tiers.setup as setup
    import kvtier.worker as worker
    from kvtier.tiers.seam import TierPlan

    real_store, real_disk = worker.disk_store, setup.DiskChunkStore

    def store(plan: TierPlan, shard: int) -> ChunkStore:
        return SlowChunkStore(real_store(plan, shard), gbps, latency_s)

    def probe_store(root: Path, shard: int, namespace: bytes) -> ChunkStore:
        return SlowChunkStore(real_disk(root, shard, namespace), gbps, latency_s)

    worker.disk_store = store
    setup.DiskChunkStore = probe_store  # type: ignore[assignment,misc]
