"""The GPU data path: chunks between the paged KV cache and pinned slab slots at host-link speed.

Two ways to move a batch of chunks of one KV-cache group, chosen per group by piece size (a
*piece* is one segment's run of one block; see :mod:`kvtier.layout`):

- ``dma``: one copy-engine descriptor per piece, straight between the cache and the slots
  (merged where pieces continue each other), all of a batch in one ``cuMemcpyBatchAsync``.
  Uses no SMs. Good when pieces are large (the descriptor cost and the copy engine's per-copy
  overhead are paid per piece).
- ``kernel``: a Triton gather into a bounded device staging ring (:mod:`kvtier.gpu.kernels`),
  then one DMA per chunk (per run of adjacent slots) to the host; loads in reverse. Costs a
  short burst on up to ``max_programs`` programs (~0.6 ms per GiB on an H200), and the host
  submits one descriptor per chunk instead of one per piece. Good for small pieces.

``mode="auto"`` (default) takes ``kernel`` for a group whose smallest piece is below
``dma_min_piece`` (:data:`DMA_MIN_PIECE`, 256 KiB, measured: ``bench/notes/transfer.md``) and
``dma`` otherwise. Both produce exactly the bytes of :mod:`kvtier.codec`.

Ordering (docs/design.md §2.6, §2.9), with side streams and events only; the host never waits
(except, in theory, when the pinned id ring wraps onto an upload still in flight):

- A save reads its blocks after an event recorded on the compute stream when the save was
  submitted (the end of the step's forward). Saves are batched: :meth:`save` queues the job
  and the batch is enqueued at the next :meth:`poll`, :meth:`tick`, :meth:`fence`,
  :meth:`load` or :meth:`close`, or once :data:`FLUSH_BATCHES` batches of ``batch_bytes``
  are queued (a step's saves are validated in one pass, then cut into batches); every save of a batch
  reads after the event of the batch's first save, so a step's saves are submitted back to
  back after its forward (as the worker does) and a batch never spans a :meth:`tick`.
- :meth:`fence` makes the compute stream wait for the event after which the save no longer
  reads its blocks (end of the gather for ``kernel``, end of the DMA for ``dma``).
- A load waits for the event recorded on the compute stream by :meth:`tick` (the step's
  start; it lands after anything the step already queued on its blocks) and is reported by
  :meth:`poll` only once its last write completed; vLLM reads the blocks only after that.
- Staging is one device buffer of ``gpu_staging_size`` bytes, half per direction, reused in
  stream order: a batch waits on the GPU for the events of earlier batches whose bytes it
  overwrites. A direction's kernel-path batches take its ``kernel_streams`` kernel
  streams in turn (:data:`KERNEL_STREAMS`), so batches of one direction may gather or scatter
  out of order; each waits only for its own copy (and its staging's earlier users). Block ids reach the kernel through a pinned ring (at most a few MiB).

Every job is reported exactly once by :meth:`poll`: after all its copies completed, or as
failed (bad block ids or slots, an exception while enqueuing, a CUDA error, a checksum
mismatch) once nothing of it can still be writing.

Verified restores (``mover.verify``, :mod:`kvtier.gpu.verify`): on the kernel path the gather
and the scatter compute the checksum of what they move (fused); on the DMA path a cache-only
pass reads the blocks on the save-kernel stream concurrently with the save's DMA (its end is
one of the save's read events, so a fence waits for it too) and after the load's DMA (``done``
after it). On the kernel path the sums leave the device off the kernel stream: a save's after
its DMA, on the save's copy stream; a load's on a stream of their own (``load_sums``), after
an event at the end of its scatter. So the next batch's kernel never waits for a
device-to-host copy of sums, and a save's DMA never waits for one either. The sums reach the
host before ``done``; saves store them in the slab's table
before they are reported, loads compare them and fail on a mismatch with
:attr:`~kvtier.transfer.Completion.corrupt` set. A load has then written its blocks; the
failed report makes vLLM recompute them before anything reads them.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.config import KvtierConfig
from kvtier.gpu.dma import (
    Descriptors,
    SegmentTable,
    chunk_descriptors,
    merge_adjacent,
    piece_descriptors,
    split_at,
)
from kvtier.gpu.runtime import CudaRuntime, Runtime
from kvtier.gpu.verify import BatchCheck, Rows, host_store
from kvtier.layout import GroupLayout
from kvtier.log import get_logger
from kvtier.protocol import SKIP, Job
from kvtier.transfer import ChunkMover, Completion, Mismatch, SlotVerifier, TransferEngine

logger = get_logger("gpu.engine")

DMA_MIN_PIECE = 256 * 1024
"""Default of ``dma_min_piece``: groups whose smallest piece is below it use the kernel path.
Measured on the H200 (bench/notes/transfer.md, run 2): the driver spends ~0.5 µs of host time
per batched-DMA descriptor, so pieces of 64 KiB cost 42 % of a core per direction at 55 GB/s
and both directions at once became host-bound (60-85 GB/s against 93-96 with the kernel path);
the kernel path moved 54 GB/s each way from 8 KiB pieces up."""
BATCH_BYTES = 64 * 2**20
KERNEL_STREAMS = 1
"""Default of ``kernel_streams``: consecutive kernel-path batches of one direction alternate
between this many high-priority streams. Why (H200, ``bench/notes/transfer.md`` run 3): under
cuBLAS's persistent 8192^3 GEMM, which holds every SM for ~1.6 ms, a queued gather or scatter
runs only where a GEMM ends, and one stream lets one kernel through there (the next kernel of
the stream is still waiting on the first when the next GEMM takes the SMs): one 64 MiB batch
per GEMM, ~41 GB/s at most, and loads of small pieces measured 37-45. Two streams let the
kernels of two landed batches start at the same GEMM end; the same model puts that at ~52
(``tests/test_gpu_kernels.py`` checks the bytes and the stream order on CPU). Unmeasured on the
GPU until ``bench/gpu_layouts.sh`` runs; ``kernel_streams=1`` is the previous behaviour."""
FLUSH_BATCHES = 16
"""Queued saves are enqueued once this many batches' worth are queued (or at the next poll,
tick, fence or load): an 8,192-token prefill step of a Llama-8B (1 GiB) is checked and
addressed in one pass instead of one per 64 MiB batch, while the first batch of a larger one
still starts before the last save is queued."""
STAGE_ALIGN = 256
META_ENTRIES = 1 << 18
BAND_MIN_BYTES = 2**20
"""Layer-by-layer loads (:meth:`CudaTransferEngine.load_by_layer`) move a chunk in bands of
whole layers of at least this many bytes per chunk (one layer of a 16-block chunk of the
Llama-8B shape is 1 MiB): a band's copies stay large enough for the link, and a layer waits
only for the bands up to its own."""


@dataclass
class _Group:
    gid: int
    bpc: int
    num_blocks: int
    slot_class: int
    table: SegmentTable
    path: str  # "dma" | "kernel"
    tiles: Any = None  # kernels.TileTable for the kernel path, and with checksums
    host_check: bool = False  # checksums on the host (pieces not whole words)

    @property
    def chunk_bytes(self) -> int:
        return self.table.chunk_bytes


class _JobState:
    """One accepted job: its batches still running, the events after which the blocks of a
    save are no longer read (for fences), and its timing.

    A job's batches (one or more per group: a job moves all its groups, in batches of at most
    ``batch_bytes``) run one after another on the direction's streams. ``started`` is the
    start event of its first batch (``t0`` its host time, where events cannot time), so
    ``seconds`` is the wall time from its first copy's start to its last copy's end;
    ``link_seconds`` adds up its share, by bytes, of each batch's busy time (the batch's time
    less what overlapped the direction's previous batch), so that the shares of the jobs
    sharing a batch add up to that batch's busy time once (see :class:`Completion`)."""

    __slots__ = ("corrupt", "error", "kind", "link_seconds", "nbytes", "read_events",
                 "remaining", "seconds", "started", "t0")

    def __init__(self, kind: str, nbytes: int) -> None:
        self.kind = kind
        self.nbytes = nbytes
        self.remaining = 0
        self.error = ""
        self.read_events: list[Any] | None = None
        self.seconds = 0.0
        self.link_seconds = 0.0
        self.started: Any = None
        self.t0 = 0.0
        self.corrupt: list[Mismatch] = []


