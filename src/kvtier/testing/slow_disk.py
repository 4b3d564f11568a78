"""TEST ONLY: a :class:`~kvtier.tiers.seam.ChunkStore` that wraps another and takes as long
as a disk of ``gbps`` GB/s and ``latency_s`` per chunk would (sleeping the difference), so the
planner's choice between a slow tier and recomputing is tested on the real data path."""

from __future__ import annotations

import time

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
