"""kvtier's Prometheus metrics (kvtier.vllm.prom) on a private registry."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvtier.bench import scrape
from kvtier.planner import Decline
from kvtier.protocol import WorkerReport
from kvtier.vllm.counters import HISTOGRAMS, METRICS, worker_observations
from kvtier.vllm.prom import KvtierPromMetrics
from kvtier.vllm.scheduler_side import STATS_REFRESH_STEPS
from kvtier.vllm.stats import MAX_OBSERVATIONS, KvtierStats, add_observations, stats_payload
from kvtier.vllm.timings import SchedulerTimings

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
    assert _v(s, "vllm:kvtier_transfer_bytes_total", direction="load", tier="dram") == 0
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
                              "bytes_stored": 1_000_000, "store_seconds": 0.001,
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
    assert _v(s, "vllm:kvtier_transfer_bytes_total", direction="load", tier="dram") == 4e9
    assert _v(s, "vllm:kvtier_transfer_gbps", direction="load", tier="dram") == pytest.approx(2.0)
    assert _v(s, "vllm:kvtier_transfer_gbps", direction="save", tier="dram") == pytest.approx(1.0)
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


def test_direction_store_is_also_exported_as_its_deprecated_alias_save(prom: Any) -> None:
    m, reg = prom
    s = _samples(reg)
    for name in ("vllm:kvtier_transfer_bytes_total", "vllm:kvtier_transfer_seconds_total",
                 "vllm:kvtier_transfer_jobs_total"):
        for direction in ("store", "save", "load"):  # every series at 0 from start-up
            assert _v(s, name, direction=direction, tier="dram") == 0, (name, direction)
    m.observe({"bytes_stored": 300, "store_seconds": 0.5, "store_jobs": 2, "bytes_loaded": 40}, 0)
    s = _samples(reg)
    for direction in ("store", "save"):
        assert _v(s, "vllm:kvtier_transfer_bytes_total", direction=direction, tier="dram") == 300
        assert _v(s, "vllm:kvtier_transfer_jobs_total", direction=direction, tier="dram") == 2
        assert _v(s, "vllm:kvtier_transfer_gbps", direction=direction, tier="dram") == pytest.approx(6e-7)
    assert _v(s, "vllm:kvtier_transfer_bytes_total", direction="load", tier="dram") == 40


def test_histograms_exist_at_zero_and_observe_every_listed_value(prom: Any) -> None:
    m, reg = prom
    s = _samples(reg)
    names = {k.partition("{")[0] for k in s}
    for h in HISTOGRAMS:
        assert f"{h.full_name}_count" in names and f"{h.full_name}_bucket" in names, h.name
        for series in h.series:
            assert _v(s, f"{h.full_name}_count", **h.labels(series)) == 0
    stats = KvtierStats(data={"obs_load_seconds": [0.002], "obs_store_bytes": [300_000]})
    stats.aggregate(KvtierStats(data={"obs_load_seconds": [0.2, 3.0], "obs_lookup_seconds":
                                      [0.00002], "obs_not_in_the_table": [1.0]}))
    m.observe(stats.to_dict(), 0)
    s = _samples(reg)
    load = {"direction": "load", "tier": "dram"}
    assert _v(s, "vllm:kvtier_transfer_time_seconds_count", **load) == 3
    assert _v(s, "vllm:kvtier_transfer_time_seconds_sum", **load) == pytest.approx(3.202)
    assert _v(s, "vllm:kvtier_transfer_time_seconds_bucket", le="0.0025", **load) == 1
    assert _v(s, "vllm:kvtier_transfer_time_seconds_bucket", le="0.25", **load) == 2
    assert _v(s, "vllm:kvtier_transfer_time_seconds_count", direction="store", tier="dram") == 0
    assert _v(s, "vllm:kvtier_transfer_size_bytes_bucket", le="262144.0", direction="store",
              tier="dram") == 0
    assert _v(s, "vllm:kvtier_transfer_size_bytes_bucket", le="1.048576e+06", direction="store",
              tier="dram") == 1
    assert _v(s, "vllm:kvtier_lookup_seconds_count") == 1
    assert not any("not_in_the_table" in k for k in s)


def test_stats_concatenate_observations_and_log_their_count_and_mean() -> None:
    a = KvtierStats(data={"obs_store_seconds": [1.0], "lookups": 1})
    a.aggregate(KvtierStats(data={"obs_store_seconds": [3.0], "lookups": 2}))
    assert a.data == {"obs_store_seconds": [1.0, 3.0], "lookups": 3}
    assert a.reduce() == {"obs_store_seconds_count": 2, "obs_store_seconds_mean": 2.0,
                          "lookups": 3}
    assert not KvtierStats(data={"obs_lookup_seconds": [0.1]}).is_empty()


def test_the_logged_line_names_the_store_direction_as_the_metrics_do() -> None:
    line = KvtierStats(data={"bytes_stored": 4_000_000_000, "store_seconds": 2.0,
                             "bytes_loaded": 1_000_000_000, "load_seconds": 0.5}).reduce()
    assert line["gbps_stored"] == 2.0 and line["gbps_loaded"] == 2.0
    assert not any("save" in k for k in line)


def test_observations_are_bounded_between_collections() -> None:
    kept: dict[str, list[float]] = {}
    for i in range(MAX_OBSERVATIONS + 10):
        add_observations(kept, {"obs_lookup_seconds": [float(i)]})
    assert len(kept["obs_lookup_seconds"]) == MAX_OBSERVATIONS
    assert kept["obs_lookup_seconds"][-1] == MAX_OBSERVATIONS + 9  # the newest are kept


def test_worker_observations_per_direction() -> None:
    report = WorkerReport(jobs=[("save", 2_000_000, 0.001), ("load", 6_000_000, 0.002),
                                ("save", 1_000_000, 0.0)])
    obs = worker_observations(report)
    assert obs["obs_store_bytes"] == [2_000_000, 1_000_000]
    assert obs["obs_store_seconds"] == [0.001, 0.0]
    assert obs["obs_store_gbps"] == [pytest.approx(2.0)]  # a job of 0 s has no rate
    assert obs["obs_load_gbps"] == [pytest.approx(3.0)]
    assert set(obs) <= {s.key for h in HISTOGRAMS for s in h.series}


def test_scheduler_timings_observe_lookups_and_load_waits() -> None:
    now = [10.0]
    t = SchedulerTimings(clock=lambda: now[0])
    t.lookup(0.001)
    t.load_started("a")
    t.load_started("b")
    now[0] = 10.5
    t.load_started("a")  # vLLM's second allocation for the same load keeps the first time
    t.forget("b")  # finished before its load ended: never observed
    now[0] = 12.0
    t.loads_ended(["a", "b", "c"])
    assert t.take() == {"obs_lookup_seconds": [0.001], "obs_load_wait_seconds": [2.0]}
    assert t.take() == {}


def test_disk_tier_jobs_are_observed_in_the_transfer_histograms_with_tier_disk(
        prom: Any, tmp_path: Any) -> None:
    """A real disk tier's demotion and promotion jobs (TierRunner over DiskChunkStore) land in
    transfer_size/time/throughput with tier="disk", direction store (demotion) and load
    (promotion); the DRAM series stay untouched."""
    import time

    import torch

    from kvtier.tiers.disk import DiskChunkStore, file_bytes
    from kvtier.tiers.seam import TierJob, TierJobKind, TierOp, TierReport, TierRunner

    slots = torch.randint(0, 256, (3, 8192), dtype=torch.uint8)
    runner = TierRunner(DiskChunkStore(tmp_path, 0, bytes(16)), lambda g, s: slots[s])
    ops = [TierOp(0, i, bytes([i + 1]) * 16, bytes([i]) * 16 if i else None) for i in range(3)]
    report = WorkerReport()
    for job_id, kind in ((1, TierJobKind.DEMOTE), (2, TierJobKind.PROMOTE)):
        runner.submit(TierJob(job_id, kind, ops))
        runner.drain()
        time.sleep(0.01)
        for c in runner.poll():
            assert c.ok, c.error
            report.tiers.setdefault("disk", TierReport()).take(c)
    runner.close()
    obs = worker_observations(report)
    assert obs["obs_disk_store_bytes"] == obs["obs_disk_load_bytes"] == [3 * file_bytes(8192)]
    assert set(obs) <= {s.key for h in HISTOGRAMS for s in h.series}
    m, reg = prom
    m.observe(KvtierStats(data=obs).to_dict(), 0)
    s = _samples(reg)
    for direction in ("store", "load"):
        disk = {"direction": direction, "tier": "disk"}
        for name in ("size_bytes", "time_seconds", "throughput_gbps"):
            assert _v(s, f"vllm:kvtier_transfer_{name}_count", **disk) == 1, (name, direction)
        assert _v(s, "vllm:kvtier_transfer_size_bytes_sum", **disk) == 3 * file_bytes(8192)
        assert _v(s, "vllm:kvtier_transfer_time_seconds_count", direction=direction,
                  tier="dram") == 0


_KEYS = ["lookups", "hits", "gauge_slab_used", "gauge_disk_used", "bytes_loaded"]


@given(st.dictionaries(st.sampled_from(_KEYS), st.integers(0, 5)),
       st.dictionaries(st.sampled_from(_KEYS), st.integers(0, 5)))
def test_a_payload_is_the_changed_counters_deltas_and_every_gauge(
        now: dict[str, int], before: dict[str, int]) -> None:
    """stats_payload (one pass, run every engine step) against its definition: counter deltas
    since ``before``, unchanged counters left out, every gauge level as it is now."""
    want = {k: v - before.get(k, 0) for k, v in now.items()
            if not k.startswith("gauge_") and v != before.get(k, 0)}
    want.update({k: v for k, v in now.items() if k.startswith("gauge_")})
    assert stats_payload(now, before) == want


def test_a_step_where_no_counter_moved_sends_no_scheduler_stats() -> None:
    """Most decode steps change nothing kvtier counts: the scheduler side then returns no
    payload at all (a gauge-only one is dropped by vLLM: KvtierStats.is_empty), and does not
    even read the counters while no hook saw activity; the next change still arrives as its
    delta since the last payload sent. Through vLLM's real
    scheduler (the harness), after two requests ran."""
    import random

    from tests.harness.cases import _base
    from tests.harness.compat import quiet
    from tests.harness.driver import Driver
    from tests.harness.workload import FaultPlan, ReqSpec

    rng = random.Random(0)
    reqs = [ReqSpec(key=f"r{i}", req_id=f"r{i}", max_tokens=40, arrival=0,
                    prompt=[rng.randrange(1, 1000) for _ in range(96)]) for i in range(2)]
    with quiet():
        drv = Driver(_base(0, reqs, FaultPlan()))
        drv.run()
    try:
        side = drv.sched.connector.scheduler_side
        assert side.scheduler is not None
        side.stats()  # whatever the run left unreported
        assert side.stats() == {}  # nothing moved since
        assert drv.sched.connector.get_kv_connector_stats() is None
        # a change no hook saw (as a lower tier's own thread makes): a quiet step does not
        # read the counters, and the periodic read brings the delta, STATS_REFRESH_STEPS late
        side.scheduler.stats.fences += 3
        reads = [side.stats() for _ in range(STATS_REFRESH_STEPS + 1)]
        arrived = [i for i, r in enumerate(reads) if r]
        assert len(arrived) == 1 and arrived[0] >= 1, arrived  # late, never lost
        delta = reads[arrived[0]]
        assert delta["fences"] == 3, delta
        assert any(k.startswith("gauge_") for k in delta)  # levels ride along with a change
        assert side.stats() == {}
        # a hook that saw activity (a finished request) makes the next step read at once
        side.scheduler.stats.fences += 2
        side.request_finished(SimpleNamespace(request_id="gone"))
        assert side.stats()["fences"] == 2
        assert side.stats() == {}
    finally:
        drv.close()
