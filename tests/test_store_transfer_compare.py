"""tools/store_transfer_compare.py on result files written the way ``kvtier bench transfer``
writes them: medians, ranges, the ratio of the best runs, and which verdicts a bimodal cell
off the engine's path can and cannot fail. The tool read the H200's runs in
bench/results/2026-12-02-gpu-h200-session9/."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

from _tools import load_tool


def _tool() -> ModuleType:
    return load_tool("store_transfer_compare")


def _run(pool: str, dma_save: float, kernel_save: float) -> dict[str, Any]:
    """One bench result: a cell whose auto path is the kernel, a pinned-memcpy ceiling."""
    return {
        "meta": {"host_pool": {"pool": pool}},
        "cells": [{"family": "mha", "chunk_bytes": 2 << 20, "auto": "kernel",
                   "modes": {"dma": {"save": {"gbps": dma_save}, "load": {"gbps": 50.0}},
                             "kernel": {"save": {"gbps": kernel_save},
                                        "load": {"gbps": 53.0}}}}],
        "ceiling": {"d2h": {"gbps": 55.0}},
    }


def _write(folder: Path, runs: list[dict[str, Any]]) -> None:
    for i, r in enumerate(runs):
        (folder / f"transfer-{r['meta']['host_pool']['pool']}-{i}.json").write_text(
            json.dumps(r))


def test_a_bimodal_cell_off_the_engine_path_fails_the_median_but_not_the_engine_verdict(
        tmp_path: Path) -> None:
    tool = _tool()
    # dma saves bimodal on both pools (two modes, 45 and 52 GB/s); the store's median run
    # lands in the low mode, the slab's in the high one; the kernel path (the engine's) agrees
    _write(tmp_path, [_run("slab", 52.0, 53.4), _run("store", 45.0, 53.5),
                      _run("slab", 45.5, 53.3), _run("store", 52.1, 53.4),
                      _run("slab", 52.2, 53.5), _run("store", 45.2, 53.2)])
    rows = {(r["path"], r["kind"]): r for r in tool.compare(tool.load_runs(tmp_path))}
    dma = rows[("dma", "save")]
    assert dma["inproc_gbps"] == 52.0 and dma["store_gbps"] == 45.2
    assert not dma["within_5pct"] and not dma["engine_path"]
    assert dma["inproc_range"] == [45.5, 52.2] and dma["store_range"] == [45.0, 52.1]
    assert abs(dma["best_store_over_inproc"] - 52.1 / 52.2) < 1e-12 and dma["best_within_5pct"]
    kernel = rows[("kernel", "save")]
    assert kernel["engine_path"] and kernel["within_5pct"]
    assert rows[("memcpy", "d2h")]["engine_path"]  # the ceiling rides along


def test_a_store_slower_on_every_run_fails_every_verdict(tmp_path: Path) -> None:
    tool = _tool()
    _write(tmp_path, [_run("slab", 52.0, 53.4), _run("store", 52.0, 44.0),
                      _run("slab", 52.0, 53.5), _run("store", 52.0, 45.0)])
    out = tmp_path / "compare.json"
    sys.argv = ["store_transfer_compare", str(tmp_path), "--json", str(out)]
    assert tool.main() == 0
    verdict = json.loads(out.read_text())
    assert not verdict["all_within_5pct"]
    assert not verdict["engine_paths_within_5pct"]
    assert not verdict["best_runs_within_5pct"]
