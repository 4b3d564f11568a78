"""A promised load that failed where vLLM has no report path for it: vLLM 0.25.1 with several
KV-cache groups (:func:`kvtier.vllm.compat.promised_loads_must_not_fail`; the design:
docs/notes/hybrid-loads-025.md).

There the worker re-issues a failed copy first (:mod:`kvtier.load_retry`); a load that still
fails reaches the scheduler side as finished (``finished_recving``, never
``invalid_block_ids``), and :func:`recover_or_stop` decides, in ``update_connector_output``
(which runs before the ``schedule()`` that promotes the request):

- every engine group is full attention and the local hit ``B`` is above 0: the request's
  ``num_computed_tokens`` goes back to ``B``, so vLLM caches ``B`` tokens' blocks and
  recomputes the rest into the blocks it holds, as a cold run with an HBM hit of ``B`` does
  (option (a) of the note, §3);
- anything else (a state or sliding-window group: null-padded tables that a recompute from
  ``B`` would read; or ``B == 0``, where vLLM frees blocks that a connector cannot): fail
  stop, :class:`LoadFailedAfterPromise` with the request id and the reason, because every
  other path there crashes later or corrupts silently.
"""

from __future__ import annotations

from typing import Any

from kvtier.layout import GroupKind
from kvtier.log import get_logger
from kvtier.protocol import WorkerReport
from kvtier.scheduler import OffloadScheduler
from kvtier.vllm.groups import EngineGroups

logger = get_logger("vllm.connector")


class LoadFailedAfterPromise(RuntimeError):
    """A promised load failed and vLLM 0.25.1 cannot recompute the request correctly."""


def truncation_recovers(groups: EngineGroups) -> bool:
    """Whether a recompute from the local hit leaves every group as a cold run would: every
    engine group is one of kvtier's full-attention groups (no null-padded table)."""
    return (len(groups.engine_ids) == groups.num_engine_groups
            and all(s.kind is GroupKind.FULL for s in groups.specs))


def completed_failures(scheduler: OffloadScheduler, report: WorkerReport
                       ) -> list[tuple[int, str, int]]:
    """(job id, request id, tokens promised) of every load that ``report`` completes (its
    last rank reports in it) with a failure on any rank; read before the scheduler takes the
    report, which forgets the job."""
    out = []
    for job_id, (ok, failed) in report.loads.items():
        js = scheduler.jobs.get(job_id)
        if js is None:
            continue  # unknown jobs are the scheduler's to refuse
        done = js.ok + js.failed + ok + failed == scheduler.world_size
        if done and js.failed + failed > 0:
            out.append((job_id, js.job.req_id, js.tokens))
    return out


def recover_or_stop(request: Any, promised_tokens: int, groups: EngineGroups,
                    reason: str) -> int:
    """Recover a failed promised load of vLLM request ``request`` (option (a)) and return the
    boundary it recomputes from; raise :class:`LoadFailedAfterPromise` where that is unsound."""
    req_id = request.request_id
    boundary = int(request.num_computed_tokens) - promised_tokens  # the local hit
    if truncation_recovers(groups) and boundary > 0:
        request.num_computed_tokens = boundary
        logger.warning("kvtier: the load of request %s failed (%s); it recomputes from its "
                       "local hit of %d tokens", req_id, reason, boundary)
        return boundary
    kinds = ", ".join(str(s.kind.value) for s in groups.specs)
    why = ("with a local hit of 0, where vLLM 0.25.1 frees blocks that a connector cannot"
           if boundary <= 0 else
           f"with KV-cache groups ({kinds}; {groups.num_engine_groups} in the engine) that "
           f"vLLM 0.25.1 cannot recompute from {boundary} tokens without reading null blocks")
    raise LoadFailedAfterPromise(
        f"kvtier: the load of request {req_id} failed after kvtier promised it ({reason}); "
        f"no correct recovery exists {why}: stopping rather than serving wrong KV "
        f"(vLLM >= 0.32 recovers it; docs/notes/hybrid-loads-025.md)")


def forget_recomputed_blocks(pool: Any, scheduler: OffloadScheduler, blocks: set[int]) -> int:
    """Drop from vLLM's prefix cache what a recomputed layer-by-layer load left there; how
    many blocks were asked.

    A synchronous load's blocks enter vLLM's prefix cache when they are allocated, and so do
    the blocks its step computes after them. When the load is recomputed (its blocks in
    ``invalid_block_ids``), vLLM's ``recompute`` policy keeps every one of them cached for
    the requests that recompute them (``v1/core/sched/scheduler.py``, ``_handle_invalid_blocks``
    on 0.25.1 and 0.32), but the recompute can take several steps (chunked prefill), and a
    request that arrives meanwhile hits them and reads KV nobody computed (found by the
    fault-injection harness: vLLM 0.32, two ranks, seed 1080). So every table that holds a
    recomputed block loses the cache entries of that block and all after it; the blocks stay
    with their requests (``BlockPool.evict_blocks``), only later hits on them are gone.
    Layer-by-layer loads act only for one KV-cache group: group 0's tables."""
    evict: set[int] = set()
    for st in scheduler.requests.values():
        table = st.block_ids[0] if st.block_ids else []
        for i, block in enumerate(table):
            if block in blocks:
                evict.update(b for b in table[i:] if b > 0)  # 0: vLLM's null block
                break
    evict.update(b for b in blocks if b > 0)
    if evict:
        pool.evict_blocks(evict)
    return len(evict)
