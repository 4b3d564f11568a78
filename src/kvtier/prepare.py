"""Prepare before promise: the step of the lookup -> prepare -> complete lifecycle in which a
lookup defers while the workers ready a hit's chunks, so that what is promised can no longer
fail.

Where it is used: where vLLM has no way to hear of a load that fails after kvtier promised it
(vLLM 0.25.1 with several KV-cache groups, docs/notes/hybrid-loads-025.md, option (b); the
connector's compat layer decides, :func:`kvtier.vllm.compat.promises_are_final`). Today the
preparation is a *verify job* (:data:`~kvtier.protocol.JobKind.VERIFY`: every worker checks
the hit's slots against their checksums on the host, nothing is written); the disk tier will
reuse the same step to promote chunks from disk into DRAM before the promise.

Contract (:class:`~kvtier.scheduler.OffloadScheduler` with ``prepare_hits``):

1. ``lookup`` finds a hit as always. If the hit's chunks (every group's KV chunks the load
   reads and the boundary's state objects) are all prepared, it is promised. Otherwise the
   lookup answers ``None`` ("ask again next step") and, unless one is in flight, plans a
   preparation job over the chunks not yet prepared, which pins them.
2. Each chunk of a finished preparation is either prepared (it stays pinned, so it cannot be
   evicted, reset into another slot or rewritten before the promise) or, when it failed
   (a checksum mismatch on any rank), dropped from the index with what is unreachable without
   it. The next lookup finds the longest hit left and promises it only if all of its chunks
   are prepared (a lower boundary needs other window chunks and another state: those are
   prepared first).
3. Bounded: a request defers for at most ``prepare_timeout_ms`` from its first deferral; then
   it goes on with no hit (declined ``prepare_timed_out``) and never defers again. A job that
   fails for another reason than a mismatch declines the hit (``prepare_failed``).
4. The pins end when the load is decided (``start_load`` takes its own), when the request
   finishes or its id is reused, or at the timeout; a job in flight then still finishes and
   its pins end with it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.index.base import Entry

ChunkRef = tuple[int, bytes]
"""(group, chunk key): one stored chunk or state object."""


@dataclass
class Preparation:
    """One request's preparation: started at ``started`` (the clock's seconds), the job in
    flight (None: none), and the prepared chunks, pinned."""

    started: float
    job: int | None = None
    prepared: dict[ChunkRef, Entry] = field(default_factory=dict)

    def covers(self, live: dict[ChunkRef, Entry | None]) -> bool:
        """Whether every chunk of a hit (``live``: the index's entry for each now) is one
        this preparation prepared (the same entry, still pinned)."""
        return all(self.prepared.get(ref) is e and e is not None for ref, e in live.items())

    def missing(self, live: dict[ChunkRef, Entry | None]) -> list[ChunkRef]:
        return [ref for ref, e in live.items() if self.prepared.get(ref) is not e]
