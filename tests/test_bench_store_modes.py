"""The benches' node-wide store modes (issue 18): ``kvtier bench transfer --host-pool`` copies
into memory of the pool it names (the store's: its memfd, attached as a worker attaches), and
``kvtier bench planner --store-size`` runs the scheduler half with its index in a real store
process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.bench.transfer.pools import host_pool
from kvtier.testing.store_probe import POOL_NAME, mapping_of

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "TRITON_INTERPRET": "1",
       "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}


@pytest.mark.parametrize("kind", ["pinned", "slab", "store", "memfd"])
def test_a_host_pool_is_the_memory_it_names(kind: str) -> None:
    with host_pool(kind, 8 * 2**20, cuda=False) as (buf, info):
        assert buf.numel() >= 8 * 2**20 and info["pool"] == kind
        first, last = buf.data_ptr(), buf.data_ptr() + buf.numel() - 1
        # memfd: the store's kind of memory (its memfd), made by this process
        in_store = [mapping_of(p).startswith(POOL_NAME) for p in (first, last)]
        assert in_store == [kind in ("store", "memfd")] * 2
        if kind != "pinned":  # the page sizes of the mapping, as the kernel reports them
            smaps = info["smaps"]
            assert smaps["Size_kB"] * 1024 >= 8 * 2**20
            assert smaps["mapping"].startswith(POOL_NAME) == (kind != "slab")
        buf[-4096:].fill_(7)  # writable to its end
        if kind == "store":
            assert info["store_line"].startswith("kvtier store ready on unix://")


def test_a_transfer_smoke_run_through_the_stores_pool(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "transfer", "--smoke",
                           "--families", "mha", "--chunks", "2MiB", "--modes", "dma",
                           "--host-pool", "store", "--out", str(tmp_path), "--tag", "s"],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (js,) = tmp_path.glob("transfer-*-cpu-smoke-s.json")
    result = json.loads(js.read_text())
    assert result["meta"]["host_pool"]["pool"] == "store"
    (cell,) = result["cells"]
    assert "errors" not in cell  # every phase's bytes spot-checked in the store's pool
    assert all(cell["modes"]["dma"][k]["bytes"] > 0 for k in ("save", "load", "both"))


def test_a_planner_run_through_a_store(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "planner",
                           "--running", "16", "--stored-chunks", "400", "--prefix-chunks", "20",
                           "--steps", "10", "--output-tokens", "2", "4", "--token-bytes", "16", "--policy", "lru",
                           "--store-size", "64MiB", "--out", str(tmp_path)],
                          env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "planner.json").read_text())
    assert result["index"] == "store" and result["saves_committed"] > 0
    assert result["us_per_request_step"]["p99"] > 0 and "lookup" in result["per_call_us"]
