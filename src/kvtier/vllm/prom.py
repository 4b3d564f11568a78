"""kvtier's connector stats as Prometheus metrics on vLLM's ``/metrics``.

vLLM builds this in its API-server process through ``KvtierConnector.build_prom_metrics`` and
calls :meth:`KvtierPromMetrics.observe` with each engine step's stats payload: the dict of a
:class:`kvtier.vllm.stats.KvtierStats` (worker counters aggregated over ranks, plus the
scheduler half's counters). Contract:

- Keys without the ``gauge_`` prefix are counter *increments*; ``gauge_*`` keys are levels.
- Every key in the table of :mod:`kvtier.vllm.counters` maps to one series (a metric plus
  fixed labels); ``declined_<reason>`` and ``saves_dropped_<reason>`` map to a ``reason``
  label, ``tier_hits_<tier>``, ``tier_misses_<tier>`` and ``tier_hit_tokens_<tier>`` to a
  ``tier`` label. A key the table does not know still appears, as ``vllm:kvtier_<key>_total`` (or
  ``vllm:kvtier_<key>`` for a gauge), so new stats are never silently lost.
- ``obs_*`` keys are lists of observations, each observed once into its histogram
  (:data:`kvtier.vllm.counters.HISTOGRAMS`); an ``obs_`` key the table does not know is
  skipped.
- A series with a deprecated alias (:data:`kvtier.vllm.counters.DEPRECATED_LABELS`,
  ``direction="save"`` for ``store``) gets every value twice: under its label and the alias.
- ``vllm:kvtier_transfer_gbps{direction}`` (deprecated) is the throughput of the latest step
  that moved bytes in that direction; the per-job histogram
  ``vllm:kvtier_transfer_throughput_gbps`` and ``rate(vllm:kvtier_transfer_bytes_total[1m]) /
  rate(vllm:kvtier_transfer_seconds_total[1m])`` replace it.
- Every fixed series exists from start-up (value 0), per engine, so dashboards and scrapes
  see the full set before the first request.
"""

from __future__ import annotations

import re
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics

from kvtier.log import get_logger
from kvtier.vllm.counters import (
    BY_NAME,
    COUNTER,
    DEPRECATED_LABELS,
    DERIVED,
    GAUGE,
    GAUGE_PREFIX,
    HISTOGRAMS,
    METRICS,
    PREFIX,
    Histogram,
    series_of_key,
)

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

    def observe(self, *_: object) -> None:
        return None


_NULL = _Null()


class KvtierPromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict[type, type],
                 labelnames: list[str], per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._families: dict[tuple[str, tuple[str, ...]], Any] = {}
        self._children: dict[tuple[int, str, str, tuple[tuple[str, str], ...]], Any] = {}
        self._histograms: dict[tuple[int, str], Any] = {}  # (engine, obs key) -> child
        families = {h.name: self._histogram_family(h) for h in HISTOGRAMS}
        for engine in per_engine_labelvalues:
            for h in HISTOGRAMS:
                family = families[h.name]
                for series in h.series:
                    labels = h.labels(series)
                    self._histograms[(engine, series.key)] = family.labels(
                        *per_engine_labelvalues[engine], *labels.values())
            for m in METRICS:
                if m.reasons:
                    for reason in m.reasons:
                        self._series(engine, m.type, m.name, m.labels(reason))
                    continue
                for series in m.series:
                    self._series(engine, m.type, m.name, m.labels(series.label))

    def _histogram_family(self, h: Histogram) -> Any:
        extra = list(h.labels(h.series[0]))
        return self._histogram_cls(name=h.full_name, documentation=h.doc,
                                   labelnames=[*self._labelnames, *extra],
                                   buckets=list(h.buckets))

    def _series(self, engine: int, kind: str, name: str, labels: dict[str, str]) -> Any:
        """The child of metric ``vllm:kvtier_<name>`` for this engine and these labels, or,
        for a series with a deprecated alias, a child that feeds both."""
        alias = _alias(labels)
        child = self._one_series(engine, kind, name, labels)
        if alias is None:
            return child
        return _Both(child, self._one_series(engine, kind, name, alias))

    def _one_series(self, engine: int, kind: str, name: str, labels: dict[str, str]) -> Any:
        lk = tuple(sorted(labels.items()))
        child = self._children.get((engine, kind, name, lk))
        if child is not None:
            return child
        extra = tuple(k for k, _ in lk)
        family = self._families.get((kind, name, extra))
        if family is None:
            full = PREFIX + name
            known = BY_NAME.get(name)
            doc = known.doc if known is not None else f"kvtier {kind} {name}."
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
            if isinstance(value, list):
                hist = self._histograms.get((engine_idx, key))
                if hist is not None:
                    for v in value:
                        hist.observe(v)
                continue
            if not isinstance(value, int | float) or isinstance(value, bool):
                continue
            known = series_of_key(key)
            if key.startswith(GAUGE_PREFIX):
                name = known[0].name if known else _clean(key[len(GAUGE_PREFIX):])
                self._series(engine_idx, GAUGE, name, {}).set(value)
                continue
            if value < 0:
                continue  # counters only go up; a negative delta means a restarted source
            name, labels = (known[0].name, known[1]) if known else (_clean(key), {})
            if value:
                self._series(engine_idx, COUNTER, name, labels).inc(value)
        for m in METRICS:
            if m.source != DERIVED:
                continue
            for series in m.series:
                value = series.read(data)
                if value is not None:
                    self._series(engine_idx, m.type, m.name, m.labels(series.label)).set(value)


class _Both:
    """A series and its deprecated alias, moved together."""

    def __init__(self, series: Any, alias: Any) -> None:
        self.series, self.alias = series, alias

    def inc(self, value: float) -> None:
        self.series.inc(value)
        self.alias.inc(value)

    def set(self, value: float) -> None:
        self.series.set(value)
        self.alias.set(value)


def _alias(labels: dict[str, str]) -> dict[str, str] | None:
    for (label, value), old in DEPRECATED_LABELS.items():
        if labels.get(label) == value:
            return {**labels, label: old}
    return None


def _clean(key: str) -> str:
    return _NAME_OK.sub("_", key)
