"""``kvtier bench serving`` end to end against the fake OpenAI server (a real HTTP server in
its own process): a --duration run with its progress bar, every --compare configuration
checked before the first server starts, token sources from vLLM's series for any connector,
aiperf's option names, and the trace-replay workload on the trace under tests/data/."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _fake_openai import FakeServer, FakeState
from kvtier.bench.client import LoadShape, drive
from kvtier.bench.serving import free_port
from kvtier.bench.workloads import TraceReplay, read_trace
from kvtier.cli import build_parser, main
from kvtier.vllm import serve

FAKE = Path(__file__).with_name("_fake_openai.py")
TRACE = Path(__file__).parent / "data" / "mooncake_small.jsonl"
SMALL = ["--prompt-prefix-pool-size", "2", "--prompt-prefix-length", "128", "--isl", "16",
         "--osl", "2", "--no-plot"]


def _fake(*flags: str) -> Iterator[str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port), *flags],
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready(url, proc, timeout=30)
        yield url
    finally:
        serve.stop(proc, grace=10)


@pytest.fixture
def kvtier_url() -> Iterator[str]:
    yield from _fake("--kvtier", "1")


@pytest.fixture
def native_url() -> Iterator[str]:
    """A server whose connector is not kvtier (vLLM native offloading, LMCache)."""
    yield from _fake("--kvtier", "0", "--connector", "1")


@pytest.fixture
def old_kvtier_url() -> Iterator[str]:
    """A kvtier server without vLLM's prompt_tokens_by_source."""
    yield from _fake("--kvtier", "1", "--by-source", "0")


def _summary(out: str) -> dict[str, Any]:
    with open(os.path.join(out, "results.json")) as f:
        run = json.load(f)["runs"][0]
    return {**run["summary"], "delta": run["metrics_delta"]}


