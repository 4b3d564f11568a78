"""kvtier's connector stats as Prometheus metrics on vLLM's ``/metrics``.

vLLM builds this in its API-server process through ``KvtierConnector.build_prom_metrics`` and
calls :meth:`KvtierPromMetrics.observe` with each engine step's stats payload: the dict of a
:class:`kvtier.vllm.stats.KvtierStats` (worker counters aggregated over ranks, plus the
scheduler half's counters). Contract:

- Keys without the ``gauge_`` prefix are counter *increments*; ``gauge_*`` keys are levels.
- Every key in :data:`COUNTERS` / :data:`GAUGES` maps to one series (a metric plus fixed
  labels); ``declined_<reason>`` and ``saves_dropped_<reason>`` map to a ``reason`` label. A
  key this module does not know still appears, as ``vllm:kvtier_<key>_total`` (or
  ``vllm:kvtier_<key>`` for a gauge), so new stats are never silently lost.
- ``vllm:kvtier_transfer_gbps{direction}`` is the throughput of the latest step that moved
  bytes in that direction (bytes / seconds the transfers took); for an average over time use
  ``rate(vllm:kvtier_transfer_bytes_total[1m]) / rate(vllm:kvtier_transfer_seconds_total[1m])``.
- Every fixed series exists from start-up (value 0), per engine, so dashboards and scrapes
  see the full set before the first request.
"""

from __future__ import annotations

import re
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvtier.log import get_logger
from kvtier.planner import Decline
from kvtier.protocol import JobKind, SaveDrop

PREFIX = "vllm:kvtier_"
GAUGE = "gauge_"

# metric name (without PREFIX) -> its documentation
DOCS: dict[str, str] = {
    "lookups": "Lookups of waiting requests in kvtier's index.",
    "hits": "Lookups that found stored chunks beyond the HBM hit and decided to load them.",
    "hit_tokens": "Prompt tokens kvtier promised to vLLM (decided loads).",
    "restored_tokens": "Prompt tokens restored from kvtier by loads that completed on every "
    "rank (prefill work avoided).",
    "loads": "Load jobs, by outcome.",
    "loads_declined": "Hits not loaded, by reason.",
    "saves": "Chunk saves, by outcome.",
    "saves_dropped": "Chunk saves dropped before they started, by reason.",
    "evictions": "Chunks evicted from the DRAM tier to make room.",
    "transfer_bytes": "Bytes moved between the KV cache and the DRAM tier, per direction "
    "(save: device to host).",
    "transfer_seconds": "Seconds transfers took, per direction (summed over ranks and "
    "concurrent jobs).",
    "transfer_jobs": "Transfer jobs finished by workers, per direction (one per rank).",
    "transfer_gbps": "GB/s of the latest step that moved bytes, per direction.",
    "transfer_failures": "Worker transfer jobs that failed (the load is recomputed, the save "
    "dropped).",
    "fences": "Saves fenced because their source blocks were reallocated or their request "
    "preempted.",
    "fences_waited": "Fences a worker had to wait for.",
    "unsaveable_requests": "Requests with extra keys kvtier cannot include (neither saved nor "
    "loaded).",
    "resets": "Resets of the DRAM tier (reset_prefix_cache with the connector).",
    "slots_used": "DRAM-tier slots holding a chunk (or being written).",
    "slots_total": "DRAM-tier slots.",
    "occupancy": "Share of DRAM-tier slots in use (slots_used / slots_total).",
    "chunk_tokens": "Tokens per stored chunk.",
}

# stats key -> (metric name, extra labels); declined_<reason> and saves_dropped_<reason> too
COUNTERS: dict[str, tuple[str, dict[str, str]]] = {
    "lookups": ("lookups", {}),
    "hits": ("hits", {}),
    "hit_tokens": ("hit_tokens", {}),
    "loaded_tokens": ("restored_tokens", {}),
    "loads_started": ("loads", {"outcome": "started"}),
    "loads_ok": ("loads", {"outcome": "ok"}),
    "loads_failed": ("loads", {"outcome": "failed"}),
    "saves_planned": ("saves", {"outcome": "planned"}),
    "saves_committed": ("saves", {"outcome": "committed"}),
    "saves_failed": ("saves", {"outcome": "failed"}),
    "evictions": ("evictions", {}),
    "bytes_saved": ("transfer_bytes", {"direction": JobKind.SAVE.value}),
    "bytes_loaded": ("transfer_bytes", {"direction": JobKind.LOAD.value}),
    "save_seconds": ("transfer_seconds", {"direction": JobKind.SAVE.value}),
    "load_seconds": ("transfer_seconds", {"direction": JobKind.LOAD.value}),
    "save_jobs": ("transfer_jobs", {"direction": JobKind.SAVE.value}),
    "load_jobs": ("transfer_jobs", {"direction": JobKind.LOAD.value}),
    "transfer_failures": ("transfer_failures", {}),
    "fences": ("fences", {}),
    "fences_waited": ("fences_waited", {}),
    "unsaveable_requests": ("unsaveable_requests", {}),
    "resets": ("resets", {}),
}
KNOWN_DROP_REASONS = tuple(r.value for r in SaveDrop)

