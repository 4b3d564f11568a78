"""TEST ONLY: switch verified restores off and on in a running worker, so one engine process
can measure their cost in alternating phases (``tools/gpu_shared_prefix.py --verify-ab``).
Never used in production: nothing a user configures reaches this module.

An engine built with ``verify_checksums`` on has what checking needs (tile tables, staging);
switched off, saves store no checksums and loads compare none. Switch only while nothing is
in flight, and let a phase load only chunks it saved itself (fresh prompts per phase): a
chunk saved while off has no checksum, so a load of it while on fails, as it should.
"""

from __future__ import annotations

from typing import Any


def set_verify(engine: Any, on: bool) -> int:
    """Set verification on every engine of a wrapper chain (``inner``) and on its mover;
    returns how many objects were switched."""
    n = 0
    while engine is not None:
        if hasattr(engine, "verify_sums"):
            engine.verify_sums = on
            n += 1
        mover = getattr(engine, "mover", None)
        if mover is not None and hasattr(mover, "verify"):
            mover.verify = on
            n += 1
        engine = getattr(engine, "inner", None)
    return n


def rpc_set_verify(vllm_worker: Any, on: bool) -> int:
    """:func:`set_verify` on this worker process's kvtier engine (for ``collective_rpc``)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side.worker
    return set_verify(worker.engine, on)
