"""``kvtier bench transfer`` without a GPU: its command line, the caches and jobs it builds,
how it steps the engine, its targets and table, and a ``--smoke`` run end to end (the engine
on the test host runtime, kernels through ``TRITON_INTERPRET=1``). The CUDA-only parts
(ceilings, probes, GEMM, naive path) run on the H200 (``bench/transfer_gpu.sh``)."""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from _background import Background
from kvtier.bench.transfer import cases, report
from kvtier.bench.transfer.cases import FAMILIES, KIB, MIB, STEP_BYTES
from kvtier.bench.transfer.gemm import gemm_slowdown
from kvtier.bench.transfer.timing import steps
from kvtier.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent


def test_the_command_line_and_its_defaults() -> None:
    args = build_parser().parse_args(["bench", "transfer", "--smoke", "--families", "mha",
                                      "--chunks", "256KiB", "--tag", "x"])
    assert args.bench == "transfer" and args.smoke and args.families == "mha"
    assert (args.chunks, args.modes, args.gib, args.reps) == ("256KiB", "dma,kernel", 1.0, 5)
    assert not args.no_gemm and args.dma_min_piece is None and args.out == "bench/results"
    full = build_parser().parse_args(["bench", "transfer"])
    assert full.families == ",".join(FAMILIES) and not full.smoke


def _bytes_per_block(geo: cases.CacheCase) -> int:
    """Of the first group (the attention layers), scales on the layers included."""
    layers = set(geo.groups[0][2])
    total = 0
    for name, spec in geo.tensors.items():
        if name in layers:
            shape, dtype = spec
            total += math.prod(shape) * getattr(torch, dtype).itemsize
    for shape, dtype in geo.scales.values():  # k_scale and v_scale
        total += 2 * math.prod(shape) * getattr(torch, dtype).itemsize
    return total // geo.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [256 * KIB, 2 * MIB, 8 * MIB])
def test_a_chunk_is_about_its_target_and_the_cache_spans_two_sets(family: str,
                                                                  chunk: int) -> None:
    span = 1 << 30
    geo = cases.cache_case(family, chunk, span)
    block = _bytes_per_block(geo)
    assert block <= chunk  # a block larger than the chunk is sharded (TP heads, PP layers)
    assert abs(geo.bpc[0] * block - chunk) <= block / 2  # the nearest whole-block chunk
    if family == "hybrid":  # one block count for both groups, one state object per chunks
        assert geo.bpc[1] == 1 and geo.state_every * geo.bpc[0] * block >= STEP_BYTES
    else:  # two disjoint sets of whole chunks covering the span each
        assert geo.num_blocks * block >= 2 * span and geo.num_blocks % 2 == 1


def test_an_unknown_family_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown family"):
        cases.cache_case("gqa", MIB, MIB)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_cell_has_every_chunk_once_per_direction_and_steps_carry_at_most_a_step(
        family: str) -> None:
    span = 2 * MIB
    geo = cases.cache_case(family, 32 * KIB, span, smoke=True)
    host = torch.empty(2 * span + 128 * MIB, dtype=torch.uint8)
    cell = cases.build_cell(geo, "cpu", host, span, seed=1)
    n = cell.sizes["chunks"]
    assert [j.ops[0].slot for j in cell.save_jobs] == list(range(n))
    assert [j.ops[0].slot for j in cell.both_saves] == list(range(n, 2 * n))
    assert sorted(op.slot for j in cell.load_jobs for op in j.ops if op.group == 0) == \
        list(range(n))
    if family != "hybrid":  # saves read and loads write disjoint blocks
        read = {b for j in cell.save_jobs for b in j.ops[0].block_ids}
        written = {b for j in cell.load_jobs for op in j.ops for b in op.block_ids}
        assert not read & written
    plan = steps(cell, cell.load_jobs, cell.both_saves)
    assert [j for ls, _ in plan for j in ls] == cell.load_jobs
    assert [j for _, ss in plan for j in ss] == cell.both_saves
    for ls, ss in plan:
        for jobs in (ls, ss):
            nbytes = sum(cell.chunk_bytes[op.group] for j in jobs for op in j.ops)
            assert nbytes <= STEP_BYTES or len(jobs) == 1


