"""Faults on a real vLLM CPU engine: an exception inside a worker transfer (a save, then a
load), a full slab and a full save queue each leave the engine serving with correct output.

"Correct" is checked bit for bit: every prompt runs (A) computed, (B) after the HBM prefix
cache was reset and every KV byte overwritten, so that whatever B did not compute came from
kvtier, and (C) with vLLM's own prefix cache holding exactly the tokens kvtier restored in B.
B's greedy tokens and top-5 logprobs must equal C's (A's when nothing was restored): a wrong
restore, or a failure that was not recomputed, changes them (the weights are re-drawn so
that the output depends on the context). After each fault the engine must still restore
exactly, and kvtier's jobs, pins and request state must return to zero.

One engine serves the module: 8 chunk slots of 256 tokens (a 4 MiB slab), so a 12-chunk
prompt fills it.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.testing.restore import (
    generate,
    handles,
    restore_check,
    settle,
    sharpen_dummy_weights,
)
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256  # chunk tokens (the default for block size 32)
SLOTS = 8
CHUNK_BYTES = 2 * 2 * 2 * 64 * 4 * C  # layers x (K, V) x KV heads x head dim x fp32 x tokens


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, shutdown_after: list[Any]) -> Any:
    # room for SLOTS chunks and their checksum tables (8 bytes per block position), not for
    # a ninth chunk
    llm = make_llm(tiny_llama_dir, extra={"dram_size": f"{SLOTS * CHUNK_BYTES + 65536}B"})
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    assert h.kvtier.occupancy()[1] == SLOTS, h.kvtier.occupancy()
    return h


def _tokens_and_logprobs(out: Any) -> tuple[list[int], list[Any]]:
    steps = out.outputs[0].logprobs or []
    lps = [sorted((t, lp.logprob) for t, lp in s.items()) for s in steps]
    return list(out.outputs[0].token_ids), lps


def _fill(h: Any) -> None:
    from kvtier.testing.probe import rpc_fill

    h.llm.reset_prefix_cache()
    assert all(n > 0 for n in h.llm.collective_rpc(rpc_fill))


def serve_check(h: Any, p: list[int], fault: Any = None) -> dict[str, Any]:
    """Runs A, B, C of the module docstring for prompt ``p``; ``fault(stage)`` is called
    before A (stage 'A') and before B (stage 'B') and may switch faults on; they are off for
    C. Returns the restored tokens and whether B matches its reference."""
    sched = h.kvtier
    params = greedy()
    h.llm.reset_prefix_cache()
    if fault:
        fault("A")
    (out_a,) = generate(h, [p], params)
    if fault:
        fault("off")
    _fill(h)
    before = sched.stats.loaded_tokens
    if fault:
        fault("B")
    (out_b,) = generate(h, [p], params)
    if fault:
        fault("off")
    restored = sched.stats.loaded_tokens - before
    if restored:
        # C: vLLM's own prefix cache holds exactly the restored tokens (and kvtier nothing
        # beyond them), then the prompt runs
        h.llm.reset_prefix_cache(reset_connector=True)
        generate(h, [p[: restored + 1]], greedy(max_tokens=1))
        (ref,) = generate(h, [p], params)
        assert ref.num_cached_tokens == restored, (ref.num_cached_tokens, restored)
    else:
        ref = out_a
    same = _tokens_and_logprobs(out_b) == _tokens_and_logprobs(ref)
    return {"restored": restored, "same": same, "tokens_b": list(out_b.outputs[0].token_ids),
            "tokens_ref": list(ref.outputs[0].token_ids)}


def _still_exact(h: Any, seed: int) -> None:
    """After the fault: a fresh prompt restores bit-exactly (blocks, tokens, logprobs)."""
    res = restore_check(h, [prompt(2 * C + 9, seed=seed)], greedy())
    assert res.passed and res.restored_tokens == 2 * C, res


def _drained(h: Any) -> None:
    settle(h)
    h.kvtier.check_drained()


@pytest.fixture
def faults(engine: Any) -> Iterator[Any]:
    """The worker's transfer engine wrapper (kvtier.testing.faults); every fault off after."""
    f = engine.faults
    yield f
    f.raise_in_jobs = 0
    f.hold_steps = 0


def test_exception_inside_a_save_transfer(engine: Any, faults: Any) -> None:
    stats = engine.kvtier.stats
    failed0 = stats.saves_failed
    engine.llm.reset_prefix_cache(reset_connector=True)

    def fault(stage: str) -> None:
        if stage == "A":
            faults.raise_in_jobs = 1  # the first job of run A, the save of chunk 0, raises
        else:
            faults.raise_in_jobs = 0

    res = serve_check(engine, prompt(3 * C + 5, seed=101), fault)
    assert stats.saves_failed - failed0 >= 1
    assert res["restored"] == 0  # chunk 0 failed: nothing of this prompt was stored
    assert res["same"], res
    _still_exact(engine, 102)
    _drained(engine)


def test_exception_inside_a_load_transfer(engine: Any, faults: Any) -> None:
    stats = engine.kvtier.stats
    failed0, started0 = stats.loads_failed, stats.loads_started
    engine.llm.reset_prefix_cache(reset_connector=True)

    def fault(stage: str) -> None:
        faults.raise_in_jobs = 1 if stage == "B" else 0  # run B's first job is its load

    res = serve_check(engine, prompt(3 * C + 5, seed=111), fault)
    assert stats.loads_failed - failed0 == 1 and stats.loads_started - started0 == 1
    assert res["restored"] == 0  # the load failed: vLLM recomputed everything
    assert res["same"], res  # and the output is the computed one
    _still_exact(engine, 112)
    _drained(engine)


def test_full_slab(engine: Any) -> None:
    sched = engine.kvtier
    dropped0 = sched.stats.saves_dropped["no_evictable_slot"]
    engine.llm.reset_prefix_cache(reset_connector=True)
    long_prompt = prompt(12 * C + 5, seed=121)  # 12 chunks for 8 slots
    res = serve_check(engine, long_prompt)
    assert sched.stats.saves_dropped["no_evictable_slot"] - dropped0 >= 1, sched.stats
    assert sched.occupancy()[0] == SLOTS  # full
    assert 0 < res["restored"] <= SLOTS * C  # the stored prefix came back...
    assert res["same"], res  # ...exactly, and the rest was computed
    _still_exact(engine, 122)  # evicts to make room, restores exactly
    _drained(engine)


def test_full_save_queue(engine: Any, faults: Any) -> None:
    sched = engine.kvtier
    dropped0 = sched.stats.saves_dropped["save_queue_full"]
    config = sched.config
    engine.llm.reset_prefix_cache(reset_connector=True)

    def fault(stage: str) -> None:
        if stage == "A":  # one save in flight at most, held 3 steps: the rest are dropped
            sched.config = config.model_copy(update={"max_pending_saves": 1})
            faults.hold_steps = 3
        else:
            sched.config = config
            faults.hold_steps = 0

    try:
        res = serve_check(engine, prompt(4 * C + 5, seed=131), fault)
    finally:
        sched.config = config
    assert sched.stats.saves_dropped["save_queue_full"] - dropped0 >= 1, sched.stats
    assert res["restored"] < 4 * C  # what was dropped is recomputed...
    assert res["same"], res  # ...and the output is right
    _still_exact(engine, 132)
    _drained(engine)
