"""Opening the remote tier at start-up: the client (kvtier.tiers.remote_client), the probe
that seeds the cost model, the catalog, the scheduler with write-through and discovery; and
the factory the workers build their stores with."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

from kvtier.config import ConfigError, KvtierConfig
from kvtier.geometry import Geometry
from kvtier.layout import GroupKind
from kvtier.log import get_logger
from kvtier.slab import SlabLayout
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost, probe
from kvtier.tiers.remote import RedisChunkStore, RemoteKeys
from kvtier.tiers.remote_client import connect, describe
from kvtier.tiers.remote_directory import RemoteDirectory
from kvtier.tiers.remote_schedule import RemoteTierScheduler
from kvtier.tiers.schedule import LowerTier
from kvtier.tiers.seam import ChunkStore, TierPlan

logger = get_logger("tiers")

MAX_CATALOG_CHUNKS = 1 << 20
"""Chunks per group the catalog tracks at most (its slots cost memory; the server's own
eviction bounds what it holds; chunks beyond are forgotten here, found again by lookups)."""

UNPROBED = TierCost(gbps=0.1, latency_s=0.05)
"""The cost assumed when the server did not answer the start-up probe (promotions pay only
for long prefixes until real reads refine it)."""


def remote_store(config: KvtierConfig, namespace: bytes, shard: int) -> RedisChunkStore:
    """One shard's store: its own client and breaker (one per process and shard)."""
    return RedisChunkStore(
        connect(config), RemoteKeys(config.remote_key_prefix, namespace), shard,
        config.remote_part_size,
        CircuitBreaker(config.remote_breaker_failures, config.remote_breaker_cooldown_ms / 1e3),
        ttl_s=config.remote_ttl_s)


def _worker_store(config: KvtierConfig, plan: TierPlan, shard: int) -> RedisChunkStore:
    return remote_store(config, plan.namespace, shard)


def worker_store_factory(config: KvtierConfig) -> functools.partial[RedisChunkStore]:
    """The workers' :data:`~kvtier.worker.TierStoreFactory` for the remote tier."""
    return functools.partial(_worker_store, config)


@dataclass
class RemoteTier:
    lower: LowerTier
    directory: RemoteDirectory

    def close(self) -> None:
        self.directory.close()


def open_remote_tier(config: KvtierConfig, geometry: Geometry, namespace: bytes,
                     slab_layout: SlabLayout, num_shards: int,
                     wrap: Callable[[ChunkStore], ChunkStore] | None = None) -> RemoteTier:
    """The remote tier of this engine. A server that does not answer is no start-up error
    (the breaker turns it into misses until it does); a model with non-attention groups is.
    ``wrap`` (tests: a slowed store) wraps the store the start-up probe measures."""
    assert config.remote_url is not None
    others = [g.kind.value for g in geometry.groups if g.kind is not GroupKind.FULL]
    if others:
        raise ConfigError(
            f"kvtier setting remote_url: the remote tier keeps full-attention chunks only, and "
            f"this model also has {sorted(set(others))} KV-cache groups; unset remote_url")
    chunk_bytes = [slab_layout.classes[c].slot_bytes for c in geometry.slot_classes]
    capacity = max(1, min(MAX_CATALOG_CHUNKS,
                          config.remote_size // (sum(chunk_bytes) * num_shards)))
    cost = _probe(config, chunk_bytes[0], wrap)
    directory = RemoteDirectory([remote_store(config, namespace, s) for s in range(num_shards)])
    make = functools.partial(RemoteTierScheduler, directory=directory)
    lower = LowerTier("remote", config.remote_key_prefix, namespace,
                      TierCatalog(len(geometry.groups), capacity), cost, chunk_bytes,
                      make_scheduler=make)
    logger.info("kvtier remote tier at %s: %d chunks per group counted on, probe %.2f GB/s "
                "and %.2f ms per chunk read", describe(config), capacity, cost.gbps,
                cost.latency_s * 1e3)
    return RemoteTier(lower, directory)


def _probe(config: KvtierConfig, chunk_bytes: int,
           wrap: Callable[[ChunkStore], ChunkStore] | None) -> TierCost:
    # under a namespace of its own: engines probing one server at once never meet
    store: ChunkStore = remote_store(config, os.urandom(16), 0)
    if wrap is not None:
        store = wrap(store)
    try:
        return probe(store, chunk_bytes)
    except Exception as e:
        logger.warning("kvtier remote tier at %s did not answer the start-up probe (%s); "
                       "assuming %.2f GB/s until reads measure it", describe(config),
                       type(e).__name__, UNPROBED.gbps)
        return TierCost(UNPROBED.gbps, UNPROBED.latency_s)
    finally:
        store.close()
