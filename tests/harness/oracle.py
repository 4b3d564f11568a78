"""The oracle: what must hold after every step, checked without kvtier's bookkeeping.

It reads vLLM's scheduler state (request statuses, block tables, the block pool), the fake
caches' bytes and write tags, the transport's ground truth (which copies ran, which failed,
which slots are being written or read) and the reports that reach vLLM. Checks:

``parked_too_long``
    every request parked for a load (``WAITING_FOR_REMOTE_KVS``) gets its aggregated
    ``finished_recving`` within a bound (the transport's worst lateness plus slack);
``stray_report`` / ``duplicate_report``
    no rank reports a load vLLM is not waiting for, or reports one twice; nothing stray or
    duplicate reaches vLLM after aggregation; ``finished_sending`` stays empty;
``reported_before_copy``
    a rank reports a load only after every copy of it ran;
``failure_hidden``
    a load whose copy failed (all or part) on a rank is reported by that rank as failed
    (``failed_recving`` on 0.32, its blocks in ``invalid_block_ids`` on 0.25.1);
``block_reused_during_save``
    when a save's copy runs, its source blocks were not written since it was submitted;
``load_before_all_ranks_wrote``
    a load never reads a slot that a save on any rank is still writing (a chunk is visible
    only after every rank wrote it);
``slot_overwritten_during_load`` / ``slot_double_write``
    a save never writes a slot a load is still reading (a pinned chunk was evicted), nor a
    slot another save is writing;
``load_wrong_bytes`` / ``load_into_foreign_block``
    the bytes a load writes into a block are exactly those the same prefix produces, and the
    block belongs to the parked request;
``wrong_kv_read``
    every position a forward reads holds its own prefix's bytes (HBM prefix-cache hits and
    restores alike), in every attention group (a sliding-window group: the window's);
``wrong_state_read``
    every forward of a state group starts from a real block holding the state of exactly the
    tokens computed before it (vLLM's ``align`` addressing: block ``(n - 1) // block_size``);
``save_wrong_state`` / ``load_wrong_state``
    a state object is saved from, and loaded into, the block of exactly its boundary (the
    state after the chunk's last token, never an interior or null block) holding that state;
    a load restores the state of its request's boundary, for every state group of the model
    (all-or-nothing with the KV);
``load_into_null_block``
    no load writes vLLM's null block (positions a window or state group does not hold);
``not_drained``
    when the workload drains: no request, block, pin, slot, job or report is left anywhere.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvtier.protocol import SKIP

from . import content
from .compat import HAS_FAILED_RECVING, RequestStatus
from .workload import BLOCK_SIZE, Scenario

if TYPE_CHECKING:
    from .runner import FakeRunner
    from .transport import Transfer, Transport


class ViolationError(AssertionError):
    def __init__(self, kind: str, detail: str) -> None:
        super().__init__(f"{kind}: {detail}")
        self.kind = kind
        self.detail = detail


@dataclass
class Parked:
    since: int
    request: Any
    boundary: int = 0  # tokens the request holds once its load is done (vLLM's promise)


@dataclass
class Oracle:
    scenario: Scenario
    slack: int = 12
    step: int = 0
    scheduler: Any = None
    transport: Transport | None = None
    runners: list[FakeRunner] = field(default_factory=list)
    parked: dict[str, Parked] = field(default_factory=dict)
    rank_reported: list[set[str]] = field(default_factory=list)
    violations: list[ViolationError] = field(default_factory=list)
    max_parked_steps: int = 0
    loads_reported: int = 0
    loads_failed_reported: int = 0
    # what the per-kind rules checked: state_saves, state_loads, window_saves, window_loads,
    # state_reads (forwards that started from a restored or cached state)
    checked: Counter = field(default_factory=Counter)
    raise_on_violation: bool = True
    # step -> blocks of that step's layer-by-layer loads some rank reported to recompute
    recomputed: dict[int, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rank_reported = [set() for _ in range(self.scenario.world_size)]

    @property
    def bound(self) -> int:
        return self.scenario.faults.max_lateness() + self.slack

    def violation(self, kind: str, detail: str) -> None:
        err = ViolationError(kind, f"step {self.step}: {detail}")
        self.violations.append(err)
        if self.raise_on_violation:
            raise err

    # -- parking -----------------------------------------------------------------------------
    def after_schedule(self) -> None:
        # a request whose report vLLM got but has not released yet (it releases parked
        # requests only in a schedule() that preempted nothing) is not parked again
        released = self.scheduler.finished_recving_kv_req_ids
        for req_id, req in self.scheduler.requests.items():
            if (req.status == RequestStatus.WAITING_FOR_REMOTE_KVS and req_id not in self.parked
                    and req_id not in released):
                self.parked[req_id] = Parked(self.step, req, req.num_computed_tokens)
                if getattr(req, "skip_reading_prefix_cache", False):
                    self.violation("load_despite_skip_reading",
                                   f"{req_id} must compute every token (prompt logprobs) but "
                                   "was parked for a load")

    def after_update(self) -> None:
        for req_id, p in self.parked.items():
            age = self.step - p.since
            self.max_parked_steps = max(self.max_parked_steps, age)
            if age > self.bound:
                self.violation("parked_too_long",
                               f"{req_id} parked since step {p.since}, no finished_recving after "
                               f"{age} steps (bound {self.bound})")

    # -- reports -----------------------------------------------------------------------------
    def on_rank_report(self, rank: int, kv: Any) -> None:
        recving = set(kv.finished_recving or ())
        failed = set(getattr(kv, "failed_recving", None) or ())
        invalid = set(kv.invalid_block_ids or ())
        if kv.finished_sending:
            self.violation("stray_report", f"rank {rank} reported finished_sending "
                           f"{sorted(kv.finished_sending)}; kvtier never holds blocks")
        if failed - recving:
            self.violation("stray_report", f"rank {rank} reported failed_recving "
                           f"{sorted(failed - recving)} without finished_recving")
        tr = self.transport
        assert tr is not None
        self._check_by_layer(rank, invalid)
        engine = self.runners[rank].harness_engine()
        recomputed = invalid & engine.by_layer_blocks
        if recomputed:
            self.recomputed.setdefault(tr.now, set()).update(recomputed)
        for req_id in sorted(recving):
            if req_id not in self.parked:
                self.violation("stray_report", f"rank {rank} reported finished_recving for "
                               f"{req_id}, which vLLM is not waiting for")
            if req_id in self.rank_reported[rank]:
                self.violation("duplicate_report",
                               f"rank {rank} reported finished_recving for {req_id} twice")
            self.rank_reported[rank].add(req_id)
            still = [t for t in tr._pending[rank] if t.kind == "load" and t.job.req_id == req_id]
            if still:
                self.violation("reported_before_copy", f"rank {rank} reported the load of "
                               f"{req_id} while job {still[0].job.job_id}'s copy had not run")
            last: dict[int, Transfer] = {}  # a re-issued load (RetryingLoads): its last try
            for t in tr.load_outcomes[rank].pop(req_id, []):
                last[t.job.job_id] = t
            bad = [t for t in last.values() if t.completion is None or not t.completion.ok]
            if bad:
                flagged = req_id in failed if HAS_FAILED_RECVING else bool(
                    invalid & self._blocks_of(req_id))
                if not flagged:
                    self.violation("failure_hidden",
                                   f"rank {rank}: the load of {req_id} (job {bad[0].job.job_id}) "
                                   f"failed ({bad[0].outcome}) but was reported as loaded")

    def _check_by_layer(self, rank: int, invalid: set[int]) -> None:
        """``failure_hidden`` for layer-by-layer loads (never parked, never in
        ``finished_recving``): every one whose copy ran on this rank by this report and
        failed has its blocks among the invalid blocks of this very report."""
        tr = self.transport
        assert tr is not None
        outcomes = tr.load_outcomes[rank]
        for req_id in sorted(outcomes):
            mine = [t for t in outcomes[req_id] if t.job.by_layer]
            if not mine:
                continue
            outcomes[req_id] = [t for t in outcomes[req_id] if not t.job.by_layer]
            if not outcomes[req_id]:
                del outcomes[req_id]
            for t in mine:
                self.checked["by_layer_loads"] += 1
                if t.completion is not None and t.completion.ok:
                    continue
                blocks = {b for op in t.job.ops for b in op.block_ids if b != SKIP}
                if not blocks <= invalid:
                    self.violation("failure_hidden",
                                   f"rank {rank}: the layer-by-layer load of {req_id} (job "
                                   f"{t.job.job_id}) failed ({t.outcome}) but blocks "
                                   f"{sorted(blocks - invalid)} were not reported in its step")

    def on_merged_report(self, kv: Any) -> None:
        if kv is None:
            return
        recving = set(kv.finished_recving or ())
        failed = set(getattr(kv, "failed_recving", None) or ())
        if kv.finished_sending:
            self.violation("stray_report",
                           f"finished_sending {sorted(kv.finished_sending)} reached vLLM")
        for req_id in sorted(recving):
            p = self.parked.pop(req_id, None)
            if p is None:
                self.violation("stray_report", f"finished_recving for {req_id} reached vLLM, "
                               "which is not waiting for it (stray or duplicate)")
                continue
            self.loads_reported += 1
            if req_id in failed:
                self.loads_failed_reported += 1
            if self.scheduler.requests.get(req_id) is not p.request:
                self.violation("stray_report", f"finished_recving for {req_id} reached vLLM "
                               "but that id now names another request")
            for s in self.rank_reported:
                s.discard(req_id)

    def _table(self, req_id: str, group: int) -> list[int]:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[group])

    def _blocks_of(self, req_id: str) -> set[int]:
        try:
            return set(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
        except Exception:
            return set()

    # -- copies (called by the transport) ----------------------------------------------------
    def on_submit(self, t: Transfer, slots: list[tuple[int, int]]) -> None:
        tr = self.transport
        assert tr is not None
        for s in slots:
            if t.kind in ("load", "verify"):
                if tr.saves_in_flight.get(s):
                    self.violation("load_before_all_ranks_wrote",
                                   f"rank {t.rank} load job {t.job.job_id} ({t.job.req_id}) reads "
                                   f"slot {s} while a save into it has not run on some rank")
            else:
                req = self.scheduler.requests.get(t.job.req_id)
                t.salt = getattr(req, "cache_salt", None) if req is not None else "<gone>"
                if tr.loads_in_flight.get(s):
                    self.violation("slot_overwritten_during_load",
                                   f"rank {t.rank} save job {t.job.job_id} writes slot {s} while "
                                   "a load still reads it (a pinned chunk was evicted?)")
                others = [j for j in tr.saves_in_flight.get(s, {}).values()
                          if j != t.job.job_id]
                if others:
                    self.violation("slot_double_write", f"rank {t.rank} save job {t.job.job_id} "
                                   f"writes slot {s} while another save into it is in flight")

    def on_save_submitted(self, t: Transfer) -> None:
        """A save reads whole, computed blocks of its request, consecutive in vLLM's block
        table from a chunk boundary, holding that request's prefix (checked on the bytes); a
        state object, the one block of exactly the chunk's end holding the state there."""
        req = self.scheduler.requests.get(t.job.req_id)
        if req is None:
            self.violation("save_wrong_blocks", f"rank {t.rank} save job {t.job.job_id} for "
                           f"{t.job.req_id}, which vLLM no longer knows")
            return
        tokens = list(req.all_token_ids)
        for op in t.job.ops:
            table = self._table(t.job.req_id, op.group)
            kind = self.scenario.groups[op.group]
            if kind == "mamba":
                self.checked["state_saves"] += 1
                self._check_state_save(t, op, table, tokens)
                continue
            if kind == "swa":
                self.checked["window_saves"] += 1
            if not self._check_kv_save(t, op, table, tokens):
                return

    def _check_kv_save(self, t: Transfer, op: Any, table: list[int], tokens: list[int]) -> bool:
        cache = self.runners[t.rank].cache
        idx = [table.index(b) if b in table and b != 0 else -1 for b in op.block_ids]
        bpc = len(op.block_ids)
        first = t.job.chunk * bpc  # the chunk the save claims to store
        if idx != list(range(first, first + bpc)):
            self.violation("save_wrong_blocks",
                           f"rank {t.rank} save job {t.job.job_id} ({t.job.req_id}) stores "
                           f"chunk {t.job.chunk} of group {op.group} from blocks {op.block_ids}, "
                           f"which are at positions {idx} of its block table {table}")
            return False
        end = (idx[-1] + 1) * BLOCK_SIZE
        chain = np.asarray(content.chain_of(tokens[:end]), dtype=np.uint64)
        for k, b in zip(idx, op.block_ids):
            bad = cache.mismatch(np.full(BLOCK_SIZE, b), np.arange(BLOCK_SIZE),
                                 chain[k * BLOCK_SIZE:(k + 1) * BLOCK_SIZE], op.group)
            if bad >= 0:
                self.violation("save_wrong_bytes",
                               f"rank {t.rank} save job {t.job.job_id} ({t.job.req_id}) "
                               f"reads block {b} of group {op.group} (position "
                               f"{k * BLOCK_SIZE + bad}), which does not hold its prefix's bytes")
                return False
        return True

    def _check_state_save(self, t: Transfer, op: Any, table: list[int],
                          tokens: list[int]) -> None:
        end = (t.job.chunk + 1) * self.scenario.chunk_tokens  # the chunk's boundary
        k = end // BLOCK_SIZE - 1
        where = table[k] if k < len(table) else None
        if op.block_ids != [where] or where in (None, 0):
            self.violation("save_wrong_state",
                           f"rank {t.rank} save job {t.job.job_id} ({t.job.req_id}) stores the "
                           f"state of group {op.group} at {end} tokens from blocks "
                           f"{op.block_ids}; that state is in block {where} (position {k}) of "
                           f"its table {table}")
            return
        chain = content.chain_of(tokens[:end])
        if not self.runners[t.rank].cache.state_matches(op.group, where, chain[-1]):
            self.violation("save_wrong_state",
                           f"rank {t.rank} save job {t.job.job_id} ({t.job.req_id}) stores "
                           f"block {where} of group {op.group} as the state at {end} tokens, "
                           "but it holds another state")

    def excused_blocks(self, step: int) -> set[int]:
        """Blocks a forward of ``step`` may read with wrong bytes: this step's layer-by-layer
        loads that some rank reports to recompute in this step (vLLM drops what the step
        computed for the requests holding them). kvtier refuses layer-by-layer loads under
        the AsyncScheduler, whose next step is scheduled before vLLM learns of them."""
        return set(self.recomputed.get(step, ()))

    def on_save_run(self, t: Transfer) -> None:
        cache = self.runners[t.rank].cache
        changed = [b for b, tag in t.snapshot.items() if cache.tag(b) != tag]
        if changed and self.excused_blocks(t.submitted):
            # computed in a step that read a recomputed layer-by-layer load: its rank's own
            # saves failed there (kvtier.worker.OffloadWorker.end_step), so this chunk is never
            # stored whole (every rank must write it); load_wrong_bytes guards that
            self.checked["saves_after_recomputed_loads"] += 1
        elif changed:
            self.violation("block_reused_during_save",
                           f"rank {t.rank} save job {t.job.job_id} ({t.job.req_id} chunk "
                           f"{t.job.chunk}) reads blocks {changed} that were rewritten after "
                           "it was submitted")

    def on_load_run(self, t: Transfer) -> None:
        req = self.scheduler.requests.get(t.job.req_id)
        if req is None:
            self.violation("load_into_foreign_block", f"rank {t.rank} load job {t.job.job_id} "
                           f"writes blocks of {t.job.req_id}, which vLLM already freed")
            return
        tokens = list(req.all_token_ids)
        tr = self.transport
        assert tr is not None
        parked = self.parked.get(t.job.req_id)
        boundary = parked.boundary if parked is not None and parked.request is req else None
        for op in t.ops_done:
            where = (t.rank, t.mover.slot_class[op.group], op.slot)
            if where not in tr.slot_salt:
                self.violation("load_wrong_bytes", f"rank {t.rank} load job {t.job.job_id} "
                               f"({t.job.req_id}) reads slot {where[1:]} no save ever wrote")
            elif tr.slot_salt[where] != req.cache_salt:
                self.violation("cross_tenant_load",
                               f"rank {t.rank} load job {t.job.job_id} ({t.job.req_id}, "
                               f"cache_salt {req.cache_salt!r}) reads slot {where[1:]} written "
                               f"for cache_salt {tr.slot_salt[where]!r}")
            table = self._table(t.job.req_id, op.group)
            if 0 in op.block_ids:
                self.violation("load_into_null_block",
                               f"rank {t.rank} load job {t.job.job_id} ({t.job.req_id}) writes "
                               f"vLLM's null block (group {op.group}, blocks {op.block_ids})")
                return
            kind = self.scenario.groups[op.group]
            if kind == "mamba":
                self.checked["state_loads"] += 1
                self._check_state_load(t, op, table, tokens, boundary)
                continue
            if kind == "swa":
                self.checked["window_loads"] += 1
            if not self._check_kv_load(t, op, table, tokens):
                return
        if t.outcome == "ok" and boundary is not None:
            self._check_states_complete(t, boundary)

    def _check_kv_load(self, t: Transfer, op: Any, table: list[int], tokens: list[int]) -> bool:
        cache = self.runners[t.rank].cache
        chain: np.ndarray | None = None
        for b in op.block_ids:
            if b == SKIP:
                continue
            if b not in table:
                self.violation("load_into_foreign_block",
                               f"rank {t.rank} load job {t.job.job_id} writes block {b}, "
                               f"not in {t.job.req_id}'s table {table} (group {op.group})")
                return False
            k = table.index(b)
            end = (k + 1) * BLOCK_SIZE
            if end > len(tokens):
                self.violation("load_wrong_bytes", f"rank {t.rank} load job {t.job.job_id} "
                               f"writes block {b} (index {k}) beyond {len(tokens)} tokens")
                return False
            if chain is None or len(chain) < end:
                chain = np.asarray(content.chain_of(tokens[:max(end, len(tokens))]),
                                   dtype=np.uint64)
            bad = cache.mismatch(np.full(BLOCK_SIZE, b), np.arange(BLOCK_SIZE),
                                 chain[k * BLOCK_SIZE:end], op.group)
            if bad >= 0:
                self.violation("load_wrong_bytes",
                               f"rank {t.rank} load job {t.job.job_id} ({t.job.req_id}, slot "
                               f"{op.slot}) wrote bytes into block {b} of group {op.group} "
                               f"(position {k * BLOCK_SIZE + bad}) that its prefix does not "
                               "produce")
        return True

    def _check_state_load(self, t: Transfer, op: Any, table: list[int], tokens: list[int],
                          boundary: int | None) -> None:
        (b,) = op.block_ids
        if b not in table:
            self.violation("load_into_foreign_block",
                           f"rank {t.rank} load job {t.job.job_id} writes state block {b}, "
                           f"not in {t.job.req_id}'s table {table} (group {op.group})")
            return
        k = table.index(b)
        end = (k + 1) * BLOCK_SIZE  # the state this block holds in align addressing
        if boundary is not None and end != boundary:
            self.violation("load_wrong_state",
                           f"rank {t.rank} load job {t.job.job_id} ({t.job.req_id}) writes the "
                           f"state of group {op.group} into block {b} (position {k}: the state "
                           f"at {end} tokens), but vLLM resumes it from {boundary} tokens")
            return
        chain = content.chain_of(tokens[:end])
        if not self.runners[t.rank].cache.state_matches(op.group, b, chain[-1]):
            self.violation("load_wrong_state",
                           f"rank {t.rank} load job {t.job.job_id} ({t.job.req_id}, slot "
                           f"{op.slot}) wrote a state into block {b} of group {op.group} that "
                           f"is not the state at {end} tokens")

    def _check_states_complete(self, t: Transfer, boundary: int) -> None:
        """A load restores the KV and the boundary's state together: every state group of
        the model gets its state, unless the request's own blocks already hold it (an HBM
        hit at the boundary)."""
        cache = self.runners[t.rank].cache
        req_id = t.job.req_id
        tokens = list(self.scheduler.requests[req_id].all_token_ids)
        chain = content.chain_of(tokens[:boundary])
        for g, kind in enumerate(self.scenario.groups):
            if kind != "mamba" or any(op.group == g for op in t.ops_done):
                continue
            table = self._table(req_id, g)
            k = boundary // BLOCK_SIZE - 1
            b = table[k] if k < len(table) else 0
            if b == 0 or not cache.state_matches(g, b, chain[-1]):
                self.violation("load_wrong_state",
                               f"rank {t.rank} load job {t.job.job_id} ({req_id}) to "
                               f"{boundary} tokens restored no state of group {g} (block {b} at "
                               f"position {k} does not hold it)")

    def wrong_read(self, rank: int, req_id: str, idx: int, block: int, nc: int,
                   tokens: list[int], group: int = 0) -> None:
        self.violation("wrong_kv_read",
                       f"rank {rank}: {req_id} reads position {idx} (block {block}, group "
                       f"{group}) of its {nc}-token context and finds bytes its prefix does "
                       "not produce")

    def wrong_state(self, rank: int, req_id: str, group: int, nc: int, pos: int,
                    block: int) -> None:
        what = "the null block" if block == 0 else f"block {block}, which holds another state"
        self.violation("wrong_state_read",
                       f"rank {rank}: {req_id} continues from {nc} tokens in state group "
                       f"{group} and finds {what} at position {pos} of its table")

    # -- the end -----------------------------------------------------------------------------
    def check_drained(self, connector: Any, aggregator: Any) -> None:
        s = self.scheduler
        problems = []
        if self.parked:
            problems.append(f"parked without report: {sorted(self.parked)}")
        if s.requests:
            problems.append(f"vLLM requests left: {sorted(s.requests)}")
        pool = s.kv_cache_manager.block_pool
        free = pool.get_num_free_blocks()
        if free != self.scenario.num_blocks - 1:
            problems.append(f"{self.scenario.num_blocks - 1 - free} KV blocks still referenced")
        tr = self.transport
        assert tr is not None
        for r in range(self.scenario.world_size):
            if tr.pending(r):
                problems.append(f"rank {r}: {tr.pending(r)} copies never ran")
            if tr.load_outcomes[r]:
                problems.append(f"rank {r}: loads never reported: {sorted(tr.load_outcomes[r])}")
            w = self.runners[r].worker
            if w._load_reqs:
                problems.append(f"rank {r}: worker still tracks loads {sorted(w._load_reqs)}")
            inflight = getattr(w, "_inflight", None)
            if inflight:
                problems.append(f"rank {r}: worker still has jobs in flight {sorted(inflight)}")
            if getattr(w, "_settled", None):
                problems.append(f"rank {r}: worker still waits for settled layer-by-layer "
                                f"loads {sorted(w._settled)}")
        if aggregator is not None and (aggregator._recv_remaining_count
                                       or getattr(aggregator, "_failed_recving_pending", None)):
            problems.append(f"aggregator holds partial reports {aggregator._recv_remaining_count}")
        sched = connector.scheduler_side.scheduler
        if connector.scheduler_side.requests:
            problems.append("connector still tracks requests "
                            f"{sorted(connector.scheduler_side.requests)}")
        if sched is not None:
            try:
                sched.check_drained()
            except AssertionError as e:
                problems.append(f"kvtier scheduler not drained: {e}")
            used, _total = sched.occupancy()
            stats = sched.index.stats()
            if used != stats.stored + stats.writing + stats.doomed:
                problems.append(f"{used} slots used but {stats.stored} chunks stored")
        if problems:
            self.violation("not_drained", "; ".join(problems))
