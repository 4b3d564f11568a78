"""Run one scenario: vLLM's real scheduler, kvtier's scheduler half, simulated workers.

The engine loop is EngineCore's: ``step`` (schedule -> execute -> update_from_output) for the
``Scheduler``, ``step_with_batch_queue`` (a queue of two batches: step N+1 is scheduled and
executed before step N's output is applied) for the ``AsyncScheduler``. With two ranks the
per-rank outputs go through vLLM's ``KVOutputAggregator`` (as the multiproc executor does,
each rank's connector output pickled on the way); with one they pass through unchanged (as
``UniProcExecutor`` does). Between steps the driver adds arriving requests, aborts, and calls
``reset_prefix_cache``. The oracle (:mod:`.oracle`) checks after every step.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import time
import traceback
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .compat import (
    KVOutputAggregator,
    RequestStatus,
    kv_cache_config,
    make_request,
    make_scheduler,
    quiet,
    vllm_config,
)
from .content import FIRST_TOKEN, VOCAB
from .oracle import Oracle, ViolationError
from .runner import FakeRunner
from .transport import Transport
from .workload import ReqSpec, Scenario


@dataclass
class Result:
    scenario: Scenario
    steps: int = 0
    violation: ViolationError | None = None
    faults: Counter = field(default_factory=Counter)
    counts: Counter = field(default_factory=Counter)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.violation is None

    def summary(self) -> str:
        v = f"VIOLATION {self.violation}" if self.violation else "ok"
        return f"[{self.scenario.describe()}] steps={self.steps} faults={dict(self.faults)} {v}"


class Driver:
    def __init__(self, sc: Scenario, extra: dict[str, Any] | None = None,
                 trace: Callable[[str], None] | None = None) -> None:
        self.sc = sc
        self.trace = trace
        self.rng = random.Random(sc.seed ^ 0xD21)
        self.cfg = vllm_config(sc, extra)
        self.kvc = kv_cache_config(sc)
        self.sched = make_scheduler(sc, self.cfg, self.kvc)
        # Model Runner V2 (the GPU default) gets resumed requests as new ones, full table
        self.sched.use_v2_model_runner = sc.v2_runner
        self.connector = self.sched.connector
        self.oracle = Oracle(sc)
        self.oracle.scheduler = self.sched
        self.transport = Transport(sc.world_size, sc.faults, sc.seed, self.oracle, trace)
        self.oracle.transport = self.transport
        self.runners: list[FakeRunner] = []
        for rank in range(sc.world_size):
            r = FakeRunner(rank, self.cfg, self.kvc, self.transport, self.oracle,
                           self.runners[0].worker.slab if self.runners else None)
            r.scheduler = self.sched
            self.runners.append(r)
        self.oracle.runners = self.runners
        self.transport.by_layer_loads_never_fail = self.runners[0].worker.layer_failures_fatal
        self.aggregator = KVOutputAggregator(sc.world_size) if sc.world_size > 1 else None
        self.pending: list[ReqSpec] = list(sc.requests)
        self.live: dict[str, tuple[ReqSpec, Any, int]] = {}  # key -> (spec, request, added)
        self.finished_at: dict[str, int] = {}
        self.clock = 0
        self.steps = 0
        self.counts: Counter[str] = Counter()
        self._filler = 0

    # -- workload events ---------------------------------------------------------------------
    def _events(self) -> None:
        sched = self.sched
        for step, running, connector in self.sc.resets:
            if step == self.clock:
                # vLLM raises if blocks stay held after preempting everything (parked
                # requests, aborted ones waiting for their load report): not supported there
                held = any(r.status != RequestStatus.RUNNING
                           and (r.num_computed_tokens > 0 or r.is_finished())
                           for r in sched.requests.values())
                try:
                    sched.reset_prefix_cache(reset_running_requests=running and not held,
                                             reset_connector=connector)
                except RuntimeError as e:  # EngineCore returns this to the caller, and serves on
                    if "Failed to reset KV cache" not in str(e):
                        raise
                    self.counts["reset_refused"] += 1
                self.counts["reset_kvtier" if connector else "reset_hbm"] += 1
        for spec, req, added in list(self.live.values()):
            if req.is_finished():
                continue
            abort = (spec.abort_after is not None and self.clock - added >= spec.abort_after) or (
                spec.abort_when_parked and req.status == RequestStatus.WAITING_FOR_REMOTE_KVS)
            if abort:
                sched.finish_requests([spec.req_id], RequestStatus.FINISHED_ABORTED)
                self.counts["aborted_parked" if spec.abort_when_parked else "aborted"] += 1
        still = []
        used_ids = {s.req_id for s, _, _ in self.live.values()}
        for spec in self.pending:
            ready = spec.arrival <= self.clock
            if spec.after is not None:
                done = self.finished_at.get(spec.after)
                ready = ready and done is not None and done + spec.gap <= self.clock
            if ready and spec.req_id not in used_ids and spec.req_id not in sched.requests:
                req = make_request(spec.req_id, spec.prompt, spec.max_tokens, spec.priority,
                                   spec.cache_salt, spec.skip_prefix_cache)
                sched.add_request(req)
                self.live[spec.key] = (spec, req, self.clock)
                used_ids.add(spec.req_id)
                if spec.recycles is not None:
                    self.counts["recycled_id"] += 1
            else:
                used_ids.add(spec.req_id)  # later specs with this id wait for this one
                still.append(spec)
        self.pending = still

    def _reap(self) -> None:
        for key, (spec, req, _) in list(self.live.items()):
            if self.sched.requests.get(spec.req_id) is not req:
                del self.live[key]
                self.finished_at[key] = self.clock

    def _filler_request(self) -> None:
        """Keep an engine busy until ``min_steps``: one more short request."""
        self._filler += 1
        rng = self.rng
        base = rng.choice(self.sc.requests).prompt
        prompt = base[: rng.randint(1, len(base))] + [rng.randrange(FIRST_TOKEN, VOCAB)
                                                      for _ in range(rng.randint(1, 40))]
        self.pending.append(ReqSpec(f"filler-{self._filler}", f"filler-{self._filler}",
                                    prompt[:300], rng.choice((2, 4, 8)), self.clock))

    # -- one engine step ---------------------------------------------------------------------
    def _schedule(self) -> Any:
        self.steps += 1
        self.oracle.step = self.steps
        so = self.sched.schedule()
        self.oracle.after_schedule()
        return so

    def _execute(self, so: Any) -> Any:
        self.transport.advance()
        self.counts["preemptions"] += len(getattr(so, "preempted_req_ids", None) or ())
        outs = [r.execute(so) for r in self.runners]
        if self.aggregator is None:
            return outs[0]
        for o in outs:
            o.kv_connector_output = pickle.loads(pickle.dumps(o.kv_connector_output))
        return self.aggregator.aggregate(outs, 0)

    def _update(self, so: Any, mro: Any) -> None:
        kv = mro.kv_connector_output
        if self.trace is not None:
            self.trace(
                f"update of step {self.steps}: scheduled {dict(so.num_scheduled_tokens)} "
                f"preempted {sorted(getattr(so, 'preempted_req_ids', None) or ())} finished "
                f"{sorted(so.finished_req_ids)} recving {sorted(kv.finished_recving or ()) if kv else []} "
                f"failed {sorted(getattr(kv, 'failed_recving', None) or ()) if kv else []}")
        self.oracle.on_merged_report(kv)
        self.sched.update_from_output(so, mro)
        self.oracle.after_update()
        if self.trace is not None:
            self.trace("  requests " + ", ".join(
                f"{k}:{v.status.name}@{v.num_computed_tokens}"
                for k, v in self.sched.requests.items()))

    def run(self) -> None:
        sc = self.sc
        queue: deque[tuple[Any, Any]] = deque()
        while True:
            self._events()
            busy = self.sched.has_requests()
            if not busy and not queue:
                if not self.pending and not self.live:
                    if self.steps >= sc.min_steps:
                        break
                    self._filler_request()
                self.clock += 1
                if self.clock > sc.max_steps * 2:
                    self.oracle.violation("not_drained", f"workload stuck: {len(self.pending)} "
                                          f"requests never admitted")
                continue
            if self.steps >= sc.max_steps:
                self.oracle.violation("not_drained", f"still busy after {self.steps} steps: "
                                      f"{sorted(self.sched.requests)} parked={sorted(self.oracle.parked)}")
            if not sc.async_scheduling:
                so = self._schedule()
                mro = self._execute(so)
                self._update(so, mro)
            else:
                if busy:
                    so = self._schedule()
                    mro = self._execute(so)
                    queue.appendleft((so, mro))
                    executed = so.total_num_scheduled_tokens > 0
                    if len(queue) < 2 and (executed or self.sched.has_requests()):
                        self.clock += 1
                        continue
                so, mro = queue.pop()
                self._update(so, mro)
            self._reap()
            self.clock += 1
        self.oracle.check_drained(self.connector, self.aggregator)

    def close(self) -> None:
        for r in self.runners:
            with contextlib.suppress(Exception):  # teardown must reach every rank
                r.close()

    def fault_counts(self) -> Counter[str]:
        out: Counter[str] = Counter(self.transport.injected)
        s = self.connector.scheduler_side.scheduler
        if s is not None:
            out["save_queue_full"] += s.stats.saves_dropped.get("save_queue_full", 0)
            out["slab_full"] += s.stats.saves_dropped.get("no_evictable_slot", 0)
        out["recycled_id"] += self.counts["recycled_id"]
        return +out

    def workload_counts(self) -> Counter[str]:
        out = Counter(self.counts)
        out.pop("recycled_id", None)
        s = self.connector.scheduler_side.scheduler
        if s is not None:
            st = s.stats
            out.update(loads_started=st.loads_started, loads_ok=st.loads_ok,
                       loads_failed=st.loads_failed, saves_committed=st.saves_committed,
                       saves_failed=st.saves_failed, fences=st.fences, hits=st.hits,
                       lookups=st.lookups)
            out.update({f"declined_{k}": v for k, v in st.declined.items()})
        admission = self.connector.scheduler_side.admission
        if admission is not None:
            out.update(admission.counters())
        out.update(self.oracle.checked)
        out["loads_reported"] = self.oracle.loads_reported
        out["max_parked_steps"] = self.oracle.max_parked_steps
        return +out


def run_scenario(sc: Scenario, extra: dict[str, Any] | None = None,
                 trace: Callable[[str], None] | None = None) -> Result:
    t0 = time.perf_counter()
    res = Result(sc)
    drv = None
    try:
        with quiet():
            drv = Driver(sc, extra, trace)
            drv.run()
    except ViolationError as e:
        res.violation = e
    except Exception as e:
        tb = traceback.format_exc(limit=12)
        res.violation = ViolationError("crash", f"{type(e).__name__}: {e}\n{tb}")
    finally:
        if drv is not None:
            res.steps = drv.steps
            res.faults = drv.fault_counts()
            res.counts = drv.workload_counts()
            drv.close()
    res.seconds = time.perf_counter() - t0
    return res
