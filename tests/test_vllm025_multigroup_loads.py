"""kvtier's loads with several KV-cache groups on vLLM 0.25.1's real Scheduler, through
kvtier's real connector halves (tests/vllm025_multigroup_loads.py, run in a subprocess with
``PYTHONPATH=.cache/vllm-0.25.1``; the design: docs/notes/hybrid-loads-025.md).

The oracle is a run without kvtier at the same boundary (``cold_96``: an HBM hit of the 96
tokens kvtier restores; ``cold_32``: an HBM hit of the 32-token local hit): every step of
request ``r`` starts at the same token, schedules as many, and holds the same per-group block
table shape (which positions are vLLM's null block) over the positions the cold run holds;
the engine ends with the same free blocks; and the fake model's reads (attention positions, the state a mamba runner starts
from) found nothing wrong.
"""

from __future__ import annotations

from typing import Any

import pytest

from _harness_runs import run_module_025
from kvtier.load_retry import LOAD_RETRIES

SETS = ("full+full", "full+swa", "full+mamba", "full+mamba+mamba")
NOT_FULL_ONLY = ("full+swa", "full+mamba", "full+mamba+mamba")


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_module_025("vllm025_multigroup_loads")


def assert_like_cold(run: dict[str, Any], cold: dict[str, Any]) -> None:
    assert "error" not in run, run.get("error")
    assert cold["findings"] == [] and run["findings"] == [], run["findings"]
    steps = [(rec["from"], rec["scheduled"]) for rec in run["records"]]
    assert steps == [(rec["from"], rec["scheduled"]) for rec in cold["records"]]
    for mine, theirs in zip(run["records"], cold["records"]):
        for table, cold_table in zip(mine["tables"], theirs["tables"]):
            # the cold run's positions alike; blocks held beyond them (allocated when the
            # load was promised) are real blocks
            assert table[:len(cold_table)] == cold_table, (mine, theirs)
            assert "-" not in table[len(cold_table):], (mine, theirs)
    assert (run["free_blocks"], run["requests_left"]) == (cold["free_blocks"],
                                                           cold["requests_left"])


@pytest.mark.vllm025
@pytest.mark.parametrize("group_set", SETS)
def test_a_copy_error_once_is_reissued_and_the_load_succeeds(
        results: dict[str, Any], group_set: str) -> None:
    r = results[group_set]
    run = r["load_once"]
    assert run["parked"] and run["promised"] == 96
    assert run["stats"]["injected"] == 1 and run["stats"]["reissued"] == 1
    assert run["stats"]["loads_failed"] == 0
    assert run["invalid_block_reports"] == []
    assert_like_cold(run, r["cold_96"])


@pytest.mark.vllm025
def test_a_load_failing_for_good_with_full_attention_only_recomputes_from_the_local_hit(
        results: dict[str, Any]) -> None:
    """Option (a): reported finished, ``num_computed_tokens`` back to the local hit (32) in
    ``update_connector_output``; the request then runs as with an HBM hit of 32."""
    r = results["full+full"]
    run = r["load_always"]
    assert run["parked"] and run["promised"] == 96
    assert run["stats"]["reissued"] == LOAD_RETRIES and run["stats"]["loads_failed"] == 1
    assert run["invalid_block_reports"] == []
    assert_like_cold(run, r["cold_32"])


@pytest.mark.vllm025
@pytest.mark.parametrize("group_set", NOT_FULL_ONLY)
def test_a_load_failing_for_good_with_a_window_or_state_group_stops_naming_the_request(
        results: dict[str, Any], group_set: str) -> None:
    """No recompute from 32 is sound there (null-padded tables): fail stop, one line naming
    the request and the reason, never a per-block report (it kills 0.25.1's scheduler)."""
    run = results[group_set]["load_always"]
    assert run["parked"] and run["promised"] == 96
    err = run["error"]
    assert err["type"] == "LoadFailedAfterPromise", err
    assert "request r " in err["message"] and "load reported failed" in err["message"]
    assert "\n" not in err["message"]
    assert run["stats"]["reissued"] == LOAD_RETRIES
    assert run["invalid_block_reports"] == [] and run["findings"] == []


MAMBA_SETS = ("full+mamba", "full+mamba+mamba")


@pytest.mark.vllm025
@pytest.mark.parametrize("group_set", MAMBA_SETS)
@pytest.mark.parametrize("case", ["hazard_no_hit_beyond", "hazard_hit_beyond"])
def test_a_local_hit_past_the_state_groups_ends_like_a_cold_recompute(
        results: dict[str, Any], group_set: str, case: str) -> None:
    """docs/vllm-api.md §0 item 8: 0.25.1 tells kvtier the attention groups' hit, where no
    state group holds a state. kvtier loads a state at its own boundary past it
    (``hazard_hit_beyond``), or drops the attention groups' HBM entries past the state and
    asks again (``hazard_no_hit_beyond``); either way the mamba runner never starts from a
    null block or a wrong state (the fake model's reads), and ``r`` runs as after an HBM hit
    of 96 tokens."""
    run = results[group_set][case]
    assert run["evicted"]["state"] > 0  # the hazard was set up
    assert run["hits_forgotten"] == (2 if case == "hazard_no_hit_beyond" else 0)
    assert run["stats"]["loads_ok"] == 1 and run["stats"]["hit_tokens"] == 32
    assert_like_cold(run, results[group_set]["cold_96"])


@pytest.mark.vllm025
def test_recurrent_state_needs_states_kept_per_block_at_start_up(results: dict[str, Any]
                                                                 ) -> None:
    """0.25.1's 'align' and 'all' start; 'none' is refused in one line naming the flag."""
    st = results["startup"]
    assert st["mode_align"]["started"] and st["mode_all"]["started"]
    refused = st["mode_none"]
    assert not refused["started"] and refused["type"] == "StartupError"
    assert refused["message"].startswith("kvtier: mamba_cache_mode='none'")
    assert "--enable-prefix-caching" in refused["message"] and "\n" not in refused["message"]


@pytest.mark.vllm025
def test_the_chunk_is_a_multiple_of_every_group_block_size_the_state_groups_too(
        results: dict[str, Any]) -> None:
    """Attention blocks of 16 tokens and mamba blocks of 48 (as seed 004's 1,536-token
    attention groups beside a 3,072-token KDA state group): unset, the chunk is the smallest
    multiple of their LCM of at least 256 tokens; a multiple of 48 is taken; 16 is refused
    naming 48."""
    st = results["startup"]
    assert st["chunk_unset_16_48"] == {"started": True, "chunk_tokens": 288}
    assert st["chunk_96_with_48"] == {"started": True, "chunk_tokens": 96}
    refused = st["chunk_16_with_48"]
    assert refused["type"] == "StartupError" and "chunk_tokens=48" in refused["message"]


@pytest.mark.vllm025
def test_a_load_failing_for_good_at_a_local_hit_of_0_stops_even_with_full_attention_only(
        results: dict[str, Any]) -> None:
    """At 0, vLLM's own failure path frees the request's blocks, which a connector cannot;
    a later local hit then crashes 0.25.1 (tests/test_proto_multigroup_load_failure.py)."""
    run = results["full+full"]["load_always_hit_0"]
    assert run["parked"] and run["promised"] == 96
    err = run["error"]
    assert err["type"] == "LoadFailedAfterPromise" and "request r " in err["message"]
    assert "local hit of 0" in err["message"] and run["invalid_block_reports"] == []
