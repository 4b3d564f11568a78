"""``kvtier bench disk``: the disk tier's sequential write and read GB/s against ``dd`` on the
same directory, page cache bypassed (issue 16; goal: the tier at >= 80% of dd).

- tier write: ``--total-mib / --chunk-mib`` chunks demoted through a
  :class:`~kvtier.tiers.seam.TierRunner` in jobs of ``--job-chunks`` (as the workers do:
  :meth:`kvtier.tiers.disk.DiskChunkStore.put`, O_DIRECT, header, checksum, atomic rename,
  ``--io-depth`` chunks in flight) then an fsync of every file and the directory (timed
  with the pass; its share is reported as ``tier_write_fsync_ms``: ``dd`` fsyncs its one
  file once); tier read: each promoted back (``get``, O_DIRECT: every read is cold),
  verifying every checksum and the bytes;
- dd: ``dd oflag=direct conv=fsync`` writing one file of the same size in chunk-size blocks,
  then ``dd iflag=direct`` reading it;
- ``--pairs`` alternations of (tier, dd), so load from other processes hits both alike; the
  table gives each one's median and spread (min-max), the ratio of the medians, and the mean
  size of the device's requests during each pass (``/sys/dev/block/*/stat``; the whole
  device's, so other processes' I/O counts too): a direct I/O moves in one request only where
  its buffer is physically contiguous, and ``dd``'s malloc'd buffer is so by chance (on the
  CI machine's virtio disk 2 MiB requests read 2-2.5 GB/s, 512 KiB ones 0.8-1.2), so a dd
  pass of small requests is a low ceiling: the column says which passes were, and the
  per-pair ratios (tier pass over the dd pass of its pair) are given over every pair and over
  the pairs whose dd pass moved whole chunks (mean request at least 95% of a chunk);
- ``--rebuild N``: N chunk files (empty: a restart reads names only) and the time to scan the
  directory and rebuild the tier's index, as a warm restart does.

Writes ``disk.json`` and ``disk.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HELP = "disk tier sequential write/read GB/s vs dd on the same directory (O_DIRECT, cold)"

NS = bytes(range(16))
GOAL = 0.8


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("dir", help="directory on the disk to measure (a kvtier-bench folder "
                   "is made and removed there)")
    p.add_argument("--chunk-mib", type=float, default=2.0, help="chunk (and dd block) size")
    p.add_argument("--total-mib", type=int, default=512, help="bytes per pass")
    p.add_argument("--pairs", type=int, default=3, help="alternations of (tier, dd)")
    p.add_argument("--io-depth", type=int, default=None,
                   help="chunks in flight (default: the tier's, DEFAULT_IO_DEPTH)")
    p.add_argument("--job-chunks", type=int, default=16,
                   help="chunks per tier job (a prefix's chain moves as one job)")
    p.add_argument("--rebuild", type=int, default=0, help="chunks for the rebuild timing")
    p.add_argument("--out", default="bench/out/disk", help="folder for JSON and PNG")


def _tier_pass(root: Path, chunk: int, n: int, depth: int, job_chunks: int,
               requests: DeviceRequests) -> tuple[float, float, float]:
    """One write and one read pass of ``n`` chunks, driven as the workers drive the tier: a
    :class:`~kvtier.tiers.seam.TierRunner` running jobs of ``job_chunks`` chunks (a prefix's
    chain), up to ``depth`` chunks in flight. Write and read GB/s, and the milliseconds of
    the write pass that the fsync of its files took."""
    import torch

    from kvtier.tiers.disk import DiskChunkStore
    from kvtier.tiers.seam import TierJob, TierJobKind, TierOp, TierRunner

    shutil.rmtree(root, ignore_errors=True)
    store = DiskChunkStore(root, 0, NS, io_depth=depth)
    job_chunks = max(1, min(job_chunks, n))
    slots = _page_aligned(job_chunks * chunk).view(job_chunks, chunk)  # as the slab's
    slots.copy_(torch.randint(0, 256, (job_chunks, chunk), dtype=torch.uint8))
    want = slots.clone()
    runner = TierRunner(store, lambda g, s: slots[s], max_jobs=n)
    keys = [i.to_bytes(16, "little") for i in range(n)]
    ops = [TierOp(0, i % job_chunks, k, keys[i - 1] if i else None) for i, k in enumerate(keys)]

    synced = [0.0]

    def timed(kind: TierJobKind) -> float:
        t0 = time.perf_counter()
        for j in range(0, n, job_chunks):
            runner.submit(TierJob(j, kind, ops[j : j + job_chunks]))
        runner.drain()
        if kind is TierJobKind.DEMOTE:
            t1 = time.perf_counter()
            _fsync_tree(store.dir)
            synced[0] = time.perf_counter() - t1
        seconds = time.perf_counter() - t0
        failed = [c for c in runner.poll() if not c.ok]
        if failed:
            raise RuntimeError(f"tier {kind} jobs failed: {failed[0]}")
        return seconds

    try:
        with requests.counting("tier_write"):
            write = timed(TierJobKind.DEMOTE)
        slots.zero_()
        with requests.counting("tier_read"):
            read = timed(TierJobKind.PROMOTE)
        direct = store.direct
    finally:
        runner.close()
        shutil.rmtree(root, ignore_errors=True)
    if not torch.equal(slots, want) or not direct:
        raise RuntimeError("the tier's bytes differ, or the filesystem refused O_DIRECT "
                           "(the numbers would be the page cache's)")
    return n * chunk / write / 1e9, n * chunk / read / 1e9, synced[0] * 1e3


def _page_aligned(nbytes: int) -> Any:
    """``nbytes`` of memory allocated as the private slab's (huge-page backed)."""
    from kvtier.huge_pages import huge_page_buffer

    return huge_page_buffer(nbytes)[1]


