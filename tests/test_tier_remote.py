"""The remote tier's store against real Redis servers (tests/_redis.py): framing, parts,
checksums, namespacing, a full server, and never a stall (a killed, restarted or SIGSTOPped
server is misses and dropped writes within the timeout, and the breaker recovers)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
import redis
import torch

from _redis import RedisProcess, standalone, unique_prefix
from kvtier.config import KvtierConfig
from kvtier.tiers.breaker import BreakerState, CircuitBreaker
from kvtier.tiers.remote import RedisChunkStore, RemoteKeys, RemoteUnavailable
from kvtier.tiers.remote_client import connect
from kvtier.tiers.seam import ChunkCorrupt, TierFull, TierJob, TierJobKind, TierOp, TierRunner

NS = bytes(range(16))
KEY_A, KEY_B = b"A" * 16, b"B" * 16


def make_store(port: int, prefix: str, part_bytes: int = 4096, ns: bytes = NS,
               timeout_ms: float = 200.0, failures: int = 2, cooldown_ms: float = 300.0,
               **kw: object) -> RedisChunkStore:
    cfg = KvtierConfig.model_validate({"remote_url": f"redis://127.0.0.1:{port}",
                                       "remote_timeout_ms": timeout_ms, **kw})
    return RedisChunkStore(connect(cfg), RemoteKeys(prefix, ns), shard=0,
                           part_bytes=part_bytes,
                           breaker=CircuitBreaker(failures, cooldown_ms / 1e3))


def payload(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def solo() -> Iterator[tuple[redis.Redis, RedisChunkStore]]:
    _, port = standalone()
    store = make_store(port, unique_prefix())
    raw = redis.Redis(port=port, socket_timeout=2)
    yield raw, store
    for k in raw.scan_iter(f"{store.keys.prefix}:*"):
        raw.delete(k)
    store.close()


@pytest.mark.parametrize("n", [8, 4096, 10_001, 3 * 4096])
def test_a_chunk_round_trips_whole_in_parts(solo: tuple[redis.Redis, RedisChunkStore],
                                            n: int) -> None:
    raw, store = solo
    data = payload(n)
    store.put(0, KEY_A, KEY_B, data)
    out = torch.zeros(n, dtype=torch.uint8)
    store.get(0, KEY_A, KEY_B, out)
    assert torch.equal(out, data)
    tag = f"{store.keys.prefix}:{{{NS.hex()}:{KEY_A.hex()}:g0:s0}}"
    parts = -(-n // 4096)
    assert sorted(k.decode() for k in raw.scan_iter(f"{store.keys.prefix}:*")) == sorted(
        [f"{tag}:h", *(f"{tag}:{i}" for i in range(parts))])
    head = msgpack.unpackb(raw.get(f"{tag}:h"))
    assert (head["ns"], head["key"], head["parent"], head["len"], head["parts"]) == (
        NS, KEY_A, KEY_B, n, parts)


def test_another_namespace_group_or_parent_is_a_miss_never_wrong_bytes(
        solo: tuple[redis.Redis, RedisChunkStore]) -> None:
    _raw, store = solo
    store.put(0, KEY_A, None, payload(5000))
    out = torch.zeros(5000, dtype=torch.uint8)
    other = make_store(store.client.connection_pool.connection_kwargs["port"],
                       store.keys.prefix, ns=b"x" * 16)
    with pytest.raises(KeyError):
        other.get(0, KEY_A, None, out)
    with pytest.raises(KeyError):
        store.get(1, KEY_A, None, out)
    with pytest.raises(ChunkCorrupt):
        store.get(0, KEY_A, KEY_B, out)  # stored as a root, asked for as a child
    with pytest.raises(ChunkCorrupt):
        store.get(0, KEY_A, None, torch.zeros(4999, dtype=torch.uint8))
    other.close()


@pytest.mark.parametrize("damage", ["flip", "drop_part", "truncate", "garbage_head"])
def test_a_damaged_or_partial_value_is_a_miss_and_a_counter(
        solo: tuple[redis.Redis, RedisChunkStore], damage: str) -> None:
    raw, store = solo
    data = payload(10_000, seed=3)
    store.put(0, KEY_A, None, data)
    tag = store.keys.tag(0, KEY_A, 0)
    if damage == "flip":
        part = bytearray(raw.get(f"{tag}:1"))
        part[17] ^= 0x40
        raw.set(f"{tag}:1", bytes(part))
    elif damage == "drop_part":
        raw.delete(f"{tag}:2")  # what an evicting server does to one key of a chunk
    elif damage == "truncate":
        raw.set(f"{tag}:0", raw.get(f"{tag}:0")[:100])
    else:
        raw.set(f"{tag}:h", b"\xc1not msgpack")
    slab = torch.zeros(10_000, dtype=torch.uint8)
    runner = TierRunner(store, lambda g, s: slab, name="remote")
    runner.submit(TierJob(1, TierJobKind.PROMOTE, [TierOp(0, 0, KEY_A, None)]))
    runner.drain()
    (done,) = runner.poll()
    assert not done.ok and done.corrupt == [0] and runner.corrupt_reads == 1
    runner.close()


def test_a_full_server_declines_writes_and_keeps_serving_reads(tmp_path: Path) -> None:
    server = RedisProcess(tmp_path, "--maxmemory", "4mb", "--maxmemory-policy", "noeviction")
    try:
        store = make_store(server.port, unique_prefix(), part_bytes=1 << 16)
        data = payload(1 << 18)
        store.put(0, KEY_A, None, data)
        with pytest.raises(TierFull):
            for i in range(64):
                store.put(0, bytes([i]) * 16, None, data)
        out = torch.zeros_like(data)
        store.get(0, KEY_A, None, out)
        assert torch.equal(out, data) and store.breaker.state is BreakerState.CLOSED
        store.close()
    finally:
        server.close()


def _timed(fn: object) -> tuple[float, BaseException | None]:
    t0 = time.perf_counter()
    try:
        fn()  # type: ignore[operator]
        err = None
    except Exception as e:
        err = e
    return time.perf_counter() - t0, err


@pytest.mark.parametrize("fault", ["kill", "sigstop"])
def test_a_dead_or_stopped_server_is_misses_within_the_timeout_and_recovers(
        tmp_path: Path, fault: str) -> None:
    server = RedisProcess(tmp_path)
    try:
        store = make_store(server.port, unique_prefix(), timeout_ms=100.0, failures=2,
                           cooldown_ms=300.0)
        data = payload(20_000)
        store.put(0, KEY_A, None, data)
        out = torch.zeros_like(data)
        server.kill() if fault == "kill" else server.stop()
        for _ in range(2):  # each call fails within the timeout (plus scheduling slack)
            took, err = _timed(lambda: store.get(0, KEY_A, None, out))
            assert isinstance(err, RemoteUnavailable) and took < 0.5, (took, err)
        assert store.breaker.state is BreakerState.OPEN
        took, err = _timed(lambda: store.put(0, KEY_B, None, data))  # refused at once
        assert isinstance(err, RemoteUnavailable) and took < 0.01, (took, err)
        assert store.breaker.refused >= 1
        server.start() if fault == "kill" else server.resume()
        time.sleep(0.35)  # the cooldown: the next call is the probe
        store.put(0, KEY_B, None, data)
        store.get(0, KEY_B, None, out)
        assert torch.equal(out, data) and store.breaker.state is BreakerState.CLOSED
        store.close()
    finally:
        server.close()


def test_a_runner_on_a_stopped_server_never_blocks_its_caller(tmp_path: Path) -> None:
    """Jobs queue on the I/O thread: submit returns at once, jobs past the bound fail at
    once, and every job completes (failed) within about its timeouts."""
    server = RedisProcess(tmp_path)
    try:
        store = make_store(server.port, unique_prefix(), timeout_ms=100.0, failures=2,
                           cooldown_ms=10_000.0)
        slab = payload(8192)
        runner = TierRunner(store, lambda g, s: slab, max_jobs=4, name="remote")
        server.stop()
        t0 = time.perf_counter()
        for j in range(8):
            runner.submit(TierJob(j + 1, TierJobKind.DEMOTE, [TierOp(0, 0, bytes([j]) * 16)]))
        assert time.perf_counter() - t0 < 0.05
        runner.drain(timeout=5)
        done = runner.poll()
        assert len(done) == 8 and not any(d.ok for d in done)
        assert sum(d.error == "tier queue full" for d in done) == 4
        assert time.perf_counter() - t0 < 1.0  # two timeouts, then the breaker refuses
        runner.close()
    finally:
        server.close()


def test_in_ci_a_missing_server_fails_the_remote_tests_instead_of_skipping(
        tmp_path: Path) -> None:
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTIER_TEST_REDIS")}
    here = Path(__file__)
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir",
            str(here.parents[1]), f"{here}::test_a_chunk_round_trips_whole_in_parts"]
    skipped = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert skipped.returncode == 0 and "4 skipped" in skipped.stdout, skipped.stdout[-2000:]
    required = subprocess.run(argv, env={**env, "KVTIER_TEST_REDIS_REQUIRED": "1"},
                              capture_output=True, text=True, timeout=120)
    assert required.returncode == 1 and "4 errors" in required.stdout, required.stdout[-2000:]
    assert "the Redis servers CI started are missing" in required.stdout
