"""vLLM 0.25.1's side of the multi-group load-failure rules (tests/proto_multigroup_load_failure.py;
the design: docs/notes/hybrid-loads-025.md): the two facts behind kvtier's rules, checked on
vLLM's real scheduler with a minimal connector. kvtier's mechanism itself is tested through
its real connector in tests/test_vllm025_multigroup_loads.py, which superseded the
prototype's truncation test."""

from __future__ import annotations

from typing import Any

import pytest

from _harness_runs import run_module_025


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_module_025("proto_multigroup_load_failure")


@pytest.mark.vllm025
def test_per_block_report_with_two_groups_crashes_vllm025(results: dict[str, Any]) -> None:
    """Why the mechanism is needed: vLLM's own report path (invalid_block_ids)."""
    r = results["per_block_report"]
    assert r["crashed"] and r["at"] == "v1/core/sched/scheduler.py:2546", r


@pytest.mark.vllm025
def test_truncating_to_zero_with_a_local_hit_on_retry_crashes_vllm025(
        results: dict[str, Any]) -> None:
    """Option (a) at boundary 0: vLLM's own failure path frees the request's blocks first
    (scheduler.py:2420-2425); a connector cannot, and the retry's local hit meets a request
    that still holds blocks. So (a) is not usable at 0 (the note's decision)."""
    r = results["truncate_zero_with_local_hit"]
    assert r["crashed"] and r["at"].startswith("v1/core/single_type_kv_cache_manager.py"), r