def _fsync_tree(d: Path) -> None:
    """Make the tier's files durable as ``dd conv=fsync`` does its one file: fsync each file
    and their directory (``os.sync`` would also flush every other process's dirty pages)."""
    for entry in os.scandir(d):
        fd = os.open(entry.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _dd(args: list[str]) -> float:
    res = subprocess.run(["dd", *args], capture_output=True, text=True, check=True)
    seconds = re.search(r"([0-9.]+) s, ", res.stderr)
    copied = re.search(r"^(\d+) bytes", res.stderr, re.M)
    if not seconds or not copied:
        raise RuntimeError(f"unexpected dd output: {res.stderr}")
    return int(copied.group(1)) / float(seconds.group(1)) / 1e9


def _dd_pass(f: Path, chunk: int, n: int, requests: DeviceRequests) -> tuple[float, float]:
    bs = f"bs={chunk}"
    with requests.counting("dd_write"):
        write = _dd(["if=/dev/zero", f"of={f}", bs, f"count={n}", "oflag=direct", "conv=fsync"])
    with requests.counting("dd_read"):
        read = _dd([f"if={f}", "of=/dev/null", bs, "iflag=direct"])
    f.unlink()
    return write, read


class DeviceRequests:
    """Mean KiB per request of the block device holding ``d``, per named pass (reads for a
    ``*_read`` pass, writes otherwise), from its ``stat`` file; nothing where there is none
    (the directory is not on a block device: tmpfs, overlay)."""

    def __init__(self, d: Path) -> None:
        st = os.stat(d)
        stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
        self._stat = stat if stat.exists() else None
        self.kib: dict[str, list[float]] = {}

    def _read(self) -> list[int]:
        return [int(x) for x in self._stat.read_text().split()] if self._stat else []

    @contextlib.contextmanager
    def counting(self, name: str) -> Iterator[None]:
        before = self._read()
        yield
        after = self._read()
        if not before or len(after) < 7:
            return
        ios, sectors = (0, 2) if name.endswith("_read") else (4, 6)
        n = after[ios] - before[ios]
        if n > 0:
            self.kib.setdefault(name, []).append((after[sectors] - before[sectors]) * 512
                                                  / n / 1024)


def _rebuild(root: Path, n: int) -> dict[str, float]:
    from kvtier.tiers.catalog import TierCatalog
    from kvtier.tiers.directory import scan
    from kvtier.tiers.disk import chunk_name, shard_dir

    d = shard_dir(root, 0)
    d.mkdir(parents=True, exist_ok=True)
    keys = [(i + 1).to_bytes(16, "little") for i in range(n)]
    for i, k in enumerate(keys):  # chains of 64 chunks, like prefixes
        (d / chunk_name(0, k, keys[i - 1] if i % 64 else None)).touch()
    os.sync()
    t0 = time.perf_counter()
    found = scan(root, 1)
    scanned = time.perf_counter() - t0
    kept = TierCatalog(1, n).rebuild(found)
    total = time.perf_counter() - t0
    shutil.rmtree(root, ignore_errors=True)
    if kept != n:
        raise RuntimeError(f"the rebuild kept {kept} of {n} chunks")
    return {"chunks": n, "scan_s": scanned, "total_s": total}


def _summary(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def run(args: argparse.Namespace) -> int:
    base = Path(args.dir) / "kvtier-bench"
    base.mkdir(parents=True, exist_ok=True)
    chunk = int(args.chunk_mib * 2**20)
    n = max(1, args.total_mib * 2**20 // chunk)
    from kvtier.tiers.disk import DEFAULT_IO_DEPTH  # imports torch: not at the CLI's start

    depth = args.io_depth = args.io_depth or DEFAULT_IO_DEPTH
    passes: dict[str, list[float]] = {k: [] for k in
                                      ("tier_write", "tier_read", "dd_write", "dd_read")}
    requests = DeviceRequests(base)
    fsync_ms: list[float] = []
    try:
        for _ in range(args.pairs):
            w, r, synced = _tier_pass(base / "tier", chunk, n, depth, args.job_chunks,
                                      requests)
            passes["tier_write"].append(w)
            passes["tier_read"].append(r)
            fsync_ms.append(synced)
            w, r = _dd_pass(base / "dd.bin", chunk, n, requests)
            passes["dd_write"].append(w)
            passes["dd_read"].append(r)
        rebuild = _rebuild(base / "rebuild", args.rebuild) if args.rebuild else None
    finally:
        shutil.rmtree(base, ignore_errors=True)
    result = _result(args, chunk, n, passes, rebuild, requests.kib)
    result["tier_write_fsync_ms"] = fsync_ms  # per pair: the share of its write pass
    _print(result)
    _report(result, args.out)
    return 0


def _result(args: argparse.Namespace, chunk: int, n: int, passes: dict[str, list[float]],
            rebuild: dict[str, float] | None, request_kib: dict[str, list[float]]
            ) -> dict[str, Any]:
    gbps = {k: {**_summary(v), "passes": v, "request_kib": request_kib.get(k, [])}
            for k, v in passes.items()}
    ratio = {d: gbps[f"tier_{d}"]["median"] / gbps[f"dd_{d}"]["median"]
             for d in ("write", "read")}
    per_pair = {d: _per_pair(passes[f"tier_{d}"], passes[f"dd_{d}"],
                             request_kib.get(f"dd_{d}", []), chunk / 1024)
                for d in ("write", "read")}
    return {
        "bench": "disk", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": platform.node(), "dir": args.dir, "chunk_bytes": chunk, "chunks": n,
        "pairs": args.pairs, "io_depth": args.io_depth,
        "job_chunks": args.job_chunks, "load_average": os.getloadavg(), "gbps": gbps,
        "tier_vs_dd": ratio, "tier_vs_dd_per_pair": per_pair, "goal": GOAL,
        "met": {d: r >= GOAL for d, r in ratio.items()}, "rebuild": rebuild,
    }


WHOLE = 0.95
"""A dd pass moved whole chunks when its mean device request is at least this share of one."""


def _per_pair(tier: list[float], dd: list[float], dd_kib: list[float], chunk_kib: float
              ) -> dict[str, Any]:
    """Each pair's tier/dd ratio; their median and spread over every pair and over the pairs
    whose dd pass moved whole chunks (``whole``: absent without request sizes)."""
    ratios = [t / d for t, d in zip(tier, dd, strict=True)]
    out: dict[str, Any] = {"ratios": ratios, "all": _summary(ratios)}
    if len(dd_kib) == len(ratios):
        whole = [r for r, kib in zip(ratios, dd_kib, strict=True) if kib >= WHOLE * chunk_kib]
        out["whole_pairs"] = len(whole)
        out["whole"] = _summary(whole) if whole else None
    return out


def _print(result: dict[str, Any]) -> None:
    print(f"{'pass':<12}{'median GB/s':>12}{'min':>8}{'max':>8}   GB/s (KiB per request) by pair")
    for k, v in result["gbps"].items():
        kib = v["request_kib"] if len(v["request_kib"]) == len(v["passes"]) else None
        each = " ".join(f"{g:.2f}" + (f" ({kib[i]:.0f})" if kib else "")
                        for i, g in enumerate(v["passes"]))
        print(f"{k:<12}{v['median']:>12.2f}{v['min']:>8.2f}{v['max']:>8.2f}   {each}")
    for d, r in result["tier_vs_dd"].items():
        met = "met" if result["met"][d] else "NOT met"
        pp = result["tier_vs_dd_per_pair"][d]
        line = (f"tier/dd {d}: {r:.0%} (goal {GOAL:.0%}: {met}); per pair {_spread(pp['all'])} "
                f"over {len(pp['ratios'])}")
        if "whole" in pp:
            line += (f", {_spread(pp['whole'])} over the {pp['whole_pairs']} whose dd moved "
                     "whole chunks" if pp["whole"] else ", no dd pass moved whole chunks")
        print(line)
    if result.get("tier_write_fsync_ms"):
        ms = result["tier_write_fsync_ms"]
        print(f"the tier's write passes include an fsync of each file: "
              f"{statistics.median(ms):.0f} ms median ({min(ms):.0f}-{max(ms):.0f})")
    if result["rebuild"]:
        rb = result["rebuild"]
        print(f"rebuild of {rb['chunks']:,} chunks: {rb['total_s']:.2f} s "
              f"(scan {rb['scan_s']:.2f} s)")


def _spread(s: dict[str, float]) -> str:
    return f"{s['median']:.0%} ({s['min']:.0%}-{s['max']:.0%})"


def _report(result: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "disk.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3.5))
        names = list(result["gbps"])
        med = [result["gbps"][k]["median"] for k in names]
        lo = [m - result["gbps"][k]["min"] for k, m in zip(names, med, strict=True)]
        hi = [result["gbps"][k]["max"] - m for k, m in zip(names, med, strict=True)]
        ax.bar(names, med, yerr=[lo, hi], capsize=4,
               color=["tab:blue", "tab:blue", "tab:gray", "tab:gray"])
        ax.set_ylabel("GB/s (median, min-max)")
        ax.set_title(f"disk tier vs dd, {result['chunk_bytes'] >> 20} MiB chunks, "
                     f"{result['pairs']} pairs")
        fig.tight_layout()
        fig.savefig(os.path.join(out, "disk.png"), dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        pass
    print(f"wrote {out}/disk.json and disk.png")
