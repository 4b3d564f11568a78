"""tests/_disk_loop.py's engine loop with both lower tiers, the disk and below it the remote
tier (DRAM -> disk -> remote), on real files and a real Redis server: several loops on one
server with their own disk directories are several hosts sharing one store."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from _disk_loop import CHUNK, Loop, Rank
from kvtier.config import KvtierConfig
from kvtier.keys import Namespace
from kvtier.protocol import WorkerReport
from kvtier.scheduler import OffloadScheduler
from kvtier.tiers.remote_schedule import RemoteTierScheduler
from kvtier.tiers.remote_setup import RemoteTier, open_remote_tier
from kvtier.tiers.schedule import TierScheduler
from kvtier.tiers.seam import ChunkStore, TierPlan
from kvtier.tiers.setup import open_disk_tier
from kvtier.worker import default_tier_store


def stack_config(disk_dir: Path, port: int, prefix: str, **kw: object) -> KvtierConfig:
    base: dict[str, object] = {
        "dram_size": "128KiB", "disk_path": str(disk_dir), "disk_size": "1MiB",
        "remote_url": f"redis://127.0.0.1:{port}", "remote_key_prefix": prefix,
        "remote_part_size": 4096, "remote_size": "4MiB", "cost_model": False,
        "remote_timeout_ms": 200}
    return KvtierConfig.model_validate({**base, **kw})


class StackLoop(Loop):
    def __init__(self, cfg: KvtierConfig, world: int = 1,
                 wrap_remote: Callable[[ChunkStore], ChunkStore] | None = None) -> None:
        """``wrap_remote``: wraps every remote store, the probe's and the workers' (a
        slowed server); the disk's stores are the real ones."""
        self.cfg = cfg
        make = default_tier_store(cfg)

        def store(plan: TierPlan, shard: int) -> ChunkStore:
            s = make(plan, shard)
            return wrap_remote(s) if wrap_remote is not None and plan.name == "remote" else s

        self.ranks = [Rank(cfg, r, world, store) for r in range(world)]
        w = self.ranks[0].worker
        ns = Namespace(model="m", layout_fingerprint=w.geometry.fingerprint,
                       kv_cache_dtype="float32", chunk_tokens=CHUNK,
                       model_revision=cfg.model_revision, extra=cfg.namespace_extra).digest()
        self.disk = open_disk_tier(cfg, w.geometry, ns, w.slab_layout, world)
        self.remote: RemoteTier = open_remote_tier(cfg, w.geometry, ns, w.slab_layout, world,
                                                   wrap=wrap_remote)
        self.sched = OffloadScheduler(cfg, w.geometry, ns, w.slab_layout, world_size=world,
                                      lower=[self.disk.lower, self.remote.lower])
        self.reports: list[WorkerReport] = []
        self._next_block = 0

    @property
    def on_disk(self) -> TierScheduler:
        t = self.sched.lower_tier("disk")
        assert t is not None and self.sched.tier is t  # the disk is right below DRAM
        return t

    @property
    def on_remote(self) -> RemoteTierScheduler:
        t = self.sched.lower_tier("remote")
        assert isinstance(t, RemoteTierScheduler)
        return t

    def close(self) -> None:
        super().close()
        self.remote.close()
