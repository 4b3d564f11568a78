"""kvtier's counters: one table from which the connector's stats dict, the Prometheus series
on vLLM's ``/metrics`` (:mod:`kvtier.vllm.prom`) and their documentation (docs/metrics.md,
:func:`render_markdown`) all come. No vLLM import: the docs test and tools read it too.

Each :class:`Metric` is one Prometheus metric ``vllm:kvtier_<name>`` and says where its values
come from:

- ``scheduler``: read from the :class:`~kvtier.scheduler.OffloadScheduler` when vLLM asks the
  scheduler's connector for stats (totals; the connector sends their deltas);
- ``worker``: read from each step's :class:`~kvtier.protocol.WorkerReport` (increments, summed
  over ranks by vLLM);
- ``derived``: computed by the Prometheus side from the other keys of one stats payload.

A counter's series are stats keys (``series``), or, for a family keyed by a reason, every
``<prefix><reason>`` key (``reasons``). Gauge keys start with ``gauge_`` (levels, not deltas).
Metric names never change without a deprecated alias kept one release (dashboards and
``kvtier bench`` read them); stats keys change only with a CHANGELOG entry (vLLM's logged
stats line shows them).

Words: a *save* is the job that copies one chunk into the DRAM tier (``saves_*``: chunks by
outcome); the bytes it moves are the ``store`` direction, and so are its stats keys
(``bytes_stored``, ``store_seconds``, ``store_jobs``). ``tier_*`` families carry the tier
name (:data:`kvtier.tiers.TIER_NAMES`): each final lookup answer, once per tier it asked.

A :class:`Histogram` is one Prometheus histogram ``vllm:kvtier_<name>``; its stats keys start
with ``obs_`` and carry a list of observations (one per transfer job, lookup or load), which
vLLM concatenates over ranks and steps.

The transfer direction is named as vLLM's offloading connector and LMCache name it: ``store``
(device to host) and ``load``. The series that said ``direction="save"`` before 0.2 are kept,
for one release, as deprecated aliases (:data:`DEPRECATED_LABELS`): the same values under the
old label, so a sum over ``direction`` must select ``direction=~"store|load"``.
"""

from __future__ import annotations

if __name__ == "__main__":  # python -m kvtier.vllm.counters > the generated table
    # the package's own module, not this __main__ copy: kvtier.vllm.remote_metrics imports
    # that one, and this copy's import of remote_metrics below would find it half made
    from kvtier.vllm.counters import render_markdown

    print(render_markdown(), end="")
    raise SystemExit(0)

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvtier.planner import Decline
from kvtier.protocol import JobKind, SaveDrop
from kvtier.tiers import DRAM, TIER_NAMES

COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"
SCHEDULER, WORKER, DERIVED = "scheduler", "worker", "derived"
GAUGE_PREFIX = "gauge_"
OBS_PREFIX = "obs_"
PREFIX = "vllm:kvtier_"
STORE, LOAD = "store", "load"
TIER = DRAM  # the transfer histograms' tier: the slab (a lower tier's bytes are disk_*)
_DRAM = (("tier", TIER),)  # the KV cache <-> DRAM transfers
DEPRECATED_LABELS: dict[tuple[str, str], str] = {("direction", STORE): "save"}
"""(label, value) -> the old value also exported, with the same numbers, until 0.3."""


@dataclass(frozen=True)
class Series:
    """One series of a metric: its stats key, its label value, and how to read it (from the
    scheduler, a worker report, or for a derived series the stats payload; None: no value)."""

    key: str
    label: str = ""
    read: Callable[[Any], Any] = lambda _: None
    fixed: tuple[tuple[str, str], ...] = ()  # a histogram series' own fixed labels (its tier)


