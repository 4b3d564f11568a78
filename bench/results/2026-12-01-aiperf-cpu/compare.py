"""Compare crosscheck.py's two runs: TTFT of every request (first-seen: the 8 first, one per
prefix; repeated-prefix: the 24 others), throughput, the concurrency each client kept up
(sum of request latencies / wall time) and each client's mean TTFT against the server's own
vllm:time_to_first_token_seconds for the same run.

    python3 compare.py OUT > OUT/comparison.md
"""
from __future__ import annotations

import json
import os
import statistics
import sys

FIRST_SEEN = 8


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo = int(k)
    return xs[lo] + (xs[min(lo + 1, len(xs) - 1)] - xs[lo]) * (k - lo)


def kvtier_bench(out: str) -> dict:
    run = json.load(open(os.path.join(out, "kvtier-bench", "results.json")))["runs"][0]
    reqs = [r for r in run["requests"] if r["index"] >= 0]
    ttft = {r["index"]: 1000 * r["ttft"] for r in reqs}
    starts = [r["start"] for r in reqs]
    ends = [r["start"] + r["latency"] for r in reqs]
    wall = max(ends) - min(starts)
    return {"ttft": ttft, "wall_s": wall, "busy": sum(r["latency"] for r in reqs) / wall,
            "output_tokens": sum(r["output_tokens"] for r in reqs)}


def aiperf(out: str) -> dict:
    recs = [json.loads(x) for x in open(os.path.join(out, "aiperf", "profile_export.jsonl"))]
    ok = [r for r in recs if "error" not in r or not r["error"]]
    ttft = {r["metadata"]["session_num"]: r["metrics"]["time_to_first_token"]["value"]
            for r in ok}
    starts = [r["metadata"]["request_start_ns"] / 1e9 for r in ok]
    ends = [r["metadata"]["request_end_ns"] / 1e9 for r in ok]
    wall = max(ends) - min(starts)
    busy = sum(e - s for s, e in zip(starts, ends)) / wall
    out_tokens = sum(r["metrics"].get("output_sequence_length", {}).get("value", 0) for r in ok)
    return {"ttft": ttft, "wall_s": wall, "busy": busy, "output_tokens": out_tokens,
            "failed": len(recs) - len(ok)}


def row(name: str, c: dict, server: dict) -> str:
    t = c["ttft"]
    first = [v for i, v in t.items() if i < FIRST_SEEN]
    rep = [v for i, v in t.items() if i >= FIRST_SEEN]
    srv = server.get("mean_ms")
    return (f"| {name} | {len(t)} | {pct(list(t.values()), 50):,.0f} | {pct(rep, 50):,.0f} | "
            f"{pct(rep, 99):,.0f} | {pct(first, 50):,.0f} | {statistics.mean(t.values()):,.0f} "
            f"| {srv:,.0f} | {c['wall_s']:.1f} | {c['busy']:.2f} |")


def main() -> None:
    out = sys.argv[1]
    raw = json.load(open(os.path.join(out, "raw.json")))
    kb, ap = kvtier_bench(out), aiperf(out)
    print("| client | requests | TTFT p50 ms | repeated p50 | repeated p99 | first-seen p50 | "
          "mean TTFT | server's mean TTFT | wall s | kept in flight |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    print(row("kvtier bench", kb, raw["kvtier_bench"]["server"]))
    print(row("aiperf 0.13.0", ap, raw["aiperf"]["server"]))
    both = sorted(set(kb["ttft"]) & set(ap["ttft"]))
    ratio = [ap["ttft"][i] / kb["ttft"][i] for i in both if i >= FIRST_SEEN]
    print(f"\nrepeated-prefix requests, aiperf TTFT / kvtier bench TTFT, request by request: "
          f"median {statistics.median(ratio):.2f}, range {min(ratio):.2f}-{max(ratio):.2f}; "
          f"aiperf failed requests: {ap['failed']}")


if __name__ == "__main__":
    main()
