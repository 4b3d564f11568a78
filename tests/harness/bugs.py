"""Planted bugs and reverted fixes: the harness must catch every one of them.

Each is a context manager that patches kvtier (classes, not instances) for the scenarios run
inside it, and says which oracle findings count as catching it. ``PLANTED`` are the six bugs
the issue names; ``REVERTS`` put back behaviour kvtier had before a bug the harness found was
fixed (the regression tests run them to show the harness still sees those bugs).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from kvtier import geometry
from kvtier.index.memory import MemoryIndex
from kvtier.layout import GroupKind
from kvtier.scheduler import OffloadScheduler, RequestState
from kvtier.transfer import ChunkMover, Completion
from kvtier.vllm.scheduler_side import SchedulerSide
from kvtier.vllm.worker_side import WorkerSide
from kvtier.worker import OffloadWorker, StepResult


@dataclass(frozen=True)
class Bug:
    name: str
    description: str
    detected_by: frozenset[str]  # oracle finding kinds that count as catching it
    fault_kinds: frozenset[str]  # faults the scenarios for it switch on
    patch: Callable[[], contextlib.AbstractContextManager[None]]
    world_size: int | None = None  # the bug needs this many ranks
    group_sets: tuple[str, ...] = ("full",)  # the KV-cache group sets its scenarios have


@contextlib.contextmanager
def _patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    old = obj.__dict__[name]
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


# -- (1) no fence in handle_preemptions -------------------------------------------------------
def no_fence() -> contextlib.AbstractContextManager[None]:
    def handle_preemptions(self: WorkerSide, kv_connector_metadata: Any) -> None:
        plan, _ = self._step_plan(kv_connector_metadata)
        if self.worker is not None and plan is not None:
            self._fenced_step = plan.step  # claims the step was fenced, fences nothing

    return _patched(WorkerSide, "handle_preemptions", handle_preemptions)


# -- (2) a duplicated finished_recving --------------------------------------------------------
def duplicate_recving() -> contextlib.AbstractContextManager[None]:
    original = WorkerSide._collect

    def _collect(self: WorkerSide) -> StepResult:
        res = original(self)
        again = getattr(self, "_bug_again", set())
        self._bug_again = set(res.finished_loads)  # type: ignore[attr-defined]
        res.finished_loads |= again  # last step's loads are reported once more
        return res

    return _patched(WorkerSide, "_collect", _collect)


# -- (3) a chunk made visible before all ranks report -----------------------------------------
def early_visibility() -> contextlib.AbstractContextManager[None]:
    original = OffloadScheduler.on_report

    def on_report(self: OffloadScheduler, report: Any) -> None:
        for job_id, (ok, _failed) in report.saves.items():
            js = self.jobs.get(job_id)
            if js is not None and ok and js.entries and not js.ok:
                for e in js.entries:  # the first rank's "written" makes it visible
                    self.index.commit(e)
                js.entries = []
        original(self, report)

    return _patched(OffloadScheduler, "on_report", on_report)


# -- (4) a pinned chunk evicted ---------------------------------------------------------------
def evict_pinned() -> contextlib.AbstractContextManager[None]:
    def _evictable(self: MemoryIndex, group: int, key: object) -> bool:
        e = self._entries[group].get(key)  # type: ignore[arg-type]
        if e is None or not e.ready:
            return False  # pins ignored
        return not (self.groups[group].chained and e.children)

    return _patched(MemoryIndex, "_evictable", _evictable)


# -- (5) a failure reported without failed_recving --------------------------------------------
def hide_failures() -> contextlib.AbstractContextManager[None]:
    original = OffloadWorker._account

    def _account(self: OffloadWorker, c: Completion, out: StepResult) -> None:
        original(self, c, out)
        out.failed_loads.clear()  # finished_recving only: vLLM takes it as loaded
        out.failed_blocks.clear()

    return _patched(OffloadWorker, "_account", _account)


# -- (6) a load that copies slot s+1 into the blocks of slot s --------------------------------
def off_by_one_slot() -> contextlib.AbstractContextManager[None]:
    original = ChunkMover.load_op

    def load_op(self: ChunkMover, op: Any) -> int:
        n = self.slab.layout.classes[self.slot_class[op.group]].num_slots
        shifted = type(op)(op.group, (op.slot + 1) % n, op.block_ids)
        return original(self, shifted)

    return _patched(ChunkMover, "load_op", load_op)


_LOADS = frozenset({"exec_delay", "reorder"})

PLANTED: dict[str, Bug] = {b.name: b for b in (
    Bug("no_fence", "handle_preemptions does not fence saves whose blocks are reallocated",
        frozenset({"block_reused_during_save", "load_wrong_bytes", "wrong_kv_read"}),
        frozenset({"exec_delay"}), no_fence),
    Bug("duplicate_recving", "every finished_recving is reported again the next step",
        frozenset({"duplicate_report", "stray_report"}), _LOADS, duplicate_recving),
    Bug("early_visibility", "a chunk is committed when the first rank reports it written",
        frozenset({"load_before_all_ranks_wrote", "load_wrong_bytes", "wrong_kv_read"}),
        frozenset({"late_rank", "exec_delay"}), early_visibility, world_size=2),
    Bug("evict_pinned", "eviction ignores the pins of loads in flight",
        frozenset({"slot_overwritten_during_load", "load_wrong_bytes", "wrong_kv_read"}),
        frozenset({"slab_full", "exec_delay"}), evict_pinned),
    Bug("hide_failures", "a failed load is reported in finished_recving only",
        frozenset({"failure_hidden", "wrong_kv_read"}),
        frozenset({"load_fail", "load_partial"}), hide_failures),
    Bug("off_by_one_slot", "a load copies slot s+1 into the blocks of slot s",
        frozenset({"load_wrong_bytes", "wrong_kv_read"}), frozenset({"reorder"}),
        off_by_one_slot),
)}


# -- multi-group bugs: the per-kind rules of the oracle ----------------------------------------
def skip_state_loads() -> contextlib.AbstractContextManager[None]:
    """A load copies its KV but none of its state objects, and reports success."""
    original = ChunkMover.load_op

    def load_op(self: ChunkMover, op: Any) -> int:
        if self.layout.groups[op.group].spec.kind is GroupKind.STATE:
            return 0
        return original(self, op)

    return _patched(ChunkMover, "load_op", load_op)


def interior_state_block() -> contextlib.AbstractContextManager[None]:
    """A state object is addressed one table position early: an interior position (in
    ``align`` mode the null block, or the state of an earlier step)."""

    def _state_block(geo: Any, g: int, table: Any, chunk: int) -> int:
        return table[(chunk + 1) * geo.chunk_tokens // geo.groups[g].block_size - 2]

    return _patched(geometry._StateRules, "_state_block", staticmethod(_state_block))


def state_off_boundary() -> contextlib.AbstractContextManager[None]:
    """A chunk's state is saved although no step ended at the chunk's boundary (the block
    then holds a later state)."""

    def blocks_to_save(self: Any, geo: Any, g: int, table: Any, chunk: int,
                       computed_tokens: int, computed_before: int | None = None) -> Any:
        return [self._state_block(geo, g, table, chunk)]

    return _patched(geometry._StateRules, "blocks_to_save", blocks_to_save)


def window_not_loaded() -> contextlib.AbstractContextManager[None]:
    """A hit is promised but its load restores no sliding-window chunk."""

    def chunks_to_load(self: Any, geo: Any, g: int, first_chunk: int, boundary: int) -> range:
        return range(0)

    return _patched(geometry._WindowRules, "chunks_to_load", chunks_to_load)


_MG_LOADS = frozenset({"exec_delay"})
_STATE_SETS = ("full+mamba", "full+mamba+mamba")

MULTI_GROUP_PLANTED: dict[str, Bug] = {b.name: b for b in (
    Bug("skip_state_loads", "a load restores the KV but skips the state objects",
        frozenset({"load_wrong_state", "wrong_state_read"}), _MG_LOADS, skip_state_loads,
        group_sets=_STATE_SETS),
    Bug("interior_state_block", "a state object is saved from and loaded into an interior "
        "table position", frozenset({"save_wrong_state", "load_wrong_state",
                                     "load_into_null_block", "wrong_state_read"}),
        _MG_LOADS, interior_state_block, group_sets=_STATE_SETS),
    Bug("state_off_boundary", "a state is saved where no step ended at the boundary",
        frozenset({"save_wrong_state", "load_wrong_state", "wrong_state_read"}), _MG_LOADS,
        state_off_boundary, group_sets=_STATE_SETS),
    Bug("window_not_loaded", "a load restores no sliding-window chunk",
        frozenset({"wrong_kv_read"}), _MG_LOADS, window_not_loaded, group_sets=("full+swa",)),
)}
"""Bugs of the multi-group rules (recurrent state, sliding window): the oracle's per-kind
checks must catch each (tests/test_harness_multigroup.py)."""


# -- reverted fixes (bugs the harness found in kvtier) ----------------------------------------
def revert_recycled_id() -> contextlib.AbstractContextManager[None]:
    """Before the fix, a request whose id was still known to kvtier (a finished request with
    saves in flight) reused that request's state: its keys, so its loads."""

    def on_new_request(self: SchedulerSide, request: Any) -> None:
        self.requests[request.request_id] = request
        if self.scheduler is not None:
            self._ensure_request(request)

    return _patched(SchedulerSide, "on_new_request", on_new_request)


