"""The disk tier on a real vLLM CPU engine: restore from disk after DRAM eviction, after a
server restart, a corrupted chunk recomputed, a full disk, and kill -9 during demotion.

DRAM holds 16 chunks (8MiB of 512KiB chunks: 256 tokens of a 2-layer model with 2 KV heads of
64); each prompt is three chunks and five tokens, so seven other prompts push a prompt out of
DRAM (and ``reset_prefix_cache`` out of HBM): its next run can only be restored from disk.
Every restore is checked bit for bit (the restored blocks' checksums against those run A
computed) and by its tokens and logprobs against vLLM's own prefix cache at the same boundary.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from kvtier.testing.restore import (
    _checksums,
    _same_blocks,
    generate,
    handles,
    same_logprobs,
    same_tokens,
    sharpen_dummy_weights,
)
from kvtier.tiers.directory import scan
from kvtier.tiers.disk import PAGE, DiskChunkStore, chunk_name, shard_dir
from tests.e2e.conftest import greedy, make_llm, prompt, shutdown

pytestmark = pytest.mark.e2e

C = 256
LONG = 3 * C + 5


def disk_engine(model: str, tier: Path, disk_size: str = "64MiB") -> Any:
    llm = make_llm(model, {"dram_size": "8MiB", "disk_path": str(tier), "disk_size": disk_size},
                   num_gpu_blocks_override=160)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def push_out(h: Any, n: int = 7, seed: int = 100) -> None:
    """Run ``n`` other prompts (DRAM evicts, the tier demotes), then empty HBM."""
    for i in range(n):
        generate(h, [prompt(LONG, seed=seed + i)], greedy(max_tokens=1))
    h.llm.reset_prefix_cache()


def keys_of(h: Any, tokens: list[int]) -> list[bytes]:
    from kvtier.keys import RequestKeys

    k = RequestKeys(h.kvtier.namespace, C)
    k.update(tokens)
    return list(k.keys)


class Reference:
    """Run A (computes and saves) and run C (vLLM's own prefix cache) of one prompt."""

    def __init__(self, h: Any, tokens: list[int]) -> None:
        h.llm.reset_prefix_cache()
        generate(h, [tokens], greedy())
        self.sums = _checksums(h, tokens)
        (self.out,) = generate(h, [tokens], greedy())

    def matches(self, h: Any, tokens: list[int]) -> bool:
        (out,) = generate(h, [tokens], greedy())
        return (_same_blocks(self.sums, _checksums(h, tokens)) and same_tokens(out, self.out)
                and same_logprobs(out, self.out))


def test_restore_from_disk_after_dram_eviction_and_after_a_restart(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    h = disk_engine(tiny_llama_dir, tmp_path / "tier")
    try:
        p = prompt(LONG, seed=1)
        ref = Reference(h, p)
        push_out(h)
        t = h.kvtier.tier
        keys = keys_of(h, p)
        assert h.kvtier.index.match(0, keys) == 0, "the prompt is still in DRAM"
        assert t.catalog.index.match(0, keys) == 3, "the prompt was not demoted"
        before = (h.kvtier.stats.loaded_tokens, t.stats.hits)
        assert ref.matches(h, p)
        assert h.kvtier.stats.loaded_tokens - before[0] == 3 * C
        assert t.stats.hits == before[1] + 1 and t.stats.promotions >= 3
        sums, out = ref.sums, ref.out
    finally:
        shutdown(h.llm)
    h = disk_engine(tiny_llama_dir, tmp_path / "tier")  # the same directory, a new server
    try:
        t = h.kvtier.tier
        assert t.catalog.index.match(0, keys_of(h, p)) == 3  # rebuilt from the directory
        h.llm.reset_prefix_cache()
        (again,) = generate(h, [p], greedy())
        assert h.kvtier.stats.loaded_tokens == 3 * C and t.stats.hits == 1
        assert _same_blocks(sums, _checksums(h, p))
        assert same_tokens(again, out) and same_logprobs(again, out)
    finally:
        shutdown(h.llm)


def test_a_corrupted_chunk_on_disk_is_recomputed(tiny_llama_dir: str, tmp_path: Path) -> None:
    h = disk_engine(tiny_llama_dir, tmp_path / "tier")
    try:
        p = prompt(LONG, seed=2)
        ref = Reference(h, p)
        push_out(h, seed=200)
        t = h.kvtier.tier
        k = keys_of(h, p)
        path = shard_dir(Path(t.tier.root), 0) / chunk_name(0, k[1], k[0])
        raw = bytearray(path.read_bytes())
        raw[PAGE + 4096] ^= 0x20
        path.write_bytes(bytes(raw))
        before = h.kvtier.stats.loaded_tokens
        (out,) = generate(h, [p], greedy())
        assert h.kvtier.stats.loaded_tokens - before == C  # chunk 0 restored, 1 and 2 computed
        assert t.stats.checksum_failures == 1
        assert same_tokens(out, ref.out) and same_logprobs(out, ref.out)
        assert not t.catalog.index.is_ready(0, k[1])
    finally:
        shutdown(h.llm)


def test_a_full_disk_declines_and_serving_goes_on(tiny_llama_dir: str, tmp_path: Path) -> None:
    h = disk_engine(tiny_llama_dir, tmp_path / "tier", disk_size="2MiB")  # three chunks
    try:
        t = h.kvtier.tier
        assert t.catalog.capacity == 3
        prompts = [prompt(LONG, seed=300 + i) for i in range(8)]
        first = [generate(h, [p], greedy())[0] for p in prompts]
        h.llm.reset_prefix_cache()
        second = [generate(h, [p], greedy())[0] for p in prompts]
        assert all(same_tokens(a, b) for a, b in zip(first, second))
        assert t.catalog.stored(0) <= 3 and t.stats.demotions >= 3
        assert h.kvtier.stats.loads_failed == 0
        files = os.listdir(shard_dir(Path(t.tier.root), 0))
        assert len([f for f in files if f.endswith(".kvc")]) <= 3
    finally:
        shutdown(h.llm)


SERVER = textwrap.dedent("""
    import os, sys
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from tests.e2e.conftest import make_llm, prompt, greedy
    from kvtier.testing.restore import handles, generate, sharpen_dummy_weights
    llm = make_llm(sys.argv[1], {"dram_size": "8MiB", "disk_path": sys.argv[2],
                                 "disk_size": "64MiB"}, num_gpu_blocks_override=160)
    h = handles(llm)
    sharpen_dummy_weights(h)
    (first,) = generate(h, [prompt(3 * 256 + 5, seed=1000)], greedy())
    print("FIRST", " ".join(map(str, first.outputs[0].token_ids)), flush=True)
    i = 1
    while True:
        generate(h, [prompt(3 * 256 + 5, seed=1000 + i)], greedy(max_tokens=1))
        i += 1
""")


def test_kill_9_during_demotion_leaves_a_directory_a_new_server_uses(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    tier = tmp_path / "tier"
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), str(root)])}
    proc = subprocess.Popen([sys.executable, "-c", SERVER, tiny_llama_dir, str(tier)],
                            cwd=root, env=env, stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        deadline = time.monotonic() + 300
        line = ""
        while not line.startswith("FIRST "):  # vLLM logs to stdout too
            line = proc.stdout.readline().decode()
            assert line and time.monotonic() < deadline, "the server died before answering"
        first_tokens = [int(x) for x in line.split()[1:]]
        demoting = deadline
        while time.monotonic() < deadline:  # until chunks reach the disk, then a bit more
            dirs = list(tier.glob("kvtier-*/shard0"))
            if dirs and len(list(dirs[0].glob("*.kvc"))) >= 6:
                demoting = time.monotonic()
                break
            time.sleep(0.05)
        assert demoting < deadline, "nothing was demoted"
        time.sleep(0.3)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (ns_dir,) = tier.glob("kvtier-*")
    found = scan(ns_dir, 1)  # removes a killed writer's temporary file, if any
    store = DiskChunkStore(ns_dir, 0, bytes.fromhex(ns_dir.name.removeprefix("kvtier-")))
    import torch

    buf = torch.empty(512 * 1024, dtype=torch.uint8)
    for c in found.chunks:  # every chunk file verifies: none is torn
        store.get(c.name.group, c.name.key, c.name.parent, buf)
    h = disk_engine(tiny_llama_dir, tier)  # the lock died with the process
    try:
        t = h.kvtier.tier
        assert t.catalog.stored(0) > 0
        p = prompt(LONG, seed=1000)  # the killed server's first prompt
        (out,) = generate(h, [p], greedy())
        assert h.kvtier.stats.loaded_tokens == 3 * C, "not restored from the killed server's disk"
        assert list(out.outputs[0].token_ids) == first_tokens
        assert h.kvtier.stats.loads_failed == 0 and t.stats.checksum_failures == 0
    finally:
        shutdown(h.llm)
