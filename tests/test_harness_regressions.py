"""Bugs the fault-injection harness found in kvtier, one named test each.

Every test runs a scenario family aimed at the bug (tests/harness/cases.py) over both
schedulers and world sizes 1 and 2, and checks two things: with kvtier as it is, the oracle
finds nothing; with the bug put back (tests/harness/bugs.py, ``revert_*``), the oracle still
finds it. The second half keeps the test honest when scenarios or kvtier change.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from harness import bugs, cases
from harness.driver import run_scenario
from harness.workload import Scenario

COMBOS = [(False, 1), (True, 1), (False, 2), (True, 2)]
ROOT = Path(__file__).resolve().parent.parent
VLLM025 = ROOT / ".cache" / "vllm-0.25.1"


@pytest.fixture(scope="module", autouse=True)
def priority_025() -> Iterator[subprocess.Popen[str] | None]:
    """The 0.25.1 run of
    :func:`test_priority_scheduler_on_vllm025_never_leaves_a_parked_load_behind_a_blocked_request`
    (a process of its own), started with the module so that it runs beside the in-process
    tests rather than after them; None where 0.25.1 is not unpacked."""
    if not (VLLM025 / "vllm" / "__init__.py").exists():
        yield None
        return
    # this checkout's kvtier first, not the one the venv's editable install points at
    path = os.pathsep.join(map(str, (VLLM025, ROOT / "src", ROOT / "tests")))
    env = dict(os.environ, PYTHONPATH=path,
               VLLM_LOGGING_LEVEL="ERROR")
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.run", "--case", "priority_parked", "--revert",
         "priority_loads"], cwd=ROOT / "tests", env=env, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate(timeout=10)


def _run(make: Callable[[int, bool, int], Scenario], seeds: range,
         patch: Callable[[], contextlib.AbstractContextManager[None]] | None) -> Counter[str]:
    found: Counter[str] = Counter()
    for seed in seeds:
        for async_sched, ws in COMBOS:
            sc = make(seed, async_sched, ws)
            with patch() if patch is not None else contextlib.nullcontext():
                r = run_scenario(sc)
            found[r.violation.kind if r.violation else "ok"] += 1
            if r.violation and patch is None:
                pytest.fail(f"{sc.describe()}: {r.violation}")
    return found


def _check(make: Callable[[int, bool, int], Scenario], revert: Callable[[], object],
           expected: set[str], seeds: range = range(8)) -> None:
    fixed = _run(make, seeds, None)
    assert set(fixed) == {"ok"}, fixed
    broken = _run(make, seeds, revert)  # type: ignore[arg-type]
    assert set(broken) & expected, f"the reverted bug went unnoticed: {dict(broken)}"


def test_recycled_request_id_loads_its_own_prefix_not_the_finished_requests() -> None:
    """Bug: vLLM may reuse the id of a finished request while that request's saves are still
    in flight. kvtier kept the old request's state under that id and handed it to the new
    request, so the newcomer's lookup used the old prompt's chunk keys: kvtier promised and
    loaded the *previous* prompt's KV into the new request's blocks (silent corruption).
    Fix: ``on_new_request`` always starts a new lifecycle; jobs keep a reference to the
    lifecycle they belong to, so late completions finish on the old one."""
    _check(cases.recycled_id, bugs.revert_recycled_id, {"load_wrong_bytes", "wrong_kv_read"})


def test_request_preempted_by_reset_and_resumed_next_step_keeps_its_block_table() -> None:
    """Bug: ``reset_prefix_cache(reset_running_requests=True)`` preempts running requests
    between two steps; the next step lists them in ``preempted_req_ids`` *and* resumes them
    with a new block table. kvtier applied the preemptions after the step's block updates,
    wiping the resumed table; the blocks allocated afterwards were taken for the first chunks,
    so later saves copied other positions' KV under those chunks' keys (a restore of them
    returns wrong KV; the harness first saw the save read blocks the forward still writes).
    Fix: ``build_connector_meta`` applies preemptions before the step's block updates."""
    _check(cases.resumed_after_reset, bugs.revert_preempt_order,
           {"save_wrong_blocks", "block_reused_during_save", "load_wrong_bytes",
            "wrong_kv_read"})


def test_request_scheduled_before_the_layout_handshake_is_not_saved_from_a_partial_table(
) -> None:
    """Bug: kvtier's scheduler half is made when the workers' layout arrives with the first
    step's output; until then lookups are deferred (``None``). vLLM 0.32 still schedules a
    request that skips the prefix cache (prompt logprobs: its external hit is forced to 0,
    ``None`` included), and kvtier stops deferring after ``MAX_GEOMETRY_DEFERRALS``. The
    blocks of such a first step were never recorded, later ones were appended to an empty
    table, and chunk j was saved from the blocks of chunk j+k under chunk j's key: any later
    request with that prefix restored another part of the prompt (silent corruption).
    Fix: requests scheduled before the handshake are not saved from until a step hands over
    their full block table (resumption)."""
    _check(cases.scheduled_before_handshake, bugs.revert_blind_requests,
           {"save_wrong_blocks", "load_wrong_bytes", "wrong_kv_read"}, seeds=range(4))


