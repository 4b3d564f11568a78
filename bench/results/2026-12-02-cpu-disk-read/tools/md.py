"""The README's tables from the stored JSON: python tools/md.py ab1 ... ab6 (run in this folder).

Per window and variant (before: main at f2d390d; after: wip/disk-csum), per direction: the
tier's and dd's GB/s, each pair's tier/dd ratio (median, min-max) over every pair and over the
pairs whose dd pass moved whole 2,048 KiB requests (mean request >= 95% of a chunk)."""
import glob
import json
import os
import statistics
import sys


def load(win):
    rows = {}
    for f in sorted(glob.glob(f"ab/{win}-*.json")):
        v = os.path.basename(f)[len(win) + 1:].rsplit("-", 1)[0]
        d = json.load(open(f))
        g = d["gbps"]
        for i in range(d["pairs"]):
            r = {k: g[k]["passes"][i] for k in g}
            r.update({k + "_kib": g[k]["request_kib"][i] for k in g})
            rows.setdefault(v, []).append(r)
    return rows


def s(xs, pct=False):
    if not xs:
        return "-"
    f = (lambda x: f"{x:.0%}") if pct else (lambda x: f"{x:.2f}")
    return f"{f(statistics.median(xs))} ({f(min(xs))}-{f(max(xs))})"


def whole(rs, d):
    return [r for r in rs if r[f"dd_{d}_kib"] >= 0.95 * 2048]


pooled = {}
print("| window | variant | dir | pairs | tier GB/s | dd GB/s, all | per pair, all | whole-request dd passes | their GB/s | per pair, against them |")
print("|---|---|---|---|---|---|---|---|---|---|")
for w in sys.argv[1:]:
    rows = load(w)
    for v in [x for x in ("before", "xxh3depth4", "after") if x in rows]:
        for d in ("read", "write"):
            rs = rows[v]
            wh = whole(rs, d)
            pooled.setdefault((v, d), []).extend(rs)
            print(f"| {w} | {v} | {d} | {len(rs)} | {s([r[f'tier_{d}'] for r in rs])} | "
                  f"{s([r[f'dd_{d}'] for r in rs])} | "
                  f"{s([r[f'tier_{d}'] / r[f'dd_{d}'] for r in rs], True)} | {len(wh)} | "
                  f"{s([r[f'dd_{d}'] for r in wh])} | "
                  f"{s([r[f'tier_{d}'] / r[f'dd_{d}'] for r in wh], True)} |")
print()
print("| pooled | dir | pairs | per pair, all | whole-request dd passes | per pair, against them |")
print("|---|---|---|---|---|---|")
for (v, d), rs in sorted(pooled.items(), key=lambda x: (x[0][1], ("before", "xxh3depth4", "after").index(x[0][0]))):
    wh = whole(rs, d)
    print(f"| {v} | {d} | {len(rs)} | {s([r[f'tier_{d}'] / r[f'dd_{d}'] for r in rs], True)} | "
          f"{len(wh)} | {s([r[f'tier_{d}'] / r[f'dd_{d}'] for r in wh], True)} |")
