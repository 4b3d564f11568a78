"""The shared slab of a multi-rank engine (kvtier.shm), across real processes in a gloo
world: one memory for every rank, nothing left in /dev/shm, reserved up front, private to
one engine, and a failure on any rank is every rank's clear error."""

from __future__ import annotations

import glob
import os
import resource
import signal
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier.config import format_bytes
from kvtier.shm import (
    SHM_DIR,
    ProcessGroupRanks,
    SharedSlab,
    SlabError,
    attach_segment,
    create_segment,
    segment_name,
)
from kvtier.slab import HostSlab, SlabLayout, lay_out_slab
from tests._ranks import Ranks, run_ranks

MiB = 2**20
LAYOUT = lay_out_slab(4 * MiB, [64 * 1024], num_shards=2)


def _engine_slab(layout: SlabLayout, engine_id: str, group: Any = None) -> HostSlab:
    """This rank's slab of engine ``engine_id`` over ``group`` (default: the whole world)."""
    return HostSlab(layout, shared=SharedSlab(engine_id, ProcessGroupRanks(group)))


def _leftovers(engine_id: str) -> list[str]:
    return sorted(glob.glob(os.path.join(SHM_DIR, f"kvtier-{engine_id}*")))


@pytest.fixture
def engine_id() -> Iterator[str]:
    eid = f"test-{uuid.uuid4().hex[:12]}"
    yield eid
    for path in _leftovers(eid):  # a failing run must not leave memory behind
        os.unlink(path)


# ---- rank bodies (module level: spawned processes import them) ----------------------------

def _share_and_look(rank: int, results: Any, eid: str) -> tuple[int, list[str]]:
    import torch.distributed as dist

    slab = _engine_slab(LAYOUT, eid)
    left = _leftovers(eid)  # every rank has it mapped: the name must be gone already
    slab.view(0, 0, shard=rank).fill_(rank + 1)
    dist.barrier()
    seen = int(slab.view(0, 0, shard=1 - rank)[0])
    slab.close()
    return seen, left


def _map_and_wait(rank: int, results: Any, eid: str) -> None:
    _engine_slab(LAYOUT, eid)
    results.put((rank, "note", "mapped"))
    time.sleep(600)  # until the test kills it


def _two_engines_one_id(rank: int, results: Any, eid: str) -> tuple[int, int]:
    import torch.distributed as dist

    a = _engine_slab(LAYOUT, eid, dist.new_group([0, 1]))
    b = _engine_slab(LAYOUT, eid, dist.new_group([0, 1]))
    if rank == 0:
        a.view(0, 0).fill_(0xA)
        b.view(0, 0).fill_(0xB)
    dist.barrier()
    return int(a.view(0, 0)[0]), int(b.view(0, 0)[0])


def _write_own_shard(rank: int, results: Any, eid: str) -> bool:
    slab = _engine_slab(LAYOUT, eid)
    slab.view(0, 0, shard=rank).fill_(7)
    slab.close()
    return True


def _slab_error(rank: int, results: Any, eid: str, fsize_limit: int, layouts: list[Any]) -> str:
    if rank == 0 and fsize_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a killed process
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_limit, resource.RLIM_INFINITY))
    try:
        _engine_slab(layouts[rank], eid)
    except SlabError as e:
        return str(e)
    return "no error"


# ---- item 7: nothing stays in /dev/shm -----------------------------------------------------

def test_every_rank_maps_one_memory_whose_name_is_gone_once_all_mapped(
        engine_id: str, tmp_path: Any) -> None:
    out = run_ranks(_share_and_look, 2, str(tmp_path / "store"), engine_id)
    assert out == [(True, (2, [])), (True, (1, []))]
    assert _leftovers(engine_id) == []


def test_kill_9_of_every_rank_leaves_nothing_in_dev_shm(engine_id: str, tmp_path: Any) -> None:
    ranks = Ranks(_map_and_wait, 2, str(tmp_path / "store"), engine_id)
    notes = [ranks.next_message() for _ in range(2)]
    assert sorted(n[0] for n in notes) == [0, 1] and {n[2] for n in notes} == {"mapped"}
    ranks.kill()  # SIGKILL: no cleanup code runs
    assert all(p.exitcode == -signal.SIGKILL for p in ranks.procs)
    assert _leftovers(engine_id) == []


# ---- item 9: one store per engine, nothing pre-created taken over --------------------------

def test_two_engines_with_one_engine_id_have_separate_stores(
        engine_id: str, tmp_path: Any) -> None:
    out = run_ranks(_two_engines_one_id, 2, str(tmp_path / "store"), engine_id)
    assert out == [(True, (0xA, 0xB)), (True, (0xA, 0xB))]


