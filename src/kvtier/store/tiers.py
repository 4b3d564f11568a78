"""The store's tier below its DRAM pool: the local disk (issue 18), owned and moved by the
store process, which reads and writes the shared pool directly (engines move no disk bytes).

Contract:

- ``kvtier store --disk-path DIR --disk-size SIZE``: the store holds ``DIR``'s lock
  (:class:`~kvtier.tiers.directory.DirectoryLock`: no engine or second store uses it) after
  the engine's disk tier's start-up checks (a local disk, ``SIZE`` free counting what kvtier
  already stores there).
- One namespace directory per namespace (:func:`kvtier.tiers.disk.namespace_dir`) whose
  files name it in their headers: engines of different layouts or models never read each
  other's chunks, on disk as in the pool. A namespace's disk budget is ``SIZE`` times its
  arena's share of the pool: a hard quota, like the arena.
- A chunk's file holds, per shard, the slot's bytes then its row of the slot class's checksum
  table, so a promoted slot verifies on an engine's load exactly like a saved one. Every read
  is verified (:class:`~kvtier.tiers.disk.DiskChunkStore`); a chunk that does not is a miss,
  forgotten with its descendants and counted (``checksum_failures``).
- Demotion and promotion are the engine's disk tier's (:class:`~kvtier.tiers.schedule.
  TierScheduler`: low watermark, whole chains, ancestors pinned), driven by the store's tier
  thread every :data:`TICK_S` under the store's lock; each shard's I/O runs on its own thread
  (:class:`~kvtier.tiers.seam.TierRunner`). The store does not verify a slot before demoting
  it: a slot corrupted in DRAM carries its old checksum row, so the load after its promotion
  fails verification on the engine (with ``verify_checksums``).
- Promotion is asked by an engine's lookup (op ``promote``): if the disk extends the DRAM hit
  the store reserves slots, reads the chunks, and answers the engine's polls (op
  ``promoted``); on landing the chunks are leased to that engine as its lookups' are, so they
  are still there when it asks again. The store promotes whenever the disk extends the hit
  (no cost model: it does not know the engines' prefill rates).
- Warm restart: a namespace's tier is opened when its arena is created, from a scan of its
  directory (:func:`~kvtier.tiers.directory.scan`, no byte read), in the recency order of the
  files; chunks beyond the budget, orphans and partial chunks are deleted.
- Namespaces with other than full-attention groups get no disk tier (logged).
"""

from __future__ import annotations

import functools
import itertools
import logging
import mmap
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch

from kvtier.config import KvtierConfig, format_bytes
from kvtier.geometry import Geometry
from kvtier.index.memory import MemoryIndex
from kvtier.planner import CostEstimates, find_hit
from kvtier.slab import SlabLayout, SlotAllocator
from kvtier.store.leases import ClientHolds
from kvtier.store.pool import Arena
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost
from kvtier.tiers.directory import DirectoryLock, check_disk_path, scan
from kvtier.tiers.disk import DiskChunkStore, file_bytes, namespace_dir
from kvtier.tiers.schedule import LowerTier, TierScheduler
from kvtier.tiers.seam import ChunkStore, TierJobKind, TierOp, TierReport, TierRunner
from kvtier.tiers.stack import TierStack

logger = logging.getLogger("kvtier.store")

TICK_S = 0.005
"""Seconds between the tier thread's rounds (demotions planned, completions taken)."""

BURST_BUCKET_S, BURST_WINDOW_S = 0.1, 2.0
"""The burst that demotions leave free slots for: the most chunks reserved in one
``BURST_BUCKET_S`` over the last ``BURST_WINDOW_S`` (an engine's step of saves reaches the
store as several requests, over several of its rounds, and engines' steps are far longer
than a round)."""

SlotViews = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""(group, slot) -> one shard's slot bytes and its checksum-table row (bytes), in the pool."""


class StoreDisk:
    """The store's disk directory: checked and locked at start, one tier per namespace."""

    def __init__(self, path: str, size: int, max_pending_chunks: int = 256) -> None:
        check_disk_path(path, size, Path(path))  # counting every namespace's files there
        self.path, self.size = path, size
        self.max_pending_chunks = max_pending_chunks
        self.lock = DirectoryLock(path)

    def close(self) -> None:
        self.lock.close()


