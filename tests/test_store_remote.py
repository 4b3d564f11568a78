"""The store's remote tier (issue 18, kvtier.store.remote): a real ``kvtier store`` process
with ``--remote-url`` on a real Redis server (tests/_redis.py), and engines whose halves
attach to the store (tests/_store_disk.py). The store moves every remote byte."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis

from _disk_loop import prompt
from _redis import standalone, unique_prefix
from _store_disk import StoreLoop, store_config, wait_for
from kvtier.store.tiers import TICK_S
from kvtier.testing.store_process import StoreProcess

POOL = "4MiB"
DISK = "32MiB"


def remote_flags(prefix: str) -> tuple[str, ...]:
    host, port = standalone()
    return ("--remote-url", f"redis://{host}:{port}", "--remote-key-prefix", prefix,
            "--remote-size", "64MiB", "--remote-timeout-ms", "2000")


def _in_dram(loop: StoreLoop, key: bytes) -> bool:
    return loop.index.get(0, key) is not None


def _remote(loop: StoreLoop) -> dict[str, object]:
    return loop.index.tier_stats()["remote"]


def _push_out(loop: StoreLoop, tokens: list[int], first_seed: int = 100) -> None:
    """Prefill other prompts until no chunk of ``tokens`` is in the store's pool (letting
    the store's tier thread keep up between prompts, as a server's would)."""
    keys = loop.keys(tokens)[:3]
    seed = first_seed
    while any(_in_dram(loop, k) for k in keys):
        assert seed < first_seed + 40, "the pool never evicted the prompt"
        loop.prefill(f"fill{seed}", prompt(seed))
        seed += 1
        time.sleep(4 * TICK_S)
        wait_for(lambda: all(s["in_flight"] == 0 for s in loop.index.tier_stats().values()),
                 timeout=10)


def _server_keys(prefix: str) -> int:
    host, port = standalone()
    return sum(1 for _ in redis.Redis(host=host, port=port).scan_iter(f"{prefix}:*"))


def test_a_prefix_pushed_out_of_the_pool_comes_back_from_the_remote_bit_exact(
        tmp_path: Path) -> None:
    prefix = unique_prefix()
    store = StoreProcess(tmp_path, size=POOL, extra=remote_flags(prefix)).start()
    try:
        assert "remote redis://" in store.ready_line
        # verify_checksums: the load after the promotion checks the slot against the
        # checksum row the store restored with it
        loop = StoreLoop(store_config(store_url=store.url, verify_checksums=True))
        try:
            att = loop.index.attachment
            assert att is not None and att.discovers and att.tiers == ("remote",)
            a = prompt(1)
            loop.prefill("a", a)
            wait_for(lambda: _remote(loop)["written_through"] >= 3)  # type: ignore[operator]
            assert _server_keys(prefix) >= 3 * 2  # a head and a part per chunk
            _push_out(loop, a)
            n, deferred, same = loop.restore("a2", a)
            assert (n, same) == (96, True)
            assert deferred >= 1  # the lookup waited for the promotion, within the bound
            assert _remote(loop)["promotions"] == 3
            assert loop.sched.stats.tier_hits["remote"] == 1
            assert all(failed == 0 for r in loop.reports for _, failed in r.loads.values())
            assert all(r.worker.checksum_failures == 0 for r in loop.ranks)
            loop.sched.check_drained()
        finally:
            loop.close()
    finally:
        store.stop()


@pytest.mark.parametrize("with_disk", [False, True])
def test_a_store_restarted_with_an_empty_pool_serves_the_prefix_from_the_remote(
        tmp_path: Path, with_disk: bool) -> None:
    """Pool -> remote, and pool -> disk -> remote with the restarted store on a new, empty
    disk: the prefix is found on the server (discovery) and promoted into the pool."""
    prefix = unique_prefix()
    a = prompt(2)

    def start(disk_dir: str) -> StoreProcess:
        disk = (tmp_path / disk_dir, DISK) if with_disk else None
        return StoreProcess(tmp_path, size=POOL, disk=disk, extra=remote_flags(prefix)).start()

    store = start("disk1")
    try:
        loop = StoreLoop(store_config(store_url=store.url))
        loop.prefill("a", a)
        wait_for(lambda: _remote(loop)["written_through"] >= 3)  # type: ignore[operator]
        loop.close()
    finally:
        store.kill()  # SIGKILL: the pool goes with it
    store = start("disk2")
    try:
        loop = StoreLoop(store_config(store_url=store.url))  # a restarted engine, too
        try:
            assert loop.index.stats().stored == 0  # nothing in the new pool
            n, deferred, same = loop.restore("a2", a)
            assert (n, same, deferred >= 1) == (96, True, True)
            remote = _remote(loop)
            assert remote["discovered"] >= 3  # found by asking the server
            assert remote["promotions"] == 3
            assert loop.sched.stats.tier_hits["remote"] == 1
            if with_disk:
                assert loop.index.tier_stats()["disk"]["promotions"] == 0
            loop.sched.check_drained()
        finally:
            loop.close()
    finally:
        store.stop()


def test_remote_flags_are_checked_as_an_engines_settings(tmp_path: Path) -> None:
    for bad, why in [(("--remote-key-prefix", "x"), "needs --remote-url"),
                     (("--remote-url", "redis://user:pw@127.0.0.1:1"), "no credentials"),
                     (("--remote-url", "http://127.0.0.1:1"), "redis://host:port")]:
        store = StoreProcess(tmp_path, size=POOL, extra=bad)
        with pytest.raises(RuntimeError) as e:
            store.start()
        assert why in str(e.value)
