"""The side-by-side table, the ratio line and the JSON file of a bench run."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Callable, Sequence
from datetime import datetime, timezone
from typing import Any

from kvtier.bench.metrics import Summary, ttft_ratio


def _num(x: float | int | None, fmt: str = "{:,.0f}") -> str:
    return "-" if x is None else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _per_req(total: int | None, s: Summary) -> str:
    ok = s.requests - s.failed
    if total is None or not ok:
        return "-"
    return f"{total:,} ({total / ok:,.0f}/req)"


ROWS: list[tuple[str, Callable[[Summary], str]]] = [
    ("requests (failed)", lambda s: f"{s.requests} ({s.failed})"),
    ("wall time", lambda s: f"{s.duration_s:.1f} s"),
    ("total tok/s", lambda s: _num(s.total_tok_s)),
    ("input tok/s", lambda s: _num(s.input_tok_s)),
    ("TTFT p50 / p90 / p99 (ms)", lambda s: " / ".join(
        _num(v, "{:,.1f}") for v in (s.ttft_p50_ms, s.ttft_p90_ms, s.ttft_p99_ms))),
    ("TTFT p50, repeated-prefix reqs (ms)", lambda s: _num(s.ttft_repeat_p50_ms, "{:,.1f}")),
    ("TTFT p50, first-seen reqs (ms)", lambda s: _num(s.ttft_first_p50_ms, "{:,.1f}")),
    ("ITL p50 / p90 (ms)", lambda s: " / ".join(
        _num(v, "{:,.1f}") for v in (s.itl_p50_ms, s.itl_p90_ms))),
    ("prompt tokens", lambda s: _per_req(s.prompt_tokens, s)),
    ("prompt tokens from HBM", lambda s: _per_req(s.hbm_tokens, s)),
    ("prompt tokens from kvtier", lambda s: _per_req(s.kvtier_tokens, s)
     if s.kvtier_present else "- (off)"),
    ("HBM share of repeated-prefix tokens", lambda s: _pct(s.hbm_share_of_repeat)),
    ("kvtier / whole-chunk prefix tokens", lambda s: _pct(s.kvtier_share_of_restorable)
     if s.kvtier_present else "- (off)"),
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


def ratio_lines(summaries: Sequence[Summary]) -> list[str]:
    """``NAME vs BASE: median TTFT of repeated-prefix requests N.Nx lower`` for every
    configuration after the first (the baseline)."""
    if len(summaries) < 2:
        return []
    base = summaries[0]
    out = []
    for s in summaries[1:]:
        r = ttft_ratio(base, s)
        what = "median TTFT of repeated-prefix requests"
        if r is None and base.ttft_p50_ms and s.ttft_p50_ms:  # e.g. no-reuse: all requests
            r, what = base.ttft_p50_ms / s.ttft_p50_ms, "median TTFT (no repeated prefixes)"
        if r is None:
            out.append(f"{s.name} vs {base.name}: no requests to compare")
        elif r >= 1:
            out.append(f"{s.name} vs {base.name}: {what} {r:.1f}x lower")
        else:
            out.append(f"{s.name} vs {base.name}: {what} {1 / r:.1f}x higher")
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
