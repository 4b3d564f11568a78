"""Requests to the node-wide store that nobody waits for an answer to (a report's commits and
unpins, a load's touch, aborts) ride ahead of the next request instead of costing a round
trip each (issue 18: the scheduler-side cost through the store), yet every engine sees them
as soon as the report that made them is handled. Real store process, real sockets, real
scheduler and CPU workers; the client's requests are counted as they go out."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _small_kv import CHUNK_TOKENS
from _store import StoreProcess, StoreTier
from _tier import FULL_A, STATE_A, prompt
from kvtier.scheduler import NewRequest, ScheduledTokens, StepInput
from kvtier.store.index import StoreIndex


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    s = StoreProcess(tmp_path).start()
    yield s
    s.stop()


def _sent(index: StoreIndex) -> list[str]:
    """The ops the index's client sends from now on (each one round trip), in order."""
    sent: list[str] = []
    call = index.client.call

    def counted(op: str, **args: Any) -> Any:
        sent.append(op)
        return call(op, **args)

    index.client.call = counted  # type: ignore[method-assign]
    return sent


def _plan_and_work(t: StoreTier, step: StepInput) -> Any:
    """A step up to the workers' report (StoreTier.step without on_report and poll)."""
    plan = t.sched.schedule_step(step)
    plan.store_epoch = t.index.epoch
    w = t.worker
    assert t.mapping.follow(plan.store_epoch, w.drain)
    w.fence(plan)
    w.begin_step(plan)
    w.end_step(plan)
    w.drain()
    return w.collect().report


def test_a_reports_commits_cost_one_round_trip_and_another_engine_sees_them_at_once(
        store: StoreProcess) -> None:
    a, b = StoreTier(store.url, seed=1), StoreTier(store.url, seed=2)
    try:
        toks = prompt(5)
        a.sched.add_request("r")
        assert a.sched.lookup("r", toks, 0) == 0
        sent = _sent(a.index)
        done, per_report = 0, []
        while done < len(toks):
            new = [NewRequest("r", [FULL_A, STATE_A])] if done == 0 else []
            done = min(len(toks), done + CHUNK_TOKENS)
            report = _plan_and_work(a, StepInput(new=new, scheduled=[
                ScheduledTokens("r", toks, done, len(toks))]))
            before = len(sent)
            a.sched.on_report(report)  # this chunk's commits (one per group)
            per_report.append(sent[before:])
            if done < len(toks):
                a.index.poll()
        assert a.sched.stats.saves_committed == 3
        # a report with commits: one request, not a "commit" per group and chunk
        assert [r for r in per_report if r] == [["flush"]] * 3
        n, res = b.restore("q", toks)  # before engine A sends anything else
        assert n == 96 and not res.failed_loads
    finally:
        a.close()
        b.close()


def test_a_loads_touch_and_unpin_go_out_ahead_of_the_next_request(
        store: StoreProcess) -> None:
    a, b = StoreTier(store.url, seed=1), StoreTier(store.url, seed=2)
    try:
        toks = prompt(6)
        a.prefill("r", toks)
        sent = _sent(b.index)
        n, _ = b.restore("q", toks)
        assert n == 96 and b.sched.stats.loads_ok == 1
        assert "touch" not in sent and "unpin" not in sent, sent
        assert sent.count("pin") == len(b.sched.geometry.groups)  # each group's one pin
        held = b.index.holds()  # the load's unpins reached the store before this answer
        assert held["pins"] == 0
        b.sched.request_finished("q")
        b.step()
        b.sched.check_drained()
    finally:
        a.close()
        b.close()


def test_saving_a_prefix_another_engine_stored_asks_the_store_once(
        store: StoreProcess) -> None:
    a, b = StoreTier(store.url, seed=1), StoreTier(store.url, seed=2)
    try:
        toks = prompt(7)
        a.prefill("r", toks)
        b.sched.add_request("q")
        assert b.sched.lookup("q", toks, len(toks) - 1) == 0  # in its own HBM: no load
        sent = _sent(b.index)
        b.step(StepInput(new=[NewRequest("q", [FULL_A, STATE_A])], scheduled=[
            ScheduledTokens("q", toks, len(toks), len(toks))]))
        # every chunk of the step is asked about at once, none is written twice
        assert sent == ["stored_or_writing"]
        assert b.sched.stats.saves_planned == 0 and not b.sched.stats.saves_dropped
    finally:
        a.close()
        b.close()


def test_a_steps_saves_of_a_request_reserve_in_one_round_trip(store: StoreProcess) -> None:
    a = StoreTier(store.url, seed=1)
    try:
        toks = prompt(5)
        a.sched.add_request("r")
        assert a.sched.lookup("r", toks, 0) == 0
        sent = _sent(a.index)
        a.step(StepInput(new=[NewRequest("r", [FULL_A, STATE_A])], scheduled=[
            ScheduledTokens("r", toks, len(toks), len(toks))]))
        # three chunks in two groups: one question, one reserve (not one per group and
        # chunk), then the workers' report (its commits)
        assert sent == ["stored_or_writing", "reserve_chunks", "flush"], sent
        assert a.sched.stats.saves_planned == a.sched.stats.saves_committed == 3
        assert not a.sched.stats.saves_dropped
        a.sched.request_finished("r")
        a.step()
        a.sched.check_drained()
    finally:
        a.close()


def test_a_store_gone_before_the_reserve_drops_the_steps_saves_as_one_full(
        store: StoreProcess) -> None:
    """As the per-chunk loop did: the first chunk is FULL, the later ones are never tried."""
    a = StoreTier(store.url, seed=1, retry_seconds=60)
    try:
        toks = prompt(5)
        a.sched.add_request("r")
        assert a.sched.lookup("r", toks, 0) == 0
        a.index.stored_or_writing = (  # type: ignore[method-assign]
            _killing_after(store, a.index.stored_or_writing))
        a.step(StepInput(new=[NewRequest("r", [FULL_A, STATE_A])], scheduled=[
            ScheduledTokens("r", toks, len(toks), len(toks))]))
        assert a.sched.stats.saves_dropped == {"no_evictable_slot": 1}
        assert a.sched.stats.saves_planned == 0 and not a.index.up
    finally:
        a.close()


def _killing_after(store: StoreProcess, fn: Any) -> Any:
    """``fn``, then the store is killed: it dies between the question and the reserve."""
    def ask(*args: Any) -> Any:
        answer = fn(*args)
        store.kill()
        return answer
    return ask
