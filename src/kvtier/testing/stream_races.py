"""TEST ONLY: a stream-order race detector for :class:`kvtier.gpu.engine.CudaTransferEngine`
on CPU tensors.

:class:`~kvtier.testing.host_runtime.HostRuntime` runs every copy and kernel at once, so a
missing event between two streams is invisible on CPU: on a GPU the two accesses may run in
either order or at the same time. :class:`RaceCheckingRuntime` still runs everything at once
(the bytes stay checkable) but also keeps, per stream, a vector clock (advanced by every piece
of work enqueued on it, merged by ``wait_event``/``wait_stream``; an event carries its stream's
clock at ``record``; the host learns an event's clock when ``query``/``synchronize`` return),
and records what every piece of work reads and writes, as byte ranges:

- DMA descriptors (:meth:`copy`);
- every torch operator, through a ``TorchDispatchMode`` (:meth:`tracing`): work on the stream
  made current by :meth:`use` (the runtime's compute stream otherwise); operators touching
  only host memory (the slab, :meth:`pinned` buffers, what :meth:`host_memory` names) are the
  host's. A freshly allocated tensor is a write by the allocating stream, as the CUDA caching
  allocator hands memory out in that stream's order (and only in that stream's order);
- the engine's Triton kernel (:func:`traced_kernels`): the exact cache, staging, id and sums
  ranges of every work item, from its tile table, recorded instead of the interpreter's
  argument copies.

Two accesses to overlapping bytes, at least one a write, neither ordered before the other,
are a :class:`StreamRace` (raised at the second one, naming both). Work enqueued by the host
is ordered after everything the host did before (program order). Not seen: host reads and
writes through NumPy views (the id ring, the finished sums). The history is never pruned:
for tests of a few batches.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kvtier.gpu.dma import Descriptors, run_on_host
from kvtier.testing.host_runtime import HostRuntime


class StreamRace(AssertionError):
    """Two unordered accesses to the same bytes on different streams."""


@dataclass
class _Access:
    lo: int
    hi: int
    stream: str
    tick: int
    write: bool
    what: str


@dataclass
class TracedStream:
    name: str
    rt: RaceCheckingRuntime
    clock: dict[str, int] = field(default_factory=dict)
    cuda_stream: int = 0

    def wait_event(self, event: Any) -> None:
        _merge(self.clock, getattr(event, "clock", {}))

    def wait_stream(self, stream: Any) -> None:
        _merge(self.clock, dict(stream.clock))

    def __hash__(self) -> int:
        return id(self)


class TracedEvent:
    def __init__(self, rt: RaceCheckingRuntime) -> None:
        self.rt = rt
        self.clock: dict[str, int] = {}

    def record(self, stream: Any = None) -> None:
        s = stream if stream is not None else self.rt.current()
        _merge(s.clock, self.rt.host.clock)  # enqueued after what the host did so far
        self.clock = dict(s.clock)

    def query(self) -> bool:
        _merge(self.rt.host.clock, self.clock)
        return True

    def synchronize(self) -> None:
        _merge(self.rt.host.clock, self.clock)

    def elapsed_time(self, other: Any) -> float:
        return 0.0


def _merge(into: dict[str, int], other: dict[str, int]) -> None:
    for k, v in other.items():
        if into.get(k, 0) < v:
            into[k] = v


def _extent(t: torch.Tensor) -> tuple[int, int] | None:
    """The bytes a strided tensor spans (None: no storage or empty)."""
    if t.device.type != "cpu" or t.numel() == 0 or t.layout != torch.strided:
        return None
    span = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + span * t.element_size()


class RaceCheckingRuntime(HostRuntime):
    """A :class:`HostRuntime` that raises :class:`StreamRace` (see the module docstring)."""

    def __init__(self) -> None:
        self.compute = TracedStream("compute", self)
        self.host = TracedStream("host", self)
        self._current: list[TracedStream] = []
        self._n = 0
        self._history: list[_Access] = []
        self._host_ranges: list[tuple[int, int]] = []
        self._device_ranges: list[tuple[int, int]] = []
        self.accesses = 0
        self.races: list[str] = []  # every race found (the engine may catch the raise)

    # -- the Runtime interface ---------------------------------------------------------
    def stream(self, high_priority: bool = False) -> Any:
        self._n += 1
        return TracedStream(f"side{self._n}", self)

    def event(self, timing: bool = False) -> Any:
        return TracedEvent(self)

    def current(self) -> Any:
        return self._current[-1] if self._current else self.compute

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()

    def copy(self, desc: Descriptors, stream: Any) -> None:
        dst, src, size = desc
        ranges = [(int(s), int(s + n), False) for s, n in zip(src, size)]
        ranges += [(int(d), int(d + n), True) for d, n in zip(dst, size)]
        self.access(stream, ranges, "dma")
        run_on_host(desc)

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        with self.paused():
            t = torch.empty(n, dtype=dtype)
        ext = _extent(t)
        if ext is not None:
            self.allocated(self.host, t, ext, "pinned")
            self._host_ranges.append(ext)
        return t

    # -- bookkeeping -------------------------------------------------------------------
    def host_memory(self, *tensors: torch.Tensor) -> None:
        """Declare host memory (the slab, its tables): operators touching only it are the
        host's, not a stream's."""
        for t in tensors:
            ext = _extent(t)
            if ext is not None:
                self._host_ranges.append(ext)

    def device_memory(self, *tensors: torch.Tensor) -> None:
        """Declare device memory that exists before tracing (the KV cache, the engine's
        staging and tables); what streams allocate while tracing is device memory too."""
        for t in tensors:
            ext = _extent(t)
            if ext is not None:
                self._device_ranges.append(ext)

    def watch(self, engine: Any, *host: torch.Tensor) -> None:
        """Declare a :class:`~kvtier.gpu.engine.CudaTransferEngine`'s device memory (the KV
        cache, staging, id rings, tile tables) and the host memory ``host`` (the slab, its
        checksum tables where they are not inside it)."""
        self.host_memory(engine.mover.slab.buffer, *host)
        self.device_memory(*{id(s.storage): s.storage for g in engine.mover.layout.groups
                             for s in g.segments}.values())
        self.device_memory(engine.stage, engine._no_stage,
                           *[u.dev for u in engine._ids.values()],
                           *[g.tiles.tab for g in engine._groups if g.tiles is not None])

    def is_device(self, lo: int, hi: int) -> bool:
        return any(lo < b and a < hi for a, b in self._device_ranges)

    def allocated(self, stream: TracedStream, t: torch.Tensor, ext: tuple[int, int],
                  what: str) -> None:
        """Fresh memory ``t``: what happened to these bytes before is another tensor's story,
        and so is what happens after ``t`` is freed (the host may reuse them for NumPy)."""
        self._forget(ext)
        if stream is not self.host:
            self._device_ranges.append(ext)
        weakref.finalize(t, self._forget, ext)
        self.access(stream, [(ext[0], ext[1], True)], what)

    def _forget(self, ext: tuple[int, int]) -> None:
        lo, hi = ext
        self._history = [a for a in self._history if a.hi <= lo or hi <= a.lo]
        self._device_ranges = [r for r in self._device_ranges if r[1] <= lo or hi <= r[0]]
        self._host_ranges = [r for r in self._host_ranges if r[1] <= lo or hi <= r[0]]

    def access(self, stream: TracedStream, ranges: list[tuple[int, int, bool]],
               what: str) -> None:
        """One piece of work on ``stream``; raises on a race with earlier work."""
        if stream is not self.host:
            _merge(stream.clock, self.host.clock)
        stream.clock[stream.name] = stream.clock.get(stream.name, 0) + 1
        tick, seen = stream.clock[stream.name], stream.clock
        for lo, hi, write in ranges:
            if hi <= lo:
                continue
            for a in self._history:
                if a.hi <= lo or hi <= a.lo or not (write or a.write):
                    continue
                if a.stream == stream.name or seen.get(a.stream, 0) >= a.tick:
                    continue
                why = (f"{what} on {stream.name} {'writes' if write else 'reads'} "
                       f"[{lo:#x}, {hi:#x}) which {a.what} on {a.stream} "
                       f"{'wrote' if a.write else 'read'} ([{a.lo:#x}, {a.hi:#x})) with no "
                       "event ordering the two")
                self.races.append(why)
                raise StreamRace(why)
            self._history.append(_Access(lo, hi, stream.name, tick, write, what))
            self.accesses += 1

    @contextlib.contextmanager
    def tracing(self) -> Iterator[None]:
        """Record every torch operator run inside (see the module docstring)."""
        with _Tracer(self):
            yield

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        with torch.utils._python_dispatch._disable_current_modes():
            yield


class _Tracer(TorchDispatchMode):
    def __init__(self, rt: RaceCheckingRuntime) -> None:
        super().__init__()
        self.rt = rt

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _is_view_op(func):
            return out  # no bytes touched
        name = str(func)
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        mutated = _mutated(func, args, kwargs)
        ranges: list[tuple[int, int, bool]] = []
        for t in ins:
            ext = _extent(t)
            if ext is not None:
                ranges.append((*ext, any(t is m for m in mutated)))
        in_ptrs = {t.data_ptr() for t in ins}
        fresh = [(t, ext) for t in outs if t.data_ptr() not in in_ptrs
                 and (ext := _extent(t)) is not None]
        rt = self.rt
        on_device = any(rt.is_device(lo, hi) for lo, hi, _ in ranges)
        factory = not ins
        stream = rt.current() if on_device or factory else rt.host
        for t, ext in fresh:
            rt.allocated(stream, t, ext, f"{name} (allocation)")
        if ranges:
            rt.access(stream, ranges, name)
        return out


def _is_view_op(func: Any) -> bool:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return False
    ret = schema.returns
    return bool(ret) and ret[0].alias_info is not None and not ret[0].alias_info.is_write


def _mutated(func: Any, args: Any, kwargs: Any) -> list[torch.Tensor]:
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    out = []
    for i, a in enumerate(schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            if isinstance(v, torch.Tensor):
                out.append(v)
    return out


class _TracedKernel:
    """``kernels._move_kernel`` with its accesses recorded (see :func:`traced_kernels`)."""

    def __init__(self, rt: RaceCheckingRuntime, kernel: Any) -> None:
        self.rt = rt
        self.kernel = kernel

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kw: Any) -> Any:
            self.rt.access(self.rt.current(), _kernel_ranges(args, kw), "move kernel")
            with self.rt.paused():
                return self.kernel[grid](*args, **kw)
        return launch


def _kernel_ranges(args: Any, kw: dict[str, Any]) -> list[tuple[int, int, bool]]:
    """What one launch of ``_move_kernel`` reads and writes, per work item (its contract in
    :mod:`kvtier.gpu.kernels`)."""
    cache, stage, tab, ids, sums, stage_off, chunk_bytes, bpc, n_tiles, n_work = args[:10]
    to_stage, checksum, move = kw["TO_STAGE"], kw["CHECKSUM"], kw["MOVE"]
    rows = tab.cpu().numpy()
    blk_ids = ids.cpu().numpy()
    out: list[tuple[int, int, bool]] = []
    for t in (tab, ids):
        ext = _extent(t)
        if ext is not None:
            out.append((*ext, False))
    if checksum:
        out.append((sums.data_ptr(), sums.data_ptr() + 8 * n_work, True))
    cache0, stage0 = cache.data_ptr(), stage.data_ptr()
    for w in range(n_work):
        e, p = w % n_tiles, w // n_tiles
        blk = int(blk_ids[p])
        src0, stride, cpos, run, n = (int(x) for x in rows[e])
        if blk < 0:
            continue
        c, j = p // bpc, p % bpc
        co = cache0 + src0 + blk * stride
        so = stage0 + stage_off + c * chunk_bytes + cpos + j * run
        if to_stage or not move:
            out.append((co, co + n, False))
            if move:
                out.append((so, so + n, True))
        else:
            out.append((so, so + n, False))
            out.append((co, co + n, True))
    return _coalesce(out)


def _coalesce(ranges: list[tuple[int, int, bool]]) -> list[tuple[int, int, bool]]:
    out: list[tuple[int, int, bool]] = []
    for write in (False, True):
        rs = sorted((lo, hi) for lo, hi, w in ranges if w is write)
        for lo, hi in rs:
            if out and out[-1][2] is write and lo <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], hi), write)
            else:
                out.append((lo, hi, write))
    return out


@contextlib.contextmanager
def traced_kernels(rt: RaceCheckingRuntime) -> Iterator[None]:
    """Record the engine's kernel launches in ``rt`` (and run them untraced)."""
    from kvtier.gpu import kernels

    real = kernels._move_kernel
    kernels._move_kernel = _TracedKernel(rt, real)  # type: ignore[assignment]
    try:
        yield
    finally:
        kernels._move_kernel = real


