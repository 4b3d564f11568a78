"""The remote tier below the disk tier (DRAM -> disk -> remote) on real vLLM CPU engines, a
real disk directory each and one real Redis server: a prefix DRAM evicted is restored from
the disk by the engine that computed it, and from the remote store by an engine on another
disk directory (nothing in its HBM, DRAM, disk or catalog), bit for bit (the restored
blocks' checksums against those the first computed) and by its tokens and logprobs against
the first engine's own prefix-cache hit; the scheduler's counters (what /metrics shows) name
the tier that served each."""

from __future__ import annotations

from pathlib import Path
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
from tests.e2e.test_disk_e2e import Reference, keys_of, push_out

pytestmark = pytest.mark.e2e

C = 256
LONG = 3 * C + 5


def stack_engine(model: str, disk: Path, port: int, prefix: str) -> Any:
    llm = make_llm(model, {"dram_size": "8MiB", "disk_path": str(disk), "disk_size": "64MiB",
                           "remote_url": f"redis://127.0.0.1:{port}",
                           "remote_key_prefix": prefix, "remote_timeout_ms": 2000},
                   num_gpu_blocks_override=160)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def test_evicted_from_dram_restored_from_disk_and_on_another_disk_from_remote(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    _, port = standalone()
    prefix = unique_prefix()
    p = prompt(LONG, seed=23)
    first = stack_engine(tiny_llama_dir, tmp_path / "disk-a", port, prefix)
    try:
        ref = Reference(first, p)  # computes and saves (written through), then its HBM hit
        push_out(first)  # DRAM evicts it to the disk; HBM emptied
        disk, remote = first.kvtier.lower_tier("disk"), first.kvtier.lower_tier("remote")
        keys = keys_of(first, p)
        assert first.kvtier.index.match(0, keys) == 0, "the prompt is still in DRAM"
        assert disk.catalog.index.match(0, keys) == 3, "the prompt was not demoted"
        assert remote.remote.written_through >= 3 and remote.stats.demotions == 0
        before = scheduler_counts(first.kvtier)
        assert ref.matches(first, p)  # restored from the disk
        got = {k: v - before.get(k, 0) for k, v in scheduler_counts(first.kvtier).items()}
        assert got["loaded_tokens"] == 3 * C, got
        assert (got["disk_hits"], got["tier_hit_tokens_disk"]) == (1, 3 * C), got
        assert (got["remote_hits"], got["remote_promoted"]) == (0, 0), got
    finally:
        shutdown(first.llm)
    second = stack_engine(tiny_llama_dir, tmp_path / "disk-b", port, prefix)
    try:
        (out,) = generate(second, [p], greedy())
        counts = scheduler_counts(second.kvtier)
        assert counts["loaded_tokens"] == 3 * C, counts
        assert (counts["remote_hits"], counts["remote_promoted"]) == (1, 3), counts
        assert (counts["tier_hits_remote"], counts["tier_hit_tokens_remote"]) == (1, 3 * C)
        assert (counts["disk_hits"], counts["disk_promotions"]) == (0, 0), counts
        assert _same_blocks(ref.sums, _checksums(second, p))
        assert same_tokens(out, ref.out) and same_logprobs(out, ref.out)
    finally:
        shutdown(second.llm)
    raw = redis.Redis(port=port, socket_timeout=2)
    for k in raw.scan_iter(f"{prefix}:*"):
        raw.delete(k)
