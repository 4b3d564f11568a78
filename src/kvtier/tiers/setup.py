"""Opening the disk tier at start-up, in the scheduler process: checks, the lock, the index
rebuilt from the directory (warm restart), and the probe that seeds the cost model."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import ConfigError, KvtierConfig
from kvtier.geometry import Geometry
from kvtier.layout import GroupKind
from kvtier.log import get_logger
from kvtier.slab import SlabLayout
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost, probe
from kvtier.tiers.directory import DirectoryLock, check_disk_path, scan
from kvtier.tiers.disk import DiskChunkStore, file_bytes, namespace_dir
from kvtier.tiers.schedule import LowerTier
from kvtier.tiers.seam import ChunkStore

logger = get_logger("tiers")


@dataclass
class DiskTier:
    """The opened tier: what the scheduler gets, and the lock it holds until :meth:`close`."""

    lower: LowerTier
    lock: DirectoryLock
    rebuilt: int
    rebuild_seconds: float

    def close(self) -> None:
        self.lock.close()


def open_disk_tier(
    config: KvtierConfig, geometry: Geometry, namespace: bytes, slab_layout: SlabLayout,
    num_shards: int, store: Callable[[Path, int], ChunkStore] | None = None,
    allow_memory_fs: bool = False,
) -> DiskTier:
    """Raise :class:`ConfigError` with the reason if the tier cannot serve this engine.

    ``store`` (tests: a slowed disk) builds the store the start-up probe measures."""
    assert config.disk_path is not None and config.disk_size is not None
    others = [g.kind.value for g in geometry.groups if g.kind is not GroupKind.FULL]
    if others:
        raise ConfigError(
            f"kvtier setting disk_path: the disk tier keeps full-attention chunks only, and "
            f"this model also has {sorted(set(others))} KV-cache groups; unset disk_path")
    root = namespace_dir(config.disk_path, namespace)
    check_disk_path(config.disk_path, config.disk_size, root, allow_memory_fs=allow_memory_fs)
    lock = DirectoryLock(config.disk_path)
    try:
        chunk_bytes = [slab_layout.classes[c].slot_bytes for c in geometry.slot_classes]
        per_chunk = sum(file_bytes(b) for b in chunk_bytes) * num_shards
        capacity = config.disk_size // per_chunk
        if capacity < 1:
            raise ConfigError(
                f"kvtier setting disk_size: {config.disk_size} bytes hold no chunk "
                f"({per_chunk} bytes for one chunk of every group and shard)")
        t0 = time.perf_counter()
        catalog = TierCatalog(len(geometry.groups), capacity)
        found = scan(root, num_shards)
        rebuilt = catalog.rebuild(found)
        seconds = time.perf_counter() - t0
        make = store or (lambda r, shard: DiskChunkStore(r, shard, namespace))
        probe_store = make(root, 0)
        cost = probe(probe_store, chunk_bytes[0])
        probe_store.close()
    except BaseException:
        lock.close()
        raise
    logger.info(
        "kvtier disk tier at %s: %d chunks per group, %d found and kept (%.3f s; %d "
        "temporary files of a killed writer removed, %d foreign files ignored), probe %.2f "
        "GB/s and %.2f ms per chunk read", root, capacity, rebuilt, seconds,
        found.temporaries_removed, found.foreign_files, cost.gbps, cost.latency_s * 1e3)
    lower = LowerTier("disk", str(root), namespace, catalog, cost, chunk_bytes)
    return DiskTier(lower, lock, rebuilt, seconds)


__all__ = ["DiskTier", "TierCost", "open_disk_tier"]
