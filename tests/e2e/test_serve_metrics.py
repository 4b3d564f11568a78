"""``kvtier serve`` on vLLM's CPU build: the server starts, says where its metrics are, and its
``/metrics`` carries every kvtier series with a value that fits the traffic sent.

The HBM prefix cache is 40 blocks of 32 tokens, so a prefix comes back after two others
mostly evicted (vLLM evicts a freed request's tail blocks first: 2 blocks stay in HBM), and
kvtier restores the rest (its cost model is off: on this tiny model recomputing 448 tokens
can be as cheap as parking the request for a load, and this test is about the metrics). The DRAM tier is 4 MiB (a few 512 KiB chunks), so unique prompts
sent afterwards force evictions.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from kvtier.bench import scrape
from kvtier.bench.client import LoadShape, drive
from kvtier.bench.serving import free_port
from kvtier.bench.workloads import NoReuse, SharedPrefix
from kvtier.planner import Decline
from kvtier.vllm.counters import HISTOGRAMS, METRICS

pytestmark = pytest.mark.e2e

READY = re.compile(r"kvtier serve: ready\. OpenAI API (\S+)/v1 ; metrics (\S+/metrics)")



@pytest.fixture(scope="module")
def server(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory) -> Any:
    log_path = str(tmp_path_factory.mktemp("serve") / "serve.log")
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    cmd = [sys.executable, "-m", "kvtier.cli", "serve", tiny_llama_dir, "--dram-size", "4MiB",
           "--policy", "lru", "--kvtier-set", "cost_model=false", "--host", "127.0.0.1",
           "--port", str(free_port()), "--load-format", "dummy", "--dtype", "float32", "--block-size", "32",
           "--skip-tokenizer-init", "--enforce-eager", "--max-model-len", "1024",
           "--num-gpu-blocks-override", "40", "--max-num-seqs", "2"]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        m = None
        while m is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(1)
            with open(log_path, errors="replace") as f:
                m = READY.search(f.read())
        if m is None:
            with open(log_path, errors="replace") as f:
                pytest.fail(f"kvtier serve did not get ready: {f.read()[-3000:]}")
        yield m.group(1), m.group(2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # kvtier serve forwards it to vLLM
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def _v(s: scrape.Samples, name: str, **labels: str) -> float:
    v = scrape.total(s, name, **labels)
    assert v is not None, f"no series {name} {labels}"
    return v


def test_metrics_carry_every_kvtier_series(server: tuple[str, str]) -> None:
    url, metrics_url = server
    assert metrics_url == f"{url}/metrics"

    async def traffic() -> tuple[list[Any], scrape.Samples]:
        shared = SharedPrefix(prefixes=3, prefix_len=512, suffix_len=64, output_len=4, seed=1)
        results, _ = await drive(url, "", shared, LoadShape(concurrency=1, requests=6))
        for _ in range(8):  # unique prompts until the DRAM tier had to evict
            s = await scrape.scrape_settled(url)
            if (scrape.total(s, "vllm:kvtier_evictions_total") or 0) > 0:
                break
            more, _ = await drive(url, "", NoReuse(prompt_len=600, output_len=2,
                                                   seed=len(results)),
                                  LoadShape(concurrency=1, requests=2))
            results += more
        return results, await scrape.scrape_settled(url)

    from kvtier.bench.client import discover_model

    model = asyncio.run(discover_model(url))
    assert model
    results, s = asyncio.run(traffic())
    assert all(r.ok for r in results), [r.error for r in results if not r.ok]

    # every series kvtier defines is there
    names = {k.partition("{")[0] for k in s}
    for m in METRICS:  # counters with their _total suffix, gauges and derived gauges
        assert m.full_name in names, m.name
    for h in HISTOGRAMS:
        assert f"{h.full_name}_bucket" in names, h.name

    # restores: round 2 of the shared prefixes came (mostly) from kvtier
    restored = _v(s, "vllm:kvtier_restored_tokens_total")
    assert restored > 0 and _v(s, "vllm:kvtier_hit_tokens_total") >= restored
    assert _v(s, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer") == restored
    round2 = results[3:6]
    assert all(r.cached_tokens == 512 for r in round2), [r.cached_tokens for r in round2]
    assert _v(s, "vllm:kvtier_loads_total", outcome="ok") == _v(
        s, "vllm:kvtier_loads_total", outcome="started") >= 3
    assert _v(s, "vllm:kvtier_lookups_total") >= len(results)
    assert _v(s, "vllm:kvtier_loads_declined_total", reason=Decline.MISS.value) >= 3
    # per tier: DRAM answers every lookup; no disk tier here, so its series stay 0
    assert _v(s, "vllm:kvtier_tier_hits_total", tier="dram") + _v(
        s, "vllm:kvtier_tier_misses_total", tier="dram") == _v(s, "vllm:kvtier_lookups_total")
    assert _v(s, "vllm:kvtier_tier_hits_total", tier="dram") >= _v(s, "vllm:kvtier_hits_total")
    assert _v(s, "vllm:kvtier_tier_hit_tokens_total", tier="dram") >= restored
    for name in ("tier_hits", "tier_misses", "tier_hit_tokens"):
        assert _v(s, f"vllm:kvtier_{name}_total", tier="disk") == 0
    # every reason is exported; those this server and traffic cannot cause read 0: one
    # full-attention group (no window, no state), no extra keys, every prompt longer than a
    # chunk, loads on, cost model off, no load failed
    impossible = {Decline.TOO_SHORT, Decline.UNSAVEABLE, Decline.WINDOW_MISSING,
                  Decline.STATE_MISSING, Decline.NOT_WORTH_IT, Decline.FAILED_BEFORE,
                  Decline.LOADS_DISABLED}
    declined = {r: _v(s, "vllm:kvtier_loads_declined_total", reason=r.value) for r in Decline}
    assert {r.value: v for r, v in declined.items() if r in impossible and v} == {}
    # a lookup ends in a hit or (at most once per reason and request) a decline
    assert sum(declined.values()) + _v(s, "vllm:kvtier_hits_total") <= _v(
        s, "vllm:kvtier_lookups_total")
    # one request at a time and a DRAM tier of unpinned chunks: evictions make room for
    # every save, none is dropped
    assert _v(s, "vllm:kvtier_saves_dropped_total") == 0

    # vLLM 0.32 counts kvtier's hits as host-memory hits, not external_unspecified
    assert _v(s, "vllm:prompt_tokens_cached_by_source_total", source="host") == restored
    assert _v(s, "vllm:prompt_tokens_cached_by_source_total",
              source="external_unspecified") == 0

    # saves, bytes and throughput each way; "save" is the deprecated alias of "store"
    assert _v(s, "vllm:kvtier_saves_total", outcome="committed") >= 6
    for direction in ("store", "save", "load"):
        assert _v(s, "vllm:kvtier_transfer_bytes_total", direction=direction) > 0
        assert _v(s, "vllm:kvtier_transfer_seconds_total", direction=direction) > 0
        assert _v(s, "vllm:kvtier_transfer_jobs_total", direction=direction) > 0
        assert 0 < _v(s, "vllm:kvtier_transfer_gbps", direction=direction) < 1000
    for name in ("bytes", "seconds", "jobs"):
        assert _v(s, f"vllm:kvtier_transfer_{name}_total", direction="save") == _v(
            s, f"vllm:kvtier_transfer_{name}_total", direction="store")
    assert _v(s, "vllm:kvtier_transfer_bytes_total", direction="load") == restored * 2048

    # histograms: one observation per job, lookup and parked load, summing to the counters
    for direction in ("store", "load"):
        jobs = _v(s, "vllm:kvtier_transfer_jobs_total", direction=direction)
        for h in ("transfer_size_bytes", "transfer_time_seconds", "transfer_throughput_gbps"):
            assert _v(s, f"vllm:kvtier_{h}_count", direction=direction, tier="dram") == jobs
        assert _v(s, "vllm:kvtier_transfer_size_bytes_sum", direction=direction) == _v(
            s, "vllm:kvtier_transfer_bytes_total", direction=direction)
        assert _v(s, "vllm:kvtier_transfer_time_seconds_sum", direction=direction) == (
            pytest.approx(_v(s, "vllm:kvtier_transfer_seconds_total", direction=direction)))
    assert _v(s, "vllm:kvtier_lookup_seconds_count") >= _v(s, "vllm:kvtier_lookups_total")
    assert 0 < _v(s, "vllm:kvtier_lookup_seconds_sum") < 60
    assert _v(s, "vllm:kvtier_load_wait_seconds_count", tier="dram") == _v(
        s, "vllm:kvtier_loads_total", outcome="started")
    assert _v(s, "vllm:kvtier_load_wait_seconds_sum") > 0

    # capacity: evictions happened, occupancy is a share, chunk size is the default
    assert _v(s, "vllm:kvtier_evictions_total") > 0
    used, total = _v(s, "vllm:kvtier_slots_used"), _v(s, "vllm:kvtier_slots_total")
    assert 0 < used <= total
    assert _v(s, "vllm:kvtier_occupancy") == pytest.approx(used / total)
    assert _v(s, "vllm:kvtier_chunk_tokens") == 256

    # nothing failed
    assert _v(s, "vllm:kvtier_loads_total", outcome="failed") == 0
    assert _v(s, "vllm:kvtier_saves_total", outcome="failed") == 0
    assert _v(s, "vllm:kvtier_transfer_failures_total") == 0
