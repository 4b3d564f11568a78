"""TEST ONLY: corrupt a stored chunk in host memory, to prove that verified restores catch it
(issue 12 item 10). Never used in production: nothing a user configures reaches this module.

Two halves, because the scheduler knows where a chunk lives and the workers own its bytes:

- :func:`slot_of_chunk` (scheduler side, in the engine-core process): the (slot class, slot)
  holding chunk ``j`` of ``group`` for a token prefix, from the index;
- :func:`flip_stored_byte` (worker side): flip one bit of one byte of that slot in this rank's
  shard (or another), through an :class:`~kvtier.worker.OffloadWorker`;
  :func:`rpc_flip_stored_byte` is the same for ``LLM.collective_rpc`` (it finds the worker
  through vLLM's connector in each worker process), and :func:`flip_chunk` does both halves
  for an in-process engine (:class:`kvtier.testing.restore.EngineHandles`).

The flip goes around every transfer engine (a plain write to the slab), after the chunk's
save completed, which is what a bad DIMM, a stray write or a bug in the tier would do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvtier.keys import RequestKeys
from kvtier.scheduler import OffloadScheduler
from kvtier.worker import OffloadWorker


def slot_of_chunk(scheduler: OffloadScheduler, tokens: Sequence[int], chunk: int,
                  group: int = 0, cache_salt: str | None = None) -> tuple[int, int]:
    """The (slot class, slot) of the stored chunk ``chunk`` of ``group`` for a request whose
    tokens start with ``tokens`` (KeyError if it is not stored)."""
    keys = RequestKeys(scheduler.namespace, scheduler.geometry.chunk_tokens, cache_salt)
    keys.update(tokens)
    if chunk >= len(keys.keys):
        raise KeyError(f"the tokens have {len(keys.keys)} whole chunks, not {chunk + 1}")
    entry = scheduler.index.get(group, keys.keys[chunk])
    if entry is None or not entry.ready:
        raise KeyError(f"chunk {chunk} of group {group} is not stored")
    return scheduler.slot_class[group], entry.slot


def flip_stored_byte(worker: OffloadWorker, slot_class: int, slot: int, offset: int = 0,
                     bit: int = 0, shard: int | None = None) -> int:
    """Flip bit ``bit`` of byte ``offset`` of a stored slot in ``shard`` (default: the
    worker's own). Waits for the worker's transfers first, so the flip lands after a save in
    flight. Returns the byte's new value."""
    worker.drain()
    shard = worker.mover.shard if shard is None else shard
    view = worker.slab.view(slot_class, slot, shard)
    view[offset] ^= 1 << bit
    return int(view[offset])


def rpc_flip_stored_byte(vllm_worker: Any, slot_class: int, slot: int, offset: int = 0,
                         bit: int = 0, rank: int | None = None) -> bool:
    """For ``LLM.collective_rpc``: :func:`flip_stored_byte` on every rank, or only on
    ``rank``; True where a byte was flipped."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    worker = get_kv_transfer_group().worker_side.worker
    if worker is None or (rank is not None and worker.rank != rank) or not worker.writes:
        return False
    flip_stored_byte(worker, slot_class, slot, offset, bit)
    return True


def flip_chunk(handles: Any, tokens: Sequence[int], chunk: int, group: int = 0,
               offset: int = 0, rank: int | None = None) -> tuple[int, int]:
    """Flip one byte of the slot holding chunk ``chunk`` of ``group`` of a prompt, for an
    engine whose engine core runs in this process (workers anywhere). Returns the slot."""
    cls, slot = slot_of_chunk(handles.kvtier, tokens, chunk, group)
    flipped = handles.llm.collective_rpc(rpc_flip_stored_byte, args=(cls, slot, offset, 0, rank))
    if not any(flipped):
        raise RuntimeError("no worker flipped a byte")
    return cls, slot