@dataclass(frozen=True)
class Metric:
    name: str
    type: str  # COUNTER | GAUGE
    source: str  # SCHEDULER | WORKER | DERIVED
    doc: str
    label: str = ""  # the label that tells its series apart ('' for one series)
    series: tuple[Series, ...] = ()
    reasons: tuple[str, ...] = ()  # a reason family: key ``series[0].key + reason``
    reasons_of: Callable[[Any], dict[str, int]] | None = None  # reason -> count, from source
    fixed: tuple[tuple[str, str], ...] = ()  # labels the same on every series (the tier)

    def labels(self, value: str = "") -> dict[str, str]:
        """The labels of the series whose ``label`` is ``value`` (or of the only series)."""
        return {**({self.label: value} if self.label else {}), **dict(self.fixed)}

    @property
    def full_name(self) -> str:
        return PREFIX + self.name + ("_total" if self.type == COUNTER else "")


def _one(key: str, read: Callable[[Any], Any]) -> tuple[Series, ...]:
    return (Series(key, "", read),)


def _per_direction(save_key: str, load_key: str, read: Callable[[Any, JobKind], Any]
                   ) -> tuple[Series, ...]:
    return (Series(save_key, STORE, lambda r: read(r, JobKind.SAVE)),
            Series(load_key, LOAD, lambda r: read(r, JobKind.LOAD)))


def _gbps(data: dict[str, Any], nbytes: str, seconds: str) -> float | None:
    if data.get(nbytes) and data.get(seconds):
        return data[nbytes] / data[seconds] / 1e9
    return None


def _failures(report: Any) -> int:
    return (sum(f for _, f in report.saves.values())
            + sum(f for _, f in report.loads.values()))


def _disk(s: Any) -> Any:
    """The scheduler's disk tier, wherever it is in the stack (the remote tier has series of
    its own, kvtier.vllm.remote_metrics, and must not show as the disk's), or None."""
    return s.lower_tier("disk")


def _has_disk(s: Any) -> bool:
    return _disk(s) is not None


