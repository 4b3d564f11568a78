"""Verified restores on the CPU engine (issue 12 item 10; docs/notes/checksums.md §8): every
chunk is checksummed at save, a load verifies every block position it writes before it writes
any, and a mismatch is a failed load, a counter, one log line and the chunk gone from the index,
never garbage in the KV cache."""

from __future__ import annotations

import logging

import pytest
import torch

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV, same
from _tier import FULL_B, STATE_B, Tier, prompt
from kvtier.checksum import key_seed
from kvtier.protocol import SKIP, Job, JobKind, StepPlan, TransferOp
from kvtier.slab import HostSlab
from kvtier.testing.corruption import flip_stored_byte, slot_of_chunk
from kvtier.transfer import ChunkMover, ThreadedTransferEngine
from kvtier.worker import OffloadWorker

FILL = 7.0
KEY_A, KEY_B = bytes(range(16)), bytes(range(1, 17))


def _mismatch_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "checksum mismatch" in r.getMessage()]


def _blocks_hold_fill(kv: SmallKV, full: list[int], state: list[int]) -> bool:
    held = [t for b in full for t in kv.attn_block(b)] + [t for b in state
                                                           for t in kv.state_block(b)]
    return all(bool((t == FILL).all()) for t in held)


def test_a_flipped_byte_fails_the_load_before_anything_is_written(
        caplog: pytest.LogCaptureFixture) -> None:
    tier = Tier()
    tokens = prompt(1)
    tier.prefill("a", tokens)
    cls, slot = slot_of_chunk(tier.sched, tokens, chunk=1, group=0)
    free_before = tier.sched.allocator.num_free(cls)
    flip_stored_byte(tier.worker, cls, slot, offset=0)
    tier.kv.wipe(FILL)
    with caplog.at_level(logging.WARNING):
        n, res = tier.restore("b", tokens)
    assert n == 3 * CHUNK_TOKENS  # promised: the lookup does not read host memory
    assert res.failed_loads == {"b"} and list(res.report.loads.values()) == [[0, 1]]
    assert _blocks_hold_fill(tier.kv, FULL_B, STATE_B), "a block was written before the verdict"
    assert tier.worker.checksum_failures == 1 and res.report.checksum_failures == 1
    assert tier.sched.stats.checksum_failures == 1 and tier.sched.stats.loads_failed == 1
    lines = _mismatch_lines(caplog)
    assert len(lines) == 1, lines
    assert f"restoring request b: group 0 slot {slot} blocks [0]" in lines[0]
    # the corrupt chunk is gone (with chunk 2, unreachable without it), its slot free again;
    # chunk 0 stays and is still a hit
    sched = tier.sched
    keys = sched.requests["b"].keys.keys
    assert sched.index.get(0, keys[1]) is None and sched.index.get(0, keys[2]) is None
    assert sched.index.is_ready(0, keys[0]) and sched.stats.corrupt_chunks == 1
    assert sched.allocator.num_free(cls) == free_before + 2
    sched.request_finished("b")
    tier.step()
    n, res = tier.restore("c", tokens)
    assert n == CHUNK_TOKENS and res.failed_loads == set() and res.report.loads
    sched.request_finished("c")
    tier.step()
    sched.check_drained()
    tier.close()


def test_without_a_flip_the_same_restore_succeeds_and_nothing_is_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    """The control of the test above: it fails only because of the flip."""
    tier = Tier()
    tokens = prompt(1)
    tier.prefill("a", tokens)
    want = [t for b in range(1, 7) for t in tier.kv.attn_block(b)]
    tier.kv.wipe(FILL)
    with caplog.at_level(logging.WARNING):
        n, res = tier.restore("b", tokens)
    assert n == 3 * CHUNK_TOKENS and res.failed_loads == set()
    assert same([t for b in FULL_B[:6] for t in tier.kv.attn_block(b)], want)
    assert tier.worker.checksum_failures == 0 and not _mismatch_lines(caplog)
    tier.close()


def test_with_verification_off_the_flip_is_restored_as_garbage() -> None:
    """What verify_checksums prevents: the same flip restored as a successful load."""
    tier = Tier(CONFIG.model_copy(update={"cost_model": False, "verify_checksums": False}))
    tokens = prompt(1)
    tier.prefill("a", tokens)
    want = [t for b in range(1, 7) for t in tier.kv.attn_block(b)]
    cls, slot = slot_of_chunk(tier.sched, tokens, chunk=1, group=0)
    flip_stored_byte(tier.worker, cls, slot, offset=0)
    n, res = tier.restore("b", tokens)
    assert n == 3 * CHUNK_TOKENS and res.failed_loads == set()
    assert not same([t for b in FULL_B[:6] for t in tier.kv.attn_block(b)], want)
    tier.close()


# -- the worker and its CPU engine, one op at a time -----------------------------------------
def _worker(seed: int = 0) -> tuple[SmallKV, OffloadWorker]:
    kv = SmallKV(seed=seed)
    return kv, OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS)


def _run(worker: OffloadWorker, plan: StepPlan) -> object:
    worker.fence(plan)
    worker.begin_step(plan)
    worker.end_step(plan)
    worker.drain()
    return worker.collect()


def _save(worker: OffloadWorker, slot: int, blocks: list[int], key: bytes, job: int = 1) -> None:
    res = _run(worker, StepPlan(1, saves=[Job(job, "s", [TransferOp(0, slot, blocks,
                                                                     key_seed(key))])]))
    assert res.report.saves == {job: [1, 0]}  # type: ignore[attr-defined]


