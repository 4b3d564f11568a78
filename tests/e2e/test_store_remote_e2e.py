"""The store's remote tier (issue 18) under a vLLM CPU engine attached to the store, on a
real Redis server: a prefix pushed out of the store's pool comes back from the remote, and
a store restarted with an empty pool serves it from the remote (found by discovery), bit for
bit (the restored blocks' checksums against those run A computed) and with the tokens and
logprobs of vLLM's own prefix cache (tests/e2e/test_disk_e2e.py's checks). The store moves
every remote byte.

The engine's arena holds 16 chunks (8MiB of 512KiB chunks); each prompt is three chunks and
five tokens, so seven other prompts push a prompt out of the pool."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _redis import standalone, unique_prefix
from kvtier.store.index import StoreIndex
from kvtier.store.promotions import StorePromotions
from kvtier.testing.restore import _checksums, _same_blocks, generate, same_logprobs, same_tokens
from kvtier.testing.store_process import StoreProcess
from tests.e2e.conftest import greedy, prompt, shutdown
from tests.e2e.test_disk_e2e import LONG, Reference, keys_of
from tests.e2e.test_store_disk_e2e import C, push_out, store_engine

pytestmark = pytest.mark.e2e


def test_a_prefix_pushed_out_of_the_stores_pool_is_restored_from_its_remote_tier(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    host, port = standalone()
    remote = ("--remote-url", f"redis://{host}:{port}", "--remote-key-prefix", unique_prefix(),
              "--remote-size", "256MiB", "--remote-timeout-ms", "2000")
    # lookups lease what they find (run C's too) for the TTL: short, so the prompt can leave
    store = StoreProcess(tmp_path, size="64MiB", lease_ttl=0.5, extra=remote).start()
    p = prompt(LONG, seed=1)
    try:
        h = store_engine(tiny_llama_dir, store.url)
        try:
            index, tier = h.kvtier.index, h.kvtier.tier
            assert isinstance(index, StoreIndex) and index.tier_names == ("remote",)
            assert isinstance(tier, StorePromotions)
            ref = Reference(h, p)
            time.sleep(1.0)  # its leases ended
            push_out(h)
            keys = keys_of(h, p)
            assert index.get(0, keys[0]) is None, "the prompt is still in the store's pool"
            assert index.tier_stats()["remote"]["written_through"] >= 3
            before = h.kvtier.stats.loaded_tokens
            assert ref.matches(h, p)
            assert h.kvtier.stats.loaded_tokens - before == 3 * C
            assert tier.stats.hits == 1 and tier.stats.promotions >= 1
            assert h.kvtier.stats.tier_hits["remote"] == 1
            sums, out = ref.sums, ref.out
        finally:
            shutdown(h.llm)
    finally:
        store.stop()
    store = StoreProcess(tmp_path, size="64MiB", extra=remote).start()  # an empty pool
    try:
        h = store_engine(tiny_llama_dir, store.url)
        try:
            assert h.kvtier.index.stats().stored == 0
            (again,) = generate(h, [p], greedy())
            assert h.kvtier.stats.loaded_tokens == 3 * C
            assert h.kvtier.stats.tier_hits["remote"] == 1
            assert h.kvtier.index.tier_stats()["remote"]["discovered"] >= 3
            assert _same_blocks(sums, _checksums(h, p))
            assert same_tokens(again, out) and same_logprobs(again, out)
            h.kvtier.check_drained()
        finally:
            shutdown(h.llm)
    finally:
        store.stop()
