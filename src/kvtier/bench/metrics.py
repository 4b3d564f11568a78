"""Summaries of one run: throughput, latency percentiles and where prompt tokens came from.

Attribution of prompt tokens (docs/bench.md explains why):

- ``cached`` is exact per request: the server's ``usage.prompt_tokens_details.cached_tokens``,
  which on vLLM counts prefix-cache (HBM) hits plus tokens a KV connector supplied.
- Per run, from the increase of counters between a scrape before and after the run:
  where the server exports vLLM's ``vllm:prompt_tokens_by_source`` (vLLM 0.25.1 and 0.32, for
  every connector: native offloading, LMCache, kvtier, none), ``connector`` is its
  ``external_kv_transfer``, ``hbm`` its ``local_cache_hit`` and ``computed`` its
  ``local_compute`` (``token_source = "vllm"``). Where it lacks that series, ``connector`` is
  kvtier's ``vllm:kvtier_restored_tokens_total`` (0 without kvtier) and ``hbm`` = ``cached`` -
  ``connector`` (``token_source = "kvtier"``).
- All three workloads restore only on requests with ``reuse_tokens > 0`` (a unique prompt has
  nothing stored), so the HBM share of the repeated-prefix tokens is (sum of their
  ``cached``) - ``connector``.
- Shares of "whole-chunk prefix tokens" use each request's ``restorable(chunk_tokens)``,
  computed from the workload alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
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
    ttft_repeat_p99_ms: float | None
    ttft_first_p50_ms: float | None
    ttft_first_p99_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    repeat_requests: int
    cached_tokens: int | None
    connector_tokens: int
    hbm_tokens: int | None
    computed_tokens: int | None
    token_source: str
    kvtier_present: bool
    reuse_tokens: int
    restorable_tokens: int
    chunk_tokens: int
    hbm_share_of_repeat: float | None
    connector_share_of_restorable: float | None
    tiers: dict[str, dict[str, float]] = field(default_factory=dict)  # per kvtier tier

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _sources(delta: scrape.Samples, cached: int | None, kvtier_present: bool,
             by_source: bool) -> tuple[int, int | None, int | None, str]:
    """(connector, hbm, computed, token_source) per the module docstring."""
    if by_source:
        got = {s: int(scrape.total(delta, scrape.BY_SOURCE, source=s) or 0)
               for s in scrape.SOURCES}
        return (got["external_kv_transfer"], got["local_cache_hit"], got["local_compute"],
                "vllm")
    connector = int(scrape.total(delta, scrape.RESTORED) or 0) if kvtier_present else 0
    return connector, None if cached is None else cached - connector, None, "kvtier"


def _gbps(nbytes: float, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else 0.0


def tier_stats(delta: scrape.Samples) -> dict[str, dict[str, float]]:
    """Per kvtier tier, from the run's ``vllm:kvtier_*`` deltas: loads served (hits), bytes
    and GB/s moved, and for the disk its promotions, demotions and checksum failures. DRAM's
    hits are the loads no promotion served; its bytes are those loaded into the KV cache."""
    def get(name: str, **match: str) -> float:
        return scrape.total(delta, f"{scrape.KVTIER_PREFIX}{name}", **match) or 0.0

    disk_hits = get("disk_hits_total", unit="loads")
    out = {"dram": {
        "hits": get("hits_total") - disk_hits,
        "bytes": get("transfer_bytes_total", direction="load"),
        "gbps": _gbps(get("transfer_bytes_total", direction="load"),
                      get("transfer_seconds_total", direction="load")),
    }}
    if scrape.total(delta, f"{scrape.KVTIER_PREFIX}disk_bytes_total") is not None:
        out["disk"] = {
            "hits": disk_hits,
            "bytes": get("disk_bytes_total", direction="read"),
            "gbps": _gbps(get("disk_bytes_total", direction="read"),
                          get("disk_seconds_total", direction="read")),
            "bytes_written": get("disk_bytes_total", direction="write"),
            "promotions": get("disk_promotions_total", outcome="committed"),
            "demotions": get("disk_demotions_total", outcome="committed"),
            "checksum_failures": get("disk_checksum_failures_total"),
        }
    return out


def summarize(name: str, results: Sequence[RequestResult], wall: float,
              metrics_delta: scrape.Samples, chunk_tokens: int, kvtier_present: bool,
              by_source: bool = False) -> Summary:
    """``by_source``: the server exports ``vllm:prompt_tokens_by_source`` (present in the
    scrape after the run; ``metrics_delta`` drops series that did not move)."""
    ok = [r for r in results if r.ok]
    repeat = [r for r in ok if r.reuse_tokens > 0]
    first = [r for r in ok if r.reuse_tokens == 0]
    prompt = sum(r.prompt_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok if r.ttft is not None]
    rep_ttft = [r.ttft for r in repeat if r.ttft is not None]
    first_ttft = [r.ttft for r in first if r.ttft is not None]
    itl = [g for r in ok for g in r.itl]
    have_cached = bool(ok) and all(r.cached_tokens is not None for r in ok)
    cached = sum(r.cached_tokens or 0 for r in ok) if have_cached else None
    connector, hbm, computed, source = _sources(metrics_delta, cached, kvtier_present,
                                                by_source)
    reuse = sum(r.reuse_tokens for r in repeat)
    restorable = sum(r.reuse_tokens // chunk_tokens * chunk_tokens for r in repeat)
    hbm_repeat = None
    if have_cached and reuse:
        hbm_repeat = (sum(r.cached_tokens or 0 for r in repeat) - connector) / reuse
    dur = max(wall, 1e-9)
    return Summary(
        name=name, requests=len(results), failed=len(results) - len(ok),
        duration_s=round(wall, 3), prompt_tokens=prompt, output_tokens=output,
        total_tok_s=round((prompt + output) / dur, 1), input_tok_s=round(prompt / dur, 1),
        output_tok_s=round(output / dur, 1),
        ttft_p50_ms=_ms(percentile(ttft, 50)), ttft_p90_ms=_ms(percentile(ttft, 90)),
        ttft_p99_ms=_ms(percentile(ttft, 99)),
        ttft_repeat_p50_ms=_ms(percentile(rep_ttft, 50)),
        ttft_repeat_p99_ms=_ms(percentile(rep_ttft, 99)),
        ttft_first_p50_ms=_ms(percentile(first_ttft, 50)),
        ttft_first_p99_ms=_ms(percentile(first_ttft, 99)),
        itl_p50_ms=_ms(percentile(itl, 50)), itl_p90_ms=_ms(percentile(itl, 90)),
        repeat_requests=len(repeat), cached_tokens=cached, connector_tokens=connector,
        hbm_tokens=hbm, computed_tokens=computed, token_source=source,
        kvtier_present=kvtier_present, reuse_tokens=reuse,
        restorable_tokens=restorable, chunk_tokens=chunk_tokens,
        hbm_share_of_repeat=None if hbm_repeat is None else round(hbm_repeat, 4),
        connector_share_of_restorable=round(connector / restorable, 4) if restorable else None,
        tiers=tier_stats(metrics_delta) if kvtier_present else {},
    )


# (label, Summary field, True when higher is better): every ratio the comparison prints.
RATIOS: tuple[tuple[str, str, bool], ...] = (
    ("median TTFT of repeated-prefix requests", "ttft_repeat_p50_ms", False),
    ("p99 TTFT of repeated-prefix requests", "ttft_repeat_p99_ms", False),
    ("median TTFT of first-seen requests", "ttft_first_p50_ms", False),
    ("p99 TTFT of first-seen requests", "ttft_first_p99_ms", False),
    ("throughput (total tok/s)", "total_tok_s", True),
)


@dataclass(frozen=True)
class Ratio:
    """``other`` against ``base`` on one measure: ``factor`` >= 1, ``better`` says which way."""

    label: str
    factor: float
    lower: bool  # other's value is lower than base's
    better: bool

    @property
    def loss(self) -> bool:
        return not self.better and self.factor > 1.0


def ratios(base: Summary, other: Summary) -> list[Ratio]:
    """Every measure of :data:`RATIOS` both runs have (a workload without repeated prefixes
    has no repeated-prefix TTFT)."""
    out = []
    for label, attr, higher_better in RATIOS:
        b, o = getattr(base, attr), getattr(other, attr)
        if not b or not o:
            continue
        lower = o < b
        factor = b / o if lower else o / b
        out.append(Ratio(label, factor, lower, lower != higher_better or factor == 1.0))
    return out


def ttft_ratio(base: Summary, other: Summary) -> float | None:
    """How many times lower ``other``'s median repeated-prefix TTFT is than ``base``'s."""
    if not base.ttft_repeat_p50_ms or not other.ttft_repeat_p50_ms:
        return None
    return base.ttft_repeat_p50_ms / other.ttft_repeat_p50_ms
