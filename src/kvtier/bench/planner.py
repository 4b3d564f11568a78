"""``kvtier bench planner``: the scheduler half's CPU cost per scheduled request per step.

What runs is kvtier's engine-agnostic scheduler half (:class:`kvtier.scheduler.
OffloadScheduler`), exactly what the vLLM connector calls each step, over an index holding
``--stored-chunks`` chunks (a full slab: every new save evicts). Each simulated step
schedules ``--running`` requests: most decode one token (keys grow, block tables grow, the
save planner looks for newly full chunks), some prefill a chunk-aligned slice (new chunks are
reserved, evicting leaves), and new requests arrive and are looked up against long stored
prefixes (match, cost model, pins, load plan). Workers' completions are fed back a step
later, so commits, unpins and fences are in the measured loop too. vLLM's own scheduler time
is not included. Target (issue): at most 100 µs per request per step.

With ``--store-url`` (a running ``kvtier store``) or ``--store-size`` (a private store
process started for the run), the scheduler's index is the node-wide store's
(:class:`kvtier.store.index.StoreIndex`): every lookup, pin, reserve and commit is a request
on the store's socket, as in an engine with ``store_url``. The store reserves the arena for
real, so such runs use small chunks (``--token-bytes``); compare with an in-process run of the
same settings. Lookups (and loads started) are also timed one by one (``per_call_us``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time
from collections.abc import Callable
from typing import Any

HELP = "scheduler-side cost per scheduled request per step (index, planner, jobs)"

TARGET_US = 100.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--running", type=int, default=256, help="requests scheduled per step")
    p.add_argument("--stored-chunks", type=int, default=1_000_000, help="chunks in the index")
    p.add_argument("--prefix-chunks", type=int, default=250,
                   help="chunks per stored prefix (64k tokens at 256 per chunk)")
    p.add_argument("--steps", type=int, default=200, help="measured steps")
    p.add_argument("--batch-tokens", type=int, default=8192,
                   help="tokens per step (vLLM's max_num_batched_tokens): decodes take one "
                   "each, prefills share the rest")
    p.add_argument("--output-tokens", type=int, nargs=2, default=(64, 512),
                   metavar=("MIN", "MAX"), help="output length range; a finished request is "
                   "replaced by a new arrival (looked up, loaded when it pays)")
    p.add_argument("--policy", default="slru", choices=["lru", "slru", "s3fifo"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--token-bytes", type=int, default=128 * 1024,
                   help="KV bytes per token (the slab's size: stored chunks x 256 x this)")
    p.add_argument("--store-url", default=None,
                   help="index through this running kvtier store (unix:///path)")
    p.add_argument("--store-size", default=None,
                   help="start a private kvtier store of this size for the run (e.g. 2GiB)")
    p.add_argument("--out", default="bench/out/planner", help="folder for JSON and PNG")


class _Req:
    __slots__ = ("blocks", "computed", "end", "prompt", "rid", "tokens")

    def __init__(self, rid: str, tokens: list[int], prompt: int, output: int) -> None:
        self.rid = rid
        self.tokens = tokens
        self.prompt = prompt
        self.end = prompt + output
        self.computed = 0
        self.blocks: list[int] = []


_PER_CALL = ("lookup", "start_load")  # calls also timed one by one


def _timed(acc: dict[str, float], name: str, fn: Callable[[], Any],
           calls: dict[str, list[float]] | None = None) -> Any:
    t0 = time.perf_counter()
    out = fn()
    dt = time.perf_counter() - t0
    acc[name] = acc.get(name, 0.0) + dt
    if calls is not None and name in _PER_CALL:
        calls.setdefault(name, []).append(dt)
    return out


class _Run:
    """One bench run: the scheduler over a filled index, the running requests and the
    timings; :meth:`step` is one measured engine step."""

    CHUNK, BLOCK = 256, 16

    def __init__(self, args: argparse.Namespace, store_url: str | None = None) -> None:
        from kvtier.config import KvtierConfig
        from kvtier.geometry import Geometry, GroupGeometry
        from kvtier.layout import GroupKind
        from kvtier.scheduler import OffloadScheduler

        self.args = args
        self.rng = random.Random(args.seed)
        chunk, block = self.CHUNK, self.BLOCK
        geo = Geometry(chunk, (GroupGeometry(GroupKind.FULL, block, args.token_bytes * block),))
        cfg = KvtierConfig(
            dram_size=args.stored_chunks * chunk * args.token_bytes, policy=args.policy,
            chunk_tokens=chunk,
            max_pending_saves=1 << 20, max_pending_loads=1 << 20, max_pins=1 << 22,
        )
        slab_layout = geo.slab_layout(cfg, 1)
        self.sched = OffloadScheduler(cfg, geo, b"bench-namespace", slab_layout,
                                      index_factory=_store_index(store_url))
        self.calls: dict[str, list[float]] = {}
        self.store_poll: Callable[[], Any] | None = getattr(self.sched.index, "poll", None)
        self.capacity = slab_layout.classes[0].num_slots
        self.prefixes: list[list[int]] = []
        self.next_block = 1
        self.arrival_id = 0
        self.arrivals = 0
        self.hits = 0
        self.running: list[_Req] = []
        self.pending_reports: list[Any] = []
        self.fill_s = 0.0

    def fill(self) -> None:
        """Fill the index with stored prefixes (not measured)."""
        from kvtier.index.base import Entry

        args, sched, rng = self.args, self.sched, self.rng
        t0 = time.perf_counter()
        stored = 0
        while stored < args.stored_chunks:
            n = min(args.prefix_chunks, args.stored_chunks - stored)
            toks = [rng.randrange(32000) for _ in range(n * self.CHUNK + 1)]
            st = sched.add_request(f"fill{len(self.prefixes)}")
            st.keys.update(toks)
            parent = None
            for key in st.keys.keys:
                e = sched.index.reserve(0, key, parent)
                assert isinstance(e, Entry)
                sched.index.commit(e)
                parent = key
            sched.request_finished(st.req_id)
            self.prefixes.append(toks)
            stored += n
        self.fill_s = time.perf_counter() - t0
        print(f"  filled in {self.fill_s:.1f} s ({sched.index.stats().stored:,} stored)",
              flush=True)

    def new_blocks(self, n: int) -> list[int]:
        out = list(range(self.next_block, self.next_block + n))
        self.next_block += n
        return out

    def arrive(self) -> _Req:
        rng = self.rng
        self.arrival_id += 1
        base = rng.choice(self.prefixes)
        cut = rng.randrange(self.CHUNK, len(base) - 1)
        toks = base[:cut] + [rng.randrange(32000) for _ in range(rng.randrange(64, 2048))]
        return _Req(f"r{self.arrival_id}", toks, len(toks),
                    rng.randrange(*self.args.output_tokens))

    def admit(self, r: _Req, acc_step: dict[str, float], measured: bool = True) -> None:
        sched, calls = self.sched, self.calls if measured else None
        _timed(acc_step, "add_request", lambda: sched.add_request(r.rid))
        n = _timed(acc_step, "lookup", lambda: sched.lookup(r.rid, r.tokens, 0), calls)
        r.blocks = self.new_blocks(-(-len(r.tokens) // self.BLOCK))
        if n:
            self.hits += 1
            _timed(acc_step, "start_load", lambda: sched.start_load(r.rid, n, [r.blocks]),
                   calls)
            r.computed = n

    def warm_start(self) -> None:
        """Start in steady state: requests at random points of their lives."""
        rng = self.rng
        for _ in range(self.args.running):
            r = self.arrive()
            self.admit(r, {}, measured=False)
            r.computed = rng.randrange(r.computed, r.end)
            r.tokens += [rng.randrange(32000)
                         for _ in range(max(0, r.computed - len(r.tokens)))]
            r.blocks += self.new_blocks(max(0, -(-r.computed // self.BLOCK) - len(r.blocks)))
            self.running.append(r)

    def step(self, measured: bool = True) -> tuple[float, dict[str, float]]:
        """One engine step; its seconds and the time of each scheduler call."""
        from kvtier.protocol import WorkerReport

        sched, running = self.sched, self.running
        acc_step: dict[str, float] = {}
        t_step = time.perf_counter()
        for rep in self.pending_reports:  # the previous step's completions
            _timed(acc_step, "on_report", lambda rep=rep: sched.on_report(rep))
        self.pending_reports = []
        for i, r in enumerate(running):  # finished requests are replaced by arrivals
            if r.computed >= r.end:
                _timed(acc_step, "request_finished", lambda r=r: sched.request_finished(r.rid))
                running[i] = self.arrive()
                self.admit(running[i], acc_step, measured)
                self.arrivals += 1
        self._schedule(acc_step)
        plan = _timed(acc_step, "build_step", sched.build_step)
        if self.store_poll is not None:  # as the connector does after each plan (store_link)
            _timed(acc_step, "store_poll", self.store_poll)
        rep = WorkerReport()
        for job in plan.saves:
            rep.saves[job.job_id] = [1, 0]
        for job in plan.loads:
            rep.loads[job.job_id] = [1, 0]
        self.pending_reports.append(rep)
        return time.perf_counter() - t_step, acc_step

    def _schedule(self, acc_step: dict[str, float]) -> None:
        """vLLM's token budget over the running requests: decodes one token each, prefills
        share the rest; block tables grow and saves are planned."""
        sched, rng = self.sched, self.rng
        budget = self.args.batch_tokens - sum(1 for r in self.running if r.computed >= r.prompt)
        for r in self.running:
            if r.computed < r.prompt:
                n_sched = max(0, min(r.prompt - r.computed, budget))
                budget -= n_sched
                if n_sched == 0:
                    continue
            else:
                n_sched = 1
                if r.computed >= len(r.tokens):
                    r.tokens.append(rng.randrange(32000))
            after = r.computed + n_sched
            need = -(-after // self.BLOCK) - len(r.blocks)
            if need > 0:
                ids = self.new_blocks(need)
                r.blocks += ids
                _timed(acc_step, "on_blocks", lambda r=r, ids=ids: sched.on_blocks(r.rid, [ids]))
            _timed(acc_step, "plan_saves",
                   lambda r=r, a=after: sched.plan_saves(r.rid, r.tokens, a, r.prompt))
            r.computed = after


def _store_index(url: str | None) -> Callable[..., Any] | None:
    """The scheduler's index factory for a store at ``url`` (None: in-process)."""
    if url is None:
        return None
    from kvtier.store.client import StoreClient
    from kvtier.store.index import StoreIndex, attach_spec

    def make(specs: Any, layout: Any) -> Any:
        index = StoreIndex(StoreClient(url), attach_spec(b"kvtier-bench-planner", specs, layout))
        if not index.up:
            raise SystemExit(f"kvtier bench planner: no kvtier store answers at {url}")
        return index

    return make


