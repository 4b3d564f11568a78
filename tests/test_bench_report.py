"""Summaries, attribution of prompt tokens, the table, the ratio line, JSON and the plot."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from kvtier.bench import scrape
from kvtier.bench.client import RequestResult
from kvtier.bench.metrics import percentile, summarize, ttft_ratio
from kvtier.bench.plot import cdf_lines, plot
from kvtier.bench.report import ratio_lines, round_ratio_lines, table, write_json

RESTORED = scrape.key(scrape.RESTORED, {"engine": "0", "model_name": "m"})


def _req(i: int, reuse: int, ttft: float, cached: int | None, prompt: int = 1000,
         error: str | None = None) -> RequestResult:
    return RequestResult(i, f"g{i % 2}", 0, reuse, prompt, 4, start=0.1 * i, ttft=ttft,
                         latency=ttft + 0.03, itl=[0.01, 0.01, 0.01], output_tokens=4,
                         cached_tokens=cached, error=error)


def test_percentile_matches_linear_interpolation() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile(list(range(101)), 90) == 90
    assert percentile([10, 0], 25) == 2.5


def test_summary_attributes_prompt_tokens() -> None:
    results = [_req(0, 0, 0.5, 0), _req(1, 0, 0.7, 0),
               _req(2, 800, 0.10, 800), _req(3, 800, 0.12, 832),
               _req(4, 800, 0.2, None, error="HTTP 500")]
    s = summarize("kvtier", results, 2.0, {RESTORED: 1536.0}, chunk_tokens=256,
                  kvtier_present=True)
    assert (s.requests, s.failed, s.repeat_requests) == (5, 1, 2)
    assert s.prompt_tokens == 4000 and s.output_tokens == 16
    assert s.input_tok_s == 2000 and s.total_tok_s == 2008
    assert s.cached_tokens == 1632 and s.connector_tokens == 1536 and s.hbm_tokens == 96
    assert s.token_source == "kvtier" and s.computed_tokens is None
    assert s.reuse_tokens == 1600 and s.restorable_tokens == 1536
    assert s.connector_share_of_restorable == 1.0
    assert s.hbm_share_of_repeat == pytest.approx(96 / 1600, abs=1e-4)
    assert s.ttft_repeat_p50_ms == pytest.approx(110.0)
    assert s.ttft_repeat_p99_ms == pytest.approx(119.8)
    assert s.ttft_first_p50_ms == pytest.approx(600.0)
    assert s.ttft_first_p99_ms == pytest.approx(698.0)
    assert s.itl_p50_ms == pytest.approx(10.0)


def test_summary_without_kvtier_or_usage_details() -> None:
    results = [_req(0, 0, 0.5, None), _req(1, 500, 0.4, None)]
    s = summarize("plain", results, 1.0, {}, chunk_tokens=256, kvtier_present=False)
    assert s.cached_tokens is None and s.hbm_tokens is None and s.connector_tokens == 0
    assert s.hbm_share_of_repeat is None and s.connector_share_of_restorable == 0.0


def test_summary_takes_token_sources_from_vllms_series_for_any_connector() -> None:
    """A native or LMCache run has no kvtier series: vLLM's prompt_tokens_by_source still
    says what the connector restored; it wins over kvtier's series where both exist."""
    results = [_req(0, 0, 0.5, 0), _req(1, 800, 0.1, 800)]
    delta = {'vllm:prompt_tokens_by_source{engine="0",source="local_cache_hit"}': 32.0,
             'vllm:prompt_tokens_by_source{engine="0",source="external_kv_transfer"}': 768.0,
             'vllm:prompt_tokens_by_source{engine="0",source="local_compute"}': 1200.0}
    native = summarize("native", results, 1.0, delta, 256, kvtier_present=False,
                       by_source=True)
    assert (native.connector_tokens, native.hbm_tokens, native.computed_tokens) == (768, 32,
                                                                                    1200)
    assert native.token_source == "vllm" and native.connector_share_of_restorable == 1.0
    both = summarize("kvtier", results, 1.0, {**delta, RESTORED: 999.0}, 256, True, True)
    assert both.connector_tokens == 768
    row = next(x for x in table([native]).splitlines() if x.startswith("prompt tokens from the"))
    assert row.split()[-2:] == ["768", "(384/req)"]


