"""The connector's link to the node-wide store (``store_url``, :mod:`kvtier.store`).

Scheduler side: :func:`store_index_factory` gives the scheduler a
:class:`~kvtier.store.index.StoreIndex` (and :func:`kvtier.store.promotions.store_lower` its
lower tier: the store's disk); :func:`stamp_plan` puts the index's epoch on each
step's plan, then polls for a lost store (after the plan: one epoch per step). Worker side:
:func:`worker_mapping` places the slab in the store's pool (every rank maps the one pool:
TP ranks share it as they share a /dev/shm segment without a store);
:meth:`~kvtier.store.attach.StoreMapping.follow` moves it on a new epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.geometry import Geometry
from kvtier.index.memory import GroupIndexSpec
from kvtier.keys import Namespace
from kvtier.layout import Layout
from kvtier.protocol import StepPlan
from kvtier.slab import Pinner, SlabLayout
from kvtier.store.attach import StoreMapping
from kvtier.store.client import StoreClient
from kvtier.store.index import StoreIndex, attach_spec, geometry_specs
from kvtier.transfer import checksum_spec
from kvtier.vllm.setup import ConnectorSetup


def engine_namespace(setup: ConnectorSetup, geometry: Geometry) -> bytes:
    """The key namespace of this engine (both halves compute it alike)."""
    return Namespace(
        model=setup.model_name, layout_fingerprint=geometry.fingerprint,
        kv_cache_dtype=setup.kv_cache_dtype, chunk_tokens=geometry.chunk_tokens,
        model_revision=setup.config.model_revision, tp_size=setup.tp_size,
        extra=setup.config.namespace_extra,
    ).digest()


def store_index_factory(setup: ConnectorSetup, namespace: bytes, geometry: Geometry
                        ) -> Callable[[Sequence[GroupIndexSpec], SlabLayout], StoreIndex]:
    url = setup.config.store_url
    assert url is not None

    def make(specs: Sequence[GroupIndexSpec], layout: SlabLayout) -> StoreIndex:
        return StoreIndex(StoreClient(url), attach_spec(namespace, specs, layout, geometry))

    return make


def stamp_plan(index: object, plan: StepPlan) -> StepPlan:
    if isinstance(index, StoreIndex):
        plan.store_epoch = index.epoch if index.up else 0
        plan.store_pool = index.pool if index.up else None
        index.poll()
    return plan


def loads_wait_for_epoch(index: object, mapped: int | None) -> bool:
    """Whether the scheduler half must promise no load from the store yet: its index is
    attached in an epoch that the workers have not reported mapping (``mapped``: the least
    epoch over ranks of their last report, -1 for a rank that maps none, None before any).

    Only where a promised load must not fail (vLLM 0.25.1 with several KV-cache groups,
    :mod:`kvtier.vllm.failed_loads`): there a load a worker refuses while it maps and pins a
    restarted store's pool (:meth:`kvtier.store.attach.StoreMapping.follow`: tens of
    seconds on a GPU) cannot be recomputed and stops the engine. Elsewhere a refused load is
    a recompute, and waiting would cost the first step's hits at every start-up: a request
    looked up before the first worker report (the engine's first step) is computed, as is
    every request while a restarted store's pool is being pinned."""
    return isinstance(index, StoreIndex) and index.up and index.epoch != mapped


def mapped_epoch(mapping: StoreMapping, refusing: str | None) -> int:
    """What a worker reports as the store epoch its slab maps (``WorkerReport.store_epoch``):
    the epoch of the plans it follows, or -1 while it maps none of them (before its first
    plan, while a new pool is mapped and pinned, or when the move failed: ``refusing``)."""
    return mapping.epoch if refusing is None and mapping.epoch > 0 else -1


def close_index(index: object) -> None:
    """End the store connection (the store releases what this engine still holds)."""
    if isinstance(index, StoreIndex):
        index.client.close()


def worker_mapping(setup: ConnectorSetup, geometry: Geometry, num_shards: int,
                   layout: Layout, pinner: Pinner | None = None) -> StoreMapping:
    """``layout``: the worker's KV layout (with ``verify_checksums`` the store learns how its
    slots are checksummed, and checks each before writing it to a tier). ``pinner``: the
    worker's (a KV cache on a GPU): the pool is pinned in ``pin_step_size`` pieces."""
    url = setup.config.store_url
    assert url is not None
    slab = geometry.slab_layout(setup.config, num_shards)
    sums = checksum_spec(layout, geometry) if setup.config.verify_checksums else None
    return StoreMapping(StoreClient(url), attach_spec(engine_namespace(setup, geometry),
                                                      geometry_specs(geometry), slab,
                                                      geometry, sums),
                        pinner=pinner, pin_step=setup.config.pin_step_size)