def run(args: argparse.Namespace) -> int:
    if args.store_size is None:
        return _run(args, args.store_url)
    import tempfile
    from pathlib import Path

    from kvtier.testing.store_process import StoreProcess

    with tempfile.TemporaryDirectory() as d:
        store = StoreProcess(Path(d), size=args.store_size, lease_ttl=30).start(timeout=600)
        try:
            return _run(args, store.url)
        finally:
            store.stop()


def _run(args: argparse.Namespace, store_url: str | None) -> int:
    bench = _Run(args, store_url)
    where = f"through the store {store_url}" if store_url else "in-process index"
    print(f"kvtier bench planner: {bench.capacity:,} slots ({where}), filling "
          f"{args.stored_chunks:,} chunks in prefixes of {args.prefix_chunks} ...", flush=True)
    bench.fill()
    per_step_us: list[float] = []
    acc: dict[str, float] = {}
    warmup = 50
    total_steps = args.steps + warmup
    progress = _progress(total_steps)
    bench.warm_start()
    for step in range(total_steps):
        elapsed, acc_step = bench.step(measured=step >= warmup)
        if step >= warmup:
            per_step_us.append(elapsed / len(bench.running) * 1e6)
            for k, v in acc_step.items():
                acc[k] = acc.get(k, 0.0) + v
        progress(step + 1)
    print()
    result = _result(args, bench, per_step_us, acc)
    result["index"] = "store" if store_url else "in-process"
    _report(result, args.out)
    _print_result(result)
    return 0


