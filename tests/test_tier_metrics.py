"""Hits and misses per tier (``vllm:kvtier_tier_{hits,misses,hit_tokens}_total{tier}``): the
scheduler half with a real disk tier under a small slab (tests/_disk_loop.py), its stats as
the connector sends them, and the series on a private Prometheus registry."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from _disk_loop import CHUNK, Loop, config, prompt
from kvtier.bench import scrape
from kvtier.tiers import TIER_NAMES
from kvtier.vllm import compat
from kvtier.vllm.counters import scheduler_counts
from kvtier.vllm.prom import KvtierPromMetrics

LABELS = {"engine": "0", "model_name": "m"}


def _fill(loop: Loop, n: int) -> list[list[int]]:
    prompts = [prompt(i) for i in range(n)]
    for i, p in enumerate(prompts):
        loop.prefill(f"p{i}", p)
    loop.settle()
    return prompts


def _tiers(loop: Loop) -> dict[str, tuple[int, int, int]]:
    """tier -> (hits, misses, hit tokens), from the stats dict the connector sends."""
    c = scheduler_counts(loop.sched)
    return {t: (c.get(f"tier_hits_{t}", 0), c.get(f"tier_misses_{t}", 0),
                c.get(f"tier_hit_tokens_{t}", 0)) for t in TIER_NAMES}


def _prom() -> tuple[KvtierPromMetrics, CollectorRegistry]:
    reg = CollectorRegistry()

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)
        return Bound

    class Cfg:
        kv_transfer_config = None

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    return KvtierPromMetrics(Cfg(), types, ["model_name", "engine"], {0: ["m", "0"]}), reg


def test_dram_counts_every_lookup_and_a_disk_hit_is_the_disk_tiers(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path))
    prompts = _fill(loop, 7)  # 21 chunks through a DRAM of 16: p0's chunks are on disk only
    before = _tiers(loop)
    # the prefills' own lookups: nothing stored anywhere yet, or only other prompts
    assert before["dram"][0] == 0 and before["dram"][1] == loop.sched.stats.lookups == 7
    assert before["disk"][0] == 0

    n, deferred = loop.lookup("from-disk", prompts[0])
    assert n == 3 * CHUNK and deferred >= 1
    after = _tiers(loop)
    assert after["disk"] == (1, before["disk"][1], 3 * CHUNK)  # all of it came up from disk
    assert after["dram"] == (0, before["dram"][1] + 1, 0)  # DRAM held none of it: a miss
    assert loop.sched.hit_sources("from-disk") == {"disk": 3 * CHUNK}  # vLLM 0.32's split
    loop.sched.request_finished("from-disk")
    loop.settle()

    n, deferred = loop.lookup("from-dram", prompts[6])  # the newest prompt, still in DRAM
    assert (n, deferred) == (3 * CHUNK, 0)
    last = _tiers(loop)
    assert last["dram"] == (1, after["dram"][1], 3 * CHUNK)
    assert last["disk"] == (1, after["disk"][1] + 1, 3 * CHUNK)  # asked, held nothing more
    assert loop.sched.hit_sources("from-dram") == {"dram": 3 * CHUNK}
    loop.sched.request_finished("from-dram")

    n, _ = loop.lookup("nowhere", prompt(99))
    assert n == 0
    final = _tiers(loop)
    assert final["dram"][1] == last["dram"][1] + 1 and final["disk"][1] == last["disk"][1] + 1
    assert final["dram"][0] + final["dram"][1] == loop.sched.stats.lookups  # DRAM: every one
    assert loop.sched.hit_sources("nowhere") == {}
    loop.sched.request_finished("nowhere")
    loop.settle()
    loop.close()


def test_without_a_lower_tier_only_dram_counts(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path, disk_path=None, disk_size=None, dram_size="1MiB"))
    prompts = _fill(loop, 2)
    n, _ = loop.lookup("again", prompts[0])
    assert n == 3 * CHUNK
    t = _tiers(loop)
    assert t["dram"] == (1, 2, 3 * CHUNK) and t["disk"] == (0, 0, 0)
    loop.sched.request_finished("again")
    loop.settle()
    loop.close()


def test_the_tier_series_exist_from_start_up_and_take_the_stats(tmp_path: Path) -> None:
    m, reg = _prom()
    s = scrape.parse(generate_latest(reg).decode())
    for name in ("vllm:kvtier_tier_hits_total", "vllm:kvtier_tier_misses_total",
                 "vllm:kvtier_tier_hit_tokens_total"):
        for tier in TIER_NAMES:
            assert s.get(scrape.key(name, {**LABELS, "tier": tier})) == 0, (name, tier)

    loop = Loop(config(tmp_path))
    prompts = _fill(loop, 7)
    loop.lookup("from-disk", prompts[0])
    m.observe(scheduler_counts(loop.sched), 0)  # the first payload: totals are the deltas
    s = scrape.parse(generate_latest(reg).decode())
    assert s.get(scrape.key("vllm:kvtier_tier_hits_total", {**LABELS, "tier": "disk"})) == 1
    assert s.get(scrape.key("vllm:kvtier_tier_hit_tokens_total",
                            {**LABELS, "tier": "disk"})) == 3 * CHUNK
    assert s.get(scrape.key("vllm:kvtier_tier_misses_total",
                            {**LABELS, "tier": "dram"})) == loop.sched.stats.lookups
    loop.sched.request_finished("from-disk")
    loop.settle()
    loop.close()


def test_vllm_032_gets_each_promised_hit_split_by_its_cache_hit_source() -> None:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as S

    from kvtier.vllm.connector import KvtierConnector

    assert "get_external_cache_hit_sources" in KvtierConnector.__dict__
    assert KvtierConnector._cache_hit_source is S.HOST
    split = compat.cache_hit_sources
    assert split({"dram": 64, "disk": 32}, 96) == {S.HOST: 64, S.DISK: 32}
    assert split({"disk": 96}, 96) == {S.DISK: 96}
    assert split({"remote": 32, "dram": 64}, 96) == {S.EXTERNAL_UNSPECIFIED: 32, S.HOST: 64}
    assert split({}, 96) == {S.HOST: 96}  # not kvtier's split: all of it host memory
    assert split({"dram": 64}, 0) == {}
