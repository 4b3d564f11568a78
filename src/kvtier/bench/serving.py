"""``kvtier bench serving``: the serving workloads against an OpenAI-compatible endpoint, or
against several server configurations in turn (``--compare``), side by side.

Each configuration runs the same seeded requests. Per configuration the bench warms the
server up (requests that are not measured and share nothing with the workload), scrapes
``/metrics``, drives the workload, scrapes again once the counters settle, and summarises
(:mod:`kvtier.bench.metrics`). Output: the table on stdout, and under ``--out``: results.json
(metadata, summaries, every request), results.png (:mod:`kvtier.bench.plot`), table.txt, and
with ``--compare`` one server log per configuration.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import json
import os
import shlex
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import aiohttp

from kvtier.bench import scrape
from kvtier.bench.client import LoadShape, RequestResult, discover_model, drive, send
from kvtier.bench.metrics import Summary, summarize
from kvtier.bench.report import metadata, ratio_lines, round_ratio_lines, table, write_json
from kvtier.bench.workloads import (
    AgentSessions,
    NoReuse,
    RequestSpec,
    SharedPrefix,
    TraceReplay,
    Workload,
    warmup_prompts,
)

HELP = ("serving workloads (shared-prefix, agent-sessions, no-reuse, trace replay) against "
        "OpenAI endpoints")
DEFAULT_CHUNK = 256
KEEP_METRICS = ("vllm:kvtier_", "vllm:prompt_tokens", "vllm:prefix_cache",
                "vllm:external_prefix_cache", "vllm:num_preemptions")


def add_arguments(p: argparse.ArgumentParser) -> None:
    _add_target_arguments(p)
    _add_workload_arguments(p)


def _add_target_arguments(p: argparse.ArgumentParser) -> None:
    t = p.add_argument_group("target")
    t.add_argument("--url", default="http://localhost:8000",
                   help="base URL of an OpenAI-compatible server (default %(default)s)")
    t.add_argument("--model", help="model name to request (default: the first /v1/models lists)")
    t.add_argument("--name", default="server", help="label of this configuration in reports")
    t.add_argument("--compare", action="append", default=[], metavar="NAME=SERVE_ARGS",
                   help="start a server with `kvtier serve SERVE_ARGS`, run the workload, stop "
                   "it; repeat for each --compare, then print them side by side (the first is "
                   "the baseline). A free port is chosen unless SERVE_ARGS has --port")
    t.add_argument("--rounds", type=int, default=1,
                   help="with --compare: start every server once, then run the workload N "
                   "times in alternation (A B A B ...), each round on new prompts (seed + "
                   "round); prints each round and every ratio's median and range over the "
                   "rounds (default %(default)s: one run each, each server stopped before "
                   "the next starts)")
    t.add_argument("--start-together", action="store_true",
                   help="with --rounds: launch every server before waiting for any (saves a "
                   "server start per configuration after the first). Only where each "
                   "server's GPU memory is fixed (vLLM's --kv-cache-memory-bytes): vLLM's "
                   "memory profiling counts what another process allocates meanwhile as its "
                   "own")
    t.add_argument("--server-timeout", type=float, default=900.0,
                   help="seconds to wait for a --compare server to start (default %(default)s)")


def _add_workload_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload (docs/design.md §4)")
    w.add_argument("--workload", choices=["shared-prefix", "agent-sessions", "no-reuse",
                                          "trace"], default="shared-prefix")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--vocab", type=int, default=1000, help="token ids are drawn below this")
    # Shared-prefix options carry aiperf's names (the old names stay as aliases).
    w.add_argument("--osl", "--output-len", dest="output_len", type=int, default=16,
                   help="output tokens per request")
    w.add_argument("--prompt-prefix-pool-size", "--prefixes", dest="prefixes", type=int,
                   default=8, help="shared-prefix: prefixes in the pool")
    w.add_argument("--prompt-prefix-length", "--prefix-len", dest="prefix_len", type=int,
                   default=2048, help="shared-prefix: prefix tokens")
    w.add_argument("--isl", "--suffix-len", dest="suffix_len", type=int, default=256,
                   help="shared-prefix: unique tokens per request after its prefix")
    w.add_argument("--order", choices=["round-robin", "random"], default="round-robin",
                   help="shared-prefix: which prefix each request uses")
    w.add_argument("--sessions", type=int, default=8,
                   help="agent-sessions: sessions interleaved")
    w.add_argument("--turns", type=int, default=6, help="agent-sessions: turns per session")
    w.add_argument("--first-len", type=int, default=2048,
                   help="agent-sessions: tokens of a session's first prompt")
    w.add_argument("--tool-len", type=int, default=256,
                   help="agent-sessions: tool-result tokens added per turn")
    w.add_argument("--message-len", type=int, default=64,
                   help="agent-sessions: new-message tokens added per turn")
    w.add_argument("--prompt-len", type=int, default=2048, help="no-reuse: prompt tokens")
    w.add_argument("--trace", metavar="JSONL", help="trace: an aiperf/Mooncake-style trace "
                   "(timestamp, input_length, output_length, hash_ids per line)")
    w.add_argument("--trace-block-size", type=int, default=512,
                   help="trace: tokens per hash id (default %(default)s, Mooncake's)")
    w.add_argument("--trace-timing", action="store_true",
                   help="trace: send each request at its timestamp instead of at a "
                   "concurrency or rate")

    ld = p.add_argument_group("load")
    how = ld.add_mutually_exclusive_group()
    how.add_argument("--concurrency", type=int, help="requests in flight (default 4)")
    how.add_argument("--rate", type=float, help="arrivals per second instead of a concurrency")
    ld.add_argument("--arrival", choices=["poisson", "constant"], default="poisson",
                    help="gaps between arrivals with --rate")
    until = ld.add_mutually_exclusive_group()
    until.add_argument("--requests", type=int, help="requests to send (default 32)")
    until.add_argument("--duration", type=float, help="seconds to keep issuing requests")
    ld.add_argument("--warmup", type=int, default=2,
                    help="unmeasured requests before the run (default %(default)s)")

    o = p.add_argument_group("output")
    o.add_argument("--out", help="directory for results.json, results.png, table.txt "
                   "(default bench/results/<time>-<workload>)")
    o.add_argument("--chunk-tokens", type=int,
                   help="kvtier chunk size for the whole-chunk share (default: what the server "
                   f"reports as vllm:kvtier_chunk_tokens, else {DEFAULT_CHUNK})")
    o.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help="extra fields for every request body")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--no-plot", action="store_true", help="no PNG")


def make_workload(args: argparse.Namespace) -> Workload:
    if args.workload == "shared-prefix":
        return SharedPrefix(args.prefixes, args.prefix_len, args.suffix_len, args.output_len,
                            args.order, args.seed, args.vocab)
    if args.workload == "agent-sessions":
        return AgentSessions(args.sessions, args.turns, args.first_len, args.tool_len,
                             args.message_len, args.output_len, args.seed, args.vocab)
    if args.workload == "trace":
        if not args.trace:
            raise ValueError("--workload trace needs --trace FILE")
        try:
            return TraceReplay(args.trace, args.trace_block_size, args.seed, args.vocab)
        except OSError as e:
            raise ValueError(f"cannot read the trace: {e}") from None
    return NoReuse(args.prompt_len, args.output_len, args.seed, args.vocab)


def make_load(args: argparse.Namespace, workload: Workload | None = None) -> LoadShape:
    """The load from the flags; a trace defaults to all its records, once."""
    schedule = bool(getattr(args, "trace_timing", False))
    if schedule and (args.concurrency is not None or args.rate is not None):
        raise ValueError("--trace-timing sends at the trace's timestamps: drop --concurrency "
                         "and --rate")
    if schedule and args.workload != "trace":
        raise ValueError("--trace-timing needs --workload trace")
    conc = args.concurrency if args.rate is None else None
    if conc is None and args.rate is None and not schedule:
        conc = 4
    reqs = args.requests if args.duration is None else None
    if reqs is None and args.duration is None:
        reqs = len(workload.records) if isinstance(workload, TraceReplay) else 32
    return LoadShape(conc, args.rate, args.arrival, reqs, args.duration, args.seed, schedule)


@dataclass
class Run:
    """One configuration's outcome."""

    name: str
    url: str
    summary: Summary
    results: list[RequestResult]
    serve_args: list[str] | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "url": self.url, "serve_args": self.serve_args, **self.info,
                "summary": self.summary.to_json(),
                "requests": [r.to_json() for r in self.results]}


