"""The remote tier below the disk tier (DRAM -> disk -> remote), end to end without an engine,
on real files and a real Redis server: the lookup order (DRAM, then the disk, then the
remote store), promotion from both tiers into DRAM before the promise, eviction to the disk
and write-through to the store, the cost model per tier, a dead or stopped server that never
touches a disk hit, and per-tier metrics that name the tier that served."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from _disk_loop import CHUNK, prompt
from _redis import RedisProcess, standalone, unique_prefix
from _stack_loop import StackLoop, stack_config
from kvtier.testing.slow_disk import SlowChunkStore
from kvtier.tiers.directory import scan
from kvtier.tiers.disk import PAGE, chunk_name, shard_dir
from kvtier.vllm.counters import scheduler_counts


def long_prompt(seed: int, chunks: int) -> list[int]:
    """``chunks`` whole chunks and one token; ``long_prompt(s, 3)`` is ``prompt(s)``, and a
    longer one with the same seed extends it."""
    return [(seed * 7919 + 31 * i) % 997 + 3 for i in range(chunks * CHUNK + 1)]


_FILLS = itertools.count(100)


def push_out_of_dram(loop: StackLoop, n: int = 7) -> None:
    """Compute ``n`` prompts never seen before (21 chunks through a DRAM of 16): the earlier
    prompts' chunks leave DRAM, demoted to the disk."""
    for _ in range(n):
        seed = next(_FILLS)
        loop.prefill(f"fill{seed}", prompt(seed))
    loop.settle()


@pytest.fixture
def shared() -> Iterator[tuple[int, str]]:
    _, port = standalone()
    prefix = unique_prefix()
    yield port, prefix
    raw = redis.Redis(port=port, socket_timeout=2)
    for k in raw.scan_iter(f"{prefix}:*"):
        raw.delete(k)


def test_dram_then_disk_then_remote(tmp_path: Path, shared: tuple[int, str]) -> None:
    port, prefix = shared
    a = StackLoop(stack_config(tmp_path / "a", port, prefix))
    p = prompt(1)
    a.prefill("p", p)
    a.settle()
    assert a.on_remote.remote.written_through == 3  # write-through after the DRAM saves
    push_out_of_dram(a)
    keys = a.keys(p)
    assert a.sched.index.match(0, keys) == 0 and a.on_disk.catalog.index.match(0, keys) == 3
    # DRAM's evictions went to the disk; the store below it only takes write-through
    assert a.on_disk.stats.demotions >= 3 and a.on_remote.stats.demotions == 0
    queries = a.on_remote.remote.queries
    n, deferred, same = a.restore("from-disk", p)
    assert (n, same) == (3 * CHUNK, True) and deferred >= 1
    assert a.on_disk.stats.promotions == 3 and a.on_remote.stats.promotions == 0
    assert a.on_remote.remote.queries == queries  # the disk held it all: the store not asked
    counts = scheduler_counts(a.sched)
    assert (counts["disk_hits"], counts["disk_hit_tokens"], counts["remote_hits"]) \
        == (1, 3 * CHUNK, 0)
    assert (counts["tier_hits_disk"], counts["tier_hit_tokens_disk"]) == (1, 3 * CHUNK)
    assert counts.get("tier_hit_tokens_remote", 0) == 0
    assert counts["disk_promotions"] == 3 and counts["remote_promoted"] == 0
    # another host: its own (empty) disk directory, the same store
    b = StackLoop(stack_config(tmp_path / "b", port, prefix))
    n, deferred, same = b.restore("from-remote", p)
    assert (n, same) == (3 * CHUNK, True) and deferred >= 2  # ask the server, then promote
    assert b.on_remote.stats.promotions == 3 and b.on_disk.stats.promotions == 0
    counts = scheduler_counts(b.sched)
    assert (counts["remote_hits"], counts["remote_hit_tokens"], counts["disk_hits"]) \
        == (1, 3 * CHUNK, 0)
    assert (counts["tier_hits_remote"], counts["tier_hit_tokens_remote"]) == (1, 3 * CHUNK)
    assert counts.get("tier_hit_tokens_disk", 0) == 0
    assert (counts["remote_bytes_read"] > 0, counts["disk_bytes_read"]) == (True, 0)
    for loop in (a, b):
        loop.settle()
        loop.sched.check_drained()
        loop.close()