# stats key -> gauge name
GAUGES: dict[str, str] = {
    "gauge_slots_used": "slots_used",
    "gauge_slots_total": "slots_total",
    "gauge_chunk_tokens": "chunk_tokens",
}

_NAME_OK = re.compile(r"[^a-zA-Z0-9_]")
logger = get_logger("vllm.prom")


class _Null:
    """Stands in for a metric that could not be registered."""

    def labels(self, *_: object) -> _Null:
        return self

    def inc(self, *_: object) -> None:
        return None

    def set(self, *_: object) -> None:
        return None


_NULL = _Null()


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._children: dict[tuple[int, str, str, tuple[tuple[str, str], ...]], Any] = {}
        for engine in per_engine_labelvalues:
            for name, labels in COUNTERS.values():
                self._series(engine, "counter", name, labels)
            for reason in Decline:
                self._series(engine, "counter", "loads_declined", {"reason": reason.value})
            for reason in KNOWN_DROP_REASONS:
                self._series(engine, "counter", "saves_dropped", {"reason": reason})
            for name in (*GAUGES.values(), "occupancy"):
                self._series(engine, "gauge", name, {})
            for direction in (JobKind.SAVE.value, JobKind.LOAD.value):
                self._series(engine, "gauge", "transfer_gbps", {"direction": direction})

    def _series(self, engine: int, kind: str, name: str, labels: dict[str, str]) -> Any:
        """The child of metric ``vllm:kvtier_<name>`` for this engine and these labels."""
        lk = tuple(sorted(labels.items()))
        child = self._children.get((engine, kind, name, lk))
        if child is not None:
            return child
        extra = tuple(k for k, _ in lk)
        family = self._families.get((kind, name, extra))
        if family is None:
            full = PREFIX + name
            doc = DOCS.get(name, f"kvtier {kind} {name}.")
            try:
                if kind == "counter":
                    family = self._counter_cls(name=full, documentation=doc,
                                               labelnames=[*self._labelnames, *extra])
                else:
                    family = self._gauge_cls(name=full, documentation=doc,
                                             labelnames=[*self._labelnames, *extra],
                                             multiprocess_mode="mostrecent")
            except ValueError:  # an unknown key whose name clashes with a known metric
                logger.warning("kvtier: cannot export %s %s as %s%s", kind, name, PREFIX, name)
                family = _NULL
            self._families[(kind, name, extra)] = family
        child = family.labels(*self.per_engine_labelvalues[engine], *(v for _, v in lk))
        self._children[(engine, kind, name, lk)] = child
        return child

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        data = transfer_stats_data or {}
        for key, value in data.items():
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            if key.startswith(GAUGE):
                name = GAUGES.get(key) or _clean(key[len(GAUGE):])
                self._series(engine_idx, "gauge", name, {}).set(value)
                continue
            if value < 0:
                continue  # counters only go up; a negative delta means a restarted source
            if key in COUNTERS:
                name, labels = COUNTERS[key]
            elif key.startswith("declined_"):
                name, labels = "loads_declined", {"reason": key[len("declined_"):]}
            elif key.startswith("saves_dropped_"):
                name, labels = "saves_dropped", {"reason": key[len("saves_dropped_"):]}
            else:
                name, labels = _clean(key), {}
            if value:
                self._series(engine_idx, "counter", name, labels).inc(value)
        used, total = data.get("gauge_slots_used"), data.get("gauge_slots_total")
        if used is not None and total:
            self._series(engine_idx, "gauge", "occupancy", {}).set(used / total)
        for direction, b, s in ((JobKind.SAVE.value, "bytes_saved", "save_seconds"),
                                (JobKind.LOAD.value, "bytes_loaded", "load_seconds")):
            if data.get(b) and data.get(s):
                self._series(engine_idx, "gauge", "transfer_gbps",
                             {"direction": direction}).set(data[b] / data[s] / 1e9)


def _clean(key: str) -> str:
    return _NAME_OK.sub("_", key)
