"""Hand-made scenario families for the regression tests: each aims straight at one bug the
harness found, with a few variants (seeds) so that the copy timings that expose it occur."""

from __future__ import annotations

import random

from .content import FIRST_TOKEN, VOCAB
from .workload import FaultPlan, ReqSpec, Scenario


def _toks(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_TOKEN, VOCAB) for _ in range(n)]


def _base(seed: int, requests: list[ReqSpec], faults: FaultPlan, **kw: object) -> Scenario:
    sc = Scenario(
        seed=seed, async_scheduling=False, world_size=1, num_blocks=48, max_num_seqs=4,
        max_num_batched_tokens=256, chunk_tokens=32, dram_size=f"{64 * 4096}B",
        max_pending_saves=256, policy="lru", admission="always", sched_policy="fcfs",
        requests=requests, resets=[], faults=faults, min_steps=0, max_steps=400,
    )
    for k, v in kw.items():
        setattr(sc, k, v)
    if sc.world_size > 1 and not kw.get("dram_size"):
        sc.dram_size = f"{64 * 4096 * sc.world_size}B"
    return sc


def recycled_id(seed: int, async_scheduling: bool = False, world_size: int = 1) -> Scenario:
    """Request ``x`` finishes while its saves are still in flight (late copies and notices);
    the HBM prefix cache is dropped; a new request reuses the id ``x`` with another prompt.
    Its lookup must use its own keys, not those of the finished ``x``."""
    rng = random.Random(seed)
    faults = FaultPlan(exec_delay_p=1.0, exec_delay_max=4, notify_delay_p=0.5,
                       notify_delay_max=3)
    reqs = []
    for i in range(3):
        first = ReqSpec(f"a{i}", f"x{i}", _toks(rng, 32 * rng.randint(3, 5)), 2, arrival=3 * i)
        again = ReqSpec(f"b{i}", f"x{i}", _toks(rng, 32 * rng.randint(3, 5)), 2,
                        arrival=3 * i + rng.randint(2, 5), recycles=f"a{i}")
        reqs += [first, again]
    resets = [(step, False, False) for step in range(2, 20)]  # keep HBM from answering
    return _base(seed, reqs, faults, resets=resets, async_scheduling=async_scheduling,
                 world_size=world_size)


def resumed_after_reset(seed: int, async_scheduling: bool = False,
                        world_size: int = 1) -> Scenario:
    """``reset_prefix_cache(reset_running_requests=True)`` preempts a long prompt in the middle
    of its chunked prefill, after some of its chunks were saved; the next step resumes it
    (listed as preempted *and* resumed) with a short first chunk, because a short request
    takes most of the token budget. Later the HBM cache is dropped and the long prompt comes
    back, restored from kvtier: what was saved must be the chunks' own blocks."""
    rng = random.Random(seed)
    # late copies: at the reset nothing is stored yet, so the request is resumed, not loaded
    faults = FaultPlan(exec_delay_p=1.0, exec_delay_max=4)
    long_prompt = _toks(rng, rng.randint(200, 320))
    reqs = [
        ReqSpec("short", "short", _toks(rng, rng.randint(30, 50)), 24, arrival=0),
        ReqSpec("long", "long", long_prompt, 2, arrival=0),
        ReqSpec("again", "again", long_prompt + _toks(rng, 8), 2, arrival=40, after="long",
                gap=2),
    ]
    reset_at = rng.randint(2, 4)
    resets = [(reset_at, True, False)] + [(s, False, False) for s in range(20, 44, 2)]
    return _base(seed, reqs, faults, resets=resets, max_num_batched_tokens=64, num_blocks=72,
                 async_scheduling=async_scheduling, world_size=world_size)


def scheduled_before_handshake(seed: int, async_scheduling: bool = False,
                               world_size: int = 1) -> Scenario:
    """A request that must compute every token (``skip_reading_prefix_cache``, e.g. prompt
    logprobs) arrives before the first engine step. vLLM 0.32 schedules it although kvtier
    deferred its lookup (vLLM forces such a request's external hit to 0, ``None`` included),
    so it runs before kvtier's scheduler half exists (that waits for the workers' layout
    handshake in the first step's output). Later requests share its prefix after the HBM
    cache was dropped and restore that prefix from kvtier."""
    rng = random.Random(seed)
    faults = FaultPlan(exec_delay_p=0.3, exec_delay_max=2)
    prefix = _toks(rng, 32 * rng.randint(3, 5))
    reqs = [ReqSpec("first", "first", prefix + _toks(rng, rng.randint(1, 30)), 3, arrival=0,
                    skip_prefix_cache=True)]
    reqs += [ReqSpec(f"r{i}", f"r{i}", prefix + _toks(rng, rng.randint(1, 30)), 2,
                     arrival=12 + 3 * i) for i in range(3)]
    resets = [(s, False, False) for s in range(10, 24)]
    # a small token budget: the first request's prefill spans several steps
    return _base(seed, reqs, faults, resets=resets, async_scheduling=async_scheduling,
                 world_size=world_size, max_num_batched_tokens=rng.choice((32, 48)))