def revert_preempt_order() -> contextlib.AbstractContextManager[None]:
    """Before the fix, build_connector_meta applied ``preempted_req_ids`` after the step's
    block updates, wiping the table of a request resumed in that same step."""
    original = SchedulerSide.build_connector_meta

    def build_connector_meta(self: SchedulerSide, scheduler_output: Any) -> Any:
        sched = self.scheduler
        preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        if sched is None or not preempted:
            return original(self, scheduler_output)
        scheduler_output.preempted_req_ids = set()
        build_step = sched.build_step

        def late_build_step() -> Any:
            for req_id in preempted:
                sched.on_preempted(req_id)
            return build_step()

        sched.build_step = late_build_step  # type: ignore[method-assign]
        try:
            return original(self, scheduler_output)
        finally:
            del sched.build_step
            scheduler_output.preempted_req_ids = preempted

    return _patched(SchedulerSide, "build_connector_meta", build_connector_meta)


def revert_blind_requests() -> contextlib.AbstractContextManager[None]:
    """Before the fix, a request vLLM scheduled before kvtier's scheduler half existed had
    its later blocks appended to an empty table: chunk j was saved from chunk j+k's blocks."""
    original = SchedulerSide.build_connector_meta

    def build_connector_meta(self: SchedulerSide, scheduler_output: Any) -> Any:
        self._blind.clear()
        out = original(self, scheduler_output)
        self._blind.clear()
        return out

    return _patched(SchedulerSide, "build_connector_meta", build_connector_meta)


