"""One preparation step (kvtier.prepare) for both reasons a hit is not yet promisable: chunks
on disk only (promoted into DRAM) and chunks in DRAM not yet verified (prepare_hits, as on
vLLM 0.25.1 with several KV-cache groups), for one request that needs both, and a chunk
flipped in DRAM before it is demoted."""

from __future__ import annotations

from pathlib import Path

import pytest

from _disk_loop import CHUNK, Loop, config, prompt
from kvtier.checksum import key_seed
from kvtier.protocol import StepPlan, TransferOp
from kvtier.testing.corruption import flip_stored_byte, slot_of_chunk


def _half_on_disk(tmp_path: Path) -> tuple[Loop, list[int], list[StepPlan]]:
    """A loop verifying hits before promising them, where prompt ``a``'s chunks 0 and 1 are
    in DRAM and on disk and chunk 2 is on disk only; the plans it runs are recorded."""
    loop = Loop(config(tmp_path, verify_checksums=True), prepare_hits=True)
    a = prompt(0)
    loop.prefill("a", a)
    loop.settle()
    for i in range(1, 5):
        loop.prefill(f"p{i}", prompt(i))
        loop.settle()
    keys = loop.keys(a)
    t = loop.sched.tier
    assert t is not None
    assert loop.sched.index.match(0, keys) == 2 and t.catalog.index.match(0, keys) == 3
    plans: list[StepPlan] = []
    schedule = loop.sched.schedule_step

    def recorded(*args: object, **kw: object) -> StepPlan:
        plan = schedule(*args, **kw)  # type: ignore[arg-type]
        plans.append(plan)
        return plan

    loop.sched.schedule_step = recorded  # type: ignore[method-assign]
    return loop, a, plans


def test_a_disk_hit_that_also_needs_verifying_is_prepared_by_one_step(tmp_path: Path) -> None:
    loop, a, plans = _half_on_disk(tmp_path)
    s, t = loop.sched, loop.sched.tier
    assert t is not None
    n, deferred, same = loop.restore("again", a)
    assert (n, same) == (3 * CHUNK, True)
    # the promotion read chunk 2 only; the verify job then checked chunks 0 and 1 only (the
    # promoted chunk was verified against its file's checksum as it landed)
    promoted = [op for p in plans for t in p.tiers for j in t.jobs if j.kind == "promote"
                for op in j.ops]
    verified = [op for p in plans for j in p.verifies for op in j.ops]
    keys = loop.keys(a)
    assert [op.key for op in promoted] == [keys[2]]
    assert sorted(op.slot for op in verified) == sorted(
        s.index.get(0, k).slot for k in keys[:2])  # type: ignore[union-attr]
    assert t.stats.promotions == 1 and s.stats.prepares == 1 and t.stats.hits == 1
    assert deferred == 2 and s.stats.prepare_deferrals == 2 and s.stats.prepare_timeouts == 0
    loop.settle()
    s.check_drained()
    loop.close()


def test_a_flip_in_dram_found_while_preparing_a_disk_hit_shortens_it(tmp_path: Path) -> None:
    loop, a, _ = _half_on_disk(tmp_path)
    s, t = loop.sched, loop.sched.tier
    assert t is not None
    cls, slot = slot_of_chunk(s, a, 1)
    flip_stored_byte(loop.ranks[0].worker, cls, slot, offset=17)
    n, deferred, same = loop.restore("again", a)
    # chunk 1 failed verification in DRAM: it and the promoted chunk 2 under it are dropped;
    # a failed job proves nothing of chunk 0, verified again by a second job, then promised;
    # the rest is recomputed: never a flipped byte restored
    assert same and n == CHUNK and deferred == 3 and s.stats.prepares == 2
    assert t.stats.promotions == 1 and s.stats.corrupt_chunks == 1
    loop.settle()
    s.check_drained()
    loop.close()


def test_a_chunk_flipped_in_dram_is_never_demoted_as_good(tmp_path: Path) -> None:
    loop = Loop(config(tmp_path, verify_checksums=True))
    a = prompt(0)
    loop.prefill("a", a)
    loop.settle()
    s, t = loop.sched, loop.sched.tier
    assert t is not None
    cls, slot = slot_of_chunk(s, a, 1)
    flip_stored_byte(loop.ranks[0].worker, cls, slot, offset=33)
    for i in range(1, 8):  # DRAM runs low: a's chunks are demoted (chunk 1 checked first)
        loop.prefill(f"p{i}", prompt(i))
        loop.settle()
    keys = loop.keys(a)
    assert t.stats.demotions_corrupt == 1
    assert loop.ranks[0].worker.tiers["disk"].corrupt_demotions == 1  # type: ignore[union-attr]
    assert t.catalog.index.match(0, keys) == 1  # chunk 0 only: 1 and 2 never reached disk
    assert s.index.match(0, keys) == 0  # and DRAM dropped the bad chunk with its child
    n, _, same = loop.restore("again", a)
    assert same and n == CHUNK  # chunk 0 from disk; the flipped byte is never restored
    loop.settle()
    s.check_drained()
    loop.close()


@pytest.mark.parametrize("sums_written", [True, False], ids=["promoted", "control-no-sums"])
def test_a_promoted_chunk_gets_the_slab_checksums_its_verified_load_checks(
        tmp_path: Path, sums_written: bool) -> None:
    """A file is verified by its own checksum (XXH3, kvtier.tiers.disk.file_checksum), not by
    the slab's: with verify_checksums the worker then stores the slot's slab checksums
    (kvtier.checksum, computed from the bytes that landed), and the verified load that follows
    passes with rows equal to what a save stores. The control skips that step: the same load
    fails its verification, so the test sees a promotion that leaves the rows stale."""
    loop = Loop(config(tmp_path, verify_checksums=True))
    w = loop.ranks[0].worker
    if not sums_written:
        w._promoted = lambda op: None  # type: ignore[method-assign]
    a = prompt(0)
    loop.prefill("a", a)
    loop.settle()
    for i in range(1, 7):  # a's chunks leave DRAM for the disk
        loop.prefill(f"p{i}", prompt(i))
        loop.settle()
    s, t = loop.sched, loop.sched.tier
    assert t is not None
    keys = loop.keys(a)
    assert s.index.match(0, keys) == 0 and t.catalog.index.match(0, keys) == 3
    n, _, same = loop.restore("again", a)
    assert t.stats.promotions == 3 and t.stats.checksum_failures == 0  # the files verified
    if not sums_written:
        assert w.checksum_failures >= 1  # the load found the slab's rows stale
        loop.close()
        return
    assert (n, same) == (3 * CHUNK, True) and w.checksum_failures == 0
    for i, k in enumerate(keys):
        _, slot = slot_of_chunk(s, a, i)
        assert w.mover.check([TransferOp(0, slot, [], key_seed(k))], skip=False) == []
    loop.settle()
    s.check_drained()
    loop.close()
