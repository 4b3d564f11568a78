"""Remote tier throughput and latency against a Redis server, per chunk size and part size.

    python tools/bench_remote.py HOST:PORT [--cluster] [--chunk-kib 512 2048 8192]
                                 [--part-kib 64 256 1024 4096] [--total-mib 256]

For every (chunk, part) pair: ``RedisChunkStore.put`` of ``total/chunk`` chunks (one
MULTI/EXEC of parts and head each, as write-through does), then ``get`` of each (one pipeline,
every part's length and the checksum verified): GB/s and per-chunk latency (p50, p99) each
way, through the real client with kvtier's timeouts. The keys are deleted afterwards. Prints
one JSON object; docs/notes/remote-tier.md has the numbers of this machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from kvtier.config import KvtierConfig
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.remote import RedisChunkStore, RemoteKeys
from kvtier.tiers.remote_client import connect


def _pct(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def run_one(cfg: KvtierConfig, chunk: int, part: int, total: int) -> dict[str, float]:
    store = RedisChunkStore(connect(cfg), RemoteKeys(cfg.remote_key_prefix, os.urandom(16)),
                            0, part, CircuitBreaker(3, 1.0))
    n = max(4, total // chunk)
    data = torch.randint(0, 256, (chunk,), dtype=torch.uint8)
    out = torch.empty_like(data)
    keys = [os.urandom(16) for _ in range(n)]
    put, get = [], []
    try:
        for k in keys:
            t0 = time.perf_counter()
            store.put(0, k, None, data)
            put.append(time.perf_counter() - t0)
        for k in keys:
            t0 = time.perf_counter()
            store.get(0, k, None, out)
            get.append(time.perf_counter() - t0)
        assert torch.equal(out, data)
    finally:
        for k in keys:
            store.delete(0, k, None)
        store.close()
    return {"chunk_kib": chunk // 1024, "part_kib": part // 1024, "chunks": n,
            "write_gbps": n * chunk / sum(put) / 1e9, "read_gbps": n * chunk / sum(get) / 1e9,
            "write_ms_p50": statistics.median(put) * 1e3, "write_ms_p99": _pct(put, .99) * 1e3,
            "read_ms_p50": statistics.median(get) * 1e3, "read_ms_p99": _pct(get, .99) * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("server")
    ap.add_argument("--cluster", action="store_true")
    ap.add_argument("--chunk-kib", type=int, nargs="+", default=[512, 2048, 8192])
    ap.add_argument("--part-kib", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--total-mib", type=int, default=256)
    a = ap.parse_args()
    cfg = KvtierConfig.model_validate({"remote_url": f"redis://{a.server}",
                                       "remote_cluster": a.cluster, "remote_timeout_ms": 5000,
                                       "remote_key_prefix": "kvtier-bench"})
    rows = [run_one(cfg, c * 1024, p * 1024, a.total_mib << 20)
            for c in a.chunk_kib for p in a.part_kib if p <= max(c, a.part_kib[0])]
    print(json.dumps({"server": a.server, "cluster": a.cluster, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
