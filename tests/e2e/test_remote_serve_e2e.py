"""Two ``kvtier serve`` servers (vLLM CPU build) on one host sharing one real Redis: a prefix
the first computed is restored by the second, its tokens equal to the first's own HBM hit, and
the second's ``/metrics`` says the restored tokens came from the remote tier; the same from a
server started after both stopped (nothing left in any HBM, DRAM or catalog)."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import aiohttp
import pytest
import redis

from _redis import standalone, unique_prefix
from kvtier.bench import scrape
from kvtier.bench.serving import free_port
from tests.e2e.conftest import prompt

pytestmark = pytest.mark.e2e

READY = re.compile(r"kvtier serve: ready\. OpenAI API (\S+)/v1 ; metrics (\S+/metrics)")
C = 256


def _command(model: str, port: int, prefix: str) -> list[str]:
    return [sys.executable, "-m", "kvtier.cli", "serve", model, "--dram-size", "16MiB",
            "--kvtier-set", "cost_model=false", "--kvtier-set",
            f"remote_url=redis://127.0.0.1:{port}", "--kvtier-set", f"remote_key_prefix={prefix}",
            "--kvtier-set", "remote_timeout_ms=2000", "--host", "127.0.0.1",
            "--port", str(free_port()), "--load-format", "dummy", "--dtype", "float32",
            "--block-size", "32", "--skip-tokenizer-init", "--enforce-eager",
            "--max-model-len", "1024", "--num-gpu-blocks-override", "80", "--max-num-seqs", "2",
            "--seed", "0"]


@contextmanager
def servers(model: str, port: int, prefix: str, logs: list[Path]) -> Iterator[list[str]]:
    """One ``kvtier serve`` per log, all started at once (each start is most of a minute on
    two cores), their API URLs once every one is ready; SIGTERM to each at the end."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env["VLLM_CPU_KVCACHE_SPACE"] = "1"
    procs = []
    try:
        for log in logs:
            with open(log, "wb") as f:
                procs.append(subprocess.Popen(_command(model, port, prefix), stdout=f,
                                              stderr=subprocess.STDOUT, env=env,
                                              start_new_session=True))
        urls: list[str | None] = [None] * len(logs)
        deadline = time.monotonic() + 600
        while None in urls and time.monotonic() < deadline:
            time.sleep(1)
            for i, (proc, log) in enumerate(zip(procs, logs)):
                if urls[i] is None:
                    m = READY.search(log.read_text(errors="replace"))
                    if m is not None:
                        urls[i] = m.group(1)
                    elif proc.poll() is not None:
                        pytest.fail(f"kvtier serve exited: {log.read_text()[-3000:]}")
        for url, log in zip(urls, logs):
            if url is None:
                pytest.fail(f"kvtier serve did not get ready: {log.read_text()[-3000:]}")
        yield [u for u in urls if u is not None]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


async def complete(url: str, tokens: list[int]) -> list[int]:
    async with aiohttp.ClientSession() as s:
        async with s.get(f"{url}/v1/models") as r:
            model = (await r.json())["data"][0]["id"]
        body = {"model": model, "prompt": tokens, "max_tokens": 6, "temperature": 0.0,
                "ignore_eos": True, "return_token_ids": True}
        async with s.post(f"{url}/v1/completions", json=body) as r:
            out = await r.json()
    return list(out["choices"][0]["token_ids"])


def metric(url: str, name: str, **labels: str) -> float:
    v = scrape.total(asyncio.run(scrape.scrape_settled(url)), name, **labels)
    return v or 0.0


def test_two_servers_one_store(tiny_llama_dir: str, tmp_path: Path) -> None:
    _, port = standalone()
    prefix = unique_prefix()
    p = prompt(3 * C + 5, seed=23)
    try:
        with servers(tiny_llama_dir, port, prefix,
                     [tmp_path / "a.log", tmp_path / "b.log"]) as (a, b):
            asyncio.run(complete(a, p))  # computed and written through
            hbm_hit = asyncio.run(complete(a, p))  # the first server's own prefix-cache hit
            for _ in range(60):
                if metric(a, "vllm:kvtier_remote_chunks_total", event="written_through") >= 3:
                    break
                asyncio.run(complete(a, prompt(40, seed=99)))
            assert metric(a, "vllm:kvtier_remote_chunks_total", event="written_through") >= 3
            assert asyncio.run(complete(b, p)) == hbm_hit
            assert metric(b, "vllm:kvtier_remote_hits_total") == 1
            assert metric(b, "vllm:kvtier_remote_hit_tokens_total") == 3 * C
            assert metric(b, "vllm:kvtier_restored_tokens_total") == 3 * C
            assert metric(b, "vllm:kvtier_remote_chunks_total", event="discovered") == 3
        # both stopped: a server started now restores from the store alone. One is enough: a
        # second fresh server would repeat its request and checks word for word, and that a
        # restore leaves the entries to the next reader shows here already (b read them first)
        with servers(tiny_llama_dir, port, prefix, [tmp_path / "c.log"]) as (c,):
            assert asyncio.run(complete(c, p)) == hbm_hit
            assert metric(c, "vllm:kvtier_remote_hit_tokens_total") == 3 * C
    finally:
        raw = redis.Redis(port=port, socket_timeout=2)
        for k in raw.scan_iter(f"{prefix}:*"):
            raw.delete(k)
