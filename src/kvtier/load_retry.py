"""Loads that are re-issued before they are reported failed.

Where an engine cannot take a failed load back once kvtier promised it (vLLM 0.25.1 with
several KV-cache groups: docs/notes/hybrid-loads-025.md §4 item 4), a failed copy is retried
from the slab copy, which stays pinned until the job is reported: :class:`RetryingLoads` wraps
any :class:`~kvtier.transfer.TransferEngine` and re-submits a load whose completion says it
failed, up to ``retries`` times, before it lets the failure through. Saves are never retried
(a failed save is only a chunk not stored).

Contracts:
- A load is reported at most once as failed, after ``retries`` re-issues that all failed; a
  success at any attempt is reported as a plain success.
- Only the wrapper's own bookkeeping decides: a duplicate notice of an earlier failed attempt
  may cost one more re-issue (bounded by ``retries``), never a lost or a second report (the
  worker drops completions of jobs it no longer has in flight).
- The reason of every load that still failed stays readable (:meth:`take_errors`) until taken.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.log import get_logger
from kvtier.protocol import Job, JobKind
from kvtier.transfer import (
    ChunkMover,
    Completion,
    EngineWrapper,
    ThreadedTransferEngine,
    TransferEngine,
)

LOAD_RETRIES = 2
"""Re-issues of a failed load before it is reported (3 attempts in all)."""

logger = get_logger("worker")


class RetryingLoads(EngineWrapper):
    def __init__(self, inner: TransferEngine, retries: int = LOAD_RETRIES) -> None:
        super().__init__(inner)
        self.retries = retries
        self._loads: dict[int, tuple[Job, int]] = {}  # job id -> (job, re-issues so far)
        self._errors: dict[int, str] = {}  # job id -> why its last attempt failed
        self.reissued = 0  # re-issues, ever

    def load(self, job: Job) -> None:
        self._loads[job.job_id] = (job, 0)
        self.inner.load(job)

    # verify jobs pass through (EngineWrapper): a check is not a copy, never re-issued

    def poll(self) -> list[Completion]:
        return [c for c in self.inner.poll() if not self._reissued(c)]

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return [c for c in self.inner.query(job_ids) if not self._reissued(c)]

    def _reissued(self, c: Completion) -> bool:
        """Re-issue a failed load with attempts left (True: the completion is swallowed),
        unless it failed on a checksum mismatch; forget a load once its completion goes
        through."""
        entry = self._loads.get(c.job_id) if c.kind is JobKind.LOAD else None
        if entry is None:
            return False
        job, done = entry
        if not c.ok and not c.corrupt and done < self.retries:  # corrupt bytes stay corrupt
            self._loads[c.job_id] = (job, done + 1)
            self.reissued += 1
            logger.warning("kvtier: load job %d failed (%s); re-issued from the slab copy "
                           "(attempt %d of %d)", c.job_id, c.error or "no reason given",
                           done + 2, self.retries + 1)
            self.inner.load(job)
            return True
        del self._loads[c.job_id]
        if not c.ok:
            self._errors[c.job_id] = c.error or "no reason given"
        return False

    def take_errors(self) -> dict[int, str]:
        """Why each load reported failed since the last call failed (its last attempt)."""
        errors, self._errors = self._errors, {}
        return errors

    def drain(self) -> None:
        """The inner engine's drain: a load re-issued by a later poll runs after it."""
        self.inner.drain()


def retrying_factory(inner: Callable[[ChunkMover], TransferEngine] | None,
                     retries: int = LOAD_RETRIES) -> Callable[[ChunkMover], RetryingLoads]:
    """An engine factory whose engines re-issue failed loads around what ``inner`` makes
    (default: the CPU engine)."""

    def make(mover: ChunkMover) -> RetryingLoads:
        engine = inner(mover) if inner is not None else ThreadedTransferEngine(mover)
        return RetryingLoads(engine, retries)

    return make
