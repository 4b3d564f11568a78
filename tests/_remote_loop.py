"""tests/_disk_loop.py's engine loop with the remote tier below DRAM instead of the disk:
several loops on one Redis server are several engines sharing one store."""

from __future__ import annotations

from _disk_loop import CHUNK, Loop, Rank
from kvtier.config import KvtierConfig
from kvtier.keys import Namespace
from kvtier.protocol import WorkerReport
from kvtier.scheduler import OffloadScheduler
from kvtier.tiers.remote_schedule import RemoteTierScheduler
from kvtier.tiers.remote_setup import RemoteTier, open_remote_tier, worker_store_factory
from kvtier.worker import TierStoreFactory


def remote_config(port: int, prefix: str, **kw: object) -> KvtierConfig:
    base: dict[str, object] = {"dram_size": "128KiB", "remote_url": f"redis://127.0.0.1:{port}",
                               "remote_key_prefix": prefix, "remote_part_bytes": 4096, "remote_size": "4MiB",
                               "cost_model": False, "remote_timeout_ms": 200}
    return KvtierConfig.model_validate({**base, **kw})


class RemoteLoop(Loop):
    def __init__(self, cfg: KvtierConfig, world: int = 1,
                 tier_store: TierStoreFactory | None = None) -> None:
        self.cfg = cfg
        store = tier_store or worker_store_factory(cfg)
        self.ranks = [Rank(cfg, r, world, store) for r in range(world)]
        w = self.ranks[0].worker
        ns = Namespace(model="m", layout_fingerprint=w.geometry.fingerprint,
                       kv_cache_dtype="float32", chunk_tokens=CHUNK,
                       model_revision=cfg.model_revision, extra=cfg.namespace_extra).digest()
        self.disk = None
        self.remote: RemoteTier = open_remote_tier(cfg, w.geometry, ns, w.slab_layout, world)
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
