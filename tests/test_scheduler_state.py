"""The scheduler with several recurrent-state groups, driven by hand one :class:`StepInput` per
engine step: the shape of a 4-layer Qwen3-Next on vLLM 0.32 (three GDN state groups listed
first, then one full-attention group; bench/results/2026-12-01-bare-cpu-vllm032/).

A boundary's state objects (one per state group) are stored, pinned, loaded and evicted with
the boundary's chunk, or not at all (issue 12, item 3).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind
from kvtier.planner import Geometry, GroupGeometry, make_slab_layout
from kvtier.protocol import Job, WorkerReport
from kvtier.scheduler import (
    CachedRequest,
    NewRequest,
    OffloadScheduler,
    ScheduledTokens,
    StepInput,
)

C = 32  # chunk tokens: 2 blocks of 16 tokens
BLOCK = 16
STATE = GroupGeometry(GroupKind.STATE, BLOCK, 8192)
FULL = GroupGeometry(GroupKind.FULL, BLOCK, 4096)
GEOMETRY = Geometry(C, (STATE, STATE, STATE, FULL))
STATES, ATTENTION = (0, 1, 2), 3
NAMESPACE = b"q" * 16
PROMPT = 4 * C + 1  # four whole chunks: the last prompt token is always computed


def make_scheduler() -> OffloadScheduler:
    # 7 state slots (two whole sets of three and a spare) and 9 attention chunks: a request
    # of four boundaries fills the state class, three requests fill the attention class
    # (each class also holds its checksum table: one page here)
    config = KvtierConfig(dram_size="136KiB", state_size="60KiB", cost_model=False)
    layout = make_slab_layout(config, GEOMETRY, 1)
    assert [c.num_slots for c in layout.classes] == [9, 7]
    return OffloadScheduler(config, GEOMETRY, NAMESPACE, layout)


def prompt(seed: int) -> list[int]:
    return [(seed * 1000 + i) % 50_000 + 1 for i in range(PROMPT)]


def table(seed: int) -> list[list[int]]:
    """Nine blocks per group, distinct across groups and requests."""
    return [[1 + 1000 * g + 10 * seed + i for i in range(9)] for g in range(4)]


def ok(jobs: Sequence[Job]) -> dict[int, list[int]]:
    return {j.job_id: [1, 0] for j in jobs}


def prefill_chunk_by_chunk(sched: OffloadScheduler, req_id: str, seed: int) -> list[bytes]:
    """A prefill of one chunk per step, every save reported at once; returns the chunk keys.
    Every step ends at a boundary, so every chunk is saved with its three states."""
    p = prompt(seed)
    sched.add_request(req_id)
    assert sched.lookup(req_id, p, 0) == 0
    for n in range(1, 5):
        step = StepInput(scheduled=[ScheduledTokens(req_id, p, n * C, PROMPT)])
        if n == 1:
            step.new = [NewRequest(req_id, table(seed))]
        else:
            step.cached = [CachedRequest(req_id, None)]
        plan = sched.schedule_step(step)
        assert [j.chunk for j in plan.saves] == [n - 1]
        sched.on_report(WorkerReport(saves=ok(plan.saves)))
    keys = list(sched.requests[req_id].keys.keys)
    sched.request_finished(req_id)
    return keys


def boundary_sets(sched: OffloadScheduler, keys: Sequence[bytes]) -> list[tuple[bool, bool]]:
    """Per key: (its chunk is stored, its state set is stored whole); raises on any state
    object without its chunk or any partial state set."""
    out = []
    for j, k in enumerate(keys):
        states = [sched.index.get(g, k) is not None for g in STATES]
        chunk = sched.index.get(ATTENTION, k) is not None
        assert all(states) or not any(states), f"boundary {j + 1}: states {states} only"
        assert chunk or not any(states), f"boundary {j + 1}: state objects without their chunk"
        out.append((chunk, all(states)))
    return out


def test_a_store_past_capacity_keeps_every_boundary_whole() -> None:
    """Before the fix only the first state group left with its chunk and each state group
    evicted on its own: from the third boundary on the store held partial sets and orphans."""
    sched = make_scheduler()
    seen: list[bytes] = []
    for r in range(6):
        seen += prefill_chunk_by_chunk(sched, f"r{r}", seed=r)
        sets = boundary_sets(sched, seen)
        assert sets[-1] == (True, True), "the newest boundary is stored whole"
        sched.index.check_invariants()
    assert sum(whole for _, whole in sets) == 2  # 7 state slots: two whole sets, one spare
    assert sum(chunk for chunk, _ in sets) == 9
    assert sched.index.stats().evictions > 0
    sched.check_drained()


def test_a_hit_restores_every_state_of_its_boundary_or_is_lower() -> None:
    sched = make_scheduler()
    keys = prefill_chunk_by_chunk(sched, "a", seed=1)
    assert boundary_sets(sched, keys) == [(True, False), (True, False), (True, True),
                                          (True, True)]
    sched.add_request("b")
    assert sched.lookup("b", prompt(1), 0) == 4 * C
    job = sched.start_load("b", 4 * C, table(7))
    by_group = [[op.block_ids for op in job.ops if op.group == g] for g in range(4)]
    # each state group's object after 128 tokens goes to that group's block 7; all chunks
    assert by_group[:3] == [[[1000 * g + 78]] for g in STATES]
    assert len(by_group[ATTENTION]) == 4
    plan = sched.schedule_step(StepInput(new=[NewRequest("b", table(7))]))
    sched.on_report(WorkerReport(loads=ok(plan.loads)))
    assert sched.stats.loads_ok == 1 and sched.stats.loaded_tokens == 4 * C
    sched.request_finished("b")

    # a prompt that ends inside chunk 2 continues from boundary 2 at best, whose states are
    # gone: the hit falls back to no boundary with whole states below it -> a miss
    sched.add_request("c")
    assert sched.lookup("c", prompt(1)[:2 * C + 5], 0) == 0
    assert sched.stats.declined["recurrent_state_not_stored"] == 1
    sched.request_finished("c")
    sched.check_drained()


def test_a_failed_state_write_on_one_group_stores_none_of_the_boundarys_states() -> None:
    """A save job is a unit: one rank failing it aborts every state object and the chunk."""
    sched = make_scheduler()
    p = prompt(3)
    sched.add_request("a")
    sched.lookup("a", p, 0)
    plan = sched.schedule_step(StepInput(new=[NewRequest("a", table(3))],
                                         scheduled=[ScheduledTokens("a", p, C, PROMPT)]))
    (save,) = plan.saves
    assert sorted(op.group for op in save.ops) == [0, 1, 2, 3]
    sched.on_report(WorkerReport(saves={save.job_id: [0, 1]}))
    k = sched.requests["a"].keys.keys[0]
    assert all(sched.index.get(g, k) is None for g in range(4))
    assert sched.occupancy()[0] == 0
    sched.request_finished("a")
    sched.check_drained()
