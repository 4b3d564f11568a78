"""Prepare before promise (kvtier.prepare) at the core: the scheduler half and a worker on the
small CPU cache. With ``prepare_hits`` a lookup defers (None) while the workers verify the
hit's chunks, promises only what verified, drops what did not, and gives up after
``prepare_timeout_ms`` (issue 12 item 10, vLLM 0.25.1 with several KV-cache groups)."""

from __future__ import annotations

from _small_kv import CHUNK_TOKENS, CONFIG
from _tier import FULL_B, STATE_B, Tier, prompt
from kvtier.planner import Decline
from kvtier.protocol import JobKind
from kvtier.scheduler import NewRequest, StepInput
from kvtier.testing.corruption import flip_stored_byte, slot_of_chunk


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _tier(clock: Clock | None = None, **config: object) -> Tier:
    cfg = CONFIG.model_copy(update={"cost_model": False, **config})
    return Tier(cfg, prepare_hits=True, clock=clock or Clock())


def _lookup_until_promised(tier: Tier, req: str, tokens: list[int], limit: int = 6
                           ) -> tuple[int, int]:
    """Look up, stepping the engine while deferred: (tokens promised, deferrals)."""
    tier.sched.add_request(req)
    for deferrals in range(limit):
        n = tier.sched.lookup(req, tokens, 0)
        if n is not None:
            return n, deferrals
        res = tier.step()
        assert not res.report.loads, "a deferred lookup loaded something"
    raise AssertionError(f"still deferred after {limit} steps")


def _load(tier: Tier, req: str, n: int) -> object:
    tier.sched.start_load(req, n, [FULL_B, STATE_B])
    res = tier.step(StepInput(new=[NewRequest(req, [FULL_B, STATE_B])]))
    tier.sched.request_finished(req)
    tier.step()
    return res


def test_a_clean_hit_is_verified_then_promised_whole() -> None:
    tier = _tier()
    tokens = prompt(2)
    tier.prefill("a", tokens)
    plans = []
    orig = tier.sched.build_step

    def spy():  # type: ignore[no-untyped-def]
        plan = orig()
        plans.append(plan)
        return plan
    tier.sched.build_step = spy  # type: ignore[method-assign]
    n, deferrals = _lookup_until_promised(tier, "b", tokens)
    assert n == 3 * CHUNK_TOKENS and deferrals == 1
    verifies = [j for p in plans for j in p.verifies]
    assert len(verifies) == 1 and {op.group for op in verifies[0].ops} == {0, 1}
    assert len(verifies[0].ops) == 3 + 1  # three KV chunks and the boundary's state
    res = _load(tier, "b", n)
    assert res.failed_loads == set() and tier.sched.stats.loads_ok == 1  # type: ignore[attr-defined]
    assert tier.sched.stats.prepares == 1 and tier.worker.checksum_failures == 0
    tier.sched.check_drained()
    tier.close()


def test_without_prepare_the_hit_is_promised_at_once() -> None:
    """The control: only prepare_hits defers."""
    tier = Tier(CONFIG.model_copy(update={"cost_model": False}))
    tokens = prompt(2)
    tier.prefill("a", tokens)
    tier.sched.add_request("b")
    assert tier.sched.lookup("b", tokens, 0) == 3 * CHUNK_TOKENS
    tier.close()


def test_a_corrupt_chunk_is_dropped_before_the_promise_and_a_lower_hit_verified() -> None:
    tier = _tier()
    tokens = prompt(3)
    tier.prefill("a", tokens)
    cls, slot = slot_of_chunk(tier.sched, tokens, chunk=1, group=0)
    flip_stored_byte(tier.worker, cls, slot, offset=0)
    n, deferrals = _lookup_until_promised(tier, "b", tokens)
    # chunk 1 failed: chunks 1 and 2 are gone; boundary 1 needs its own state, verified next
    assert n == CHUNK_TOKENS and deferrals == 2
    assert tier.worker.checksum_failures == 1 and tier.sched.stats.checksum_failures == 1
    assert tier.sched.stats.corrupt_chunks == 1 and tier.sched.stats.prepares == 2
    res = _load(tier, "b", n)
    assert res.failed_loads == set()  # type: ignore[attr-defined]
    assert tier.sched.stats.loads_failed == 0, "a promised load failed"
    tier.sched.check_drained()
    tier.close()


