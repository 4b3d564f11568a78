"""Layer-by-layer loads (``layerwise_loads``) on a real vLLM CPU engine: vLLM schedules a
restored request in the step of its load (a synchronous load, never parked), the forward waits
for the bytes at its first attention layer (the CPU engine cannot order per layer, so the host
waits there), and the restore check holds: restored blocks equal run A's, tokens and top-5
logprobs equal vLLM's own prefix-cache hit. Negative controls: a chunk not copied fails the
check; a failed load is recomputed in the same step's report, output unchanged."""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256  # default chunk for block size 32


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, shutdown_after: list[Any]) -> Any:
    llm = make_llm(tiny_llama_dir, {"layerwise_loads": True}, num_gpu_blocks_override=160)
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    assert h.scheduler_connector.setup.layerwise_loads
    return h


def _worker(engine: Any) -> Any:
    return engine.worker_connector.worker_side.worker


@pytest.mark.parametrize("chunks", [1, 3, 8])
def test_restore_check_with_loads_by_layer(engine: Any, chunks: int) -> None:
    worker = _worker(engine)
    before = (worker.loads_by_layer, engine.kvtier.stats.loads_started)
    res = restore_check(engine, [prompt(chunks * C + 5, seed=60 + chunks)], greedy())
    assert res.restored_tokens == res.expected_restored == chunks * C, res
    (p,) = res.prompts
    assert p.checksums_equal and p.tokens_equal and p.logprobs_equal, (p.tokens_b, p.tokens_c)
    assert res.loads_failed == 0 and worker.layers_missed == 0
    # the probe heard vLLM's hook on every layer before the first promise
    assert worker.layer_hooks.verified and worker.layer_hooks_missing is None
    started = engine.kvtier.stats.loads_started - before[1]
    assert started >= 1 and worker.loads_by_layer - before[0] == started  # none parked
    assert not engine.scheduler_connector.timings._load_started  # vLLM parked nothing


def test_two_prompts_sharing_a_prefix_load_it_once_in_one_batch(engine: Any) -> None:
    """A synchronous load's blocks enter vLLM's prefix cache in the step they are loaded
    (parked loads cache them only once reported), so the second prompt of the batch hits
    them in HBM: the prefix is restored once, and both prompts' checks hold."""
    shared = prompt(3 * C, seed=70)
    res = restore_check(engine, [shared + prompt(40, seed=71), shared + prompt(60, seed=72)],
                        greedy())
    assert res.restored_tokens == 3 * C and res.loads_ok == 1 and res.loads_failed == 0, res
    assert all(p.passed for p in res.prompts), res


def test_negative_control_a_chunk_not_copied_fails_the_check(engine: Any) -> None:
    engine.faults.skip_load_chunk = 0
    try:
        res = restore_check(engine, [prompt(3 * C + 5, seed=73)], greedy())
    finally:
        engine.faults.skip_load_chunk = -1
        engine.llm.reset_prefix_cache()
    (p,) = res.prompts
    assert not p.checksums_equal and not (p.tokens_equal and p.logprobs_equal)


def test_a_failed_load_by_layer_is_recomputed_in_its_step(engine: Any) -> None:
    """A chunk not copied and the load reported failed: the blocks hold the fill pattern
    when the forward reads them, so only vLLM's recompute of them in the next step (told by
    block id in this one) gives the same output."""
    stats = engine.kvtier.stats
    engine.faults.fail_loads = 1
    engine.faults.skip_load_chunk = 0
    before = stats.loads_failed
    try:
        res = restore_check(engine, [prompt(3 * C + 5, seed=74)], greedy())
    finally:
        engine.faults.fail_loads = 0
        engine.faults.skip_load_chunk = -1
        engine.llm.reset_prefix_cache()
    (p,) = res.prompts
    assert stats.loads_failed - before == 1 and res.restored_tokens == 0
    assert p.tokens_equal and p.logprobs_equal  # vLLM recomputed the blocks: same output
