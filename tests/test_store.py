"""The node-wide store (issue 18) on CPU: a real ``kvtier store`` process, real sockets,
real engines' halves (the scheduler and a CPU worker on tests/_small_kv.py)."""

from __future__ import annotations

import ctypes
import os
import shutil
import socket
import stat
import tempfile
from pathlib import Path

import pytest
import torch

from _store import StoreProcess, StoreTier
from _tier import FULL_B, prompt
from kvtier.geometry import Geometry
from kvtier.store import framing
from kvtier.store.client import StoreClient, StoreRefused
from kvtier.store.index import StoreIndex
from kvtier.store.pool import map_pool

SPEC = {"namespace": b"raw", "arena_bytes": 4 * 2**20, "slots": [4],
        "groups": [[0, True, False]]}


@pytest.fixture
def store(tmp_path):  # type: ignore[no-untyped-def]
    s = StoreProcess(tmp_path).start()
    yield s
    s.stop()


def _raw(url: str, spec: dict = SPEC) -> tuple[StoreClient, int]:  # type: ignore[type-arg]
    c = StoreClient(url)
    return c, c.connect(spec).pool_fd


def test_socket_is_private_and_the_pool_comes_as_a_descriptor(store: StoreProcess) -> None:
    st = os.stat(store.path)
    assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    c, fd = _raw(store.url)
    try:
        link = os.readlink(f"/proc/self/fd/{fd}")
        assert link.startswith("/memfd:kvtier-store-pool"), link  # no name in any directory
        assert os.fstat(fd).st_size == 64 * 2**20
    finally:
        os.close(fd)
        c.close()


def test_a_peer_of_another_uid_is_refused() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root to connect as another uid")
    where = Path(tempfile.mkdtemp(dir="/tmp"))
    os.chmod(where, 0o711)  # nobody may reach the socket through the directory
    store = StoreProcess(where).start()
    try:
        _refused_as_nobody(store)
    finally:
        store.stop()
        shutil.rmtree(where)


def _refused_as_nobody(store: StoreProcess) -> None:
    os.chmod(store.path, 0o666)  # past the file mode: only the credentials check is left
    pid = os.fork()
    if pid == 0:  # the child becomes nobody and tries to attach
        code = 1
        try:
            os.setgid(65534)
            os.setuid(65534)
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(5)
            s.connect(store.path)
            code = 2  # connected: now the store must close without an answer
            try:
                framing.send(s, {"op": "attach", "id": 1, **SPEC})
                framing.recv(s)
            except ConnectionError:  # closed (reset, or EOF) without an answer
                code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    c, fd = _raw(store.url)  # and the store still serves its owner
    os.close(fd)
    c.close()


def test_garbage_on_the_socket_closes_only_that_connection(store: StoreProcess) -> None:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(5)
    s.connect(store.path)
    s.sendall(b"\x00\x00\x00\x05\xc1\xc1\xc1\xc1\xc1")  # a frame that is no msgpack map
    try:
        closed = s.recv(100) == b""  # the store closed it without an answer
    except ConnectionResetError:
        closed = True
    assert closed
    c, fd = _raw(store.url)
    os.close(fd)
    with pytest.raises(StoreRefused, match="unknown op"):
        c.call("nonsense")
    assert c.call("stats")["stored"] == 0
    c.close()
    s.close()


def test_two_engines_share_hits_through_the_pool_with_no_staging_copy(
        store: StoreProcess) -> None:
    a, b = StoreTier(store.url, seed=1), StoreTier(store.url, seed=2)
    try:
        toks = prompt(3)
        a.prefill("r", toks)
        n, res = b.restore("r", toks)
        assert n == 96 and not res.failed_loads
        for i, blk in enumerate(FULL_B[:6]):  # engine B now holds engine A's bytes
            want = a.kv.attn_block(list(range(1, 8))[i])
            for x, y in zip(b.kv.attn_block(blk), want):
                assert torch.equal(x, y)
        # both workers' slabs are views of one memfd: A's bytes are in B's mapping and in
        # a third mapping of the descriptor, at the arena offset + slot offset
        c, fd = _raw(store.url, {**a.store_index.spec})  # type: ignore[union-attr]
        view = map_pool(fd, 64 * 2**20)
        os.close(fd)
        lay, att = a.worker.slab_layout, a.index.attachment
        base = att.arena_offset + lay.offset(0, 0)  # type: ignore[union-attr]
        size = lay.classes[0].slot_bytes
        raw = bytes(view[base : base + size])
        assert raw == bytes(a.worker.slab.view(0, 0).numpy())
        assert raw == bytes(b.worker.slab.view(0, 0).numpy())
        for slab in (a.worker.slab, b.worker.slab):  # every slot view inside its mapping
            m = slab._mmap
            lo = ctypes.addressof(ctypes.c_char.from_buffer(m))  # type: ignore[arg-type]
            for cls, sc in enumerate(lay.classes):
                for s in range(sc.num_slots):
                    v = slab.view(cls, s)
                    assert lo <= v.data_ptr() and v.data_ptr() + v.numel() <= lo + len(m)
        c.close()
        view.close()
        b.sched.request_finished("r")
        b.step()
        for t in (a, b):
            t.sched.check_drained()
            held = t.index.holds()  # lookup leases not taken by a load end at their TTL
            assert (held["writes"], held["pins"]) == (0, 0)
    finally:
        a.close()
        b.close()


