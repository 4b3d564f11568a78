"""Summarise the fresh demo runs under runs/run-N: one row per run, then median and spread."""
import json, statistics, sys
from pathlib import Path

rows, medians, pairs_all = [], [], []
for n in range(1, 11):
    d = Path(f"runs/run-{n}")
    if not (d / "done").exists():
        continue
    res = d / "out" / "results.json"
    checks = [l for l in (d / "stdout.txt").read_text().splitlines() if l.startswith("[")]
    times = (d / "times").read_text().split()
    if not res.exists():
        rows.append(f"| run-{n} | no results (rc {times[-1]}) | | | | | |")
        continue
    pairs: dict[int, dict] = {}
    starts: dict[str, float] = {}
    for r in json.loads(res.read_text())["runs"]:
        pairs.setdefault(r.get("round", 0), {})[r["name"]] = r["summary"]
        starts.setdefault(r["name"], r.get("server_start_s") or 0)
    ps = [pairs[k] for k in sorted(pairs)]
    ratios = [p["HBM-only"]["ttft_repeat_p50_ms"] / p["kvtier"]["ttft_repeat_p50_ms"] for p in ps]
    med = statistics.median(ratios)
    medians.append(med)
    pairs_all += ratios
    ok = sum(c.startswith("[ok]") for c in checks)
    hbm = " / ".join(f"{p['HBM-only']['ttft_repeat_p50_ms']:,.0f}" for p in ps)
    kvt = " / ".join(f"{p['kvtier']['ttft_repeat_p50_ms']:,.0f}" for p in ps)
    rows.append(f"| run-{n} | {ok}/{len(checks)} ok | {med:.1f}x | "
                f"{', '.join(f'{x:.1f}x' for x in ratios)} | {hbm} | {kvt} | "
                f"{times[1]}-{times[3]} | {starts.get('HBM-only', 0):.0f} / {starts.get('kvtier', 0):.0f} |")
    (Path(sys.argv[1]) / f"run-{n}-checks.txt").write_text("\n".join(checks) + "\n")
    (Path(sys.argv[1]) / f"run-{n}-table.txt").write_text((d / "out" / "table.txt").read_text())
print("| run | checks | median ratio | pairs | HBM-only repeated TTFT p50 (ms) | kvtier repeated TTFT p50 (ms) | UTC (with the lock) | server start s |")
print("|---|---|---|---|---|---|---|---|")
print("\n".join(rows))
if medians:
    print(f"\nruns {len(medians)}; median of the runs' medians {statistics.median(medians):.1f}x; "
          f"lowest {min(medians):.1f}x, highest {max(medians):.1f}x; single pairs "
          f"{min(pairs_all):.1f}x-{max(pairs_all):.1f}x over {len(pairs_all)} pairs; "
          f"pairs under 5x: {sum(x < 5 for x in pairs_all)}")
