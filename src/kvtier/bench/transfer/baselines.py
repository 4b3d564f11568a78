"""What the engine is measured against, outside it: the pinned-memcpy ceiling of the link,
the two halves of the data path alone (raw batched DMA, raw gather), and the naive path (one
``copy_`` per piece). CUDA only."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from kvtier.bench.transfer.cases import GIB, KIB, MIB, Cell

DESIGN_CEILING = {"d2h": 55.3, "h2d": 55.4, "both": 99.2}  # measured on the H200 host


def _timed(fn: Callable[[], None], nbytes: int, reps: int, s1: Any, s2: Any) -> list[float]:
    """GB/s of ``reps`` runs of ``fn`` (after one warm-up), from an event on ``s1`` to the
    end of both ``s1`` and ``s2``."""
    import torch

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


def ceilings(device: Any, host: Any, reps: int) -> dict[str, Any]:
    """Median GB/s of ``reps`` pinned 1 GiB copies each way, and both ways at once."""
    import torch

    dev = torch.empty(2 * GIB, dtype=torch.uint8, device=device)
    dev.random_(0, 256)
    h1, h2 = host[:GIB], host[GIB: 2 * GIB]
    h2.fill_(0xA5)  # DMA speed does not depend on the bytes
    s1, s2 = torch.cuda.Stream(device), torch.cuda.Stream(device)

    def d2h() -> None:
        with torch.cuda.stream(s1):
            h1.copy_(dev[:GIB], non_blocking=True)

    def h2d() -> None:
        with torch.cuda.stream(s1):
            dev[GIB:].copy_(h2, non_blocking=True)

    def both() -> None:
        d2h()
        with torch.cuda.stream(s2):
            dev[GIB:].copy_(h2, non_blocking=True)

    out: dict[str, Any] = {}
    for name, fn, nbytes in (("d2h", d2h, GIB), ("h2d", h2d, GIB), ("both", both, 2 * GIB)):
        runs = _timed(fn, nbytes, reps, s1, s2)
        med = statistics.median(runs)
        out[name] = {"gbps": med, "runs": runs, "design": DESIGN_CEILING[name],
                     "within_5pct_of_design": abs(med / DESIGN_CEILING[name] - 1) <= 0.05}
    return out


def _probe_dma(dev: Any, host: Any, stream: Any, rng: Any) -> list[dict[str, Any]]:
    """1 GiB as pieces of 8 KiB .. 2 MiB from random places of ``dev`` to consecutive host
    places and back, one ``cuMemcpyBatchAsync`` per 64 MiB."""
    import numpy as np
    import torch

    from kvtier.gpu.dma import Driver

    drivers = {0: Driver(), 1: Driver(flags=1)}
    out = []
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
            a.record(stream)
            for i in range(0, n, per):
                drv.run((d[i:i + per], c[i:i + per], size[i:i + per]), stream.cuda_stream)
            b.record(stream)
            t_sub = time.perf_counter() - t0
            b.synchronize()
            wall = time.perf_counter() - t0
            out.append({"piece": piece, "way": way, "descriptors": n, "flags": flags,
                        "gpu_gbps": GIB / (a.elapsed_time(b) / 1e3) / 1e9,
                        "wall_gbps": GIB / wall / 1e9, "submit_s": t_sub})
    return out


def _probe_gather(dev: Any, device: Any, rng: Any) -> list[dict[str, Any]]:
    """The Triton gather of 1 GiB of 8 KiB and 64 KiB pieces of ``dev`` into staging."""
    import numpy as np
    import torch

    from kvtier.gpu.kernels import TileTable
    from kvtier.layout import GroupKind, GroupSpec, build_layout

    stage = torch.empty(GIB, dtype=torch.uint8, device=device)
    out = []
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
            out.append({"piece": piece, "programs": programs,
                        "gbps": GIB / (a.elapsed_time(b) / 1e3) / 1e9})
    return out


def probe(device: Any, host: Any) -> dict[str, Any]:
    """The two halves of the data path alone, outside the engine: 1 GiB moved by
    ``cuMemcpyBatchAsync`` as pieces of 8 KiB .. 2 MiB from random places of a 4 GiB device
    buffer to consecutive host places (one driver call per 64 MiB), each way; and the Triton
    gather of 1 GiB of 8 KiB and 64 KiB pieces into device staging. GPU time (events), and
    host time to submit."""
    import numpy as np
    import torch

    dev = torch.empty(4 * GIB, dtype=torch.uint8, device=device)
    dev.random_(0, 256)
    rng = np.random.default_rng(0)
    dma = _probe_dma(dev, host, torch.cuda.Stream(device), rng)
    return {"dma": dma, "gather": _probe_gather(dev, device, rng)}


def naive(cell: Cell, nbytes: int) -> dict[str, float]:
    """One ``copy_`` per piece (per segment and block), on a side stream."""
    import torch

    g = cell.layout.groups[0]
    bpc = cell.mover.geometry.blocks_per_chunk(0)
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
