"""The disk tier under the slab, end to end without an engine: demotion of what DRAM evicts,
promotion before a promise, warm restart, corruption, a full tier, the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from _disk_loop import CHUNK, Loop, config, prompt
from kvtier.scheduler import NewRequest, ScheduledTokens, StepInput
from kvtier.testing.slow_disk import SlowChunkStore
from kvtier.tiers.directory import scan
from kvtier.tiers.disk import PAGE, DiskChunkStore, chunk_name, shard_dir
from kvtier.tiers.fake import MemoryChunkStore
from kvtier.tiers.seam import TierJobKind, TierPlan
from kvtier.worker import disk_store


def fill(loop: Loop, n: int) -> list[list[int]]:
    prompts = [prompt(i) for i in range(n)]
    for i, p in enumerate(prompts):
        loop.prefill(f"p{i}", p)
    loop.settle()
    return prompts


def test_chunks_evicted_from_dram_come_back_from_disk_before_the_promise(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path))
    prompts = fill(loop, 7)  # 21 chunks through a DRAM of 16
    t = loop.sched.tier
    assert t is not None and t.stats.demotions >= 3 and t.stats.demotions_dropped == 0
    keys = loop.keys(prompts[0])
    assert loop.sched.index.match(0, keys) == 0 and t.catalog.index.match(0, keys) == 3
    n, deferred, same = loop.restore("again", prompts[0])
    assert (n, same) == (3 * CHUNK, True)
    assert deferred >= 1 and t.stats.promotions >= 1 and t.stats.hits == 1
    loop.settle()
    loop.sched.check_drained()
    loop.close()


def test_a_restarted_server_serves_hits_from_disk_at_once(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path))
    prompts = fill(loop, 7)
    stored = loop.sched.tier.catalog.stored(0)  # type: ignore[union-attr]
    loop.close()
    again = Loop(config(tmp_path))
    assert again.disk is not None and again.disk.rebuilt == stored
    n, deferred, same = again.restore("after-restart", prompts[0])
    assert (n, same) == (3 * CHUNK, True) and deferred >= 1
    again.close()


@pytest.mark.parametrize("change", [{"model_revision": "v2"}, {"namespace_extra": "other"},
                                    {"kv_cache_dtype": "fp8"}])
def test_a_changed_revision_dtype_or_namespace_is_a_miss(tmp_path: Path,
                                                         change: dict[str, str]) -> None:
    loop = Loop(config(tmp_path))
    prompts = fill(loop, 7)
    loop.close()
    dtype = change.get("kv_cache_dtype", "float32")
    cfg = {k: v for k, v in change.items() if k != "kv_cache_dtype"}
    other = Loop(config(tmp_path, **cfg), kv_cache_dtype=dtype)
    assert other.disk is not None and other.disk.rebuilt == 0
    n, _, same = other.restore("x", prompts[0])
    assert n == 0 and same
    other.close()


def test_a_corrupted_chunk_is_recomputed_counted_and_forgotten(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path))
    prompts = fill(loop, 7)
    t = loop.sched.tier
    assert t is not None
    loop.close()
    found = {c.name.key: c.name for c in scan(Path(loop.disk.lower.root), 1).chunks}  # type: ignore[union-attr]
    again = Loop(config(tmp_path))
    k1 = again.keys(prompts[0])[1]
    name = found[k1]
    path = shard_dir(Path(again.disk.lower.root), 0) / chunk_name(0, k1, name.parent)  # type: ignore[union-attr]
    raw = bytearray(path.read_bytes())
    raw[PAGE + 100] ^= 0x04
    path.write_bytes(bytes(raw))
    n, deferred, same = again.restore("corrupt", prompts[0])
    assert deferred >= 1
    ts = again.sched.tier
    assert ts is not None
    assert same and n == CHUNK  # chunk 0 verified and restored, chunks 1 and 2 recomputed
    assert ts.stats.checksum_failures == 1
    assert again.ranks[0].worker.tiers["disk"].corrupt_reads == 1  # type: ignore[union-attr]
    assert not ts.catalog.index.is_ready(0, k1)  # forgotten, with its descendants
    again.settle()
    again.sched.check_drained()
    again.close()


def _as_format_1(path: Path, shard: int = 0) -> None:
    """Rewrite a chunk file as the previous format wrote it: the same header and payload,
    version 1, the payload summed with kvtier.checksum.checksum under chunk_seed."""
    import hashlib

    import torch

    from kvtier.checksum import checksum, chunk_seed
    from kvtier.tiers import disk

    raw = bytearray(path.read_bytes())
    f = list(disk._HEAD.unpack(bytes(raw[: disk._HEAD.size])))
    group, key = f[2], f[8]
    body = torch.frombuffer(bytearray(raw[PAGE:]), dtype=torch.uint8)
    f[1], f[6] = 1, checksum(body, chunk_seed(key, group, shard))
    head = disk._HEAD.pack(*f)
    raw[: disk._HEAD.size + disk._DIGEST] = head + hashlib.blake2b(
        head, digest_size=disk._DIGEST).digest()
    path.write_bytes(bytes(raw))


def test_files_of_the_previous_format_are_misses_forgotten_and_deleted(tmp_path: Path) -> None:
    """After an upgrade across the file format, a restarted server keeps the old files in its
    index (names only) but never reads them as bytes: the promotion that meets one treats it
    as gone (vanished, not a checksum failure), the prompt is recomputed bit for bit, and the
    files are deleted."""
    loop = Loop(config(tmp_path))
    prompts = fill(loop, 7)
    loop.close()
    root = Path(loop.disk.lower.root)  # type: ignore[union-attr]
    old = {c.name.key: c.name for c in scan(root, 1).chunks}
    keys = loop.keys(prompts[0])
    paths = [shard_dir(root, 0) / chunk_name(0, k, old[k].parent) for k in keys]
    for p in paths:
        _as_format_1(p)
    again = Loop(config(tmp_path))
    ts = again.sched.tier
    assert ts is not None and ts.catalog.index.match(0, keys) == 3
    n, _, same = again.restore("after-upgrade", prompts[0])
    assert same and n == 0
    assert ts.stats.vanished == 3 and ts.stats.checksum_failures == 0  # one job read all 3
    assert again.ranks[0].worker.tiers["disk"].corrupt_reads == 0  # type: ignore[union-attr]
    again.settle()
    assert not any(p.exists() for p in paths)  # forgotten and deleted
    assert ts.catalog.index.match(0, keys) == 0
    again.sched.check_drained()
    again.close()


def test_a_second_engine_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    from kvtier.config import ConfigError

    loop = Loop(config(tmp_path))
    with pytest.raises(ConfigError, match="another engine"):
        Loop(config(tmp_path))
    loop.close()


def test_a_full_tier_declines_demotions_cleanly(tmp_path: Path) -> None:
    stores: list[MemoryChunkStore] = []

    def tiny(plan: TierPlan, shard: int) -> MemoryChunkStore:
        stores.append(MemoryChunkStore(shard, capacity=2 * 8192))  # two chunks, then full
        return stores[-1]

    loop = Loop(config(tmp_path), tier_store=tiny)
    prompts = fill(loop, 7)
    t = loop.sched.tier
    assert t is not None and t.stats.tier_full >= 1 and t.stats.demotion_jobs_failed >= 1
    assert t.stats.demotions <= 2 and len(stores[0].keys()) <= 2
    for i, p in enumerate(prompts):  # every answer is exact: restored or recomputed
        _, _, same = loop.restore(f"r{i}", p)
        assert same
    loop.settle()
    loop.sched.check_drained()
    loop.close()


def test_two_ranks_a_chunk_is_on_the_tier_only_when_both_wrote_it(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path, dram_size="256KiB"), world=2)  # 16 slots of 2 shards
    prompts = fill(loop, 6)
    t = loop.sched.tier
    assert t is not None
    for attempt in range(10):  # new prompts until a step demotes (not a chunk stored before)
        tokens = prompt(500 + attempt)
        req = f"more{attempt}"
        loop.sched.add_request(req)
        loop.sched.lookup(req, tokens, 0)
        blocks = loop.blocks(7)
        loop.compute(req, tokens, blocks)
        plan = loop.sched.schedule_step(StepInput(
            new=[NewRequest(req, [blocks])], scheduled=[ScheduledTokens(req, tokens, 97, 97)]))
        reports = []
        for r in loop.ranks:
            r.worker.begin_step(plan)
            r.worker.end_step(plan)
            r.worker.drain()
            reports.append(r.worker.collect().report)
        loop.sched.request_finished(req)
        if any(j.kind is TierJobKind.DEMOTE for p in plan.tiers for j in p.jobs):
            break
        loop.sched.on_report(reports[0].add(reports[1]))
    else:
        raise AssertionError("no step demoted")
    before = t.stats.demotions
    loop.sched.on_report(reports[0])
    assert t.stats.demotions == before  # rank 1 has not reported its shard yet
    loop.sched.on_report(reports[1])
    assert t.stats.demotions > before
    loop.settle()
    found = {(c.name.group, c.name.key) for c in scan(Path(t.tier.root), 2).chunks}
    assert {(0, key) for key in loop.keys(prompts[0])} <= found  # in both shards
    n, _, same = loop.restore("back", prompts[0])
    assert same and n == 3 * CHUNK
    loop.settle()
    loop.sched.check_drained()
    loop.close()


def test_a_slow_disk_loses_to_recompute_and_a_fast_one_wins(tmp_path: Path) -> None:
    def slow(plan: TierPlan, shard: int) -> SlowChunkStore:
        return SlowChunkStore(disk_store(plan, shard), gbps=0.0005)  # 8 KiB in ~16 ms

    def slow_probe(root: Path, shard: int) -> SlowChunkStore:
        return SlowChunkStore(DiskChunkStore(root, shard, NS_OF[0]), gbps=0.0005)

    cfg = config(tmp_path, cost_model=True, prefill_seconds_per_token=1e-5,
                 link_gbps=100.0, step_seconds=0.0)
    loop = Loop(cfg)
    prompts = fill(loop, 7)
    loop.close()
    NS_OF.append(loop.sched.namespace)
    slowed = Loop(cfg, tier_store=slow, open_store=slow_probe)
    t = slowed.sched.tier
    assert t is not None and t.tier.cost.gbps < 0.01  # the probe measured the slow disk
    n, deferred, same = slowed.restore("slow", prompts[0])
    assert (n, deferred, same) == (0, 0, True) and t.stats.declined_slower == 1
    slowed.close()
    fast = Loop(cfg.model_copy(update={"prefill_seconds_per_token": 1e-3}))
    n, deferred, same = fast.restore("fast", prompts[0])
    assert n == 3 * CHUNK and deferred >= 1 and same
    fast.close()


NS_OF: list[bytes] = []


def test_past_the_deferral_bound_the_request_goes_on_with_what_dram_holds(
        tmp_path: Path) -> None:
    def slow(plan: TierPlan, shard: int) -> SlowChunkStore:
        return SlowChunkStore(disk_store(plan, shard), gbps=1.0, latency_s=0.2)

    loop = Loop(config(tmp_path))
    prompts = fill(loop, 7)
    loop.close()
    clock = [100.0]
    slowed = Loop(config(tmp_path, prepare_timeout_ms=50.0), tier_store=slow,
                  clock=lambda: clock[0])
    t = slowed.sched.tier
    assert t is not None
    slowed.sched.add_request("bounded")
    assert slowed.sched.lookup("bounded", prompts[0], 0) is None  # the promotion starts
    w = slowed.ranks[0].worker
    plan = slowed.sched.schedule_step(StepInput())
    w.begin_step(plan)  # the reads take 0.6 s; the step ends before they do
    slowed.sched.on_report(w.collect().report)
    assert slowed.sched.lookup("bounded", prompts[0], 0) is None  # within the bound
    clock[0] += 1.0  # a second later
    assert slowed.sched.lookup("bounded", prompts[0], 0) == 0  # DRAM holds none of it
    assert slowed.sched.stats.prepare_timeouts == 1 and t.stats.promotions == 0
    w.drain()
    slowed.sched.on_report(w.collect().report)
    assert t.stats.promotions == 3  # it landed for the next request
    slowed.sched.request_finished("bounded")
    slowed.settle()
    slowed.sched.check_drained()
    slowed.close()
