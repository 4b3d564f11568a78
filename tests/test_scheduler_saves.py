"""A request's saves of one step are decided chunk by chunk, then reserved at once
(``Index.reserve_chunks``: one round trip through the store): the outcome must be exactly
what a loop that reserved each chunk in its turn makes. Checked against that loop (the
scheduler's plan_saves before the batched reserve, kept here as the reference) over random
runs of a small real scheduler (full attention + sliding window), with every drop reason the
loop knows reached: the same jobs (chunks, slots, blocks, in order), the same stats, the same
index and the same admission memory after every step."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest

from kvtier.config import KvtierConfig
from kvtier.index.base import Entry
from kvtier.layout import GroupKind
from kvtier.planner import Geometry, GroupGeometry, chunks_to_save, make_slab_layout
from kvtier.protocol import Job, SaveDrop, WorkerReport
from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput, _SaveChoice

C, BLOCK = 32, 16
GEOMETRY = Geometry(C, (
    GroupGeometry(GroupKind.FULL, BLOCK, 4096),
    GroupGeometry(GroupKind.SLIDING_WINDOW, BLOCK, 4096, sliding_window=C),
))


class PerChunkScheduler(OffloadScheduler):
    """The reference: plan_saves as it was before the batched reserve (one ``reserve`` per
    group and chunk, admission asked just before a chunk's reserve)."""

    def plan_saves(self, req_id: str, tokens: Sequence[int], computed_after_step: int,
                   num_prompt: int, computed_before: int | None = None) -> list[Job]:
        st = self.requests.get(req_id)
        if st is None or st.finished:
            return []
        if not st.keys.unsaveable:
            st.keys.update(tokens)
        if st.keys.unsaveable:
            if st.saved_chunks != -1:
                self.stats.unsaveable_requests += 1
                st.saved_chunks = -1
            return []
        todo = chunks_to_save(self.geometry.chunk_tokens, st.keys.num_chunks, st.saved_chunks,
                              computed_after_step, num_prompt,
                              self.config.save_generated_tokens,
                              volatile_tail=self.draft_lookahead > 0)
        jobs: list[Job] = []
        if not todo:
            return jobs
        live = self.index.stored_or_writing(len(self.geometry.groups),
                                            [st.keys.keys[j] for j in todo])
        for j in todo:
            reason = self._one_chunk(st, j, computed_after_step, jobs, computed_before,
                                     [per[j - todo.start] for per in live])
            if reason is not None:
                self.stats.saves_dropped[reason.value] += 1
                if reason.drops_later_chunks:
                    break
        st.saved_chunks = max(st.saved_chunks, todo.stop)
        return jobs

    def _one_chunk(self, st: Any, j: int, computed_after_step: int, jobs: list[Job],
                   computed_before: int | None, live: list[bool]) -> SaveDrop | None:
        key = st.keys.keys[j]
        parent = st.keys.keys[j - 1] if j > 0 else None
        wanted: list[tuple[int, list[int]]] = []
        for g in range(len(self.geometry.groups)):
            if live[g]:
                continue
            ids = self.geometry.blocks_to_save(g, st.block_ids[g], j, computed_after_step,
                                               computed_before)
            if isinstance(ids, SaveDrop):
                return ids
            if ids is not None:
                wanted.append((g, ids))
        if not wanted:
            return None
        if self._pending_save_chunks + 1 > self.config.max_pending_saves:
            return SaveDrop.QUEUE_FULL
        if not self.admission.admit(key):
            return SaveDrop.ADMISSION
        entries: list[Entry] = []
        for g, _ids in wanted:
            e = self.index.reserve(g, key, parent)
            if not isinstance(e, Entry):
                for done in entries:
                    self.index.abort(done)
                return e
            entries.append(e)
        # the job's bookkeeping is the production's (what this reference pins is the order of
        # decisions and reserves, not the building of a job from its entries)
        return self._save_job(st, _SaveChoice(key, parent, wanted, j), entries, jobs)


def _pair(rng: random.Random) -> tuple[OffloadScheduler, OffloadScheduler]:
    settings: dict[str, Any] = {
        "dram_size": rng.choice(["96KiB", "160KiB", "256KiB"]), "cost_model": False,
        "max_pending_saves": rng.choice([2, 3, 5, 64]),
        "admission": rng.choice(["always", "second_sight"]),
        "admission_memory": rng.choice([3, 6, 1000]),
    }
    config = KvtierConfig(**settings)
    layout = make_slab_layout(config, GEOMETRY, 1)
    return (OffloadScheduler(config, GEOMETRY, b"n" * 16, layout),
            PerChunkScheduler(config, GEOMETRY, b"n" * 16, layout))


def _saves(jobs: Sequence[Job]) -> list[Any]:
    return [(j.job_id, j.req_id, j.chunk, [(op.group, op.slot, op.block_ids, op.seed)
                                           for op in j.ops]) for j in jobs]


def _state(s: OffloadScheduler) -> Any:
    seen = getattr(s.admission, "_seen", None)
    return (dataclasses.asdict(s.stats), s.index.stats(), s.occupancy(),
            None if seen is None else list(seen), s._pending_save_chunks)


class _Run:
    """One random run: requests from a few shared prefixes, prefilled in random slices,
    some with holes in their tables; reports come back late (writes in flight fill the
    slab) and some fail."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.new, self.ref = _pair(self.rng)
        self.prefixes = [[self.rng.randrange(1, 50_000) for _ in range(8 * C)]
                         for _ in range(3)]
        self.next_block = 1
        self.running: dict[str, list[Any]] = {}  # id -> [tokens, computed]
        self.in_flight: list[Job] = []
        self.ids = 0

    def _arrival(self) -> NewRequest:
        rng = self.rng
        self.ids += 1
        rid = f"r{self.ids}"
        base = rng.choice(self.prefixes)
        toks = base[:rng.randrange(C, len(base))] + [rng.randrange(1, 50_000)
                                                     for _ in range(rng.randrange(0, 3 * C))]
        n = -(-len(toks) // BLOCK)
        full = list(range(self.next_block, self.next_block + n))
        window = list(range(self.next_block + n, self.next_block + 2 * n))
        self.next_block += 2 * n
        if rng.random() < 0.15:
            full[rng.randrange(n)] = 0  # a hole: the chunk and the ones after it drop
        for s in (self.new, self.ref):
            s.add_request(rid)
        self.running[rid] = [toks, 0]
        return NewRequest(rid, [full, window])

    def step(self) -> tuple[list[Job], list[Job]]:
        rng = self.rng
        new = [self._arrival() for _ in range(rng.choice([0, 0, 1, 2]))]
        scheduled = []
        for rid, r in list(self.running.items()):
            toks, done = r
            r[1] = min(len(toks), done + rng.choice([C // 2, C, 2 * C, 4 * C]))
            scheduled.append(ScheduledTokens(rid, toks, r[1], len(toks), done))
        step = StepInput(new=new, scheduled=scheduled)
        plans = (self.new.schedule_step(step), self.ref.schedule_step(step))
        for rid, (toks, done) in list(self.running.items()):
            if done >= len(toks):
                del self.running[rid]
                for s in (self.new, self.ref):
                    s.request_finished(rid)
        self.in_flight += plans[0].saves
        self._report()
        return plans[0].saves, plans[1].saves

    def _report(self) -> None:
        rng = self.rng
        if not self.in_flight or rng.random() < 0.4:
            return  # the workers are slow: writes stay in flight
        n = rng.randrange(1, len(self.in_flight) + 1)
        done, self.in_flight = self.in_flight[:n], self.in_flight[n:]
        saves = {j.job_id: [0, 1] if rng.random() < 0.1 else [1, 0] for j in done}
        for s in (self.new, self.ref):
            s.on_report(WorkerReport(saves=saves))


@pytest.mark.parametrize("seed", range(40))
def test_the_batched_reserve_saves_exactly_what_the_per_chunk_loop_saved(seed: int) -> None:
    run = _Run(seed)
    for step in range(30):
        new_saves, ref_saves = run.step()
        assert _saves(new_saves) == _saves(ref_saves), f"step {step}"
        assert _state(run.new) == _state(run.ref), f"step {step}"
    run.new.index.check_invariants()


def test_the_random_runs_reach_every_drop_the_loop_knows() -> None:
    """The comparison above means something: across its runs, each reason a save can drop
    for in-process occurs (STORED needs another engine's write between the scheduler's
    question and its reserve: tests/test_store_batching.py)."""
    drops: Counter[str] = Counter()
    for seed in range(40):
        run = _Run(seed)
        for _ in range(30):
            run.step()
        drops.update(run.ref.stats.saves_dropped)
    expected = {d.value for d in SaveDrop} - {SaveDrop.STORED.value}
    assert expected <= set(drops), drops


def test_a_loaded_request_asks_no_save_check_for_the_chunks_it_loaded() -> None:
    """The chunks a load covers are stored, and so are their ancestors: the request's first
    step after its load asks the index (through the node-wide store: a round trip) only about
    the chunks it computes itself."""
    from test_scheduler import C, make_scheduler, stored, table, tokens

    sched = make_scheduler()
    prompt = tokens(4 * C + 3)
    sched.add_request("w")
    stored(sched, "w", prompt, table(1, 9))
    longer = prompt[: 4 * C] + tokens(2 * C + 5, seed=9)  # 4 stored chunks, then 2 new
    sched.add_request("r")
    assert sched.lookup("r", longer, 0) == 4 * C
    sched.start_load("r", 4 * C, table(20, 13))
    asked: list[int] = []
    real = sched.index.stored_or_writing

    def spy(groups: int, keys: list[bytes]) -> list[list[bool]]:
        asked.append(len(keys))
        return real(groups, keys)

    sched.index.stored_or_writing = spy  # type: ignore[method-assign]
    plan = sched.schedule_step(StepInput(scheduled=[ScheduledTokens(
        "r", longer, len(longer), len(longer), 4 * C)]))
    assert asked == [2] and [j.chunk for j in plan.saves] == [4, 5]
