"""Driving the engine as the worker does, timing it, and checking the bytes it moved.

One *phase* is every save, every load, or both at once of a :class:`~.cases.Cell`, submitted
per engine step (``tick``, loads, saves, ``poll``) and timed from the first enqueue to the last
completion, host work included.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kvtier.bench.transfer.cases import STEP_BYTES, Cell


@dataclass
class Phase:
    seconds: float
    nbytes: int
    jobs: int
    detail: dict[str, Any] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


def _job_bytes(cell: Cell, job: Any) -> int:
    return sum(cell.chunk_bytes[op.group] for op in job.ops)


def steps(cell: Cell, loads: list[Any], saves: list[Any]) -> list[tuple[list[Any], list[Any]]]:
    """(loads, saves) per engine step: whole jobs of at most :data:`STEP_BYTES` each way (at
    least one), so that both directions carry the same bytes per step and end together."""
    out: list[tuple[list[Any], list[Any]]] = []
    si = li = 0
    while si < len(saves) or li < len(loads):
        step_l, step_s, lb, sb = [], [], 0, 0
        while li < len(loads) and (not step_l or lb + _job_bytes(cell, loads[li]) <= STEP_BYTES):
            lb += _job_bytes(cell, loads[li])
            step_l.append(loads[li])
            li += 1
        while si < len(saves) and (not step_s or sb + _job_bytes(cell, saves[si]) <= STEP_BYTES):
            sb += _job_bytes(cell, saves[si])
            step_s.append(saves[si])
            si += 1
        out.append((step_l, step_s))
    return out


def stream_context(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Make ``stream`` current (None: stay on the current one, as on CPU)."""
    if stream is None:
        return contextlib.nullcontext()
    import torch

    return torch.cuda.stream(stream)


def run_phase(engine: Any, cell: Cell, kind: str, compute: Any, sync: Callable[[], None]
              ) -> Phase:
    """Submit the phase's jobs as the worker would (per step: ``tick``, loads, saves,
    ``poll``), wait for the last completion; the wall time runs from the first enqueue.
    Every job must be reported once, ok. Also records where the time went (``detail``)."""
    saves = cell.save_jobs if kind == "save" else cell.both_saves if kind == "both" else []
    loads = cell.load_jobs if kind in ("load", "both") else []
    expect = {j.job_id for j in saves} | {j.job_id for j in loads}
    got: dict[int, Any] = {}

    def collect() -> None:
        for c in engine.poll():
            if c.job_id in got or not c.ok:
                raise RuntimeError(f"job {c.job_id}: {'twice' if c.job_id in got else c.error}")
            got[c.job_id] = c

    schedule = steps(cell, loads, saves)
    engine.trace = []
    with stream_context(compute):
        sync()
        t0 = time.perf_counter()
        for step_l, step_s in schedule:
            engine.tick()
            for job in step_l:
                engine.load(job)
            for job in step_s:
                engine.save(job)
            collect()
        collect()  # flushes what is still queued
        t_enq = time.perf_counter()
        engine.drain()
        t1 = time.perf_counter()
    collect()
    if set(got) != expect:
        raise RuntimeError(f"{kind}: {len(expect - set(got))} jobs never reported")
    ph = Phase(t1 - t0, sum(c.nbytes for c in got.values()), len(got))
    trace, engine.trace = engine.trace, None
    ph.detail = {"host_enqueue_s": t_enq - t0, "batches": len(trace),
                 "host_in_batches_s": sum(b["host_s"] for b in trace)}
    with contextlib.suppress(Exception):  # GPU time from the first batch start to the last done
        first = trace[0]["start"]
        ph.detail["gpu_s"] = max(first.elapsed_time(b["done"]) for b in trace) / 1e3
    return ph


def warm(eng: Any, cell: Cell, idle: Any, sync: Callable[[], None]) -> None:
    """Compile kernels and touch every path once (a few jobs of each kind). The load reads
    slots the saves write, so it starts only once they completed (as the scheduler loads
    only saved chunks): in one step the load's copy could read a slot the save is still
    writing (a torn read; with ``--verify`` a checksum mismatch)."""
    from kvtier.protocol import Job

    def finish() -> None:
        eng.drain()
        for c in eng.poll():
            if not c.ok:
                raise RuntimeError(f"warm-up job failed: {c.error}")

    with stream_context(idle):
        eng.tick()
        for j in cell.save_jobs[:2]:
            eng.save(Job(j.job_id + 5 * 10**7, j.req_id, j.ops))
        finish()
        eng.tick()
        j = cell.load_jobs[0]
        eng.load(Job(j.job_id + 5 * 10**7, j.req_id, j.ops[:2]))
        finish()
    sync()


def _check_saved(cell: Cell, jobs: list[Any], kind: str, rng: random.Random, n: int) -> None:
    import torch

    from kvtier import codec

    slab = cell.mover.slab
    dev = cell.layout.groups[0].segments[0].storage.device
    for job in rng.sample(jobs, min(n, len(jobs))):
        for op in job.ops:
            g = cell.layout.groups[op.group]
            b = cell.mover.geometry.blocks_per_chunk(op.group)
            want = torch.empty(cell.chunk_bytes[op.group], dtype=torch.uint8, device=dev)
            codec.gather(g, op.block_ids, b, want)
            got = slab.view(op.group, op.slot)[: cell.chunk_bytes[op.group]]
            if not torch.equal(got, want.cpu()):
                raise AssertionError(f"{cell.geo.family}: {kind}: slot {op.slot} of "
                                     f"group {op.group} differs from the reference codec")


def _check_loaded(cell: Cell, rng: random.Random, n: int) -> None:
    import torch

    from kvtier import codec

    g0 = cell.layout.groups[0]
    bpc, cb = cell.mover.geometry.blocks_per_chunk(0), cell.chunk_bytes[0]
    dev = g0.segments[0].storage.device
    for job in rng.sample(cell.load_jobs, min(n, len(cell.load_jobs))):
        op = job.ops[0]
        got = torch.empty(cb, dtype=torch.uint8, device=dev)
        codec.gather(g0, op.block_ids, bpc, got)
        if not torch.equal(got.cpu(), cell.mover.slab.view(0, op.slot)[:cb]):
            raise AssertionError(f"{cell.geo.family}: load into {op.block_ids} differs "
                                 f"from slot {op.slot}")


def spot_check(cell: Cell, kind: str, n: int = 4) -> None:
    """Saved slots equal the reference codec's bytes; loaded blocks equal their slot."""
    rng = random.Random(n)
    if kind in ("save", "both"):
        _check_saved(cell, cell.save_jobs if kind == "save" else cell.both_saves, kind, rng, n)
    if kind == "load" and cell.geo.family != "hybrid":  # hybrid load blocks repeat
        _check_loaded(cell, rng, n)
