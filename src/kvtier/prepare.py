"""Prepare before promise: the step of the lookup -> prepare -> complete lifecycle in which a
lookup defers (``None``, "ask again next step") while the bytes of a hit are made ready in
DRAM, so that what is promised can no longer fail.

One mechanism, two kinds of preparation job, any of them per request:

- a *promotion* (the disk and remote tiers, :mod:`kvtier.tiers.stack`): chunks DRAM lacks
  and a lower tier holds are read into reserved DRAM slots, verifying the tier's checksum,
  each from the topmost tier holding it (one job per tier, the promotion lands when all
  did); wherever a lower tier is configured;
- a *verify job* (:data:`~kvtier.protocol.JobKind.VERIFY`): every worker checks the hit's
  DRAM slots against their checksums, nothing is written; where vLLM has no way to hear of a
  load that fails after kvtier promised it (vLLM 0.25.1 with several KV-cache groups,
  docs/notes/hybrid-loads-025.md, option (b); :func:`kvtier.vllm.compat.promises_are_final`)
  and ``verify_checksums`` is on (``prepare_hits``).

Contract (:class:`~kvtier.scheduler.OffloadScheduler`):

1. ``lookup`` finds the DRAM hit as always. If a lower tier extends it and restoring through
   it pays, a promotion starts and the lookup defers. When the promotion lands, its chunks
   are in DRAM, verified by the tier's checksum and pinned as *prepared* (no eviction takes
   them before the promise); the next lookup finds the longer DRAM hit.
2. With ``prepare_hits`` a hit is promised only if every chunk it reads (every group's KV
   chunks and the boundary's state objects) is prepared; otherwise the lookup defers and,
   unless a job is in flight, plans a verify job over the chunks not yet prepared, which
   pins them. A chunk that failed (a checksum mismatch on any rank) is dropped from the
   index with what is unreachable without it; the next lookup finds the longest hit left.
3. One bound for both: a request defers for at most ``prepare_timeout_ms`` and
   ``prepare_max_steps`` engine steps from its first deferral. Past it the request goes on
   with what is already prepared: the DRAM hit without the promotion's chunks (without
   ``prepare_hits``), or, with it, the hit if every chunk of it is prepared, else no hit
   (declined ``prepare_timed_out``); it never defers again (``prepare_timeouts`` counts it).
   A job in flight still finishes (a promotion still lands, for later requests). A verify
   job that fails for another reason than a mismatch declines the hit (``prepare_failed``).
4. The pins end when the load is decided (``start_load`` takes its own), when the request
   finishes or its id is reused, or at the timeout; a job in flight then still finishes and
   its pins end with it.

Counters (:class:`~kvtier.scheduler.SchedulerStats`): ``prepares`` (verify jobs planned),
``prepare_deferrals`` (lookups answered None, whatever they waited for),
``prepare_timeouts``; the tier counts its promotions (``TierStats.promotions``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.index.base import Entry

ChunkRef = tuple[int, bytes]
"""(group, chunk key): one stored chunk or state object."""


@dataclass
class Preparation:
    """One request's preparation: started at ``started`` (the clock's seconds) in engine step
    ``step``; the verify job in flight (``job``) and the promotion in flight (``promotion``),
    None where none; the prepared chunks, pinned."""

    started: float
    step: int = 0
    job: int | None = None
    promotion: int | None = None
    promotion_tried: bool = False  # a request promotes at most once per lifecycle
    promoted_tokens: int = 0  # tokens a landed promotion added to the DRAM hit
    promoted_by: dict[str, int] = field(default_factory=dict)  # those tokens per lower tier
    timed_out: bool = False
    prepared: dict[ChunkRef, Entry] = field(default_factory=dict)

    @property
    def busy(self) -> bool:
        """A preparation job is in flight."""
        return self.job is not None or self.promotion is not None

    def past_bound(self, now: float, step: int, max_ms: float, max_steps: int) -> bool:
        return (now - self.started) * 1e3 > max_ms or step - self.step > max_steps

    def covers(self, live: dict[ChunkRef, Entry | None]) -> bool:
        """Whether every chunk of a hit (``live``: the index's entry for each now) is one
        this preparation prepared (the same entry, still pinned)."""
        return all(self.prepared.get(ref) is e and e is not None for ref, e in live.items())

    def missing(self, live: dict[ChunkRef, Entry | None]) -> list[ChunkRef]:
        return [ref for ref, e in live.items() if self.prepared.get(ref) is not e]