def _tier(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Read a disk-tier statistic of the scheduler (0 without a disk tier)."""
    return lambda s: read(_disk(s).stats) if _has_disk(s) else 0


def _with_tier(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Read a scheduler statistic where a disk tier is configured (0 without one)."""
    return lambda s: read(s) if _has_disk(s) else 0


def _disk_stored(s: Any) -> int:
    if not _has_disk(s):
        return 0
    return sum(_disk(s).catalog.stored(g) for g in s.geometry.full_groups)


def _disk_total(s: Any) -> int:
    return _disk(s).catalog.capacity * len(s.geometry.full_groups) if _has_disk(s) else 0


def _occupancy(data: dict[str, Any]) -> float | None:
    used, total = data.get("gauge_slots_used"), data.get("gauge_slots_total")
    return used / total if used is not None and total else None


METRICS: tuple[Metric, ...] = (
    Metric("lookups", COUNTER, SCHEDULER, "Lookups of waiting requests in kvtier's index.",
           series=_one("lookups", lambda s: s.stats.lookups)),
    Metric("hits", COUNTER, SCHEDULER,
           "Lookups that found stored chunks beyond the HBM hit and decided to load them.",
           series=_one("hits", lambda s: s.stats.hits)),
    Metric("hit_tokens", COUNTER, SCHEDULER,
           "Prompt tokens kvtier promised to vLLM (decided loads).",
           series=_one("hit_tokens", lambda s: s.stats.hit_tokens)),
    Metric("tier_hits", COUNTER, SCHEDULER,
           "Lookups whose answer promised tokens this tier held, per tier (the tokens "
           "beyond the HBM hit and the tiers above it).", label="tier",
           series=(Series("tier_hits_"),), reasons=TIER_NAMES,
           reasons_of=lambda s: s.stats.tier_hits),
    Metric("tier_misses", COUNTER, SCHEDULER,
           "Lookups that asked this tier and were promised none of its tokens (nothing "
           "stored there, or the load declined: loads_declined says why), per tier. DRAM is "
           "asked by every lookup; a lower tier by those whose DRAM answer a promotion could "
           "improve on.",
           label="tier", series=(Series("tier_misses_"),), reasons=TIER_NAMES,
           reasons_of=lambda s: s.stats.tier_misses),
    Metric("tier_hit_tokens", COUNTER, SCHEDULER,
           "Prompt tokens promised from each tier (tier_hits' tokens).", label="tier",
           series=(Series("tier_hit_tokens_"),), reasons=TIER_NAMES,
           reasons_of=lambda s: s.stats.tier_hit_tokens),
    Metric("restored_tokens", COUNTER, SCHEDULER,
           "Prompt tokens restored from kvtier by loads that completed on every rank "
           "(prefill work avoided).",
           series=_one("loaded_tokens", lambda s: s.stats.loaded_tokens)),
    Metric("loads", COUNTER, SCHEDULER, "Load jobs, by outcome.", label="outcome", series=(
        Series("loads_started", "started", lambda s: s.stats.loads_started),
        Series("loads_ok", "ok", lambda s: s.stats.loads_ok),
        Series("loads_failed", "failed", lambda s: s.stats.loads_failed))),
    Metric("loads_declined", COUNTER, SCHEDULER, "Hits not loaded, by reason.", label="reason",
           series=(Series("declined_"),), reasons=tuple(r.value for r in Decline),
           reasons_of=lambda s: s.stats.declined),
    Metric("saves", COUNTER, SCHEDULER, "Chunk saves, by outcome.", label="outcome", series=(
        Series("saves_planned", "planned", lambda s: s.stats.saves_planned),
        Series("saves_committed", "committed", lambda s: s.stats.saves_committed),
        Series("saves_failed", "failed", lambda s: s.stats.saves_failed))),
    Metric("saves_dropped", COUNTER, SCHEDULER,
           "Chunk saves dropped before they started, by reason.", label="reason",
           series=(Series("saves_dropped_"),), reasons=tuple(r.value for r in SaveDrop),
           reasons_of=lambda s: s.stats.saves_dropped),
    Metric("evictions", COUNTER, SCHEDULER, "Chunks evicted from the DRAM tier to make room.",
           series=_one("evictions", lambda s: s.index.evictions)),
    Metric("transfer_bytes", COUNTER, WORKER,
           "Bytes moved between the KV cache and the DRAM tier, per direction "
           "(store: device to host).", label="direction", fixed=_DRAM,
           series=_per_direction("bytes_stored", "bytes_loaded",
                                 lambda r, k: r.bytes_stored if k is JobKind.SAVE
                                 else r.bytes_loaded)),
    Metric("transfer_seconds", COUNTER, WORKER,
           "Seconds the host link was busy with transfers, per direction (summed over "
           "ranks; jobs that moved at once count their shared time once).",
           label="direction", fixed=_DRAM,
           series=_per_direction("store_seconds", "load_seconds",
                                 lambda r, k: r.store_seconds if k is JobKind.SAVE
                                 else r.load_seconds)),
    Metric("transfer_jobs", COUNTER, WORKER,
           "Transfer jobs finished by workers, per direction (one per rank).",
           label="direction", fixed=_DRAM,
           series=_per_direction("store_jobs", "load_jobs",
                                 lambda r, k: len(r.saves if k is JobKind.SAVE else r.loads))),
    Metric("transfer_gbps", GAUGE, DERIVED,
           "Deprecated (removed in 0.3): GB/s of the latest step that moved bytes, per "
           "direction; use the transfer_throughput_gbps histogram or "
           "rate(transfer_bytes_total) / rate(transfer_seconds_total).", label="direction",
           fixed=_DRAM,
           series=(Series("", STORE,
                          lambda d: _gbps(d, "bytes_stored", "store_seconds")),
                   Series("", LOAD,
                          lambda d: _gbps(d, "bytes_loaded", "load_seconds")))),
    Metric("transfer_failures", COUNTER, WORKER,
           "Worker transfer jobs that failed (the load is recomputed, the save dropped).",
           series=_one("transfer_failures", _failures)),
    Metric("loads_by_layer", COUNTER, WORKER,
           "Loads restored layer by layer inside the step that computes the rest of their "
           "prompt (layerwise_loads), summed over ranks.",
           series=_one("loads_by_layer", lambda r: r.loads_by_layer)),
    Metric("layer_waits_missed", COUNTER, WORKER,
           "Steps whose forward read a layer of a layer-by-layer load before waiting for it, "
           "summed over ranks: vLLM recomputed those blocks (under its asynchronous scheduler the "
           "engine stops instead). Above 0, an attention path or a CUDA graph skips vLLM's "
           "layer hook: turn layerwise_loads off.",
           series=_one("layer_waits_missed", lambda r: r.layer_waits_missed)),
    Metric("checksum_failures", COUNTER, WORKER,
           "Loads (and pre-promise verifications) whose stored bytes did not match their "
           "checksum, per rank: the load failed and vLLM recomputed, the chunks were dropped.",
           series=_one("checksum_failures", lambda r: r.checksum_failures)),
    Metric("corrupt_chunks", COUNTER, SCHEDULER,
           "Stored chunks dropped from the DRAM tier because their bytes failed verification "
           "(their descendants leave with them).",
           series=_one("corrupt_chunks", lambda s: s.stats.corrupt_chunks)),
    Metric("prepares", COUNTER, SCHEDULER,
           "Preparing hits before they are promised (kvtier.prepare): verify jobs planned "
           "(where a promised load cannot fail: vLLM 0.25.1 with several KV-cache groups), "
           "lookups deferred while a hit was verified or promoted from the disk tier, and "
           "requests that went on without it past prepare_timeout_ms / prepare_max_steps.",
           label="what", series=(
               Series("prepares", "jobs", lambda s: s.stats.prepares),
               Series("prepare_deferrals", "deferrals", lambda s: s.stats.prepare_deferrals),
               Series("prepare_timeouts", "timeouts", lambda s: s.stats.prepare_timeouts))),
    Metric("fences", COUNTER, SCHEDULER,
           "Saves fenced because their source blocks were reallocated or their request "
           "preempted.", series=_one("fences", lambda s: s.stats.fences)),
    Metric("fences_waited", COUNTER, WORKER, "Fences a worker had to wait for.",
           series=_one("fences_waited", lambda r: r.fences_waited)),
    Metric("unsaveable_requests", COUNTER, SCHEDULER,
           "Requests with extra keys kvtier cannot include (neither saved nor loaded).",
           series=_one("unsaveable_requests", lambda s: s.stats.unsaveable_requests)),
    Metric("resets", COUNTER, SCHEDULER,
           "Resets of the DRAM tier (reset_prefix_cache with the connector).",
           series=_one("resets", lambda s: s.stats.resets)),
    Metric("slots_used", GAUGE, SCHEDULER, "DRAM-tier slots holding a chunk (or being written).",
           series=_one("gauge_slots_used", lambda s: s.occupancy()[0])),
    Metric("slots_total", GAUGE, SCHEDULER, "DRAM-tier slots.",
           series=_one("gauge_slots_total", lambda s: s.occupancy()[1])),
    Metric("occupancy", GAUGE, DERIVED,
           "Share of DRAM-tier slots in use (slots_used / slots_total).",
           series=_one("", _occupancy)),
    Metric("chunk_tokens", GAUGE, SCHEDULER, "Tokens per stored chunk.",
           series=_one("gauge_chunk_tokens", lambda s: s.geometry.chunk_tokens)),
    Metric("disk_hits", COUNTER, SCHEDULER,
           "Loads whose chunks were promoted from the disk tier for them, and their tokens "
           "beyond what DRAM held.", label="unit", series=(
               Series("disk_hits", "loads", _tier(lambda t: t.hits)),
               Series("disk_hit_tokens", "tokens", _tier(lambda t: t.hit_tokens)))),
    Metric("disk_demotions", COUNTER, SCHEDULER,
           "Chunks leaving DRAM, by outcome: committed to disk, dropped (no room or budget: "
           "lost to the tier), already on disk, dropped because their DRAM bytes did not "
           "verify (verify_checksums: never written as good), or in a failed demotion job.",
           label="outcome",
           series=(Series("disk_demotions", "committed", _tier(lambda t: t.demotions)),
                   Series("disk_demotions_dropped", "dropped",
                          _tier(lambda t: t.demotions_dropped)),
                   Series("disk_evicted_already_stored", "already_stored",
                          _tier(lambda t: t.evicted_already_stored)),
                   Series("disk_demotions_corrupt", "corrupt_in_dram",
                          _tier(lambda t: t.demotions_corrupt)),
                   Series("disk_demotion_jobs_failed", "job_failed",
                          _tier(lambda t: t.demotion_jobs_failed)))),
    Metric("disk_promotions", COUNTER, SCHEDULER,
           "Chunks promoted from disk into DRAM before a hit was promised, and failed "
           "promotion jobs.", label="outcome",
           series=(Series("disk_promotions", "committed", _tier(lambda t: t.promotions)),
                   Series("disk_promotion_jobs_failed", "job_failed",
                          _tier(lambda t: t.promotion_jobs_failed)))),
    Metric("disk_checksum_failures", COUNTER, SCHEDULER,
           "Disk chunks whose bytes did not verify on read (a miss; the chunk is forgotten).",
           series=_one("disk_checksum_failures", _tier(lambda t: t.checksum_failures))),
    Metric("disk_full", COUNTER, SCHEDULER,
           "Demotion jobs the disk declined for want of space (a clean decline).",
           series=_one("disk_full", _tier(lambda t: t.tier_full))),
    Metric("disk_deferrals", COUNTER, SCHEDULER,
           "With a disk tier: lookups answered 'ask again' while a hit was prepared, requests "
           "that went on past the bound (the same counts as kvtier_prepares, one preparation "
           "step for promotion and verification), and promotions the cost model declined.",
           label="kind",
           series=(Series("disk_deferrals", "deferred",
                          _with_tier(lambda s: s.stats.prepare_deferrals)),
                   Series("disk_deferrals_expired", "expired",
                          _with_tier(lambda s: s.stats.prepare_timeouts)),
                   Series("disk_declined_slower", "declined_slower",
                          _tier(lambda t: t.declined_slower)))),
    Metric("disk_bytes", COUNTER, SCHEDULER,
           "Bytes the disk tier read (promotions) and wrote (demotions), summed over ranks.",
           label="direction",
           series=(Series("disk_bytes_read", "read", _tier(lambda t: t.bytes_read)),
                   Series("disk_bytes_written", "write", _tier(lambda t: t.bytes_written)))),
    Metric("disk_seconds", COUNTER, SCHEDULER,
           "Seconds the disk tier's reads and writes took, summed over ranks.",
           label="direction",
           series=(Series("disk_read_seconds", "read", _tier(lambda t: t.read_seconds)),
                   Series("disk_write_seconds", "write", _tier(lambda t: t.write_seconds)))),
    Metric("disk_gbps", GAUGE, DERIVED,
           "GB/s of the disk tier in the latest stats interval that moved bytes, per direction "
           "(per rank).", label="direction",
           series=(Series("", "read",
                          lambda d: _gbps(d, "disk_bytes_read", "disk_read_seconds")),
                   Series("", "write",
                          lambda d: _gbps(d, "disk_bytes_written", "disk_write_seconds")))),
    Metric("disk_chunks_stored", GAUGE, SCHEDULER, "Chunks the disk tier holds (all groups).",
           series=_one("gauge_disk_chunks_stored", _disk_stored)),
    Metric("disk_chunks_total", GAUGE, SCHEDULER, "Chunks the disk tier has room for.",
           series=_one("gauge_disk_chunks_total", _disk_total)),
)

@dataclass(frozen=True)
class Histogram:
    """One histogram ``vllm:kvtier_<name>``: each series' stats key (``obs_...``) carries a
    list of observations; ``fixed`` labels are the same on every series (the tier)."""

    name: str
    source: str  # WORKER | SCHEDULER
    doc: str
    buckets: tuple[float, ...]
    label: str = ""
    series: tuple[Series, ...] = ()
    fixed: tuple[tuple[str, str], ...] = ()

    @property
    def full_name(self) -> str:
        return PREFIX + self.name

    def labels(self, series: Series) -> dict[str, str]:
        return {**({self.label: series.label} if self.label else {}), **dict(self.fixed),
                **dict(series.fixed)}


def obs_key(what: str, direction: str = "") -> str:
    """The stats key of one histogram series: ``obs_<direction>_<what>`` (or ``obs_<what>``)."""
    return OBS_PREFIX + (f"{direction}_" if direction else "") + what


LOWER_TIERS = TIER_NAMES[1:]
"""Tiers below DRAM with transfer histograms of their own: ``store`` is a demotion (DRAM to
the tier), ``load`` a promotion (the tier to DRAM), one observation per tier job and rank."""


def tier_obs_key(tier: str, what: str, direction: str) -> str:
    """A lower tier's histogram key: ``obs_<tier>_<direction>_<what>``."""
    return obs_key(what, f"{tier}_{direction}")


def _directions(what: str) -> tuple[Series, ...]:
    """The DRAM tier's series (the histogram's fixed tier), then each lower tier's."""
    return (Series(obs_key(what, STORE), STORE), Series(obs_key(what, LOAD), LOAD),
            *(Series(tier_obs_key(t, what, d), d, fixed=(("tier", t),))
              for t in LOWER_TIERS for d in (STORE, LOAD)))


SIZE_BUCKETS = tuple(float(2**16 * 4**i) for i in range(10))  # 64 KiB .. 16 GiB
TIME_BUCKETS = (0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                2.5, 5.0, 10.0)
GBPS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0, 40.0, 50.0, 60.0, 80.0, 100.0,
                150.0)
