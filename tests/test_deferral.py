"""Cache-aware admission's deferral rule (kvtier.deferral): when it defers (a running request
produces the request's next chunk, or HBM cannot hold it; only while others run or load; never
under the priority policy), and that no request is deferred past its bounds whatever the
sequence of lookups (starvation-free)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.deferral import DeferralLimits, Deferrals, Situation

COLD = Situation(waits_for_producer=False, fits=False, busy=True, priority=False)


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_deferred_when_it_waits_for_a_producer_or_does_not_fit_while_others_run() -> None:
    d = Deferrals(DeferralLimits(8, 1000.0, 4), Clock())
    assert d.defer("a", 1, COLD)  # does not fit
    assert d.defer("p", 1, Situation(waits_for_producer=True, fits=True, busy=True,
                                     priority=False))
    for s in (Situation(False, True, True, False),  # fits, nobody produces its chunk
              Situation(True, False, False, False),  # nothing runs or loads
              Situation(True, False, True, True)):  # priority policy
        assert not d.defer("b", 1, s)
    assert d.deferred == 2


def test_the_step_bound_then_never_again() -> None:
    d = Deferrals(DeferralLimits(3, 1e9, 4), Clock())
    assert [d.defer("a", s, COLD) for s in (1, 1, 2, 3, 4, 5)] == [True, True, True, True,
                                                                    False, False]
    assert d.deferred_steps("a") == 3 and d.expired == 1


def test_the_time_bound_counts_from_the_first_deferral() -> None:
    clock = Clock()
    d = Deferrals(DeferralLimits(100, 50.0, 4), clock)
    assert d.defer("a", 1, COLD)
    clock.t = 0.049
    assert d.defer("a", 2, COLD)
    clock.t = 0.050
    assert not d.defer("a", 3, COLD) and not d.defer("a", 4, COLD)


def test_at_most_max_deferred_at_once_and_a_finished_one_frees_its_place() -> None:
    d = Deferrals(DeferralLimits(100, 1e9, 2), Clock())
    assert d.defer("a", 1, COLD) and d.defer("b", 1, COLD)
    assert not d.defer("c", 1, COLD) and d.declined_full == 1
    d.forget("a")
    assert d.defer("c", 2, COLD)
    # one deferred two steps ago and not since (it was admitted) no longer takes a place
    assert d.defer("b", 2, COLD)
    assert not d.defer("e", 3, COLD)  # b and c deferred in step 2
    assert d.defer("f", 4, COLD)


LOOKUP = st.tuples(st.integers(0, 5), st.integers(0, 2), st.floats(0.0, 30.0),
                   st.booleans(), st.booleans(), st.booleans(), st.booleans())


@settings(max_examples=300, deadline=None)
@given(max_steps=st.integers(1, 6), max_ms=st.floats(1.0, 200.0),
       max_deferred=st.integers(1, 4), lookups=st.lists(LOOKUP, max_size=120))
def test_no_request_is_deferred_past_its_bounds(max_steps: int, max_ms: float,
                                                 max_deferred: int,
                                                 lookups: list[tuple]) -> None:
    clock = Clock()
    d = Deferrals(DeferralLimits(max_steps, max_ms, max_deferred), clock)
    step = 0
    first: dict[str, float] = {}
    steps: dict[str, set[int]] = {}
    for req, step_gap, ms, waits, fits, busy, prio in lookups:
        step += step_gap
        clock.t += ms / 1000.0
        rid = f"r{req}"
        s = Situation(waits, fits, busy, prio)
        if d.defer(rid, step, s):
            assert (waits or not fits) and busy and not prio
            first.setdefault(rid, clock.t)
            steps.setdefault(rid, set()).add(step)
            assert len(steps[rid]) <= max_steps
            assert (clock.t - first[rid]) * 1000.0 < max_ms
            assert d.active(step) <= max_deferred
