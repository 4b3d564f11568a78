"""The run of ``kvtier bench transfer``: the baselines, then every family x chunk size cell
on every engine path, alone and under the GEMM; the files are rewritten after every cell."""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kvtier.bench.transfer import report
from kvtier.bench.transfer.baselines import ceilings, naive, probe
from kvtier.bench.transfer.cases import (
    GIB,
    KIB,
    MIB,
    REGISTERED_LAYOUTS,
    STEP_BYTES,
    Cell,
    build_cell,
    cache_case,
)
from kvtier.bench.transfer.gemm import Gemm, under_gemm
from kvtier.bench.transfer.pools import host_pool
from kvtier.bench.transfer.timing import run_phase, spot_check, warm


@dataclass
class Setting:
    """What every cell of one run shares."""

    smoke: bool
    device: Any
    span: int
    thr: int  # the auto path's dma_min_piece
    cfg: Any  # KvtierConfig of the engines
    idle: Any  # the stream the engine runs from (None on CPU)
    gemm: Gemm | None
    verify: bool = False  # checksums at save, verified at load (verify_checksums)
    kernel_streams: int | None = None  # None: the engine's default
    sweep: bool = False  # the kernel width sweep on every cell (else indexer 2 MiB only)

    def sync(self) -> None:
        if not self.smoke:
            import torch

            torch.cuda.synchronize()


def _parse_size(s: str) -> int:
    from kvtier.config import parse_bytes

    return parse_bytes(s.strip())


def _metadata(smoke: bool, device: Any, span: int, thr: int) -> dict[str, Any]:
    import torch

    from kvtier.bench.report import metadata

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
    return meta


def _baselines(result: dict[str, Any], device: Any, host: Any, reps: int) -> None:
    """The pinned ceiling and the raw DMA and gather probes, printed and into ``result``."""
    import torch

    result["ceiling"] = ceilings(device, host, reps)
    c = result["ceiling"]
    print("ceiling GB/s: d2h {d2h[gbps]:.1f}  h2d {h2d[gbps]:.1f}  both {both[gbps]:.1f}"
          .format(**c), flush=True)
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