LOOKUP_BUCKETS = (0.00001, 0.00005, 0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0)

HISTOGRAMS: tuple[Histogram, ...] = (
    Histogram("transfer_size_bytes", WORKER,
              "Bytes of one transfer job on one rank, per direction and tier (DRAM: a store "
              "job is one chunk, a load job one request's restored chunks; a lower tier: a "
              "store is one demotion job, a load one promotion job, files' headers and "
              "padding included).",
              SIZE_BUCKETS, "direction", _directions("bytes"), (("tier", TIER),)),
    Histogram("transfer_time_seconds", WORKER,
              "Seconds one transfer job took on one rank, per direction and tier (time to "
              "store, time to retrieve).", TIME_BUCKETS, "direction", _directions("seconds"),
              (("tier", TIER),)),
    Histogram("transfer_throughput_gbps", WORKER,
              "GB/s of one transfer job on one rank (its bytes / its seconds), per direction "
              "and tier.",
              GBPS_BUCKETS, "direction", _directions("gbps"), (("tier", TIER),)),
    Histogram("lookup_seconds", SCHEDULER,
              "Seconds one lookup of a waiting request in kvtier's index took (the "
              "scheduler's get_num_new_matched_tokens call).", LOOKUP_BUCKETS,
              series=(Series(obs_key("lookup_seconds")),)),
    Histogram("load_wait_seconds", SCHEDULER,
              "Seconds a request waited parked for its load: from vLLM allocating its blocks "
              "to the load's end reported by every rank (ok or failed).", TIME_BUCKETS,
              series=(Series(obs_key("load_wait_seconds")),), fixed=(("tier", TIER),)),
)
HIST_BY_KEY: dict[str, tuple[Histogram, Series]] = {
    s.key: (h, s) for h in HISTOGRAMS for s in h.series}