def _result(args: argparse.Namespace, bench: _Run, per_step_us: list[float],
            acc: dict[str, float]) -> dict[str, Any]:
    measured = len(per_step_us)
    reqs = args.running
    breakdown = {k: v / measured / reqs * 1e6 for k, v in sorted(acc.items(), key=lambda x: -x[1])}
    sched = bench.sched
    result = {
        "bench": "planner", "date": time.strftime("%Y-%m-%d"), "host": os.uname().nodename,
        "cpu": _cpu_model(), "running": args.running, "stored_chunks": args.stored_chunks,
        "slots": bench.capacity, "policy": args.policy, "steps": measured,
        "us_per_request_step": {
            "p50": statistics.median(per_step_us),
            "p90": _pct(per_step_us, 0.9), "p99": _pct(per_step_us, 0.99),
            "mean": statistics.fmean(per_step_us),
        },
        "breakdown_us_per_request_step": breakdown,
        "arrivals": bench.arrivals, "lookups_with_hit": bench.hits,
        "evictions": sched.index.evictions,
        "batch_tokens": args.batch_tokens, "output_tokens": list(args.output_tokens),
        "saves_committed": sched.stats.saves_committed, "fill_seconds": bench.fill_s,
        "target_us": TARGET_US, "token_bytes": args.token_bytes,
        "per_call_us": {k: _summary(v) for k, v in bench.calls.items()},
    }
    # the target is met when even the 99th-percentile step costs at most 100 µs a request
    result["target_met"] = result["us_per_request_step"]["p99"] <= TARGET_US
    return result


