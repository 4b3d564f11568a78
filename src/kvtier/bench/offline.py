"""``kvtier bench offline``: the offline reference runs of issue 15, one engine process per
configuration, in one command.

    kvtier bench offline --shape llama8b --configs hbm,big,native,kvtier,kvtier-null-copy \\
        --rounds 3 --out-dir bench/results/2026-12-02-offline-h200-llama8b

Each configuration runs in its own process (:mod:`kvtier.bench.offline_engine`); with
``--rounds N`` the configurations run N times, in reverse order every other round, so pairs
alternate. Writes into ``--out-dir``: each run's JSON and log, ``summary.json`` (the command,
device, vLLM version, per configuration the median wall time and the runs), ``summary.md``
(the short table, the seconds per category and their gap to null-copy, park lengths, tokens
against ``hbm``) and ``timelines.png``. A configuration that fails is reported with the end of
its log; the others still run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

from kvtier.bench import offline_report
from kvtier.bench.offline_engine import CONFIGS, DEFAULT_CONFIGS, add_workload_arguments

HELP = "offline reference runs (hbm, big, native, kvtier, kvtier-null-copy), one engine each"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--configs", default=",".join(DEFAULT_CONFIGS),
                   help=f"comma-separated, of {', '.join(CONFIGS)} (default: "
                   f"{','.join(DEFAULT_CONFIGS)})")
    p.add_argument("--rounds", type=int, default=1,
                   help="run every configuration this many times, alternating the order")
    p.add_argument("--out-dir", default=None,
                   help="where results go (default bench/results/DATE-offline-SHAPE)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per engine run")
    add_workload_arguments(p)


def _order(configs: list[str], rounds: int) -> list[tuple[int, str]]:
    out = []
    for r in range(rounds):
        seq = configs if r % 2 == 0 else configs[::-1]
        out.extend((r, c) for c in seq)
    return out


def _child_args(args: argparse.Namespace) -> list[str]:
    """The workload flags as given, for the engine process."""
    out = []
    for action in _workload_parser()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        value = getattr(args, action.dest)
        flag = action.option_strings[0]
        if isinstance(value, bool):
            out += [flag] if value else []
        elif isinstance(value, list):
            for v in value:
                out += [flag, str(v)]
        elif value is not None:
            out += [flag, str(value)]
    return out


def _workload_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    add_workload_arguments(p)
    return p


def run_one(config: str, args: argparse.Namespace, out_json: str, log: str) -> dict[str, Any]:
    """One engine process; its JSON, or ``{"config", "error"}`` with the end of its log."""
    cmd = [sys.executable, "-m", "kvtier.bench.offline_engine", "--config", config,
           "--out", out_json, *_child_args(args)]
    t = time.time()
    with open(log, "w") as f:
        try:
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=args.timeout,
                                  env=dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0"))
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = -1
    if rc == 0 and os.path.exists(out_json):
        with open(out_json) as f:
            return dict(json.load(f))
    with open(log, errors="replace") as f:
        tail = f.readlines()[-15:]
    return {"config": config, "error": f"exit {rc} after {time.time() - t:.0f} s",
            "log_tail": "".join(tail)}


def _progress(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="engines", unit="run", file=sys.stderr, leave=True)


def run(args: argparse.Namespace) -> int:
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        print(f"kvtier bench offline: unknown configurations {bad}; known: {CONFIGS}",
              file=sys.stderr)
        return 2
    out_dir = args.out_dir or os.path.join(
        "bench", "results", f"{time.strftime('%Y-%m-%d')}-offline-{args.shape}")
    os.makedirs(out_dir, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in configs}
    order = _order(configs, args.rounds)
    bar = _progress(len(order))
    for r, config in order:
        stem = os.path.join(out_dir, f"{config}-r{r}")
        res = run_one(config, args, stem + ".json", stem + ".log")
        runs[config].append(res)
        bar.set_postfix_str(f"{config}: " + (f"{res['wall_s']:.2f} s" if "wall_s" in res
                                             else res["error"]))
        bar.update(1)
    bar.close()
    summary = summarize(runs, args)
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    text = offline_report.markdown(summary, runs)
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    ok = {c: v for c, v in runs.items() if v and all("wall_s" in x for x in v)}
    if ok:
        offline_report.plot(os.path.join(out_dir, "timelines.png"), ok, summary["title"])
    print(f"kvtier bench offline: results in {out_dir}", file=sys.stderr)
    return 0 if len(ok) == len(configs) else 1


def summarize(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace
              ) -> dict[str, Any]:
    first = next((x for v in runs.values() for x in v if "wall_s" in x), {})
    per: dict[str, Any] = {}
    for config, results in runs.items():
        walls = [x["wall_s"] for x in results if "wall_s" in x]
        per[config] = {
            "wall_s_median": statistics.median(walls) if walls else None,
            "wall_s": walls, "errors": [x for x in results if "error" in x],
        }
    return {"command": " ".join(["kvtier", *sys.argv[1:]]),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": first.get("device"),
            "vllm": first.get("vllm"), "shape": args.shape, "rounds": args.rounds,
            "title": f"{args.shape}: {args.prefixes} x {args.prefix_len} prefixes x "
                     f"{args.per_prefix}, {args.suffix_len} suffix, {args.output_len} out"
                     f"{', unique' if args.unique else ''} ({first.get('device')})",
            "configs": per}
