"""Transfers while a GEMM keeps the SMs busy: what the data path costs the forward pass, and
what the forward pass costs the data path."""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable
from typing import Any

from kvtier.bench.transfer.cases import Cell
from kvtier.bench.transfer.timing import run_phase, spot_check


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
        return gemm_slowdown(inside, alone, end, self.ms)


def gemm_slowdown(inside: list[float], alone: list[float], window_ms: float,
                  baseline_ms: float) -> dict[str, float]:
    """The GEMMs inside the transfer window (ms each) against those alone; ``baseline_ms``
    stands in when none ran alone."""
    covered = sum(inside) / window_ms if window_ms > 0 else 0.0
    ms_in = statistics.fmean(inside) if inside else float("nan")
    ms_alone = statistics.fmean(alone) if alone else baseline_ms
    return {"gemm_ms_alone": ms_alone, "gemm_ms_during": ms_in, "gemms_inside": len(inside),
            "gemms_alone": len(alone), "window_covered": covered,
            "slowdown": ms_in / ms_alone - 1 if inside else float("nan")}


def under_gemm(eng: Any, cell: Cell, kind: str, idle: Any, sync: Callable[[], None],
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