def _pair() -> list:  # type: ignore[type-arg]
    base = summarize("HBM-only", [_req(0, 0, 0.5, 0), _req(1, 800, 0.6, 0)], 1.0, {}, 256,
                     False)
    kvt = summarize("kvtier", [_req(0, 0, 0.5, 0), _req(1, 800, 0.1, 768)], 1.0,
                    {RESTORED: 768.0}, 256, True)
    return [base, kvt]


def test_table_and_every_ratio_marked_when_a_loss() -> None:
    base, kvt = _pair()
    text = table([base, kvt])
    lines = text.splitlines()
    assert lines[0].split() == ["HBM-only", "kvtier"]
    assert any(line.startswith("TTFT p50 / p99, repeated-prefix reqs (ms)") for line in lines)
    assert any(line.startswith("TTFT p50 / p99, first-seen reqs (ms)") for line in lines)
    row = next(line for line in lines if line.startswith("prompt tokens from the KV connector"))
    assert row.split()[-3:] == ["exported)", "768", "(384/req)"]  # HBM-only: "- (not exported)"
    assert ttft_ratio(base, kvt) == pytest.approx(6.0)
    assert ratio_lines([base]) == []
    # repeated-prefix TTFT 6x lower, but first-seen TTFT 2x higher and throughput lower
    slow_first = summarize("kvtier", [_req(0, 0, 1.0, 0), _req(1, 800, 0.1, 768)], 1.25,
                           {RESTORED: 768.0}, 256, True)
    assert ratio_lines([base, slow_first]) == [
        "kvtier vs HBM-only: median TTFT of repeated-prefix requests 6.0x lower",
        "kvtier vs HBM-only: p99 TTFT of repeated-prefix requests 6.0x lower",
        "kvtier vs HBM-only: median TTFT of first-seen requests 2.0x higher  <- LOSS",
        "kvtier vs HBM-only: p99 TTFT of first-seen requests 2.0x higher  <- LOSS",
        "kvtier vs HBM-only: throughput (total tok/s) 1.25x lower  <- LOSS",
    ]
    assert ratio_lines([slow_first, base])[-1] == (
        "HBM-only vs kvtier: throughput (total tok/s) 1.25x higher")
    plain = [summarize(n, [_req(0, 0, t, 0)], 1.0, {}, 256, False) for n, t in (("a", 0.2),
                                                                              ("b", 0.4))]
    assert ratio_lines(plain) == [
        "b vs a: median TTFT of first-seen requests 2.0x higher  <- LOSS",
        "b vs a: p99 TTFT of first-seen requests 2.0x higher  <- LOSS",
        "b vs a: throughput (total tok/s) the same"]


def test_plot_lines_one_colour_per_configuration_with_first_seen() -> None:
    base, kvt = _pair()
    res = [_req(0, 0, 0.5, 0), _req(1, 800, 0.1, 768)]
    lines = cdf_lines([(base, res), (kvt, res)])
    assert [(n, sub) for n, sub, *_ in lines] == [
        (n, sub) for n in ("HBM-only", "kvtier") for sub in ("all", "repeated-prefix",
                                                            "first-seen")]
    colours = {n: {c for m, _, _, c, _ in lines if m == n} for n in ("HBM-only", "kvtier")}
    assert all(len(c) == 1 for c in colours.values())
    assert colours["HBM-only"] != colours["kvtier"]
    assert len({style for _, _, style, _, _ in lines}) == 3
    assert next(xs for n, sub, _, _, xs in lines if sub == "first-seen") == [500.0]


