"""Worker-side facts about the node-wide store, for tests (``LLM.collective_rpc``).

:func:`rpc_store_facts` says, on each rank, whether the worker's slab lies in the store's
pool: the slab's buffer inside a mapping of the store's memfd (``/memfd:kvtier-store-pool``
in ``/proc/self/maps``), so every copy the rank makes goes straight into the shared pool.
"""

from __future__ import annotations

from typing import Any

POOL_NAME = "/memfd:kvtier-store-pool"


def mapping_of(ptr: int) -> str:
    """The ``/proc/self/maps`` path column of the mapping holding address ``ptr``."""
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5].strip() if len(fields) > 5 else ""
    return ""


def rpc_store_facts(worker: Any) -> dict[str, Any]:
    """This rank: its rank, shards, bytes moved, and whether the first and last byte of its
    slab lie in the store's pool mapping."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    side = get_kv_transfer_group().worker_side
    w = side.worker
    buf = w.slab.buffer
    first, last = buf.data_ptr(), buf.data_ptr() + buf.numel() - 1
    return {"rank": w.rank, "shards": w.slab_layout.num_shards,
            "store_mapped": side.store_mapping is not None,
            "in_pool": all(mapping_of(p).startswith(POOL_NAME) for p in (first, last)),
            "bytes_stored": w.total_bytes_stored, "bytes_loaded": w.total_bytes_loaded}
