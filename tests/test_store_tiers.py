"""The store's disk tier (issue 18, kvtier.store.tiers): a real ``kvtier store`` process with
``--disk-path``, real files, and engines whose halves attach to it (tests/_store_disk.py)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from _disk_loop import prompt
from _store_disk import StoreLoop, store_config, wait_for
from kvtier.store.client import StoreClient, StoreRefused
from kvtier.store.promotions import STATS_MAX_AGE_S
from kvtier.store.tiers import TICK_S, record_bytes
from kvtier.testing.corruption import flip_stored_byte
from kvtier.testing.store_process import StoreProcess
from kvtier.tiers.disk import chunk_name, file_bytes, namespace_dir
from kvtier.vllm.counters import scheduler_counts

POOL = "4MiB"
DISK = "32MiB"  # a 128 KiB arena's share: 1 MiB, 64 chunk files of 16 KiB


@pytest.fixture
def disk(tmp_path: Path) -> Path:
    return tmp_path / "disk"


@pytest.fixture
def store(tmp_path: Path, disk: Path):  # type: ignore[no-untyped-def]
    s = StoreProcess(tmp_path, size=POOL, disk=(disk, DISK)).start()
    yield s
    s.stop()


def _in_dram(loop: StoreLoop, key: bytes) -> bool:
    return loop.index.get(0, key) is not None


def _push_to_disk(loop: StoreLoop, tokens: list[int], first_seed: int = 100) -> None:
    """Prefill other prompts until every chunk of ``tokens`` left DRAM for the store's disk
    (one prompt at a time, letting the store's demotions keep up, as a server's would)."""
    keys = loop.keys(tokens)[:3]
    seed = first_seed
    while any(_in_dram(loop, k) for k in keys):
        assert seed < first_seed + 40, "the store never demoted the prompt"
        loop.prefill(f"fill{seed}", prompt(seed))
        seed += 1
        time.sleep(4 * TICK_S)  # the store's tier thread saw the saves
        wait_for(lambda: loop.disk_stats()["in_flight"] == 0, timeout=10)  # and caught up
    wait_for(lambda: all(n >= 3 for n in loop.disk_stats()["stored"]))  # type: ignore[attr-defined]


@pytest.mark.parametrize("world", [1, 2])
def test_a_chunk_evicted_from_the_pool_comes_back_from_the_stores_disk_bit_exact(
        store: StoreProcess, disk: Path, world: int) -> None:
    # verify_checksums: the load after the promotion checks the slot against the checksum
    # row the store restored with it; two ranks: the store moves both shards
    cfg = store_config(store_url=store.url, verify_checksums=True,
                       dram_size=f"{128 * world}KiB")  # the same slots per shard
    loop = StoreLoop(cfg, world=world)
    try:
        assert loop.index.attachment is not None and loop.index.attachment.lower
        a = prompt(1)
        loop.prefill("a", a)
        _push_to_disk(loop, a)
        before = loop.disk_stats()
        assert before["demotions"] >= 3  # type: ignore[operator]
        n, deferred, same = loop.restore("a2", a)
        assert (n, same) == (96, True)
        assert deferred >= 1  # the lookup waited for the promotion, within the bound
        after = loop.disk_stats()
        assert after["promotions"] == before["promotions"] + 3  # type: ignore[operator]
        assert all(failed == 0 for r in loop.reports for _, failed in r.loads.values())
        assert all(r.worker.checksum_failures == 0 for r in loop.ranks)
        assert loop.sched.stats.tier_hits["disk"] == 1
        time.sleep(STATS_MAX_AGE_S)
        counts = scheduler_counts(loop.sched)  # the disk gauges read the store's catalog
        assert counts["gauge_disk_chunks_stored"] == after["stored"][0]  # type: ignore[index]
        assert counts["gauge_disk_chunks_total"] == after["capacity"]
        assert loop.sched.tier is not None and loop.sched.tier.stats.hits == 1
        # the files are the store's, under the namespace's directory
        ns = loop.sched.namespace
        keys = loop.keys(a)
        for shard in range(world):
            name = chunk_name(0, keys[0], None)
            assert (namespace_dir(disk, ns) / f"shard{shard}" / name).is_file()
        loop.sched.check_drained()
    finally:
        loop.close()


def test_a_corrupted_file_on_the_stores_disk_is_a_miss_and_counted(
        store: StoreProcess, disk: Path) -> None:
    loop = StoreLoop(store_config(store_url=store.url))
    try:
        a = prompt(2)
        loop.prefill("a", a)
        _push_to_disk(loop, a)
        key = loop.keys(a)[0]
        path = namespace_dir(disk, loop.sched.namespace) / "shard0" / chunk_name(0, key, None)
        raw = bytearray(path.read_bytes())
        raw[4096 + 100] ^= 0xFF  # one payload bit flipped
        path.write_bytes(bytes(raw))
        stored = loop.disk_stats()["stored"][0]  # type: ignore[index]
        n, _, same = loop.restore("a2", a)
        assert (n, same) == (0, True)  # recomputed: never the wrong bytes
        stats = loop.disk_stats()
        assert stats["checksum_failures"] == 1
        assert stats["stored"][0] == stored - 3  # type: ignore[index]  # with its descendants
        wait_for(lambda: not path.exists())  # and its file deleted
        loop.sched.check_drained()
    finally:
        loop.close()


@pytest.mark.parametrize("end", ["stop", "kill"])
def test_a_restarted_store_with_the_same_directory_serves_hits_from_disk(
        tmp_path: Path, disk: Path, end: str) -> None:
    store = StoreProcess(tmp_path, size=POOL, disk=(disk, DISK)).start()
    a = prompt(3)
    try:
        loop = StoreLoop(store_config(store_url=store.url))
        loop.prefill("a", a)
        _push_to_disk(loop, a)
        loop.close()
    finally:
        if end == "kill":
            store.kill()  # SIGKILL: no cleanup of any kind runs in the store
        else:
            store.stop()
    store = StoreProcess(tmp_path, size=POOL, disk=(disk, DISK)).start()
    try:
        loop = StoreLoop(store_config(store_url=store.url))  # a restarted engine, too
        try:
            assert loop.disk_stats()["stored"][0] >= 3  # type: ignore[index]
            n, deferred, same = loop.restore("a2", a)
            assert (n, same, deferred >= 1) == (96, True, True)
            assert loop.disk_stats()["promotions"] == 3
        finally:
            loop.close()
    finally:
        store.stop()


def test_engines_of_another_namespace_never_read_its_files(store: StoreProcess,
                                                           disk: Path) -> None:
    a_loop = StoreLoop(store_config(store_url=store.url))
    b_loop = StoreLoop(store_config(store_url=store.url, namespace_extra="other"))
    try:
        a = prompt(4)
        a_loop.prefill("a", a)
        _push_to_disk(a_loop, a)
        n, deferred, same = b_loop.restore("b", a)
        assert (n, deferred, same) == (0, 0, True)
        assert b_loop.disk_stats()["promotions"] == 0
        def files(loop: StoreLoop) -> list[Path]:
            return list(namespace_dir(disk, loop.sched.namespace).rglob("*.kvc"))

        assert files(a_loop) and not files(b_loop)  # B's own directory: nothing stored yet
        # each namespace's disk budget is its arena's share of the pool (a hard quota)
        lay = a_loop.ranks[0].worker.slab_layout
        share = 32 * 2**20 * lay.total_bytes // (4 * 2**20)
        assert a_loop.disk_stats()["capacity"] == share // file_bytes(record_bytes(lay, 0))
    finally:
        a_loop.close()
        b_loop.close()


def test_the_stores_disk_directory_is_its_own(store: StoreProcess, disk: Path,
                                             tmp_path: Path) -> None:
    second = StoreProcess(tmp_path / "x", size=POOL, disk=(disk, DISK))
    (tmp_path / "x").mkdir()
    with pytest.raises(RuntimeError, match="did not start"):
        second.start()
    c = StoreClient(store.url)  # and an attach without a geometry gets no disk tier
    try:
        att = c.connect({"namespace": b"raw", "arena_bytes": 2**20, "slots": [4],
                         "groups": [[0, True, False]]})
        assert not att.lower
        with pytest.raises(StoreRefused):
            c.call("pin", g=0, keys=[b"k" * 16])
        assert c.call("promote", keys=[b"k" * 16], num_tokens=64, hbm_tokens=0) is None
    finally:
        c.close()


@pytest.mark.parametrize("verify", [True, False])
def test_a_slot_corrupted_in_the_pool_is_never_demoted_as_good(
        store: StoreProcess, verify: bool) -> None:
    # with verify_checksums the workers tell the store how slots are checksummed: it checks
    # each slot before the disk gets it (without, it cannot: the row is not written)
    loop = StoreLoop(store_config(store_url=store.url, verify_checksums=verify))
    try:
        a = prompt(4)
        loop.prefill("a", a)
        keys = loop.keys(a)
        e = loop.index.get(0, keys[1])
        assert e is not None
        flip_stored_byte(loop.ranks[0].worker, loop.sched.slot_class[0], e.slot, offset=33)
        seed = 100
        while _in_dram(loop, keys[0]):  # push the prompt's chunks out of the pool
            assert seed < 140, "the store never demoted the prompt"
            loop.prefill(f"fill{seed}", prompt(seed))
            seed += 1
            time.sleep(4 * TICK_S)
            wait_for(lambda: loop.disk_stats()["in_flight"] == 0, timeout=10)
        stats = loop.disk_stats()
        if verify:
            assert stats["demotions_corrupt"] == 1
            n, _, same = loop.restore("a2", a)
            assert same and n == 32  # chunk 0 from disk; the flipped chunk never restored
        else:
            assert stats["demotions_corrupt"] == 0  # nothing to check against
        loop.sched.check_drained()
    finally:
        loop.close()


def test_a_graceful_stop_writes_what_the_pool_holds_to_the_disk(tmp_path: Path,
                                                               disk: Path) -> None:
    store = StoreProcess(tmp_path, size=POOL, disk=(disk, DISK)).start()
    a = prompt(5)
    try:
        loop = StoreLoop(store_config(store_url=store.url))
        loop.prefill("a", a)
        assert all(_in_dram(loop, k) for k in loop.keys(a)[:3])
        assert loop.disk_stats()["stored"][0] == 0  # type: ignore[index]  # only in the pool
        loop.close()
    finally:
        store.stop()  # SIGTERM: the store writes its pool back before it exits
    store = StoreProcess(tmp_path, size=POOL, disk=(disk, DISK)).start()
    try:
        loop = StoreLoop(store_config(store_url=store.url))
        try:
            assert loop.disk_stats()["stored"][0] >= 3  # type: ignore[index]
            n, deferred, same = loop.restore("a2", a)
            assert (n, same, deferred >= 1) == (96, True, True)
        finally:
            loop.close()
    finally:
        store.stop()
