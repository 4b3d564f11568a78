"""The offline bench's step accounting (kvtier.bench.steps): a request's phase per step, its
timeline and park lengths, the seconds per category summing to the wall time, the gap to
null-copy, and the recorder's timing of nested calls on real objects."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from kvtier.bench.steps import (
    CATEGORIES,
    Step,
    StepRecorder,
    categories,
    gap_table,
    park_steps,
    phase,
    timelines,
)


def test_a_requests_phase_in_a_step() -> None:
    assert phase("WAITING_FOR_REMOTE_KVS", 0, 0, 100) == "parked"
    assert phase("WAITING", 0, 0, 100) == "queued"
    assert phase("PREEMPTED", 0, 50, 100) == "queued"
    assert phase("RUNNING", 64, 0, 100) == "prefill"
    assert phase("RUNNING", 36, 64, 100) == "prefill"  # the prompt's last chunk
    assert phase("RUNNING", 1, 100, 100) == "decode"
    assert phase("RUNNING", 0, 100, 100) == "queued"  # running but not scheduled this step


def _steps() -> list[Step]:
    seq = [({"a": "prefill", "b": "queued"}, 10), ({"a": "decode", "b": "parked"}, 1),
           ({"b": "parked"}, 0), ({"b": "prefill"}, 5), ({"b": "parked"}, 0),
           ({"b": "decode"}, 1)]
    return [Step(t0=float(i), step_s=0.5, scheduler_s=0.1, connector_sched_s=0.05,
                 connector_worker_s=0.05, wait_s=0.01, tokens=tok, phases=ph)
            for i, (ph, tok) in enumerate(seq)]


def test_timelines_count_each_phase_and_each_park_once() -> None:
    lines = timelines(_steps())
    b = lines["b"]
    assert b["parks"] == [2, 1] and b["parked_steps"] == 3 and b["queued_steps"] == 1
    assert b["prefill_s"] == 0.5 and b["first_step"] == 0 and b["last_step"] == 5
    assert b["first_prefill_step"] == 3 and lines["a"]["first_prefill_step"] == 0
    assert lines["a"]["parks"] == [] and lines["a"]["end_s"] == 1.5
    assert park_steps(lines) == {1: 1, 2: 1}


def test_categories_sum_to_the_wall_and_parked_steps_count_whole() -> None:
    steps = _steps()
    cats = categories(steps, wall_s=3.5)
    assert set(cats) == set(CATEGORIES)
    assert abs(sum(cats.values()) - 3.5) < 1e-9
    assert cats["parked_s"] == 1.0  # steps 2 and 4: no tokens, a request parked
    assert abs(cats["forward_s"] - 4 * (0.5 - 0.21)) < 1e-9
    assert abs(cats["outside_s"] - 0.5) < 1e-9


def test_the_gap_to_the_floor_per_category() -> None:
    cats = {"floor": dict.fromkeys(CATEGORIES, 1.0), "x": dict.fromkeys(CATEGORIES, 1.0)}
    cats["x"]["parked_s"] = 1.9
    gap = gap_table(cats, {"floor": 7.0, "x": 8.0}, "floor")
    assert abs(gap["x"]["parked_s"] - 0.9) < 1e-9 and gap["x"]["wall_gap_s"] == 1.0
    assert abs(gap["x"]["explained"] - 0.9) < 1e-9
    assert gap["floor"]["explained"] == 1.0


class _Status:
    name = "RUNNING"


class _Req:
    status = _Status()
    num_computed_tokens = 8
    num_prompt_tokens = 16


class _Out:
    total_num_scheduled_tokens = 8
    num_scheduled_tokens: ClassVar[dict[str, int]] = {"r": 8}


class _Connector:
    def build_connector_meta(self, out: Any) -> None:
        time.sleep(0.02)


class _Scheduler:
    def __init__(self) -> None:
        self.connector = _Connector()
        self.requests = {"r": _Req()}

    def schedule(self) -> _Out:
        time.sleep(0.01)
        out = _Out()
        self.connector.build_connector_meta(out)
        return out

    def update_from_output(self, out: _Out, model_out: Any) -> None:
        time.sleep(0.01)


class _Core:
    def __init__(self) -> None:
        self.scheduler = _Scheduler()
        self.step_fn = self.step

    def step(self) -> None:
        out = self.scheduler.schedule()
        time.sleep(0.03)  # the forward
        self.scheduler.update_from_output(out, None)


def test_the_recorder_takes_nested_connector_time_out_of_the_scheduler() -> None:
    core = _Core()
    rec = StepRecorder()
    rec.install(core)
    core.step_fn()
    (s,) = rec.steps
    assert s.tokens == 8 and s.phases == {"r": "prefill"}
    assert 0.019 < s.connector_sched_s < 0.2
    assert 0.019 < s.scheduler_s < 0.2  # 10 + 10 ms, the connector's 20 ms taken out
    assert 0.029 < s.forward_s < 0.3
    assert abs(s.step_s - (s.scheduler_s + s.connector_sched_s + s.forward_s + s.recorder_s
                           + s.wait_s + s.connector_worker_s)) < 1e-6