def test_a_duration_run_with_its_progress_bar(kvtier_url: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    out = str(tmp_path / "d")
    assert main(["bench", "--url", kvtier_url, *SMALL, "--concurrency", "2", "--duration",
                 "1.5", "--out", out]) == 0
    s = _summary(out)
    assert s["requests"] >= 2 and s["failed"] == 0
    assert "req" in capsys.readouterr().err  # the bar was drawn


@pytest.mark.parametrize("bad, says", [
    ("--dram-size 2G", "unknown unit 'G'"),
    ("--max-model-lenn 5", "vLLM has no flag --max-model-lenn; did you mean --max-model-len?"),
    ("--policy bogus", "argument --policy: invalid choice: 'bogus'"),
    ("--no-kvtier --dram-size 1GiB", "kvtier settings ['dram_size'] given with --no-kvtier"),
])
def test_every_compare_configuration_is_checked_before_any_server_starts(
        bad: str, says: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    launched: list[Any] = []
    monkeypatch.setattr(serve, "launch", lambda *a, **k: launched.append(a))
    rc = main(["bench", *SMALL, "--requests", "2", "--out", str(tmp_path / "c"),
               "--compare", "a=m --no-kvtier --dtype float32", "--compare", f"b=m {bad}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and launched == []
    (line,) = err.splitlines()
    assert line.startswith("kvtier bench: --compare b: ") and says in line, err


def test_token_sources_come_from_vllms_series_for_any_connector(
        native_url: str, old_kvtier_url: str, tmp_path: Path) -> None:
    shape = [*SMALL, "--concurrency", "1", "--requests", "6", "--no-progress"]
    assert main(["bench", "--url", native_url, *shape, "--out", str(tmp_path / "n")]) == 0
    native = _summary(str(tmp_path / "n"))
    ext = 'vllm:prompt_tokens_by_source{engine="0",model_name="fake",source="external_kv_transfer"}'
    hit = 'vllm:prompt_tokens_by_source{engine="0",model_name="fake",source="local_cache_hit"}'
    assert native["token_source"] == "vllm" and not native["kvtier_present"]
    assert native["connector_tokens"] == native["delta"][ext] > 0  # not "from HBM"
    assert native["hbm_tokens"] == native["delta"][hit]
    assert native["hbm_tokens"] + native["connector_tokens"] == native["cached_tokens"]
    # where vLLM lacks the series, kvtier's own counter is the fallback
    assert main(["bench", "--url", old_kvtier_url, *shape, "--out", str(tmp_path / "k")]) == 0
    old = _summary(str(tmp_path / "k"))
    assert old["token_source"] == "kvtier" and old["kvtier_present"]
    restored = 'vllm:kvtier_restored_tokens_total{engine="0",model_name="fake"}'
    assert old["connector_tokens"] == old["delta"][restored] == native["connector_tokens"]
    assert old["hbm_tokens"] == old["cached_tokens"] - old["connector_tokens"]


def test_shared_prefix_options_have_aiperfs_names_and_the_old_aliases() -> None:
    p = build_parser()
    new = p.parse_args(["bench", "serving", "--prompt-prefix-pool-size", "3",
                        "--prompt-prefix-length", "64", "--isl", "8", "--osl", "5"])
    old = p.parse_args(["bench", "serving", "--prefixes", "3", "--prefix-len", "64",
                        "--suffix-len", "8", "--output-len", "5"])
    picked = ("prefixes", "prefix_len", "suffix_len", "output_len")
    assert [getattr(new, k) for k in picked] == [getattr(old, k) for k in picked] == [3, 64, 8, 5]


def _replay_in_order(w: TraceReplay) -> list[Any]:
    specs = []
    while (spec := w.next_request()) is not None:
        specs.append(spec)
        w.complete(spec, None, spec.max_tokens)
    return specs


def test_trace_replay_maps_each_hash_id_to_one_fixed_block() -> None:
    records = read_trace(str(TRACE))
    specs = _replay_in_order(TraceReplay(str(TRACE), block_size=512, seed=0))
    assert len(specs) == len(records) == 10
    assert [len(s.prompt) for s in specs] == [r.input_length for r in records]
    assert [s.max_tokens for s in specs] == [r.output_length for r in records]
    assert [s.at for s in specs] == [r.timestamp_ms / 1000 for r in records]
    # hash ids 0,1 -> the same 1,024 tokens in requests 0, 1, 3, 4 and 8
    assert all(s.prompt[:1024] == specs[0].prompt[:1024] for s in (specs[i] for i in (1, 3, 4, 8)))
    assert specs[1].prompt[1024:] != specs[0].prompt[1024:1300]  # id 3 is not id 2
    assert specs[4].prompt[:1300] == specs[1].prompt  # ids 0,1,3: a longer cut of the same
    assert specs[2].prompt[:512] != specs[0].prompt[:512]
    # reuse = leading tokens an earlier completed request computed (partial last blocks too)
    assert [s.reuse_tokens for s in specs] == [0, 1024, 0, 1100, 1300, 0, 600, 0, 1024, 0]
    again = _replay_in_order(TraceReplay(str(TRACE), block_size=512, seed=0))
    assert [s.prompt for s in again] == [s.prompt for s in specs]  # deterministic
    other = _replay_in_order(TraceReplay(str(TRACE), block_size=512, seed=1))
    assert other[0].prompt != specs[0].prompt


def test_a_bad_trace_is_one_clear_error(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                   '{"timestamp": 5, "input_length": 10}\n')
    assert main(["bench", "--workload", "trace", "--trace", str(bad), "--out",
                 str(tmp_path / "o")]) == 2
    assert f"{bad}:2: not a trace record" in capsys.readouterr().err


def test_trace_replay_against_a_server_once_through_the_trace(kvtier_url: str, tmp_path: Path
                                                              ) -> None:
    out = str(tmp_path / "t")
    assert main(["bench", "--url", kvtier_url, "--workload", "trace", "--trace", str(TRACE),
                 "--concurrency", "1", "--no-progress", "--no-plot", "--out", out]) == 0
    s = _summary(out)
    assert s["requests"] == 10 and s["failed"] == 0  # all records, once, by default
    assert s["repeat_requests"] == 5 and s["reuse_tokens"] == 1024 + 1100 + 1300 + 600 + 1024


def test_trace_timing_sends_each_request_at_its_timestamp() -> None:
    state = FakeState(first_delay=0.001, itl=0.001)
    w = TraceReplay(str(TRACE), block_size=512)

    async def go() -> list[Any]:
        async with FakeServer(state) as url:
            res, _ = await drive(url, "m", w, LoadShape(None, requests=10, schedule=True))
            return res

    results = asyncio.run(go())
    assert len(results) == 10 and all(r.ok for r in results)
    sent = [a - state.arrivals[0] for a in state.arrivals]
    for got, rec in zip(sent, read_trace(str(TRACE))):
        assert got == pytest.approx(rec.timestamp_ms / 1000, abs=0.08)


def test_rounds_need_compare_and_a_positive_count(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--rounds", "3"], ["--rounds", "0", "--compare", "a=m --no-kvtier"]):
        assert main(["bench", *argv]) == 2
        assert "--rounds N wants N >= 1" in capsys.readouterr().err