def revert_priority_loads() -> contextlib.AbstractContextManager[None]:
    """Before the fix, kvtier promised loads under vLLM 0.25.1's priority scheduler, which
    can leave the parked request behind a higher-priority one that needs its blocks."""
    import kvtier.vllm.compat as compat_module

    return _patched(compat_module, "parked_requests_drained_first", lambda: True)


def revert_exactly_once() -> contextlib.AbstractContextManager[None]:
    """Before the fix, the worker reported every completion its engine delivered (a duplicate
    notice crashed the scheduler half) and never asked for a lost one (the load hung)."""

    def _take(self: OffloadWorker, c: Completion, out: StepResult) -> None:
        self._inflight.pop(c.job_id, None)
        self._account(c, out)

    @contextlib.contextmanager
    def both() -> Iterator[None]:
        with _patched(OffloadWorker, "_take", _take), \
                _patched(OffloadWorker, "collect", _collect_without_query):
            yield

    return both()


def _collect_without_query(self: OffloadWorker) -> StepResult:
    out = StepResult()
    rep = out.report
    for job in self._reported_nowrite:
        rep.saves[job.job_id] = [1, 0]
    self._reported_nowrite = []
    for c in self.engine.poll():
        self._take(c, out)
    rep.fences_waited, self._fences_waited = self._fences_waited, 0
    return out


