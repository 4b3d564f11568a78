"""Layer-by-layer loads (``layerwise_loads``) in the worker half, on a real CPU KV cache: the
forward's wait for each layer (``OffloadWorker.wait_layer``), and what vLLM hears in the same
step: never a finished load, the blocks of a failed one, and every block when a layer was read
without its wait. Both engine kinds: one that cannot order the forward per layer (the host
waits once, whole), and the GPU engine's bands on :class:`HostRuntime`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import torch

from _small_kv import NUM_BLOCKS, SmallKV, same
from kvtier import worker as worker_module
from kvtier.config import KvtierConfig
from kvtier.gpu.engine import CudaTransferEngine
from kvtier.layout import GroupKind, GroupSpec, build_layout
from kvtier.protocol import Job, StepPlan, TransferOp
from kvtier.testing.host_runtime import HostRuntime
from kvtier.transfer import ChunkMover, Completion
from kvtier.worker import OffloadWorker, StepResult
from test_worker import UnreliableNotices, make_worker, save_job, step

ATTN_BLOCKS = (7, 8)


def _saved(kv: SmallKV, worker: OffloadWorker) -> list[torch.Tensor]:
    """Blocks 1, 2 (and state 3) saved to slot 0, then the cache wiped; their bytes."""
    want = kv.attn_block(1) + kv.attn_block(2)
    res = step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    assert res.report.saves == {1: [1, 0]}
    kv.wipe()
    return want


def _by_layer(job_id: int, slot: int = 0, blocks: Sequence[int] = ATTN_BLOCKS) -> Job:
    return Job(job_id, "r", [TransferOp(0, slot, list(blocks))], by_layer=True)


def _forward(worker: OffloadWorker, layers: Sequence[int]) -> StepResult:
    """One step whose forward waits for ``layers`` (in order), then vLLM's post-forward."""
    worker.begin_step(StepPlan(2, loads=[_by_layer(2)]))
    assert worker.loading_by_layer
    for layer in layers:
        worker.wait_layer(layer)
    res = worker.collect()
    assert not worker.loading_by_layer
    return res


def test_a_load_waited_layer_by_layer_is_restored_and_never_a_finished_load() -> None:
    kv = SmallKV(seed=11)
    worker = make_worker(kv, verify=False)
    want = _saved(kv, worker)
    res = _forward(worker, [0, 1, 2])
    assert res.report.loads == {2: [1, 0]} and res.report.bytes_loaded > 0
    assert res.report.loads_by_layer == 1 and res.report.layer_waits_missed == 0
    assert res.finished_loads == set() and res.failed_loads == set()
    assert res.recompute_blocks == set() and res.failed_blocks == set()
    assert worker.layers_missed == 0
    assert same(kv.attn_block(7) + kv.attn_block(8), want)
    assert worker.collect().is_empty()  # reported once
    worker.close()


@pytest.mark.parametrize("layers", [[1, 2], [], [0]])
def test_a_layer_read_before_its_wait_fails_the_blocks_in_the_same_step(layers: list[int]
                                                                         ) -> None:
    """The host waited at layer 1 (layer 0 was read first), or no layer waited at all (a
    replayed CUDA graph), or layer 0 alone (the host engine waits whole there: enough): the
    copy is fine (the scheduler half hears it loaded), vLLM recomputes the blocks."""
    kv = SmallKV(seed=12)
    worker = make_worker(kv, verify=False)
    _saved(kv, worker)
    res = _forward(worker, layers)
    assert res.report.loads == {2: [1, 0]} and res.finished_loads == set()
    missed = layers != [0]
    assert res.recompute_blocks == (set(ATTN_BLOCKS) if missed else set())
    assert worker.layers_missed == res.report.layer_waits_missed == int(missed)
    assert worker.collect().is_empty()
    worker.close()


