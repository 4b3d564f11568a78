"""The README's depth table from the stored JSON: python tools/depth_agg.py (in this folder)."""
import glob
import json
import statistics

print("| io_depth | passes | tier write GB/s | tier read GB/s | per pair vs dd write | read | vs whole-request dd write | read |")
print("|---|---|---|---|---|---|---|---|")
for dp in (2, 4, 6, 8, 12, 16, 24):
    fs = glob.glob(f"depth/d{dp}-*.json")
    if not fs:
        continue
    tw, tr, rw, rr, ww, wr = [], [], [], [], [], []
    for f in fs:
        d = json.load(open(f))
        g = d["gbps"]
        tw += g["tier_write"]["passes"]
        tr += g["tier_read"]["passes"]
        rw += d["tier_vs_dd_per_pair"]["write"]["ratios"]
        rr += d["tier_vs_dd_per_pair"]["read"]["ratios"]
        for dir_, acc in (("write", ww), ("read", wr)):
            kib = g[f"dd_{dir_}"]["request_kib"]
            acc += [x for x, k in zip(d["tier_vs_dd_per_pair"][dir_]["ratios"], kib)
                    if k >= 0.95 * 2048]
    m = statistics.median

    def f2(xs):
        return f"{m(xs):.0%} (n={len(xs)})" if xs else "n=0"

    print(f"| {dp} | {len(tw)} | {m(tw):.2f} ({min(tw):.2f}-{max(tw):.2f}) | "
          f"{m(tr):.2f} ({min(tr):.2f}-{max(tr):.2f}) | {m(rw):.0%} | {m(rr):.0%} | {f2(ww)} | {f2(wr)} |")
