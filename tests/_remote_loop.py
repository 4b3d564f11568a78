"""tests/_disk_loop.py's engine loop with the remote tier below DRAM instead of the disk:
several loops on one Redis server are several engines sharing one store."""

from __future__ import annotations

from collections.abc import Callable

from _disk_loop import CHUNK, Loop, Rank
from kvtier.config import KvtierConfig
from kvtier.keys import Namespace
from kvtier.protocol import WorkerReport
from kvtier.scheduler import OffloadScheduler
from kvtier.tiers.remote_schedule import RemoteTierScheduler
from kvtier.tiers.remote_setup import RemoteTier, open_remote_tier, worker_store_factory
from kvtier.tiers.seam import ChunkStore, TierPlan


def remote_config(port: int, prefix: str, **kw: object) -> KvtierConfig:
    base: dict[str, object] = {"dram_size": "128KiB", "remote_url": f"redis://127.0.0.1:{port}",
                               "remote_key_prefix": prefix, "remote_part_size": 4096, "remote_size": "4MiB",
                               "cost_model": False, "remote_timeout_ms": 200}
    return KvtierConfig.model_validate({**base, **kw})


class RemoteLoop(Loop):
    def __init__(self, cfg: KvtierConfig, world: int = 1,
                 wrap: Callable[[ChunkStore], ChunkStore] | None = None) -> None:
        """``wrap``: wraps every store, the probe's and the workers' (a slowed server)."""
        self.cfg = cfg
        make = worker_store_factory(cfg)

        def store(plan: TierPlan, shard: int) -> ChunkStore:
            s = make(plan, shard)
            return wrap(s) if wrap is not None else s

        self.ranks = [Rank(cfg, r, world, store) for r in range(world)]
        w = self.ranks[0].worker
        ns = Namespace(model="m", layout_fingerprint=w.geometry.fingerprint,
                       kv_cache_dtype="float32", chunk_tokens=CHUNK,
                       model_revision=cfg.model_revision, extra=cfg.namespace_extra).digest()
        self.disk = None
        self.remote: RemoteTier = open_remote_tier(cfg, w.geometry, ns, w.slab_layout, world,
                                                   wrap=wrap)
        self.sched = OffloadScheduler(cfg, w.geometry, ns, w.slab_layout, world_size=world,
                                      lower=self.remote.lower)
        self.reports: list[WorkerReport] = []
        self._next_block = 0

    @property
    def tier(self) -> RemoteTierScheduler:
        assert isinstance(self.sched.tier, RemoteTierScheduler)
        return self.sched.tier

    def close(self) -> None:
        super().close()
        self.remote.close()
