"""Where the bench's host bytes live (``kvtier bench transfer --host-pool``), so one run of the
same cells compares the pools a worker can copy into:

- ``pinned``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc), the bench's historical pool;
- ``slab``: the in-process pool of an engine without a store: a :class:`~kvtier.slab.HostSlab`
  (private memory, then ``cudaHostRegister`` in ``pin_step`` pieces);
- ``store``: the node-wide store's pool: a private ``kvtier store`` process is started, the
  bench attaches as a worker does (the memfd over SCM_RIGHTS, the whole pool mapped), and its
  arena is registered the same way (:func:`kvtier.store.attach.store_slab`).

:func:`host_pool` yields the uint8 tensor and what setting it up cost (``map_s``, ``pin_s``);
without CUDA (``--smoke``) nothing is pinned and the rest runs as on the GPU host.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

POOLS = ("pinned", "slab", "store")
SLOT = 2 * 2**20  # the pool's slot size: the bench addresses its bytes itself
PIN_STEP = 2**30


def _pinner(cuda: bool) -> Any:
    if not cuda:
        return None
    from kvtier.gpu.pinning import CudaPinner

    return CudaPinner()


def _layout(nbytes: int) -> Any:
    """A slab layout of 2 MiB slots whose buffer holds at least ``nbytes`` (a layout also
    keeps room for its tables, so ask for more until it holds them)."""
    from kvtier.slab import lay_out_slab

    budget = -(-nbytes // SLOT) * SLOT
    while (layout := lay_out_slab(budget, [SLOT])).total_bytes < nbytes:
        budget += -(-(nbytes - layout.total_bytes) // SLOT) * SLOT
    return layout


@contextlib.contextmanager
def host_pool(kind: str, nbytes: int, cuda: bool) -> Iterator[tuple[Any, dict[str, Any]]]:
    """At least ``nbytes`` of host memory of pool ``kind`` (module docstring), and its
    set-up times; released (unregistered, unmapped, the store stopped) on exit."""
    import torch

    from kvtier.slab import HostSlab

    if kind not in POOLS:
        raise ValueError(f"--host-pool {kind!r}: one of {', '.join(POOLS)}")
    if kind == "pinned":
        t0 = time.perf_counter()
        buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        yield buf, {"pool": kind, "alloc_s": time.perf_counter() - t0}
        return
    layout = _layout(nbytes)
    if kind == "slab":
        t0 = time.perf_counter()
        slab = HostSlab(layout, pinner=_pinner(cuda), pin_step=PIN_STEP)
        try:
            yield slab.buffer, {"pool": kind, "pin_s": time.perf_counter() - t0}
        finally:
            slab.close()
        return
    with _store_slab(layout, cuda) as (slab, info):
        yield slab.buffer, info


@contextlib.contextmanager
def _store_slab(layout: Any, cuda: bool) -> Iterator[tuple[Any, dict[str, Any]]]:
    from kvtier.index.memory import GroupIndexSpec
    from kvtier.store.attach import MapTiming, store_slab
    from kvtier.store.client import StoreClient
    from kvtier.store.index import attach_spec
    from kvtier.store.pool import ARENA_ALIGN
    from kvtier.testing.store_process import StoreProcess

    size_mib = -(-(layout.total_bytes + 2 * ARENA_ALIGN) // 2**20)
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        store = StoreProcess(Path(d), size=f"{size_mib}MiB").start(timeout=600)
        start_s = time.perf_counter() - t0
        try:
            client = StoreClient(store.url, timeout=60)
            spec = attach_spec(b"kvtier-bench-transfer",
                               [GroupIndexSpec(0, None, True, False)],  # type: ignore[arg-type]
                               layout)
            att = client.connect(spec)
            timing = MapTiming()
            slab = store_slab(layout, att, pinner=_pinner(cuda), pin_step=PIN_STEP,
                              timing=timing)
            try:
                yield slab, {"pool": "store", "store_start_s": start_s,
                             "map_s": timing.map_seconds, "pin_s": timing.pin_seconds,
                             "store_line": store.ready_line}
            finally:
                slab.close()
                client.close()
        finally:
            store.stop()
