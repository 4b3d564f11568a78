"""The store's remote tier (``kvtier store --remote-url``): a Redis or Valkey server below the
store's pool (and below its disk, with ``--disk-path``), the engine's remote tier
(:mod:`kvtier.tiers.remote`) driven by the store process.

Contract:

- The settings are an engine's remote settings (``remote_url``, ``remote_cluster``,
  ``remote_username``/``remote_password``, ``remote_tls_*``, ``remote_key_prefix``,
  ``remote_size``, ``remote_timeout_ms``, ``remote_part_size``, ``remote_ttl_s``,
  ``remote_breaker_*``), checked as an engine's are (:class:`~kvtier.config.KvtierConfig`);
  the password comes from ``KVTIER_REMOTE_PASSWORD``, never a flag (a command line is
  visible to every user of the host).
- Keys are the engine's (:class:`~kvtier.tiers.remote.RemoteKeys`: prefix and the arena's
  namespace), so engines of one model find a store's chunks and a store finds theirs; a
  value is one shard's slot bytes then its checksum-table row, as on the store's disk.
- A server that does not answer at start is no error (logged; the breaker turns every call
  into a miss or a dropped write until it answers), as for an engine.
- Each namespace counts on ``remote_size`` times its arena's share of the pool.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Sequence

from kvtier.config import KvtierConfig
from kvtier.store.remote_settings import PASSWORD_ENV
from kvtier.tiers.catalog import TierCatalog
from kvtier.tiers.cost import TierCost
from kvtier.tiers.remote import RedisChunkStore
from kvtier.tiers.remote_client import describe
from kvtier.tiers.remote_directory import RemoteDirectory
from kvtier.tiers.remote_schedule import RemoteTierScheduler
from kvtier.tiers.remote_setup import MAX_CATALOG_CHUNKS, UNPROBED, remote_store
from kvtier.tiers.schedule import LowerTier

logger = logging.getLogger("kvtier.store")


class StoreRemote:
    """The store's remote server: its settings, checked at start; one tier per namespace."""

    def __init__(self, settings: dict[str, object]) -> None:
        """``settings``: the engine's remote settings (``SETTINGS``; ValueError if invalid)."""
        password = os.environ.get(PASSWORD_ENV)
        if password:
            settings = {**settings, "remote_password": password}
        self.config = KvtierConfig.model_validate(settings)
        assert self.config.remote_url is not None
        self._check_reachable()

    def describe(self) -> str:
        return describe(self.config)

    def _check_reachable(self) -> None:
        store = remote_store(self.config, os.urandom(16), 0)
        try:
            store.present(0, [b"probe"])
        except Exception as e:  # not fatal: the breaker serves misses until it answers
            logger.warning("kvtier store: the remote tier at %s does not answer (%s); its "
                           "reads are misses and its writes dropped until it does",
                           self.describe(), e)
        finally:
            store.close()

    def store(self, namespace: bytes, shard: int) -> RedisChunkStore:
        return remote_store(self.config, namespace, shard)

    def lower(self, namespace: bytes, num_groups: int, num_shards: int,
              chunk_bytes: Sequence[int], share: float) -> tuple[LowerTier, RemoteDirectory]:
        """A namespace's remote tier: write-through, demotion when it is alone below the
        pool, discovery of what other engines or an earlier store wrote."""
        per_chunk = sum(chunk_bytes) * num_shards
        capacity = max(1, min(MAX_CATALOG_CHUNKS,
                              int(self.config.remote_size * share) // per_chunk))
        directory = RemoteDirectory([self.store(namespace, s) for s in range(num_shards)])
        make = functools.partial(RemoteTierScheduler, directory=directory, query_wait_s=0.0)
        lower = LowerTier("remote", self.config.remote_key_prefix, namespace,
                          TierCatalog(num_groups, capacity),
                          TierCost(UNPROBED.gbps, UNPROBED.latency_s), chunk_bytes,
                          make_scheduler=make)
        logger.info("kvtier store: remote tier of a namespace at %s: %d chunks per group "
                    "counted on", self.describe(), capacity)
        return lower, directory
