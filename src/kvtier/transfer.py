"""Moving bytes between the paged KV cache and slab slots, off the forward's critical path.

A :class:`TransferEngine` takes whole jobs (a chunk to save, a request to load) and reports
each through :meth:`poll`, success or failure: an exception inside a copy is a failed job,
never a lost one. Reports may come late, out of order or more than once; an engine whose
notices can get lost must answer :meth:`~TransferEngine.query` from ground truth (what
``event.query()`` is to CUDA). The worker turns that into exactly one report per job and rank. ``fence`` makes sure no compute that follows can overwrite the
blocks a save still reads.

:class:`ThreadedTransferEngine` runs the reference codec on a worker thread: torch's copies
release the GIL, so it overlaps the forward on CPU and serves as the correctness baseline
everywhere. The GPU engine (streams, events, batched DMA) lives in ``kvtier.gpu``.

Verified restores (:mod:`kvtier.checksum`, ``verify_checksums``): a save stores, in the slab's
checksum table, one checksum per block position of the slot as written; a load compares every
position it writes before it writes any (on CPU the scatter is a memcpy from the slot, so
checking the slot is end to end), and a mismatch fails the job with the corrupt slots in
:attr:`Completion.corrupt`. A verify job (:data:`~kvtier.protocol.JobKind.VERIFY`) checks a
request's slots in place and writes nothing.
"""

from __future__ import annotations

import concurrent.futures
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import numpy as np
import torch

from kvtier import checksum, codec
from kvtier.geometry import Geometry
from kvtier.layout import GroupLayout, Layout
from kvtier.protocol import SKIP, Job, JobKind, TransferOp
from kvtier.slab import HostSlab


@dataclass(frozen=True)
class Mismatch:
    """One slot whose bytes do not match its stored checksum: the block positions that
    differ (all of them for a chunk checksummed as one block)."""

    group: int
    slot_class: int
    slot: int
    blocks: tuple[int, ...]

    def __str__(self) -> str:
        return f"group {self.group} slot {self.slot} blocks {list(self.blocks)}"


class ChecksumMismatch(Exception):
    """Slots whose bytes did not verify; the job fails before anything is written."""

    def __init__(self, mismatches: Sequence[Mismatch]) -> None:
        self.mismatches = list(mismatches)
        super().__init__("checksum mismatch: " + "; ".join(str(m) for m in self.mismatches))


@dataclass
class Completion:
    """One job's terminal report from an engine, on one rank.

    ``nbytes``: the bytes the job moved over this rank's host link (0 when it failed).
    ``seconds``: its wall time, from the start of its first copy to the end of its last one,
    all its KV-cache groups and batches included: what the job cost in latency.
    ``link_seconds``: its share of this rank's link busy time. Jobs that share a batch, or
    otherwise move at once, split the time they overlap, so the ``link_seconds`` of any set
    of jobs add up to at most the time the link was busy with them, and their bytes over it
    to at most the rate the link achieved, never more. ``None``: the same as ``seconds``
    (an engine whose jobs never overlap: one at a time on one thread).
    """

    job_id: int
    kind: JobKind
    ok: bool
    nbytes: int
    seconds: float
    error: str = ""
    corrupt: list[Mismatch] = field(default_factory=list)  # a checksum failure, if any
    link_seconds: float | None = None

    @property
    def busy_seconds(self) -> float:
        """This job's share of the link's busy time (see the class docstring)."""
        return self.seconds if self.link_seconds is None else self.link_seconds


class LayerLoads(Protocol):
    """Loads started for the forward that reads them layer by layer
    (:meth:`TransferEngine.load_by_layer`). Their jobs complete and are reported by
    :meth:`TransferEngine.poll` like any load's."""

    def wait_layer(self, layer_index: int) -> None:
        """Order what the forward does next (the compute stream, or the host) after the
        bytes of every layer up to ``layer_index`` landed; never blocks the host on a
        device engine."""

    def synchronize(self) -> None:
        """Block the host until every copy of these loads ended (its completion is then
        in the next :meth:`TransferEngine.poll`)."""