def test_a_failed_or_refused_load_by_layer_reports_its_blocks_in_its_step() -> None:
    kv = SmallKV(seed=13)
    worker = make_worker(kv, verify=False)
    worker.begin_step(StepPlan(1, loads=[_by_layer(1, slot=10**6)]))  # no such slot
    worker.wait_layer(0)
    res = worker.collect()
    assert res.report.loads == {1: [0, 1]} and res.recompute_blocks == set(ATTN_BLOCKS)
    assert res.finished_loads == set() and res.failed_loads == set()
    worker.refusing = "the store's pool is not mapped"
    worker.begin_step(StepPlan(2, loads=[_by_layer(2, blocks=(4, 5))]))
    worker.wait_layer(0)
    res = worker.collect()
    assert res.report.loads == {2: [0, 1]} and res.recompute_blocks == {4, 5}
    assert worker.pending() == 0
    worker.close()


def test_under_the_asynchronous_scheduler_a_failed_load_by_layer_stops_the_engine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Where failures are fatal (``layer_failures_fatal``: vLLM's asynchronous scheduler,
    whose recompute of a failed synchronous load can keep KV of a replaced token), a failed
    copy, a load never reported and a layer read without its wait each raise in the step's
    collection instead of reaching vLLM as blocks to recompute; a load that succeeds is
    restored exactly as without the flag."""
    monkeypatch.setattr(worker_module, "LAYER_WAIT_LIMIT_S", 0.1)
    kv = SmallKV(seed=22)
    worker = make_worker(kv, verify=False)
    worker.layer_failures_fatal = True
    want = _saved(kv, worker)
    res = _forward(worker, [0, 1, 2])
    assert res.report.loads == {2: [1, 0]} and res.recompute_blocks == set()
    assert same(kv.attn_block(7) + kv.attn_block(8), want)
    worker.begin_step(StepPlan(3, loads=[_by_layer(3, slot=10**6)]))  # a failed copy
    worker.wait_layer(0)
    with pytest.raises(worker_module.LayerLoadFailed, match="asynchronous scheduler"):
        worker.collect()
    worker.begin_step(StepPlan(4, loads=[_by_layer(4, blocks=(4, 5))]))
    # no layer waited (a replayed FULL graph): the copies succeed, the forward read early
    with pytest.raises(worker_module.LayerLoadFailed, match=r"read layers \[0, 1"):
        worker.collect()
    worker.close()

    engines: list[_SilentUntilAsked] = []

    def make(mover: ChunkMover) -> _SilentUntilAsked:
        engines.append(_SilentUntilAsked(mover, lose=True))
        return engines[-1]
    silent = make_worker(SmallKV(seed=23), make, verify=False)
    silent.layer_failures_fatal = True
    silent.begin_step(StepPlan(1, loads=[_by_layer(1)]))
    for layer in (0, 1, 2):
        silent.wait_layer(layer)
    with pytest.raises(worker_module.LayerLoadFailed):
        silent.collect()  # never reported within LAYER_WAIT_LIMIT_S
    silent.close()


class _SilentUntilAsked(UnreliableNotices):
    """Notices lost, and ``query`` answers nothing until ``answer`` is set."""

    answer = False

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return super().query(job_ids) if self.answer else []


def test_a_load_never_reported_fails_its_blocks_and_its_late_report_goes_to_the_scheduler(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host waits at most LAYER_WAIT_LIMIT_S: the blocks are then reported failed in
    that step; the job's own completion, later, reaches the scheduler half only."""
    monkeypatch.setattr(worker_module, "LAYER_WAIT_LIMIT_S", 0.1)
    kv = SmallKV(seed=14)
    engines: list[_SilentUntilAsked] = []

    def make(mover: ChunkMover) -> _SilentUntilAsked:
        engines.append(_SilentUntilAsked(mover, lose=True))
        return engines[-1]
    worker = make_worker(kv, make, verify=False)
    res = _forward(worker, [0, 1, 2])
    assert res.report.loads == {} and res.recompute_blocks == set(ATTN_BLOCKS)
    engines[0].answer = True
    later = [worker.collect() for _ in range(3)]
    assert [r.report.loads for r in later if r.report.loads] == [{2: [1, 0]}]
    assert all(not r.recompute_blocks and not r.failed_blocks and not r.finished_loads
               for r in later)
    worker.close()


