"""tests/_disk_loop.py's engine attached to a real store that has a disk tier: the
scheduler through :class:`~kvtier.store.index.StoreIndex` with the store's disk as its lower
tier (:func:`kvtier.store.promotions.store_lower`), every rank's slab in the store's pool,
glued as the connector glues them (the plan carries the epoch, the workers follow it, the
index polls after each plan). The store moves every disk byte; the workers none."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from _disk_loop import BLOCK, CHUNK, LAYERS, NUM_BLOCKS, Loop, Rank
from kvtier.config import KvtierConfig
from kvtier.index.memory import GroupIndexSpec
from kvtier.keys import Namespace
from kvtier.layout import GroupKind, GroupSpec, build_layout
from kvtier.protocol import WorkerReport
from kvtier.scheduler import OffloadScheduler, StepInput
from kvtier.slab import SlabLayout
from kvtier.store.attach import StoreMapping
from kvtier.store.client import StoreClient
from kvtier.store.index import StoreIndex, attach_spec, geometry_specs
from kvtier.store.promotions import store_lower
from kvtier.transfer import checksum_spec
from kvtier.worker import OffloadWorker


def store_config(**kw: object) -> KvtierConfig:
    # a promotion's bound far above what a loaded CI machine may need (the tests count
    # deferrals, not milliseconds)
    base: dict[str, object] = {"dram_size": "128KiB", "cost_model": False,
                               "prepare_timeout_ms": 30000, "prepare_max_steps": 100000,
                               "store_url": kw.pop("store_url")}
    return KvtierConfig.model_validate({**base, **kw})


class StoreRank(Rank):
    def __init__(self, cfg: KvtierConfig, rank: int, world: int, namespace: bytes) -> None:
        self.caches = {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 8) for n in LAYERS}
        layout = build_layout(self.caches, [GroupSpec(GroupKind.FULL, BLOCK, LAYERS)],
                              NUM_BLOCKS)
        probe = OffloadWorker(cfg, layout, CHUNK, rank=rank, world_size=world)
        geo, slab_layout = probe.geometry, probe.slab_layout
        probe.close()
        assert cfg.store_url is not None
        sums = checksum_spec(layout, geo) if cfg.verify_checksums else None  # as the connector
        self.mapping = StoreMapping(StoreClient(cfg.store_url),
                                    attach_spec(namespace, geometry_specs(geo), slab_layout,
                                                geo, sums))
        self.worker = OffloadWorker(cfg, layout, CHUNK, rank=rank, world_size=world,
                                    slab_factory=self.mapping.slab)


class StoreLoop(Loop):
    """:class:`Loop` whose pool, index and disk are the store's."""

    def __init__(self, cfg: KvtierConfig, world: int = 1, model: str = "m") -> None:
        self.cfg = cfg
        probe = Rank(cfg.model_copy(update={"store_url": None}), 0, world, None)  # type: ignore[arg-type]
        geo = probe.worker.geometry
        probe.worker.close()
        ns = Namespace(model=model, layout_fingerprint=geo.fingerprint,
                       kv_cache_dtype="float32", chunk_tokens=CHUNK,
                       model_revision=cfg.model_revision, extra=cfg.namespace_extra).digest()
        self.ranks = [StoreRank(cfg, r, world, ns) for r in range(world)]  # type: ignore[misc]
        w = self.ranks[0].worker
        self.store_index: StoreIndex | None = None
        self.disk = None
        self.sched = OffloadScheduler(cfg, w.geometry, ns, w.slab_layout, world_size=world,
                                      lower=store_lower(ns, w.geometry),
                                      index_factory=self._index_factory(w.geometry))
        self.reports: list[WorkerReport] = []
        self._next_block = 0

    def _index_factory(self, geo: object) -> Callable[[Sequence[GroupIndexSpec], SlabLayout],
                                                      StoreIndex]:
        def make(specs: Sequence[GroupIndexSpec], layout: SlabLayout) -> StoreIndex:
            assert self.cfg.store_url is not None
            self.store_index = StoreIndex(StoreClient(self.cfg.store_url),
                                          attach_spec(self.sched_namespace(), specs, layout,
                                                      geo),  # type: ignore[arg-type]
                                          retry_seconds=0.2)
            return self.store_index

        return make

    def sched_namespace(self) -> bytes:
        return self.ranks[0].mapping.spec["namespace"]  # type: ignore[attr-defined, no-any-return]

    @property
    def index(self) -> StoreIndex:
        assert self.store_index is not None
        return self.store_index

    def step(self, step: StepInput | None = None, ranks: Sequence[int] | None = None) -> None:
        plan = self.sched.schedule_step(step or StepInput())
        plan.store_epoch = self.index.epoch if self.index.up else 0
        assert not plan.tiers  # the store moves the disk's bytes, never the workers
        total = WorkerReport()
        for r in self.ranks:
            w = r.worker
            assert r.mapping.follow(plan.store_epoch, w.drain)  # type: ignore[attr-defined]
            w.fence(plan)
            w.begin_step(plan)
            w.end_step(plan)
            w.drain()
            total.add(w.collect().report)
        self.reports.append(total)
        self.sched.on_report(total)
        self.index.poll()
        time.sleep(0.002)  # the store's tier thread runs between steps, as in a server

    def lookup(self, req: str, tokens: Sequence[int], max_steps: int = 20000
               ) -> tuple[int, int]:
        return super().lookup(req, tokens, max_steps)

    def disk_stats(self) -> dict[str, object]:
        s = self.index.disk_stats()
        assert s is not None, "the store has no disk tier for this namespace"
        return s

    def close(self) -> None:
        super().close()
        self.index.client.close()


def wait_for(cond: Callable[[], bool], timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not reached in time")
        time.sleep(0.01)