class TransferEngine(ABC):
    @abstractmethod
    def save(self, job: Job) -> None:
        """Start copying the job's blocks into its slots (after this step's forward)."""

    @abstractmethod
    def load(self, job: Job) -> None:
        """Start copying the job's slots into its blocks."""

    def load_by_layer(self, jobs: Sequence[Job]) -> LayerLoads | None:
        """Start loads that the forward about to run reads, layer by layer, in layer order
        (the layout's segments are in layer order in each slot), or return None: this engine
        cannot, and the caller loads them with :meth:`load` and waits for them whole before
        the forward reads any. Jobs it rejects are reported failed by :meth:`poll`."""
        return None

    def verify(self, job: Job) -> None:
        """Start checking the job's slots against their checksums (nothing is written); the
        completion is a :data:`~kvtier.protocol.JobKind.VERIFY` one, ``corrupt`` set on a
        mismatch. Engines that cannot check on the host keep this default."""
        raise NotImplementedError(f"{type(self).__name__} cannot verify slots")

    @abstractmethod
    def fence(self, job_ids: Sequence[int]) -> int:
        """Order the next compute after the listed saves' reads. Returns how many were
        still pending (unknown or finished ids are fine)."""

    @abstractmethod
    def poll(self) -> list[Completion]:
        """Jobs finished since the last poll (a job may be reported again; never before it
        finished)."""

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        """Completions of the listed jobs that have finished, from ground truth. Engines
        whose :meth:`poll` never loses a report may keep this default."""
        return []

    @abstractmethod
    def pending(self) -> int: ...

    def tick(self) -> None:  # noqa: B027 - optional hook
        """One engine step began."""

    def wait(self, timeout: float) -> None:  # noqa: B027 - optional hook
        """Block up to ``timeout`` seconds, until a submitted job finished (at once when
        none is in flight). Engines whose copies need the host's Python (the CPU engine's
        thread) implement it, so that an engine loop with nothing to compute lets them run
        instead of polling them; engines whose copies run on a device keep this default."""

    @abstractmethod
    def drain(self) -> None:
        """Block until every submitted copy finished (shutdown, tests); completions are
        still reported by the next :meth:`poll`."""

    def slab_moved(self) -> None:  # noqa: B027 - optional hook
        """The mover's slab now lies in other memory (the node-wide store's new pool,
        :meth:`kvtier.slab.HostSlab.occupy`): forget anything derived from its old addresses
        or pinned ranges. Called after :meth:`drain`, with no job in flight or queued.
        Engines that read ``mover.slab`` at each copy (the CPU engine) keep this default."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


class EngineWrapper(TransferEngine):
    """An engine around another (``inner``): every call goes through unchanged unless a
    subclass overrides it. Wrappers stack (re-issued loads around test faults around the
    real engine), so a wrapper must pass on what it does not change, verify jobs included:
    subclass this rather than :class:`TransferEngine`. :meth:`load_by_layer` is the one call
    not passed on: under a wrapper, layer-by-layer loads go through :meth:`load` (whole, the
    forward waiting on the host), so the wrapper sees every load (a wrapper that keeps an
    engine's bands must override it and pass it on itself)."""

    def __init__(self, inner: TransferEngine) -> None:
        self.inner = inner

    def save(self, job: Job) -> None:
        self.inner.save(job)

    def load(self, job: Job) -> None:
        self.inner.load(job)

    def load_by_layer(self, jobs: Sequence[Job]) -> LayerLoads | None:
        return None  # not passed on: the caller loads them through load(), which this sees

    def verify(self, job: Job) -> None:
        self.inner.verify(job)

    def fence(self, job_ids: Sequence[int]) -> int:
        return self.inner.fence(job_ids)

    def poll(self) -> list[Completion]:
        return self.inner.poll()

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return self.inner.query(job_ids)

    def pending(self) -> int:
        return self.inner.pending()

    def tick(self) -> None:
        self.inner.tick()

    def wait(self, timeout: float) -> None:
        self.inner.wait(timeout)

    def drain(self) -> None:
        self.inner.drain()

    def slab_moved(self) -> None:
        self.inner.slab_moved()

    def close(self) -> None:
        self.inner.close()


E = TypeVar("E", bound=TransferEngine)


def find_engine(engine: TransferEngine | None, kind: type[E]) -> E | None:
    """The first engine of type ``kind`` in a stack of wrappers, outermost first."""
    while engine is not None:
        if isinstance(engine, kind):
            return engine
        engine = getattr(engine, "inner", None)
    return None


class ChunkMover:
    """The codec applied to one job's ops against one slab shard: chunk ``j`` of group ``g``
    is ``geometry.blocks_per_chunk(g)`` blocks of ``layout``'s group ``g``, in a slot of
    class ``geometry.slot_classes[g]``. ``verify``: saves write the slot's checksums and
    :meth:`check` compares them (off: neither)."""

    def __init__(self, layout: Layout, geometry: Geometry, slab: HostSlab, shard: int,
                 verify: bool = False) -> None:
        self.layout = layout
        self.geometry = geometry
        self.slab = slab
        self.shard = shard
        self.verify = verify
        self.slot_class = geometry.slot_classes
        self.blocks_per_chunk = tuple(geometry.blocks_per_chunk(g)
                                      for g in range(len(geometry.groups)))
        self._runs = [_checksum_runs(self.layout.groups[g], bpc)
                      for g, bpc in enumerate(self.blocks_per_chunk)]

    def save_op(self, op: TransferOp) -> int:
        group = self.layout.groups[op.group]
        dst = self.slab.view(self.slot_class[op.group], op.slot, self.shard)
        bpc = self.blocks_per_chunk[op.group]
        codec.gather(group, op.block_ids, bpc, dst)
        if self.verify:
            self.store_sums(op)
        return codec.chunk_bytes(group, bpc)

    def store_sums(self, op: TransferOp) -> None:
        """Checksum the op's slot as it is now and store the result in the slab's table."""
        cls = self.slot_class[op.group]
        stored = checksum.seal(self._sums(op.group, self.slab.view(cls, op.slot, self.shard)),
                               self.seed(op))
        self.slab.sums(cls, self.shard)[op.slot, : len(stored)] = torch.from_numpy(
            np.array(stored, dtype=np.uint64).view(np.int64))

    def load_op(self, op: TransferOp) -> int:
        group = self.layout.groups[op.group]
        src = self.slab.view(self.slot_class[op.group], op.slot, self.shard)
        bpc = self.blocks_per_chunk[op.group]
        if SKIP not in op.block_ids:
            codec.scatter(group, op.block_ids, bpc, src)
            return codec.chunk_bytes(group, bpc)
        codec.scatter_positions(group, op.block_ids, bpc, src)
        return group.bytes_per_block * sum(1 for b in op.block_ids if b != SKIP)

    # -- checksums ------------------------------------------------------------------------
    def seed(self, op: TransferOp) -> int:
        """The op's seed in this shard (the key digest mixed with group and shard)."""
        return checksum.shard_seed(op.seed, op.group, self.shard)

    def check(self, ops: Sequence[TransferOp], skip: bool = True) -> list[Mismatch]:
        """The ops' slots whose bytes do not match their stored checksums; ``skip``: block
        positions whose id is :data:`~kvtier.protocol.SKIP` are not compared (a load does not
        write them). Empty when verification is off."""
        if not self.verify:
            return []
        bad = []
        for op in ops:
            cls = self.slot_class[op.group]
            src = self.slab.view(cls, op.slot, self.shard)
            runs = self._runs[op.group]
            sums = self._sums(op.group, src)
            if runs is None:  # one checksum over the whole chunk: every position counts
                positions: Sequence[int] = [0]
            elif skip:
                positions = [j for j, b in enumerate(op.block_ids) if b != SKIP]
            else:
                positions = range(len(sums))
            stored = self.slab.sums(cls, self.shard)[op.slot].tolist()
            blocks = checksum.mismatched_blocks(stored, sums, self.seed(op), positions)
            if blocks:
                if runs is None:
                    blocks = list(range(self.blocks_per_chunk[op.group]))
                bad.append(Mismatch(op.group, cls, op.slot, tuple(blocks)))
        return bad

    def _sums(self, group: int, slot: torch.Tensor) -> list[int]:
        runs = self._runs[group]
        bpc = self.blocks_per_chunk[group]
        if runs is None:
            n = -(-codec.chunk_bytes(self.layout.groups[group], bpc) // 8) * 8
            return checksum.block_sums(slot[:n], None, 1)
        return checksum.block_sums(slot[: sum(runs) * bpc], runs, bpc)


def checksum_spec(layout: Layout, geometry: Geometry) -> list[list[object]]:
    """How a slot of each group is checksummed, as plain values (what a worker attaching to
    the node-wide store sends, so the store can check a slot before writing it to a tier):
    per group ``[runs or None, blocks per chunk, bytes checksummed when runs is None]``."""
    out: list[list[object]] = []
    for g in range(len(geometry.groups)):
        bpc = geometry.blocks_per_chunk(g)
        runs = _checksum_runs(layout.groups[g], bpc)
        whole = -(-codec.chunk_bytes(layout.groups[g], bpc) // 8) * 8
        out.append([runs, bpc, whole])
    return out


def _checksum_runs(group: GroupLayout, bpc: int) -> list[int] | None:
    """The runs a chunk of ``group`` is checksummed by, one checksum per block position; None
    where a run is not whole 8-byte words (then the whole chunk, rounded up to a word inside
    its slot, is one checksum)."""
    runs = [s.run for s in group.segments]
    return runs if all(r % 8 == 0 for r in runs) else None


class SlotVerifier:
    """Verify jobs (:data:`~kvtier.protocol.JobKind.VERIFY`) on a thread of their own, for an
    engine whose copies do not run on the host: every slot of the job is checked against its
    stored checksums (all block positions), nothing is written."""

    def __init__(self, mover: ChunkMover) -> None:
        self.mover = mover
        self._pool: ThreadPoolExecutor | None = None
        self._running: dict[int, Future] = {}

    def submit(self, job: Job) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-verify")
        self._running[job.job_id] = self._pool.submit(self._run, job)

    def _run(self, job: Job) -> Completion:
        t0 = time.perf_counter()
        try:
            bad = self.mover.check(job.ops, skip=False)
        except Exception as e:
            return Completion(job.job_id, JobKind.VERIFY, False, 0, time.perf_counter() - t0,
                              f"{type(e).__name__}: {e}")
        if bad:
            return Completion(job.job_id, JobKind.VERIFY, False, 0, time.perf_counter() - t0,
                              str(ChecksumMismatch(bad)), bad)
        return Completion(job.job_id, JobKind.VERIFY, True, 0, time.perf_counter() - t0)

    def poll(self) -> list[Completion]:
        out = []
        for job_id, fut in list(self._running.items()):
            if fut.done():
                del self._running[job_id]
                out.append(fut.result())
        return out

    def pending(self) -> int:
        return len(self._running)

    def drain(self) -> None:
        for fut in list(self._running.values()):
            fut.result()

    def close(self) -> None:
        self.drain()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


class ThreadedTransferEngine(TransferEngine):
    """Copies on one background thread, in submission order."""

    def __init__(self, mover: ChunkMover) -> None:
        self.mover = mover
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvtier-transfer")
        self._running: dict[int, tuple[JobKind, Future]] = {}

    def save(self, job: Job) -> None:
        self._start(JobKind.SAVE, job)

    def load(self, job: Job) -> None:
        self._start(JobKind.LOAD, job)

    def _start(self, kind: JobKind, job: Job) -> None:
        self._running[job.job_id] = (kind, self._pool.submit(self._run, kind, job))

    def verify(self, job: Job) -> None:
        self._start(JobKind.VERIFY, job)

    def _run(self, kind: JobKind, job: Job) -> Completion:
        t0 = time.perf_counter()
        nbytes = 0
        try:
            if kind is not JobKind.SAVE:  # every slot checked before any byte is written
                bad = self.mover.check(job.ops, skip=kind is JobKind.LOAD)
                if bad:
                    raise ChecksumMismatch(bad)
            if kind is not JobKind.VERIFY:
                move = self.mover.save_op if kind is JobKind.SAVE else self.mover.load_op
                for op in job.ops:
                    nbytes += move(op)
        except ChecksumMismatch as e:
            return Completion(job.job_id, kind, False, 0, time.perf_counter() - t0, str(e),
                              e.mismatches)
        except Exception as e:  # a failed copy is a failed job, reported like any other
            return Completion(job.job_id, kind, False, nbytes, time.perf_counter() - t0,
                              f"{type(e).__name__}: {e}")
        return Completion(job.job_id, kind, True, nbytes, time.perf_counter() - t0)

    def fence(self, job_ids: Sequence[int]) -> int:
        waited = 0
        for job_id in job_ids:
            entry = self._running.get(job_id)
            if entry is not None and entry[0] is JobKind.SAVE:
                if not entry[1].done():
                    waited += 1
                entry[1].result()  # CPU: the next forward runs on this host thread
        return waited

    def poll(self) -> list[Completion]:
        out = []
        for job_id, (_kind, fut) in list(self._running.items()):
            if fut.done():
                del self._running[job_id]
                out.append(fut.result())
        return out

    def pending(self) -> int:
        return len(self._running)

    def wait(self, timeout: float) -> None:
        futures = [fut for _, fut in self._running.values()]
        if futures:
            concurrent.futures.wait(futures, timeout, concurrent.futures.FIRST_COMPLETED)

    def drain(self) -> None:
        """Wait for everything submitted (shutdown and tests)."""
        for _, fut in list(self._running.values()):
            fut.result()

    def close(self) -> None:
        self.drain()
        self._pool.shutdown(wait=True)

