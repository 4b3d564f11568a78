"""The restore check on a real vLLM CPU engine (issue: the connector, end to end).

One engine serves every check in this module; fault switches are toggled on the worker's
transfer engine wrapper (kvtier.testing.faults) between checks. The HBM cache is small (160 blocks of 32 tokens) so that the hold-and-
preempt checks see real preemption and block reuse.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from kvtier.testing.restore import generate, handles, restore_check, settle, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256  # default chunk for block size 32


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, shutdown_after: list[Any]) -> Any:
    llm = make_llm(tiny_llama_dir, num_gpu_blocks_override=160)
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def _check(engine: Any, prompts: list[list[int]]) -> None:
    res = restore_check(engine, prompts, greedy())
    assert res.restored_tokens == res.expected_restored > 0, res
    for p in res.prompts:
        assert p.checksums_equal, f"restored blocks differ from run A ({p.prompt_len} tokens)"
        assert p.tokens_equal and p.logprobs_equal, (p.tokens_b, p.tokens_c)
    assert res.loads_failed == 0


@pytest.mark.parametrize("chunks", [1, 3, 8], ids=["one-chunk", "several-chunks", "many-chunks"])
def test_restore_check(engine: Any, chunks: int) -> None:
    _check(engine, [prompt(chunks * C + 5, seed=chunks)])


def test_a_zero_fill_restore_check_still_fails_on_a_skipped_chunk(engine: Any) -> None:
    """The fill-zero form (``fill_byte=0``, the DSA report of tools/gpu_seed_check.py) passes
    a correct restore and still catches a chunk kvtier did not copy: zeros are not the KV."""
    res = restore_check(engine, [prompt(3 * C + 5, seed=21)], greedy(), fill_byte=0)
    assert res.passed and res.restored_tokens == res.expected_restored == 3 * C, res
    engine.faults.skip_load_chunk = 0
    try:
        bad = restore_check(engine, [prompt(3 * C + 5, seed=22)], greedy(), fill_byte=0)
    finally:
        engine.faults.skip_load_chunk = -1
        engine.llm.reset_prefix_cache()
    (p,) = bad.prompts
    assert not bad.passed and not p.checksums_equal
    assert not (p.tokens_equal and p.logprobs_equal), (p.tokens_b, p.tokens_c)


def test_two_requests_sharing_a_prefix_in_one_batch(engine: Any) -> None:
    shared = prompt(2 * C, seed=11)
    _check(engine, [shared + prompt(C + 7, seed=12), shared + prompt(C + 3, seed=13)])


def test_two_requests_sharing_a_prefix_one_at_a_time(engine: Any) -> None:
    """Each request restores the shared chunks on its own (its own reset and fill), and runs
    B and C generate it alone: the form of the shared-prefix check that stays bit-equal where
    kernels are not batch-invariant."""
    shared = prompt(2 * C, seed=14)
    prompts = [shared + prompt(C + 7, seed=15), shared + prompt(C + 3, seed=16)]
    res = restore_check(engine, prompts, greedy(), one_at_a_time=True, hit_controls=True)
    assert res.one_at_a_time and res.passed, res
    assert res.restored_tokens == res.expected_restored == 2 * 3 * C
    assert res.loads_ok >= 2 and res.loads_failed == 0  # one load per request at least
    assert all(p.checksums_equal and p.tokens_equal and p.logprobs_equal for p in res.prompts)
    # vLLM's CPU build reproduces its own hit (C2), also with everything around the cached
    # blocks filled (CF), and B equals CF: the controls the GPU seed checks lean on
    for p in res.prompts:
        assert p.hbm_hit_repeatable and p.hbm_hit_fill_equal, p
        assert p.tokens_equal_fill and p.logprobs_equal_fill, p


def test_fill_keeping_fills_everything_but_the_listed_blocks(engine: Any) -> None:
    """CF's fill (kvtier.testing.probe.ProbeConnector.fill_keeping): the listed blocks keep
    their bytes, every other block of the same layers gets the pattern."""
    from kvtier.testing.probe import rpc_block_checksums, rpc_fill_keeping

    p = prompt(2 * C + 5, seed=19)
    engine.llm.reset_prefix_cache()
    generate(engine, [p], greedy())
    (table,) = engine.scheduler_connector.blocks_of(p)
    layers = list(engine.scheduler_connector.groups.specs[0].layer_names)
    kept, other = table[:2], table[2:4]
    ask = [(layers, kept + other)]
    (before,) = engine.llm.collective_rpc(rpc_block_checksums, args=(ask,))
    assert all(n > 0 for n in engine.llm.collective_rpc(
        rpc_fill_keeping, args=(0x47, [(layers, kept)])))
    (after,) = engine.llm.collective_rpc(rpc_block_checksums, args=(ask,))
    assert after[0][:2] == before[0][:2]
    assert all(a != b for a, b in zip(after[0][2:], before[0][2:]))
    assert after[0][2] == after[0][3]  # both all pattern
    engine.llm.reset_prefix_cache()  # HBM now caches blocks that hold the pattern


def test_one_at_a_time_fails_when_a_chunk_copy_is_skipped(engine: Any) -> None:
    shared = prompt(2 * C, seed=17)
    engine.faults.skip_load_chunk = 0
    try:
        res = restore_check(engine, [shared + prompt(C + 7, seed=18),
                                     shared + prompt(C + 3, seed=19)], greedy(),
                            one_at_a_time=True)
    finally:
        engine.faults.skip_load_chunk = -1
        engine.llm.reset_prefix_cache()
    assert res.restored_tokens == res.expected_restored  # the loads "succeeded"...
    for p in res.prompts:  # ...but each request's blocks hold the fill pattern
        assert not p.checksums_equal
        assert not (p.tokens_equal and p.logprobs_equal), (p.tokens_b, p.tokens_c)
    assert not res.passed


def test_negative_control_a_skipped_chunk_copy_fails_the_check(engine: Any) -> None:
    """Proof that the check can fail: skip the copy of one chunk of the load."""
    engine.faults.skip_load_chunk = 0
    try:
        res = restore_check(engine, [prompt(3 * C + 5, seed=31)], greedy())
    finally:
        engine.faults.skip_load_chunk = -1
        engine.llm.reset_prefix_cache()  # HBM now caches the unfilled blocks
    (p,) = res.prompts
    assert res.restored_tokens == res.expected_restored  # the load "succeeded"...
    assert not p.checksums_equal  # ...but the blocks hold the fill pattern (b)
    # and the output changed (c), seen by each comparison on its own: either one replaced
    # by a comparison that cannot fail would leave the check blind to a wrong KV block
    assert not p.tokens_equal, (p.tokens_b, p.tokens_c)
    assert not p.logprobs_equal


def test_injected_load_failure_recomputes_and_is_not_offered_again(engine: Any) -> None:
    stats = engine.kvtier.stats
    engine.faults.fail_loads = 1
    before = (stats.loads_started, stats.loads_failed, stats.declined["load_failed_before"])
    try:
        res = restore_check(engine, [prompt(3 * C + 5, seed=41)], greedy())
    finally:
        engine.faults.fail_loads = 0
    (p,) = res.prompts
    assert res.loads_failed == 1 and res.restored_tokens == 0
    assert p.tokens_equal and p.logprobs_equal  # recomputed: identical output
    assert stats.loads_started - before[0] == 1  # one attempt, never retried
    assert stats.declined["load_failed_before"] - before[2] >= 1  # the hit was declined after


def _run_steps(engine: Any, until: Any, max_steps: int = 400) -> int:
    eng = engine.llm.llm_engine
    for n in range(max_steps):
        if until():
            return n
        eng.step()
        time.sleep(0.0005)  # the CPU transfer thread needs the GIL now and then
    raise TimeoutError("condition not reached")


def test_transfers_held_in_flight_abort_preempt_and_reuse(engine: Any) -> None:
    """Every transfer held >= 3 steps: a request aborted while parked, requests preempted
    while their saves are in flight, finished requests whose held saves' blocks are reused.
    No hang, no engine assertion, no corrupted chunk; pins, jobs and slots return to zero."""
    sched = engine.kvtier
    eng = engine.llm.llm_engine
    worker = engine.worker_connector.worker_side.worker
    engine.llm.reset_prefix_cache()
    parked_prompt = prompt(3 * C + 5, seed=51)
    generate(engine, [parked_prompt], greedy())  # stored without holding
    engine.llm.reset_prefix_cache()
    st0 = (sched.stats.fences, sched.stats.fences_after_finish, sched.stats.preempted_with_saves,
           worker.total_fences_waited)
    engine.faults.hold_steps = 3
    try:
        # (a) aborted while parked on a held load
        eng.add_request("parked", {"prompt_token_ids": parked_prompt}, greedy())
        def parked() -> bool:  # vLLM suffixes request ids internally
            return any(rid.startswith("parked") and st.load_job is not None
                       for rid, st in sched.requests.items())

        _run_steps(engine, parked)
        eng.step()
        eng.abort_request(["parked"])
        _run_steps(engine, lambda: not eng.has_unfinished_requests())
        # (c) requests that finish while their saves are held, then (b) more KV than HBM
        # holds: their blocks are reused and running requests are preempted, all while the
        # saves of those requests are still held
        engine.faults.hold_steps = 250
        short = [prompt(4 * C + 100, seed=70 + i) for i in range(2)]
        for i, p in enumerate(short):
            eng.add_request(f"short{i}", {"prompt_token_ids": p}, greedy(max_tokens=2))
        _run_steps(engine, lambda: not eng.has_unfinished_requests())
        long_prompts = [prompt(4 * C + 100, seed=60 + i) for i in range(4)]
        for i, p in enumerate(long_prompts):
            eng.add_request(f"long{i}", {"prompt_token_ids": p}, greedy(max_tokens=300))
        _run_steps(engine, lambda: not eng.has_unfinished_requests(), max_steps=3000)
    finally:
        engine.faults.hold_steps = 0
    settle(engine)
    stats = sched.stats
    assert stats.max_job_steps >= 3, "transfers were not held in flight"
    assert stats.preempted_with_saves - st0[2] >= 1, "no preemption while a save was in flight"
    assert stats.fences_after_finish - st0[1] >= 1, "no finished request's held save was fenced"
    assert worker.total_fences_waited - st0[3] >= 1, "no fence found its save still pending"
    assert not any(rid.startswith("parked") for rid in sched.requests)
    # no corrupted chunk: what was saved while held restores bit-exactly
    _check(engine, [short[0][: 4 * C + 7], long_prompts[1][: 4 * C + 7]])
    # pins, jobs, request state and (after a connector reset) slots return to zero
    engine.llm.reset_prefix_cache(reset_connector=True)
    settle(engine)
    sched.check_drained()
    assert sched.occupancy()[0] == 0