def _load(worker: OffloadWorker, slot: int, blocks: list[int], key: bytes, job: int = 2
          ) -> object:
    return _run(worker, StepPlan(2, loads=[Job(job, "r", [TransferOp(0, slot, blocks,
                                                                     key_seed(key))])]))


def _block_offset(kv: SmallKV, position: int) -> int:
    """Where block position ``position`` of a group-0 chunk starts in its slot (codec format:
    segment-major, then block: segment 0's run of that block)."""
    return kv.layout.groups[0].segments[0].run * position


def test_skipped_positions_are_not_compared_and_kept_ones_are() -> None:
    kv, worker = _worker(3)
    _save(worker, 0, [1, 2], KEY_A)
    flip_stored_byte(worker, 0, 0, offset=_block_offset(kv, 1) + 5, bit=3)
    res = _load(worker, 0, [7, SKIP], KEY_A)  # the flip is in the skipped position
    assert res.report.loads == {2: [1, 0]} and worker.checksum_failures == 0  # type: ignore[attr-defined]
    assert same(kv.attn_block(7), kv.attn_block(1))
    kv.wipe(FILL)
    res = _load(worker, 0, [SKIP, 8], KEY_A, job=3)
    assert res.report.loads == {3: [0, 1]} and res.report.corrupt == {3: [(0, 0)]}  # type: ignore[attr-defined]
    assert bool((kv.attn_block(8)[0] == FILL).all()) and worker.checksum_failures == 1
    worker.close()


def test_a_stale_slot_holding_another_chunk_fails() -> None:
    """The index says slot 0 holds chunk A while it holds chunk B (bytes and checksum agree):
    the seed, from A's key, does not."""
    kv, worker = _worker(4)
    _save(worker, 0, [1, 2], KEY_B)
    kv.wipe(FILL)
    res = _load(worker, 0, [7, 8], KEY_A)
    assert res.report.loads == {2: [0, 1]} and worker.checksum_failures == 1  # type: ignore[attr-defined]
    assert bool((kv.attn_block(7)[0] == FILL).all())
    assert _load(worker, 0, [7, 8], KEY_B, job=3).report.loads == {3: [1, 0]}  # type: ignore[attr-defined]
    worker.close()


def test_a_rank_reading_another_ranks_shard_fails() -> None:
    """Rank 1 reading shard 0's bytes and table (a wrong shard offset) fails: its seed mixes
    in shard 1."""
    kv = SmallKV(seed=5)
    w0 = OffloadWorker(CONFIG, kv.layout, CHUNK_TOKENS)
    slab = HostSlab(w0.geometry.slab_layout(CONFIG, 2))
    rank0 = ChunkMover(kv.layout, w0.geometry, slab, 0, verify=True)
    rank1 = ChunkMover(kv.layout, w0.geometry, slab, 1, verify=True)
    op = TransferOp(0, 3, [1, 2], key_seed(KEY_A))
    rank0.save_op(op)
    assert rank0.check([op]) == []
    slab.view(0, 3, 1).copy_(slab.view(0, 3, 0))  # what rank 1 reads is rank 0's shard
    slab.sums(0, 1)[3] = slab.sums(0, 0)[3]
    bad = rank1.check([op])
    assert [(m.slot_class, m.slot, m.blocks) for m in bad] == [(0, 3, (0, 1))]
    rank1.save_op(op)  # its own save verifies
    assert rank1.check([op]) == []
    w0.close()
    slab.close()


def test_a_verify_job_checks_in_place_and_writes_nothing() -> None:
    kv, worker = _worker(6)
    _save(worker, 0, [1, 2], KEY_A)
    _save(worker, 1, [3, 4], KEY_B, job=5)
    flip_stored_byte(worker, 0, 1, offset=_block_offset(kv, 0))
    kv.wipe(FILL)
    job = Job(9, "v", [TransferOp(0, 0, [SKIP, SKIP], key_seed(KEY_A)),
                       TransferOp(0, 1, [SKIP, SKIP], key_seed(KEY_B))])
    res = _run(worker, StepPlan(3, verifies=[job]))
    assert res.report.verifies == {9: [0, 1]}  # type: ignore[attr-defined]
    assert res.report.corrupt == {9: [(0, 1)]} and not res.report.loads  # type: ignore[attr-defined]
    assert res.finished_loads == set()  # type: ignore[attr-defined]
    assert bool((kv.attn_block(1)[0] == FILL).all())
    worker.close()


def test_a_copy_error_is_a_failure_but_not_a_checksum_failure() -> None:
    _kv, worker = _worker(7)
    engine = worker.engine
    assert isinstance(engine, ThreadedTransferEngine)
    res = _run(worker, StepPlan(1, loads=[Job(1, "r", [TransferOp(0, 10**6, [1, 2])])]))
    assert res.report.loads == {1: [0, 1]} and not res.report.corrupt  # type: ignore[attr-defined]
    assert worker.failures == 1 and worker.checksum_failures == 0
    assert JobKind.VERIFY.value == "verify"
    worker.close()


def test_the_table_entry_is_the_checksum_of_the_slot_as_written() -> None:
    from kvtier import checksum

    kv, worker = _worker(8)
    _save(worker, 2, [5, 6], KEY_A)
    runs = [s.run for s in kv.layout.groups[0].segments]
    cb = sum(runs) * 2
    want = checksum.block_checksums(worker.slab.view(0, 2)[:cb], runs, 2,
                                    checksum.chunk_seed(KEY_A, 0, 0))
    got = [int(x) & checksum.MASK64 for x in worker.slab.sums(0, 0)[2].tolist()]
    assert got == want
    assert worker.slab.sums(0).dtype == torch.int64
    worker.close()
