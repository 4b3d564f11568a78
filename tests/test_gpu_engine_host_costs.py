"""The GPU engine's host costs, on CPU (no device). Its round-robin rings (the device staging
and the pinned block-id upload): a take gets the events of exactly the earlier users whose
bytes it overlaps, and its cost does not grow with the users still live (the id ring keeps
thousands between two wraps: one per batch). A step's saves are validated in one pass."""

from __future__ import annotations

import random
import time
from typing import Any

from _families import blocks_per_chunk, drain, make_mover, materialize, stored_recipes
from kvtier import codec
from kvtier.config import KvtierConfig
from kvtier.gpu.engine import CudaTransferEngine, _Ring
from kvtier.protocol import Job, TransferOp
from kvtier.testing.host_runtime import HostRuntime

BY_NAME = {r["name"]: r for r in stored_recipes()}


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
            assert a >= 0 and a + n <= size
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


class CountingRuntime(HostRuntime):
    """Copies run as on HostRuntime; each ``copy`` call (one per batch on the DMA path) is
    counted."""

    def __init__(self) -> None:
        self.copies = 0

    def copy(self, desc: Any, stream: Any) -> None:
        self.copies += 1
        super().copy(desc, stream)


def test_a_steps_saves_are_enqueued_together_at_its_poll() -> None:
    """A prefill step's saves (here 8 batches of 2 chunks) are checked and cut into batches
    in one pass when the step's poll comes, not one pass per batch as they are queued (a
    pass costs tens of µs of host Python), and each is reported once, with its bytes."""
    fam = materialize(BY_NAME["v032_mla_auto"], "cpu")
    chunk, bpc = blocks_per_chunk(fam.layout)
    b = bpc[0]
    mover = make_mover(fam.layout, chunk, bpc, 16, pin=False)
    cb = codec.chunk_bytes(fam.layout.groups[0], b)
    rt = CountingRuntime()
    eng = CudaTransferEngine(mover, KvtierConfig(dram_size="1GiB"), mode="dma",
                             batch_bytes=2 * cb, runtime=rt)
    eng.tick()
    n = min(16, fam.layout.groups[0].num_blocks // b)
    for i in range(n):
        eng.save(Job(i, "r", [TransferOp(0, i, list(range(i * b, (i + 1) * b)))]))
    assert rt.copies == 0  # nothing enqueued while the step's saves are still coming
    got = drain(eng, set(range(n)))
    assert rt.copies == -(-n // 2)  # then batches of batch_bytes, as before
    assert all(c.ok and c.nbytes == cb for c in got.values())
    eng.close()
    mover.slab.close()