def test_two_ranks_of_one_engine_write_their_own_shards_in_one_pool(
        store: StoreProcess) -> None:
    """TP=2 without vLLM: both ranks' workers map the one pool through their own
    connections; each writes its own shard of every slot, and a second engine's two ranks
    read each its own."""
    from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV
    from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput
    from kvtier.store.attach import StoreMapping
    from kvtier.store.index import attach_spec, geometry_specs
    from kvtier.worker import OffloadWorker

    cfg = CONFIG.model_copy(update={"cost_model": False})

    def engine(seed: int) -> tuple[OffloadScheduler, list[OffloadWorker], list[SmallKV]]:
        kvs = [SmallKV(seed=seed * 10 + r) for r in range(2)]
        workers = []
        for r, kv in enumerate(kvs):
            geo = Geometry.of_layout(kv.layout, CHUNK_TOKENS)
            spec = attach_spec(b"tp2" * 5, geometry_specs(geo), geo.slab_layout(cfg, 2))
            workers.append(OffloadWorker(cfg, kv.layout, CHUNK_TOKENS, rank=r, world_size=2,
                                         slab_factory=StoreMapping(StoreClient(store.url),
                                                                   spec).slab))
        w0 = workers[0]
        sched = OffloadScheduler(cfg, w0.geometry, b"tp2" * 5, w0.slab_layout, world_size=2,
                                 index_factory=lambda s, lay: StoreIndex(
                                     StoreClient(store.url), attach_spec(b"tp2" * 5, s, lay)))
        return sched, workers, kvs

    sa, wa, ka = engine(1)
    sb, wb, kb = engine(2)
    try:
        toks = prompt(7)
        full, state = list(range(1, 8)), list(range(1, 5))
        sa.add_request("p")
        assert sa.lookup("p", toks, 0) == 0
        done, first = 0, True
        while done < len(toks):
            done = min(len(toks), done + CHUNK_TOKENS)
            new = [NewRequest("p", [full, state])] if first else []
            first = False
            plan = sa.schedule_step(StepInput(new=new, scheduled=[
                ScheduledTokens("p", toks, done, len(toks))]))
            _run(sa, wa, plan)
        sa.request_finished("p")
        _run(sa, wa, sa.schedule_step(StepInput()))
        assert sa.stats.saves_committed == 3
        sb.add_request("q")
        n = sb.lookup("q", toks, 0)
        assert n == 96
        sb.start_load("q", n, [FULL_B, list(range(10, 14))])
        _run(sb, wb, sb.schedule_step(StepInput(new=[NewRequest("q", [FULL_B, list(range(10, 14))])])))
        assert sb.stats.loads_ok == 1 and sb.stats.loads_failed == 0
        for r in range(2):  # each rank of B holds what the same rank of A computed
            for i, blk in enumerate(FULL_B[:6]):
                for x, y in zip(kb[r].attn_block(blk), ka[r].attn_block(full[i])):
                    assert torch.equal(x, y)
        assert not torch.equal(ka[0].attn_block(1)[0], ka[1].attn_block(1)[0])  # two shards
    finally:
        for w in wa + wb:
            w.close()


def _run(sched, workers, plan) -> None:  # type: ignore[no-untyped-def]
    from kvtier.protocol import WorkerReport

    total = WorkerReport()
    for w in workers:
        w.fence(plan)
        w.begin_step(plan)
        w.end_step(plan)
        w.drain()
        total.add(w.collect().report)
    sched.on_report(total)


def test_engines_of_another_namespace_never_see_the_bytes(store: StoreProcess) -> None:
    """Another model or layout is another namespace: its own arena and index, no hit."""
    a = StoreTier(store.url, seed=1, namespace=b"model-a" * 2)
    b = StoreTier(store.url, seed=2, namespace=b"model-b" * 2)
    try:
        toks = prompt(8)
        a.prefill("p", toks)
        n, _ = b.restore("p", toks)
        assert n == 0
        assert a.index.attachment.arena_offset != b.index.attachment.arena_offset  # type: ignore[union-attr]
        b.sched.request_finished("p")
        b.step()
        b.sched.check_drained()
    finally:
        a.close()
        b.close()


def test_the_connector_metrics_read_the_store_index(store: StoreProcess) -> None:
    from kvtier.vllm.counters import scheduler_counts

    a = StoreTier(store.url, seed=1)
    try:
        a.prefill("p", prompt(9))
        counts = scheduler_counts(a.sched)
        assert counts["evictions"] == 0 and counts["lookups"] == 1
    finally:
        a.close()