def worker_observations(report: Any) -> dict[str, list[float]]:
    """One step's per-job observations, from the ``jobs`` of a
    :class:`~kvtier.protocol.WorkerReport` (jobs that finished ok)."""
    out: dict[str, list[float]] = {}
    for kind, nbytes, seconds in report.jobs:
        direction = STORE if kind == JobKind.SAVE.value else LOAD
        out.setdefault(obs_key("bytes", direction), []).append(nbytes)
        out.setdefault(obs_key("seconds", direction), []).append(seconds)
        if nbytes and seconds > 0:
            out.setdefault(obs_key("gbps", direction), []).append(nbytes / seconds / 1e9)
    observed = [o for rep in report.tiers.values() for o in rep.observed]
    for tier, kind, nbytes, seconds in observed:
        if tier not in LOWER_TIERS:
            continue
        direction = STORE if kind == "demote" else LOAD
        out.setdefault(tier_obs_key(tier, "bytes", direction), []).append(nbytes)
        out.setdefault(tier_obs_key(tier, "seconds", direction), []).append(seconds)
        if seconds > 0:
            out.setdefault(tier_obs_key(tier, "gbps", direction), []).append(
                nbytes / seconds / 1e9)
    return out


from kvtier.vllm.remote_metrics import REMOTE_METRICS  # noqa: E402 - its rows use the above

