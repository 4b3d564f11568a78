"""Verified restores on a real vLLM CPU engine (issue 12 item 10): a byte of a stored chunk
flipped in host memory between two identical requests makes the second request's load fail
its checksum; vLLM recomputes, so its output equals a cold run's bit for bit (greedy tokens and
top-5 logprobs), ``checksum_failures`` is 1, one log line names the request and slot, and the
corrupt chunk left the index (the recomputed request saves it again, and the prompt then
restores exactly).
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from kvtier.testing.corruption import flip_chunk
from kvtier.testing.probe import rpc_fill
from kvtier.testing.restore import generate, handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256  # chunk tokens (the default for block size 32)


@pytest.fixture(scope="module")
def engine(tiny_llama_dir: str, shutdown_after: list[Any]) -> Any:
    llm = make_llm(tiny_llama_dir)
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def _tokens_and_logprobs(out: Any) -> tuple[list[int], list[Any]]:
    steps = out.outputs[0].logprobs or []
    return (list(out.outputs[0].token_ids),
            [sorted((t, lp.logprob) for t, lp in s.items()) for s in steps])


def test_a_flipped_slot_between_two_identical_requests_is_recomputed(
        engine: Any, caplog: pytest.LogCaptureFixture) -> None:
    h = engine
    sched, worker = h.kvtier, h.worker_connector.worker_side.worker
    p = prompt(3 * C + 17, seed=11)
    h.llm.reset_prefix_cache(reset_connector=True)
    (cold,) = generate(h, [p], greedy())  # computed: the reference, and saves 3 chunks
    failed0, loaded0 = sched.stats.loads_failed, sched.stats.loaded_tokens
    h.llm.reset_prefix_cache()  # HBM only: the second request must come from kvtier
    assert all(n > 0 for n in h.llm.collective_rpc(rpc_fill))
    _cls, slot = flip_chunk(h, p, chunk=1, offset=100)
    with caplog.at_level(logging.WARNING, logger="vllm.kvtier"):
        (again,) = generate(h, [p], greedy())
    assert worker.checksum_failures == 1, worker.checksum_failures
    assert _tokens_and_logprobs(again) == _tokens_and_logprobs(cold), (
        list(again.outputs[0].token_ids), list(cold.outputs[0].token_ids))
    assert worker.checksum_failures == 1 and sched.stats.checksum_failures == 1
    assert sched.stats.loads_failed == failed0 + 1 and sched.stats.loaded_tokens == loaded0
    lines = [r.getMessage() for r in caplog.records if "checksum mismatch" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"slot {slot} " in lines[0] and "restoring request" in lines[0]
    # the corrupt chunk left the index (with chunk 2 after it); the recomputed request saved
    # both again, so the same prompt now restores whole and exactly
    assert sched.stats.corrupt_chunks == 1
    res = restore_check(h, [p], greedy())
    assert res.passed and res.restored_tokens == 3 * C and res.loads_failed == 0, res
    assert worker.checksum_failures == 1


def test_after_a_mismatch_the_engine_still_restores_exactly(engine: Any) -> None:
    res = restore_check(engine, [prompt(2 * C + 9, seed=12)], greedy())
    assert res.passed and res.restored_tokens == 2 * C, res
    engine.kvtier.check_drained()