def test_a_lost_notice_is_asked_for_while_the_forward_waits() -> None:
    kv = SmallKV(seed=15)
    worker = make_worker(kv, lambda m: UnreliableNotices(m, lose=True), verify=False)
    want = kv.attn_block(1) + kv.attn_block(2)
    step(worker, StepPlan(1, saves=[save_job(1, 0, [1, 2], 3)]))
    saved = [worker.collect().report.saves for _ in range(3)]  # found by query
    assert {1: [1, 0]} in saved
    kv.wipe()
    res = _forward(worker, [0, 1, 2])
    assert res.report.loads == {2: [1, 0]} and res.recompute_blocks == set()
    assert same(kv.attn_block(7) + kv.attn_block(8), want)
    worker.close()


# --- the GPU engine's bands (HostRuntime, DMA path: no Triton) ------------------------------

def _one_group_worker(kv: SmallKV) -> OffloadWorker:
    """SmallKV's attention layers as a model of one KV-cache group."""
    layout = build_layout(kv.attn, [GroupSpec(GroupKind.FULL, 16, tuple(kv.attn))], NUM_BLOCKS)
    config = KvtierConfig(dram_size="1MiB", gpu_staging_size="1MiB")

    def make(mover: ChunkMover) -> CudaTransferEngine:
        return CudaTransferEngine(mover, config, mode="dma", runtime=HostRuntime())
    return OffloadWorker(config, layout, 32, engine_factory=make)