METRICS += REMOTE_METRICS
BY_NAME: dict[str, Metric] = {m.name: m for m in METRICS}
BY_KEY: dict[str, tuple[Metric, Series]] = {
    s.key: (m, s) for m in METRICS if not m.reasons for s in m.series if s.key}
"""Stats key -> its metric and series (reason families are matched by prefix)."""
REASON_FAMILIES: tuple[Metric, ...] = tuple(m for m in METRICS if m.reasons)


def scheduler_counts(scheduler: Any) -> dict[str, Any]:
    """The scheduler side's stats: totals since start (counters) and levels (gauges)."""
    out: dict[str, Any] = {}
    for m in METRICS:
        if m.source != SCHEDULER:
            continue
        if m.reasons_of is not None:
            prefix = m.series[0].key
            for reason, n in m.reasons_of(scheduler).items():
                out[prefix + reason] = n
            continue
        for s in m.series:
            out[s.key] = s.read(scheduler)
    return out


def worker_counts(report: Any) -> dict[str, Any]:
    """One step's worker increments, from its :class:`~kvtier.protocol.WorkerReport`."""
    return {s.key: s.read(report) for m in METRICS if m.source == WORKER for s in m.series}


def series_of_key(key: str) -> tuple[Metric, dict[str, str]] | None:
    """The metric and labels a stats key feeds, or None for a key the table does not know."""
    known = BY_KEY.get(key)
    if known is not None:
        m, s = known
        return m, m.labels(s.label)
    for m in REASON_FAMILIES:
        prefix = m.series[0].key
        if key.startswith(prefix):
            return m, m.labels(key[len(prefix):])
    return None


