"""Eviction policies and admission, selectable by name (``KvtierConfig.policy``)."""

from __future__ import annotations

from kvtier.config import KvtierConfig
from kvtier.policy.admission import AdmitAll, SecondSight
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.lru import LRUPolicy
from kvtier.policy.s3fifo import S3FIFOPolicy
from kvtier.policy.slru import SLRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    "lru": LRUPolicy,
    "slru": SLRUPolicy,
    "s3fifo": S3FIFOPolicy,
}


def make_policy(name: str, capacity: int, config: KvtierConfig | None = None) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"unknown eviction policy {name!r}: choose one of {sorted(POLICIES)}")
    cfg = config or KvtierConfig()
    if name == "slru":
        return SLRUPolicy(capacity, protected_fraction=cfg.slru_protected_fraction)
    if name == "s3fifo":
        return S3FIFOPolicy(capacity, small_fraction=cfg.s3fifo_small_fraction)
    return LRUPolicy(capacity)


def make_admission(config: KvtierConfig) -> AdmitAll | SecondSight:
    if config.admission == "second_sight":
        return SecondSight(config.admission_memory)
    return AdmitAll()


__all__ = ["POLICIES", "AdmitAll", "EvictionPolicy", "LRUPolicy", "S3FIFOPolicy",
           "SLRUPolicy", "SecondSight", "make_admission", "make_policy"]