def revert_window_release() -> contextlib.AbstractContextManager[None]:
    """Before the fix, a sliding-window chunk was saved from blocks vLLM had released (out of
    the window) in the scheduling of that very step: kvtier's copy of the table still showed
    them, and another request could already hold them."""
    original = geometry._WindowRules.blocks_to_save

    def blocks_to_save(self: Any, geo: Any, g: int, table: Any, chunk: int,
                       computed_tokens: int, computed_before: int | None = None) -> Any:
        return original(self, geo, g, table, chunk, computed_tokens, None)

    return _patched(geometry._WindowRules, "blocks_to_save", blocks_to_save)


def revert_cross_group_fence() -> contextlib.AbstractContextManager[None]:
    """Before the fix, a save was fenced only when its blocks came back in its own group;
    vLLM's one block pool hands a released window or state block to any group."""
    original = OffloadScheduler.build_step

    def build_step(self: OffloadScheduler) -> Any:
        fence: set[int] = set()
        for reading, allocated in zip(self._block_jobs, self._step_allocated):
            for b in allocated.intersection(reading) - {0}:
                fence.update(reading[b])
        for req_id in self._step_preempted:
            st = self.requests.get(req_id)
            if st is not None:
                fence.update(st.save_jobs)
        fence.difference_update(j.job_id for j in self._step_saves)
        self._step_allocated = [set() for _ in self.geometry.groups]
        self._step_preempted = set()
        plan = original(self)
        plan.fence = sorted(fence)
        return plan

    return _patched(OffloadScheduler, "build_step", build_step)


def revert_reverse_hybrid_hit() -> contextlib.AbstractContextManager[None]:
    """Before the fix, on vLLM 0.25.1 kvtier handled a hybrid's local hit that ran past the
    state groups' only, not one that ran past the attention groups' (a state cached after
    more tokens than the attention blocks; kvtier's own drops of attention entries for
    another prompt make it common): the forward read attention blocks nobody computed."""
    return _patched(SchedulerSide, "_attention_missing_at_local_hit",
                    lambda self, request, local_hit: False)


def revert_recomputed_blocks_cached() -> contextlib.AbstractContextManager[None]:
    """Before the fix, a recomputed layer-by-layer load's blocks, and those its step computed
    after them, stayed in vLLM's prefix cache while the recompute ran (vLLM's ``recompute``
    policy keeps them): a request arriving meanwhile read KV nobody computed."""
    from kvtier.vllm import scheduler_side

    return _patched(scheduler_side, "forget_recomputed_blocks", lambda pool, sched, blocks: 0)


def revert_loads_before_forward() -> contextlib.AbstractContextManager[None]:
    """Without it, a step whose forward may replay a FULL CUDA graph (a batch of one-token
    queries, one of them a hit promised by layer) waited for its loads only at the layer
    hooks, which such a replay never calls."""
    return _patched(SchedulerSide, "_may_replay_full_graph", lambda self, plan, so: False)


REVERTS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "recycled_id": revert_recycled_id,
    "preempt_order": revert_preempt_order,
    "blind_requests": revert_blind_requests,
    "priority_loads": revert_priority_loads,
    "exactly_once": revert_exactly_once,
    "window_release": revert_window_release,
    "cross_group_fence": revert_cross_group_fence,
    "reverse_hybrid_hit": revert_reverse_hybrid_hit,
    "recomputed_blocks_cached": revert_recomputed_blocks_cached,
    "loads_before_forward": revert_loads_before_forward,
}

__all__ = ["MULTI_GROUP_PLANTED", "PLANTED", "REVERTS", "Bug", "RequestState", "revert_blind_requests",
           "revert_exactly_once", "revert_preempt_order", "revert_priority_loads",
           "revert_recycled_id"]
