"""An engine's two halves attached to a real store (:class:`kvtier.testing.store_process.
StoreProcess`) (the scheduler through :class:`~kvtier.store.index.StoreIndex`, the worker's slab in
the store's pool), wired as tests/_tier.py wires the in-process tier."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV
from _tier import FULL_A, FULL_B, Tier, prompt
from kvtier.geometry import Geometry
from kvtier.index.memory import GroupIndexSpec
from kvtier.scheduler import OffloadScheduler, StepInput
from kvtier.slab import Pinner, SlabLayout
from kvtier.store.attach import StoreMapping
from kvtier.store.client import StoreClient
from kvtier.store.index import StoreIndex, attach_spec, geometry_specs
from kvtier.testing.store_process import SRC, StoreProcess
from kvtier.transfer import ChunkMover, TransferEngine
from kvtier.worker import OffloadWorker, StepResult

EngineFactory = Callable[[ChunkMover], TransferEngine]


class StoreTier(Tier):
    """:class:`Tier` with both halves attached to the store at ``url``, glued as an engine
    glues them: the plan carries the index's epoch, the worker follows it, the index polls
    for the store after each plan."""

    def __init__(self, url: str, seed: int = 0, namespace: bytes = b"t" * 16,
                 retry_seconds: float = 0.2, timeout: float = 2.0,
                 pinner: Pinner | None = None, engine_factory: EngineFactory | None = None,
                 config: dict[str, Any] | None = None) -> None:
        """``pinner``: the worker's (the store's pool is pinned with it, as on a GPU);
        ``engine_factory``: its transfer engine (default the CPU one); ``config``: settings
        over the test's."""
        self.config = CONFIG.model_copy(update={"cost_model": False, **(config or {})})
        self.kv = SmallKV(seed=seed)
        self.url, self.namespace = url, namespace
        self._retry, self._timeout = retry_seconds, timeout
        self.store_index: StoreIndex | None = None
        geo = Geometry.of_layout(self.kv.layout, CHUNK_TOKENS)
        specs = geometry_specs(geo)
        layout = geo.slab_layout(self.config, 1)
        self.mapping = StoreMapping(StoreClient(url, timeout),
                                    attach_spec(namespace, specs, layout), pinner=pinner,
                                    pin_step=self.config.pin_step_size)
        self.worker = OffloadWorker(self.config, self.kv.layout, CHUNK_TOKENS,
                                    engine_factory=engine_factory,
                                    slab_factory=self.mapping.slab)
        self.sched = OffloadScheduler(self.config, self.worker.geometry, namespace,
                                      self.worker.slab_layout, index_factory=self._index)

    def _index(self, specs: Sequence[GroupIndexSpec], layout: SlabLayout) -> StoreIndex:
        self.store_index = StoreIndex(StoreClient(self.url, self._timeout),
                                      attach_spec(self.namespace, specs, layout),
                                      retry_seconds=self._retry)
        return self.store_index

    @property
    def index(self) -> StoreIndex:
        assert self.store_index is not None
        return self.store_index

    def step(self, step: StepInput | None = None) -> StepResult:
        plan = self.sched.schedule_step(step or StepInput())
        up = self.index.up  # the epoch and its pool, as the connector stamps them
        plan.store_epoch, plan.store_pool = (self.index.epoch, self.index.pool) if up else (0, None)
        w = self.worker
        ok = self.mapping.follow(plan.store_epoch, w.drain, w.engine.slab_moved,
                                 plan.store_pool)
        assert ok or self.mapping.pinner is not None, self.mapping.why  # unpinned: at once
        w.refusing = None if ok else self.mapping.why  # as the connector's worker side does
        w.fence(plan)
        w.begin_step(plan)
        w.end_step(plan)
        w.drain()
        res = w.collect()
        self.sched.on_report(res.report)
        self.index.poll()
        return res

    def close(self) -> None:
        self.mapping.close()
        super().close()
        self.index.client.close()


__all__ = ["SRC", "StoreProcess", "StoreTier"]


def restore_equal(engine: StoreTier, source: StoreTier, req: str, toks: list[int]) -> None:
    """``engine`` restores ``toks`` (96 tokens stored by ``source``) into FULL_B, bit-equal to
    ``source``'s FULL_A blocks, then finishes the request."""
    n, res = engine.restore(req, toks)
    assert n == 96 and not res.failed_loads
    for i, blk in enumerate(FULL_B[:6]):
        for x, y in zip(engine.kv.attn_block(blk), source.kv.attn_block(FULL_A[i])):
            assert torch.equal(x, y)
    engine.sched.request_finished(req)
    engine.step()


def restart(store: StoreProcess, t: StoreTier) -> None:
    """Kill the store, let ``t`` notice, start it again (an empty pool) and let ``t``'s
    scheduler half attach to it: the next plan names the new epoch."""
    epoch = t.index.epoch
    store.kill()
    req = f"probe-{epoch}"  # a lookup finds the store gone (an idle step asks it nothing)
    t.sched.add_request(req)
    assert t.sched.lookup(req, prompt(99), 0) == 0
    t.sched.request_finished(req)
    t.step()
    assert not t.index.up
    store.start()
    deadline = time.monotonic() + 10
    while t.index.epoch == epoch and time.monotonic() < deadline:
        time.sleep(0.1)
        t.step()
    assert t.index.up and t.index.epoch == epoch + 1
