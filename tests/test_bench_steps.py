"""The offline bench's step accounting (kvtier.bench.steps): a request's phase per step, its
timeline and park lengths, the seconds per category summing to the wall time, the gap to
null-copy, and the recorder's timing of nested calls on real objects."""

from __future__ import annotations

import time
from typing import Any, ClassVar

from kvtier.bench.offline_report import step_kind_table
from kvtier.bench.steps import (
    CATEGORIES,
    Step,
    StepRecorder,
    categories,
    gap_table,
    park_steps,
    phase,
    step_kinds,
    steps_json,
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


def test_steps_by_kind_and_decode_step_time_by_batch() -> None:
    decodes = [Step(step_s=0.010 + i * 1e-4, tokens=2, phases={"a": "decode", "b": "decode"})
               for i in range(21)]
    decodes += [Step(step_s=0.5, tokens=1, phases={"a": "decode", "b": "queued"})] * 3
    rows = steps_json(_steps() + decodes
                      + [Step(step_s=0.2, tokens=0, phases={"c": "queued"})])
    assert [r["kind"] for r in rows[:6]] == ["prefill", "decode", "parked", "prefill",
                                            "parked", "decode"]
    assert rows[0]["batch"] == 1 and rows[6]["batch"] == 2
    kinds = step_kinds(rows)
    assert kinds["prefill"] == {"steps": 2, "seconds": 1.0}
    assert kinds["parked"] == {"steps": 2, "seconds": 1.0}
    assert kinds["idle"] == {"steps": 1, "seconds": 0.2}
    assert kinds["decode"]["steps"] == 2 + 21 + 3
    # batch 1 ran 5 times (< 20): no median; batch 2's is its middle step
    assert kinds["decode_median_s_by_batch"] == {2: 0.010 + 10e-4}
    # the report: batch sizes every configuration ran often enough, after a JSON round trip
    other = {**kinds, "decode_median_s_by_batch": {"2": 0.02, "3": 0.03}}
    table = step_kind_table({"x": [{"wall_s": 1.0, "step_kinds": kinds}],
                             "y": [{"wall_s": 2.0, "step_kinds": other}]})
    assert table[2] == "| prefill | 2, 1.000 | 2, 1.000 |"
    assert table[-1] == "| decode step at batch 2, median ms | 11.00 | 20.00 |"
    assert step_kind_table({"x": [{"wall_s": 1.0}]}) == []  # runs from before the field


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
