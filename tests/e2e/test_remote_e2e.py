"""The remote tier on real vLLM CPU engines sharing one real Redis server: a prefix one engine
computed is restored by another (a fresh engine: nothing in its HBM, DRAM or catalog), bit for
bit (the restored blocks' checksums against those the first computed) and by its tokens and
logprobs against the first engine's own prefix-cache hit; the scheduler's counters (what
/metrics shows) say the hit came from the remote tier."""

from __future__ import annotations

from typing import Any

import pytest
import redis

from _redis import standalone, unique_prefix
from kvtier.testing.restore import (
    _checksums,
    _same_blocks,
    generate,
    handles,
    same_logprobs,
    same_tokens,
    sharpen_dummy_weights,
)
from kvtier.vllm.counters import scheduler_counts
from tests.e2e.conftest import greedy, make_llm, prompt, shutdown

pytestmark = pytest.mark.e2e

C = 256
LONG = 3 * C + 5


def remote_engine(model: str, port: int, prefix: str) -> Any:
    llm = make_llm(model, {"dram_size": "8MiB", "remote_url": f"redis://127.0.0.1:{port}",
                           "remote_key_prefix": prefix, "remote_timeout_ms": 2000},
                   num_gpu_blocks_override=160)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def test_a_prefix_computed_by_one_engine_is_restored_by_another(tiny_llama_dir: str) -> None:
    _, port = standalone()
    prefix = unique_prefix()
    p = prompt(LONG, seed=17)
    first = remote_engine(tiny_llama_dir, port, prefix)
    try:
        first.llm.reset_prefix_cache()
        generate(first, [p], greedy())  # computes and saves; write-through copies it
        sums = _checksums(first, p)
        (hbm_hit,) = generate(first, [p], greedy())  # its own HBM prefix-cache hit
        for _ in range(50):  # the copies land within a few steps
            if first.kvtier.tier.remote.written_through >= 3:
                break
            generate(first, [prompt(40, seed=99)], greedy(max_tokens=1))
        assert first.kvtier.tier.remote.written_through >= 3
    finally:
        shutdown(first.llm)
    for run in ("another engine", "another engine after a restart"):
        second = remote_engine(tiny_llama_dir, port, prefix)
        try:
            (out,) = generate(second, [p], greedy())
            counts = scheduler_counts(second.kvtier)
            assert counts["loaded_tokens"] == 3 * C, (run, counts)
            assert (counts["remote_hits"], counts["remote_discovered"]) == (1, 3), (run, counts)
            assert _same_blocks(sums, _checksums(second, p)), run
            assert same_tokens(out, hbm_hit) and same_logprobs(out, hbm_hit), run
        finally:
            shutdown(second.llm)
    raw = redis.Redis(port=port, socket_timeout=2)
    for k in raw.scan_iter(f"{prefix}:*"):
        raw.delete(k)