def render_markdown() -> str:
    """The generated part of docs/metrics.md: one row per metric."""
    rows = ["| metric | type | labels | stats keys | source | what |",
            "|---|---|---|---|---|---|"]
    for m in METRICS:
        if m.reasons:
            labels = f"`{m.label}`: " + ", ".join(f"`{r}`" for r in m.reasons)
            keys = f"`{m.series[0].key}<{m.label}>`"
        else:
            labels = "; ".join(
                [*([f"`{m.label}`: " + ", ".join(_label_doc(m.label, s.label)
                                                 for s in m.series)] if m.label else []),
                 *(f"`{k}`: `{v}`" for k, v in m.fixed)])
            keys = ", ".join(f"`{s.key}`" for s in m.series if s.key) or "(computed)"
        rows.append(f"| `{m.full_name}` | {m.type} | {labels} | {keys} | {m.source} "
                    f"| {m.doc} |")
    for h in HISTOGRAMS:
        labels = "; ".join(
            [*([f"`{h.label}`: " + ", ".join(dict.fromkeys(f"`{s.label}`" for s in h.series))]
               if h.label else []),
             *(f"`{k}`: " + ", ".join(dict.fromkeys(
                 f"`{dict(s.fixed).get(k, v)}`" for s in h.series)) for k, v in h.fixed)])
        keys = ", ".join(f"`{s.key}`" for s in h.series)
        bounds = ", ".join(_bound(b, h.name.endswith("_bytes")) for b in h.buckets)
        rows.append(f"| `{h.full_name}` | histogram | {labels} | {keys} | {h.source} "
                    f"| {h.doc} Buckets: {bounds}. |")
    return "\n".join(rows) + "\n"


def _label_doc(label: str, value: str) -> str:
    old = DEPRECATED_LABELS.get((label, value))
    return f"`{value}`" + (f" (and `{old}`, its deprecated alias)" if old else "")


def _bound(b: float, in_bytes: bool) -> str:
    if not in_bytes:
        return f"{b:g}"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if b >= size:
            return f"{b / size:g} {unit}"
    return f"{b:g} B"