def test_json_and_plot_files(tmp_path: str) -> None:
    base, kvt = _pair()
    path = os.path.join(tmp_path, "r.json")
    write_json(path, {"date": "x"}, [{"name": "a", "summary": base.to_json()}])
    with open(path) as f:
        data = json.load(f)
    assert data["meta"] == {"date": "x"} and data["runs"][0]["summary"]["name"] == "HBM-only"
    png = os.path.join(tmp_path, "r.png")
    res = [_req(0, 0, 0.5, 0), _req(1, 800, 0.1, 768)]
    plot(png, [(base, res), (kvt, res)], "title")
    with open(png, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_scrape_parse_total_and_delta() -> None:
    text = "\n".join([
        "# HELP vllm:x x", "# TYPE vllm:x counter",
        'vllm:x_total{engine="0",model_name="m",reason="a"} 3.0',
        'vllm:x_total{engine="0",model_name="m",reason="b"} 4.0',
        'vllm:x_created{engine="0",model_name="m",reason="b"} 1.7e9',
        "plain 1e3", "garbage line {",
    ])
    s = scrape.parse(text)
    assert scrape.total(s, "vllm:x_total") == 7.0
    assert scrape.total(s, "vllm:x_total", reason="b") == 4.0
    assert scrape.total(s, "missing") is None and s["plain"] == 1000.0
    assert not any("created" in k for k in s)
    after = dict(s, plain=1500.0)
    assert scrape.delta(after, s) == {"plain": 500.0}


def test_rounds_give_each_ratio_its_median_and_range() -> None:
    """--rounds: alternating pairs; the ratio lines over them name the median, the range and
    every round, and a median worse than the baseline's is a LOSS."""
    def pair(hbm_repeat: float, kvt_repeat: float, kvt_first: float) -> list[Any]:
        base = summarize("HBM-only", [_req(0, 0, 0.5, 0), _req(1, 800, hbm_repeat, 0)], 1.0,
                         {}, 256, False)
        kvt = summarize("kvtier", [_req(0, 0, kvt_first, 0), _req(1, 800, kvt_repeat, 768)],
                        1.0, {RESTORED: 768.0}, 256, True)
        return [base, kvt]

    rounds = [pair(0.8, 0.1, 0.5), pair(0.4, 0.1, 1.0), pair(0.9, 0.1, 1.0)]
    lines = round_ratio_lines(rounds)
    assert lines[0] == ("kvtier vs HBM-only over 3 rounds: median TTFT of repeated-prefix "
                        "requests 8.0x lower (range 9.0x lower .. 4.0x lower; rounds 8.0x "
                        "lower, 4.0x lower, 9.0x lower)")
    first = next(x for x in lines if "median TTFT of first-seen" in x)
    assert first.endswith("(range the same .. 2.0x higher; rounds the same, 2.0x higher, "
                          "2.0x higher)  <- LOSS")
    assert round_ratio_lines([rounds[0][:1]]) == []


def test_per_tier_hits_bytes_and_gbps_come_from_the_kvtier_series() -> None:
    from kvtier.bench import scrape
    from kvtier.bench.metrics import tier_stats

    delta = scrape.parse(
        'vllm:kvtier_hits_total 5\n'
        'vllm:kvtier_disk_hits_total{unit="loads"} 2\n'
        'vllm:kvtier_disk_hits_total{unit="tokens"} 200\n'
        'vllm:kvtier_transfer_bytes_total{direction="load"} 4e9\n'
        'vllm:kvtier_transfer_seconds_total{direction="load"} 2\n'
        'vllm:kvtier_disk_bytes_total{direction="read"} 1e9\n'
        'vllm:kvtier_disk_bytes_total{direction="write"} 3e9\n'
        'vllm:kvtier_disk_seconds_total{direction="read"} 0.5\n'
        'vllm:kvtier_disk_promotions_total{outcome="committed"} 7\n')
    tiers = tier_stats(delta)
    assert tiers["dram"] == {"hits": 3.0, "bytes": 4e9, "gbps": 2.0}
    assert tiers["disk"]["hits"] == 2.0 and tiers["disk"]["gbps"] == 2.0
    assert tiers["disk"]["bytes_written"] == 3e9 and tiers["disk"]["promotions"] == 7.0
    assert "disk" not in tier_stats(scrape.parse('vllm:kvtier_hits_total 1\n'))