class ArenaTierRunner(TierRunner):
    """A shard's :class:`TierRunner` over the pool: a chunk's tier copy is its slot's bytes
    followed by its checksum-table row (staged: the two are not adjacent in the pool)."""

    def __init__(self, store: ChunkStore, views: SlotViews, **kw: object) -> None:
        self.views = views
        self._local = threading.local()  # a staging buffer per I/O thread
        super().__init__(store, lambda g, s: views(g, s)[0], **kw)  # type: ignore[arg-type]

    def _staging(self, n: int) -> torch.Tensor:
        stage = getattr(self._local, "stage", None)
        if stage is None or stage.numel() < n:
            stage = self._local.stage = torch.empty(n, dtype=torch.uint8)
        return stage[:n]

    def _mover(self, kind: TierJobKind, op: TierOp) -> Callable[[], int]:
        return functools.partial(self._move, kind, op)

    def _move(self, kind: TierJobKind, op: TierOp) -> int:
        slot, row = self.views(op.group, op.slot)
        n = slot.numel()
        rec = self._staging(n + row.numel())
        if kind is TierJobKind.DEMOTE:
            np.copyto(rec[:n].numpy(), slot.numpy())
            np.copyto(rec[n:].numpy(), row.numpy())
            return self.store.put(op.group, op.key, op.parent, rec)
        got = self.store.get(op.group, op.key, op.parent, rec)  # verified, or raises
        np.copyto(slot.numpy(), rec[:n].numpy())
        np.copyto(row.numpy(), rec[n:].numpy())
        return got


def record_bytes(layout: SlabLayout, cls: int) -> int:
    """Bytes of one chunk's tier copy on one shard: the slot's payload and checksum row."""
    c = layout.classes[cls]
    return c.slot_bytes + 8 * c.sums_entries