def test_a_prefix_partly_on_disk_takes_the_rest_from_the_store(
        tmp_path: Path, shared: tuple[int, str]) -> None:
    port, prefix = shared
    long = long_prompt(2, 5)
    b = StackLoop(stack_config(tmp_path / "b", port, prefix))
    b.prefill("long", long)  # another host wrote five chunks to the store
    b.settle()
    a = StackLoop(stack_config(tmp_path / "a", port, prefix))
    a.prefill("short", long_prompt(2, 3))  # this host computed the first three
    a.settle()
    push_out_of_dram(a)
    keys = a.keys(long)
    assert a.sched.index.match(0, keys) == 0 and a.on_disk.catalog.index.match(0, keys) == 3
    n, _, same = a.restore("long-again", long)
    assert (n, same) == (5 * CHUNK, True)
    # the disk's chunks from the disk, only the rest from the store
    assert a.on_disk.stats.promotions == 3 and a.on_remote.stats.promotions == 2
    counts = scheduler_counts(a.sched)
    assert (counts["tier_hit_tokens_disk"], counts["tier_hit_tokens_remote"]) \
        == (3 * CHUNK, 2 * CHUNK)
    assert (counts["disk_hits"], counts["remote_hits"]) == (1, 1)
    assert counts.get("tier_hit_tokens_dram", 0) == 0
    for loop in (a, b):
        loop.settle()
        loop.sched.check_drained()
        loop.close()


def test_the_cost_model_declines_a_slow_store_and_still_promotes_from_disk(
        tmp_path: Path, shared: tuple[int, str]) -> None:
    port, prefix = shared
    long = long_prompt(3, 5)
    b = StackLoop(stack_config(tmp_path / "b", port, prefix))
    b.prefill("long", long)
    b.settle()
    b.close()
    # reading the store costs 50 ms a chunk, recomputing one 32 ms, reading the disk about
    # 1 ms (far less even on a busy machine): the store's two chunks cost more than they
    # save, the disk's three save 90 ms
    cfg = stack_config(tmp_path / "a", port, prefix, cost_model=True, link_gbps=100.0,
                       prefill_seconds_per_token=1e-3, step_seconds=0.0,
                       remote_timeout_ms=1000)
    a = StackLoop(cfg, wrap_remote=lambda s: SlowChunkStore(s, gbps=1.0, latency_s=0.05))
    assert a.on_remote.tier.cost.latency_s >= 0.05  # its own probe measured the delay
    assert a.on_disk.tier.cost.latency_s < 0.01
    a.prefill("short", long_prompt(3, 3))
    a.settle()
    push_out_of_dram(a)
    n, _, same = a.restore("long-again", long)
    assert (n, same) == (3 * CHUNK, True)  # the disk's part, not the store's
    assert a.on_disk.stats.promotions == 3 and a.on_remote.stats.promotions == 0
    assert a.on_remote.stats.declined_slower == 1 and a.on_disk.stats.declined_slower == 0
    counts = scheduler_counts(a.sched)
    assert (counts["remote_declined_slower"], counts["disk_declined_slower"]) == (1, 0)
    a.settle()
    a.sched.check_drained()
    a.close()


def test_a_dead_or_stopped_store_never_touches_a_disk_hit(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path)
    cfg = stack_config(tmp_path / "disk", server.port, unique_prefix(), remote_timeout_ms=100,
                       remote_breaker_cooldown_ms=300, prepare_timeout_ms=300)
    try:
        a = StackLoop(cfg)
        p, longer = long_prompt(4, 3), long_prompt(4, 5)
        a.prefill("p", p)
        a.settle()
        for fault in ("kill", "stop"):
            server.kill() if fault == "kill" else server.stop()
            demotions = a.on_disk.stats.demotions
            push_out_of_dram(a)  # demotions to the disk go on; copies to the store drop
            assert a.on_disk.stats.demotions > demotions
            assert a.on_disk.stats.demotion_jobs_failed == 0
            t0 = time.perf_counter()
            n, _, same = a.restore(f"p-{fault}", p)  # all on disk: the store is not asked
            assert (n, same) == (3 * CHUNK, True) and time.perf_counter() - t0 < 1.0
            push_out_of_dram(a)
            t0 = time.perf_counter()
            n, _, same = a.restore(f"longer-{fault}", longer)  # the store is asked, fails
            assert (n, same) == (3 * CHUNK, True) and time.perf_counter() - t0 < 2.0
            server.start() if fault == "kill" else server.resume()
            time.sleep(0.4)
            a.settle()
        assert a.on_remote.remote.write_through_dropped > 0
        assert a.on_disk.stats.promotion_jobs_failed == 0
        a.settle()
        a.sched.check_drained()
        a.close()
    finally:
        server.close()


