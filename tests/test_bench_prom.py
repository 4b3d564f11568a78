"""kvtier's Prometheus metrics (kvtier.vllm.prom) on a private registry."""

from __future__ import annotations

from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.bench import scrape
from kvtier.planner import Decline
from kvtier.vllm.counters import METRICS
from kvtier.vllm.prom import KvtierPromMetrics
from kvtier.vllm.stats import KvtierStats

LABELS = {"engine": "0", "model_name": "m"}


@pytest.fixture
def prom() -> tuple[KvtierPromMetrics, CollectorRegistry]:
    reg = CollectorRegistry()

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)
        return Bound

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}

    class Cfg:
        kv_transfer_config = None

    return KvtierPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]}), reg


def _samples(reg: CollectorRegistry) -> scrape.Samples:
    return scrape.parse(generate_latest(reg).decode())


def _v(s: scrape.Samples, name: str, **labels: str) -> float | None:
    return s.get(scrape.key(name, {**LABELS, **labels}))


def test_every_series_exists_at_zero_before_traffic(prom: Any) -> None:
    _, reg = prom
    s = _samples(reg)
    assert _v(s, "vllm:kvtier_restored_tokens_total") == 0
    assert _v(s, "vllm:kvtier_loads_total", outcome="failed") == 0
    assert _v(s, "vllm:kvtier_transfer_bytes_total", direction="load") == 0
    assert _v(s, "vllm:kvtier_occupancy") == 0
    for reason in Decline:
        assert _v(s, "vllm:kvtier_loads_declined_total", reason=reason.value) == 0
    names = {k.partition("{")[0] for k in s}
    for m in METRICS:  # every metric of the table, counters with their _total suffix
        assert m.full_name in names, m.name
        assert m.doc  # and its own documentation


def test_observe_maps_stats_to_series(prom: Any) -> None:
    m, reg = prom
    # a worker's and the scheduler's stats merged, as vLLM hands them to the frontend
    stats = KvtierStats(data={"bytes_loaded": 4_000_000_000, "load_seconds": 2.0,
                              "bytes_saved": 1_000_000, "save_seconds": 0.001,
                              "transfer_failures": 1})
    stats.aggregate(KvtierStats(data={
        "loaded_tokens": 512, "loads_ok": 2, "declined_not_stored": 3,
        "saves_dropped_save_queue_full": 4, "evictions": 5, "gauge_slots_used": 10,
        "gauge_slots_total": 40, "gauge_chunk_tokens": 256, "brand_new_counter": 7,
        "gauge_new_level": 2.5}))
    m.observe(stats.to_dict(), engine_idx=0)
    m.observe({"loaded_tokens": 256, "gauge_slots_used": 20, "gauge_slots_total": 40}, 0)
    s = _samples(reg)
    assert _v(s, "vllm:kvtier_restored_tokens_total") == 768
    assert _v(s, "vllm:kvtier_loads_total", outcome="ok") == 2
    assert _v(s, "vllm:kvtier_loads_declined_total", reason="not_stored") == 3
    assert _v(s, "vllm:kvtier_saves_dropped_total", reason="save_queue_full") == 4
    assert _v(s, "vllm:kvtier_evictions_total") == 5
    assert _v(s, "vllm:kvtier_transfer_failures_total") == 1
    assert _v(s, "vllm:kvtier_transfer_bytes_total", direction="load") == 4e9
    assert _v(s, "vllm:kvtier_transfer_gbps", direction="load") == pytest.approx(2.0)
    assert _v(s, "vllm:kvtier_transfer_gbps", direction="save") == pytest.approx(1.0)
    assert _v(s, "vllm:kvtier_slots_used") == 20  # a level: the newest value
    assert _v(s, "vllm:kvtier_occupancy") == pytest.approx(0.5)
    assert _v(s, "vllm:kvtier_chunk_tokens") == 256
    assert _v(s, "vllm:kvtier_brand_new_counter_total") == 7  # unknown keys are not lost
    assert _v(s, "vllm:kvtier_new_level") == 2.5


def test_clashing_unknown_key_is_skipped_not_fatal(prom: Any) -> None:
    m, reg = prom
    m.observe({"gauge_lookups": 3, "lookups": 2}, 0)  # a gauge named like a counter
    s = _samples(reg)
    assert _v(s, "vllm:kvtier_lookups_total") == 2


def test_connector_builds_its_prom_metrics() -> None:
    from kvtier.vllm.connector import KvtierConnector

    assert "build_prom_metrics" in KvtierConnector.__dict__
