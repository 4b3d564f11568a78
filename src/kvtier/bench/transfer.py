"""``kvtier bench transfer``: the GPU data path against the host link.

For every layout family and chunk size, through :class:`kvtier.gpu.engine.CudaTransferEngine`
as the worker drives it (saves queued per step and flushed by ``poll``; loads of 16 MiB
jobs after ``tick``), on its ``dma`` and its ``kernel`` path::

    GB/s = bytes moved / wall time from the first enqueue to the last completion

over at least ``--gib`` GiB of randomly scattered block ids (host work, gather and bookkeeping
included), for saves alone, loads alone and both at once; then the same while a bf16
8192x8192x8192 GEMM loops on the default stream, with the GEMM's slowdown. Next to them, in
the same run: the pinned-memcpy ceiling (median of ``--reps`` 1 GiB copies each way and both
ways at once) and the naive path (one ``copy_`` per piece). Every measured transfer is
spot-checked against the reference codec. Writes a table (stdout and ``.md``), JSON and a PNG
under ``--out``.

Layout families (a chunk of target size C; where one block of the model is larger than C, the
cache is one rank's shard: KV heads split as by tensor parallelism, then layers as by a
pipeline stage; the actual chunk bytes are reported):

- ``mha``: Llama-3.1-8B (32 layers, 8 KV heads of 128, bf16, block 16), FlashAttention's
  ``(nb, 2, 16, heads, 128)`` per layer;
- ``mla_bf16`` / ``mla_fp8``: DeepSeek-V3 latent cache (61 layers), FlashMLA's
  ``(nb, 64, 576)`` bf16 or fp8 (uint8) rows, block 64;
- ``kv_fp8_scales``: Llama-3.1-8B shape, split K/V fp8 ``(2, nb, 16, heads, 128)`` (ROCm
  backends) with per-token-per-head float32 ``k_scale``/``v_scale`` ``(nb, 16, heads)`` on
  the layer;
- ``indexer``: the DeepSeek-V3.2 indexer cache alone, ``(nb, 64, 132)`` uint8 (61 layers);
- ``hybrid``: 4 attention layers ``(nb, 2, 16, 8, 128)`` bf16 plus a recurrent-state group of
  24 mamba2 layers (conv ``(3, 4352)`` + ssm ``(64, 64, 128)`` bf16 per layer, 24.6 MiB per
  state object); one state object per 16 MiB of KV. One block count serves both groups (as
  in vLLM), so its attention cache is small and blocks repeat across chunks.

Needs CUDA, except ``--smoke`` (tiny sizes on CPU tensors through the engine's host runtime
and ``TRITON_INTERPRET=1``; checks the code, not the speed).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

HELP = "GPU<->host KV transfer GB/s per layout and chunk size, vs the pinned-memcpy ceiling"

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
CHUNKS = (256 * KIB, 2 * MIB, 8 * MIB)
FAMILIES = ("mha", "mla_bf16", "mla_fp8", "kv_fp8_scales", "indexer", "hybrid")
DESIGN_CEILING = {"d2h": 55.3, "h2d": 55.4, "both": 99.2}  # DESIGN.md §3
STEP_BYTES = 64 * MIB  # saves submitted per engine step; bytes per load job
TARGETS = {"large": 0.90, "small": 0.75, "both": 0.80, "gemm_link": 0.80, "gemm_slow": 0.05}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", default="bench/results", help="folder for JSON, PNG and table")
    p.add_argument("--families", default=",".join(FAMILIES),
                   help=f"comma-separated subset of {','.join(FAMILIES)}")
    p.add_argument("--chunks", default="256KiB,2MiB,8MiB", help="chunk sizes")
    p.add_argument("--modes", default="dma,kernel", help="engine paths to measure")
    p.add_argument("--gib", type=float, default=1.0, help="GiB moved per measurement")
    p.add_argument("--reps", type=int, default=5, help="1 GiB copies per ceiling")
    p.add_argument("--no-gemm", action="store_true", help="skip the runs under a GEMM")
    p.add_argument("--dma-min-piece", default=None,
                   help="the auto path's threshold to report (default: the engine's)")
    p.add_argument("--tag", default="", help="extra text in the output file names")
    p.add_argument("--smoke", action="store_true",
                   help="tiny sizes on CPU (host runtime, TRITON_INTERPRET=1): checks the code")


# --- geometry --------------------------------------------------------------------------------

@dataclass
class Geometry:
    """One family at one chunk size: what to allocate and how chunks are made."""

    family: str
    chunk_target: int
    tensors: dict[str, Any]  # layer -> (shape, dtype) or list of them; see _allocate
    groups: list[tuple[str, int, list[str]]]  # (kind, block_size, layers)
    num_blocks: int
    bpc: list[int]
    scales: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    state_every: int = 0  # KV chunks per state object (hybrid)
    note: str = ""
    kv_cache_dtype: str = "auto"


def _shard(per_layer: Callable[[int], int], heads: int, layers: int, chunk: int,
           shardable: bool = True) -> tuple[int, int, str]:
    """(heads, layers, note): the fewest TP shards, then the fewest layers, so that one block
    is at most ``chunk`` bytes."""
    h, note = heads, ""
    while shardable and h > 1 and per_layer(h) * layers > chunk:
        h //= 2
    if h != heads:
        note = f"TP{heads // h} shard ({h} KV head{'s' if h > 1 else ''})"
    n = layers
    if per_layer(h) * n > chunk:
        n = max(1, chunk // per_layer(h))
        note = (note + ", " if note else "") + f"PP stage of {n} of {layers} layers"
    return h, n, note


def geometry(family: str, chunk: int, span: int, smoke: bool = False) -> Geometry:
    """The cache for ``family`` with chunks of about ``chunk`` bytes and at least ``span``
    bytes of distinct blocks (two sets: saves and loads)."""
    def nb_for(block_bytes: int) -> int:
        # Two disjoint sets (saves, loads) of whole chunks covering ``span`` each; odd and
        # above every other dimension, so the block axis is never ambiguous.
        bpc = bpc_for(block_bytes)
        chunks = -(-span // (bpc * block_bytes))
        return max(601, 2 * chunks * bpc + 8) | 1

    def bpc_for(block_bytes: int) -> int:
        return max(1, round(chunk / block_bytes))

    def attn(i: int) -> str:
        return f"model.layers.{i}.self_attn.attn"

    layers_llama, layers_ds = (32, 61) if not smoke else (4, 6)
    if family == "mha":
        def per(h: int) -> int:
            return 2 * 16 * h * 128 * 2
        h, n, note = _shard(per, 8, layers_llama, chunk)
        bb = per(h) * n
        nb = nb_for(bb)
        return Geometry(family, chunk, {attn(i): ((nb, 2, 16, h, 128), "bfloat16")
                                        for i in range(n)},
                        [("full", 16, [attn(i) for i in range(n)])], nb, [bpc_for(bb)],
                        note=note)
    if family in ("mla_bf16", "mla_fp8"):
        es = 2 if family == "mla_bf16" else 1
        dt = "bfloat16" if es == 2 else "uint8"
        _, n, note = _shard(lambda h: 64 * 576 * es, 1, layers_ds, chunk, shardable=False)
        bb = 64 * 576 * es * n
        nb = nb_for(bb)
        return Geometry(family, chunk, {attn(i): ((nb, 64, 576), dt) for i in range(n)},
                        [("full", 64, [attn(i) for i in range(n)])], nb, [bpc_for(bb)],
                        note=note, kv_cache_dtype="auto" if es == 2 else "fp8")
    if family == "kv_fp8_scales":
        def per(h: int) -> int:
            return 2 * 16 * h * 128 + 2 * 16 * h * 4
        h, n, note = _shard(per, 8, layers_llama, chunk)
        bb = per(h) * n
        nb = nb_for(bb)
        return Geometry(family, chunk, {attn(i): ((2, nb, 16, h, 128), "uint8")
                                        for i in range(n)},
                        [("full", 16, [attn(i) for i in range(n)])], nb, [bpc_for(bb)],
                        scales={attn(i): ((nb, 16, h), "float32") for i in range(n)},
                        note=note, kv_cache_dtype="fp8_e4m3")
    if family == "indexer":
        _, n, note = _shard(lambda h: 64 * 132, 1, layers_ds, chunk, shardable=False)
        bb = 64 * 132 * n
        nb = nb_for(bb)
        names = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(n)]
        return Geometry(family, chunk, {nm: ((nb, 64, 132), "uint8") for nm in names},
                        [("full", 64, names)], nb, [bpc_for(bb)], note=note)
    if family == "hybrid":
        n_attn, n_mamba = 4, (24 if not smoke else 2)
        conv, ssm = ((3, 4352), (64, 64, 128)) if not smoke else ((3, 64), (2, 8, 16))
        bb = n_attn * 2 * 16 * 8 * 128 * 2
        nb = 257 if not smoke else 17
        state = [f"model.layers.{i}.mixer" for i in range(n_attn, n_attn + n_mamba)]
        tensors: dict[str, Any] = {attn(i): ((nb, 2, 16, 8, 128), "bfloat16")
                                   for i in range(n_attn)}
        for nm in state:
            tensors[nm] = [((nb, *conv), "bfloat16"), ((nb, *ssm), "bfloat16")]
        bpc = bpc_for(bb)
        return Geometry(family, chunk, tensors,
                        [("full", 16, [attn(i) for i in range(n_attn)]),
                         ("state", 16 * bpc, state)],
                        nb, [bpc, 1], state_every=max(1, STEP_BYTES // (bpc * bb)),
                        note=f"{nb} blocks for both groups; blocks repeat across chunks")
    raise ValueError(f"unknown family {family!r}")


# --- one cell --------------------------------------------------------------------------------

class _Slab:
    """Slab slots over a slice of one pinned buffer (the engine needs ``plan`` and
    ``buffer``; the spot checks ``view``)."""

    def __init__(self, plan: Any, buffer: Any) -> None:
        self.plan = plan
        self.buffer = buffer[: plan.total_bytes]

    def view(self, cls: int, slot: int, shard: int = 0) -> Any:
        off = self.plan.offset(cls, slot, shard)
        return self.buffer[off: off + self.plan.classes[cls].slot_bytes]

    def close(self) -> None:
        pass


@dataclass
class Cell:
    geo: Geometry
    layout: Any
    mover: Any
    storages: list[Any]
    chunk_bytes: list[int]
    save_jobs: list[Any]  # slot set A
    load_jobs: list[Any]  # from slot set A into the load blocks
    both_saves: list[Any]  # into slot set B
    sizes: dict[str, int]


def _allocate(geo: Geometry, device: Any) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    import torch

    gen = torch.Generator(device=device).manual_seed(1)
    storages = []

    def make(shape: tuple[int, ...], dtype: str) -> Any:
        t = torch.empty(math.prod(shape) * getattr(torch, dtype).itemsize, dtype=torch.uint8,
                        device=device)
        t.random_(0, 256, generator=gen)  # never zeros
        storages.append(t)
        return t.view(getattr(torch, dtype)).view(shape)

    def page_views(specs: list[tuple[tuple[int, ...], str]]) -> list[Any]:
        """Several per-block tensors back to back in one page per block (how vLLM lays out
        a mamba layer's conv and ssm state)."""
        nb = specs[0][0][0]
        sizes = [math.prod(sh[1:]) * getattr(torch, dt).itemsize for sh, dt in specs]
        raw = make((nb * sum(sizes),), "uint8")
        out, off = [], 0
        for (shape, dt), size in zip(specs, sizes):
            dtype = getattr(torch, dt)
            inner = torch.empty(shape[1:], device="meta").stride()
            out.append(torch.as_strided(raw.view(dtype), shape,
                                        (sum(sizes) // dtype.itemsize, *inner),
                                        off // dtype.itemsize))
            off += size
        return out

    kv: dict[str, Any] = {}
    for name, spec in geo.tensors.items():
        kv[name] = make(*spec) if isinstance(spec, tuple) else page_views(spec)
    layers: dict[str, Any] = {}
    for name, (shape, dtype) in geo.scales.items():
        obj = type("Layer", (), {})()
        obj.k_scale = make(shape, dtype)
        obj.v_scale = make(shape, dtype)
        layers[name] = obj
    return kv, layers, storages


def build_cell(geo: Geometry, device: Any, pinned: Any, span: int, seed: int) -> Cell:
    from kvtier.layout import GroupKind, GroupSpec, build_layout
    from kvtier.ops import Job, TransferOp
    from kvtier.slab import ALIGN, SizeClass, SlabPlan
    from kvtier.transfer import ChunkMover

    kv, layers, storages = _allocate(geo, device)
    specs = [GroupSpec(GroupKind(kind), bs, tuple(names)) for kind, bs, names in geo.groups]
    layout = build_layout(kv, specs, geo.num_blocks, kv_cache_dtype=geo.kv_cache_dtype,
                          layers=layers)
    cbytes = [g.bytes_per_block * b for g, b in zip(layout.groups, geo.bpc)]
    kv_cb = cbytes[0]
    state_cb = cbytes[1] if len(cbytes) > 1 else 0
    per_boundary = kv_cb + (state_cb / geo.state_every if geo.state_every else 0)
    n_chunks = max(2, math.ceil(span / per_boundary))
    n_states = -(-n_chunks // geo.state_every) if geo.state_every else 0
    classes, pos = [], 0
    for i, (cb, n) in enumerate(((kv_cb, n_chunks), (state_cb, n_states))):
        if not cb:
            continue
        stride = -(-cb // ALIGN) * ALIGN
        classes.append(SizeClass(f"c{i}", cb, stride, 2 * n, pos))
        pos += stride * 2 * n
    plan = SlabPlan(tuple(classes), pos, 1)
    if plan.total_bytes > pinned.numel():
        raise RuntimeError(f"{geo.family}: needs {plan.total_bytes} pinned bytes, "
                           f"have {pinned.numel()}")
    slab = _Slab(plan, pinned)
    mover = ChunkMover(layout, slab, 0, list(range(len(layout.groups))), geo.bpc)
    rng = random.Random(seed)
    nb = geo.num_blocks
    perm = list(range(nb))
    rng.shuffle(perm)
    save_blocks, load_blocks = perm[: nb // 2], perm[nb // 2:]
    bpc = geo.bpc[0]

    def rows(pool: list[int], n: int) -> list[list[int]]:
        out, i = [], 0
        for _ in range(n):
            if i + bpc > len(pool):  # the hybrid's small block count: blocks repeat
                rng.shuffle(pool)
                i = 0
            out.append(pool[i:i + bpc])
            i += bpc
        return out

    src, dst = rows(save_blocks, n_chunks), rows(load_blocks, n_chunks)
    state_src = [rng.choice(save_blocks) for _ in range(n_states)]
    state_dst = [rng.choice(load_blocks) for _ in range(n_states)]

    def saves(first_slot: int, base_id: int) -> list[Any]:
        jobs = []
        for c in range(n_chunks):
            ops = [TransferOp(0, first_slot + c, src[c])]
            if geo.state_every and c % geo.state_every == geo.state_every - 1:
                k = c // geo.state_every
                ops.append(TransferOp(1, (first_slot // n_chunks) * n_states + k,
                                      [state_src[k]]))
            jobs.append(Job(base_id + c, f"s{c}", ops, chunk=c))
        return jobs

    per_job = max(1, STEP_BYTES // kv_cb)
    loads = []
    for j, a in enumerate(range(0, n_chunks, per_job)):
        ops = [TransferOp(0, c, dst[c]) for c in range(a, min(n_chunks, a + per_job))]
        for c in range(a, min(n_chunks, a + per_job)):
            if geo.state_every and c % geo.state_every == geo.state_every - 1:
                k = c // geo.state_every
                ops.append(TransferOp(1, k, [state_dst[k]]))
        loads.append(Job(10**7 + j, f"l{j}", ops))
    g0 = layout.groups[0]
    sizes = {"chunk_bytes": kv_cb, "bytes_per_block": g0.bytes_per_block,
             "blocks_per_chunk": bpc, "pieces_per_chunk": len(g0.segments) * bpc,
             "min_piece": min(s.run for s in g0.segments),
             "max_piece": max(s.run for s in g0.segments), "segments": len(g0.segments),
             "num_blocks": nb, "chunks": n_chunks, "state_objects": n_states,
             "state_bytes": state_cb, "cache_bytes": sum(int(s.numel()) for s in storages)}
    return Cell(geo, layout, mover, storages, cbytes, saves(0, 0), loads,
                saves(n_chunks, 2 * 10**7), sizes)


# --- measuring -------------------------------------------------------------------------------

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


def run_phase(engine: Any, cell: Cell, kind: str, compute: Any, sync: Callable[[], None]
              ) -> Phase:
    """Submit the phase's jobs as the worker would (per step: ``tick``, loads, saves,
    ``poll``), wait for the last completion; the wall time runs from the first enqueue.
    Every job must be reported once, ok. Also records where the time went (``detail``)."""
    import torch

    saves = cell.save_jobs if kind == "save" else cell.both_saves if kind == "both" else []
    loads = cell.load_jobs if kind in ("load", "both") else []
    expect = {j.job_id for j in saves} | {j.job_id for j in loads}
    got: dict[int, Any] = {}

    def collect() -> None:
        for c in engine.poll():
            if c.job_id in got or not c.ok:
                raise RuntimeError(f"job {c.job_id}: {'twice' if c.job_id in got else c.error}")
            got[c.job_id] = c

    # Steps: whole jobs of at most STEP_BYTES each way (at least one), so that both
    # directions carry the same bytes per step and end together.
    steps: list[tuple[list[Any], list[Any]]] = []
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
        steps.append((step_l, step_s))
    ctx = torch.cuda.stream(compute) if compute is not None else _null()
    engine.trace = []
    with ctx:
        sync()
        t0 = time.perf_counter()
        for step_l, step_s in steps:
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


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *a: object) -> None:
        return None


def spot_check(cell: Cell, kind: str, n: int = 4) -> None:
    """Saved slots equal the reference codec's bytes; loaded blocks equal their slot."""
    import torch

    from kvtier import codec

    rng = random.Random(n)
    slab = cell.mover.slab
    g0 = cell.layout.groups[0]
    bpc = cell.geo.bpc[0]
    cb = cell.chunk_bytes[0]
    dev = g0.segments[0].storage.device
    if kind in ("save", "both"):
        jobs = cell.save_jobs if kind == "save" else cell.both_saves
        for job in rng.sample(jobs, min(n, len(jobs))):
            for op in job.ops:
                g = cell.layout.groups[op.group]
                b = bpc if op.group == 0 else 1
                want = torch.empty(cell.chunk_bytes[op.group], dtype=torch.uint8, device=dev)
                codec.gather(g, op.block_ids, b, want)
                got = slab.view(op.group, op.slot)[: cell.chunk_bytes[op.group]]
                if not torch.equal(got, want.cpu()):
                    raise AssertionError(f"{cell.geo.family}: {kind}: slot {op.slot} of "
                                         f"group {op.group} differs from the reference codec")
    if kind == "load" and cell.geo.family != "hybrid":  # hybrid load blocks repeat
        for job in rng.sample(cell.load_jobs, min(n, len(cell.load_jobs))):
            op = job.ops[0]
            got = torch.empty(cb, dtype=torch.uint8, device=dev)
            codec.gather(g0, op.block_ids, bpc, got)
            if not torch.equal(got.cpu(), slab.view(0, op.slot)[:cb]):
                raise AssertionError(f"{cell.geo.family}: load into {op.block_ids} differs "
                                     f"from slot {op.slot}")


# --- GEMM, ceilings, naive -------------------------------------------------------------------

class Gemm:
    """bf16 8192^3 on the default stream; per-GEMM times from events."""

    def __init__(self, device: Any) -> None:
        import torch

        g = torch.Generator(device=device).manual_seed(0)
        self.a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=g)
        self.b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16, generator=g)
        self.c = torch.empty_like(self.a)
        self.stream = torch.cuda.default_stream(device)
        self.ms = self.baseline()

    def enqueue(self, k: int) -> list[Any]:
        import torch

        evs = []
        with torch.cuda.stream(self.stream):
            for _ in range(k):
                e = torch.cuda.Event(enable_timing=True)
                e.record(self.stream)
                evs.append(e)
                torch.matmul(self.a, self.b, out=self.c)
            e = torch.cuda.Event(enable_timing=True)
            e.record(self.stream)
            evs.append(e)
        return evs

    def baseline(self, k: int = 12) -> float:
        import torch

        self.enqueue(3)
        evs = self.enqueue(k)
        torch.cuda.synchronize()
        return statistics.median(a.elapsed_time(b) for a, b in itertools.pairwise(evs))

    def during(self, evs: list[Any], t0: Any, t1: Any, skip: int = 0) -> dict[str, float]:
        """GEMM times inside [t0, t1] against those entirely outside it (the first ``skip``
        left out)."""
        end = t0.elapsed_time(t1)
        inside, alone = [], []
        for i, (a, b) in enumerate(itertools.pairwise(evs)):
            s, e = t0.elapsed_time(a), t0.elapsed_time(b)
            if s >= 0 and e <= end:
                inside.append(e - s)
            elif (e <= 0 or s >= end) and i >= skip:
                alone.append(e - s)
        covered = sum(inside) / end if end > 0 else 0.0
        ms_in = statistics.fmean(inside) if inside else float("nan")
        ms_alone = statistics.fmean(alone) if alone else self.ms
        return {"gemm_ms_alone": ms_alone, "gemm_ms_during": ms_in, "gemms_inside": len(inside),
                "gemms_alone": len(alone), "window_covered": covered,
                "slowdown": ms_in / ms_alone - 1 if inside else float("nan")}


def ceilings(device: Any, host: Any, reps: int) -> dict[str, Any]:
    """Median GB/s of ``reps`` pinned 1 GiB copies each way, and both ways at once."""
    import torch

    dev = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    dev.random_(0, 256)
    h1, h2 = host[:GIB], host[GIB: 2 * GIB]
    h2.fill_(0xA5)  # DMA speed does not depend on the bytes
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)
    out: dict[str, Any] = {}

    def timed(fn: Callable[[], None], nbytes: int) -> list[float]:
        res = []
        for _ in range(reps + 1):
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s1)
            s2.wait_event(a)
            fn()
            e2 = torch.cuda.Event()
            e2.record(s2)
            s1.wait_event(e2)
            b.record(s1)
            b.synchronize()
            res.append(nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
        return res[1:]  # the first is a warm-up

    def d2h() -> None:
        with torch.cuda.stream(s1):
            h1.copy_(dev[:GIB], non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s1):
            dev[GIB:].copy_(h2, non_blocking=True)

    def both() -> None:
        with torch.cuda.stream(s1):
            h1.copy_(dev[:GIB], non_blocking=True)
        with torch.cuda.stream(s2):
            dev[GIB:].copy_(h2, non_blocking=True)

    for name, fn, nbytes in (("d2h", d2h, GIB), ("h2d", h2d, GIB), ("both", both, 2 * GIB)):
        runs = timed(fn, nbytes)
        med = statistics.median(runs)
        out[name] = {"gbps": med, "runs": runs, "design": DESIGN_CEILING[name],
                     "within_5pct_of_design": abs(med / DESIGN_CEILING[name] - 1) <= 0.05}

    return out


def probe(device: Any, host: Any) -> dict[str, Any]:
    """The two halves of the data path alone, outside the engine: 1 GiB moved by
    ``cuMemcpyBatchAsync`` as pieces of 8 KiB .. 2 MiB from random places of a 4 GiB device
    buffer to consecutive host places (one driver call per 64 MiB), each way; and the Triton
    gather of 1 GiB of 8 KiB and 64 KiB pieces into device staging. GPU time (events), and
    host time to submit."""
    import numpy as np
    import torch

    from kvtier.gpu.dma import Driver
    from kvtier.gpu.kernels import TileTable
    from kvtier.layout import GroupKind, GroupSpec, build_layout

    drivers = {0: Driver(), 1: Driver(flags=1)}
    dev = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    dev.random_(0, 256)
    s = torch.cuda.Stream(device)
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"dma": [], "gather": []}
    for piece, flags in ((8 * KIB, 0), (8 * KIB, 1), (64 * KIB, 0), (64 * KIB, 1),
                         (256 * KIB, 0), (2 * MIB, 0)):
        drv = drivers[flags]
        n = GIB // piece
        src = dev.data_ptr() + rng.permutation(4 * GIB // piece)[:n].astype(np.int64) * piece
        dst = host.data_ptr() + np.arange(n, dtype=np.int64) * piece
        size = np.full(n, piece, dtype=np.int64)
        per = 64 * MIB // piece
        for way in ("d2h", "h2d"):
            d, c = (dst, src) if way == "d2h" else (src, dst)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record(s)
            for i in range(0, n, per):
                drv.run((d[i:i + per], c[i:i + per], size[i:i + per]), s.cuda_stream)
            b.record(s)
            t_sub = time.perf_counter() - t0
            b.synchronize()
            wall = time.perf_counter() - t0
            out["dma"].append({"piece": piece, "way": way, "descriptors": n, "flags": flags,
                               "gpu_gbps": GIB / (a.elapsed_time(b) / 1e3) / 1e9,
                               "wall_gbps": GIB / wall / 1e9, "submit_s": t_sub})
    stage = torch.empty(GIB, dtype=torch.uint8, device=device)
    for piece in (8 * KIB, 64 * KIB):
        nb = 4 * GIB // piece
        name = "model.layers.0.self_attn.attn"
        lay = build_layout({name: dev.view(nb, piece)}, [GroupSpec(GroupKind.FULL, 16, (name,))],
                           nb, block_axes={name: 0})
        t = TileTable.build(lay.groups[0], 1)
        ids = torch.as_tensor(rng.permutation(nb)[: GIB // piece].astype(np.int64),
                              device=device)
        for programs in (132, 264, 528):
            t.launch(stage, 0, ids, True, programs)
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            t.launch(stage, 0, ids, True, programs)
            b.record()
            b.synchronize()
            out["gather"].append({"piece": piece, "programs": programs,
                                  "gbps": GIB / (a.elapsed_time(b) / 1e3) / 1e9})
    return out


def naive(cell: Cell, nbytes: int) -> dict[str, float]:
    """One ``copy_`` per piece (per segment and block), on a side stream."""
    import torch

    g = cell.layout.groups[0]
    bpc = cell.geo.bpc[0]
    slab = cell.mover.slab
    n = max(1, nbytes // cell.chunk_bytes[0])
    jobs = cell.save_jobs[:n]
    s = torch.cuda.Stream(g.segments[0].storage.device)
    out = {}
    for kind in ("save", "load"):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.cuda.stream(s):
            for job in jobs:
                slot = slab.view(0, job.ops[0].slot)
                off = 0
                for seg in g.segments:
                    rows = seg.blocks()
                    for j, b in enumerate(job.ops[0].block_ids):
                        piece = slot[off + j * seg.run: off + (j + 1) * seg.run]
                        if kind == "save":
                            piece.copy_(rows[b], non_blocking=True)
                        else:
                            rows[b].copy_(piece, non_blocking=True)
                    off += seg.run * bpc
        s.synchronize()
        out[kind] = len(jobs) * cell.chunk_bytes[0] / (time.perf_counter() - t0) / 1e9
    out["pieces"] = len(jobs) * len(g.segments) * bpc
    return out


# --- the run -----------------------------------------------------------------------------------

def _parse_size(s: str) -> int:
    from kvtier.config import parse_bytes

    return parse_bytes(s.strip())


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kvtier.bench.report import metadata
    from kvtier.config import KvtierConfig
    from kvtier.gpu.engine import DMA_MIN_PIECE

    smoke = bool(args.smoke)
    if not smoke and not torch.cuda.is_available():
        print("kvtier bench transfer needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda")
    families = [f for f in args.families.split(",") if f]
    chunks = [_parse_size(c) for c in args.chunks.split(",") if c]
    modes = [m for m in args.modes.split(",") if m]
    span = int(args.gib * GIB) if not smoke else 2 * MIB
    if smoke:
        chunks = [max(4 * KIB, c // 64) for c in chunks]
    thr = _parse_size(args.dma_min_piece) if args.dma_min_piece else DMA_MIN_PIECE
    meta = metadata()
    meta.update({"torch": torch.__version__, "smoke": smoke, "span_bytes": span,
                 "dma_min_piece": thr, "step_bytes": STEP_BYTES})
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    if not smoke:
        from kvtier.gpu.dma import Driver

        meta["gpu"] = torch.cuda.get_device_name(device)
        meta["dma_driver_mode"] = Driver().mode
        meta["sms"] = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        meta["gpu"] = "cpu-smoke"
    print(f"# kvtier bench transfer on {meta['gpu']} ({meta['date']})", flush=True)
    pinned_bytes = (max(2 * GIB, 2 * span) if not smoke else 2 * span) + 128 * MIB
    host = torch.empty(pinned_bytes, dtype=torch.uint8, pin_memory=not smoke)
    result: dict[str, Any] = {"meta": meta, "cells": [], "ceiling": None, "naive": None}
    if not smoke:
        result["ceiling"] = ceilings(device, host, args.reps)
        c = result["ceiling"]
        print("ceiling GB/s: d2h {d2h[gbps]:.1f}  h2d {h2d[gbps]:.1f}  both {both[gbps]:.1f}"
              .format(**c), flush=True)
    if not smoke:
        try:
            result["probe"] = probe(device, host)
        except Exception as e:  # a probe is diagnostic: report it, measure the rest
            print(f"probe failed: {type(e).__name__}: {e}", flush=True)
            result["probe"] = {"error": repr(e), "dma": [], "gather": []}
        torch.cuda.empty_cache()
        for r in result["probe"]["dma"]:
            print(f"raw batched DMA {r['way']} {r['piece'] // KIB:5d} KiB pieces (flags "
                  f"{r['flags']}): GPU "
                  f"{r['gpu_gbps']:5.1f} GB/s, wall {r['wall_gbps']:5.1f}, submit "
                  f"{1e3 * r['submit_s']:.1f} ms for {r['descriptors']}", flush=True)
        for r in result["probe"]["gather"]:
            print(f"raw gather {r['piece'] // KIB} KiB pieces, {r['programs']} programs: "
                  f"{r['gbps']:.0f} GB/s", flush=True)
    gemm = Gemm(device) if not (smoke or args.no_gemm) else None
    if gemm is not None:
        result["gemm_ms_alone"] = gemm.ms
        print(f"GEMM alone: {gemm.ms:.3f} ms ({2 * 8192**3 / gemm.ms / 1e9:.0f} TFLOP/s)",
              flush=True)
    cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size="256MiB" if not smoke else "2MiB")
    idle = torch.cuda.Stream(device) if not smoke else None

    def sync() -> None:
        if not smoke:
            torch.cuda.synchronize()

    t_start = time.perf_counter()
    for fam in families:
        for ci, chunk in enumerate(chunks):
            t_cell = time.perf_counter()
            geo = geometry(fam, chunk, span, smoke)
            cell = build_cell(geo, device, host, span, seed=ci)
            # The cell's job lists (tens of thousands of objects) live for the whole cell:
            # out of the collector's way, as a serving engine's long-lived state would be.
            gc.freeze()
            entry: dict[str, Any] = {"family": fam, "chunk_target": chunk, "note": geo.note,
                                     **cell.sizes, "modes": {}}
            print(f"\n{fam} chunk {cell.sizes['chunk_bytes'] / KIB:.0f} KiB "
                  f"(target {chunk // KIB} KiB; {cell.sizes['segments']} segments, pieces "
                  f"{cell.sizes['min_piece']}..{cell.sizes['max_piece']} B"
                  f"{'; ' + geo.note if geo.note else ''})", flush=True)
            auto_paths = _auto_paths(cell, thr)
            run_modes = list(modes)
            if len(set(auto_paths)) > 1 and "auto" not in run_modes:
                run_modes.append("auto")  # a mixed choice is its own configuration
            for mode in run_modes:
                try:
                    m = _measure_mode(cell, cfg, mode, thr, smoke, idle, sync, gemm)
                except Exception as e:  # a failed check is reported; the rest still runs
                    print(f"  {mode}: FAILED {type(e).__name__}: {e}", flush=True)
                    entry.setdefault("errors", {})[mode] = f"{type(e).__name__}: {e}"
                    continue
                entry["modes"][mode] = m
                print("  " + _line(mode, m), flush=True)
            if fam == "indexer" and chunk == 2 * MIB and gemm is not None:
                try:
                    entry["sweep"] = _sweep(cell, cfg, idle, sync, gemm)
                except Exception as e:
                    print(f"  sweep failed: {type(e).__name__}: {e}", flush=True)
            auto = auto_paths[0] if len(set(auto_paths)) == 1 else "auto"
            entry["auto"] = auto if auto in entry["modes"] else None
            entry["auto_paths"] = auto_paths
            if fam == "mha" and chunk == 2 * MIB and not smoke:
                result["naive"] = naive(cell, 256 * MIB)
                print("  naive (one copy_ per piece): save {save:.2f} GB/s, load {load:.2f} "
                      "GB/s over {pieces} pieces".format(**result["naive"]), flush=True)
            entry["cell_seconds"] = time.perf_counter() - t_cell
            result["cells"].append(entry)
            print(f"  ({entry['cell_seconds']:.1f} s; {time.perf_counter() - t_start:.0f} s so "
                  "far)", flush=True)
            _write(args, result, quiet=True)  # what is done survives a time-out
            del cell
            gc.unfreeze()
            gc.collect()
            if not smoke:
                torch.cuda.empty_cache()
    result["targets"] = targets(result)
    _write(args, result)
    return 0


def _measure_mode(cell: Cell, cfg: Any, mode: str, thr: int, smoke: bool, idle: Any,
                  sync: Callable[[], None], gemm: Gemm | None) -> dict[str, Any]:
    from kvtier.gpu.engine import CudaTransferEngine
    from kvtier.testing.host_runtime import HostRuntime

    eng = CudaTransferEngine(cell.mover, cfg, mode=mode, runtime=HostRuntime() if smoke else None,
                             dma_min_piece=thr)
    try:
        m: dict[str, Any] = {"paths": eng.paths()}
        _warm(eng, cell, idle, sync)
        for kind in ("save", "load", "both"):
            ph = run_phase(eng, cell, kind, idle, sync)
            spot_check(cell, kind)
            m[kind] = {"gbps": ph.gbps, "seconds": ph.seconds, "bytes": ph.nbytes, **ph.detail}
        if gemm is not None:
            for kind in ("save", "load", "both"):
                m["gemm_" + kind] = _under_gemm(eng, cell, kind, idle, sync, gemm,
                                                m[kind]["seconds"])
        return m
    finally:
        eng.close()


def _auto_paths(cell: Cell, thr: int) -> list[str]:
    """The path the engine's auto mode takes for each group (its smallest piece vs ``thr``)."""
    return ["kernel" if min(s.run for s in g.segments) < thr else "dma"
            for g in cell.layout.groups]


def _warm(eng: Any, cell: Cell, idle: Any, sync: Callable[[], None]) -> None:
    """Compile kernels and touch every path once (a few jobs of each kind)."""
    import torch

    from kvtier.ops import Job

    ctx = torch.cuda.stream(idle) if idle is not None else _null()
    with ctx:
        eng.tick()
        for j in cell.save_jobs[:2]:
            eng.save(Job(j.job_id + 5 * 10**7, j.req_id, j.ops))
        j = cell.load_jobs[0]
        eng.load(Job(j.job_id + 5 * 10**7, j.req_id, j.ops[:2]))
        eng.drain()
        for c in eng.poll():
            if not c.ok:
                raise RuntimeError(f"warm-up job failed: {c.error}")
    sync()


def _sweep(cell: Cell, cfg: Any, idle: Any, sync: Callable[[], None], gemm: Gemm
           ) -> list[dict[str, Any]]:
    """The gather kernel's width and grid, alone and under the GEMM (saves)."""
    from kvtier.gpu.engine import CudaTransferEngine

    out = []
    for warps, programs, batch in ((4, 256, 64 * MIB), (1, 132, 64 * MIB), (1, 528, 64 * MIB),
                                   (4, 64, 64 * MIB), (4, 256, 16 * MIB)):
        eng = CudaTransferEngine(cell.mover, cfg, mode="kernel", max_programs=programs,
                                 num_warps=warps, batch_bytes=batch)
        _warm(eng, cell, idle, sync)
        alone = run_phase(eng, cell, "save", idle, sync)
        under = _under_gemm(eng, cell, "save", idle, sync, gemm, alone.seconds)
        eng.close()
        r = {"num_warps": warps, "max_programs": programs, "batch_bytes": batch,
             "save": alone.gbps, "save_gemm": under["gbps"], "slowdown": under["slowdown"]}
        print(f"  sweep kernel warps {warps} programs {programs} batch {batch // MIB} MiB: save "
              f"{alone.gbps:.1f}, under GEMM {under['gbps']:.1f} GB/s "
              f"({100 * under['slowdown']:+.1f}%)", flush=True)
        out.append(r)
    return out


def _under_gemm(eng: Any, cell: Cell, kind: str, idle: Any, sync: Callable[[], None],
                gemm: Gemm, alone_s: float) -> dict[str, Any]:
    """The phase while GEMMs loop on the default stream. GEMMs run alone before and after
    the transfers in the same queue, so the GPU's clock and power state are the same for the
    GEMMs the slowdown compares."""
    import torch

    # 40 GEMMs (~60 ms) bring the card to the clock and power state of a sustained GEMM
    # first; the last of them and 16 after the transfers are the GEMMs alone.
    warm, pre, post = 28, 40, 16
    during = int(1.5 * alone_s * 1e3 / gemm.ms) + 8
    sync()
    evs = gemm.enqueue(pre + during + post)
    evs[pre - 2].synchronize()  # GEMMs < pre - 2 ran alone; the queue still holds the rest
    marker = torch.cuda.Stream(idle.device)
    t0 = torch.cuda.Event(enable_timing=True)
    t0.record(marker)
    ph = run_phase(eng, cell, kind, idle, lambda: None)
    t1 = torch.cuda.Event(enable_timing=True)
    t1.record(marker)
    torch.cuda.synchronize()
    spot_check(cell, kind, 2)
    out = {"gbps": ph.gbps, "seconds": ph.seconds, "bytes": ph.nbytes, **ph.detail}
    out.update(gemm.during(evs, t0, t1, skip=warm))
    return out


def _line(mode: str, m: dict[str, Any]) -> str:
    s = (f"{mode:6s} save {m['save']['gbps']:6.1f}  load {m['load']['gbps']:6.1f}  "
         f"both {m['both']['gbps']:6.1f} GB/s")
    if "gemm_save" in m:
        s += "  | under GEMM: " + "  ".join(
            f"{k} {m['gemm_' + k]['gbps']:.1f} ({100 * m['gemm_' + k]['slowdown']:+.1f}%)"
            for k in ("save", "load", "both"))
    return s + f"  [{','.join(m['paths'])}]"


# --- targets, table, files -------------------------------------------------------------------

def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue target, met or not, on the auto path (the one the engine picks)."""
    ceil = result.get("ceiling")
    if not ceil:
        return []
    link = {"save": ceil["d2h"]["gbps"], "load": ceil["h2d"]["gbps"]}
    bidir = ceil["both"]["gbps"]
    out = []

    def add(name: str, what: str, ok: bool, detail: list[str]) -> None:
        out.append({"name": name, "what": what, "met": ok, "misses": detail})

    for name, lo, hi, frac in (("2MiB", 2 * MIB, None, TARGETS["large"]),
                               ("256KiB", 0, 2 * MIB, TARGETS["small"])):
        misses = []
        for c in result["cells"]:
            if not (c["chunk_target"] >= lo and (hi is None or c["chunk_target"] < hi)):
                continue
            if not c.get("auto"):
                misses.append(f"{c['family']} {c['chunk_target'] // KIB}KiB: no measurement "
                              f"of the auto path ({c.get('errors')})")
                continue
            m = c["modes"][c["auto"]]
            for kind in ("save", "load"):
                if m[kind]["gbps"] < frac * link[kind]:
                    misses.append(f"{c['family']} {c['chunk_target'] // KIB}KiB {kind} "
                                  f"{m[kind]['gbps']:.1f} < {frac * link[kind]:.1f}")
        add(name, f"save and load >= {frac:.0%} of the link for "
            f"{'chunks >= 2 MiB' if hi is None else '256 KiB chunks'}", not misses, misses)
    misses = []
    for c in result["cells"]:
        if c.get("auto") and c["chunk_target"] >= 2 * MIB:
            g = c["modes"][c["auto"]]["both"]["gbps"]
            if g < TARGETS["both"] * bidir:
                misses.append(f"{c['family']} {c['chunk_target'] // KIB}KiB both {g:.1f} < "
                              f"{TARGETS['both'] * bidir:.1f}")
    add("both", "save and load at once >= 80% of the bidirectional ceiling (chunks >= 2 MiB)",
        not misses, misses)
    misses = []
    seen = False
    for c in result["cells"]:
        m = c["modes"].get(c.get("auto") or "", {})
        for kind in ("save", "load"):
            g = m.get("gemm_" + kind)
            if not g:
                continue
            seen = True
            if g["gbps"] < TARGETS["gemm_link"] * link[kind]:
                misses.append(f"{c['family']} {c['chunk_target'] // KIB}KiB {kind} "
                              f"{g['gbps']:.1f} GB/s under GEMM")
            if not g["slowdown"] < TARGETS["gemm_slow"]:
                misses.append(f"{c['family']} {c['chunk_target'] // KIB}KiB {kind} GEMM "
                              f"slowed {100 * g['slowdown']:.1f}%")
    add("gemm", "under the GEMM: transfers >= 80% of the link, GEMM slowed < 5%",
        seen and not misses, misses)
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| layout | chunk | pieces (B) | path | save | load | both | save+GEMM (slow) | "
             "load+GEMM (slow) | both+GEMM (slow) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        for mode, m in c["modes"].items():
            star = "*" if mode == c.get("auto") else ""

            def g(k: str, m: dict[str, Any] = m) -> str:
                x = m.get("gemm_" + k)
                return f"{x['gbps']:.1f} ({100 * x['slowdown']:+.1f}%)" if x else "-"
            lines.append(
                f"| {c['family']} | {c['chunk_bytes'] / KIB:.0f} KiB x{c['blocks_per_chunk']} | "
                f"{c['min_piece']}..{c['max_piece']} | {mode}{star} | {m['save']['gbps']:.1f} | "
                f"{m['load']['gbps']:.1f} | {m['both']['gbps']:.1f} | {g('save')} | "
                f"{g('load')} | {g('both')} |")
    out = ["GB/s; * = the path the engine picks (auto); (slow) = GEMM slowdown", "", *lines]
    if result.get("ceiling"):
        c = result["ceiling"]
        out += ["", "| ceiling (pinned 1 GiB, median) | measured GB/s | DESIGN.md §3 | "
                "within 5% |", "|---|---|---|---|"]
        for k in ("d2h", "h2d", "both"):
            out.append(f"| {k} | {c[k]['gbps']:.1f} | {c[k]['design']} | "
                       f"{'yes' if c[k]['within_5pct_of_design'] else 'NO'} |")
    if result.get("naive"):
        n = result["naive"]
        out += ["", f"naive, one copy_ per 64 KiB piece (mha 2 MiB chunks): save "
                f"{n['save']:.2f} GB/s, load {n['load']:.2f} GB/s"]
    if result.get("gemm_ms_alone"):
        out += ["", f"GEMM bf16 8192^3 alone: {result['gemm_ms_alone']:.3f} ms"]
    if result.get("targets"):
        out += ["", "| target | met | misses |", "|---|---|---|"]
        for t in result["targets"]:
            out.append(f"| {t['what']} | {'MET' if t['met'] else 'not met'} | "
                       f"{'; '.join(t['misses'][:6])}{' ...' if len(t['misses']) > 6 else ''} |")
    return "\n".join(out)


def plot(path: str, result: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    kinds = ("save", "load", "both")
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharey="col")
    for row, gemm in enumerate(("", "gemm_")):
        for col, kind in enumerate(kinds):
            ax = axes[row][col]
            labels = [f"{c['family']}\n{c['chunk_bytes'] / KIB:.0f}K" for c in cells]
            x = range(len(cells))
            width = 0.28
            for i, mode in enumerate(("dma", "kernel", "auto")):
                ys = [c["modes"].get(mode, {}).get(gemm + kind, {}).get("gbps", 0) for c in cells]
                if any(ys):
                    ax.bar([v + (i - 1) * width for v in x], ys, width, label=mode)
            if result.get("ceiling"):
                ref = result["ceiling"]["both" if kind == "both" else
                                        "d2h" if kind == "save" else "h2d"]["gbps"]
                ax.axhline(ref, color="k", lw=1, ls="--", label="pinned ceiling")
            ax.set_xticks(list(x), labels, fontsize=6, rotation=90)
            ax.set_title(f"{kind}{' under GEMM' if gemm else ''} (GB/s)", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"kvtier bench transfer, {result['meta'].get('gpu')}, "
                 f"{result['meta'].get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _write(args: argparse.Namespace, result: dict[str, Any], quiet: bool = False) -> None:
    os.makedirs(args.out, exist_ok=True)
    gpu = str(result["meta"].get("gpu", "gpu")).replace(" ", "-")
    stem = os.path.join(args.out, f"transfer-{result['meta']['date'][:10]}-{gpu}"
                                  f"{'-' + args.tag if args.tag else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=float)
        f.write("\n")
    if quiet:
        return
    text = table(result)
    with open(stem + ".md", "w") as f:
        f.write(f"# kvtier bench transfer\n\n{result['meta']['date']}, {result['meta']['gpu']}, "
                f"`{result['meta']['command']}`\n\n{text}\n")
    try:
        plot(stem + ".png", result)
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print("\n" + text)
    print(f"\nwrote {stem}.json, .md, .png")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=HELP)
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
