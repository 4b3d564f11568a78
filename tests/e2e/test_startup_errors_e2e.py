"""A start-up refusal of the connector inside a real vLLM CPU engine is one line, and the last
line of the whole output: offline ``LLM(...)`` in a program of its own (its EngineCore and
worker processes print their tracebacks, then the program its own) and ``kvtier serve`` (the
API server and its engine processes print, then kvtier serve)."""

from __future__ import annotations

import os
import re
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from _background import Background
from kvtier.bench.serving import free_port
from kvtier.config import ConfigError, KvtierConfig
from kvtier.geometry import resolve_chunk_tokens
from kvtier.vllm import startup

ROOT = Path(__file__).resolve().parents[2]

OFFLINE = """
import sys
from vllm import LLM
from vllm.config import KVTransferConfig

if __name__ == "__main__":  # vLLM starts its engine processes with spawn
    ktc = KVTransferConfig(kv_connector="kvtier", kv_role="kv_both",
                           kv_load_failure_policy=sys.argv[2],
                           kv_connector_extra_config={"dram_size": "128MiB",
                                                      "chunk_tokens": int(sys.argv[3])})
    LLM(model=sys.argv[1], kv_transfer_config=ktc, load_format="dummy", skip_tokenizer_init=True,
        enforce_eager=True, dtype="float32", max_model_len=1024, max_num_seqs=2, block_size=32)
    print("the engine started")
"""


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("VLLM_ENABLE_V1_MULTIPROCESSING", startup.REPORT_ENV)}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT / "src"))
    return env


def _lines(text: str) -> list[str]:
    return [ln for ln in text.splitlines() if ln.strip()]


def _chunk_line(chunk: int, block: int) -> str:
    with pytest.raises(ConfigError) as info:
        resolve_chunk_tokens(KvtierConfig.load({"chunk_tokens": chunk}, environ={}).chunk_tokens,
                             [block])
    return startup.one_line(str(info.value))


OFFLINE_CASES = [("recompute", 100), ("fail", 96)]


@pytest.fixture(scope="module")
def runs(tiny_llama_dir: str, tmp_path_factory: pytest.TempPathFactory
         ) -> Iterator[dict[object, Background]]:
    """The module's three refusing programs, all started at once: each start-up is most of a
    minute on two cores, with mostly one of its processes busy at a time (the program, then
    its EngineCore, then the worker), so together they take about as long as the slowest."""
    tmp = tmp_path_factory.mktemp("refusals")
    script = tmp / "offline.py"
    script.write_text(textwrap.dedent(OFFLINE))
    # no --block-size: vLLM's CPU platform picks it, so only the connector can refuse
    serve = [sys.executable, "-m", "kvtier.cli", "serve", tiny_llama_dir, "--chunk-tokens",
             "100", "--dram-size", "64MiB", "--host", "127.0.0.1", "--port", str(free_port()),
             "--load-format", "dummy", "--dtype", "float32", "--skip-tokenizer-init",
             "--enforce-eager", "--max-model-len", "1024", "--max-num-seqs", "2"]
    started: dict[object, Background] = {}
    try:
        started["serve"] = Background(serve, tmp / "serve.log", env=_env())
        for policy, chunk in OFFLINE_CASES:
            started[(policy, chunk)] = Background(
                [sys.executable, str(script), tiny_llama_dir, policy, str(chunk)],
                tmp / f"offline-{policy}-{chunk}.log", env=_env())
        yield started
    finally:
        for run in started.values():
            run.kill()


@pytest.mark.parametrize("policy, chunk", OFFLINE_CASES)
def test_offline_start_up_refusal_is_the_last_line(runs: dict[object, Background], policy: str,
                                                   chunk: int) -> None:
    if policy == "fail":
        what, todo = startup.failure_policy_refusal("fail", False) or ("", "")
        line = startup.one_line(f"{what}; {todo}")
    else:
        line = _chunk_line(chunk, 32)
    rc, stdout = runs[(policy, chunk)].result(540)
    out = _lines(stdout)
    assert rc != 0 and "the engine started" not in stdout
    assert out[-1] == line, "\n".join(out[-30:])
    assert any("ERROR" in ln and ln.endswith(line) for ln in out[:-1])  # logged where it failed


def test_kvtier_serve_start_up_refusal_is_the_last_line(runs: dict[object, Background]) -> None:
    rc, stdout = runs["serve"].result(540)
    out = _lines(stdout)
    assert rc != 0, "\n".join(out[-30:])
    m = re.fullmatch(r"kvtier: setting 'chunk_tokens' \(100\) is not a multiple of every "
                     r"KV-cache block size \[(\d+)\] .*", out[-1])
    assert m is not None, "\n".join(out[-30:])
    assert out[-1] == _chunk_line(100, int(m.group(1)))
    assert "kvtier serve: the server exited with code" in "\n".join(out[-10:-1])
