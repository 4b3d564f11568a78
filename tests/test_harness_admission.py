"""Cache-aware admission (``cache_aware_admission``) through the real schedulers of vLLM 0.32
(this process) and 0.25.1 (a subprocess with its sources first on the path): the harness's
seeded scenarios, faults included, with admission on. Every scenario passes the oracle (the
restored content, no lost or hung request, every request finished), so deferrals never
starve a request or corrupt a restore, and deferrals happen."""

from __future__ import annotations

import dataclasses

from _harness_runs import finish_025, report, start_025
from harness.run import run_batch, scenarios

N = 40


def _check(summary: dict) -> None:
    lines = [f"{v['kind']}: {v['scenario']}\n    {v['detail'][:1500]}"
             for v in summary["violations"][:5]]
    assert not summary["violations"], "\n".join(lines)
    assert summary["scenarios"] == N
    counts = summary["counts"]
    assert counts.get("admission_deferred", 0) > 0, counts  # admission acted
    assert counts.get("loads_ok", 0) > 0 and counts.get("hits", 0) > 0


def test_admission_on_through_both_vllm_schedulers() -> None:
    proc = start_025(N, 500, "--admission")
    batch = run_batch(dataclasses.replace(sc, admission_defers=True)
                      for sc in scenarios(N, 500))
    summary = batch.to_json()
    report("vllm032-admission", summary)
    _check(summary)
    summary_025 = finish_025(proc, timeout=1800)
    report("vllm025-admission", summary_025)
    _check(summary_025)