def test_a_pre_created_world_writable_file_is_never_taken_over(
        engine_id: str, tmp_path: Any) -> None:
    trap = os.path.join(SHM_DIR, f"kvtier-{engine_id}")  # the name kvtier used to derive
    fd = os.open(trap, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        os.fchmod(fd, 0o666)
        os.ftruncate(fd, LAYOUT.total_bytes)
        out = run_ranks(_write_own_shard, 2, str(tmp_path / "store"), engine_id)
        assert out == [(True, True), (True, True)]
        assert os.pread(fd, LAYOUT.total_bytes, 0) == bytes(LAYOUT.total_bytes)  # untouched
    finally:
        os.close(fd)
        os.unlink(trap)


def test_segments_are_created_exclusively_mode_0600_under_fresh_names(
        engine_id: str) -> None:
    names = {segment_name("a/b c") for _ in range(100)}
    assert len(names) == 100 and all(n.startswith("kvtier-a_b_c-") and "/" not in n
                                     for n in names)
    old_umask = os.umask(0)
    try:
        fd, path = create_segment(SHM_DIR, engine_id, MiB)
    finally:
        os.umask(old_umask)
    try:
        st = os.fstat(fd)
        assert (st.st_mode & 0o777, st.st_uid, st.st_size) == (0o600, os.geteuid(), MiB)
        assert os.path.basename(path).startswith(f"kvtier-{engine_id}-")
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_rank_refuses_any_file_rank_0_did_not_create(engine_id: str, tmp_path: Any) -> None:
    fd, path = create_segment(SHM_DIR, engine_id, MiB)
    st = os.fstat(fd)
    ident = (st.st_dev, st.st_ino)
    link = str(tmp_path / "link")
    os.symlink(path, link)
    try:
        os.close(attach_segment(path, MiB, ident))  # the genuine one
        with pytest.raises(SlabError, match="not the file rank 0 created"):
            attach_segment(path, MiB, (st.st_dev, st.st_ino + 1))
        with pytest.raises(SlabError, match="needs 2097152"):
            attach_segment(path, 2 * MiB, ident)
        with pytest.raises(SlabError, match="cannot open"):
            attach_segment(link, MiB, ident)  # never through a symlink
        os.fchmod(fd, 0o666)
        with pytest.raises(SlabError, match="mode 666, not 600"):
            attach_segment(path, MiB, ident)
    finally:
        os.close(fd)
        os.unlink(path)


# ---- item 8: reserved up front; too little space is a clear start-up error -----------------

def test_the_segment_is_reserved_not_sparse(engine_id: str) -> None:
    fd, path = create_segment(SHM_DIR, engine_id, 8 * MiB)
    try:
        assert os.fstat(fd).st_blocks * 512 >= 8 * MiB
    finally:
        os.close(fd)
        os.unlink(path)


def test_a_size_the_file_cannot_take_fails_every_rank_at_start_up(
        engine_id: str, tmp_path: Any) -> None:
    out = run_ranks(_slab_error, 2, str(tmp_path / "store"), engine_id,
                    LAYOUT.total_bytes // 2, [LAYOUT, LAYOUT])
    need = format_bytes(LAYOUT.total_bytes)
    for rank, (ok, msg) in enumerate(out):
        assert ok and msg.startswith("rank 0: ") and f"needs a {need} file" in msg, (rank, msg)
        assert "ulimit -f" in msg
    assert _leftovers(engine_id) == []


def test_more_than_free_dev_shm_is_refused_with_how_to_raise_it(engine_id: str) -> None:
    st = os.statvfs(SHM_DIR)
    size = st.f_bavail * st.f_frsize + 2**30
    with pytest.raises(SlabError, match=r"--shm-size") as e:
        create_segment(SHM_DIR, engine_id, size)
    assert f"needs {format_bytes(size)}" in str(e.value)
    assert _leftovers(engine_id) == []


def test_a_rank_that_cannot_map_fails_every_rank_and_nothing_stays(
        engine_id: str, tmp_path: Any) -> None:
    other = lay_out_slab(8 * MiB, [64 * 1024], num_shards=2)  # rank 1 disagrees on the size
    out = run_ranks(_slab_error, 2, str(tmp_path / "store"), engine_id, 0, [LAYOUT, other])
    for ok, msg in out:
        assert ok and msg.startswith("rank 1: refusing the shared slab"), msg
    assert _leftovers(engine_id) == []