async def _version(url: str) -> str | None:
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as s, \
                s.get(f"{url}/version") as r:
            return str((await r.json()).get("version")) if r.status == 200 else None
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError):
        return None


async def run_one(name: str, url: str, args: argparse.Namespace,
                  serve_args: list[str] | None = None) -> Run:
    """Warm up, scrape, drive the workload, scrape, summarise. Raises on an unreachable
    server; failed requests are counted, not raised."""
    model = args.model or await discover_model(url)
    workload = make_workload(args)
    load = make_load(args, workload)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=900)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for i, p in enumerate(warmup_prompts(args.warmup, 128, args.seed, args.vocab)):
            res = await send(session, url, model, RequestSpec(-1 - i, p, 4, "warmup"),
                             time.perf_counter(), extra=args.extra_body)
            if res.error:
                raise RuntimeError(f"warm-up request to {url} failed: {res.error}")
    before = await scrape.scrape(url)
    bar = _progress(name, load, args.no_progress)
    results, wall = await drive(url, model, workload, load,
                                on_done=(lambda _r: bar.update(1)) if bar is not None else None,
                                extra=args.extra_body)
    if bar is not None:  # a tqdm without a total (a --duration run) refuses bool()
        bar.close()
    after = await scrape.scrape_settled(url)
    delta = scrape.delta(after, before)
    present = scrape.has_kvtier(after)
    chunk = args.chunk_tokens or int(scrape.total(after, scrape.CHUNK_TOKENS) or 0) or DEFAULT_CHUNK
    by_source = scrape.total(after, scrape.BY_SOURCE) is not None
    summary = summarize(name, results, wall, delta, chunk, present, by_source)
    info = {"model": model, "vllm_version": await _version(url), "shape": workload.shape(),
            "load": load.describe(),
            "metrics_delta": {k: v for k, v in delta.items() if k.startswith(KEEP_METRICS)}}
    return Run(name, url, summary, results, serve_args, info)