def test_the_gpu_engine_bands_restore_a_load_by_layer(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", 1)  # one band per layer
    kv = SmallKV(seed=16)
    worker = _one_group_worker(kv)
    want = kv.attn_block(1) + kv.attn_block(2)
    res = step(worker, StepPlan(1, saves=[Job(1, "r", [TransferOp(0, 0, [1, 2])])]))
    assert res.report.saves == {1: [1, 0]}
    kv.wipe()
    worker.begin_step(StepPlan(2, loads=[_by_layer(2)]))
    layered = worker._layered
    assert layered is not None and layered.loads is not None
    assert layered.loads.first_layers == [0, 1]
    worker.wait_layer(0)
    assert layered.loads.next == 1  # layer 1's band not waited for yet
    worker.wait_layer(1)
    res = worker.collect()
    assert res.report.loads == {2: [1, 0]} and res.recompute_blocks == set()
    assert res.finished_loads == set()
    assert same(kv.attn_block(7) + kv.attn_block(8), want)
    # the next step's forward skips layer 1's wait: every block of its load is recomputed
    worker.begin_step(StepPlan(3, loads=[_by_layer(3, blocks=(9, 10))]))
    worker.wait_layer(0)
    res = worker.collect()
    assert res.report.loads == {3: [1, 0]} and res.recompute_blocks == {9, 10}
    worker.close()


def _layered_step(worker: OffloadWorker, step_no: int, layers: Sequence[int]) -> StepResult:
    worker.begin_step(StepPlan(step_no, loads=[_by_layer(step_no)]))
    for layer in layers:
        worker.wait_layer(layer)
    return worker.collect()


def test_a_model_whose_attention_skips_the_layer_hook_is_found_in_one_step(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """H200 session 15: MiniMax-M3's sparse layers (3-59) run their own attention op, which
    never calls wait_for_layer_load; only the dense layers 0-2 wait. Every load by layer was
    recomputed, and the run never finished. A forward that waits for some layers and not for
    others tells at once: the workers report it once, and the blocks are still recomputed."""
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", 1)
    kv = SmallKV(seed=18)
    worker = _one_group_worker(kv)
    step(worker, StepPlan(1, saves=[Job(1, "r", [TransferOp(0, 0, [1, 2])])]))
    res = _layered_step(worker, 2, [0])  # layer 1's attention skips the hook
    assert res.recompute_blocks == set(ATTN_BLOCKS)
    assert res.report.layer_hooks_missing == 1 and worker.layer_hooks_missing == [1]
    res = _layered_step(worker, 3, [0])
    assert res.recompute_blocks == set(ATTN_BLOCKS)
    assert res.report.layer_hooks_missing == 0  # reported once
    worker.close()


def test_forwards_that_wait_for_no_layer_turn_it_off_only_in_a_row(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One forward that waits for no layer may be a replayed CUDA graph (its blocks are
    recomputed, nothing more); UNWAITED_STEPS_OFF of them in a row: the hook is skipped
    everywhere. A waited step in between starts the count again."""
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", 1)
    kv = SmallKV(seed=19)
    worker = _one_group_worker(kv)
    step(worker, StepPlan(1, saves=[Job(1, "r", [TransferOp(0, 0, [1, 2])])]))
    n = worker_module.UNWAITED_STEPS_OFF
    pattern = [[]] * (n - 1) + [[0, 1]] + [[]] * n
    found = []
    for i, layers in enumerate(pattern):
        res = _layered_step(worker, 2 + i, layers)
        assert res.recompute_blocks == (set() if layers else set(ATTN_BLOCKS))
        found.append(res.report.layer_hooks_missing)
    assert found == [0] * (2 * n - 1) + [1]
    assert worker.layer_hooks_missing == [0, 1]
    worker.close()


def test_where_failures_are_fatal_the_host_does_not_wait_for_the_bands(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Under the asynchronous scheduler the forward's device-side waits are trusted: the
    step's collection never blocks on the bands' events, a load still in flight is reported
    to the scheduler half when it finishes (never as blocks to recompute), and a failure
    reported in a later step still stops the engine."""
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", 1)

    def no_host_wait(self: object) -> None:
        raise AssertionError("the host waited for the bands")
    monkeypatch.setattr(engine_module._BandLoads, "synchronize", no_host_wait)
    kv = SmallKV(seed=24)
    worker = _one_group_worker(kv)
    worker.layer_failures_fatal = True
    want = kv.attn_block(1) + kv.attn_block(2)
    step(worker, StepPlan(1, saves=[Job(1, "r", [TransferOp(0, 0, [1, 2])])]))
    kv.wipe()
    engine = worker.engine
    polled = engine.poll
    monkeypatch.setattr(engine, "poll", list)  # this step's notices come late
    res = _layered_step(worker, 2, [0, 1])
    assert res.recompute_blocks == set() and res.report.loads == {}
    monkeypatch.setattr(engine, "poll", polled)
    later = [worker.collect() for _ in range(2)]
    assert [r.report.loads for r in later if r.report.loads] == [{2: [1, 0]}]
    assert all(not r.recompute_blocks and not r.finished_loads for r in later)
    assert same(kv.attn_block(7) + kv.attn_block(8), want)
    monkeypatch.setattr(engine, "poll", list)
    worker.begin_step(StepPlan(3, loads=[_by_layer(3, slot=10**6)]))  # fails, reported late
    for layer in (0, 1):
        worker.wait_layer(layer)
    assert worker.collect().recompute_blocks == set()
    monkeypatch.setattr(engine, "poll", polled)
    with pytest.raises(worker_module.LayerLoadFailed, match="failed after its promise"):
        worker.collect()
    worker.close()


@pytest.mark.parametrize("engine", ["host-waits", "bands"])
def test_a_step_that_may_replay_a_full_graph_waits_for_its_loads_before_the_forward(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``StepPlan.loads_before_forward``: the forward (a replayed FULL CUDA graph) calls no
    layer hook, yet every layer counts as waited, the bytes are in place and nothing is
    recomputed or stops the engine."""
    from kvtier.gpu import engine as engine_module

    monkeypatch.setattr(engine_module, "BAND_MIN_BYTES", 1)
    kv = SmallKV(seed=25)
    if engine == "bands":
        worker = _one_group_worker(kv)
        blocks = ATTN_BLOCKS
        step(worker, StepPlan(1, saves=[Job(1, "r", [TransferOp(0, 0, [1, 2])])]))
        want = kv.attn_block(1) + kv.attn_block(2)
        kv.wipe()
    else:
        worker = make_worker(kv, verify=False)
        blocks = ATTN_BLOCKS
        want = _saved(kv, worker)
    worker.layer_failures_fatal = True
    worker.begin_step(StepPlan(2, loads=[_by_layer(2, blocks=blocks)],
                               loads_before_forward=True))
    res = worker.collect()  # no hook ran
    later = [worker.collect() for _ in range(2)]
    assert res.recompute_blocks == set() and res.report.layer_waits_missed == 0
    assert [r.report.loads for r in (res, *later) if r.report.loads] == [{2: [1, 0]}]
    assert same(kv.attn_block(7) + kv.attn_block(8), want)
    worker.close()


def _probe_step(worker: OffloadWorker, step_no: int, layers: Sequence[int]) -> StepResult:
    """A step without loads by layer whose forward calls the hook for ``layers``."""
    worker.begin_step(StepPlan(step_no))
    for layer in layers:
        worker.wait_layer(layer)
    return worker.collect()


def test_the_probe_hears_every_layer_before_any_load_by_layer_is_promised() -> None:
    """A forward that calls the hook for no layer (a replayed CUDA graph) tells nothing; the
    first that calls it for every layer verifies the model, once, and the probe stops."""
    kv = SmallKV(seed=20)
    worker = _one_group_worker(kv)
    assert not worker.layer_hooks.probing  # only where the setting can act (worker_side)
    worker.layer_hooks.start_probe()
    assert worker.layer_hooks.probing
    verified = [_probe_step(worker, i + 1, layers).report.layer_hooks_verified
                for i, layers in enumerate([[], [], [0, 1], [0, 1]])]
    assert verified == [0, 0, 1, 0]
    assert worker.layer_hooks.verified and not worker.layer_hooks.probing
    assert worker.layer_hooks_missing is None
    worker.close()


def test_the_probe_finds_a_model_whose_attention_skips_the_hook_before_any_promise() -> None:
    """MiniMax-M3's case found without a recomputed step: the first forward that calls the
    hook for some layers only reports the others missing, and nothing is verified."""
    kv = SmallKV(seed=21)
    worker = _one_group_worker(kv)
    worker.layer_hooks.start_probe()
    res = _probe_step(worker, 1, [0])
    assert res.report.layer_hooks_missing == 1 and res.report.layer_hooks_verified == 0
    assert worker.layer_hooks_missing == [1] and not worker.layer_hooks.probing
    assert res.recompute_blocks == set()  # nothing was loaded, nothing recomputes
    assert _probe_step(worker, 2, [0, 1]).report.layer_hooks_verified == 0
    worker.close()


def _report(**counts: int) -> Any:
    from kvtier.protocol import WorkerReport
    from kvtier.vllm.metadata import KvtierWorkerMetadata

    output = type("Output", (), {})()
    output.kv_connector_worker_meta = KvtierWorkerMetadata(
        report=WorkerReport(**counts), geometries=[], load_errors={})
    return output


def _verified(side: Any, ranks: int = 1) -> Any:
    """``side`` after ``ranks`` workers reported the hook heard on every layer."""
    side.update_connector_output(_report(layer_hooks_verified=ranks))
    return side


def test_the_scheduler_half_loads_by_layer_once_every_rank_heard_every_hook() -> None:
    import dataclasses

    from kvtier.vllm.scheduler_side import SchedulerSide

    setup = dataclasses.replace(_setup({"layerwise_loads": True}),  # type: ignore[type-var]
                                world_size=2)
    side = SchedulerSide(setup)
    assert side.layerwise_loads and not side._loads_by_layer(_Request(1024), 0, 512)
    _verified(side)  # one rank of two
    assert not side._loads_by_layer(_Request(1024), 0, 512)
    _verified(side)
    assert side._loads_by_layer(_Request(1024), 0, 512)


def test_the_scheduler_half_loads_parked_once_a_worker_finds_the_hook_missing(
        kvtier_caplog: pytest.LogCaptureFixture) -> None:
    from kvtier.vllm.scheduler_side import SchedulerSide

    side = _verified(SchedulerSide(_setup({"layerwise_loads": True})))  # type: ignore[arg-type]
    assert side._loads_by_layer(_Request(1024), 0, 512)
    side.update_connector_output(_report(layer_hooks_missing=1))
    assert not side.layerwise_loads and not side._loads_by_layer(_Request(1024), 0, 512)
    assert any("skips vLLM's wait_for_layer_load" in r.getMessage()
               for r in kvtier_caplog.records)


# --- where the setting can act (kvtier.vllm.setup.layerwise_loads) -------------------------

def _setup(extra: dict[str, object], mamba: str | None = None,
           cudagraph_mode: str | None = None, async_scheduling: bool = False) -> object:
    from kvtier.vllm.setup import set_up
    from tests.test_connector_startup import _configs

    cfg, kvc = _configs("recompute", {"dram_size": "8MiB", **extra}, mamba)
    cfg.scheduler_config.async_scheduling = async_scheduling
    if cudagraph_mode is not None:
        from vllm.config import CUDAGraphMode

        cfg.compilation_config.cudagraph_mode = CUDAGraphMode[cudagraph_mode]
    return set_up(cfg, cfg.kv_transfer_config, kvc, is_scheduler=True)


def test_the_setting_acts_only_where_vllm_reads_each_layer_after_its_wait(
        kvtier_caplog: pytest.LogCaptureFixture) -> None:
    assert not _setup({}).layerwise_loads  # type: ignore[attr-defined]
    sync = _setup({"layerwise_loads": True})
    assert sync.layerwise_loads and not sync.layer_load_failures_fatal  # type: ignore[attr-defined]
    # the asynchronous scheduler: acts, and a failure after the promise stops the engine
    asynchronous = _setup({"layerwise_loads": True}, async_scheduling=True)
    assert asynchronous.layerwise_loads  # type: ignore[attr-defined]
    assert asynchronous.layer_load_failures_fatal  # type: ignore[attr-defined]
    for mode in ("FULL_AND_PIECEWISE", "PIECEWISE", "NONE", "FULL_DECODE_ONLY"):
        assert _setup({"layerwise_loads": True}, cudagraph_mode=mode).layerwise_loads, mode
    refusals = [
        (_setup({"layerwise_loads": True}, cudagraph_mode="FULL"), "cudagraph_mode is FULL"),
        (_setup({"layerwise_loads": True, "verify_checksums": True}), "verify_checksums"),
        (_setup({"layerwise_loads": True}, mamba="align"), "more than one KV-cache group"),
        (_setup({"layerwise_loads": True, "store_url": "unix:///tmp/kvtier-none.sock"},
                async_scheduling=True), "node-wide store"),
    ]
    for setup, why in refusals:
        assert not setup.layerwise_loads  # type: ignore[attr-defined]
        assert any(why in r.getMessage() and "layerwise_loads" in r.getMessage()
                   for r in kvtier_caplog.records), why


class _Request:
    def __init__(self, num_tokens: int) -> None:
        self.request_id = "r"
        self.num_tokens = num_tokens


@pytest.mark.parametrize(("rest", "spec_tokens", "by_layer"),
                         [(2, 0, True), (1, 0, False), (4, 3, False), (5, 3, True)])
def test_a_hit_loads_by_layer_only_while_its_step_is_no_uniform_decode(
        rest: int, spec_tokens: int, by_layer: bool) -> None:
    """A step of nothing but 1 + speculative-token queries may replay a FULL CUDA graph,
    which never calls the layer hook: such a hit is loaded parked."""
    import dataclasses

    from kvtier.vllm.scheduler_side import SchedulerSide

    setup = dataclasses.replace(_setup({"layerwise_loads": True}),  # type: ignore[type-var]
                                decode_query_len=1 + spec_tokens)
    side = _verified(SchedulerSide(setup))
    assert side._loads_by_layer(_Request(512 + 256 + rest), 512, 256) is by_layer


@pytest.mark.parametrize(("scheduled", "spec_tokens", "by_layer", "before"), [
    ({"r": 1, "a": 1, "b": 1}, 0, True, True),  # one token for the hit among decodes
    ({"r": 2, "a": 1}, 0, True, False),  # a mixed batch: piecewise, the hooks run
    ({"r": 3, "a": 4, "b": 4}, 3, True, True),  # decodes with 3 drafts each
    ({"r": 5, "a": 4}, 3, True, False),
    ({"r": 1, "a": 1}, 0, False, False),  # no load by layer in the step
])
def test_a_step_that_may_replay_a_full_graph_is_planned_to_wait_before_its_forward(
        scheduled: dict[str, int], spec_tokens: int, by_layer: bool, before: bool) -> None:
    import dataclasses

    from kvtier.protocol import StepPlan
    from kvtier.vllm.scheduler_side import SchedulerSide

    setup = dataclasses.replace(_setup({"layerwise_loads": True}),  # type: ignore[type-var]
                                decode_query_len=1 + spec_tokens)
    side = SchedulerSide(setup)
    plan = StepPlan(1, loads=[_by_layer(1) if by_layer else
                              Job(1, "r", [TransferOp(0, 0, list(ATTN_BLOCKS))])])
    output = type("Output", (), {"num_scheduled_tokens": scheduled})()
    assert side._may_replay_full_graph(plan, output) is before


def test_saves_of_a_step_whose_load_by_layer_is_recomputed_fail() -> None:
    """The forward read wrong bytes where vLLM recomputes: nothing it computed in that step,
    or in the next (an asynchronous scheduler had scheduled it already), is saved (any
    request of the batch may share those blocks); a later good step saves."""
    kv = SmallKV(seed=17)
    worker = make_worker(kv, verify=False)
    _saved(kv, worker)
    save = Job(3, "r", [TransferOp(0, 1, [11, 12])])
    plan = StepPlan(2, loads=[_by_layer(2)], saves=[save])
    worker.begin_step(plan)  # no layer waited: a replayed graph
    worker.end_step(plan)
    worker.drain()
    res = worker.collect()
    assert res.recompute_blocks == set(ATTN_BLOCKS) and res.report.saves == {3: [0, 1]}
    plan = StepPlan(3, saves=[Job(6, "r", [TransferOp(0, 3, [15, 16])])])
    worker.begin_step(plan)
    worker.end_step(plan)
    worker.drain()
    assert worker.collect().report.saves == {6: [0, 1]}
    plan = StepPlan(4, loads=[_by_layer(4)], saves=[Job(5, "r", [TransferOp(0, 2, [13, 14])])])
    worker.begin_step(plan)
    for layer in (0, 1, 2):
        worker.wait_layer(layer)
    worker.end_step(plan)
    worker.drain()
    res = worker.collect()
    assert res.recompute_blocks == set() and res.report.saves == {5: [1, 0]}
    assert res.report.loads == {4: [1, 0]}
    worker.close()
