"""Batches of scenarios, and the command line (also how the 0.25.1 run gets its own process).

    cd tests && python -m harness.run --scenarios 400 --seed 0 [--bug NAME] [--json FILE]
    cd tests && PYTHONPATH=../.cache/vllm-0.25.1:.:../src python -m harness.run --scenarios 400

Scenarios are spread round-robin over (Scheduler, AsyncScheduler) x (world size 1, 2); the
seed of scenario ``i`` is ``seed + i // 4``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import sys
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .bugs import PLANTED, REVERTS, Bug
from .cases import CASES
from .compat import VERSION
from .driver import Result, run_scenario
from .workload import GROUP_SETS, MULTI_GROUP_SETS, Scenario, make_scenario

COMBOS = ((False, 1), (True, 1), (False, 2), (True, 2))


def scenarios(n: int, seed: int = 0, fault_kinds: set[str] | None = None,
              world_size: int | None = None, group_sets: tuple[str, ...] = ("full",)
              ) -> Iterator[Scenario]:
    """``n`` scenarios, round-robin over the combos and then over ``group_sets`` (names of
    :data:`~.workload.GROUP_SETS`)."""
    combos = [c for c in COMBOS if world_size is None or c[1] == world_size]
    for i in range(n):
        async_sched, ws = combos[i % len(combos)]
        rest = i // len(combos)
        groups = GROUP_SETS[group_sets[rest % len(group_sets)]]
        yield make_scenario(seed + rest // len(group_sets), async_sched, ws, fault_kinds,
                            groups)


@dataclass
class Batch:
    version: str = VERSION
    scenarios: int = 0
    steps: int = 0
    seconds: float = 0.0
    faults: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    combos: Counter = field(default_factory=Counter)
    group_sets: Counter = field(default_factory=Counter)
    violations: list[dict[str, Any]] = field(default_factory=list)
    too_short: list[str] = field(default_factory=list)  # scenarios below the CI minimums

    def add(self, r: Result) -> None:
        self.scenarios += 1
        self.steps += r.steps
        self.seconds += r.seconds
        self.faults.update(r.faults)
        self.counts.update({k: v for k, v in r.counts.items() if k != "max_parked_steps"})
        self.counts["max_parked_steps"] = max(self.counts["max_parked_steps"],
                                              r.counts.get("max_parked_steps", 0))
        sc = r.scenario
        self.combos[f"{'async' if sc.async_scheduling else 'sync'}-ws{sc.world_size}"] += 1
        self.group_sets[sc.group_set] += 1
        if r.violation is not None:
            self.violations.append({"kind": r.violation.kind, "detail": r.violation.detail,
                                    "scenario": sc.describe(), "seed": sc.seed,
                                    "async": sc.async_scheduling, "ws": sc.world_size,
                                    "groups": sc.group_set})
        elif r.steps < sc.min_steps or len(sc.requests) < 8 or sum(r.faults.values()) < 1:
            self.too_short.append(f"{sc.describe()} steps={r.steps} faults={dict(r.faults)}")

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "scenarios": self.scenarios, "steps": self.steps,
                "seconds": round(self.seconds, 2), "faults": dict(self.faults),
                "counts": dict(self.counts), "combos": dict(self.combos),
                "group_sets": dict(self.group_sets),
                "violations": self.violations, "too_short": self.too_short}


def run_batch(items: Iterator[Scenario], bug: Bug | None = None,
              stop_when: frozenset[str] | None = None, budget_s: float | None = None) -> Batch:
    """Run scenarios (under ``bug`` if given); stop at the first finding whose kind is in
    ``stop_when``, or when ``budget_s`` seconds are spent."""
    out = Batch()
    t0 = time.perf_counter()
    for sc in items:
        if bug is not None:
            with bug.patch():
                r = run_scenario(sc)
        else:
            r = run_scenario(sc)
        out.add(r)
        if stop_when is not None and r.violation is not None and r.violation.kind in stop_when:
            break
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
    return out


def catch_planted(seed: int = 1000, max_scenarios: int = 120) -> dict[str, dict[str, Any]]:
    """Each planted bug, alone, over scenarios with the faults that expose it, until the
    oracle reports a finding the bug must cause; then the scenario that caught it again,
    without the bug (``clean``: "ok", or the finding it makes anyway: then the finding was
    the scenario's, not the bug's)."""
    out: dict[str, dict[str, Any]] = {}
    for name, bug in PLANTED.items():
        batch = run_batch(scenarios(max_scenarios, seed, set(bug.fault_kinds), bug.world_size),
                          bug, stop_when=bug.detected_by)
        hits = [v for v in batch.violations if v["kind"] in bug.detected_by]
        clean = None
        if hits:
            h = hits[0]
            r = run_scenario(make_scenario(h["seed"], h["async"], h["ws"], set(bug.fault_kinds)))
            clean = "ok" if r.violation is None else f"{r.violation.kind}: {r.violation.detail[:300]}"
        out[name] = {"caught": hits[0]["kind"] if hits else None,
                     "detail": hits[0]["detail"][:300] if hits else "",
                     "scenario": hits[0] if hits else None, "scenarios": batch.scenarios,
                     "other": [v["kind"] for v in batch.violations if v not in hits],
                     "clean": clean}
    return out


def run_case(name: str, revert: str | None = None, seeds: range = range(4)) -> dict[str, int]:
    """Findings (or "ok") of a regression family over every combo, optionally reverted."""
    found: Counter[str] = Counter()
    for seed in seeds:
        for async_sched, ws in COMBOS:
            sc = CASES[name](seed, async_sched, ws)
            with REVERTS[revert]() if revert else contextlib.nullcontext():
                r = run_scenario(sc)
            found[r.violation.kind if r.violation else "ok"] += 1
    return dict(found)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.run", description=__doc__)
    ap.add_argument("--scenarios", type=int, default=400)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bug", choices=sorted(PLANTED))
    ap.add_argument("--json", help="write the summary here ('-': stdout)")
    ap.add_argument("--one", metavar="SEED,ASYNC,WS",
                    help="run one scenario, e.g. 137,1,2 (seed 137, AsyncScheduler, 2 ranks)")
    ap.add_argument("--trace", action="store_true", help="with --one: print every step")
    ap.add_argument("--case", choices=sorted(CASES),
                    help="run a regression family (seeds 0-3, every combo); with --revert, "
                    "also with that fix reverted")
    ap.add_argument("--revert", choices=sorted(REVERTS),
                    help="with --case: also run it with that fix reverted; else the batch "
                    "runs with it reverted")
    ap.add_argument("--planted", action="store_true",
                    help="run each planted bug until the oracle catches it (JSON with --json)")
    ap.add_argument("--groups", default="full",
                    help="KV-cache group sets, comma-separated (" + ", ".join(GROUP_SETS)
                    + "), or 'multi' for " + ",".join(MULTI_GROUP_SETS))
    ap.add_argument("--admission", action="store_true",
                    help="every scenario with kvtier's cache_aware_admission on")
    ap.add_argument("--stop-when", metavar="KIND[,KIND]",
                    help="stop the batch at the first finding of one of these kinds")
    ap.add_argument("-v", "--verbose", action="store_true")
    args = ap.parse_args(argv)
    group_sets = MULTI_GROUP_SETS if args.groups == "multi" else tuple(args.groups.split(","))
    unknown = [g for g in group_sets if g not in GROUP_SETS]
    if unknown:
        ap.error(f"unknown group sets {unknown}")
    if args.case:
        out = {"version": VERSION, "fixed": run_case(args.case)}
        if args.revert:
            out["reverted"] = run_case(args.case, args.revert)
        print(json.dumps(out))
        return 0
    if args.planted:
        caught = catch_planted(args.seed or 1000)
        if args.json == "-":
            print(json.dumps({"version": VERSION, "planted": caught}))
        else:
            for name, c in caught.items():
                print(f"{name}: {c}")
        return 0 if all(c["caught"] and c["clean"] == "ok" for c in caught.values()) else 1
    bug = PLANTED[args.bug] if args.bug else None
    if args.one:
        seed, async_sched, ws = (int(x) for x in args.one.split(","))
        sc = make_scenario(seed, bool(async_sched), ws, groups=GROUP_SETS[group_sets[0]])
        print(sc.describe())
        for r in sc.requests:
            print(f"  {r.key} id={r.req_id} prompt={len(r.prompt)} max_tokens={r.max_tokens} "
                  f"arrival={r.arrival} after={r.after} abort_after={r.abort_after} "
                  f"abort_when_parked={r.abort_when_parked} recycles={r.recycles}")
        trace = print if args.trace else None
        with bug.patch() if bug is not None else contextlib.nullcontext():
            res = run_scenario(sc, trace=trace)
        print(res.summary())
        return 0 if res.ok else 1
    with REVERTS[args.revert]() if args.revert else contextlib.nullcontext():
        items = scenarios(args.scenarios, args.seed, group_sets=group_sets)
        if args.admission:
            items = (dataclasses.replace(sc, admission_defers=True) for sc in items)
        stop = frozenset(args.stop_when.split(",")) if args.stop_when else None
        batch = run_batch(items, bug, stop_when=stop)
    summary = batch.to_json()
    if args.json == "-":
        json.dump(summary, sys.stdout)
        sys.stdout.write("\n")
    else:
        if args.json:
            with open(args.json, "w") as f:
                json.dump(summary, f, indent=1)
        print(f"vLLM {batch.version}: {batch.scenarios} scenarios, {batch.steps} steps, "
              f"{batch.seconds:.1f}s, {len(batch.violations)} violations")
        print(f"faults: {dict(batch.faults)}")
        print(f"counts: {dict(batch.counts)}")
        for v in batch.violations[: None if args.verbose else 10]:
            print(f"  {v['kind']}: {v['scenario']}\n    {v['detail'][:2000]}")
    return 1 if batch.violations else 0


if __name__ == "__main__":
    raise SystemExit(main())
