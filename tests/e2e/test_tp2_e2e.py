"""Tensor parallelism on vLLM's CPU build: two worker processes (gloo), EngineCore in this
process. Every rank saves and loads its own shard under one slot numbering; an MLA model's
KV, replicated across ranks, is stored once and read by both; a load that fails on one rank
fails for both and the request recomputes. The shared slab leaves nothing in /dev/shm: not while
the engine runs, not after it stops, not after a kill -9."""

from __future__ import annotations

import glob
import os
import select
import signal
import subprocess
import sys
import time
from typing import Any

import pytest

from kvtier.testing.models import tiny_deepseek_v2
from kvtier.testing.probe import rpc_fail_next_loads, rpc_worker_facts
from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt, shutdown

pytestmark = pytest.mark.e2e

C = 256


def _segments(engine_id: str) -> list[str]:
    return glob.glob(f"/dev/shm/kvtier-{engine_id}*")


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped holds no memory and counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _ready_line(engine: subprocess.Popen[bytes], timeout: float) -> str:
    """The engine's READY line, or "" if it exits or stays silent for ``timeout`` s (read
    unbuffered: vLLM logs to stdout too, and the line must not wait in a buffer)."""
    assert engine.stdout is not None
    fd, seen, deadline = engine.stdout.fileno(), b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        if select.select([fd], [], [], 1.0)[0]:
            chunk = os.read(fd, 65536)
            if not chunk:
                return ""
            seen = (seen + chunk)[-65536:]
            complete = seen.decode(errors="replace").split("\n")[:-1]
            ready = [ln for ln in complete if ln.startswith("READY ")]
            if ready:
                return ready[0]
    return ""


@pytest.fixture
def tp2_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only worker rpcs
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank


def test_tp2_each_rank_its_own_shard_and_a_one_rank_failure(
        tiny_llama_dir: str, tp2_env: None, shutdown_now: list[Any]) -> None:
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, num_gpu_blocks_override=256)
    shutdown_now.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    res = restore_check(h, [prompt(3 * C + 5, seed=7), prompt(C + 9, seed=8)], greedy())
    assert res.restored_tokens == res.expected_restored > 0
    assert all(p.checksums_equal and p.tokens_equal and p.logprobs_equal for p in res.prompts)
    facts = sorted(llm.collective_rpc(rpc_worker_facts), key=lambda f: f["rank"])
    assert [f["rank"] for f in facts] == [0, 1]
    assert all(f["shards"] == 2 and f["writes"] and f["bytes_stored"] > 0 for f in facts)
    # a load that fails on rank 1 only: the request recomputes, output unchanged
    assert llm.collective_rpc(rpc_fail_next_loads, args=(1, 1)) == [False, True]
    res = restore_check(h, [prompt(2 * C + 5, seed=9)], greedy())
    assert res.loads_failed == 1 and res.restored_tokens == 0
    (p,) = res.prompts
    assert p.tokens_equal and p.logprobs_equal
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    assert _segments(engine_id) == []  # unlinked once both ranks mapped it
    shutdown(llm)
    assert _segments(engine_id) == []


def test_tp2_kill_9_of_the_engine_and_its_workers_leaves_no_shared_memory(
        tiny_llama_dir: str, tp2_env: None) -> None:
    engine = subprocess.Popen([sys.executable, "-m", "tests.e2e.tp2_engine", tiny_llama_dir],
                              stdout=subprocess.PIPE, start_new_session=True)
    workers: list[int] = []
    try:
        line = _ready_line(engine, timeout=600)
        assert line, f"the engine was not ready (exit status {engine.poll()})"
        _, engine_id, *pids = line.split()
        workers = [int(p) for p in pids]
        assert len(workers) == 2
        while_running = _segments(engine_id)
        os.killpg(engine.pid, signal.SIGKILL)  # engine and workers at once: no cleanup runs
        assert engine.wait(timeout=30) == -signal.SIGKILL
        deadline = time.monotonic() + 60
        while any(_alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert not any(_alive(p) for p in workers), "workers outlived the kill"
        assert (while_running, _segments(engine_id)) == ([], [])
    finally:
        for pid in [engine.pid, *workers]:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_tp2_mla_is_stored_once_and_loaded_by_both_ranks(
        tmp_path: Any, tp2_env: None, shutdown_now: list[Any]) -> None:
    llm = make_llm(tiny_deepseek_v2(str(tmp_path / "dsv2")), tensor_parallel_size=2,
                   max_model_len=2048, num_gpu_blocks_override=256)
    shutdown_now.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    res = restore_check(h, [prompt(3 * C + 5, seed=10)], greedy())
    assert res.restored_tokens == res.expected_restored > 0
    (p,) = res.prompts
    assert p.checksums_equal and p.tokens_equal and p.logprobs_equal  # on both ranks
    facts = sorted(llm.collective_rpc(rpc_worker_facts), key=lambda f: f["rank"])
    assert all(f["replicated"] and f["shards"] == 1 for f in facts)
    assert facts[0]["writes"] and facts[0]["bytes_stored"] > 0
    assert not facts[1]["writes"] and facts[1]["bytes_stored"] == 0  # one copy, not two
    assert facts[1]["bytes_loaded"] == facts[0]["bytes_loaded"] > 0  # both ranks loaded it
