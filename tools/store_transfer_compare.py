"""Save and load GB/s through the store's shared pool against the in-process pool (issue 18:
equal within 5%), from the JSON files of ``kvtier bench transfer --host-pool slab|store``
runs in one folder (``bench/gpu_store.sh`` makes them). Prints a Markdown table; ``--json``
writes the numbers too.

    python tools/store_transfer_compare.py DIR [--json out.json]

Per cell (family, chunk), engine path and direction: the median GB/s of each pool over its
runs, the store's as a fraction of the in-process pool's, and whether it is within 5% below
(faster counts as within). The pinned-memcpy ceilings measured on each pool come alongside.
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


def gbps(runs: list[dict[str, Any]]) -> dict[tuple[str, int, str, str], list[float]]:
    out: dict[tuple[str, int, str, str], list[float]] = defaultdict(list)
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
    rows = []
    for key in sorted(set(base) & set(store)):
        b, s = statistics.median(base[key]), statistics.median(store[key])
        ratio = s / b if b else float("nan")
        row = {"family": key[0], "chunk_bytes": key[1], "path": key[2], "kind": key[3],
               "inproc_gbps": b, "store_gbps": s, "runs": [len(base[key]), len(store[key])],
               "store_over_inproc": ratio, "within_5pct": ratio >= 1 - TOLERANCE}
        if memfd.get(key):
            m = statistics.median(memfd[key])
            row.update(memfd_gbps=m, memfd_over_inproc=m / b if b else float("nan"))
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    with_memfd = any("memfd_gbps" in r for r in rows)
    extra = " memfd/in-process |" if with_memfd else ""
    lines = ["| cell | path | direction | in-process GB/s | store GB/s | store/in-process | "
             "within 5% |" + extra, "|---|---|---|---|---|---|---|" + ("---|" if extra else "")]
    for r in rows:
        cell = r["family"] if r["family"] == "ceiling" else (
            f"{r['family']} {r['chunk_bytes'] // 1024} KiB")
        m = (f" {r['memfd_over_inproc']:.3f} |" if "memfd_gbps" in r else " - |") if extra else ""
        lines.append(f"| {cell} | {r['path']} | {r['kind']} | {r['inproc_gbps']:.2f} | "
                     f"{r['store_gbps']:.2f} | {r['store_over_inproc']:.3f} | "
                     f"{'yes' if r['within_5pct'] else 'NO'} |" + m)
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
    ok = bool(measured) and all(r["within_5pct"] for r in measured)
    print(f"\nstore within 5% of the in-process pool on every measured cell: "
          f"{'yes' if ok else 'NO'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "all_within_5pct": ok}, indent=1))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
