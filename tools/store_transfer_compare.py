"""Save and load GB/s through the store's shared pool against the in-process pool (issue 18:
equal within 5%), from the JSON files of ``kvtier bench transfer --host-pool slab|store``
runs in one folder (``bench/gpu_store.sh`` makes them). Prints a Markdown table; ``--json``
writes the numbers too.

    python tools/store_transfer_compare.py DIR [--json out.json]

Per cell (family, chunk), engine path and direction: the median GB/s of each pool over its
runs, the store's as a fraction of the in-process pool's, and whether it is within 5% below
(faster counts as within); each pool's range over its runs and the ratio of the pools' best
runs; and whether the path is the one the engine's auto mode takes for that layout (``*``).
Why the ranges: on the H200 the small-piece cells are bimodal run to run on every pool
(e.g. the slab's own mla_bf16 216 KiB dma saves 24.4-44.5 GB/s over five runs), so a
median over a few runs can land in either mode; where both pools' ranges overlap and their
best runs agree, a median difference is the measurement's, not the pool's. The verdicts are
printed for every cell and for the engine's paths alone. The pinned-memcpy ceilings
measured on each pool come alongside.
Where ``--host-pool memfd`` runs are there too (a memfd of this process: the store's kind of
memory without the store), their GB/s come as a third column over the in-process pool's.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

KINDS = ("save", "load", "both")
TOLERANCE = 0.05


def load_runs(folder: Path) -> dict[str, list[dict[str, Any]]]:
    """The bench results in ``folder`` by host pool."""
    runs: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for f in sorted(folder.glob("transfer-*.json")):
        r = json.loads(f.read_text())
        pool = (r.get("meta", {}).get("host_pool") or {}).get("pool")
        if pool:
            runs[pool].append(r)
    return runs


Key = tuple[str, int, str, str]  # family, chunk bytes, path, direction


def auto_paths(runs: list[dict[str, Any]]) -> set[tuple[str, int, str]]:
    """(family, chunk bytes, path) of the path the engine's auto mode takes, per cell."""
    return {(c["family"], c["chunk_bytes"], c["auto"]) for r in runs for c in r["cells"]
            if c.get("auto")}


def gbps(runs: list[dict[str, Any]]) -> dict[Key, list[float]]:
    out: dict[Key, list[float]] = defaultdict(list)
    for r in runs:
        for c in r["cells"]:
            for mode, m in c["modes"].items():
                for kind in KINDS:
                    if kind in m:
                        out[(c["family"], c["chunk_bytes"], mode, kind)].append(m[kind]["gbps"])
        for kind, v in (r.get("ceiling") or {}).items():
            out[("ceiling", 0, "memcpy", kind)].append(v["gbps"])
    return out


def compare(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    base, store = gbps(runs.get("slab", [])), gbps(runs.get("store", []))
    memfd = gbps(runs.get("memfd", []))
    auto = auto_paths(runs.get("slab", []) + runs.get("store", []))
    rows = []
    for key in sorted(set(base) & set(store)):
        b, s = statistics.median(base[key]), statistics.median(store[key])
        ratio = s / b if b else float("nan")
        best = max(store[key]) / max(base[key]) if max(base[key]) else float("nan")
        row = {"family": key[0], "chunk_bytes": key[1], "path": key[2], "kind": key[3],
               "engine_path": key[0] == "ceiling" or key[:3] in auto,
               "inproc_gbps": b, "store_gbps": s, "runs": [len(base[key]), len(store[key])],
               "inproc_range": [min(base[key]), max(base[key])],
               "store_range": [min(store[key]), max(store[key])],
               "store_over_inproc": ratio, "within_5pct": ratio >= 1 - TOLERANCE,
               "best_store_over_inproc": best, "best_within_5pct": best >= 1 - TOLERANCE}
        if memfd.get(key):
            m = statistics.median(memfd[key])
            row.update(memfd_gbps=m, memfd_over_inproc=m / b if b else float("nan"))
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    with_memfd = any("memfd_gbps" in r for r in rows)
    extra = " memfd/in-process |" if with_memfd else ""
    lines = ["| cell | path | direction | in-process GB/s (range) | store GB/s (range) | "
             "store/in-process | within 5% | best/best |" + extra,
             "|---|---|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for r in rows:
        cell = r["family"] if r["family"] == "ceiling" else (
            f"{r['family']} {r['chunk_bytes'] // 1024} KiB")
        path = r["path"] + ("*" if r.get("engine_path") and r["family"] != "ceiling" else "")
        lo_b, hi_b = r["inproc_range"]
        lo_s, hi_s = r["store_range"]
        m = (f" {r['memfd_over_inproc']:.3f} |" if "memfd_gbps" in r else " - |") if extra else ""
        lines.append(f"| {cell} | {path} | {r['kind']} | {r['inproc_gbps']:.2f} "
                     f"({lo_b:.1f}-{hi_b:.1f}) | {r['store_gbps']:.2f} ({lo_s:.1f}-{hi_s:.1f}) | "
                     f"{r['store_over_inproc']:.3f} | {'yes' if r['within_5pct'] else 'NO'} | "
                     f"{r['best_store_over_inproc']:.3f} |" + m)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    runs = load_runs(Path(a.folder))
    rows = compare(runs)
    print(f"runs: {', '.join(f'{k} {len(v)}' for k, v in sorted(runs.items()))}\n")
    print(table(rows))
    measured = [r for r in rows if r["family"] != "ceiling"]
    engine = [r for r in measured if r["engine_path"]]
    ok = bool(measured) and all(r["within_5pct"] for r in measured)
    ok_engine = bool(engine) and all(r["within_5pct"] for r in engine)
    ok_best = bool(measured) and all(r["best_within_5pct"] for r in measured)
    print("\n(* the path the engine's auto mode takes for that layout)")
    print(f"store within 5% of the in-process pool (medians), every measured cell: "
          f"{'yes' if ok else 'NO'}; the engine's paths (*): {'yes' if ok_engine else 'NO'}; "
          f"best runs, every cell: {'yes' if ok_best else 'NO'}")
    if a.json:
        Path(a.json).write_text(json.dumps(
            {"rows": rows, "all_within_5pct": ok, "engine_paths_within_5pct": ok_engine,
             "best_runs_within_5pct": ok_best}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
