"""Prepare before promise through vLLM 0.25.1's real scheduler with two KV-cache groups
(tests/vllm025_prepare.py, in a subprocess with 0.25.1 on the path): vLLM takes kvtier's
``None`` as "ask again", parks the request only once the hit verified, and a corrupt chunk
lowers the promise instead of failing a promised load."""

from __future__ import annotations

from typing import Any

import pytest

from _harness_runs import run_module_025


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_module_025("vllm025_prepare")


def _statuses(r: dict[str, Any]) -> list[str]:
    return [t["status"].get("r", "gone") for t in r["trace"]]


@pytest.mark.vllm025
def test_a_deferred_lookup_is_asked_again_and_then_promised(results: dict[str, Any]) -> None:
    r = results["clean"]
    assert r["answers"] == [None, 96]  # deferred once while verified, then the whole hit
    assert _statuses(r)[:3] == ["WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING"]
    assert [t["scheduled"] for t in r["trace"]][:3] == [{}, {}, {"r": 1}]
    assert r["loads_ok"] == 1 and r["loaded_tokens"] == 96 and r["loads_failed"] == 0
    assert r["requests_left"] == r["kvtier_requests_left"] == r["pinned"] == 0


@pytest.mark.vllm025
def test_a_corrupt_chunk_lowers_the_promise_and_no_promised_load_fails(
        results: dict[str, Any]) -> None:
    r = results["corrupt"]
    # chunk 1 fails its check: dropped (with chunk 2); boundary 1 verified next, then promised
    assert r["answers"] == [None, None, 32]
    assert r["checksum_failures"] == 1 and r["corrupt_chunks"] == 1 and r["prepares"] == 2
    assert r["loads_failed"] == 0 and r["loaded_tokens"] == 32
    assert {"r": 97 - 32} in [t["scheduled"] for t in r["trace"]]
    assert r["requests_left"] == r["kvtier_requests_left"] == r["pinned"] == 0


@pytest.mark.vllm025
def test_a_slow_verification_times_out_into_a_cold_prefill(results: dict[str, Any]) -> None:
    r = results["timeout"]
    assert r["answers"] == [None, 0] and r["declined"] == {"prepare_timed_out": 1}
    assert [t["scheduled"] for t in r["trace"]][1] == {"r": 97}
    assert r["loads_ok"] == r["loads_failed"] == 0
    assert r["requests_left"] == r["kvtier_requests_left"] == r["pinned"] == 0
