"""kvtier's counters as vLLM connector stats.

Counters are deltas since the last collection and add up across workers and steps; keys
starting with ``gauge_`` are levels (slab occupancy) and keep the newest value; keys starting
with ``obs_`` are lists of observations for the histograms and are concatenated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

GAUGE = "gauge_"
OBS = "obs_"
MAX_OBSERVATIONS = 4096
"""Per key, kept between two collections: with vLLM's stats off nobody collects them."""


@dataclass
class KvtierStats(KVConnectorStats):
    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KvtierStats:
        for k, v in (other.data or {}).items():
            if k.startswith(GAUGE):
                self.data[k] = v
            elif isinstance(v, list):
                self.data[k] = [*self.data.get(k, []), *v]
            else:
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        """The logged summary: counters and gauges, GB/s per direction, and each list of
        observations as its count and mean."""
        out: dict[str, int | float] = {}
        for k, v in self.data.items():
            if isinstance(v, list):
                if v:
                    out[f"{k}_count"] = len(v)
                    out[f"{k}_mean"] = round(sum(v) / len(v), 6)
            else:
                out[k] = v
        for done, direction in (("stored", "store"), ("loaded", "load")):
            b = self.data.get(f"bytes_{done}", 0)
            s = self.data.get(f"{direction}_seconds", 0.0)
            if b and s:
                out[f"gbps_{done}"] = round(b / s / 1e9, 3)
        return out

    def is_empty(self) -> bool:
        return not any(v for k, v in self.data.items() if not k.startswith(GAUGE))


def add_observations(into: dict[str, list[float]], more: dict[str, list[float]]) -> None:
    """Append each key's observations of ``more`` to ``into``, keeping the newest
    :data:`MAX_OBSERVATIONS` of each."""
    for k, v in more.items():
        kept = into.setdefault(k, [])
        kept.extend(v)
        if len(kept) > MAX_OBSERVATIONS:
            del kept[: len(kept) - MAX_OBSERVATIONS]


def stats_payload(counts: dict[str, Any], before: dict[str, Any]) -> dict[str, Any]:
    """What one stats collection sends: counter deltas since ``before`` (unchanged ones left
    out) and every ``gauge_`` level. One pass: it runs every engine step."""
    delta: dict[str, Any] = {}
    gauges: dict[str, Any] = {}
    for k, v in counts.items():
        if k.startswith(GAUGE):
            gauges[k] = v
        else:
            was = before.get(k, 0)
            if v != was:
                delta[k] = v - was
    delta.update(gauges)
    return delta
