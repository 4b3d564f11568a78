"""Disk tier throughput on this machine, page cache bypassed, against dd on the same directory.

    python tools/bench_disk.py DIR [--chunk-mib 2] [--total-mib 512] [--rebuild 100000]

- tier write: :class:`kvtier.tiers.disk.DiskChunkStore.put` of ``total/chunk`` chunks (O_DIRECT,
  header, checksum, atomic rename), then tier read: ``get`` of each (O_DIRECT: every read is
  cold, the page cache is not involved), verifying every checksum;
- dd: ``dd oflag=direct`` writing one file of the same size in chunk-size blocks, then
  ``dd iflag=direct`` reading it;
- rebuild (``--rebuild N``): N chunk files (empty: the rebuild reads names only) and the time
  to scan the directory and rebuild the tier's index, as a restart does.
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import torch

from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.directory import scan
from kvtier.tiers.disk import DiskChunkStore, chunk_name, shard_dir

NS = bytes(range(16))


def tier_rates(root: Path, chunk: int, n: int) -> dict[str, float]:
    store = DiskChunkStore(root, 0, NS)
    data = torch.randint(0, 256, (chunk,), dtype=torch.uint8)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        store.put(0, k, keys[i - 1] if i else None, data)
    os.sync()
    write = time.perf_counter() - t0
    out = torch.empty_like(data)
    t0 = time.perf_counter()
    for i, k in enumerate(keys):
        store.get(0, k, keys[i - 1] if i else None, out)
    read = time.perf_counter() - t0
    assert torch.equal(out, data)
    assert store.direct, "the filesystem refused O_DIRECT: the numbers would be cached ones"
    return {"tier_write_gbps": n * chunk / write / 1e9, "tier_read_gbps": n * chunk / read / 1e9}


def dd_rate(args: list[str]) -> float:
    res = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    m = re.search(r"([0-9.]+) s, ", res.stderr)
    copied = re.search(r"^(\d+) bytes", res.stderr, re.M)
    assert m and copied, res.stderr
    return int(copied.group(1)) / float(m.group(1)) / 1e9


def rebuild_time(root: Path, n: int) -> dict[str, float]:
    d = shard_dir(root, 0)
    d.mkdir(parents=True, exist_ok=True)
    keys = [(i + 1).to_bytes(16, "little") for i in range(n)]
    t0 = time.perf_counter()
    for i, k in enumerate(keys):  # chains of 64 chunks, like prefixes
        parent = keys[i - 1] if i % 64 else None
        (d / chunk_name(0, k, parent)).touch()
    made = time.perf_counter() - t0
    os.sync()
    t0 = time.perf_counter()
    found = scan(root, 1)
    scanned = time.perf_counter() - t0
    cat = TierCatalog(1, n)
    kept = cat.rebuild(found)
    total = time.perf_counter() - t0
    assert kept == n, (kept, n)
    return {"rebuild_chunks": n, "rebuild_scan_s": scanned, "rebuild_total_s": total,
            "create_files_s": made}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--total-mib", type=int, default=512)
    ap.add_argument("--rebuild", type=int, default=0)
    a = ap.parse_args()
    base = Path(a.dir) / "kvtier-bench"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    chunk = int(a.chunk_mib * 2**20)
    n = max(1, a.total_mib * 2**20 // chunk)
    out: dict[str, float | int | str] = {"dir": a.dir, "chunk_bytes": chunk, "chunks": n}
    try:
        out.update(tier_rates(base / "tier", chunk, n))
        f = base / "dd.bin"
        bs = f"bs={chunk}"
        out["dd_write_gbps"] = dd_rate(["if=/dev/zero", f"of={f}", bs, f"count={n}",
                                        "oflag=direct", "conv=fsync"])
        out["dd_read_gbps"] = dd_rate([f"if={f}", "of=/dev/null", bs, "iflag=direct"])
        out["tier_vs_dd_write"] = out["tier_write_gbps"] / out["dd_write_gbps"]  # type: ignore[operator]
        out["tier_vs_dd_read"] = out["tier_read_gbps"] / out["dd_read_gbps"]  # type: ignore[operator]
        if a.rebuild:
            out.update(rebuild_time(base / "rebuild", a.rebuild))
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