def test_checksum_failures_count_on_the_tier_that_failed_and_the_store_fills_in(
        tmp_path: Path, shared: tuple[int, str]) -> None:
    port, prefix = shared
    a = StackLoop(stack_config(tmp_path / "a", port, prefix))
    p = prompt(5)
    a.prefill("p", p)
    a.settle()
    push_out_of_dram(a)
    k1 = a.keys(p)[1]
    found = {c.name.key: c.name for c in scan(Path(a.disk.lower.root), 1).chunks}
    path = shard_dir(Path(a.disk.lower.root), 0) / chunk_name(0, k1, found[k1].parent)
    raw = bytearray(path.read_bytes())
    raw[PAGE + 100] ^= 0x04
    path.write_bytes(bytes(raw))
    n, _, same = a.restore("corrupt", p)
    assert (n, same) == (CHUNK, True)  # chunk 0 from disk; 1 and 2 did not verify there
    counts = scheduler_counts(a.sched)
    assert (counts["disk_checksum_failures"], counts["remote_checksum_failures"]) == (1, 0)
    n, _, same = a.restore("again", p)  # the disk forgot them: the store has them
    assert (n, same) == (3 * CHUNK, True)
    assert a.on_remote.stats.promotions == 2
    counts = scheduler_counts(a.sched)
    assert (counts["tier_hit_tokens_remote"], counts["remote_hits"]) == (2 * CHUNK, 1)
    a.settle()
    a.sched.check_drained()
    a.close()


def test_a_chunk_gone_from_disk_is_forgotten_there_and_the_store_serves_it(
        tmp_path: Path, shared: tuple[int, str]) -> None:
    port, prefix = shared
    a = StackLoop(stack_config(tmp_path / "a", port, prefix))
    p = prompt(7)
    a.prefill("p", p)
    a.settle()
    push_out_of_dram(a)
    k1 = a.keys(p)[1]
    found = {c.name.key: c.name for c in scan(Path(a.disk.lower.root), 1).chunks}
    (shard_dir(Path(a.disk.lower.root), 0) / chunk_name(0, k1, found[k1].parent)).unlink()
    n, _, same = a.restore("gone", p)
    assert (n, same) == (CHUNK, True)  # chunk 0 from disk, the rest recomputed
    assert a.on_disk.stats.vanished == 1 and a.on_disk.stats.checksum_failures == 0
    n, _, same = a.restore("again", p)  # the disk forgot it: the store has it
    assert (n, same) == (3 * CHUNK, True) and a.on_remote.stats.promotions == 2
    a.settle()
    a.sched.check_drained()
    a.close()


def test_a_disk_part_that_fails_credits_neither_tier_and_the_store_serves_it_next(
        tmp_path: Path, shared: tuple[int, str]) -> None:
    """One promotion, disk chunks 0-2 and store chunks 3-4; disk chunk 1 does not verify:
    chunk 0 lands (DRAM's hit now), the store's part hangs below the failed one and is
    dropped, and neither lower tier is credited with the hit."""
    port, prefix = shared
    long = long_prompt(8, 5)
    b = StackLoop(stack_config(tmp_path / "b", port, prefix))
    b.prefill("long", long)
    b.settle()
    b.close()
    a = StackLoop(stack_config(tmp_path / "a", port, prefix))
    a.prefill("short", long_prompt(8, 3))
    a.settle()
    push_out_of_dram(a)
    k1 = a.keys(long)[1]
    found = {c.name.key: c.name for c in scan(Path(a.disk.lower.root), 1).chunks}
    path = shard_dir(Path(a.disk.lower.root), 0) / chunk_name(0, k1, found[k1].parent)
    raw = bytearray(path.read_bytes())
    raw[PAGE + 100] ^= 0x04
    path.write_bytes(bytes(raw))
    n, _, same = a.restore("corrupt", long)
    assert (n, same) == (CHUNK, True)
    counts = scheduler_counts(a.sched)
    assert (counts["disk_checksum_failures"], counts["remote_promoted"]) == (1, 0)
    assert counts.get("tier_hit_tokens_disk", 0) == counts.get("tier_hit_tokens_remote", 0) == 0
    assert counts["tier_hit_tokens_dram"] == CHUNK
    n, _, same = a.restore("again", long)  # the store serves what the disk lost
    assert (n, same) == (5 * CHUNK, True)
    counts = scheduler_counts(a.sched)
    assert counts["tier_hit_tokens_remote"] == 4 * CHUNK and counts["remote_promoted"] == 4
    a.settle()
    a.sched.check_drained()
    a.close()
