"""Summaries of one run: throughput, latency percentiles and where prompt tokens came from.

Attribution of prompt tokens (docs/bench.md explains why):

- ``cached`` is exact per request: the server's ``usage.prompt_tokens_details.cached_tokens``,
  which on vLLM counts prefix-cache (HBM) hits plus tokens a KV connector supplied.
- ``kvtier`` is exact per run: the increase of kvtier's ``vllm:kvtier_restored_tokens_total``
  between a scrape before and a scrape after the run (tokens of loads that completed), 0 when
  the server has no kvtier. vLLM's streaming responses carry no per-request connector share.
- ``hbm`` = ``cached`` - ``kvtier``, per run. All three workloads restore only on requests
  with ``reuse_tokens > 0`` (a unique prompt has nothing stored), so the HBM share of the
  repeated-prefix tokens is (sum of their ``cached``) - ``kvtier``.
- Shares of "whole-chunk prefix tokens" use each request's ``restorable(chunk_tokens)``,
  computed from the workload alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.bench import scrape
from kvtier.bench.client import RequestResult


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default), ``q`` in [0, 100]; None if empty."""
    if not values:
        return None
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x * 1000.0, 2)


@dataclass
class Summary:
    """One configuration's run. Latencies in ms, throughputs in tokens/s, None = not measured."""

    name: str
    requests: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    total_tok_s: float
    input_tok_s: float
    output_tok_s: float
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    ttft_p99_ms: float | None
    ttft_repeat_p50_ms: float | None
    ttft_first_p50_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    repeat_requests: int
    cached_tokens: int | None
    kvtier_tokens: int
    hbm_tokens: int | None
    kvtier_present: bool
    reuse_tokens: int
    restorable_tokens: int
    chunk_tokens: int
    hbm_share_of_repeat: float | None
    kvtier_share_of_restorable: float | None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def summarize(name: str, results: Sequence[RequestResult], wall: float,
              metrics_delta: scrape.Samples, chunk_tokens: int, kvtier_present: bool
              ) -> Summary:
    ok = [r for r in results if r.ok]
    repeat = [r for r in ok if r.reuse_tokens > 0]
    first = [r for r in ok if r.reuse_tokens == 0]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    have_cached = bool(ok) and all(r.cached_tokens is not None for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok) if have_cached else None
    kvtier = int(scrape.total(metrics_delta, scrape.RESTORED) or 0)
    hbm = None if cached is None else cached - kvtier
    reuse = sum(r.reuse_tokens for r in repeat)
    restorable = sum(r.reuse_tokens // chunk_tokens * chunk_tokens for r in repeat)
    hbm_repeat = None
    if have_cached and reuse:
        hbm_repeat = (sum(r.cached_tokens or 0 for r in repeat) - kvtier) / reuse
    dur = max(wall, 1e-9)
    return Summary(
        name=name, requests=len(results), failed=len(results) - len(ok),
        duration_s=round(wall, 3), prompt_tokens=prompt, output_tokens=output,
        total_tok_s=round((prompt + output) / dur, 1), input_tok_s=round(prompt / dur, 1),
        output_tok_s=round(output / dur, 1),
        ttft_p50_ms=_ms(percentile(ttft, 50)), ttft_p90_ms=_ms(percentile(ttft, 90)),
        ttft_p99_ms=_ms(percentile(ttft, 99)),
        ttft_repeat_p50_ms=_ms(percentile([r.ttft for r in repeat if r.ttft is not None], 50)),
        ttft_first_p50_ms=_ms(percentile([r.ttft for r in first if r.ttft is not None], 50)),
        itl_p50_ms=_ms(percentile(itl, 50)), itl_p90_ms=_ms(percentile(itl, 90)),
        repeat_requests=len(repeat), cached_tokens=cached, kvtier_tokens=kvtier,
        hbm_tokens=hbm, kvtier_present=kvtier_present, reuse_tokens=reuse,
        restorable_tokens=restorable, chunk_tokens=chunk_tokens,
        hbm_share_of_repeat=None if hbm_repeat is None else round(hbm_repeat, 4),
        kvtier_share_of_restorable=round(kvtier / restorable, 4) if restorable else None,
    )


def ttft_ratio(base: Summary, other: Summary) -> float | None:
    """How many times lower ``other``'s median repeated-prefix TTFT is than ``base``'s."""
    if not base.ttft_repeat_p50_ms or not other.ttft_repeat_p50_ms:
        return None
    return base.ttft_repeat_p50_ms / other.ttft_repeat_p50_ms
