"""The disk tier under the slab, end to end without an engine: demotion of what DRAM evicts,
promotion before a promise, warm restart, corruption, a full tier, the cost model."""

from __future__ import annotations

from pathlib import Path

import pytest

from _disk_loop import CHUNK, Loop, config, prompt
from kvtier.tiers.directory import scan
from kvtier.tiers.disk import PAGE, chunk_name, shard_dir


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
    assert again.ranks[0].worker.tier.corrupt_reads == 1  # type: ignore[union-attr]
    assert not ts.catalog.index.is_ready(0, k1)  # forgotten, with its descendants
    again.settle()
    again.sched.check_drained()
    again.close()


def test_a_second_engine_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    from kvtier.config import ConfigError

    loop = Loop(config(tmp_path))
    with pytest.raises(ConfigError, match="another engine"):
        Loop(config(tmp_path))
    loop.close()
