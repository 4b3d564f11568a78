"""The store's tiers below its DRAM pool (issue 18): the local disk and the remote server
(:mod:`kvtier.store.remote`), owned and moved by the store process, which reads and writes
the shared pool directly (engines move no tier bytes).

Contract:

- The tiers are the engine's stacked tiers (:class:`~kvtier.tiers.stack.TierStack`), top
  first: pool -> disk -> remote, pool -> disk, or pool -> remote. The disk takes what the
  pool evicts (demotion); the remote server takes every chunk an engine commits
  (write-through) and, alone below the pool, what it evicts; a chunk a promotion reads
  comes from the topmost tier holding it. Every demotion and write is asynchronous: planned
  by the store's tier thread every :data:`TICK_S` under the store's lock, its I/O on each
  tier's and shard's own thread (:class:`~kvtier.tiers.seam.TierRunner`); no request waits
  for a tier's I/O.
- ``kvtier store --disk-path DIR --disk-size SIZE``: the store holds ``DIR``'s lock
  (:class:`~kvtier.tiers.directory.DirectoryLock`: no engine or second store uses it) after
  the engine's disk tier's start-up checks (a local disk, ``SIZE`` free counting what kvtier
  already stores there).
- One namespace directory per namespace (:func:`kvtier.tiers.disk.namespace_dir`), and
  remote keys under the namespace (:class:`~kvtier.tiers.remote.RemoteKeys`), whose headers
  name it: engines of different layouts or models never read each other's chunks, in a
  tier as in the pool. A namespace's budget in each tier is the tier's size times its
  arena's share of the pool: a hard quota, like the arena.
- A chunk's tier copy holds, per shard, the slot's bytes then its row of the slot class's
  checksum table, so a promoted slot verifies on an engine's load exactly like a saved one.
  Every read is verified (the tier's own checksum); a chunk that does not is a miss,
  forgotten with its descendants and counted (``checksum_failures``).
- With ``verify`` (the namespace's engines store checksums: ``verify_checksums``) a
  demotion or write-through first checks the slot against its checksum row (a slot
  corrupted in the pool is not written, and is dropped from the pool with what hangs below
  it: ``demotions_corrupt``), as an engine's worker does.
- Promotion is asked by an engine's lookup (op ``promote``; first ``discover`` while a tier
  finds out what it holds: the remote server, for chunks another engine or an earlier store
  wrote): if the tiers extend the DRAM hit the store reserves slots, reads the chunks, and
  answers the engine's polls (op ``promoted``); on landing the chunks are leased to that
  engine as its lookups' are, so they are still there when it asks again. Nothing is
  promised before the chunks landed in the pool. The store promotes whenever the tiers
  extend the hit (no cost model: it does not know the engines' prefill rates).
- Warm restart: a namespace's disk tier is opened when its arena is created, from a scan of
  its directory (:func:`~kvtier.tiers.directory.scan`, no byte read), in the recency order
  of the files; chunks beyond the budget, orphans and partial chunks are deleted. The remote
  server's chunks are found by discovery.
- Namespaces with other than full-attention groups get no tiers (logged).
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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.checksum import block_sums, key_seed, mismatched_blocks, shard_seed
from kvtier.config import KvtierConfig, format_bytes
from kvtier.geometry import Geometry
from kvtier.index.base import Entry
from kvtier.index.memory import MemoryIndex
from kvtier.planner import CostEstimates, find_hit
from kvtier.slab import SlabLayout, SlotAllocator
from kvtier.store.leases import ClientHolds
from kvtier.store.pool import Arena
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost
from kvtier.tiers.directory import DirectoryLock, check_disk_path, scan
from kvtier.tiers.disk import DiskChunkStore, file_bytes, namespace_dir
from kvtier.tiers.remote_directory import RemoteDirectory
from kvtier.tiers.schedule import LowerTier
from kvtier.tiers.seam import (
    ChunkCorrupt,
    ChunkStore,
    TierJobKind,
    TierOp,
    TierReport,
    TierRunner,
)
from kvtier.tiers.stack import TierStack

if TYPE_CHECKING:
    from kvtier.store.remote import StoreRemote

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

    def __init__(self, path: str, size: int) -> None:
        check_disk_path(path, size, Path(path))  # counting every namespace's files there
        self.path, self.size = path, size
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


@dataclass
class StoreTiers:
    """The store's tiers below its pool, top first: the disk, the remote server (either, or
    both); ``max_pending_chunks``: chunks in flight to or from each tier per namespace."""

    disk: StoreDisk | None = None
    remote: StoreRemote | None = None
    max_pending_chunks: int = 256

    def describe(self) -> str:
        parts = [] if self.disk is None else [
            f"disk {format_bytes(self.disk.size)} at {self.disk.path}"]
        if self.remote is not None:
            parts.append(f"remote {self.remote.describe()}")
        return ", ".join(parts)

    def close(self) -> None:
        if self.disk is not None:
            self.disk.close()


class SpaceTier:
    """One namespace's tiers in the store (see the module doc). Every method but the I/O
    threads' runs under the store's lock."""

    def __init__(self, tiers: StoreTiers, namespace: bytes, geometry: Geometry,
                 layout: SlabLayout, arena: Arena, pool: torch.Tensor, index: MemoryIndex,
                 allocator: SlotAllocator, share: float, lease_ttl: float) -> None:
        """``share``: the arena's part of the pool (each tier's budget is that part of it)."""
        self.geometry, self.layout, self.index = geometry, layout, index
        self.lease_ttl = lease_ttl
        self.namespace = namespace
        self.chunk_bytes = [record_bytes(layout, c) for c in geometry.slot_classes]
        self.directory: RemoteDirectory | None = None
        lowers, stores = [], []
        if tiers.disk is not None:
            lowers.append(self._disk(tiers.disk, share))
            root = Path(lowers[-1].root)
            stores.append(lambda ns, shard, root=root: DiskChunkStore(root, shard, ns))
        if tiers.remote is not None:
            lower, self.directory = tiers.remote.lower(
                namespace, len(geometry.groups), layout.num_shards, self.chunk_bytes, share)
            lowers.append(lower)
            stores.append(tiers.remote.store)
        config = KvtierConfig(disk_max_pending_chunks=tiers.max_pending_chunks,
                              cost_model=False)
        estimates = CostEstimates(config.link_gbps, config.prefill_seconds_per_token,
                                  config.step_seconds)
        # the engine's stacked tiers: promotions, demotions, write-through (kvtier.tiers.stack)
        self.stack = TierStack(
            lowers, index, allocator, list(geometry.slot_classes), geometry, config, estimates,
            layout.num_shards, itertools.count(1), self._landed)
        self.checks: list[tuple[list[int] | None, int, int]] | None = None  # verify_with
        self.shard_views = [self._views(pool, arena.offset, s) for s in range(layout.num_shards)]
        self.runners: dict[str, list[ArenaTierRunner]] = {
            t.name: [ArenaTierRunner(make(namespace, shard), self.shard_views[shard],
                                     max_jobs=tiers.max_pending_chunks + 64,
                                     name=f"store-{t.name}",
                                     check_demoted=functools.partial(self._check_slot, shard))
                     for shard in range(layout.num_shards)]
            for t, make in zip(lowers, stores)}
        self.saves = 0  # chunks reserved in the arena since the last round
        self._buckets: deque[list[int]] = deque()  # [bucket number, chunks reserved in it]
        self.owners: dict[int, ClientHolds] = {}  # promotion job -> the engine that asked
        self.results: dict[int, tuple[ClientHolds, bool]] = {}  # landed, not yet polled
        self.asked: dict[ClientHolds, set[str]] = {}  # requests a discovery keeps state for

    def _disk(self, disk: StoreDisk, share: float) -> LowerTier:
        root = namespace_dir(disk.path, self.namespace)
        per_chunk = sum(file_bytes(b) for b in self.chunk_bytes) * self.layout.num_shards
        budget = int(disk.size * share)
        capacity = budget // per_chunk
        if capacity < 1:
            raise ValueError(f"the namespace's disk budget {format_bytes(budget)} holds no "
                             f"chunk ({format_bytes(per_chunk)} each)")
        catalog = TierCatalog(len(self.geometry.groups), capacity)
        t0 = time.perf_counter()
        rebuilt = catalog.rebuild(scan(root, self.layout.num_shards))
        logger.info("kvtier store: disk tier of a namespace at %s: %d chunks per group, %d "
                    "found and kept (%.3f s)", root, capacity, rebuilt,
                    time.perf_counter() - t0)
        return LowerTier("disk", str(root), self.namespace, catalog, TierCost(1.0, 0.0),
                         self.chunk_bytes)

    # -- a slot checked before a tier gets it ------------------------------------------------
    def verify_with(self, raw: Sequence[Sequence[object]]) -> None:
        """The namespace's workers store checksums (``verify_checksums``; ``raw``:
        :func:`kvtier.transfer.checksum_spec`): from now on each slot is checked against its
        row before a tier gets it."""
        if self.checks is None:
            self.checks = [(None if runs is None else [int(r) for r in runs],  # type: ignore[union-attr]
                            int(bpc), int(whole)) for runs, bpc, whole in raw]  # type: ignore[call-overload]
            logger.info("kvtier store: a namespace's slots are checked before a tier gets them")

    def _check_slot(self, shard: int, op: TierOp) -> None:
        """On a tier's I/O thread, before a demotion or write-through reads the slot: its
        bytes must match the checksums its save stored (ChunkCorrupt: not written, and the
        pool drops it with what hangs below it)."""
        checks = self.checks
        if checks is None:
            return
        runs, bpc, whole = checks[op.group]
        slot, row = self.shard_views[shard](op.group, op.slot)
        sums = block_sums(slot[:whole] if runs is None else slot[: sum(runs) * bpc], runs,
                          1 if runs is None else bpc)
        stored = row.numpy().view(np.int64).tolist()
        seed = shard_seed(key_seed(op.key), op.group, shard)
        bad = mismatched_blocks(stored, sums, seed, [0] if runs is None else range(len(sums)))
        if bad:
            raise ChunkCorrupt(f"the pool's copy does not match its checksums (shard {shard}, "
                               f"block positions {bad})")

    @property
    def names(self) -> list[str]:
        return [t.tier.name for t in self.stack.tiers]

    @property
    def discovers(self) -> bool:
        """A tier finds out what it holds by asking (the remote server: other engines'
        chunks, an earlier store's)."""
        return any(t.discovers for t in self.stack.tiers)

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
        """Take every tier's completions, then plan this round's demotions, write-through
        and deletes."""
        reports = {}
        for name, runners in self.runners.items():
            report = TierReport()
            for r in runners:
                for c in r.poll():
                    report.take(c)
            reports[name] = report
        self.stack.on_report(reports)
        for plan in self.stack.take_plans(self._burst(time.monotonic())):
            for job in plan.jobs:
                for r in self.runners[plan.name]:
                    r.submit(job)

    def write_back(self) -> bool:
        """One round of a graceful stop's write-back: every chunk of the pool the disk lacks
        goes to the disk (what is pinned stays), and the remote tier's write-through is
        finished; whether anything is left (call again after a moment)."""
        disk = self.stack.named("disk")
        left = disk.plan_write_back() if disk is not None else False
        self.tick()
        return left or self.stack.has_pending_work()

    def _burst(self, now: float) -> int:
        bucket = int(now / BURST_BUCKET_S)
        if not self._buckets or self._buckets[-1][0] != bucket:
            self._buckets.append([bucket, 0])
        self._buckets[-1][1] += self.saves
        self.saves = 0
        while self._buckets[0][0] <= bucket - BURST_WINDOW_S / BURST_BUCKET_S:
            self._buckets.popleft()
        return max(n for _, n in self._buckets)

    # -- writes -----------------------------------------------------------------------------
    def note_saved(self, entry: Entry) -> None:
        """An engine committed ``entry`` to the pool (the remote tier writes it through)."""
        self.stack.note_saved(entry)

    # -- promotions -------------------------------------------------------------------------
    @staticmethod
    def _request(holds: ClientHolds, req: str) -> str:
        return f"{id(holds)}/{req}"  # engines' request ids are their own

    def discovering(self, holds: ClientHolds, req: str, keys: list[bytes],
                    num_tokens: int) -> bool:
        """Whether a tier is still finding out which of ``keys`` it holds (the engine's
        lookup defers and asks again; state is kept until :meth:`forget_request`)."""
        self.asked.setdefault(holds, set()).add(req)
        return self.stack.discovering(self._request(holds, req), keys, num_tokens)

    def forget_request(self, holds: ClientHolds, req: str) -> None:
        self.asked.get(holds, set()).discard(req)
        self.stack.forget_request(self._request(holds, req))

    def promote(self, holds: ClientHolds, keys: list[bytes], num_tokens: int,
                hbm_tokens: int) -> list[object] | None:
        """Start promoting what the tiers add to the DRAM hit of ``keys``: [job, tokens it
        adds, those tokens per tier]; None if they add nothing (or a tier's in-flight bound
        is reached)."""
        dram = find_hit(self.index, self.geometry, keys, num_tokens, hbm_tokens)
        started = self.stack.promote("", keys, num_tokens, hbm_tokens, dram)
        if started is None:
            return None
        self.owners[started[0]] = holds
        return [started[0], started[1], started[2]]

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
        for req in self.asked.pop(holds, set()):
            self.stack.forget_request(self._request(holds, req))

    def stats(self) -> dict[str, dict[str, object]]:
        """Per tier name: stored chunks per group, capacity and counters."""
        out: dict[str, dict[str, object]] = {}
        for t in self.stack.tiers:
            s, cat = t.stats, t.catalog
            out[t.tier.name] = {
                "stored": [cat.stored(g) for g in range(len(self.geometry.groups))],
                "capacity": cat.capacity, "demotions": s.demotions,
                "promotions": s.promotions, "checksum_failures": s.checksum_failures,
                "tier_full": s.tier_full, "demotions_dropped": s.demotions_dropped,
                "demotions_corrupt": s.demotions_corrupt, "vanished": s.vanished,
                "in_flight": len(t.jobs)}
            remote = getattr(t, "remote", None)
            if remote is not None:
                out[t.tier.name].update(written_through=remote.written_through,
                                        write_through_dropped=remote.write_through_dropped,
                                        discovered=remote.discovered)
        return out

    def reset(self) -> None:
        self.stack.reset()  # the copies go with the next round's deletes

    def close(self) -> None:
        for runners in self.runners.values():
            for r in runners:
                r.close()
        if self.directory is not None:
            self.directory.close()


def pool_tensor(mapping: mmap.mmap) -> torch.Tensor:
    return torch.frombuffer(mapping, dtype=torch.uint8)
