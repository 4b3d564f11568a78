"""The remote tier under the slab, end to end without an engine, on a real Redis server:
two engines sharing one store (a prefix one computed, the other restores bit for bit, also
after both restart), write-through, discovery that defers within its bound, and a dead or
stopped server that turns into misses without stalling a step."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from _disk_loop import CHUNK, prompt
from _redis import RedisProcess, standalone, unique_prefix
from _remote_loop import RemoteLoop, remote_config
from kvtier.testing.slow_disk import SlowChunkStore
from kvtier.vllm.counters import scheduler_counts


@pytest.fixture
def shared() -> Iterator[tuple[int, str]]:
    _, port = standalone()
    prefix = unique_prefix()
    yield port, prefix
    raw = redis.Redis(port=port, socket_timeout=2)
    for k in raw.scan_iter(f"{prefix}:*"):
        raw.delete(k)


def test_a_prefix_one_engine_computed_is_restored_by_another(shared: tuple[int, str]) -> None:
    port, prefix = shared
    first, second = RemoteLoop(remote_config(port, prefix)), RemoteLoop(remote_config(port, prefix))
    p = prompt(1)
    first.prefill("a", p)
    first.settle()
    assert first.tier.remote.written_through == 3  # while it still holds them in DRAM
    n, deferred, same = second.restore("b", p)
    assert (n, same) == (3 * CHUNK, True) and deferred >= 2  # ask the server, then promote
    t = second.tier
    assert t.remote.discovered == 3 and t.stats.promotions == 3 and t.stats.hits == 1
    counts = scheduler_counts(second.sched)  # what /metrics shows
    assert (counts["remote_hits"], counts["remote_hit_tokens"], counts["remote_discovered"],
            counts["remote_promoted"]) == (1, 3 * CHUNK, 3, 3)
    assert scheduler_counts(first.sched)["remote_written_through"] == 3
    # the per-tier series: the remote tier provided the whole hit, DRAM none of it
    assert (counts["tier_hits_remote"], counts["tier_hit_tokens_remote"]) == (1, 3 * CHUNK)
    assert counts.get("tier_hit_tokens_dram", 0) == 0
    # and not as the disk's: the disk series read only a disk tier
    assert (counts["disk_hits"], counts["disk_promotions"], counts["gauge_disk_chunks_total"]) \
        == (0, 0, 0)
    second.settle()
    second.sched.check_drained()
    first.close()
    second.close()
    # both restart: nothing in DRAM, nothing in their catalogs; the store still has it
    again = RemoteLoop(remote_config(port, prefix))
    n, _, same = again.restore("c", p)
    assert (n, same) == (3 * CHUNK, True) and again.tier.remote.discovered == 3
    again.close()


def test_another_prefix_or_deployment_prefix_is_a_miss(shared: tuple[int, str]) -> None:
    port, prefix = shared
    first = RemoteLoop(remote_config(port, prefix))
    first.prefill("a", prompt(1))
    first.settle()
    other = RemoteLoop(remote_config(port, prefix, namespace_extra="other"))
    n, _, same = other.restore("b", prompt(1))
    assert (n, same) == (0, True) and other.tier.remote.discovered == 0
    n, _, _ = first.restore("c", prompt(2))
    assert n == 0
    first.close()
    other.close()


def test_a_dead_then_stopped_server_never_stalls_a_step_and_recovers(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path)
    cfg = remote_config(server.port, unique_prefix(), remote_timeout_ms=100,
                        remote_breaker_cooldown_ms=300, disk_max_defer_ms=300)
    try:
        first, second = RemoteLoop(cfg), RemoteLoop(cfg)
        first.prefill("a", prompt(1))
        first.settle()
        for fault in ("kill", "stop"):
            server.kill() if fault == "kill" else server.stop()
            t0 = time.perf_counter()
            for i in range(3):  # computing goes on: saves land in DRAM, copies are dropped
                # fresh prompts each round (one DRAM holds whole is answered at once)
                first.prefill(f"{fault}{i}", prompt(10 + i + 3 * (fault == "stop")))
            n, _, same = second.restore(f"r-{fault}", prompt(1))  # a miss, not a wait
            took = time.perf_counter() - t0
            assert (n, same) == (0, True) and took < 3.0, took
            server.start() if fault == "kill" else server.resume()
            time.sleep(0.4)
            second.settle()
        assert first.tier.remote.write_through_dropped > 0
        first.prefill("after", prompt(20))  # the breaker closed again: copies land
        first.settle()
        before = first.tier.remote.written_through
        assert before >= 3
        third = RemoteLoop(cfg)
        n, _, same = third.restore("back", prompt(20))
        assert (n, same) == (3 * CHUNK, True)
        for loop in (first, second, third):
            loop.close()
    finally:
        server.close()


def test_the_cost_model_declines_a_slow_remote_tier_and_takes_a_fast_one(
        shared: tuple[int, str]) -> None:
    """Injected latency (kvtier.testing.slow_disk's delaying wrapper around the Redis store,
    probe included): restoring through it would be slower than recomputing."""
    port, prefix = shared
    cfg = remote_config(port, prefix, cost_model=True, prefill_seconds_per_token=1e-5,
                        link_gbps=100.0, step_seconds=0.0, remote_timeout_ms=1000)
    writer = RemoteLoop(cfg)
    writer.prefill("a", prompt(3))
    writer.settle()
    writer.close()
    slow = RemoteLoop(cfg, wrap=lambda s: SlowChunkStore(s, gbps=1.0, latency_s=0.05))
    assert slow.tier.tier.cost.latency_s >= 0.05  # the probe measured the delay
    n, _, same = slow.restore("slow", prompt(3))
    assert (n, same) == (0, True) and slow.tier.stats.declined_slower == 1
    assert slow.tier.remote.discovered == 3  # found, and declined: 3 chunks take 0.15 s
    slow.close()
    fast = RemoteLoop(cfg.model_copy(update={"prefill_seconds_per_token": 1e-3}))
    n, _, same = fast.restore("fast", prompt(3))
    assert (n, same) == (3 * CHUNK, True) and fast.tier.stats.declined_slower == 0
    fast.close()



def test_a_chunk_the_server_evicted_is_a_miss_forgotten_and_the_prefix_before_it_lands(
        shared: tuple[int, str]) -> None:
    """A server under maxmemory evicts whole chunks this engine's catalog still lists: the
    promotion keeps what came before the evicted one, and the catalog forgets it and what
    hangs below it (no later lookup reads it again)."""
    port, prefix = shared
    loop = RemoteLoop(remote_config(port, prefix))
    p = prompt(6)
    loop.prefill("a", p)
    for i in range(7):  # 21 chunks through a DRAM of 16: p leaves DRAM
        loop.prefill(f"fill{i}", prompt(200 + i))
    loop.settle()
    keys = loop.keys(p)
    t = loop.tier
    assert loop.sched.index.match(0, keys) == 0 and t.catalog.index.match(0, keys) == 3
    tag = loop.remote.directory.shards[0].keys.tag(0, keys[1], 0)
    raw = redis.Redis(port=port, socket_timeout=2)
    assert raw.delete(*raw.keys(f"{tag}:*")) >= 2  # its head and its parts: evicted
    n, _, same = loop.restore("b", p)
    assert (n, same) == (CHUNK, True)  # chunk 0 restored, 1 and 2 recomputed
    assert t.stats.vanished == 1 and t.stats.checksum_failures == 0
    assert t.catalog.index.match(0, keys) == 1  # 1 forgotten, with 2 below it
    failed = t.stats.promotion_jobs_failed
    n, _, same = loop.restore("c", p)  # asks the server again: 1 is not there
    assert (n, same) == (CHUNK, True) and t.stats.promotion_jobs_failed == failed
    loop.settle()
    loop.sched.check_drained()
    loop.close()
