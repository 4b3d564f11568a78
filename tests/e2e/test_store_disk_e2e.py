"""The store's disk tier (issue 18) under a vLLM CPU engine attached to the store: a prefix
evicted from the store's pool comes back from the store's disk, then from the same
directory after the store and the engine restart, bit for bit (the restored blocks'
checksums against those run A computed) and with the tokens and logprobs of vLLM's own
prefix cache (tests/e2e/test_disk_e2e.py's checks; the store moves every disk byte).

The engine's arena holds 16 chunks (8MiB of 512KiB chunks); each prompt is three chunks and
five tokens, so seven other prompts push a prompt out of the pool."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.store.index import StoreIndex
from kvtier.store.promotions import StorePromotions
from kvtier.testing.restore import (
    _checksums,
    _same_blocks,
    generate,
    handles,
    same_logprobs,
    same_tokens,
    sharpen_dummy_weights,
)
from kvtier.testing.store_process import StoreProcess
from tests.e2e.conftest import greedy, make_llm, prompt, shutdown
from tests.e2e.test_disk_e2e import LONG, Reference, keys_of

pytestmark = pytest.mark.e2e

C = 256


def store_engine(model: str, url: str) -> Any:
    h = handles(make_llm(model, {"dram_size": "8MiB", "store_url": url},
                         num_gpu_blocks_override=160))
    sharpen_dummy_weights(h)
    return h


def push_out(h: Any, n: int = 7, seed: int = 100) -> None:
    """Run ``n`` other prompts (the store's pool evicts, its disk takes them; the store's
    tier thread gets a moment between prompts, as between a server's requests)."""
    for i in range(n):
        generate(h, [prompt(LONG, seed=seed + i)], greedy(max_tokens=1))
        time.sleep(0.2)
    h.llm.reset_prefix_cache()


def test_a_prefix_evicted_from_the_stores_pool_is_restored_from_its_disk(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    disk = (tmp_path / "disk", "256MiB")
    # lookups lease what they find (run C's too) for the TTL: short, so the prompt can leave
    store = StoreProcess(tmp_path, size="64MiB", lease_ttl=0.5, disk=disk).start()
    p = prompt(LONG, seed=1)
    try:
        h = store_engine(tiny_llama_dir, store.url)
        try:
            index, tier = h.kvtier.index, h.kvtier.tier
            assert isinstance(index, StoreIndex) and index.has_lower
            assert isinstance(tier, StorePromotions)
            ref = Reference(h, p)
            time.sleep(1.0)  # its leases ended
            push_out(h)
            keys = keys_of(h, p)
            assert index.get(0, keys[0]) is None, "the prompt is still in the store's pool"
            disk_stats = index.disk_stats()
            assert disk_stats is not None and disk_stats["stored"][0] >= 3
            before = h.kvtier.stats.loaded_tokens
            assert ref.matches(h, p)
            assert h.kvtier.stats.loaded_tokens - before == 3 * C
            assert tier.stats.hits == 1 and tier.stats.promotions >= 1
            assert h.kvtier.stats.tier_hits["disk"] == 1
            sums, out = ref.sums, ref.out
        finally:
            shutdown(h.llm)
    finally:
        store.stop()
    store = StoreProcess(tmp_path, size="64MiB", disk=disk).start()  # the same directory
    try:
        h = store_engine(tiny_llama_dir, store.url)
        try:
            (again,) = generate(h, [p], greedy())
            assert h.kvtier.stats.loaded_tokens == 3 * C
            assert h.kvtier.tier.stats.hits == 1
            assert _same_blocks(sums, _checksums(h, p))
            assert same_tokens(again, out) and same_logprobs(again, out)
            h.kvtier.check_drained()
        finally:
            shutdown(h.llm)
    finally:
        store.stop()