def _print_result(result: dict[str, Any]) -> None:
    p50 = result["us_per_request_step"]["p50"]
    print(f"\n{'':<22}{'µs/request/step':>16}")
    for k in ("p50", "p90", "p99", "mean"):
        print(f"{k:<22}{result['us_per_request_step'][k]:>16.2f}")
    print("breakdown (mean):")
    for k, v in result["breakdown_us_per_request_step"].items():
        print(f"  {k:<20}{v:>16.2f}")
    for k, v in result["per_call_us"].items():
        print(f"  per {k} call: p50 {v['p50']:.1f} µs, p99 {v['p99']:.1f} µs ({v['calls']} calls)")
    print(f"\ntarget <= {TARGET_US:.0f} µs per request per step (p99): "
          f"{'met' if result['target_met'] else 'NOT met'} (p50 {p50:.1f} µs)")


def _summary(seconds: list[float]) -> dict[str, float]:
    us = [x * 1e6 for x in seconds]
    return {"calls": len(us), "p50": statistics.median(us), "p99": _pct(us, 0.99),
            "max": max(us)}


def _pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def _progress(total: int) -> Callable[[int], None]:
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, desc="steps", unit="step", leave=False)

        def update(n: int) -> None:
            bar.n = n
            bar.refresh()
            if n == total:
                bar.close()

        return update
    except ImportError:  # pragma: no cover
        return lambda n: None


def _report(result: dict[str, Any], out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "planner.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 3.5))
        items = list(result["breakdown_us_per_request_step"].items())
        ax.barh([k for k, _ in items], [v for _, v in items])
        ax.axvline(result["target_us"], color="red", linestyle="--", label="target (total)")
        ax.set_xlabel("µs per scheduled request per step (mean)")
        ax.set_title(f"scheduler half, {result['running']} running, "
                     f"{result['stored_chunks']:,} stored chunks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(os.path.join(out, "planner.png"), dpi=120)
        plt.close(fig)
    except ImportError:  # pragma: no cover
        pass
    print(f"wrote {out}/planner.json and planner.png")