def priority_parked(seed: int, async_scheduling: bool = False, world_size: int = 1) -> Scenario:
    """Priority scheduling and block pressure: a low-priority request is parked for a load,
    holding its blocks, when a high-priority request arrives that needs more blocks than the
    parked one leaves free. vLLM 0.25.1's priority scheduler compares the heads of its
    waiting and skipped (parked) queues by priority and stops at the first request it cannot
    allocate, so the parked request is never promoted and the engine never drains; 0.32
    drains block-holding requests first."""
    rng = random.Random(seed)
    faults = FaultPlan(exec_delay_p=1.0, exec_delay_max=3)
    parked = _toks(rng, 176 + 16 * rng.randint(0, 2))
    big = 224 + 16 * rng.randint(0, 2)
    reqs = [
        ReqSpec("store", "store", parked, 2, arrival=0, priority=3),
        ReqSpec("parked", "parked", parked + _toks(rng, 4), 2, arrival=8, priority=3,
                after="store", gap=2),
        ReqSpec("urgent", "urgent", _toks(rng, big), 2, arrival=9, priority=0, after="store",
                gap=3),
    ]
    reqs += [ReqSpec(f"f{i}", f"f{i}", _toks(rng, rng.randint(5, 30)), 2, arrival=20 + i)
             for i in range(6)]
    resets = [(s, False, False) for s in range(3, 12)]
    return _base(seed, reqs, faults, resets=resets, num_blocks=24, sched_policy="priority",
                 max_steps=200, async_scheduling=async_scheduling, world_size=world_size)


def lossy_notices(seed: int, kind: str, async_scheduling: bool = False,
                  world_size: int = 1) -> Scenario:
    """Saves and loads whose completion notices are duplicated (``kind='duplicate'``) or lost
    (``kind='drop'``); the HBM cache is dropped now and then so that prompts come back as
    loads. Every job must be reported exactly once per rank, and no load may hang."""
    rng = random.Random(seed)
    faults = FaultPlan(duplicate_p=0.5 if kind == "duplicate" else 0.0,
                       drop_p=0.4 if kind == "drop" else 0.0,
                       notify_delay_p=0.3, notify_delay_max=2)
    prefix = _toks(rng, 96)
    reqs = [ReqSpec(f"r{i}", f"r{i}", prefix + _toks(rng, rng.randint(1, 40)), 3,
                    arrival=4 * i) for i in range(8)]
    resets = [(4 * i + 2, False, False) for i in range(8)]
    return _base(seed, reqs, faults, resets=resets, async_scheduling=async_scheduling,
                 world_size=world_size)


def recomputed_while_shared(seed: int, async_scheduling: bool = False,
                            world_size: int = 1) -> Scenario:
    """A prefix is saved, the HBM prefix cache is dropped, and a request restores the prefix
    layer by layer; the load fails, so vLLM recomputes its blocks, over several steps at a
    64-token budget, and the request is aborted before the recompute is through (as one
    preempted then would be: seed 1080 of the default batch). Requests sharing the prefix
    arrive then: vLLM's prefix cache must hand them neither the blocks nobody recomputed
    nor those the failed step computed after them (under the asynchronous scheduler such a
    failure stops the engine, so none is injected there: nothing to find)."""
    rng = random.Random(seed)
    faults = FaultPlan(load_fail_p=1.0)
    prefix = _toks(rng, 32 * rng.randint(4, 6))
    restore_at = 14
    reqs = [ReqSpec("first", "first", prefix + _toks(rng, 8), 2, arrival=0),
            ReqSpec("restore", "restore", prefix + _toks(rng, rng.randint(40, 90)), 4,
                    arrival=restore_at, abort_after=rng.randint(1, 2))]
    reqs += [ReqSpec(f"share{i}", f"share{i}", prefix + _toks(rng, rng.randint(8, 40)), 2,
                     arrival=restore_at + 2 + i) for i in range(4)]
    return _base(seed, reqs, faults, resets=[(12, False, False)], max_num_batched_tokens=64,
                 num_blocks=160, layerwise=True, async_scheduling=async_scheduling,
                 world_size=world_size)


def by_layer_in_a_decode_batch(seed: int, async_scheduling: bool = False,
                               world_size: int = 1) -> Scenario:
    """A hit promised by layer (its request had more than a decode's query left) whose step
    the token budget gives it one token, in a batch of one-token decodes: vLLM replays a FULL
    CUDA graph for such a batch where one was captured, and no layer hook runs. kvtier must
    order that forward after the loads before it starts (``StepPlan.loads_before_forward``);
    without that the forward reads the blocks unwaited (recomputed under the synchronous
    scheduler, the engine stopped under the asynchronous one)."""
    rng = random.Random(seed)
    prefix = _toks(rng, 32 * rng.randint(2, 4))
    reqs = [ReqSpec("first", "first", prefix + _toks(rng, 8), 2, arrival=0)]
    reqs += [ReqSpec(f"dec{i}", f"dec{i}", _toks(rng, 6 + i), 60, arrival=80)
             for i in range(3)]
    reqs.append(ReqSpec("restore", "restore", prefix + _toks(rng, rng.randint(20, 60)), 4,
                        arrival=rng.randint(92, 100)))
    return _base(seed, reqs, FaultPlan(full_graph_replay_p=1.0), resets=[(76, False, False)],
                 max_num_batched_tokens=4, layerwise=True, async_scheduling=async_scheduling,
                 world_size=world_size)


CASES = {
    "by_layer_in_a_decode_batch": by_layer_in_a_decode_batch,
    "recycled_id": recycled_id,
    "resumed_after_reset": resumed_after_reset,
    "scheduled_before_handshake": scheduled_before_handshake,
    "priority_parked": priority_parked,
    "duplicate_notices": lambda s, a=False, w=1: lossy_notices(s, "duplicate", a, w),
    "lost_notices": lambda s, a=False, w=1: lossy_notices(s, "drop", a, w),
    "recomputed_while_shared": recomputed_while_shared,
}