def _cell(family: str, chunk: int, save: float, load: float, gemm_slow: float) -> dict[str, Any]:
    m = {"paths": ["kernel"], "save": {"gbps": save}, "load": {"gbps": load},
         "both": {"gbps": save + load}}
    for k in ("save", "load", "both"):
        m["gemm_" + k] = {"gbps": m[k]["gbps"], "slowdown": gemm_slow}
    return {"family": family, "chunk_target": chunk, "chunk_bytes": chunk, "blocks_per_chunk": 1,
            "min_piece": 8192, "max_piece": 8192, "modes": {"kernel": m}, "auto": "kernel"}


def test_targets_name_each_miss_and_the_table_marks_the_auto_path() -> None:
    ceiling = {k: {"gbps": g, "design": g, "within_5pct_of_design": True}
               for k, g in (("d2h", 50.0), ("h2d", 50.0), ("both", 100.0))}
    result = {"meta": {}, "ceiling": ceiling,
              "cells": [_cell("mha", 2 * MIB, 48.0, 47.0, 0.01),
                        _cell("indexer", 2 * MIB, 30.0, 47.0, 0.2),
                        _cell("mha", 256 * KIB, 40.0, 40.0, 0.01)]}
    got = {t["name"]: t for t in report.targets(result)}
    assert got["2MiB"]["misses"] == ["indexer 2048KiB save 30.0 < 45.0"]
    assert got["256KiB"]["met"] and not got["both"]["met"] and not got["gemm"]["met"]
    assert "indexer 2048KiB save GEMM slowed 20.0%" in got["gemm"]["misses"]
    result["targets"] = list(got.values())
    text = report.table(result)
    assert "| mha | 2048 KiB x1 | 8192..8192 | kernel* | 48.0 | 47.0 | 95.0 |" in text
    assert "| d2h | 50.0 | 50.0 | yes |" in text and "| not met |" in text


def test_gemm_slowdown_compares_the_window_with_the_gemms_alone() -> None:
    s = gemm_slowdown([1.1, 1.1], [1.0, 1.0, 1.0], 2.2, 0.5)
    assert s["slowdown"] == pytest.approx(0.1) and s["window_covered"] == pytest.approx(1.0)
    assert gemm_slowdown([1.0], [], 2.0, 0.5)["slowdown"] == pytest.approx(1.0)


SMOKE_RUNS = {
    "t": ["--families", "mha,hybrid,kimi_linear,minimax_m3", "--chunks", "256KiB,2MiB"],
    # --verify: saves checksum what they write and loads verify it
    "v": ["--verify", "--families", "mha,kimi_linear", "--chunks", "256KiB"],
    # --sweep: the kernel path's width/grid/batch shapes, saves and loads (alone on CPU)
    "s": ["--sweep", "--families", "mha", "--chunks", "256KiB", "--modes", "kernel"],
}


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[dict[str, tuple[Background, Path]]]:
    """The module's ``--smoke`` runs, started at once: each is mostly one busy Python
    thread (the Triton interpreter), so on two cores together they take about as long as the
    longer one. Each test waits for its own (its output folder, its exit status)."""
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    started: dict[str, tuple[Background, Path]] = {}
    try:
        for tag, extra in SMOKE_RUNS.items():
            out = tmp_path_factory.mktemp(f"smoke-{tag}")
            started[tag] = (Background(
                [sys.executable, "-m", "kvtier.cli", "bench", "transfer", "--smoke", *extra,
                 "--out", str(out), "--tag", tag], out / "log", env=env), out)
        yield started
    finally:
        for run, _ in started.values():
            run.kill()


def _smoke(runs: dict[str, tuple[Background, Path]], tag: str) -> Path:
    """The folder of the smoke run ``tag`` once it ended, which it must have done cleanly."""
    run, out = runs[tag]
    rc, log = run.result(600)
    assert rc == 0, log[-4000:]
    return out