class SpaceTier:
    """One namespace's disk tier in the store (see the module doc). Every method but the I/O
    threads' runs under the store's lock."""

    def __init__(self, disk: StoreDisk, namespace: bytes, geometry: Geometry,
                 layout: SlabLayout, arena: Arena, pool: torch.Tensor, index: MemoryIndex,
                 allocator: SlotAllocator, budget: int, lease_ttl: float) -> None:
        self.geometry, self.layout, self.index = geometry, layout, index
        self.lease_ttl = lease_ttl
        self.root = namespace_dir(disk.path, namespace)
        chunk_bytes = [record_bytes(layout, c) for c in geometry.slot_classes]
        per_chunk = sum(file_bytes(b) for b in chunk_bytes) * layout.num_shards
        capacity = budget // per_chunk
        if capacity < 1:
            raise ValueError(f"the namespace's disk budget {format_bytes(budget)} holds no "
                             f"chunk ({format_bytes(per_chunk)} each)")
        catalog = TierCatalog(len(geometry.groups), capacity)
        t0 = time.perf_counter()
        found = scan(self.root, layout.num_shards)
        self.rebuilt = catalog.rebuild(found)
        logger.info("kvtier store: disk tier of a namespace at %s: %d chunks per group, %d "
                    "found and kept (%.3f s)", self.root, capacity, self.rebuilt,
                    time.perf_counter() - t0)
        config = KvtierConfig(disk_max_pending_chunks=disk.max_pending_chunks,
                              cost_model=False)
        estimates = CostEstimates(config.link_gbps, config.prefill_seconds_per_token,
                                  config.step_seconds)
        lower = LowerTier("disk", str(self.root), namespace, catalog, TierCost(1.0, 0.0),
                          chunk_bytes)
        # a stack of one tier: its promotions are planned as an engine's are (kvtier.tiers.stack)
        self.stack = TierStack(
            [lower], index, allocator, list(geometry.slot_classes), geometry, config, estimates,
            layout.num_shards, itertools.count(1), self._landed)
        self.scheduler: TierScheduler = self.stack.tiers[0]
        self.runners = [
            ArenaTierRunner(DiskChunkStore(self.root, shard, namespace),
                            self._views(pool, arena.offset, shard),
                            max_jobs=disk.max_pending_chunks + 64, name="store-disk")
            for shard in range(layout.num_shards)]
        self.saves = 0  # chunks reserved in the arena since the last round
        self._buckets: deque[list[int]] = deque()  # [bucket number, chunks reserved in it]
        self.owners: dict[int, ClientHolds] = {}  # promotion job -> the engine that asked
        self.results: dict[int, tuple[ClientHolds, bool]] = {}  # landed, not yet polled

    def _views(self, pool: torch.Tensor, base: int, shard: int) -> SlotViews:
        lay, cls_of = self.layout, self.geometry.slot_classes

        def views(group: int, slot: int) -> tuple[torch.Tensor, torch.Tensor]:
            cls = cls_of[group]
            c = lay.classes[cls]
            off = base + lay.offset(cls, slot, shard)
            row = base + shard * lay.shard_bytes + c.sums_offset + slot * 8 * c.sums_entries
            return pool[off : off + c.slot_bytes], pool[row : row + 8 * c.sums_entries]

        return views

    # -- the tier thread's round ------------------------------------------------------------
    def tick(self) -> None:
        """Take the shards' completions, then plan this round's demotions and deletes."""
        report = TierReport()
        for r in self.runners:
            for c in r.poll():
                report.take(c)
        if report.jobs or report.full:
            self.scheduler.on_report(report)
        plan = self.scheduler.take_plan(self._burst(time.monotonic()))
        if plan is not None:
            for job in plan.jobs:
                for r in self.runners:
                    r.submit(job)

    def _burst(self, now: float) -> int:
        bucket = int(now / BURST_BUCKET_S)
        if not self._buckets or self._buckets[-1][0] != bucket:
            self._buckets.append([bucket, 0])
        self._buckets[-1][1] += self.saves
        self.saves = 0
        while self._buckets[0][0] <= bucket - BURST_WINDOW_S / BURST_BUCKET_S:
            self._buckets.popleft()
        return max(n for _, n in self._buckets)

    # -- promotions -------------------------------------------------------------------------
    def promote(self, holds: ClientHolds, keys: list[bytes], num_tokens: int,
                hbm_tokens: int) -> list[int] | None:
        """Start promoting what the disk adds to the DRAM hit of ``keys``: [job, tokens it
        adds]; None if the disk adds nothing (or the in-flight bound is reached)."""
        dram = find_hit(self.index, self.geometry, keys, num_tokens, hbm_tokens)
        started = self.stack.promote("", keys, num_tokens, hbm_tokens, dram)
        if started is None:
            return None
        self.owners[started[0]] = holds
        return [started[0], started[1]]

    def _landed(self, _req: str, job: int, landed: list, lost: Sequence[str]) -> None:  # type: ignore[type-arg]
        ok = not lost
        holds = self.owners.pop(job, None)
        if holds is None:
            return  # its engine left: the chunks stay in the arena for the next lookup
        deadline = time.monotonic() + self.lease_ttl
        for e in landed:
            holds.lease(e, deadline)
        self.results[job] = (holds, ok)

    def promoted(self, holds: ClientHolds, jobs: list[int]) -> dict[int, bool]:
        """Of ``jobs`` (this engine's), those that landed: whether each verified whole."""
        out = {}
        for j in jobs:
            r = self.results.get(j)
            if r is not None and r[0] is holds:
                out[j] = r[1]
                del self.results[j]
        return out

    def forget(self, holds: ClientHolds) -> None:
        """The engine's connection closed: its promotions land for nobody."""
        for j in [j for j, h in self.owners.items() if h is holds]:
            del self.owners[j]
        for j in [j for j, r in self.results.items() if r[0] is holds]:
            del self.results[j]

    def stats(self) -> dict[str, object]:
        s = self.scheduler.stats
        cat = self.scheduler.catalog
        return {"stored": [cat.stored(g) for g in range(len(self.geometry.groups))],
                "capacity": cat.capacity, "demotions": s.demotions, "promotions": s.promotions,
                "checksum_failures": s.checksum_failures, "tier_full": s.tier_full,
                "demotions_dropped": s.demotions_dropped,
                "in_flight": len(self.scheduler.jobs)}

    def reset(self) -> None:
        self.scheduler.catalog.index.reset()  # the files go with the next round's deletes

    def close(self) -> None:
        for r in self.runners:
            r.close()


def pool_tensor(mapping: mmap.mmap) -> torch.Tensor:
    return torch.frombuffer(mapping, dtype=torch.uint8)
