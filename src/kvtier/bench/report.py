"""The side-by-side table, the ratio line and the JSON file of a bench run."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from kvtier.bench.metrics import RATIOS, Summary, ratios


def _num(x: float | int | None, fmt: str = "{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _per_req(total: int | None, s: Summary) -> str:
    ok = s.requests - s.failed
    if total is None or not ok:
        return "-"
    return f"{total:,} ({total / ok:,.0f}/req)"


def _has_connector_count(s: Summary) -> bool:
    return s.token_source == "vllm" or s.kvtier_present


def _connector(s: Summary) -> str:
    """vLLM's count for any connector; kvtier's own where vLLM has none; else unknown."""
    return _per_req(s.connector_tokens, s) if _has_connector_count(s) else "- (not exported)"


def _tier_row(s: Summary, tier: str) -> str:
    t = s.tiers.get(tier)
    if t is None:
        return "-"
    return f"{t['hits']:,.0f} / {t['bytes'] / 1e9:,.2f} / {t['gbps']:,.2f}"


ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("requests (failed)", lambda s: f"{s.requests} ({s.failed})"),
    ("wall time", lambda s: f"{s.duration_s:.1f} s"),
    ("total tok/s", lambda s: _num(s.total_tok_s)),
    ("input tok/s", lambda s: _num(s.input_tok_s)),
    ("TTFT p50 / p90 / p99 (ms)", lambda s: " / ".join(
        _num(v, "{:,.1f}") for v in (s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms))),
    ("TTFT p50 / p99, repeated-prefix reqs (ms)", lambda s: " / ".join(
        _num(v, "{:,.1f}") for v in (s.ttft_repeat_p50_ms, s.ttft_repeat_p99_ms))),
    ("TTFT p50 / p99, first-seen reqs (ms)", lambda s: " / ".join(
        _num(v, "{:,.1f}") for v in (s.ttft_first_p50_ms, s.ttft_first_p99_ms))),
    ("ITL p50 / p90 (ms)", lambda s: " / ".join(
        _num(v, "{:,.1f}") for v in (s.itl_p50_ms, s.itl_p90_ms))),
    ("prompt tokens", lambda s: _per_req(s.prompt_tokens, s)),
    ("prompt tokens computed", lambda s: _per_req(s.computed_tokens, s)),
    ("prompt tokens from HBM", lambda s: _per_req(s.hbm_tokens, s)),
    ("prompt tokens from the KV connector", _connector),
    ("HBM share of repeated-prefix tokens", lambda s: _pct(s.hbm_share_of_repeat)),
    ("connector / whole-chunk prefix tokens", lambda s: _pct(s.connector_share_of_restorable)
     if _has_connector_count(s) else "-"),
    ("kvtier DRAM: hits / GB loaded / GB/s", lambda s: _tier_row(s, "dram")),
    ("kvtier disk: hits / GB read / GB/s", lambda s: _tier_row(s, "disk")),
    ("token sources from", lambda s: "vllm:prompt_tokens_by_source" if s.token_source == "vllm"
     else "usage + vllm:kvtier_*" if s.kvtier_present else "usage"),
]


def table(summaries: Sequence[Summary]) -> str:
    """Rows are metrics, columns are configurations."""
    head = ["", *(s.name for s in summaries)]
    body = [[label, *(f(s) for s in summaries)] for label, f in ROWS]
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    def line(r: list[str]) -> str:
        return "  ".join(c.ljust(widths[0]) if i == 0 else c.rjust(widths[i])
                         for i, c in enumerate(r)).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *(line(r) for r in body)])


def _factor(x: float) -> str:
    return f"{x:.1f}x" if x >= 2 else f"{x:.2f}x"


def ratio_lines(summaries: Sequence[Summary]) -> list[str]:
    """One line per measure (:data:`kvtier.bench.metrics.RATIOS`) for every configuration
    after the first (the baseline): ``NAME vs BASE: MEASURE N.Nx lower|higher``, ending in
    ``  <- LOSS`` when it is worse than the baseline."""
    if len(summaries) < 2:
        return []
    base = summaries[0]
    out = []
    for s in summaries[1:]:
        rs = ratios(base, s)
        if not rs:
            out.append(f"{s.name} vs {base.name}: no requests to compare")
        for r in rs:
            how = ("the same" if r.factor == 1.0 else
                   f"{_factor(r.factor)} {'lower' if r.lower else 'higher'}")
            out.append(f"{s.name} vs {base.name}: {r.label} {how}"
                       f"{'  <- LOSS' if r.loss else ''}")
    return out


def _way(q: float) -> str:
    """``other / base`` of one measure as ``N.Nx lower|higher`` (``the same`` at 1)."""
    if q == 1.0:
        return "the same"
    return f"{_factor(1 / q)} lower" if q < 1 else f"{_factor(q)} higher"


def round_ratio_lines(rounds: Sequence[Sequence[Summary]]) -> list[str]:
    """Over rounds of the same configurations (the first is the baseline): one line per
    configuration and measure, ``NAME vs BASE over N rounds: MEASURE <median> (range <min> ..
    <max>; rounds ...)``, ending in ``  <- LOSS`` when the median is worse than the
    baseline's. A measure some round lacks is left out."""
    if not rounds or len(rounds[0]) < 2:
        return []
    out = []
    for i in range(1, len(rounds[0])):
        base, other = rounds[0][0].name, rounds[0][i].name
        for label, attr, higher_better in RATIOS:
            qs = []
            for rnd in rounds:
                b, o = getattr(rnd[0], attr), getattr(rnd[i], attr)
                if b and o:
                    qs.append(o / b)
            if len(qs) != len(rounds):
                continue
            med = statistics.median(qs)
            loss = med < 1 if higher_better else med > 1
            out.append(f"{other} vs {base} over {len(qs)} rounds: {label} {_way(med)} "
                       f"(range {_way(min(qs))} .. {_way(max(qs))}; rounds "
                       f"{', '.join(_way(q) for q in qs)}){'  <- LOSS' if loss else ''}")
    return out


def machine() -> dict[str, Any]:
    """Where the run happened (for bench/results)."""
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    mem = None
    with contextlib.suppress(ValueError, OSError, AttributeError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return {"hostname": platform.node(), "cpu": cpu, "cores": os.cpu_count(),
            "memory_gib": None if mem is None else round(mem / 2**30, 1),
            "python": platform.python_version(), "platform": platform.platform()}


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5, cwd=os.path.dirname(__file__))
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def metadata(argv: Sequence[str] | None = None) -> dict[str, Any]:
    return {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "command": shlex.join(["kvtier", *(sys.argv[1:] if argv is None else argv)]),
            "kvtier_commit": git_commit(), "machine": machine()}


def write_json(path: str, meta: dict[str, Any], runs: Sequence[dict[str, Any]]) -> None:
    with open(path, "w") as f:
        json.dump({"meta": meta, "runs": list(runs)}, f, indent=1)
        f.write("\n")
