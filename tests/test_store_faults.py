"""Faults of the node-wide store (issue 18), end to end on CPU: a killed engine, a killed and
restarted store, an engine started before its store. Real processes, real sockets, the
scheduler half and a CPU worker wired as an engine wires them (tests/_store.py)."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time

import torch

from _store import SRC, StoreProcess, StoreTier, restart, restore_equal
from _tier import FULL_A, FULL_B, STATE_B, prompt
from kvtier.scheduler import NewRequest, StepInput
from kvtier.store.client import StoreClient

KILLED_ENGINE = r"""
import os, sys, time
from kvtier.store.client import StoreClient
c = StoreClient(sys.argv[1])
os.close(c.connect({"namespace": b"killed", "arena_bytes": 4 << 20, "slots": [4],
                    "groups": [[0, False, False]]}).pool_fd)
for k in (b"a", b"b"):
    c.call("commit", h=c.call("reserve", g=0, key=k, parent=None)["h"])
c.call("pin", g=0, keys=[b"a"])           # a load in flight
c.call("match", g=0, keys=[b"b"])         # a lookup's lease
c.call("reserve", g=0, key=b"c", parent=None)  # a write in flight
print("held", flush=True)
time.sleep(600)
"""


def test_a_killed_engine_leaks_no_pin_lease_or_slot(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StoreProcess(tmp_path).start()
    try:
        env = {**os.environ, "PYTHONPATH": SRC}
        eng = subprocess.Popen([sys.executable, "-c", KILLED_ENGINE, store.url],
                               stdout=subprocess.PIPE, text=True, env=env)
        assert eng.stdout is not None and eng.stdout.readline().strip() == "held"
        obs = StoreClient(store.url)
        os.close(obs.connect({"namespace": b"killed", "arena_bytes": 4 << 20, "slots": [4],
                              "groups": [[0, False, False]]}).pool_fd)
        held = obs.call("stats")
        assert (held["pinned"], held["writing"], held["free_slots"]) == (2, 1, 1)
        eng.send_signal(signal.SIGKILL)
        eng.wait(10)
        deadline = time.monotonic() + 10
        while obs.call("stats")["pinned"] and time.monotonic() < deadline:
            time.sleep(0.05)
        after = obs.call("stats")
        assert (after["pinned"], after["writing"], after["stored"]) == (0, 0, 2)
        assert after["free_slots"] == 2  # the unfinished write's slot came back
        obs.call("check")  # the store's own invariants hold
        obs.close()
    finally:
        store.stop()


def test_a_killed_store_means_recompute_then_reattach(tmp_path) -> None:  # type: ignore[no-untyped-def]
    store = StoreProcess(tmp_path).start()
    a = StoreTier(store.url, seed=1, timeout=1.0)
    b = None
    try:
        toks = prompt(1)
        a.prefill("p", toks)
        # a load decided before the store dies finishes from the old mapping
        a.sched.add_request("q")
        n = a.sched.lookup("q", toks, 0)
        assert n == 96
        store.kill()
        a.sched.start_load("q", n, [FULL_B, STATE_B])
        res = a.step(StepInput(new=[NewRequest("q", [FULL_B, STATE_B])]))
        assert not res.failed_loads and "q" in res.finished_loads
        for i, blk in enumerate(FULL_B[:6]):
            for x, y in zip(a.kv.attn_block(blk), a.kv.attn_block(FULL_A[i])):
                assert torch.equal(x, y)
        a.sched.request_finished("q")
        a.step()
        # with the store gone: no hang, every lookup a miss, saves dropped, steps go on
        t0 = time.monotonic()
        a.sched.add_request("r")
        assert a.sched.lookup("r", toks, 0) == 0
        assert time.monotonic() - t0 < 1.0
        a.prefill("s", prompt(2))
        assert a.sched.stats.saves_dropped["no_evictable_slot"] >= 1
        assert not a.index.up
        # the store returns (empty: a new pool): the engine attaches again and stores anew
        store.start()
        time.sleep(0.3)  # past retry_seconds
        a.step()
        assert a.index.up and a.index.epoch == 2
        a.sched.request_finished("r")
        a.prefill("t", prompt(4))
        assert a.mapping.epoch == 2  # the worker moved to the new pool
        b = StoreTier(store.url, seed=9)
        restore_equal(b, a, "t", prompt(4))
        a.sched.check_drained()
    finally:
        a.close()
        if b is not None:
            b.close()
        store.stop()


def test_an_engine_started_before_its_store_serves_retries_and_logs(
        tmp_path, caplog) -> None:  # type: ignore[no-untyped-def]
    store = StoreProcess(tmp_path)
    with caplog.at_level(logging.WARNING, logger="kvtier.store"):
        a = StoreTier(store.url, seed=3)
    try:
        assert not a.index.up and a.index.outages == 1
        assert any("kvtier store unavailable" in r.getMessage() for r in caplog.records)
        a.prefill("p", prompt(5))  # served, kvtier off: nothing stored, nothing failed
        assert a.sched.stats.saves_committed == 0
        store.start()
        time.sleep(0.3)
        a.step()
        assert a.index.up
        a.prefill("q", prompt(6))
        assert a.sched.stats.saves_committed > 0
        b = StoreTier(store.url, seed=8)
        try:
            restore_equal(b, a, "q", prompt(6))
        finally:
            b.close()
    finally:
        a.close()
        store.stop()


def test_a_store_restarted_twice_before_the_worker_follows_is_never_read_as_the_plans_pool(
        tmp_path) -> None:  # type: ignore[no-untyped-def]
    """The scheduler half attached to the store's second pool; before a plan of that epoch
    reached the worker the store restarted again: the worker is handed a third pool, which
    the plan does not name. The plan's jobs fail (its slots are the second pool's) and the
    slab stays; once the scheduler half attaches to the third pool the worker moves there."""
    store = StoreProcess(tmp_path).start()
    a = StoreTier(store.url, seed=1, timeout=1.0, retry_seconds=0.1)
    b = None
    try:
        a.prefill("p", prompt(1))
        restart(store, a)
        assert a.index.epoch == 2 and a.mapping.epoch == 1  # no plan of epoch 2 ran yet
        second = a.index.pool
        store.kill()
        store.start()  # the third pool; the scheduler half has not noticed
        ok = a.mapping.follow(2, a.worker.drain, a.worker.engine.slab_moved, second)
        assert not ok and "restarted again" in a.mapping.why
        assert a.mapping.epoch == 1 and not a.mapping.moving  # the slab did not move
        # the scheduler half finds its connection dead, attaches to the third pool (epoch
        # 3), and the worker follows it
        time.sleep(1.1)  # past the worker's retry interval (attach.RETRY_SECONDS)
        deadline = time.monotonic() + 10
        while a.index.epoch < 3 and time.monotonic() < deadline:
            a.sched.add_request("probe3")
            a.sched.lookup("probe3", prompt(98), 0)
            a.sched.request_finished("probe3")
            a.step()
            time.sleep(0.15)
        assert a.index.epoch == 3 and a.index.pool != second
        a.prefill("t", prompt(4))
        assert a.mapping.epoch == 3
        b = StoreTier(store.url, seed=9)
        restore_equal(b, a, "t", prompt(4))
        a.sched.check_drained()
    finally:
        a.close()
        if b is not None:
            b.close()
        store.stop()
