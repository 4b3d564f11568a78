"""The one counters table (kvtier.vllm.counters): docs/metrics.md is generated from it, its
stats keys and metric names are the ones dashboards and ``kvtier bench`` read, and the
stats dicts the connector sends are made from it."""

from __future__ import annotations

from pathlib import Path

from kvtier.config import KvtierConfig
from kvtier.geometry import Geometry, GroupGeometry
from kvtier.layout import GroupKind
from kvtier.protocol import WorkerReport
from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput
from kvtier.vllm.counters import METRICS, render_markdown, scheduler_counts, worker_counts

ROOT = Path(__file__).resolve().parent.parent
BEGIN = "<!-- BEGIN GENERATED: python -m kvtier.vllm.counters -->\n"
END = "<!-- END GENERATED -->"

# The names dashboards and the logged stats line show: a change here needs a CHANGELOG entry
# (metric names: a deprecated alias for one release). 0.2 renamed the store direction's keys
# bytes_saved, save_seconds, save_jobs to bytes_stored, store_seconds, store_jobs.
STATS_KEYS = {
    "lookups", "hits", "hit_tokens", "loaded_tokens", "loads_started", "loads_ok",
    "loads_failed", "saves_planned", "saves_committed", "saves_failed", "evictions",
    "bytes_stored", "bytes_loaded", "store_seconds", "load_seconds", "store_jobs", "load_jobs",
    "transfer_failures", "fences", "fences_waited", "unsaveable_requests", "resets",
    "gauge_slots_used", "gauge_slots_total", "gauge_chunk_tokens",
    "checksum_failures", "corrupt_chunks",  # added with verified restores (issue 12 item 10)
    "loads_by_layer", "layer_waits_missed",  # added with layerwise_loads (issue 15)
    "prepares", "prepare_deferrals",
    "prepare_timeouts",  # one bound for verification and disk promotion (issue 16)
    # the disk tier's (issue 16)
    "disk_hits", "disk_hit_tokens", "disk_demotions", "disk_demotions_dropped",
    "disk_evicted_already_stored", "disk_demotion_jobs_failed", "disk_promotions",
    "disk_promotion_jobs_failed", "disk_checksum_failures", "disk_full", "disk_deferrals",
    "disk_deferrals_expired", "disk_declined_slower", "disk_bytes_read", "disk_bytes_written",
    "disk_read_seconds", "disk_write_seconds", "gauge_disk_chunks_stored",
    "gauge_disk_chunks_total",
    "disk_demotions_corrupt",  # a chunk corrupted in DRAM is not demoted (issue 16)
    # the remote tier's (issue 17)
    "remote_hits", "remote_hit_tokens", "remote_written_through",
    "remote_write_through_dropped", "remote_discovered", "remote_promoted", "remote_queries",
    "remote_queries_failed", "remote_queries_expired", "remote_bytes_read",
    "remote_bytes_written", "remote_checksum_failures", "gauge_remote_chunks_known",
    "remote_declined_slower",  # the remote tier below the disk (issue 17)
}
METRIC_NAMES = {
    "lookups", "hits", "hit_tokens", "restored_tokens", "loads", "loads_declined", "saves",
    "saves_dropped", "evictions", "transfer_bytes", "transfer_seconds", "transfer_jobs",
    "transfer_gbps", "transfer_failures", "fences", "fences_waited", "unsaveable_requests",
    "resets", "slots_used", "slots_total", "occupancy", "chunk_tokens",
    "loads_by_layer", "layer_waits_missed",  # added with layerwise_loads (issue 15)
    "checksum_failures", "corrupt_chunks", "prepares",  # added with verified restores
    "disk_hits", "disk_demotions", "disk_promotions", "disk_checksum_failures", "disk_full",
    "disk_deferrals", "disk_bytes", "disk_seconds", "disk_gbps", "disk_chunks_stored",
    "disk_chunks_total",
    "remote_hits", "remote_hit_tokens", "remote_chunks", "remote_lookups", "remote_bytes",
    "remote_checksum_failures", "remote_chunks_known",  # the remote tier's (issue 17)
    "remote_declined_slower",
    "tier_hits", "tier_misses", "tier_hit_tokens",  # per tier (issue 19)
}


def test_docs_metrics_md_is_the_table() -> None:
    text = (ROOT / "docs" / "metrics.md").read_text()
    assert BEGIN in text and END in text, "docs/metrics.md lost its generated-section markers"
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0]
    assert generated == render_markdown(), (
        "docs/metrics.md is out of date: regenerate its table with "
        "`python -m kvtier.vllm.counters`")


def test_names_are_unchanged() -> None:
    assert {m.name for m in METRICS} == METRIC_NAMES
    keys = {s.key for m in METRICS if not m.reasons for s in m.series if s.key}
    assert keys == STATS_KEYS
    assert {m.series[0].key for m in METRICS if m.reasons} == {
        "declined_", "saves_dropped_", "tier_hits_", "tier_misses_", "tier_hit_tokens_"}


def test_the_stats_dicts_come_from_the_table() -> None:
    geo = Geometry(32, (GroupGeometry(GroupKind.FULL, 16, 4096),))
    config = KvtierConfig(dram_size="4MiB", cost_model=False)
    sched = OffloadScheduler(config, geo, b"n" * 16, geo.slab_layout(config, 1))
    sched.add_request("a")
    prompt = list(range(1, 101))
    sched.lookup("a", prompt, 0)
    plan = sched.schedule_step(StepInput(new=[NewRequest("a", [list(range(1, 8))])],
                                         scheduled=[ScheduledTokens("a", prompt, 100, 100)]))
    sched.on_report(WorkerReport(saves={j.job_id: [1, 0] for j in plan.saves}))
    counts = scheduler_counts(sched)
    assert counts["lookups"] == 1 and counts["saves_planned"] == counts["saves_committed"] == 3
    assert counts["declined_not_stored"] == 1  # a reason family: one key per reason seen
    assert counts["gauge_chunk_tokens"] == 32 and counts["gauge_slots_used"] == 3
    scheduler_keys = {s.key for m in METRICS if m.source == "scheduler" and not m.reasons
                      for s in m.series}
    assert scheduler_keys <= set(counts)

    report = WorkerReport(saves={1: [1, 0], 2: [0, 1]}, loads={3: [0, 1]}, bytes_stored=10,
                          store_seconds=0.5, fences_waited=2)
    w = worker_counts(report)
    assert (w["store_jobs"], w["load_jobs"], w["transfer_failures"]) == (2, 1, 2)
    assert (w["bytes_stored"], w["store_seconds"], w["bytes_loaded"]) == (10, 0.5, 0)
    assert w["fences_waited"] == 2