@dataclass
class _Band:
    """Consecutive layers of one group, moved together by a layer-by-layer load: ``group``
    is the engine's group over the band's segments alone, ``offset`` where the band's bytes
    start inside a slot (a slot holds a chunk segment by segment, in layer order)."""

    first_layer: int
    group: _Group
    offset: int


class _BandLoads:
    """The :class:`~kvtier.transfer.LayerLoads` of one step: per band, in layer order, the
    events after which its bytes are in the cache."""

    def __init__(self, rt: Runtime, first_layers: list[int], events: list[list[Any]]) -> None:
        self.rt = rt
        self.first_layers = first_layers
        self.events = events
        self.next = 0  # the first band no layer waited for yet

    def wait_layer(self, layer_index: int) -> None:
        n = len(self.first_layers)
        if self.next >= n or self.first_layers[self.next] > layer_index:
            return
        compute = self.rt.current()
        while self.next < n and self.first_layers[self.next] <= layer_index:
            for ev in self.events[self.next]:
                if ev is not None:  # None: the context is gone, nothing runs any more
                    compute.wait_event(ev)
            self.next += 1

    def synchronize(self) -> None:
        for band in self.events:
            for ev in band:
                if ev is not None:
                    with contextlib.suppress(RuntimeError):  # poll reports the error
                        ev.synchronize()


@dataclass(slots=True)
class _Batch:
    kind: str
    job_ids: list[int]
    done: Any  # None: the context is gone, nothing of the batch can still run
    start: Any
    t0: float
    error: str = ""
    warned: bool = False
    check: BatchCheck | None = None  # the batch's device checksums
    host_rows: Rows | None = None  # saves of a host-checked group: checksummed at the end
    shares: list[float] | None = None  # each job's part of the batch's bytes (job_ids order)


@dataclass
class _GroupWork:
    """The accepted ops of one group in one submission, as arrays."""

    ids: np.ndarray  # (n, bpc) int64
    slots: np.ndarray  # (n,) int64 slot numbers
    owners: list[int]  # job id of each op
    digests: np.ndarray | None = None  # (n,) uint64 key digests (TransferOp.seed)