def test_blocks_of_a_recomputed_layerwise_load_leave_vllms_prefix_cache() -> None:
    """Bug (found by the default batch: vLLM 0.32, two ranks, seed 1080): a layer-by-layer
    load failed, and vLLM's ``recompute`` policy kept its blocks (and those the step computed
    after them) in the prefix cache for the recompute; the request was preempted before the
    recompute reached its last block, and a request sharing the prefix hit that block and
    read KV nobody computed. Fix: the workers report the recomputed blocks
    (``WorkerReport.recomputed_blocks``), and the scheduler half drops every table's cache
    entries from the first of them on (``kvtier.vllm.failed_loads.forget_recomputed_blocks``)
    before vLLM schedules again."""
    _check(cases.recomputed_while_shared, bugs.revert_recomputed_blocks_cached,
           {"wrong_kv_read"})


def test_a_load_by_layer_in_a_batch_that_may_replay_a_full_graph_is_waited_before_it(
        ) -> None:
    """Found by reasoning, not by the harness's random batch: a hit promised by layer can be
    scheduled with one token (the step's budget) in a batch of one-token decodes, for which
    vLLM replays a FULL CUDA graph and calls no layer hook; the forward then read the blocks
    unwaited (recomputed under the synchronous scheduler, the engine stopped under the
    asynchronous one). Fix: such a step's plan says ``loads_before_forward`` and the workers
    order the forward after every band at bind (on the device)."""
    _check(cases.by_layer_in_a_decode_batch, bugs.revert_loads_before_forward, {"crash"})


def test_duplicate_completion_notice_is_reported_once() -> None:
    """Bug: the worker reported every completion its transfer engine delivered. A transport
    that delivers a completion twice made a rank report a save twice (the scheduler half
    raised "reported more than once per rank" inside update_connector_output, killing
    EngineCore) or crashed the worker on a second load completion (KeyError).
    Fix: the worker keeps its jobs in flight until their first completion and drops later
    ones (kvtier guarantees one report per job and rank)."""
    _check(lambda s, a, w: cases.lossy_notices(s, "duplicate", a, w), bugs.revert_exactly_once,
           {"crash"})


def test_lost_completion_notice_is_recovered_by_query() -> None:
    """Bug: a completion notice the transport never delivered left its job in flight forever:
    a parked request never got ``finished_recving`` and the engine never drained.
    Fix: the worker asks ``TransferEngine.query`` (ground truth, like ``event.query()``) for
    jobs in flight for ``REQUERY_STEPS`` collects."""
    _check(lambda s, a, w: cases.lossy_notices(s, "drop", a, w), bugs.revert_exactly_once,
           {"not_drained", "parked_too_long"})


@pytest.mark.vllm025
def test_priority_scheduler_on_vllm025_never_leaves_a_parked_load_behind_a_blocked_request(
        priority_025: subprocess.Popen[str] | None) -> None:
    """Bug (found on vLLM 0.25.1 only): its priority scheduler compares the heads of the
    waiting queue and of the skipped queue (where requests parked for a load wait) by
    priority, and stops at the first request it cannot allocate. A low-priority request parked
    for a kvtier load holds its blocks; a higher-priority request that needs more blocks than
    are left heads the waiting queue, cannot be allocated, and the parked request is never
    promoted: the engine stops serving. vLLM 0.32 drains block-holding requests first.
    Fix: kvtier turns loads off (saves stay on, with a warning) under the priority policy on a
    vLLM whose scheduler does not drain block-holding requests first."""
    if priority_025 is None:
        pytest.skip("vLLM 0.25.1 is not unpacked (bash scripts/fetch_vllm025.sh)")
    stdout, stderr = priority_025.communicate(timeout=600)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    assert lines, stderr[-4000:]
    out = json.loads(lines[-1])
    assert out["version"].startswith("0.25")
    assert set(out["fixed"]) == {"ok"}, out
    assert "not_drained" in out["reverted"], out


def test_priority_scheduler_on_vllm032_keeps_loads() -> None:
    """The same family on vLLM 0.32 (block-holding requests first): loads stay on and the
    engine drains."""
    loads = 0
    for seed in range(4):
        for async_sched, ws in COMBOS:
            r = run_scenario(cases.priority_parked(seed, async_sched, ws))
            assert r.ok, r.violation
            loads += r.counts.get("loads_started", 0)
    assert loads > 0
