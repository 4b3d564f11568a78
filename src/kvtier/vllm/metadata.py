"""kvtier's objects inside vLLM's connector channels (pickled between processes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata

from kvtier.geometry import Geometry
from kvtier.protocol import StepPlan, WorkerReport

try:  # both 0.25.1 and 0.32 have it; keep the import soft for older releases
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
except ImportError:  # pragma: no cover
    KVConnectorWorkerMetadata = object  # type: ignore[misc,assignment]


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    plan: StepPlan = field(default_factory=StepPlan)
    geometry_known: bool = False


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):  # type: ignore[misc]
    """Workers -> scheduler, once per step, summed over workers by vLLM's aggregator."""

    report: WorkerReport = field(default_factory=WorkerReport)
    geometries: list[Geometry] = field(default_factory=list)  # the handshake, per rank
    ranks: int = 1
    load_errors: dict[int, str] = field(default_factory=dict)  # job id -> why it failed


    def aggregate(self, other: Any) -> KvtierWorkerMetadata:
        if not isinstance(other, KvtierWorkerMetadata):
            return self
        merged = KvtierWorkerMetadata(
            report=WorkerReport().add(self.report).add(other.report),
            geometries=self.geometries + other.geometries,
            ranks=self.ranks + other.ranks,
            load_errors={**self.load_errors, **other.load_errors},
        )
        return merged
