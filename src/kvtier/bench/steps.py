"""Where an offline run's seconds go, step by step, and what each request did in each step.

:class:`StepRecorder` wraps methods of one in-process vLLM engine core (0.25.1 and 0.32: the
``EngineCore`` of ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` with one worker in the process) to time
them; it changes no argument and no result. Per engine step it records:

- ``step_s``: the whole step (``EngineCore.step_fn``);
- ``scheduler_s``: vLLM's scheduler Python (``schedule`` + ``update_from_output``), less the
  connector calls made inside them;
- ``connector_sched_s`` / ``connector_worker_s``: the KV connector's scheduler-side and
  worker-side methods (whatever connector runs: kvtier's, native's), less transfer waits;
- ``wait_s``: transfer waits inside the worker-side connector: kvtier's ``OffloadWorker``
  fence and drain (a save not yet done when the next forward would overwrite its blocks);
- ``forward_s``: the rest of the step (model runner: inputs, forward, sampling);
- ``recorder_s``: this recorder's own bookkeeping (reported, never part of another);
- ``tokens``: tokens scheduled; a step of 0 tokens with requests parked is a *parked step*
  (vLLM waits for loads and runs nothing), counted whole under ``parked_s``;
- per request: its phase in the step (:func:`phase`).

:func:`categories` turns the steps into the seconds-per-category table (summing to the wall
time with ``outside_s``, the LLM loop between steps), :func:`timelines` into per-request
phase seconds and park lengths, :func:`step_kinds` into wall seconds by kind of step
(comparable across configurations where the categories are not).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

SCHEDULER_SIDE = ("get_num_new_matched_tokens", "update_state_after_alloc",
                  "build_connector_meta", "update_connector_output", "request_finished",
                  "request_finished_all_groups", "take_events", "on_new_request")
WORKER_SIDE = ("bind_connector_metadata", "clear_connector_metadata", "handle_preemptions",
               "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
               "get_finished", "get_block_ids_with_load_errors", "build_connector_worker_meta")
PHASES = ("queued", "parked", "prefill", "decode")
STEP_KINDS = ("prefill", "decode", "parked", "idle")  # Step.kind
CATEGORIES = ("wait_s", "parked_s", "connector_sched_s", "connector_worker_s", "scheduler_s",
              "forward_s", "recorder_s", "outside_s")


@dataclass
class Step:
    t0: float = 0.0
    step_s: float = 0.0
    scheduler_s: float = 0.0
    connector_sched_s: float = 0.0
    connector_worker_s: float = 0.0
    wait_s: float = 0.0
    recorder_s: float = 0.0  # this recorder's own bookkeeping
    tokens: int = 0
    phases: dict[str, str] = field(default_factory=dict)  # request id -> phase

    @property
    def parked(self) -> bool:
        return self.tokens == 0 and "parked" in self.phases.values()

    @property
    def batch(self) -> int:
        """Requests that computed tokens in this step."""
        return sum(ph in ("prefill", "decode") for ph in self.phases.values())

    @property
    def kind(self) -> str:
        """``parked`` (see :attr:`parked`), ``idle`` (nothing computed), ``prefill`` (some
        request computed prompt tokens) or ``decode`` (every computing request decoded)."""
        if self.parked:
            return "parked"
        if self.tokens == 0:
            return "idle"
        return "prefill" if "prefill" in self.phases.values() else "decode"

    @property
    def forward_s(self) -> float:
        return max(0.0, self.step_s - self.scheduler_s - self.connector_sched_s
                   - self.connector_worker_s - self.wait_s - self.recorder_s)


def phase(status: str, scheduled: int, computed_before: int, prompt_tokens: int) -> str:
    """A request's phase in a step: ``parked`` (waiting for its KV load), ``prefill`` or
    ``decode`` (scheduled, before or after the end of its prompt), else ``queued``."""
    if status == "WAITING_FOR_REMOTE_KVS":
        return "parked"
    if scheduled > 0:
        return "prefill" if computed_before < prompt_tokens else "decode"
    return "queued"


class _Span:
    """Adds the seconds of each call to a field of the current step; nested spans of
    ``inner`` are subtracted from the outer one."""

    def __init__(self, rec: StepRecorder, attr: str) -> None:
        self.rec, self.attr = rec, attr

    def wrap(self, obj: Any, name: str) -> None:
        fn = getattr(obj, name, None)
        if fn is None or not callable(fn):
            return
        rec, attr = self.rec, self.attr

        def timed(*args: Any, **kwargs: Any) -> Any:
            outer = rec._nested
            rec._nested = 0.0
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t
                own = dt - rec._nested
                setattr(rec.cur, attr, getattr(rec.cur, attr) + own)
                rec._nested = outer + dt

        setattr(obj, name, timed)


class StepRecorder:
    """Install with :meth:`install` on the engine core and the worker's connector."""

    def __init__(self) -> None:
        self.steps: list[Step] = []
        self.cur = Step()
        self._nested = 0.0
        self.started = time.perf_counter()

    def install(self, engine_core: Any, worker_connector: Any = None, worker: Any = None
                ) -> None:
        sched = engine_core.scheduler
        self._observe_schedule(sched)  # inside the span: its own time is taken out of it
        for name in ("schedule", "update_from_output"):
            _Span(self, "scheduler_s").wrap(sched, name)
        conn = getattr(sched, "connector", None)
        if conn is not None:
            for name in SCHEDULER_SIDE:
                _Span(self, "connector_sched_s").wrap(conn, name)
        if worker_connector is not None:
            for name in WORKER_SIDE:
                _Span(self, "connector_worker_s").wrap(worker_connector, name)
        if worker is not None:
            for name in ("fence", "drain"):
                _Span(self, "wait_s").wrap(worker, name)
        step_fn = engine_core.step_fn

        def step(*args: Any, **kwargs: Any) -> Any:
            self.cur = Step(t0=time.perf_counter() - self.started)
            self._nested = 0.0
            t = time.perf_counter()
            try:
                return step_fn(*args, **kwargs)
            finally:
                self.cur.step_s = time.perf_counter() - t
                self.steps.append(self.cur)

        engine_core.step_fn = step

    def _observe_schedule(self, sched: Any) -> None:
        schedule = sched.schedule

        def observed(*args: Any, **kwargs: Any) -> Any:
            out = schedule(*args, **kwargs)
            t = time.perf_counter()
            self.cur.tokens = int(out.total_num_scheduled_tokens)
            n = out.num_scheduled_tokens
            for rid, req in sched.requests.items():
                k = int(n.get(rid, 0))
                self.cur.phases[rid] = phase(req.status.name, k, req.num_computed_tokens - k,
                                             req.num_prompt_tokens)
            dt = time.perf_counter() - t
            self.cur.recorder_s += dt
            self._nested += dt
            return out

        sched.schedule = observed

    def reset(self) -> None:
        self.steps = []
        self.started = time.perf_counter()