def run(args: argparse.Namespace) -> int:
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    from kvtier.gpu.engine import DMA_MIN_PIECE

    smoke = bool(args.smoke)
    if not smoke and not torch.cuda.is_available():
        print("kvtier bench transfer needs a CUDA device (or --smoke)", file=sys.stderr)
        return 2
    device = torch.device("cpu") if smoke else torch.device("cuda")
    chunks = [_parse_size(c) for c in args.chunks.split(",") if c]
    span = int(args.gib * GIB) if not smoke else 2 * MIB
    if smoke:
        chunks = [max(4 * KIB, c // 64) for c in chunks]
    thr = _parse_size(args.dma_min_piece) if args.dma_min_piece else DMA_MIN_PIECE
    meta = _metadata(smoke, device, span, thr)
    print(f"# kvtier bench transfer on {meta['gpu']} ({meta['date']})", flush=True)
    pinned_bytes = (max(2 * GIB, 2 * span) if not smoke else 2 * span) + 128 * MIB
    with host_pool(args.host_pool, pinned_bytes, cuda=not smoke) as (host, pool):
        meta["host_pool"] = pool
        print(f"host pool: {pool}", flush=True)
        return _run_all(args, meta, device, host, chunks, span, thr)


def _run_all(args: argparse.Namespace, meta: dict[str, Any], device: Any, host: Any,
             chunks: list[int], span: int, thr: int) -> int:
    import torch

    from kvtier.config import KvtierConfig
    from kvtier.gpu.engine import KERNEL_STREAMS

    smoke = bool(args.smoke)
    result: dict[str, Any] = {"meta": meta, "cells": [], "ceiling": None, "naive": None}
    if not smoke:
        _baselines(result, device, host, args.reps)
    gemm = Gemm(device) if not (smoke or args.no_gemm) else None
    if gemm is not None:
        result["gemm_ms_alone"] = gemm.ms
        print(f"GEMM alone: {gemm.ms:.3f} ms ({2 * 8192**3 / gemm.ms / 1e9:.0f} TFLOP/s)",
              flush=True)
    cfg = KvtierConfig(dram_size="1GiB", gpu_staging_size="256MiB" if not smoke else "2MiB")
    st = Setting(smoke, device, span, thr, cfg, torch.cuda.Stream(device) if not smoke else None,
                 gemm, verify=bool(args.verify), kernel_streams=args.kernel_streams,
                 sweep=bool(getattr(args, "sweep", False)))
    meta["verify_checksums"] = bool(args.verify)
    meta["kernel_streams"] = args.kernel_streams or KERNEL_STREAMS
    modes = [m for m in args.modes.split(",") if m]
    t_start = time.perf_counter()
    for fam in [f for f in args.families.split(",") if f]:
        for ci, chunk in enumerate(chunks[:1] if fam in REGISTERED_LAYOUTS else chunks):
            result["cells"].append(_run_cell(st, result, host, fam, chunk, ci, modes))
            print(f"  ({result['cells'][-1]['cell_seconds']:.1f} s; "
                  f"{time.perf_counter() - t_start:.0f} s so far)", flush=True)
            report.write(args, result, quiet=True)  # what is done survives a time-out
            gc.unfreeze()
            gc.collect()
            if not smoke:
                torch.cuda.empty_cache()
    result["targets"] = report.targets(result)
    report.write(args, result)
    return 0


def _run_cell(st: Setting, result: dict[str, Any], host: Any, fam: str, chunk: int, seed: int,
              modes: list[str]) -> dict[str, Any]:
    """One family at one chunk size on every path (and ``auto`` where it mixes paths); the
    mha 2 MiB cell also measures the naive path into ``result``."""
    t_cell = time.perf_counter()
    geo = cache_case(fam, chunk, st.span, st.smoke)
    cell = build_cell(geo, st.device, host, st.span, seed=seed, verify=st.verify)
    # The cell's job lists (tens of thousands of objects) live for the whole cell:
    # out of the collector's way, as a serving engine's long-lived state would be.
    gc.freeze()
    entry: dict[str, Any] = {"family": fam, "chunk_target": chunk, "note": geo.note,
                             **cell.sizes, "modes": {}}
    print(f"\n{fam} chunk {cell.sizes['chunk_bytes'] / KIB:.0f} KiB "
          f"(target {chunk // KIB} KiB; {cell.sizes['segments']} segments, pieces "
          f"{cell.sizes['min_piece']}..{cell.sizes['max_piece']} B"
          f"{'; ' + geo.note if geo.note else ''})", flush=True)
    auto_paths = _auto_paths(cell, st.thr)
    run_modes = list(modes)
    if len(set(auto_paths)) > 1 and "auto" not in run_modes:
        run_modes.append("auto")  # a mixed choice is its own configuration
    for mode in run_modes:
        try:
            m = measure_mode(st, cell, mode)
        except Exception as e:  # a failed check is reported; the rest still runs
            print(f"  {mode}: FAILED {type(e).__name__}: {e}", flush=True)
            entry.setdefault("errors", {})[mode] = f"{type(e).__name__}: {e}"
            continue
        entry["modes"][mode] = m
        print("  " + report.line(mode, m), flush=True)
    if st.sweep or (st.gemm is not None and fam == "indexer" and chunk == 2 * MIB):
        try:
            entry["sweep"] = sweep(st, cell)
        except Exception as e:
            print(f"  sweep failed: {type(e).__name__}: {e}", flush=True)
    auto = auto_paths[0] if len(set(auto_paths)) == 1 else "auto"
    entry["auto"] = auto if auto in entry["modes"] else None
    entry["auto_paths"] = auto_paths
    if fam == "mha" and chunk == 2 * MIB and not st.smoke:
        result["naive"] = naive(cell, 256 * MIB)
        print("  naive (one copy_ per piece): save {save:.2f} GB/s, load {load:.2f} "
              "GB/s over {pieces} pieces".format(**result["naive"]), flush=True)
    entry["cell_seconds"] = time.perf_counter() - t_cell
    return entry


def _engine(st: Setting, cell: Cell, **kw: Any) -> Any:
    """The engine under test on the cell (on the host runtime for ``--smoke``)."""
    from kvtier.gpu.engine import CudaTransferEngine

    if st.kernel_streams is not None:
        kw.setdefault("kernel_streams", st.kernel_streams)
    runtime = None
    if st.smoke:
        from kvtier.testing.host_runtime import HostRuntime

        runtime = HostRuntime()
    return CudaTransferEngine(cell.mover, st.cfg, runtime=runtime, **kw)


def measure_mode(st: Setting, cell: Cell, mode: str) -> dict[str, Any]:
    """Saves, loads and both on one engine path, spot-checked; then each under the GEMM."""
    eng = _engine(st, cell, mode=mode, dma_min_piece=st.thr)
    try:
        m: dict[str, Any] = {"paths": eng.paths()}
        warm(eng, cell, st.idle, st.sync)
        for kind in report.KINDS:
            ph = run_phase(eng, cell, kind, st.idle, st.sync)
            spot_check(cell, kind)
            m[kind] = {"gbps": ph.gbps, "seconds": ph.seconds, "bytes": ph.nbytes, **ph.detail}
        if st.gemm is not None:
            for kind in report.KINDS:
                m["gemm_" + kind] = under_gemm(eng, cell, kind, st.idle, st.sync, st.gemm,
                                               m[kind]["seconds"])
        return m
    finally:
        eng.close()


def _auto_paths(cell: Cell, thr: int) -> list[str]:
    """The path the engine's auto mode takes for each group (its smallest piece vs ``thr``)."""
    return ["kernel" if min(s.run for s in g.segments) < thr else "dma"
            for g in cell.layout.groups]


SWEEP = ((4, 256, 64 * MIB, 1), (1, 132, 64 * MIB, 1), (1, 528, 64 * MIB, 1),
         (1, 1056, 64 * MIB, 1), (2, 528, 64 * MIB, 1), (4, 64, 64 * MIB, 1),
         (1, 528, 16 * MIB, 1), (4, 256, 16 * MIB, 1), (4, 256, 16 * MIB, 4),
         (1, 528, 16 * MIB, 4))
"""(num_warps, max_programs, batch_bytes, staging factor) of the gather/scatter kernel's sweep;
the factor multiplies the run's ``gpu_staging_size`` (half per direction). Why these: under
cuBLAS's persistent GEMM a queued kernel runs only where its programs fit beside the GEMM's
CTAs; on the H200 thin programs co-resided best for saves (1 warp x 528: 51.6 GB/s under the
GEMM, 4 x 256: 50.4, 4 x 64: 39.0; bench/notes/transfer.md run 3). Loads were never swept:
a load's scatter waits for a GEMM boundary after its batch lands, and with two 64 MiB
batches per direction in the staging ring the next batch's copy waits for that scatter, so
smaller batches in a larger ring are swept too."""


def sweep(st: Setting, cell: Cell) -> list[dict[str, Any]]:
    """The kernel path's width, grid and batch, alone and under the GEMM, saves and loads:
    one engine per shape; each row has both directions' GB/s and the GEMM's slowdown (None
    without a GEMM: ``--smoke`` sweeps alone, which checks the code, not the numbers)."""
    sync: Callable[[], None] = st.sync
    out = []
    for warps, programs, batch, factor in SWEEP:
        staging = int(st.cfg.gpu_staging_size) * factor
        cfg = st.cfg.model_copy(update={"gpu_staging_size": staging,
                                        "dram_size": max(int(st.cfg.dram_size), staging)})
        eng = _engine(replace(st, cfg=cfg), cell, mode="kernel", max_programs=programs,
                      num_warps=warps, batch_bytes=batch)
        try:
            warm(eng, cell, st.idle, sync)
            r: dict[str, Any] = {"num_warps": warps, "max_programs": programs,
                                 "batch_bytes": batch, "staging_bytes": staging}
            for kind in ("save", "load"):
                alone = run_phase(eng, cell, kind, st.idle, sync)
                r[kind] = alone.gbps
                r[kind + "_gemm"] = r[kind + "_slowdown"] = None
                if st.gemm is not None:
                    under = under_gemm(eng, cell, kind, st.idle, sync, st.gemm, alone.seconds)
                    r[kind + "_gemm"], r[kind + "_slowdown"] = under["gbps"], under["slowdown"]
        finally:
            eng.close()
        print(f"  sweep kernel warps {warps} programs {programs} batch {batch // MIB} MiB "
              f"staging {staging // MIB} MiB: "
              + "; ".join(f"{k} {r[k]:.1f}" + (
                  f", under GEMM {r[k + '_gemm']:.1f} GB/s ({100 * r[k + '_slowdown']:+.1f}%)"
                  if r[k + "_gemm"] is not None else " GB/s") for k in ("save", "load")),
              flush=True)
        out.append(r)
    return out
