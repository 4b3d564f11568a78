"""Where the bench's host bytes live (``kvtier bench transfer --host-pool``), so one run of the
same cells compares the pools a worker can copy into:

- ``pinned``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc), the bench's historical pool;
- ``slab``: the in-process pool of an engine without a store: a :class:`~kvtier.slab.HostSlab`
  (private memory, then ``cudaHostRegister`` in ``pin_step`` pieces);
- ``store``: the node-wide store's pool: a private ``kvtier store`` process is started, the
  bench attaches as a worker does (the memfd over SCM_RIGHTS, the whole pool mapped), and its
  arena is registered the same way (:func:`kvtier.store.attach.store_slab`);
- ``memfd``: the store's kind of memory without the store: a memfd this process creates and
  reserves (:func:`kvtier.store.pool.create_pool_fd`), mapped shared and registered the same
  way. Between ``slab`` and ``store`` it separates shared-memory pages from another process
  having faulted them in.

Every pool is registered in one piece (``pin_step`` = the whole buffer): the bench addresses
the buffer's bytes itself, across the 2 MiB slots of its layout, so a piece of a size that does
not divide 1 GiB (MLA's 73,728 bytes) could straddle two registrations, which
``cuMemcpyBatchAsync`` refuses (H200, 2026-12-01). An engine's slab never straddles: its
registrations never split a slot (:func:`kvtier.slab.pin_ranges`).

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

POOLS = ("pinned", "slab", "store", "memfd")
SLOT = 2 * 2**20  # the pool's slot size: the bench addresses its bytes itself


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
    if kind in ("slab", "memfd"):
        t0 = time.perf_counter()
        region = _memfd_region(layout.total_bytes) if kind == "memfd" else None
        map_s = time.perf_counter() - t0
        slab = HostSlab(layout, region=region, pinner=_pinner(cuda),
                        pin_step=layout.total_bytes)
        try:
            yield slab.buffer, {"pool": kind, "map_s": map_s,
                                "pin_s": time.perf_counter() - t0 - map_s,
                                **huge_pages(slab.buffer.data_ptr())}
        finally:
            slab.close()
        return
    with _store_slab(layout, cuda) as (slab, info):
        yield slab.buffer, info


def huge_pages(ptr: int, smaps: str = "/proc/self/smaps") -> dict[str, Any]:
    """The mapping holding ``ptr``, from ``smaps``: its size and how much of it is mapped by
    huge pages (``AnonHugePages`` for private memory, ``ShmemPmdMapped`` for shared memory),
    in kB: the one page-size difference between the pools that the kernel shows. Empty where
    smaps cannot be read."""
    fields = ("Size", "AnonHugePages", "ShmemPmdMapped", "FilePmdMapped")
    found: dict[str, Any] = {}
    try:
        with open(smaps) as f:
            inside = False
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    if inside:
                        break
                    inside = lo <= ptr < hi
                    if inside:
                        parts = line.split(None, 5)
                        found["mapping"] = parts[5].strip() if len(parts) > 5 else "[anonymous]"
                elif inside and head.rstrip(":") in fields:
                    found[head.rstrip(":") + "_kB"] = int(line.split()[1])
    except (OSError, ValueError):
        return {}
    return {"smaps": found} if found else {}


def _memfd_region(nbytes: int) -> tuple[Any, int]:
    """A reserved memfd of ``nbytes`` mapped shared (the fd is closed: the mapping keeps it)."""
    import os

    from kvtier.store.pool import create_pool_fd, map_pool

    fd = create_pool_fd(nbytes)
    try:
        return map_pool(fd, nbytes), 0
    finally:
        os.close(fd)


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
            slab = store_slab(layout, att, pinner=_pinner(cuda),
                              pin_step=layout.total_bytes, timing=timing)
            try:
                yield slab, {"pool": "store", "store_start_s": start_s,
                             "map_s": timing.map_seconds, "pin_s": timing.pin_seconds,
                             "store_line": store.ready_line,
                             **huge_pages(slab.buffer.data_ptr())}
            finally:
                slab.close()
                client.close()
        finally:
            store.stop()
