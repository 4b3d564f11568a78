"""The disk tier's store: files, checksums, crash safety, the directory scan, the lock and the
start-up checks of disk_path (real files under pytest's tmp_path, on the machine's disk)."""

from __future__ import annotations

import hashlib
import mmap
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier.checksum import checksum, chunk_seed
from kvtier.config import ConfigError
from kvtier.keys import KEY_BYTES
from kvtier.tiers.directory import DirectoryLock, check_disk_path, scan
from kvtier.tiers.disk import (
    PAGE,
    DiskChunkStore,
    OtherFormat,
    chunk_name,
    file_bytes,
    file_checksum,
    namespace_dir,
    parse_chunk_name,
    shard_dir,
)
from kvtier.tiers.fake import MemoryChunkStore
from kvtier.tiers.seam import ChunkCorrupt, TierJob, TierJobKind, TierOp, TierRunner

NS = hashlib.blake2b(b"ns", digest_size=16).digest()


def key(i: int) -> bytes:
    return hashlib.blake2b(i.to_bytes(8, "little"), digest_size=16).digest()


def payload(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def store(tmp_path: Path, shard: int = 0) -> DiskChunkStore:
    return DiskChunkStore(namespace_dir(tmp_path, NS), shard, NS)


def test_a_chunk_round_trips_and_its_name_carries_its_parent(tmp_path: Path) -> None:
    s = store(tmp_path)
    data = payload(10_000, 1)  # not a multiple of a page: padded on disk
    assert s.put(0, key(1), key(0), data) == file_bytes(10_000) == PAGE + 12_288
    out = torch.empty_like(data)
    s.get(0, key(1), key(0), out)
    assert torch.equal(out, data)
    name = parse_chunk_name(chunk_name(0, key(1), key(0)))
    assert name is not None and (name.group, name.key, name.parent) == (0, key(1), key(0))
    assert parse_chunk_name(chunk_name(3, key(2), None)).parent is None  # type: ignore[union-attr]
    with pytest.raises(KeyError):
        s.get(0, key(2), key(1), out)


@pytest.mark.parametrize("where", ["payload", "padding", "header", "truncated", "grown"])
def test_damaged_files_never_return_bytes(tmp_path: Path, where: str) -> None:
    s = store(tmp_path)
    data = payload(10_000, 2)
    s.put(0, key(1), None, data)
    path = shard_dir(namespace_dir(tmp_path, NS), 0) / chunk_name(0, key(1), None)
    raw = bytearray(path.read_bytes())
    if where == "payload":
        raw[PAGE + 1234] ^= 0x10
    elif where == "padding":
        raw[PAGE + 10_500] ^= 0x01
    elif where == "header":
        raw[20] ^= 0x01
    elif where == "truncated":
        raw = raw[:-PAGE]
    else:
        raw += bytes(PAGE)
    path.write_bytes(bytes(raw))
    out = torch.zeros_like(data)
    with pytest.raises(ChunkCorrupt):
        s.get(0, key(1), None, out)
    assert not out.any(), "bytes that did not verify reached the caller"


def test_a_file_of_another_shard_group_or_namespace_does_not_verify(tmp_path: Path) -> None:
    root = namespace_dir(tmp_path, NS)
    data = payload(8192, 3)
    store(tmp_path, shard=1).put(0, key(1), None, data)
    src = shard_dir(root, 1) / chunk_name(0, key(1), None)
    s0 = store(tmp_path, shard=0)
    os.link(src, shard_dir(root, 0) / chunk_name(0, key(1), None))
    os.link(src, shard_dir(root, 1) / chunk_name(1, key(1), None))
    with pytest.raises(ChunkCorrupt):
        s0.get(0, key(1), None, torch.empty_like(data))
    with pytest.raises(ChunkCorrupt):
        store(tmp_path, shard=1).get(1, key(1), None, torch.empty_like(data))
    other = DiskChunkStore(root, 1, hashlib.blake2b(b"other", digest_size=16).digest())
    with pytest.raises(ChunkCorrupt):
        other.get(0, key(1), None, torch.empty_like(data))


def test_a_flipped_byte_anywhere_in_the_file_is_a_miss(tmp_path: Path) -> None:
    """Every byte of a chunk file is checked: each one of a file flipped in turn (the header's
    fields, its digest, the rest of the header page, the payload, its padding) fails the read,
    and the bytes never reach the caller; restored, the file reads again."""
    s = store(tmp_path)
    data = payload(1000, 5)  # less than a page: padding on disk too
    s.put(0, key(1), key(0), data)
    path = shard_dir(namespace_dir(tmp_path, NS), 0) / chunk_name(0, key(1), key(0))
    size = path.stat().st_size
    assert size == file_bytes(data.numel()) == 2 * PAGE
    out = torch.zeros_like(data)
    fd = os.open(path, os.O_RDWR)
    try:
        for at in range(size):
            old = os.pread(fd, 1, at)
            os.pwrite(fd, bytes([old[0] ^ (1 << at % 8)]), at)
            with pytest.raises(ChunkCorrupt):
                s.get(0, key(1), key(0), out)
            os.pwrite(fd, old, at)
    finally:
        os.close(fd)
    assert not out.any(), "bytes that did not verify reached the caller"
    s.get(0, key(1), key(0), out)
    assert torch.equal(out, data)


def _rewrite_header(path: Path, **fields: object) -> None:
    """Rewrite fields of a chunk file's header with a valid digest (what a misdirected or
    stale write that kept a well-formed header would leave), the payload unchanged."""
    from kvtier.tiers import disk

    raw = bytearray(path.read_bytes())
    names = ("magic", "version", "group", "shard", "zero", "length", "checksum", "namespace",
             "key", "parent", "has_parent")
    values = dict(zip(names, disk._HEAD.unpack(bytes(raw[: disk._HEAD.size]))))
    values.update(fields)
    head = disk._HEAD.pack(*(values[n] for n in names))
    raw[: disk._HEAD.size + disk._DIGEST] = head + hashlib.blake2b(
        head, digest_size=disk._DIGEST).digest()
    path.write_bytes(bytes(raw))


def test_a_file_holding_another_chunks_payload_is_a_miss(tmp_path: Path) -> None:
    """The checksum is seeded with the chunk's key, group and shard: a file whose header
    names the chunk asked for (digest valid) but whose payload and checksum are another
    chunk's, group's or shard's does not verify, and a file under another chunk's name does
    not either (its header names that chunk)."""
    root = namespace_dir(tmp_path, NS)
    data = payload(8192, 6)
    s = store(tmp_path)
    assert len({file_checksum(data, key(1), 0, 0), file_checksum(data, key(2), 0, 0),
                file_checksum(data, key(1), 1, 0), file_checksum(data, key(1), 0, 1)}) == 4
    s.put(0, key(1), None, data)
    src = shard_dir(root, 0) / chunk_name(0, key(1), None)
    out = torch.empty_like(data)
    for g, sh, k in ((0, 0, key(2)), (1, 0, key(1)), (0, 1, key(1))):
        dst = shard_dir(root, sh) / chunk_name(g, k, None)
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(src.read_bytes())
        with pytest.raises(ChunkCorrupt, match="names another chunk"):
            store(tmp_path, sh).get(g, k, None, out)
        _rewrite_header(dst, group=g, shard=sh, key=k)
        with pytest.raises(ChunkCorrupt, match="checksum mismatch"):
            store(tmp_path, sh).get(g, k, None, out)
    s.get(0, key(1), None, out)  # the original still reads
    assert torch.equal(out, data)


def _version1_file(path: Path, data: torch.Tensor, k: bytes, parent: bytes | None) -> None:
    """A chunk file as kvtier wrote it before format 2 (the same header; the payload summed
    with kvtier.checksum.checksum under chunk_seed)."""
    from kvtier.tiers import disk

    body = torch.zeros(file_bytes(data.numel()) - PAGE, dtype=torch.uint8)
    body[: data.numel()] = data
    head = disk._HEAD.pack(disk.MAGIC, 1, 0, 0, 0, data.numel(),
                           checksum(body, chunk_seed(k, 0, 0)), NS, k,
                           parent or bytes(KEY_BYTES), parent is not None)
    head += hashlib.blake2b(head, digest_size=disk._DIGEST).digest()
    path.write_bytes(head + bytes(PAGE - len(head)) + body.numpy().tobytes())


def test_a_file_of_the_previous_format_is_absent_not_corrupt(
        tmp_path: Path, kvtier_caplog: pytest.LogCaptureFixture) -> None:
    """A version-1 file (the NumPy sum) is no chunk of format 2: the read raises
    OtherFormat, a KeyError, so a promotion counts it absent (forgotten and deleted by the
    scheduler), not as corruption, and logs nothing; its bytes never reach a staged caller
    (a slot read in place is not committed). The same file with a flipped version byte is
    corrupt."""
    root = namespace_dir(tmp_path, NS)
    data = payload(8192, 7)
    path = shard_dir(root, 0) / chunk_name(0, key(1), None)
    path.parent.mkdir(parents=True)
    _version1_file(path, data, key(1), None)
    s = store(tmp_path)
    out = torch.zeros_like(data)
    with pytest.raises(OtherFormat, match="format version 1"):
        s.get(0, key(1), None, out)
    assert issubclass(OtherFormat, KeyError) and not issubclass(OtherFormat, ChunkCorrupt)
    slots = page_aligned(1, 8192)
    r = _runner(s, slots)
    r.submit(TierJob(1, TierJobKind.PROMOTE, [TierOp(0, 0, key(1), None)]))
    (c,) = _wait(r, 1)
    r.close()
    assert not c.ok and c.absent == [0] and c.corrupt == []
    assert (r.absent_reads, r.corrupt_reads) == (1, 0)
    assert not [m for m in kvtier_caplog.messages if "did not verify" in m]
    assert not out.any()
    raw = bytearray(path.read_bytes())
    raw[8] ^= 0x02  # the version field: 1 -> 3, its digest now wrong
    path.write_bytes(bytes(raw))
    with pytest.raises(ChunkCorrupt, match="digest"):
        store(tmp_path).get(0, key(1), None, out)


def _runner(st: DiskChunkStore | MemoryChunkStore, slots: torch.Tensor) -> TierRunner:
    return TierRunner(st, lambda g, slot: slots[slot], max_jobs=4)


def _wait(r: TierRunner, n: int) -> list:
    done: list = []
    end = time.monotonic() + 30
    while len(done) < n and time.monotonic() < end:
        done += r.poll()
        time.sleep(0.002)
    return done


def page_aligned(rows: int, n: int) -> torch.Tensor:
    """``rows`` slots of ``n`` bytes starting on pages, as the slab's are."""
    return torch.frombuffer(mmap.mmap(-1, rows * n), dtype=torch.uint8).view(rows, n)


def test_a_page_aligned_slot_is_read_in_place_and_still_verified(tmp_path: Path) -> None:
    s = store(tmp_path)
    data = payload(2 * PAGE, 4)
    s.put(0, key(1), None, data)
    out = page_aligned(1, 2 * PAGE)[0]
    assert s._lands_in_place(out) and not s._lands_in_place(torch.empty(2 * PAGE + 8,
                                                                         dtype=torch.uint8))
    assert s.get(0, key(1), None, out) == file_bytes(2 * PAGE) and torch.equal(out, data)
    path = shard_dir(namespace_dir(tmp_path, NS), 0) / chunk_name(0, key(1), None)
    raw = bytearray(path.read_bytes())
    raw[PAGE + 5000] ^= 0x04
    path.write_bytes(bytes(raw))
    with pytest.raises(ChunkCorrupt):
        s.get(0, key(1), None, out)
    s.close()


def test_a_slot_written_in_place_makes_the_same_file_as_a_staged_copy(tmp_path: Path) -> None:
    """A page-aligned slot is written straight from the slab (no staging copy); the file is
    byte for byte the one a staged write makes, and reads back verified either way."""
    data = payload(2 * PAGE, 9)
    slot = page_aligned(1, 2 * PAGE)[0].copy_(data)
    unaligned = torch.empty(2 * PAGE + 8, dtype=torch.uint8)[8:].copy_(data)
    files = []
    for i, src in enumerate((slot, unaligned)):
        s = DiskChunkStore(namespace_dir(tmp_path / str(i), NS), 0, NS)
        assert s._lands_in_place(src) == (i == 0)
        s.put(0, key(1), key(0), src)
        out = torch.zeros(2 * PAGE, dtype=torch.uint8)
        assert s.get(0, key(1), key(0), out) == file_bytes(2 * PAGE) and torch.equal(out, data)
        s.close()
        files.append((shard_dir(namespace_dir(tmp_path / str(i), NS), 0)
                      / chunk_name(0, key(1), key(0))).read_bytes())
    assert files[0] == files[1] and len(files[0]) == file_bytes(2 * PAGE)


@pytest.mark.parametrize("aligned", [False, True], ids=["staged", "in-place"])
def test_runner_reports_each_job_and_names_the_chunk_that_did_not_verify(
        tmp_path: Path, kvtier_caplog: pytest.LogCaptureFixture, aligned: bool) -> None:
    slots = torch.stack([payload(4096, i) for i in range(4)])
    if aligned:
        slots = page_aligned(4, 4096).copy_(slots)
    s = store(tmp_path)
    r = _runner(s, slots)
    ops = [TierOp(0, i, key(i), key(i - 1) if i else None) for i in range(3)]
    r.submit(TierJob(1, TierJobKind.DEMOTE, ops))
    (demoted,) = _wait(r, 1)
    assert demoted.ok and demoted.job_id == 1 and demoted.nbytes == 3 * file_bytes(4096)
    path = shard_dir(namespace_dir(tmp_path, NS), 0) / chunk_name(0, key(1), key(0))
    raw = bytearray(path.read_bytes())
    raw[PAGE + 7] ^= 0xFF
    path.write_bytes(bytes(raw))
    want = slots[:3].clone()
    slots.zero_()
    r.submit(TierJob(2, TierJobKind.PROMOTE, [TierOp(0, i, o.key, o.parent)
                                              for i, o in enumerate(ops)]))
    (promoted,) = _wait(r, 1)
    r.close()
    assert not promoted.ok and promoted.corrupt == [1]
    assert torch.equal(slots[0], want[0]) and torch.equal(slots[2], want[2])
    assert r.corrupt_reads == 1
    lines = [m for m in kvtier_caplog.messages if "did not verify" in m]
    assert len(lines) == 1 and key(1).hex()[:12] in lines[0]


def test_a_full_tier_declines_the_write_and_a_full_queue_fails_at_once() -> None:
    slots = torch.stack([payload(4096, i) for i in range(4)])
    mem = MemoryChunkStore(capacity=2 * 4096)
    r = _runner(mem, slots)
    r.submit(TierJob(1, TierJobKind.DEMOTE, [TierOp(0, i, key(i)) for i in range(4)]))
    (c,) = _wait(r, 1)
    assert not c.ok and c.full and r.full_writes == 1
    assert mem.keys() == {(0, key(0)), (0, key(1))}
    r.close()
    blocked = _runner(MemoryChunkStore(), slots)
    blocked.max_jobs = 0
    blocked.submit(TierJob(7, TierJobKind.DEMOTE, [TierOp(0, 0, key(0))]))
    (c,) = blocked.poll()
    assert (c.job_id, c.ok, c.error) == (7, False, "tier queue full")
    blocked.close()


class _MeetingStore(DiskChunkStore):
    """A real disk store whose puts and gets each wait until ``max_in_flight`` of them run at
    once (a barrier): a runner moving one chunk at a time breaks it (the job fails)."""

    def __init__(self, root: Path, depth: int) -> None:
        super().__init__(root, 0, NS, io_depth=depth)
        self.meet = threading.Barrier(depth, timeout=10)

    def put(self, group: int, key: bytes, parent: bytes | None, data: torch.Tensor) -> int:
        self.meet.wait()
        return super().put(group, key, parent, data)

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        self.meet.wait()
        return super().get(group, key, parent, out)


def test_a_jobs_chunks_move_up_to_the_stores_depth_at_once(tmp_path: Path) -> None:
    slots = torch.stack([payload(8192, i) for i in range(8)])
    want = slots.clone()
    s = _MeetingStore(namespace_dir(tmp_path, NS), depth=4)
    r = _runner(s, slots)
    ops = [TierOp(0, i, key(i), key(i - 1) if i else None) for i in range(8)]
    r.submit(TierJob(1, TierJobKind.DEMOTE, ops))
    (demoted,) = _wait(r, 1)
    slots.zero_()
    r.submit(TierJob(2, TierJobKind.PROMOTE, ops))
    (promoted,) = _wait(r, 1)
    r.close()
    assert demoted.ok and promoted.ok, (demoted.error, promoted.error)
    assert demoted.nbytes == promoted.nbytes == 8 * file_bytes(8192)
    assert torch.equal(slots, want)


def test_at_depth_a_chunk_that_fails_its_dram_check_stops_its_descendants(
        tmp_path: Path) -> None:
    slots = torch.stack([payload(4096, i) for i in range(6)])
    s = DiskChunkStore(namespace_dir(tmp_path, NS), 0, NS, io_depth=4)
    ops = [TierOp(0, i, key(i), key(i - 1) if i else None) for i in range(6)]

    def check(op: TierOp) -> None:
        if op.key == key(2):
            raise ChunkCorrupt("flipped in DRAM")

    r = TierRunner(s, lambda g, slot: slots[slot], max_jobs=4, check_demoted=check)
    r.submit(TierJob(1, TierJobKind.DEMOTE, ops))
    (c,) = _wait(r, 1)
    r.close()
    assert not c.ok and c.corrupt == [2] and r.corrupt_demotions == 1
    on_disk = {p.name for p in shard_dir(namespace_dir(tmp_path, NS), 0).iterdir()}
    assert on_disk == {chunk_name(0, o.key, o.parent) for o in ops[:2]}


WRITER = textwrap.dedent("""
    import sys, torch
    from pathlib import Path
    from kvtier.tiers.disk import DiskChunkStore
    from tests.test_tier_disk import NS, key, payload
    s = DiskChunkStore(Path(sys.argv[1]), 0, NS)
    data = payload(8 << 20, 9)
    print("ready", flush=True)
    i = 0
    while True:
        data[0] = i % 256
        s.put(0, key(i), key(i - 1) if i else None, data)
        i += 1
""")


def test_kill_9_mid_write_never_leaves_a_torn_chunk(tmp_path: Path) -> None:
    root = namespace_dir(tmp_path, NS)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for attempt in range(4):
        p = subprocess.Popen([sys.executable, "-c", WRITER, str(root)], stdout=subprocess.PIPE,
                             env=env, cwd=Path(__file__).parent.parent)
        assert p.stdout is not None and p.stdout.readline().strip() == b"ready"
        time.sleep(0.15 + 0.1 * attempt)
        p.send_signal(signal.SIGKILL)
        p.wait()
    leftovers = [n for n in os.listdir(shard_dir(root, 0)) if n.endswith(".tmp")]
    found = scan(root, 1)
    assert found.temporaries_removed == len(leftovers)
    assert not [n for n in os.listdir(shard_dir(root, 0)) if n.endswith(".tmp")]
    assert found.chunks, "the writer wrote nothing before it was killed"
    s = store(tmp_path)
    out = torch.empty(8 << 20, dtype=torch.uint8)
    want = payload(8 << 20, 9)
    for c in found.chunks:
        s.get(c.name.group, c.name.key, c.name.parent, out)  # raises if torn
        assert torch.equal(out[1:], want[1:])


def test_scan_keeps_chunks_every_shard_has_and_ignores_foreign_files(tmp_path: Path) -> None:
    root = namespace_dir(tmp_path, NS)
    s0, s1 = store(tmp_path, 0), store(tmp_path, 1)
    data = payload(4096, 4)
    for i in range(3):
        s0.put(0, key(i), None, data)
    s1.put(0, key(0), None, data)
    s1.put(0, key(1), None, data)
    (shard_dir(root, 0) / "README").write_text("not a chunk")
    (shard_dir(root, 1) / ".half.kvc.1.2.tmp").write_bytes(b"x")
    (shard_dir(root, 1) / "zz.root.g0.kvc").write_bytes(b"x")  # a bad key
    got = scan(root, 2)
    assert {c.name.key for c in got.chunks} == {key(0), key(1)}
    assert [(sh, c.key) for sh, c in got.partial] == [(0, key(2))]
    assert got.temporaries_removed == 1 and got.foreign_files == 2


def test_a_second_engine_on_the_directory_is_refused(tmp_path: Path) -> None:
    first = DirectoryLock(str(tmp_path))
    with pytest.raises(ConfigError, match=rf"another engine \(pid {os.getpid()}\)"):
        DirectoryLock(str(tmp_path))
    first.close()
    DirectoryLock(str(tmp_path)).close()


def test_disk_path_checks_name_the_reason(tmp_path: Path) -> None:
    check_disk_path(str(tmp_path / "tier"), 1 << 20)
    assert (tmp_path / "tier").is_dir()
    if Path("/dev/shm").is_dir():
        with pytest.raises(ConfigError, match="tmpfs"):
            check_disk_path("/dev/shm/kvtier-test-tier", 1 << 20)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot create"):
        check_disk_path(str(tmp_path / "file" / "tier"), 1 << 20)
    with pytest.raises(ConfigError, match=r"disk_size=1024TiB.*free"):
        check_disk_path(str(tmp_path / "tier"), 1 << 50)


def test_disk_settings_go_together_and_carry_units() -> None:
    from kvtier.config import KvtierConfig

    cfg = KvtierConfig.load({"disk_path": "/data/kv", "disk_size": "500GiB"}, environ={})
    assert cfg.disk_size == 500 * 2**30
    with pytest.raises(ConfigError, match="disk_path and disk_size go together"):
        KvtierConfig.load({"disk_path": "/data/kv"}, environ={})
    with pytest.raises(ConfigError, match=r"disk_size.*a number and a unit"):
        KvtierConfig.load({"disk_path": "/data/kv", "disk_size": "500"}, environ={})


def test_a_model_with_other_than_full_attention_is_refused(tmp_path: Path) -> None:
    from kvtier.config import KvtierConfig
    from kvtier.geometry import Geometry, GroupGeometry
    from kvtier.layout import GroupKind
    from kvtier.tiers.setup import open_disk_tier

    geo = Geometry(32, (GroupGeometry(GroupKind.FULL, 16, 4096),
                        GroupGeometry(GroupKind.SLIDING_WINDOW, 16, 4096, sliding_window=64)))
    cfg = KvtierConfig(dram_size="4MiB", disk_path=str(tmp_path), disk_size="16MiB")
    with pytest.raises(ConfigError, match="full-attention chunks only"):
        open_disk_tier(cfg, geo, NS, geo.slab_layout(cfg, 1), 1)


class _ConcurrencyCountingDisk(DiskChunkStore):
    """The real disk store, counting the reads that run at once and the threads they ran on."""

    def __init__(self, root: Path) -> None:
        super().__init__(root, 0, NS, io_depth=4)
        self.running = self.most = 0
        self.threads: set[str] = set()
        self._count = threading.Lock()

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        with self._count:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            return super().get(group, key, parent, out)
        finally:
            with self._count:
                self.running -= 1


def test_the_start_up_probe_reads_as_promotions_do(tmp_path: Path) -> None:
    """The probe's chunks are read through a TierRunner at the store's depth (on its I/O
    pool, several at once), not one at a time, and are deleted afterwards."""
    from kvtier.tiers.cost import probe

    s = _ConcurrencyCountingDisk(namespace_dir(tmp_path, NS))
    cost = probe(s, 1 << 20)
    assert cost.gbps > 0 and cost.latency_s > 0
    assert any(t.startswith("kvtier-probe-io") for t in s.threads), s.threads
    assert s.most >= 2, "the probe read one chunk at a time"
    assert not list(s.dir.iterdir()), "the probe left chunks behind"
    s.close()


class _MeetingDisk(DiskChunkStore):
    """The real disk store whose reads wait (up to 10 s) until ``meet`` of them run at once:
    a runner that never has that many in flight fails them (BrokenBarrierError)."""

    def __init__(self, root: Path, meet: int) -> None:
        super().__init__(root, 0, NS, io_depth=4)
        self.barrier = threading.Barrier(meet, timeout=10)

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        self.barrier.wait()
        return super().get(group, key, parent, out)


def test_chunks_of_consecutive_jobs_are_in_flight_together_and_reported_in_order(
        tmp_path: Path) -> None:
    """One-chunk promotion jobs (one request's prefix each) still reach the store's depth:
    the next job's read starts while the one before is in flight; completions keep the
    submission order. A delete waits for the write before it (the promotion after both
    finds the chunk gone)."""
    slots = page_aligned(8, 8192)
    slots.copy_(torch.stack([payload(8192, i) for i in range(8)]))
    want = slots.clone()
    s = _MeetingDisk(namespace_dir(tmp_path, NS), meet=4)
    r = TierRunner(s, lambda g, slot: slots[slot], max_jobs=64)
    ops = [TierOp(0, i, key(i)) for i in range(8)]
    r.submit(TierJob(1, TierJobKind.DEMOTE, ops))
    assert [c.ok for c in _wait(r, 1)] == [True]
    slots.zero_()
    for i in range(8):
        r.submit(TierJob(10 + i, TierJobKind.PROMOTE, [ops[i]]))
    done = _wait(r, 8)
    assert [c.job_id for c in done] == list(range(10, 18)) and all(c.ok for c in done), done
    assert torch.equal(slots, want)
    s.barrier = threading.Barrier(1)
    r.submit(TierJob(20, TierJobKind.DEMOTE, [TierOp(0, 0, key(99))]))
    r.submit(TierJob(0, TierJobKind.DELETE, [TierOp(0, 0, key(99))]))
    r.submit(TierJob(21, TierJobKind.PROMOTE, [TierOp(0, 1, key(99))]))
    written, promoted = _wait(r, 2)
    assert written.ok and not promoted.ok and promoted.absent == [0]
    r.close()
