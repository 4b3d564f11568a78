"""kvtier's loads with several KV-cache groups on vLLM 0.25.1's real ``Scheduler``
(docs/notes/hybrid-loads-025.md): run by tests/test_vllm025_multigroup_loads.py in a
subprocess,

    cd tests && PYTHONPATH=../.cache/vllm-0.25.1:.:../src python -m vllm025_multigroup_loads

which prints one JSON line: per group set and case, what happened.

vLLM's scheduler (no model) creates kvtier's scheduler half from ``kv_transfer_config``; one
worker runs a real worker-side :class:`FaultKvtierConnector` over real CPU tensors (one
attention tensor per attention layer, a list of state tensors per mamba layer) in 0.25.1's
hook order. Its forward is a fake model whose bytes say what they are:

- an attention position ``p`` holds ``H(tokens[:p + 1])`` (every element), a recurrent state
  after ``n`` tokens holds ``H(tokens[:n]) + 0.5``, written where 0.25.1's ``align`` runner
  keeps it (block ``(n - 1) // block_size`` of the group's table);
- before writing, each step reads what a real forward reads: every attention position below
  the computed tokens (sliding window: the window's), and the state the mamba runner starts
  from (block ``(computed - 1) // block_size``, ``preprocess_mamba``); a null block or wrong
  bytes are a finding (``mamba_read_null``, ``mamba_read_wrong``, ``kv_read_wrong``).

Cases per group set (``full+full``, ``full+swa``, ``full+mamba``, ``full+mamba+mamba``):

- ``load_once``: request ``a`` computes prompt P (kvtier saves it), the HBM prefix cache is
  reset, ``c`` caches P's first 32 tokens, then ``r`` (P's first 96 tokens and 8 more) hits
  32 tokens locally and kvtier promises 64 more; its load's first copy raises (re-issued).
- ``load_always``: the same, every attempt of the load fails; ``load_always_hit_0``
  (full+full): without ``c``, a local hit of 0.
- ``hazard_no_hit_beyond`` (mamba sets): ``a`` computes P, then the HBM states from 64
  tokens on are evicted (attention blocks stay): 0.25.1 tells kvtier a local hit of 96 for
  ``r``, where no state group has a state and kvtier has nothing beyond (docs/vllm-api.md
  §0 item 8); ``hazard_hit_beyond``: states from 48 and attention from 64 tokens on
  evicted: a local hit of 64 without its state, and kvtier's hit goes on to 96.
- ``cold_96`` / ``cold_32``: no connector; ``r`` after P (hit 96) / after ``c`` (hit 32).
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch
import vllm
from vllm.config import CacheConfig, DeviceConfig, KVTransferConfig, SchedulerConfig, VllmConfig
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from harness.compat import kv_output, make_request, model_config, runner_output
from kvtier.testing.faults import FaultyEngine, faulty_factory
from kvtier.transfer import ChunkMover, TransferEngine
from kvtier.vllm.connector import KvtierConnector

BS = 16
NUM_BLOCKS = 96
WINDOW = 32
PROMPT = [100 + (7 * i) % 500 for i in range(100)]
R_PROMPT = PROMPT[:96] + [900 + i for i in range(8)]
C_PROMPT = PROMPT[:32] + [700 + i for i in range(8)]
MOD = 8_388_593  # prefix hashes stay exact in float32
CONV, SSM = (3, 8), (2, 4, 4)


class FaultKvtierConnector(KvtierConnector):
    """kvtier's connector whose worker engine is a FaultyEngine (kvtier.testing.faults),
    reachable as ``faulty`` for the driver to switch faults between steps."""

    faulty: FaultyEngine | None = None

    def _engine_factory(self, device_is_cuda: bool
                        ) -> Callable[[ChunkMover], TransferEngine] | None:
        wrap = faulty_factory(super()._engine_factory(device_is_cuda))

        def make(mover: ChunkMover) -> FaultyEngine:
            self.faulty = wrap(mover)
            return self.faulty

        return make


# -- engine shapes --------------------------------------------------------------------------
def group_specs(name: str, mamba_mode: str = "align", mamba_block: int = BS
                ) -> list[tuple[str, Any]]:
    full = FullAttentionSpec(block_size=BS, num_kv_heads=1, head_size=8, dtype=torch.float32)
    other = {
        "full": FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=4,
                                  dtype=torch.float32),
        "swa": SlidingWindowSpec(block_size=BS, num_kv_heads=1, head_size=8,
                                 dtype=torch.float32, sliding_window=WINDOW),
        "mamba": MambaSpec(block_size=mamba_block, shapes=(CONV, SSM),
                           dtypes=(torch.float32, torch.float32), mamba_cache_mode=mamba_mode),
    }
    kinds = name.split("+")
    return [(f"model.layers.{i}.{'mixer' if k == 'mamba' else 'self_attn.attn'}",
             full if i == 0 else other[k]) for i, k in enumerate(kinds)]


def make_scheduler(set_name: str, with_kvtier: bool, extra: dict[str, Any] | None = None,
                   mamba_mode: str = "align", mamba_block: int = BS) -> Scheduler:
    kv = KVTransferConfig(
        kv_connector="FaultKvtierConnector", kv_role="kv_both",
        kv_connector_module_path="vllm025_multigroup_loads",
        kv_load_failure_policy="recompute",
        # verify_checksums off unless a scenario sets it: these scenarios are failures
        # *after* the promise (copy errors); verification before it (kvtier.prepare) defers
        # the promise by a step and has its own tests (tests/test_prepare.py)
        kv_connector_extra_config={k: v for k, v in {
            "dram_size": "4MiB", "chunk_tokens": BS, "cost_model": False,
            "verify_checksums": False, **(extra or {}),
        }.items() if v is not None},
    ) if with_kvtier else None
    specs = group_specs(set_name, mamba_mode, mamba_block)
    has_mamba = any(isinstance(s, MambaSpec) for _, s in specs)
    cache = CacheConfig(block_size=BS, enable_prefix_caching=mamba_mode != "none",
                        mamba_cache_mode=mamba_mode if has_mamba else "none")
    cfg = VllmConfig(
        model_config=model_config(),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32,
                                         max_model_len=1024, is_encoder_decoder=False,
                                         enable_chunked_prefill=True),
        cache_config=cache, kv_transfer_config=kv, device_config=DeviceConfig("cpu"))
    cfg.cache_config.num_gpu_blocks = NUM_BLOCKS
    kvc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([layer], spec) for layer, spec in specs])
    s = Scheduler(vllm_config=cfg, kv_cache_config=kvc, log_stats=True,
                  structured_output_manager=StructuredOutputManager(cfg),
                  block_size=math.lcm(*(spec.block_size for _, spec in specs)),
                  hash_block_size=BS)
    s.fake = FakeWorker(cfg, kvc, specs, with_kvtier)  # type: ignore[attr-defined]
    return s


# -- the fake model ---------------------------------------------------------------------------
def prefix_hashes(tokens: list[int]) -> list[int]:
    """``out[n]``: the hash of ``tokens[:n]``."""
    out = [1]
    for t in tokens:
        out.append((out[-1] * 31 + t + 1) % MOD)
    return out


class FakeWorker:
    def __init__(self, cfg: VllmConfig, kvc: KVCacheConfig, specs: list[tuple[str, Any]],
                 with_kvtier: bool) -> None:
        self.specs = specs
        self.caches: dict[str, Any] = {}
        for layer, spec in specs:
            if isinstance(spec, MambaSpec):
                self.caches[layer] = [torch.zeros(NUM_BLOCKS, *CONV), torch.zeros(NUM_BLOCKS, *SSM)]
            else:
                self.caches[layer] = torch.zeros(NUM_BLOCKS, 2, BS, spec.num_kv_heads,
                                                 spec.head_size)
        self.connector: FaultKvtierConnector | None = None
        if with_kvtier:
            self.connector = FaultKvtierConnector(cfg, KVConnectorRole.WORKER, kvc)
            self.connector.register_kv_caches(dict(self.caches))
        self.findings: list[str] = []
        self.invalid_block_reports: list[list[int]] = []

    def execute(self, s: Scheduler, out: Any) -> tuple[list[str], list[list[int]], Any]:
        conn = self.connector
        if conn is not None:
            meta = out.kv_connector_metadata
            conn.handle_preemptions(meta)
            conn.bind_connector_metadata(meta)
            conn.start_load_kv(None)
        ids, sampled = [], []
        for req_id, n in out.num_scheduled_tokens.items():
            req = s.requests[req_id]
            tables = s.kv_cache_manager.get_block_ids(req_id)
            end = req.num_computed_tokens  # schedule() already advanced it
            self.forward(req_id, list(req.all_token_ids), tables, end - n, end)
            ids.append(req_id)
            sampled.append([7] if end >= req.num_tokens else [])
        if conn is None:
            return ids, sampled, None
        if out.total_num_scheduled_tokens > 0:
            conn.wait_for_save()
        # every copy submitted so far finishes within its step (idle steps take microseconds
        # here, no time for a copy thread): the runs are reproducible
        conn.worker_side.worker.drain()  # type: ignore[union-attr]
        _, recving = conn.get_finished(out.finished_req_ids)
        invalid = conn.get_block_ids_with_load_errors()
        if invalid:
            self.invalid_block_reports.append(sorted(invalid))
        meta_out = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        return ids, sampled, kv_output(set(recving or ()), None, set(invalid), meta_out, None)

    def forward(self, req_id: str, tokens: list[int], tables: Any, start: int, end: int
                ) -> None:
        h = prefix_hashes(tokens[:end])
        for (layer, spec), table in zip(self.specs, tables):
            cache = self.caches[layer]
            if isinstance(spec, MambaSpec):
                if start > 0:
                    block = table[(start - 1) // BS]
                    if block == 0:
                        self.findings.append(f"mamba_read_null {req_id} {layer} at {start}")
                    elif float(cache[0][block, 0, 0]) != h[start] + 0.5:
                        self.findings.append(f"mamba_read_wrong {req_id} {layer} at {start}")
                for t in cache:
                    t[table[(end - 1) // BS]] = h[end] + 0.5
                continue
            first = max(0, start - WINDOW + 1) if isinstance(spec, SlidingWindowSpec) else 0
            for p in range(first, start):
                if float(cache[table[p // BS], 0, p % BS, 0, 0]) != h[p + 1]:
                    self.findings.append(f"kv_read_wrong {req_id} {layer} at {p}")
                    break
            for p in range(start, end):
                cache[table[p // BS], :, p % BS] = h[p + 1]


# -- the engine loop --------------------------------------------------------------------------
def step(s: Scheduler) -> dict[str, Any]:
    """One engine step; what ``r`` looked like when it was scheduled."""
    out = s.schedule()
    record: dict[str, Any] = {}
    if "r" in out.num_scheduled_tokens:
        req = s.requests["r"]
        n = out.num_scheduled_tokens["r"]
        record = {"from": req.num_computed_tokens - n, "scheduled": n,
                  "tables": ["".join("-" if b == 0 else "b" for b in ids)
                             for ids in s.kv_cache_manager.get_block_ids("r")]}
    ids, sampled, kv = s.fake.execute(s, out)  # type: ignore[attr-defined]
    s.update_from_output(out, runner_output(ids, sampled, kv))
    return record


def run_until_done(s: Scheduler, max_steps: int = 60) -> list[dict[str, Any]]:
    records = []
    for _ in range(max_steps):
        conn = s.connector
        busy = s.has_requests() or (conn is not None and conn.has_pending_push_work())
        if not busy:
            return records
        if (rec := step(s)):
            records.append(rec)
    raise RuntimeError(
        f"the engine did not drain: requests "
        f"{ {k: (v.status.name, v.num_computed_tokens) for k, v in s.requests.items()} }, "
        f"kvtier jobs {sorted(s.connector.scheduler_side.scheduler.jobs) if s.connector else []}")


def kvtier_stats(s: Scheduler) -> dict[str, Any]:
    sched = s.connector.scheduler_side.scheduler
    faulty = s.fake.connector.faulty  # type: ignore[attr-defined]
    engine = s.fake.connector.worker_side.worker.engine  # type: ignore[attr-defined]
    return {"loads_ok": sched.stats.loads_ok, "loads_failed": sched.stats.loads_failed,
            "hit_tokens": sched.stats.hit_tokens, "injected": faulty.injected if faulty else 0,
            "reissued": getattr(engine, "reissued", None)}


def end_state(s: Scheduler) -> dict[str, Any]:
    return {"free_blocks": s.kv_cache_manager.block_pool.get_num_free_blocks(),
            "requests_left": len(s.requests)}


def add(s: Scheduler, req_id: str, prompt: list[int], max_tokens: int = 2) -> None:
    s.add_request(make_request(req_id, prompt, max_tokens=max_tokens))


def cold(set_name: str, boundary: int) -> dict[str, Any]:
    s = make_scheduler(set_name, with_kvtier=False)
    add(s, "a" if boundary == 96 else "c", PROMPT if boundary == 96 else C_PROMPT)
    run_until_done(s)
    add(s, "r", R_PROMPT)
    records = run_until_done(s)
    return {"records": records, "findings": s.fake.findings, **end_state(s)}  # type: ignore


def load_case(set_name: str, fault: str, local_hit: bool = True) -> dict[str, Any]:
    """``a`` saved by kvtier, HBM reset, ``c`` cached 32 tokens, ``r`` hits 32 + 64 (without
    ``local_hit``: no ``c``, ``r`` hits 0 + 96)."""
    s = make_scheduler(set_name, with_kvtier=True)
    add(s, "a", PROMPT)
    run_until_done(s)
    s.reset_prefix_cache()  # HBM only: kvtier keeps P
    if local_hit:
        add(s, "c", C_PROMPT)
        run_until_done(s)
    faulty = s.fake.connector.faulty  # type: ignore[attr-defined]
    if fault == "once":
        faulty.raise_in_jobs = 1  # the first job submitted next: r's load
    else:
        faulty.fail_loads = 1  # r's load, every attempt (a failed job id stays failed)
    add(s, "r", R_PROMPT)
    out: dict[str, Any] = {}
    try:
        step(s)
        out["parked"] = s.requests["r"].status == RequestStatus.WAITING_FOR_REMOTE_KVS
        out["promised"] = s.requests["r"].num_computed_tokens
        out["records"] = run_until_done(s)
    except Exception as e:
        frame = traceback.extract_tb(e.__traceback__)[-1]
        out["error"] = {"type": type(e).__name__, "message": str(e),
                        "at": f"{frame.filename.rsplit('/', 1)[-1]}:{frame.lineno}"}
    out.update(findings=s.fake.findings,  # type: ignore[attr-defined]
               invalid_block_reports=s.fake.invalid_block_reports,  # type: ignore
               stats=kvtier_stats(s), **end_state(s))
    return out


def evict_from_hbm(s: Scheduler, kinds: tuple[type, ...], from_tokens: int) -> int:
    """Drop from vLLM's prefix cache the blocks of P's prompt from ``from_tokens`` on, in the
    groups whose spec is one of ``kinds`` (what eviction under pressure does: align mode
    frees a hybrid's state blocks long before its attention blocks)."""
    pool = s.kv_cache_manager.block_pool
    hashes = make_request("probe", PROMPT, max_tokens=1).block_hashes
    dropped = 0
    for gid, (_, spec) in enumerate(s.fake.specs):  # type: ignore[attr-defined]
        if not isinstance(spec, kinds):
            continue
        for j in range(from_tokens // BS, len(hashes)):
            while cached := pool.get_cached_block(hashes[j], [gid]):
                pool.evict_blocks({cached[0].block_id})
                dropped += 1
    return dropped


def hazard_case(set_name: str, state_from: int, attention_from: int | None
                ) -> dict[str, Any]:
    """``a`` computed P (kvtier saved it with its states); the HBM states from
    ``state_from`` tokens on are evicted, and the attention blocks from ``attention_from``
    tokens on (None: none). ``r``'s local hit, as 0.25.1 tells kvtier, is the attention
    groups' (96 or 64), where no state group holds a state."""
    s = make_scheduler(set_name, with_kvtier=True)
    add(s, "a", PROMPT)
    run_until_done(s)
    evicted = {"state": evict_from_hbm(s, (MambaSpec,), state_from)}
    if attention_from is not None:
        evicted["attention"] = evict_from_hbm(s, (FullAttentionSpec,), attention_from)
    add(s, "r", R_PROMPT)
    records = run_until_done(s)
    side = s.connector.scheduler_side
    return {"records": records, "findings": s.fake.findings,  # type: ignore[attr-defined]
            "evicted": evicted, "hits_forgotten": getattr(side, "hits_forgotten", None),
            "stats": kvtier_stats(s), **end_state(s)}


def startup_case(mamba_mode: str = "align", mamba_block: int = BS,
                 chunk_tokens: int | None = BS) -> dict[str, Any]:
    """Whether an engine with a full-attention group and a mamba group starts; its chunk."""
    try:
        s = make_scheduler("full+mamba", with_kvtier=True, mamba_mode=mamba_mode,
                           mamba_block=mamba_block, extra={"chunk_tokens": chunk_tokens})
    except Exception as e:
        return {"started": False, "type": type(e).__name__, "message": str(e)}
    worker = s.fake.connector.worker_side.worker  # type: ignore[attr-defined]
    return {"started": True, "chunk_tokens": worker.geometry.chunk_tokens}


STARTUP = {
    "mode_align": {}, "mode_all": {"mamba_mode": "all"}, "mode_none": {"mamba_mode": "none"},
    # the chunk: the LCM of every group's block size (state groups too), or a multiple of it
    "chunk_unset_16_48": {"mamba_block": 48, "chunk_tokens": None},
    "chunk_16_with_48": {"mamba_block": 48, "chunk_tokens": 16},
    "chunk_96_with_48": {"mamba_block": 48, "chunk_tokens": 96},
}


SETS = ("full+full", "full+swa", "full+mamba", "full+mamba+mamba")


def main() -> None:
    only = sys.argv[1:] or list(SETS)
    results: dict[str, Any] = {"version": vllm.__version__}
    results["startup"] = {name: startup_case(**kw) for name, kw in STARTUP.items()}
    for name in only:
        results[name] = {"cold_96": cold(name, 96), "cold_32": cold(name, 32),
                         "load_once": load_case(name, "once"),
                         "load_always": load_case(name, "always")}
        if name == "full+full":  # (a) is refused at a local hit of 0 (the prototype's crash)
            results[name]["load_always_hit_0"] = load_case(name, "always", local_hit=False)
        if "mamba" in name:
            results[name]["hazard_no_hit_beyond"] = hazard_case(name, 64, None)
            results[name]["hazard_hit_beyond"] = hazard_case(name, 48, 64)
    print(json.dumps(results))


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    # vLLM imports this module by name for the connector: run that copy, not __main__
    import vllm025_multigroup_loads

    vllm025_multigroup_loads.main()
