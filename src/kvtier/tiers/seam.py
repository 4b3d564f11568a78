"""The tier seam: storage below the DRAM slab, and who moves its bytes.

A lower tier (local disk today, a remote store later) holds chunks the slab evicted. Its
metadata lives in the scheduler half, like the slab's (:mod:`kvtier.tiers.catalog`); its bytes
are moved by the worker processes, because the slab is private memory of the worker at TP=1:

- every rank reads and writes its own shard (a replicated layout keeps one shard, moved by
  rank 0 only), and a chunk counts as present on the tier only when every rank reported its
  write (the scheduler commits it then);
- the scheduler sends :class:`TierJob` s in the step plan; each rank's :class:`TierRunner` runs
  them on its own thread, in order (a delete after everything before it; up to the store's
  ``max_in_flight`` chunks move at once, the device's queue depth, consecutive jobs' too), and
  reports one :class:`TierCompletion` per job, which names the job and, when bytes did not
  verify, the op indexes (chunks) that failed; the queue is bounded (``max_jobs``), and a job
  past the bound fails at once, never waits;
- a tier is a :class:`ChunkStore`: put, get and delete of one shard's bytes of one chunk under
  ``(group, key)``. :class:`kvtier.tiers.disk.DiskChunkStore` is the disk;
  :class:`kvtier.tiers.fake.MemoryChunkStore` is a real in-memory store for unit tests.

Promotions (tier -> slab) land in slots the scheduler reserved; nothing is promised to the
engine before they are committed (docs/design.md §2.5: lower tiers land in the slab before any
GPU block is written). Demotions (slab -> tier) read slots the scheduler keeps from reuse until
the job is reported.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvtier.log import get_logger

logger = get_logger("tiers")


class TierJobKind(str, Enum):
    """What a tier job does: slab slots to the tier, the tier to slab slots, or forget chunks."""

    DEMOTE = "demote"
    PROMOTE = "promote"
    DELETE = "delete"

    def __str__(self) -> str:
        return str(self.value)


class ChunkCorrupt(Exception):
    """Stored bytes that do not verify (checksum, header, length): the chunk is a miss."""


class TierFull(Exception):
    """The tier has no room for the chunk (a full disk): the write is declined cleanly."""


@dataclass
class TierOp:
    """One chunk of one group: slab slot ``slot`` <-> the tier's copy of ``key``.

    ``parent`` is the key of the chunk before it (None for a prefix's first chunk): the tier
    stores it with the chunk, so its index can be rebuilt leaves-first after a restart.
    """

    group: int
    slot: int
    key: bytes
    parent: bytes | None = None


@dataclass
class TierJob:
    job_id: int
    kind: TierJobKind
    ops: list[TierOp]


@dataclass
class TierCompletion:
    job_id: int
    kind: TierJobKind
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    corrupt: list[int] = field(default_factory=list)  # op indexes whose bytes did not verify
    absent: list[int] = field(default_factory=list)  # promotion ops whose chunk was gone
    full: bool = False  # the tier declined a write for want of space
    error: str = ""
    tier: str = ""  # the runner's tier name (the ``tier`` label of its histograms)


@dataclass
class TierReport:
    """One step's tier completions, summed over ranks: [ok, failed] per job, the op indexes
    that did not verify on some rank, and the bytes and seconds of each direction."""

    jobs: dict[int, list[int]] = field(default_factory=dict)
    corrupt: dict[int, list[int]] = field(default_factory=dict)
    absent: dict[int, list[int]] = field(default_factory=dict)  # ops whose chunk was gone
    full: int = 0  # jobs a full tier declined
    corrupt_reads: int = 0
    bytes_promoted: int = 0
    promote_seconds: float = 0.0
    bytes_demoted: int = 0
    demote_seconds: float = 0.0
    # per job that moved bytes and succeeded: (tier, kind, bytes, seconds), for histograms
    observed: list[tuple[str, str, int, float]] = field(default_factory=list)

    def take(self, c: TierCompletion) -> None:
        ok, failed = self.jobs.setdefault(c.job_id, [0, 0])
        self.jobs[c.job_id] = [ok + c.ok, failed + (not c.ok)]
        if c.corrupt:
            known = self.corrupt.setdefault(c.job_id, [])
            known.extend(i for i in c.corrupt if i not in known)
            self.corrupt_reads += len(c.corrupt)
        if c.absent:
            gone = self.absent.setdefault(c.job_id, [])
            gone.extend(i for i in c.absent if i not in gone)
        self.full += c.full
        if c.ok and c.nbytes:
            self.observed.append((c.tier, c.kind.value, c.nbytes, c.seconds))
        if c.kind is TierJobKind.PROMOTE:
            self.bytes_promoted += c.nbytes
            self.promote_seconds += c.seconds
        else:
            self.bytes_demoted += c.nbytes
            self.demote_seconds += c.seconds

    def add(self, other: TierReport) -> TierReport:
        for job, (ok, failed) in other.jobs.items():
            cur = self.jobs.setdefault(job, [0, 0])
            cur[0] += ok
            cur[1] += failed
        for job, ops in other.absent.items():
            gone = self.absent.setdefault(job, [])
            gone.extend(i for i in ops if i not in gone)
        for job, ops in other.corrupt.items():
            known = self.corrupt.setdefault(job, [])
            known.extend(i for i in ops if i not in known)
        self.full += other.full
        self.observed.extend(other.observed)
        self.corrupt_reads += other.corrupt_reads
        self.bytes_promoted += other.bytes_promoted
        self.promote_seconds += other.promote_seconds
        self.bytes_demoted += other.bytes_demoted
        self.demote_seconds += other.demote_seconds
        return self


@dataclass
class TierPlan:
    """A step's jobs of one lower tier, and where the tier is: ``root`` (the namespace
    directory of the disk tier; the key prefix of the remote one), ``namespace`` (what every
    stored chunk's header must name) and ``name`` (which tier: ``disk`` or ``remote``,
    :data:`kvtier.tiers.TIER_NAMES`; each has its own store and I/O thread on the workers)."""

    root: str
    namespace: bytes
    jobs: list[TierJob] = field(default_factory=list)
    name: str = "disk"


class ChunkStore(ABC):
    """One shard's copies of chunks on one tier. Methods run on the tier's I/O thread, or on
    up to ``max_in_flight`` threads at once for distinct chunks of one job.

    Contract: ``put`` makes a chunk visible only whole (a crash mid-write leaves no chunk, or
    the old one); ``get`` verifies the bytes it returns (raises :class:`ChunkCorrupt`, never
    returns bytes that did not verify) and raises KeyError for an absent chunk. After a
    ``get`` that raised, ``out`` may hold unverified bytes (a store may read into it before
    verifying): the caller must not use them (a promotion's slot is then not committed).
    """

    max_in_flight: int = 1
    """How many puts or gets of distinct chunks may run at once (the queue depth a device
    needs to reach its bandwidth); 1: one at a time, on the runner's thread."""

    @abstractmethod
    def put(self, group: int, key: bytes, parent: bytes | None, data: torch.Tensor) -> int:
        """Store ``data`` (uint8) as this shard's copy of ``key``; returns bytes written.
        Raises :class:`TierFull` when there is no room."""

    @abstractmethod
    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        """Fill ``out`` (uint8, the chunk's length) with the verified copy; bytes read. On an
        exception ``out``'s contents are unspecified."""

    @abstractmethod
    def delete(self, group: int, key: bytes, parent: bytes | None) -> None:
        """Forget the chunk (absent is fine)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        pass


def _done(result: int, error: BaseException | None = None) -> Future[int]:
    f: Future[int] = Future()
    if error is None:
        f.set_result(result)
    else:
        f.set_exception(error)
    return f


SlotView = Callable[[int, int], torch.Tensor]
"""(group, slot) -> this rank's bytes of that slab slot (``slot_bytes`` long)."""


class _QueueEmpty:
    """No job is queued (a non-blocking take found none)."""


_QUEUE_EMPTY = _QueueEmpty()


@dataclass
class _JobRun:
    """One job on the I/O thread: its completion so far and the ops not started yet."""

    job: TierJob
    out: TierCompletion
    todo: Iterator[tuple[int, TierOp]]
    starting: bool = True  # ops may still start (False: all started, or the job stopped)
    stop: bool = False  # a failure: no more ops of this job start
    in_flight: int = 0
    t0: float = field(default_factory=time.perf_counter)


class TierRunner:
    """One rank's I/O for one tier: jobs run in submission order on one thread (their chunks
    on up to ``store.max_in_flight`` threads at once, across consecutive jobs, started in
    order; jobs reported in order).

    ``moves``: whether this rank moves bytes (False for ranks > 0 of a replicated layout: they
    report every job done without I/O, like their saves). ``max_jobs`` bounds the queue.
    ``on_promoted``: called on the I/O thread for every op whose slot a promotion filled
    with verified bytes (the worker stores the slot's slab checksums there).
    ``check_demoted``: called on the I/O thread before a demotion reads a slot; raises
    :class:`ChunkCorrupt` when the slot's bytes do not match their slab checksums (the
    worker checks them), so a chunk corrupted in DRAM is never written to the tier as good:
    the op is reported corrupt and the job's later ops (its descendants) are not written.
    """

    def __init__(self, store: ChunkStore, slot_view: SlotView, moves: bool = True,
                 max_jobs: int = 1024, name: str = "disk",
                 on_promoted: Callable[[TierOp], None] | None = None,
                 check_demoted: Callable[[TierOp], None] | None = None) -> None:
        self.store = store
        self.on_promoted = on_promoted
        self.check_demoted = check_demoted
        self.slot_view = slot_view
        self.moves = moves
        self.max_jobs = max_jobs
        self.name = name
        self._jobs: queue.Queue[TierJob | None] = queue.Queue()
        self._done: list[TierCompletion] = []
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # a job ended
        self._queued = 0
        self._promotions = 0  # promotion jobs queued or running
        self.corrupt_reads = 0  # chunks whose stored bytes did not verify, ever
        self.absent_reads = 0  # chunks a promotion found gone from the tier, ever
        self.corrupt_demotions = 0  # chunks not written: their DRAM bytes did not verify
        self.full_writes = 0  # writes declined for want of space, ever
        self._pool: ThreadPoolExecutor | None = None  # the store's puts and gets, in flight
        self._thread = threading.Thread(target=self._loop, name=f"kvtier-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: TierJob) -> None:
        """Queue a job; past ``max_jobs`` queued it fails at once (reported by :meth:`poll`)."""
        with self._lock:
            if self._queued >= self.max_jobs:
                if job.kind is not TierJobKind.DELETE:
                    self._done.append(TierCompletion(job.job_id, job.kind, False,
                                                     error="tier queue full"))
                return
            self._queued += 1
            self._promotions += job.kind is TierJobKind.PROMOTE
        self._jobs.put(job)

    def poll(self) -> list[TierCompletion]:
        with self._lock:
            out, self._done = self._done, []
        return out

    def pending(self) -> int:
        with self._lock:
            return self._queued

    def wait_promotions(self, timeout_s: float) -> None:
        """While a promotion is queued or running (a lookup waits for it), give this rank's
        I/O thread up to ``timeout_s``: an engine that spins through empty steps otherwise
        holds the GIL and starves the reads it waits for. Returns at once without one."""
        with self._lock:
            if self._promotions and not self._done:
                self._changed.wait(timeout_s)

    def drain(self, timeout: float = 60.0) -> None:
        """Wait until every queued job ran (shutdown, tests)."""
        end = time.monotonic() + timeout
        while self.pending() and time.monotonic() < end:
            time.sleep(0.001)

    def stop(self) -> None:
        """Run what is queued, then end the I/O threads; the store stays open."""
        self.drain()
        self._jobs.put(None)
        self._thread.join(timeout=10)
        if self._pool is not None:
            self._pool.shutdown(wait=True)

    def close(self) -> None:
        self.stop()
        self.store.close()

    # -- the I/O thread ---------------------------------------------------------------------
    # Ops are started in order, at most max_in_flight at once, and finished in order: a
    # demotion's slot check runs before its write is started, so a chunk after one that
    # failed its check (its descendants) is never written; past a failure nothing more of
    # that job starts, and what is in flight is waited for (it reads or fills slab slots).
    # The window spans jobs: the next promotion's or demotion's first ops start while the
    # last ops of the one before are still in flight (small jobs, one request's chunks each,
    # would otherwise never reach the device's queue depth, and every job would end with the
    # device idle). A delete waits for everything before it (a write then a delete of one
    # chunk stay in that order). Jobs are reported in submission order.
    def _loop(self) -> None:
        window: deque[tuple[_JobRun, int, TierOp, Future[int]]] = deque()
        runs: deque[_JobRun] = deque()  # begun, not reported; only the last may start ops
        held: TierJob | None = None  # a delete, waiting for everything before it
        closing = False
        while True:
            while held is None and not closing and len(window) < self._depth(TierJobKind.PROMOTE):
                if runs and runs[-1].starting:
                    self._start_next(runs[-1], window)
                    continue
                job = self._next_job(block=not window and not runs)
                if job is _QUEUE_EMPTY:
                    break
                if job is None:
                    closing = True
                elif job.kind is TierJobKind.DELETE:
                    held = job
                else:
                    runs.append(_JobRun(job, TierCompletion(job.job_id, job.kind, True,
                                                            tier=self.name),
                                        iter(enumerate(job.ops)), starting=self.moves))
            if window:
                self._finish_head(window)
            while runs and not runs[0].starting and runs[0].in_flight == 0:
                self._report(runs.popleft())
            if window or runs:
                continue
            if held is not None:
                if self.moves:
                    self._delete(held)
                self._report(_JobRun(held, TierCompletion(held.job_id, held.kind, True),
                                     iter(())))
                held = None
            elif closing:
                return

    def _delete(self, job: TierJob) -> None:
        for op in job.ops:
            try:
                self.store.delete(op.group, op.key, op.parent)
            except Exception as e:  # the rest waits for the next eviction of the chunks
                logger.warning("kvtier %s: deleting chunk %s failed: %s", self.name,
                               op.key.hex()[:12], e)
                return

    def _next_job(self, block: bool) -> TierJob | _QueueEmpty | None:
        """The next queued job (None: close), or ``_QUEUE_EMPTY`` without ``block``."""
        try:
            return self._jobs.get(block=block)
        except queue.Empty:
            return _QUEUE_EMPTY

    def _start_next(self, run: _JobRun, window: deque[tuple[_JobRun, int, TierOp,
                                                              Future[int]]]) -> None:
        nxt = next(run.todo, None) if not run.stop else None
        if nxt is None:
            run.starting = False
            return
        try:
            window.append((run, *nxt, self._start(run.job.kind, nxt[1])))
            run.in_flight += 1
        except Exception as e:
            run.stop = self._failed(run.out, run.job.kind, nxt[0], nxt[1], e)

    def _finish_head(self, window: deque[tuple[_JobRun, int, TierOp, Future[int]]]) -> None:
        run, i, op, pending = window.popleft()
        run.in_flight -= 1
        try:
            run.out.nbytes += pending.result()
            if run.job.kind is TierJobKind.PROMOTE and self.on_promoted is not None:
                self.on_promoted(op)
        except Exception as e:
            run.stop = self._failed(run.out, run.job.kind, i, op, e) or run.stop

    def _report(self, run: _JobRun) -> None:
        run.out.seconds = time.perf_counter() - run.t0
        kind = run.job.kind
        with self._lock:
            self._queued -= 1
            self._promotions -= kind is TierJobKind.PROMOTE
            if kind is not TierJobKind.DELETE:
                self._done.append(run.out)
            self._changed.notify_all()

    def _depth(self, kind: TierJobKind) -> int:
        return 1 if kind is TierJobKind.DELETE else max(1, self.store.max_in_flight)

    def _start(self, kind: TierJobKind, op: TierOp) -> Future[int]:
        """Start one demotion or promotion op: on the runner's thread when one at a time,
        else on the I/O pool."""
        if kind is TierJobKind.DEMOTE and self.check_demoted is not None:
            self.check_demoted(op)
        move = self._mover(kind, op)
        if self._depth(kind) == 1:
            try:
                return _done(move())
            except Exception as e:
                return _done(0, e)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.store.max_in_flight,
                                            thread_name_prefix=f"kvtier-{self.name}-io")
        return self._pool.submit(move)

    def _mover(self, kind: TierJobKind, op: TierOp) -> Callable[[], int]:
        """The I/O of one demotion or promotion op (run on the runner's thread or the I/O
        pool): the slot's bytes to or from the store. Subclasses that stage bytes override."""
        view = self.slot_view(op.group, op.slot)
        if kind is TierJobKind.DEMOTE:
            return functools.partial(self.store.put, op.group, op.key, op.parent, view)
        return functools.partial(self.store.get, op.group, op.key, op.parent, view)

    def _failed(self, out: TierCompletion, kind: TierJobKind, i: int, op: TierOp,
                e: Exception) -> bool:
        """Record op ``i``'s failure; whether the job stops starting ops."""
        if isinstance(e, ChunkCorrupt):
            out.ok = False
            out.corrupt.append(i)
            self._log_corrupt(kind, op, e)
            return kind is TierJobKind.DEMOTE  # the rest of a demotion: this chunk's descendants
        if isinstance(e, KeyError):  # the chunk is gone (evicted by the server, file removed)
            out.ok, out.error = False, f"KeyError: {e}"
            if kind is not TierJobKind.PROMOTE:
                return True
            out.absent.append(i)  # a miss: the scheduler forgets it, like a corrupt one
            self.absent_reads += 1
            return False
        if isinstance(e, TierFull):
            self.full_writes += 1
            out.ok, out.full, out.error = False, True, str(e)
            return True  # a full tier declines the rest of the job
        # an I/O error is a failed job, reported like any other
        out.ok, out.error = False, f"{type(e).__name__}: {e}"
        return kind is not TierJobKind.DELETE

    def _log_corrupt(self, kind: TierJobKind, op: TierOp, e: Exception) -> None:
        if kind is TierJobKind.DEMOTE:
            self.corrupt_demotions += 1
            n, what = self.corrupt_demotions, "its DRAM copy did not verify, not demoted"
        else:
            self.corrupt_reads += 1
            n, what = self.corrupt_reads, "did not verify, treated as a miss"
        if n <= 20 or n % 100 == 0:  # one line per chunk, bounded
            logger.warning("kvtier %s: chunk %s of group %d %s (%d so far): %s", self.name,
                           op.key.hex()[:12], op.group, what, n, e)