def categories(steps: Sequence[Step], wall_s: float) -> dict[str, float]:
    """Seconds per category over the run; they sum to ``wall_s`` (``outside_s`` is what no
    step holds). A parked step counts whole under ``parked_s``."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for s in steps:
        if s.parked:
            out["parked_s"] += s.step_s
            continue
        for name in ("wait_s", "connector_sched_s", "connector_worker_s", "scheduler_s",
                     "forward_s", "recorder_s"):
            out[name] += getattr(s, name)
    out["outside_s"] = max(0.0, wall_s - sum(s.step_s for s in steps))
    return out


def gap_table(cats: Mapping[str, Mapping[str, float]], walls: Mapping[str, float],
              floor: str) -> dict[str, dict[str, float]]:
    """Per configuration, each category's seconds minus the floor's (``floor``: the null-copy
    configuration), the wall gap, and how much of it the named categories explain."""
    base = cats[floor]
    out: dict[str, dict[str, float]] = {}
    for name, c in cats.items():
        row = {k: c[k] - base[k] for k in CATEGORIES}
        gap = walls[name] - walls[floor]
        named = sum(v for k, v in row.items() if k not in ("outside_s", "recorder_s"))
        row["wall_gap_s"] = gap
        row["explained"] = named / gap if abs(gap) > 1e-9 else 1.0
        out[name] = row
    return out


def timelines(steps: Sequence[Step]) -> dict[str, dict[str, Any]]:
    """Per request: seconds and steps in each phase, the step it first appeared in, first
    prefilled in (``first_prefill_step``) and was last seen in,
    and its parks' lengths in steps (consecutive parked steps, each park once)."""
    out: dict[str, dict[str, Any]] = {}
    last: dict[str, str] = {}
    for i, s in enumerate(steps):
        for rid, ph in s.phases.items():
            r = out.setdefault(rid, {**{p + "_s": 0.0 for p in PHASES},
                                     **{p + "_steps": 0 for p in PHASES},
                                     "parks": [], "first_step": i, "last_step": i,
                                     "start_s": s.t0})
            r[ph + "_s"] += s.step_s
            r[ph + "_steps"] += 1
            if ph == "prefill":
                r.setdefault("first_prefill_step", i)
            r["last_step"] = i
            r["end_s"] = s.t0 + s.step_s
            if ph == "parked":
                if last.get(rid) == "parked":
                    r["parks"][-1] += 1
                else:
                    r["parks"].append(1)
            last[rid] = ph
    return out


def park_steps(lines: Mapping[str, Mapping[str, Any]]) -> dict[int, int]:
    """How many parks lasted each number of steps (``{1: n}``: every park ended in the step
    after it started, the null-copy floor's condition)."""
    c: Counter[int] = Counter()
    for r in lines.values():
        c.update(r["parks"])
    return dict(sorted(c.items()))


def steps_json(steps: Iterable[Step]) -> list[dict[str, Any]]:
    return [{**asdict(s), "forward_s": s.forward_s, "parked": s.parked, "kind": s.kind,
             "batch": s.batch} for s in steps]


def step_kinds(steps: Sequence[Mapping[str, Any]], min_steps: int = 20) -> dict[str, Any]:
    """Wall seconds of the steps of each kind (``steps``: :func:`steps_json` rows), and the
    median seconds of a decode step per batch size with at least ``min_steps`` steps.

    Why: under vLLM's asynchronous scheduler a step's GPU work overlaps the next step's
    Python, so time moves between the forward and the connector categories with whatever
    blocks the host (a connector that waits on its copies makes the forward look shorter).
    A step's wall time does not move that way, and decode steps of one batch size do the
    same work in every configuration: those are the numbers to compare across them."""
    out: dict[str, Any] = {k: {"steps": 0, "seconds": 0.0} for k in STEP_KINDS}
    by_batch: dict[int, list[float]] = {}
    for s in steps:
        k = out[s["kind"]]
        k["steps"] += 1
        k["seconds"] += s["step_s"]
        if s["kind"] == "decode":
            by_batch.setdefault(s["batch"], []).append(s["step_s"])
    out["decode_median_s_by_batch"] = {
        b: statistics.median(v) for b, v in sorted(by_batch.items()) if len(v) >= min_steps}
    return out


def phase_totals(lines: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Mean seconds per request in each phase."""
    n = max(1, len(lines))
    return {p: sum(r[p + "_s"] for r in lines.values()) / n for p in PHASES}