class _Ring:
    """Offsets into a buffer of ``size`` bytes handed out round-robin. Whoever takes a range
    gets the events of the earlier users of any of its bytes, to wait for (on a stream for
    device memory, on the host for the pinned id ring).

    The live users' ranges never overlap (a range taken drops every user it overlaps), so
    they are kept sorted by address and a take finds the ones it overlaps by bisection: its
    cost does not grow with the users still live (up to ``size / n`` of them: thousands for
    the id ring between two wraps)."""

    def __init__(self, size: int, align: int) -> None:
        self.size = size
        self.align = align
        self.pos = 0
        self._starts: list[int] = []  # the live users' ranges [start, end), sorted
        self._ends: list[int] = []
        self._events: list[Any] = []

    def __len__(self) -> int:
        """The users whose ranges no take has overlapped yet."""
        return len(self._starts)

    def take(self, n: int) -> tuple[int, list[Any]]:
        if n > self.size:
            raise ValueError(f"{n} bytes asked of a ring of {self.size}")
        if self.pos + n > self.size:
            self.pos = 0
        a, b = self.pos, self.pos + n
        self.pos = -(-b // self.align) * self.align
        return a, self._drop(a, b)

    def give(self, a: int, n: int, event: Any) -> None:
        self._drop(a, a + n)  # taken already: nothing of it can still be live
        i = bisect.bisect_left(self._starts, a)
        self._starts.insert(i, a)
        self._ends.insert(i, a + n)
        self._events.insert(i, event)

    def _drop(self, a: int, b: int) -> list[Any]:
        """Forget the users overlapping [a, b); their events."""
        i = bisect.bisect_right(self._ends, a)  # the first whose range ends after a
        j = bisect.bisect_left(self._starts, b, lo=i)  # the first that starts at b or later
        if i >= j:
            return []
        waits = self._events[i:j]
        del self._starts[i:j], self._ends[i:j], self._events[i:j]
        return waits


class _IdUpload:
    """Block ids to the device through a pinned ring, on the current stream."""

    def __init__(self, rt: Runtime, entries: int = META_ENTRIES) -> None:
        self.rt = rt
        self.host = rt.pinned(entries, torch.int64)
        self.host_np = self.host.numpy()
        self.dev = torch.empty(entries, dtype=torch.int64, device=rt.device)
        self.ring = _Ring(entries, 2)  # 16-byte aligned: one kernel specialization

    def __call__(self, ids: np.ndarray) -> torch.Tensor:
        n = ids.size
        a, waits = self.ring.take(n)
        for ev in waits:  # an earlier upload of these entries still in flight: rare, short
            ev.synchronize()
        self.host_np[a:a + n] = ids.ravel()
        out = self.dev[a:a + n]
        out.copy_(self.host[a:a + n], non_blocking=True)
        ev = self.rt.event()
        ev.record(self.rt.current())
        self.ring.give(a, n, ev)
        return out


def _byte_shares(kind: str, g: _Group, ids: np.ndarray,
                 owners: list[int]) -> tuple[list[int], list[float]]:
    """The distinct jobs of a batch's rows (``owners``: each row's job) and each one's part of
    the bytes the batch moves: whole chunks for a save, the blocks not ``SKIP`` for a load."""
    rows = (np.full(len(owners), g.bpc) if kind == "save"
            else (ids != SKIP).sum(axis=1))
    per: dict[int, int] = {}
    for job_id, n in zip(owners, rows.tolist()):
        per[job_id] = per.get(job_id, 0) + int(n)
    total = sum(per.values())
    job_ids = list(per)
    if total <= 0:
        return job_ids, [1.0 / len(job_ids)] * len(job_ids)
    return job_ids, [per[j] / total for j in job_ids]


class CudaTransferEngine(TransferEngine):
    """Saves and loads of whole jobs on CUDA side streams (see the module docstring).

    ``mode``: ``auto`` | ``dma`` | ``kernel`` (``kernel`` falls back to ``dma`` for a group
    whose chunk does not fit a quarter of the staging). ``batch_bytes``: the most bytes one
    batch moves. ``max_programs``/``num_warps``: the gather kernel's grid cap and width (a
    launch's; up to ``kernel_streams`` launches of a direction may run at once).
    ``kernel_streams``: the streams a direction's kernel-path batches alternate between
    (:data:`KERNEL_STREAMS`); loads are unordered between batches (two loads in flight never
    write the same block: the scheduler loads into blocks no one reads until reported).
    ``runtime``: default a :class:`~kvtier.gpu.runtime.CudaRuntime` of the cache's device;
    tests pass :class:`kvtier.testing.host_runtime.HostRuntime` to run the same engine on CPU
    tensors.
    """

    def __init__(self, mover: ChunkMover, config: KvtierConfig, *, mode: str = "auto",
                 dma_min_piece: int = DMA_MIN_PIECE, batch_bytes: int = BATCH_BYTES,
                 max_programs: int = 256, num_warps: int = 4,
                 kernel_streams: int = KERNEL_STREAMS,
                 runtime: Runtime | None = None) -> None:
        if mode not in ("auto", "dma", "kernel"):
            raise ValueError(f"unknown transfer mode {mode!r} (auto, dma or kernel)")
        self.mover = mover
        self.config = config
        self.mode = mode
        self.batch_bytes = batch_bytes
        self.max_programs = max_programs
        self.num_warps = num_warps
        layout = mover.layout
        device = layout.groups[0].segments[0].storage.device
        if runtime is None:
            if device.type != "cuda":
                raise ValueError(f"the KV cache is on {device}, not on a CUDA device")
            runtime = CudaRuntime(device)
        self.rt = runtime
        if kernel_streams < 1:
            raise ValueError(f"kernel_streams must be at least 1, got {kernel_streams}")
        self._kernels = {kind: [runtime.stream(high_priority=True) for _ in
                                range(kernel_streams)] for kind in ("save", "load")}
        self._kernel_turn = {"save": 0, "load": 0}
        self.save_kernel, self.load_kernel = self._kernels["save"][0], self._kernels["load"][0]
        self.save_copy = runtime.stream()
        self.load_copy = runtime.stream()
        # a staged load's checksum copy-out: neither its kernel stream (the next batch's
        # kernel would wait for it) nor its copy stream (the next batch's upload would)
        self.load_sums = runtime.stream()
        self.verify_sums = mover.verify
        half = (int(config.gpu_staging_size) // 2) // STAGE_ALIGN * STAGE_ALIGN
        self._groups = [self._set_up_group(g, half, dma_min_piece) for g in
                        range(len(layout.groups))]
        # the bands of a layer-by-layer load, made at its first use (one group only)
        self._bands: list[_Band] | None = None
        need_stage = any(g.path == "kernel" for g in self._groups)
        self.stage = torch.empty(2 * half if need_stage else 0, dtype=torch.uint8,
                                 device=device)
        self._no_stage = torch.empty(8, dtype=torch.uint8, device=device)  # cache-only passes
        self._stage_ring = {"save": _Ring(half, STAGE_ALIGN), "load": _Ring(half, STAGE_ALIGN)}
        self._stage_base = {"save": 0, "load": half}
        self._ids = ({"save": _IdUpload(runtime), "load": _IdUpload(runtime)}
                     if need_stage or self.verify_sums else {})
        self._verifier = SlotVerifier(mover)
        self._slab_base = 0
        self._host_bounds = np.zeros(0, dtype=np.int64)
        self._slab_layout = mover.slab.layout
        self._take_slab()
        self._chunk_bytes = {g.gid: g.chunk_bytes for g in self._groups}
        self._queued: list[Job] = []
        self._queued_bytes = 0
        self._queued_after: Any = None
        self._jobs: dict[int, _JobState] = {}
        # In flight, per direction, in submission order. A direction's batches complete
        # nearly in order, so poll looks at the oldest ones only (never the whole list).
        self._inflight: dict[str, deque[_Batch]] = {"save": deque(), "load": deque()}
        self.trace: list[dict[str, Any]] | None = None  # set to a list to record batches
        self._ready: list[Completion] = []
        self._step_event: Any = None
        # per direction, the end of the batch finished last (for link busy time)
        self._last_done: dict[str, Any] = {"save": None, "load": None}

    # -- set-up -----------------------------------------------------------------------------
    def _set_up_group(self, gid: int, stage_half: int, dma_min_piece: int) -> _Group:
        """The segment table and path of one group; its chunk geometry is the mover's."""
        group = self.mover.layout.groups[gid]
        bpc = self.mover.geometry.blocks_per_chunk(gid)
        table = SegmentTable.of(group, bpc)
        fits = table.chunk_bytes <= stage_half // 2
        if self.mode == "dma" or not fits:
            path = "dma"
        elif self.mode == "kernel":
            path = "kernel"
        else:
            path = "kernel" if table.min_piece < dma_min_piece else "dma"
        g = _Group(gid, bpc, group.num_blocks, self.mover.geometry.slot_classes[gid], table,
                   path)
        if path == "kernel" or self.mover.verify:
            from kvtier.gpu.kernels import TileTable

            g.tiles = TileTable.build(group, bpc, stage_align=STAGE_ALIGN)
            g.host_check = self.mover.verify and g.tiles.vec < 8
        return g

    def _take_slab(self) -> None:
        """What the engine derives from the slab's host memory: its base address (every
        slot's address, :meth:`_slot_addrs`) and where each cudaHostRegister of it starts
        (copies must not straddle two, :func:`~kvtier.gpu.dma.split_at`). Nothing else here
        holds a slab address: descriptors are built per batch, the staging ring and the id
        upload are device and pinned memory of the engine's own, and checksums are stored
        through ``mover.slab`` when a batch finishes."""
        slab = self.mover.slab
        self._slab_base = slab.buffer.data_ptr()
        self._host_bounds = np.array(sorted(getattr(slab, "registered", ())[1:]),
                                     dtype=np.int64)
        self._slab_layout = slab.layout

    def slab_moved(self) -> None:
        """The slab is in a new mapping (the store's new pool): copy to and from it."""
        if self._queued or self._jobs:
            raise RuntimeError("the slab moved under jobs still queued or in flight")
        self._take_slab()

    def paths(self) -> list[str]:
        """The path each group takes (``dma`` or ``kernel``)."""
        return [g.path for g in self._groups]

    def warm_up(self) -> int:
        """Launch every kernel variant this engine will launch, once on each of its kernel
        streams, over one chunk of skipped block ids (-1): nothing is read or written, in the
        cache, the staging buffer or the slab. What runs is the one-time cost of a first
        launch: Triton's compile or its cache load and launcher, the id ring's first upload,
        each stream's first allocations. Called at start-up, it keeps that cost out of the
        first request: on the H200 the first request after a start took 70-300 ms longer
        than native's (session 12). Blocks until done; returns the launches made. Call it
        before the first job."""
        if self._queued or self._jobs:
            raise RuntimeError("warm_up after jobs were submitted")
        launches = 0
        for g in self._groups:
            if g.tiles is None:
                continue
            skipped = np.full(g.bpc, SKIP, dtype=np.int64)
            sums_on = self.verify_sums and not g.host_check
            for kind in ("save", "load"):
                if g.path == "dma" and not sums_on:
                    continue  # a DMA batch without checksums launches no kernel
                for kern in self._kernels[kind]:
                    with self.rt.use(kern):
                        ids = self._ids[kind](skipped)
                        sums = (torch.zeros(g.tiles.work_items(ids.numel()), dtype=torch.int64,
                                            device=self.rt.device) if sums_on else None)
                        if g.path == "kernel":
                            g.tiles.launch(self.stage, self._stage_base[kind], ids,
                                           kind == "save", self.max_programs, self.num_warps,
                                           sums=sums)
                        else:
                            g.tiles.launch(self._no_stage, 0, ids, False, self.max_programs,
                                           self.num_warps, sums=sums, move=False)
                        if sums is not None:
                            g.tiles.block_sums(sums, ids.numel())
                        done = self.rt.event()
                        done.record(kern)
                    done.synchronize()
                    launches += 1
        return launches

    # -- the TransferEngine interface ------------------------------------------------------
    def tick(self) -> None:
        self._flush()
        ev = self.rt.event()
        ev.record(self.rt.current())
        self._step_event = ev

    def save(self, job: Job) -> None:
        if not self._queued:
            self._queued_after = self.rt.event()
            self._queued_after.record(self.rt.current())
        self._queued.append(job)
        cb = self._chunk_bytes
        for op in job.ops:
            self._queued_bytes += cb.get(op.group, 0)
        if self._queued_bytes >= FLUSH_BATCHES * self.batch_bytes:
            self._flush()

    def load(self, job: Job) -> None:
        self._flush()
        after = self._step_event
        if after is None:
            after = self.rt.event()
            after.record(self.rt.current())
        self._submit("load", [job], after)

    def load_by_layer(self, jobs: Sequence[Job]) -> _BandLoads | None:
        """Load the jobs band by band (:data:`BAND_MIN_BYTES`, layer order), each band's
        batches after the step's start as any load's; the forward's wait for a layer makes
        the compute stream wait for the bands up to it. None (load them whole) for several
        groups or with checksums (verified per chunk, not per band)."""
        if len(self._groups) != 1 or self.verify_sums:
            return None
        if self._bands is None:
            self._bands = self._make_bands(self._groups[0])
        self._flush()
        after = self._step_event
        if after is None:
            after = self.rt.event()
            after.record(self.rt.current())
        work = self._accept("load", list(jobs)).get(0)
        events: list[list[Any]] = [[] for _ in self._bands]
        if work is not None and work.owners:
            queue = self._inflight["load"]
            addrs = self._slot_addrs(self._groups[0], work.slots)
            for band, done in zip(self._bands, events):
                g = band.group
                per = max(1, self.batch_bytes // g.chunk_bytes)
                if g.path == "kernel":
                    per = min(per, max(1, self._stage_ring["load"].size // 2 // g.chunk_bytes))
                for a in range(0, len(work.owners), per):
                    self._batch("load", g, work.ids[a:a + per], addrs[a:a + per] + band.offset,
                                work.owners[a:a + per], after)
                    done.append(queue[-1].done)
        return _BandLoads(self.rt, [b.first_layer for b in self._bands], events)

    def _make_bands(self, g: _Group) -> list[_Band]:
        """The group's segments cut into bands of whole layers, each at least
        :data:`BAND_MIN_BYTES` per chunk (the last may be smaller)."""
        group = self.mover.layout.groups[g.gid]
        segs = group.segments
        cuts, size = [0], 0
        for i, s in enumerate(segs):
            if (i > 0 and size >= BAND_MIN_BYTES
                    and s.layer_index != segs[i - 1].layer_index):
                cuts.append(i)
                size = 0
            size += s.run * g.bpc
        cuts.append(len(segs))
        bands = []
        for a, b in itertools.pairwise(cuts):
            part = GroupLayout(group.group_id, group.spec, segs[a:b])
            table = SegmentTable.of(part, g.bpc)
            band = _Group(g.gid, g.bpc, g.num_blocks, g.slot_class, table, g.path)
            if g.path == "kernel":
                from kvtier.gpu.kernels import TileTable

                band.tiles = TileTable.build(part, g.bpc, stage_align=STAGE_ALIGN)
            bands.append(_Band(segs[a].layer_index, band, int(g.table.chunk_off[a])))
        return bands

    def verify(self, job: Job) -> None:
        """On the host, on a thread of its own (the slots are host memory)."""
        self._verifier.submit(job)

    def fence(self, job_ids: Sequence[int]) -> int:
        wanted = set(job_ids)
        if any(j.job_id in wanted for j in self._queued):
            self._flush()
        compute = self.rt.current()
        waited = 0
        for job_id in job_ids:
            st = self._jobs.get(job_id)
            if st is None or st.kind != "save":
                continue
            pending = False
            for ev in st.read_events or ():
                if not ev.query():
                    pending = True
                compute.wait_event(ev)
            waited += pending
        return waited

    def poll(self) -> list[Completion]:
        self._flush()
        out, self._ready = self._ready, []
        out += self._verifier.poll()
        for queue in self._inflight.values():
            while queue:
                if not self._finish_batch(queue[0], out):
                    self._watch(queue[0])
                    break
                queue.popleft()
        return out

    STUCK_SECONDS = 30.0

    def _watch(self, b: _Batch) -> None:
        """A batch that does not complete is a bug or a hung device: say so, loudly, once.
        Its jobs are still not reported (their copies may yet write), per the contract."""
        age = time.perf_counter() - b.t0
        if age > self.STUCK_SECONDS and not b.warned:
            b.warned = True
            logger.error("kvtier: a %s batch of jobs %s has been in flight for %.0f s",
                         b.kind, b.job_ids[:16], age)

    def _finish_batch(self, b: _Batch, out: list[Completion]) -> bool:
        """Report the jobs of a completed batch (False: still running)."""
        err = b.error
        try:
            if b.done is not None and not b.done.query():
                return False
        except RuntimeError as e:  # a CUDA error: nothing of this batch runs any more
            err = err or f"{type(e).__name__}: {e}"
        now = time.perf_counter()
        secs = self._elapsed(b.start, b, err, now - b.t0)
        busy = self._busy(b, secs, err)
        jobs = self._jobs
        if not err:
            self._finish_checks(b)
        shares = b.shares or [1.0 / len(b.job_ids)] * len(b.job_ids)
        # a job's time runs from its first batch's start; jobs that started in this batch
        # (every one-chunk save) take the batch's own, one event query for all of them
        since: dict[int, float] = {id(b.start): secs}
        for job_id, share in zip(b.job_ids, shares):
            st = jobs.get(job_id)
            if st is None:
                continue
            if err and not st.error:
                st.error = err
            st.link_seconds += share * busy
            took = since.get(id(st.started))
            if took is None:
                took = since[id(st.started)] = self._elapsed(st.started, b, err, now - st.t0)
            st.seconds = max(st.seconds, took)
            st.remaining -= 1
            if st.remaining <= 0:
                del jobs[job_id]
                out.append(Completion(job_id, st.kind, not st.error,
                                      0 if st.error else st.nbytes, st.seconds, st.error,
                                      st.corrupt, st.link_seconds))
        return True

    def _busy(self, b: _Batch, secs: float, err: str) -> float:
        """The part of a completed batch's ``secs`` its direction's link was not already busy
        with the batch finished before it: a batch may start (its gather, its wait for the
        staging ring) while the one before it still copies. The busy parts of a direction's
        batches add up to the time any of them ran, each second once."""
        prev, self._last_done[b.kind] = self._last_done[b.kind], (
            b.done if not err and b.done is not None else None)
        if err or prev is None or b.done is None:
            return secs
        try:
            overlap = float(b.start.elapsed_time(prev)) / 1e3
        except RuntimeError:
            return secs
        return secs - min(max(overlap, 0.0), secs)

    @staticmethod
    def _elapsed(start: Any, b: _Batch, err: str, host_seconds: float) -> float:
        """Device seconds from the event ``start`` to the end of the completed batch ``b``
        (``host_seconds`` where the device cannot time them: an error, a lost context)."""
        if not err and b.done is not None and start is not None:
            with contextlib.suppress(RuntimeError):
                return float(start.elapsed_time(b.done)) / 1e3
        return host_seconds

    def _finish_checks(self, b: _Batch) -> None:
        """A completed batch's checksums: stored (saves) or compared (loads)."""
        slab, shard = self.mover.slab, self.mover.shard
        if b.host_rows is not None:
            host_store(self.mover, b.host_rows)
        if b.check is None:
            return
        if b.kind == "save":
            b.check.finish_save(slab, shard)
            return
        for job_id, bad in b.check.finish_load(slab, shard).items():
            st = self._jobs.get(job_id)
            if st is not None:
                st.corrupt += bad
                st.error = "checksum mismatch: " + "; ".join(str(m) for m in st.corrupt)

    def pending(self) -> int:
        return (len(self._queued) + len(self._jobs) + len(self._ready)
                + self._verifier.pending())

    def drain(self) -> None:
        """Enqueue everything queued and wait on the host until it completed (tests, bench,
        shutdown, a store's new epoch); the completions stay for :meth:`poll`. The batches
        are finished here (their checksums stored in, or compared with, the slab they
        copied), so that once this returns nothing of them touches the slab any more: it
        may move next (:meth:`slab_moved`)."""
        self._flush()
        self._verifier.drain()
        for b in (*self._inflight["save"], *self._inflight["load"]):
            if b.done is not None:
                with contextlib.suppress(RuntimeError):
                    b.done.synchronize()
        for queue in self._inflight.values():
            while queue and self._finish_batch(queue[0], self._ready):
                queue.popleft()

    def close(self) -> None:
        self.drain()
        self._verifier.close()
        for queue in self._inflight.values():
            queue.clear()
        self._jobs.clear()

    # -- bookkeeping ------------------------------------------------------------------------
    def _fail_now(self, kind: str, job: Job, error: str,
                  corrupt: list[Mismatch] | None = None) -> None:
        self._jobs.pop(job.job_id, None)
        self._ready.append(Completion(job.job_id, kind, False, 0, 0.0, error, corrupt or []))

    def _host_checked(self, job: Job) -> bool:
        """Loads touching host-checked groups: verified here, before anything is enqueued
        (False: the job failed)."""
        ops = [op for op in job.ops if self._groups[op.group].host_check]
        bad = self.mover.check(ops) if ops else []
        if bad:
            self._fail_now("load", job, "checksum mismatch: " + "; ".join(map(str, bad)), bad)
        return not bad

    def _flush(self) -> None:
        if not self._queued:
            return
        jobs, self._queued = self._queued, []
        self._queued_bytes = 0
        after, self._queued_after = self._queued_after, None
        self._submit("save", jobs, after)

    # -- validation and enqueueing ----------------------------------------------------------
    def _accept(self, kind: str, jobs: list[Job]) -> dict[int, _GroupWork]:
        """The ops of the jobs that pass every check, by group, as arrays. A job with any bad
        op fails as a whole, before anything of it is enqueued."""
        ids: dict[int, list[Sequence[int]]] = {}
        slots: dict[int, list[int]] = {}
        owners: dict[int, list[int]] = {}
        digests: dict[int, list[int]] = {}
        groups, states, load = self._groups, self._jobs, kind == "load"
        n_groups = len(groups)
        for job in jobs:
            job_id = job.job_id
            if job_id in states:  # a caller bug; its one report is the first's
                logger.warning("kvtier: %s job %d submitted again while in flight; ignored",
                               kind, job_id)
                continue
            nbytes = 0
            ops = job.ops
            try:
                for op in ops:
                    gid = op.group
                    if not 0 <= gid < n_groups:
                        raise ValueError(f"no KV-cache group {gid}")
                    g = groups[gid]
                    if len(op.block_ids) != g.bpc:
                        raise ValueError(f"{len(op.block_ids)} block ids for a {g.bpc}-block "
                                         f"chunk of group {g.gid}")
                    if load:
                        nbytes += g.chunk_bytes // g.bpc * (g.bpc - list(op.block_ids).count(SKIP))
                    else:
                        nbytes += g.chunk_bytes
            except Exception as e:  # a failed job, reported like any other
                self._fail_now(kind, job, f"{type(e).__name__}: {e}")
                continue
            if not ops:  # nothing to move
                self._ready.append(Completion(job_id, kind, True, 0, 0.0))
                continue
            if load and self.verify_sums and not self._host_checked(job):
                continue
            states[job_id] = _JobState(kind, nbytes)
            for op in ops:
                gid = op.group
                if gid not in ids:
                    ids[gid], slots[gid], owners[gid], digests[gid] = [], [], [], []
                ids[gid].append(op.block_ids)
                slots[gid].append(op.slot)
                owners[gid].append(job_id)
                digests[gid].append(op.seed)
        work: dict[int, _GroupWork] = {}
        bad: dict[int, str] = {}
        for gid in ids:
            g = groups[gid]
            w = _GroupWork(np.array(ids[gid], dtype=np.int64).reshape(-1, g.bpc),
                           np.array(slots[gid], dtype=np.int64), owners[gid],
                           np.array(digests[gid], dtype=np.uint64))
            for i, why in self._check(kind, g, w):
                bad.setdefault(w.owners[i], why)
            work[gid] = w
        if bad:
            self._reject(kind, bad, work)
        return work

    def _reject(self, kind: str, bad: dict[int, str], work: dict[int, _GroupWork]) -> None:
        """Fail the jobs in ``bad`` (job id -> why) and drop all their ops from ``work``."""
        for job_id, why in bad.items():
            self._jobs.pop(job_id, None)
            self._ready.append(Completion(job_id, kind, False, 0, 0.0, why))
        for w in work.values():
            keep = np.array([o not in bad for o in w.owners], dtype=bool)
            w.ids, w.slots = w.ids[keep], w.slots[keep]
            if w.digests is not None:
                w.digests = w.digests[keep]
            w.owners = [o for o in w.owners if o not in bad]

    def _check(self, kind: str, g: _Group, w: _GroupWork) -> list[tuple[int, str]]:
        """Indices of bad ops (vectorized): ids out of range, repeated within a chunk, SKIP
        in a save; slots out of range."""
        ids, slots = w.ids, w.slots
        skip = (ids == SKIP) if kind == "load" else np.zeros(ids.shape, dtype=bool)
        bad = (((ids < 0) & ~skip) | (ids >= g.num_blocks)).any(axis=1)
        if g.bpc > 1:
            srt = np.sort(np.where(skip, -1, ids), axis=1)
            bad |= ((srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)).any(axis=1)
        n_slots = self._slab_layout.classes[g.slot_class].num_slots
        bad |= (slots < 0) | (slots >= n_slots)
        return [(i, f"CodecError: bad chunk for group {g.gid}: block ids "
                    f"{ids[i].tolist()} (distinct, in [0, {g.num_blocks})"
                    f"{' or SKIP' if kind == 'load' else ''}), slot {int(slots[i])} "
                    f"(in [0, {n_slots}))") for i in np.flatnonzero(bad).tolist()]

    def _slot_addrs(self, g: _Group, slots: np.ndarray) -> np.ndarray:
        c = self._slab_layout.classes[g.slot_class]
        base = self._slab_base + self.mover.shard * self._slab_layout.shard_bytes + c.offset
        return (base + slots * c.stride).astype(np.int64)

    def _submit(self, kind: str, jobs: list[Job], after: Any) -> None:
        for gid, w in self._accept(kind, jobs).items():
            if not w.owners:
                continue
            g = self._groups[gid]
            addrs = self._slot_addrs(g, w.slots)
            per = max(1, self.batch_bytes // g.chunk_bytes)
            if g.path == "kernel":
                per = min(per, max(1, self._stage_ring[kind].size // 2 // g.chunk_bytes))
            for a in range(0, len(w.owners), per):
                rows = None
                if self.verify_sums:
                    assert w.digests is not None
                    rows = Rows(gid, g.slot_class, w.slots[a:a + per], w.digests[a:a + per],
                                w.ids[a:a + per], w.owners[a:a + per])
                self._batch(kind, g, w.ids[a:a + per], addrs[a:a + per],
                            w.owners[a:a + per], after, rows)

    def _batch(self, kind: str, g: _Group, ids: np.ndarray, slots: np.ndarray,
               owners: list[int], after: Any, rows: Rows | None = None) -> None:
        rt = self.rt
        job_ids, shares = _byte_shares(kind, g, ids, owners)
        check = (BatchCheck(rt, g.tiles, rows) if rows is not None and not g.host_check
                 else None)
        t0 = time.perf_counter()
        start, done = rt.event(timing=True), rt.event(timing=True)
        error = ""
        copy = self.save_copy if kind == "save" else self.load_copy
        kern = self._kernel_stream(kind)
        reads: list[Any] = []
        try:
            if g.path == "dma":
                reads = self._dma(kind, g, ids, slots, after, start, done, check, kern)
            elif kind == "save":
                reads = [self._save_staged(g, ids, slots, after, start, done, check, kern)]
            else:
                self._load_staged(g, ids, slots, after, start, done, check, kern)
        except Exception as e:  # enqueued work of this batch completes before the report
            error = f"{type(e).__name__}: {e}"
            try:
                copy.wait_stream(kern)
                done.record(copy)
            except Exception:  # the context is gone: nothing of it can still be running
                done = None
            reads = [done] if done is not None else []
        jobs = self._jobs
        track = bool(reads) and kind == "save"
        for job_id in job_ids:
            st = jobs[job_id]
            st.remaining += 1
            if st.started is None:
                st.started, st.t0 = start, t0
            if track:
                if st.read_events is None:
                    st.read_events = list(reads)
                else:
                    st.read_events += reads
        host_rows = rows if rows is not None and g.host_check and kind == "save" else None
        self._inflight[kind].append(_Batch(kind, job_ids, done, start, t0, error, False,
                                           check, host_rows, shares))
        if self.trace is not None:
            self.trace.append({"kind": kind, "path": g.path, "chunks": len(slots),
                               "bytes": len(slots) * g.chunk_bytes, "start": start,
                               "done": done, "host_s": time.perf_counter() - t0})

    def _kernel_stream(self, kind: str) -> Any:
        """The kernel stream of the direction's next batch: the next one in turn."""
        streams = self._kernels[kind]
        turn = self._kernel_turn[kind]
        self._kernel_turn[kind] = (turn + 1) % len(streams)
        return streams[turn]

    def _copy(self, desc: Descriptors, to_host: bool, stream: Any) -> None:
        """Merge adjacent pieces, never across a host-memory registration, and enqueue."""
        self.rt.copy(split_at(merge_adjacent(desc), to_host, self._host_bounds), stream)

    def _dma(self, kind: str, g: _Group, ids: np.ndarray, slots: np.ndarray, after: Any,
             start: Any, done: Any, check: BatchCheck | None, kern: Any) -> list[Any]:
        """One DMA batch; with ``check`` the cache-only checksum pass on the kernel stream:
        beside the DMA for a save (both only read the blocks), after it for a load. Returns
        the events after which a save no longer reads its blocks."""
        rt = self.rt
        save = kind == "save"
        copy = self.save_copy if save else self.load_copy
        copy.wait_event(after)
        start.record(copy)
        self._copy(piece_descriptors(g.table, ids, slots, save), save, copy)
        if check is None:
            done.record(copy)
            return [done]
        moved = rt.event()
        moved.record(copy)
        summed = rt.event()
        with rt.use(kern):
            kern.wait_event(after if save else moved)
            dev_ids = self._ids[kind](ids)
            g.tiles.launch(self._no_stage, 0, dev_ids, False, self.max_programs,
                           self.num_warps, sums=check.device_sums(), move=False)
            summed.record(kern)
            check.to_host()
            if not save:
                done.record(kern)
                return []
            on_host = rt.event()
            on_host.record(kern)
        copy.wait_event(on_host)
        done.record(copy)
        return [moved, summed]

    def _save_staged(self, g: _Group, ids: np.ndarray, slots: np.ndarray, after: Any,
                     start: Any, done: Any, check: BatchCheck | None, kern: Any) -> Any:
        rt = self.rt
        n = len(slots) * g.chunk_bytes
        ring = self._stage_ring["save"]
        off, waits = ring.take(n)
        copy = self.save_copy
        read = rt.event()
        with rt.use(kern):
            kern.wait_event(after)
            for ev in waits:
                kern.wait_event(ev)
            start.record(kern)
            dev_ids = self._ids["save"](ids)
            g.tiles.launch(self.stage, self._stage_base["save"] + off, dev_ids, True,
                           self.max_programs, self.num_warps,
                           sums=None if check is None else check.device_sums())
            read.record(kern)
            if check is not None:
                check.reduce()
            summed = rt.event()
            summed.record(kern)
        copy.wait_event(summed)
        stage_addr = self.stage.data_ptr() + self._stage_base["save"] + off
        self._copy(chunk_descriptors(stage_addr, g.chunk_bytes, slots, True), True, copy)
        if check is not None:  # after the DMA, on its stream: the kernel stream goes on
            with rt.use(copy):
                check.copy_out()
        done.record(copy)
        ring.give(off, n, done)
        return read

    def _load_staged(self, g: _Group, ids: np.ndarray, slots: np.ndarray, after: Any,
                     start: Any, done: Any, check: BatchCheck | None, kern: Any) -> None:
        rt = self.rt
        n = len(slots) * g.chunk_bytes
        ring = self._stage_ring["load"]
        off, waits = ring.take(n)
        copy = self.load_copy
        copy.wait_event(after)
        for ev in waits:
            copy.wait_event(ev)
        start.record(copy)
        stage_addr = self.stage.data_ptr() + self._stage_base["load"] + off
        self._copy(chunk_descriptors(stage_addr, g.chunk_bytes, slots, False), False,
                copy)
        landed = rt.event()
        landed.record(copy)
        with rt.use(kern):
            kern.wait_event(landed)
            dev_ids = self._ids["load"](ids)
            g.tiles.launch(self.stage, self._stage_base["load"] + off, dev_ids, False,
                           self.max_programs, self.num_warps,
                           sums=None if check is None else check.device_sums())
            if check is None:
                done.record(kern)
            else:
                check.reduce()
                reduced = rt.event()
                reduced.record(kern)
        if check is not None:
            sums = self.load_sums
            sums.wait_event(reduced)
            with rt.use(sums):
                check.copy_out()
            done.record(sums)
        ring.give(off, n, done)
