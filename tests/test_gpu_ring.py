"""The GPU engine's round-robin rings (the device staging and the pinned block-id upload):
a take gets the events of exactly the earlier users whose bytes it overlaps, and its cost
does not grow with the users still live (the id ring keeps thousands between two wraps:
one per batch)."""

from __future__ import annotations

import random
import time

from kvtier.gpu.engine import _Ring


def _model_take(live: list[tuple[int, int, int]], a: int, b: int
                ) -> tuple[list[tuple[int, int, int]], set[int]]:
    hit = {e for s, t, e in live if s < b and a < t}
    return [u for u in live if u[2] not in hit], hit


def test_a_take_waits_for_exactly_the_users_it_overlaps() -> None:
    rng = random.Random(5)
    for size, align in ((100, 1), (256, 16), (1000, 7)):
        ring = _Ring(size, align)
        live: list[tuple[int, int, int]] = []  # the brute-force model: (start, end, event)
        for event in range(3000):
            n = rng.randint(1, size // 3)
            a, waits = ring.take(n)
            assert 0 <= a and a + n <= size
            live, hit = _model_take(live, a, a + n)
            assert sorted(waits) == sorted(hit)
            if rng.random() < 0.9:  # a failed enqueue takes a range and gives nothing back
                ring.give(a, n, event)
                live.append((a, a + n, event))
            assert len(ring) == len(live)


def _takes_per_second(ring: _Ring, n: int, reps: int) -> float:
    t = time.perf_counter()
    for i in range(reps):
        a, _ = ring.take(n)
        ring.give(a, n, i)
    return reps / (time.perf_counter() - t)


def test_a_take_costs_the_same_with_thousands_of_live_users() -> None:
    """Before: every take walked every live user (8,192 of them before the id ring's first
    wrap at 32 ids a batch), ~2.5 ms a batch on the H200's host late in a lap."""
    few = _Ring(1 << 18, 2)
    many = _Ring(1 << 18, 2)
    for i in range(8000):  # a lap's worth of 32-id batches still live
        a, _ = many.take(32)
        many.give(a, 32, i)
    for i in range(10):
        a, _ = few.take(32)
        few.give(a, 32, i)
    # the two rings are not yet near a wrap: every take overlaps nothing
    fast = max(_takes_per_second(few, 1, 600) for _ in range(3))
    slow = max(_takes_per_second(many, 1, 600) for _ in range(3))
    assert slow > fast / 5, (fast, slow)