def test_smoke_run_writes_the_table_json_and_png(
        smoke_runs: dict[str, tuple[Background, Path]]) -> None:
    out = _smoke(smoke_runs, "t")
    (js,) = out.glob("transfer-*-cpu-smoke-t.json")
    result = json.loads(js.read_text())
    # a registered layout runs once, at its own chunk, whatever --chunks lists
    assert [c["family"] for c in result["cells"]] == ["mha", "mha", "hybrid", "hybrid",
                                                      "kimi_linear", "minimax_m3"]
    for c in result["cells"]:
        assert "errors" not in c and set(c["modes"]) == {"dma", "kernel"}
        for m in c["modes"].values():
            assert m["save"]["bytes"] > 0 and m["load"]["bytes"] > 0 and m["both"]["bytes"] > 0
    md = js.with_suffix(".md").read_text()
    assert "| mha | 8 KiB x1 | 8192..8192 | kernel* |" in md and "| hybrid |" in md
    assert js.with_suffix(".png").stat().st_size > 0


def test_the_kimi_linear_layout_is_what_vllm_registered_on_the_h200() -> None:
    """27 layers as vLLM 0.25.1 registered them (run2/kimi_linear.json, 4 layers there):
    MLA (nb, 1888, 576) bf16; KDA pages of 2,174,976 bytes holding conv (3, 12288) bf16 then
    the recurrent state (32, 128, 128) float32; one block per chunk; a state per chunk."""
    geo = cases.cache_case("kimi_linear", 2 * MIB, 1 << 30)
    (mla_kind, bs, mla), (state_kind, state_bs, kda) = geo.groups
    assert (mla_kind, state_kind, bs, state_bs, len(mla), len(kda)) == (
        "full", "state", 1888, 1888, 7, 20)
    assert geo.tensors[mla[0]] == ((geo.num_blocks, 1888, 576), "bfloat16")
    assert geo.tensors[kda[0]] == [((geo.num_blocks, 3, 12288), "bfloat16"),
                                   ((geo.num_blocks, 32, 128, 128), "float32")]
    assert geo.page_bytes[kda[0]] == 2174976 == 1888 * 576 * 2
    assert geo.bpc == [1, 1] and geo.state_every == 1
    boundary = 7 * 2174976 + 20 * (3 * 12288 * 2 + 32 * 128 * 128 * 4)
    assert geo.num_blocks >= 2 * ((1 << 30) // boundary)  # distinct blocks per direction


def test_smoke_run_with_verified_restores(
        smoke_runs: dict[str, tuple[Background, Path]]) -> None:
    """``--verify``: saves checksum what they write and loads verify it (the engine fails a
    job on a mismatch, which the run reports as an error): a clean run has no errors."""
    out = _smoke(smoke_runs, "v")
    (js,) = out.glob("transfer-*-cpu-smoke-v.json")
    result = json.loads(js.read_text())
    assert result["meta"]["verify_checksums"] is True
    assert [c["family"] for c in result["cells"]] == ["mha", "kimi_linear"]
    assert all("errors" not in c and c["modes"] for c in result["cells"])


def test_smoke_run_sweeps_the_kernel_shapes_in_both_directions(
        smoke_runs: dict[str, tuple[Background, Path]]) -> None:
    """``--sweep`` on a cell that is not the indexer's 2 MiB: one row per shape of
    ``runner.SWEEP``, with saves and loads measured (no GEMM on CPU: those fields are None)."""
    from kvtier.bench.transfer.runner import SWEEP

    out = _smoke(smoke_runs, "s")
    (js,) = out.glob("transfer-*-cpu-smoke-s.json")
    (cell,) = json.loads(js.read_text())["cells"]
    rows = cell["sweep"]
    assert [(r["num_warps"], r["max_programs"], r["batch_bytes"]) for r in rows] == [
        x[:3] for x in SWEEP]
    staging = {r["staging_bytes"] for r in rows}
    assert len(staging) == 2 and max(staging) == 4 * min(staging)  # the ring is swept too
    for r in rows:
        assert r["save"] > 0 and r["load"] > 0
        assert r["save_gemm"] is None and r["load_slowdown"] is None


H200_CENSUS = ROOT / "bench/results/2026-12-01-gpu-h200-session3"
H200_REGISTRATIONS = ROOT / "bench/results/2026-12-01-bare-gpu-h200-vllm025/run2"
CENSUS_FILES = {"deepseek_v32": "check-sparse/seed/deepseek_v32_kvtier.json",
                "glm_moe_dsa": "check-sparse/seed/glm_moe_dsa_kvtier.json",
                "minimax_m3": "check-sparse/seed/minimax_m3_probe.json",
                "deepseek_v3_mtp": "check-hybrid-mtp/seed/deepseek_v3_mtp_kvtier.json"}


def _built_group(geo: cases.CacheCase) -> Any:
    """The layout kvtier builds from the case's tensors (CPU), and its one group."""
    from kvtier.bench.transfer.cases import _allocate
    from kvtier.layout import GroupKind, GroupSpec, build_layout

    kv, layers, _ = _allocate(geo, torch.device("cpu"))
    specs = [GroupSpec(GroupKind(k), bs, tuple(names)) for k, bs, names in geo.groups]
    layout = build_layout(kv, specs, geo.num_blocks, kv_cache_dtype=geo.kv_cache_dtype,
                          layers=layers)
    (group,) = layout.groups
    return layout, group


@pytest.mark.parametrize("family", sorted(CENSUS_FILES))
def test_a_registered_layout_at_the_census_layer_count_is_what_the_h200_registered(
        family: str) -> None:
    """The smoke build is the seed configuration the H200 ran (4 layers there): kvtier's
    census of that run (groups, block size, registered caches, bytes per block and chunk)
    and, where run2 recorded them, every tensor's name, block shape and dtype."""
    census = json.loads((H200_CENSUS / CENSUS_FILES[family]).read_text())["census"]
    (want,) = census["groups"]
    geo = cases.cache_case(family, 2 * MIB, 2 * MIB, smoke=True)
    layout, group = _built_group(geo)
    assert (geo.groups[0][0], geo.groups[0][1], len(geo.groups[0][2])) == (
        want["kind"], want["block_size"], want["layers"])
    assert group.bytes_per_block == want["bytes_per_block"]
    assert geo.bpc[0] * geo.groups[0][1] == census["chunk_tokens"]
    assert geo.bpc[0] * group.bytes_per_block == want["chunk_bytes"]
    reg = H200_REGISTRATIONS / f"{family}.json"
    if family != "minimax_m3":  # its bare run2 stopped before registering (flashinfer)
        tensors = json.loads(reg.read_text())["census"]["tensors"]
        assert {nm: (tuple(t[0]["shape"][1:]), t[0]["dtype"]) for nm, t in tensors.items()} \
            == {nm: (shape[1:], dt) for nm, (shape, dt) in geo.tensors.items()}
    else:  # M3: one dense layer's per-tensor scales are keyed, no bytes in the blocks
        assert layout.fixed_scales == {"model.layers.0.self_attn.attn.k_scale": 1.0,
                                       "model.layers.0.self_attn.attn.v_scale": 1.0}


@pytest.mark.parametrize(("family", "caches", "block_bytes", "bpc"), [
    ("deepseek_v32", 122, 61 * (64 * 576 * 2 + 64 * 132), 4),
    ("glm_moe_dsa", 156, 78 * (64 * 656 + 64 * 132), 4),
    ("minimax_m3", 117, 60 * 2 * 128 * 4 * 128 + 57 * 128 * 128 * 2, 2),
    ("deepseek_v3_mtp", 62, 62 * 16 * 576 * 2, 16),
])
def test_a_registered_layout_at_the_real_layer_count_scales_the_census(
        family: str, caches: int, block_bytes: int, bpc: int) -> None:
    """The real models: the census's per-cache rows times the real layer counts (61; GLM-5's
    78; M3's 3 dense + 57 sparse layers; 61 + 1 MTP draft), one chunk of 256 tokens, enough
    distinct blocks for the span in each direction."""
    span = 1 << 30
    geo = cases.cache_case(family, 256 * KIB, span)
    assert len(geo.tensors) == caches and geo.bpc == [bpc]
    assert _bytes_per_block(geo) == block_bytes
    assert geo.num_blocks % 2 and geo.num_blocks >= 2 * span // block_bytes
    if family == "minimax_m3":
        names = list(geo.tensors)
        assert names[:3] == [f"model.layers.{i}.self_attn.attn" for i in range(3)]
        assert names[3:5] == ["model.layers.3.self_attn.attn",
                              "model.layers.3.self_attn.attn.index_cache"]
        assert geo.tensors[names[0]] == ((geo.num_blocks, 2, 128, 4, 128), "uint8")
        assert geo.tensors[names[4]] == ((geo.num_blocks, 128, 128), "bfloat16")
    if family == "deepseek_v3_mtp":
        assert "model.layers.61.self_attn.attn" in geo.tensors
