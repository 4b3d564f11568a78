"""Engines attached to one node-wide store at the same time (issue 18), on vLLM's CPU build
with a real ``kvtier store`` process:

- two engines, each in a process of its own, running at once: a prefix computed by either is
  restored by the other from the shared pool while both run, tokens and logprobs bit-equal to
  the restoring engine's own HBM hit of it (and to the computing engine's output); an engine
  restarted while the other stays attached finds both prefixes in the store;
- TP=2: both ranks attach and map the one pool (their slabs lie in the store's memfd), each
  copies its own shard there; a restore through the store is bit-equal (checksums, tokens,
  logprobs) on both ranks, and a load failing on one rank only makes the request recompute.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.probe import rpc_fail_next_loads
from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from kvtier.testing.store_probe import rpc_store_facts
from kvtier.testing.store_process import StoreProcess
from tests.e2e.conftest import greedy, make_llm, prompt

pytestmark = pytest.mark.e2e

C = 256
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    s = StoreProcess(tmp_path, size="512MiB").start()
    yield s
    s.stop()


class Engine:
    """``python -m tests.e2e.store_engine``: one engine process, one request at a time."""

    def __init__(self, model: str, url: str, cpu: str, log: Path, after_go: bool = False
                 ) -> None:
        """``after_go``: the process imports vLLM, then waits for :meth:`go` to build the
        engine (and attach it to the store)."""
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": cpu,
               "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "src"), ROOT])}
        self.log = log
        with open(log, "wb") as f:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.e2e.store_engine", model, url,
                 *(["--after-go"] if after_go else [])], cwd=ROOT,
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=f, text=True, env=env)

    def go(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("GO\n")
        self.proc.stdin.flush()

    def line(self, timeout: float) -> str:
        assert self.proc.stdout is not None
        if not select.select([self.proc.stdout], [], [], timeout)[0]:
            return ""
        return self.proc.stdout.readline()

    def wait_ready(self, timeout: float = 600) -> None:
        line = self.line(timeout)
        assert line.strip() == "READY", (line, self.log.read_text()[-3000:])

    def ask(self, tokens: list[int], timeout: float = 300) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.line(timeout)
        assert line, f"no answer: {self.log.read_text()[-3000:]}"
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"quit": True}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(60)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait(10)


def _restored_from_store(e: Engine, tokens: list[int], computed: dict[str, Any]
                         ) -> dict[str, Any]:
    """Ask ``e`` for a prefix another engine computed: every whole chunk comes from the store
    (its HBM never saw the prompt), then its own HBM hit of it must say the same, bit for bit."""
    before = e.ask(prompt(40, seed=98))["loaded_tokens"]
    restored = e.ask(tokens)
    assert restored["store_up"] and restored["loads_failed"] == 0
    assert restored["cached"] == 4 * C and restored["loaded_tokens"] - before == 4 * C
    hbm_hit = e.ask(tokens)
    assert hbm_hit["cached"] == 4 * C and hbm_hit["loaded_tokens"] == restored["loaded_tokens"]
    for other in (hbm_hit, computed):
        assert restored["tokens"] == other["tokens"]
        assert restored["logprobs"] == other["logprobs"]
    return restored


def test_two_engines_at_once_share_hits_and_a_restarted_engine_finds_them(
        tiny_llama_dir: str, store: StoreProcess, tmp_path: Path) -> None:
    p, q = prompt(4 * C + 5, seed=31), prompt(4 * C + 7, seed=32)
    a = Engine(tiny_llama_dir, store.url, "0", tmp_path / "a.log")
    b = Engine(tiny_llama_dir, store.url, "1", tmp_path / "b.log")
    engines = [a, b]
    try:
        a.wait_ready()
        b.wait_ready()
        by_a = a.ask(p)  # a computes p, b computes q; both engines stay up
        by_b = b.ask(q)
        assert by_a["cached"] == 0 and by_a["saves_committed"] >= 4
        assert by_b["cached"] == 0 and by_b["saves_committed"] >= 4
        # a's successor imports vLLM meanwhile; its engine is built once a stopped
        a2 = Engine(tiny_llama_dir, store.url, "0", tmp_path / "a2.log", after_go=True)
        engines.append(a2)
        _restored_from_store(b, p, by_a)  # each restores the other's prefix meanwhile
        _restored_from_store(a, q, by_b)
        a.stop()  # a restart while b stays attached: the store keeps both prefixes
        a2.go()
        a2.wait_ready()
        _restored_from_store(a2, p, by_a)
        _restored_from_store(a2, q, by_b)
    finally:
        for e in engines:
            e.stop()


def test_tp2_attaches_both_ranks_and_restores_through_the_store(
        tiny_llama_dir: str, store: StoreProcess, monkeypatch: pytest.MonkeyPatch,
        shutdown_now: list[Any]) -> None:
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # test-only worker rpcs
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    llm = make_llm(tiny_llama_dir, {"store_url": store.url}, tensor_parallel_size=2,
                   num_gpu_blocks_override=256)
    shutdown_now.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    assert h.kvtier.index.up
    res = restore_check(h, [prompt(3 * C + 5, seed=33), prompt(C + 9, seed=34)], greedy())
    assert res.restored_tokens == res.expected_restored == 4 * C
    assert all(p.checksums_equal and p.tokens_equal and p.logprobs_equal for p in res.prompts)
    facts = sorted(llm.collective_rpc(rpc_store_facts), key=lambda f: f["rank"])
    assert [f["rank"] for f in facts] == [0, 1]
    assert all(f["store_mapped"] and f["in_pool"] and f["shards"] == 2 for f in facts), facts
    assert all(f["bytes_stored"] > 0 and f["bytes_loaded"] > 0 for f in facts), facts
    assert facts[0]["bytes_stored"] == facts[1]["bytes_stored"]  # a shard each, equal halves
    assert llm.collective_rpc(rpc_fail_next_loads, args=(1, 1)) == [False, True]
    res = restore_check(h, [prompt(2 * C + 5, seed=35)], greedy())
    assert res.loads_failed == 1 and res.restored_tokens == 0
    (p,) = res.prompts
    assert p.tokens_equal and p.logprobs_equal
    h.kvtier.check_drained()