def _progress(name: str, load: LoadShape, off: bool) -> Any:
    if off:
        return None
    from tqdm import tqdm

    return tqdm(total=load.requests, desc=name, unit="req", file=sys.stderr, leave=True,
                dynamic_ncols=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def parse_compare(items: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for item in items:
        name, sep, rest = item.partition("=")
        if not sep or not name.strip() or not rest.strip():
            raise ValueError(f"--compare wants NAME='kvtier serve args', got {item!r}")
        out.append((name.strip(), shlex.split(rest)))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"--compare names must differ, got {names}")
    return out


@dataclass
class Config:
    """One ``--compare`` configuration, checked and ready to start."""

    name: str
    argv: list[str]
    serve_args: Any  # kvtier.vllm.serve.ServeArgs (imported lazily)


def prepare_compare(items: list[str]) -> list[Config]:
    """Parse and check every ``--compare`` configuration before any server starts: kvtier's
    flags and settings, vLLM's flags (vLLM's own parser), and a --port given must be free.
    Raises ValueError naming the configuration."""
    from kvtier.config import ConfigError
    from kvtier.vllm import serve

    out = []
    ports: set[int] = set()  # servers may run at once (--rounds): never the same port twice
    for name, argv in parse_compare(items):
        try:
            sa = serve.parse(argv)
            own_port = serve.flag_value(sa.vllm_args, "--port") is not None
            if not own_port:
                port = free_port()
                while port in ports:
                    port = free_port()
                ports.add(port)
                sa.vllm_args += ["--port", str(port)]
            if serve.flag_value(sa.vllm_args, "--host") is None:
                sa.vllm_args += ["--host", "127.0.0.1"]
            serve.preflight(sa, serve.vllm_command(sa), check_port=own_port)
        except ConfigError as e:
            raise ValueError(f"--compare {name}: {e}") from None
        out.append(Config(name, argv, sa))
    return out


def run_compare(args: argparse.Namespace, configs: list[Config], out_dir: str,
                on_round: Callable[[list[Run]], None] | None = None) -> list[Run]:
    """One round: start each configuration's server, run the workload, stop it, in order.
    ``args.rounds`` > 1: start every server (one after the other, or with
    ``args.start_together`` all at once), then run the rounds in alternation (each
    configuration once per round, on the round's seed), then stop them all. ``on_round``
    gets the runs so far after every round but the last, so that a run cut short keeps the
    finished rounds."""
    if args.rounds <= 1:
        runs = []
        for cfg in configs:
            with _launched(cfg, out_dir) as server:
                runs.append(_measure(cfg, *server.wait(args.server_timeout), args, 0))
        return runs
    with contextlib.ExitStack() as stack:
        if args.start_together:
            launched = [stack.enter_context(_launched(cfg, out_dir)) for cfg in configs]
            servers = [s.wait(args.server_timeout) for s in launched]
        else:
            servers = [stack.enter_context(_launched(cfg, out_dir)).wait(args.server_timeout)
                       for cfg in configs]
        runs = []
        for r in range(args.rounds):
            runs += [_measure(cfg, url, waited, args, r)
                     for cfg, (url, waited) in zip(configs, servers)]
            if on_round is not None and r + 1 < args.rounds:
                on_round(runs)
        return runs


@dataclass
class _Server:
    """A launched ``--compare`` server, not yet known to be ready."""

    cfg: Config
    url: str
    proc: subprocess.Popen[bytes]
    log_path: str
    started: float

    def wait(self, timeout: float) -> tuple[str, float]:
        """Block until it answers; returns (its URL, seconds since its launch)."""
        from kvtier.vllm import serve

        serve.wait_ready(self.url, self.proc, timeout - (time.monotonic() - self.started),
                         self.log_path)
        waited = time.monotonic() - self.started
        print(f"[{self.cfg.name}] ready after {waited:.0f} s at {self.url}", file=sys.stderr,
              flush=True)
        return self.url, waited


@contextlib.contextmanager
def _launched(cfg: Config, out_dir: str) -> Iterator[_Server]:
    """``cfg``'s server, launched (its log in ``out_dir``); stopped after."""
    from kvtier.vllm import serve

    url = serve.base_url(cfg.serve_args.vllm_args)
    log_path = os.path.join(out_dir, f"server-{_slug(cfg.name)}.log")
    print(f"[{cfg.name}] starting: kvtier serve {shlex.join(cfg.argv)}", file=sys.stderr,
          flush=True)
    with open(log_path, "wb") as log:
        started = time.monotonic()
        proc = serve.launch(cfg.serve_args, log)
        try:
            yield _Server(cfg, url, proc, log_path, started)
        finally:
            serve.stop(proc)


def _measure(cfg: Config, url: str, waited: float, args: argparse.Namespace,
             round_: int) -> Run:
    """One configuration's run of round ``round_`` (seed ``args.seed + round_``)."""
    run = asyncio.run(run_one(cfg.name, url, _with_seed(args, args.seed + round_), cfg.argv))
    run.info["server_start_s"] = round(waited, 1)
    if args.rounds > 1:
        run.info["round"] = round_
        run.info["seed"] = args.seed + round_
    return run


def _with_seed(args: argparse.Namespace, seed: int) -> argparse.Namespace:
    out = copy.copy(args)
    out.seed = seed
    return out


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def report(runs: list[Run], out_dir: str, args: argparse.Namespace,
           partial: bool = False) -> str:
    """Print and write the table, the ratio lines, results.json and results.png.
    ``partial``: the rounds finished so far, written as they stand; only the newest round's
    table is printed."""
    rounds = _by_round(runs)
    if len(rounds) == 1 and not partial:
        summaries = [r.summary for r in runs]
        text = "\n".join([table(summaries), *ratio_lines(summaries)])
    else:
        parts: list[str] = []
        for i, rnd in enumerate(rounds):
            summaries = [r.summary for r in rnd]
            last_round = len(parts)
            parts += [f"round {i + 1} of {args.rounds} (seed {rnd[0].info.get('seed')})",
                      table(summaries), *ratio_lines(summaries), ""]
        if len(rounds) > 1:
            parts += round_ratio_lines([[r.summary for r in rnd] for rnd in rounds])
        text = "\n".join(parts)
        if partial:
            print("\n".join(parts[last_round:]), flush=True)
            with open(os.path.join(out_dir, "table.txt"), "w") as f:
                f.write(text + "\n")
            write_json(os.path.join(out_dir, "results.json"), metadata(),
                       [r.to_json() for r in runs])
            print(f"results so far: {out_dir}/ (results.json, table.txt)", file=sys.stderr)
            return text
    print(text, flush=True)
    with open(os.path.join(out_dir, "table.txt"), "w") as f:
        f.write(text + "\n")
    write_json(os.path.join(out_dir, "results.json"), metadata(), [r.to_json() for r in runs])
    if not args.no_plot:
        from kvtier.bench.plot import plot

        shape = runs[0].info.get("shape", {}) if runs else {}
        title = ", ".join(f"{k}={v}" for k, v in shape.items()) + (
            f"; {runs[0].info.get('load')}" if runs else "")
        plot(os.path.join(out_dir, "results.png"), [(r.summary, r.results) for r in runs], title)
    print(f"results: {out_dir}/ (results.json, table.txt"
          f"{'' if args.no_plot else ', results.png'})", file=sys.stderr)
    return text


def _by_round(runs: list[Run]) -> list[list[Run]]:
    """The runs of each round, in order (one round when they carry none)."""
    out: dict[int, list[Run]] = {}
    for r in runs:
        out.setdefault(int(r.info.get("round", 0)), []).append(r)
    return [out[k] for k in sorted(out)]


def run(args: argparse.Namespace) -> int:
    try:  # validate everything before starting anything
        make_load(args, make_workload(args))
        if args.rounds < 1 or (args.rounds > 1 and not args.compare):
            raise ValueError("--rounds N wants N >= 1, and N > 1 only with --compare")
        configs = prepare_compare(args.compare) if args.compare else []
    except ValueError as e:
        print(f"kvtier bench: {e}", file=sys.stderr)
        return 2
    out_dir = args.out or os.path.join(
        "bench", "results", f"{datetime.now().strftime('%Y%m%d-%H%M%S')}-{args.workload}")
    os.makedirs(out_dir, exist_ok=True)
    try:
        if configs:
            runs = run_compare(args, configs, out_dir,
                               lambda so_far: report(so_far, out_dir, args, partial=True))
        else:
            runs = [asyncio.run(run_one(args.name, args.url.rstrip("/"), args))]
    except (RuntimeError, OSError, aiohttp.ClientError) as e:
        print(f"kvtier bench: {e}", file=sys.stderr)
        return 1
    report(runs, out_dir, args)
    return 0 if all(r.summary.failed == 0 for r in runs) else 1