def test_a_slow_preparation_times_out_into_no_hit() -> None:
    clock = Clock()
    tier = _tier(clock, prepare_timeout_ms=50.0)
    tokens = prompt(4)
    tier.prefill("a", tokens)
    tier.sched.add_request("b")
    assert tier.sched.lookup("b", tokens, 0) is None  # a verify job is planned
    clock.now += 0.049
    assert tier.sched.lookup("b", tokens, 0) is None  # still within the bound, not re-planned
    assert tier.sched.stats.prepares == 1
    clock.now += 0.002
    assert tier.sched.lookup("b", tokens, 0) == 0
    assert tier.sched.requests["b"].last_decline is Decline.PREPARE_TIMEOUT
    assert tier.sched.stats.declined[Decline.PREPARE_TIMEOUT.value] == 1
    tier.step()  # the verify job runs and finishes: its pins end with it
    assert tier.sched.index.stats().pinned == 0, "a given-up preparation kept its pins"
    assert tier.sched.lookup("b", tokens, 0) == 0  # never defers again
    tier.sched.request_finished("b")
    tier.step()
    tier.sched.check_drained()
    tier.close()


def test_a_request_that_finishes_while_preparing_leaves_nothing_pinned() -> None:
    tier = _tier()
    tokens = prompt(5)
    tier.prefill("a", tokens)
    tier.sched.add_request("b")
    assert tier.sched.lookup("b", tokens, 0) is None
    tier.sched.request_finished("b")
    res = tier.step()
    assert list(res.report.verifies.values()) == [[1, 0]]
    tier.step()
    tier.sched.check_drained()
    assert tier.sched.has_pending_work() is False
    assert JobKind.VERIFY.value == "verify"
    tier.close()


def test_prepared_chunks_stay_pinned_until_the_promise() -> None:
    """Between the verify and the promise nothing may evict or rewrite a prepared chunk."""
    tier = _tier()
    tokens = prompt(6)
    tier.prefill("a", tokens)
    tier.sched.add_request("b")
    assert tier.sched.lookup("b", tokens, 0) is None
    tier.step()
    assert tier.sched.index.stats().pinned == 4  # three chunks and a state object
    n = tier.sched.lookup("b", tokens, 0)
    assert n == 3 * CHUNK_TOKENS
    _load(tier, "b", n)
    tier.sched.check_drained()
    tier.close()


def test_a_preparation_that_fails_without_a_mismatch_declines_the_hit() -> None:
    """A verify job that fails for another reason (an exception in the engine) proves
    nothing: no promise, no chunk dropped, the request goes on without a hit."""
    from kvtier.testing.faults import faulty_factory

    cfg = CONFIG.model_copy(update={"cost_model": False})
    tier = Tier(cfg, engine=faulty_factory(), prepare_hits=True, clock=Clock())
    tokens = prompt(7)
    tier.prefill("a", tokens)
    tier.worker.engine.raise_in_jobs = 1  # type: ignore[attr-defined]
    tier.sched.add_request("b")
    assert tier.sched.lookup("b", tokens, 0) is None
    tier.step()
    assert tier.sched.lookup("b", tokens, 0) == 0
    assert tier.sched.requests["b"].last_decline is Decline.PREPARE_FAILED
    assert tier.sched.stats.corrupt_chunks == 0 and tier.worker.checksum_failures == 0
    tier.sched.request_finished("b")
    tier.step()
    tier.sched.check_drained()
    tier.close()
