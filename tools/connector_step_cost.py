"""kvtier's connector hooks' host time per engine step, through vLLM's real scheduler, on CPU.

    .venv/bin/python tools/connector_step_cost.py [--requests 2] [--max-tokens 1500]

Runs the test harness (:mod:`tests.harness`: vLLM's ``AsyncScheduler``, kvtier's scheduler
side, workers on the harness's transport) over a few requests that decode for long, so
almost every step is a decode step with nothing to move, and prints per hook and role the
µs per engine step (wall time of each call, summed over the run, divided by the steps).
What a decode step costs kvtier's Python on both sides, where vLLM calls it every step
(the scheduler side's ``get_kv_connector_stats`` among them). For the worker half's own
time at the H200 geometry, per step kind, see ``tools/worker_step_profile.py``.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.vllm.connector import KvtierConnector
from tests.harness.cases import _base
from tests.harness.compat import quiet
from tests.harness.driver import Driver
from tests.harness.workload import FaultPlan, ReqSpec

HOOKS = ("build_connector_meta", "update_connector_output", "get_kv_connector_stats",
         "handle_preemptions", "bind_connector_metadata", "start_load_kv", "wait_for_save",
         "get_finished", "get_transfer_results", "get_block_ids_with_load_errors",
         "build_connector_worker_meta", "get_num_new_matched_tokens",
         "update_state_after_alloc", "request_finished_all_groups")


def _timed(seconds: Counter[tuple[str, str]]) -> None:
    """Wrap every hook of KvtierConnector to add its wall time to ``seconds[(hook, role)]``."""
    for name in HOOKS:
        hook = getattr(KvtierConnector, name)

        def wrapper(self: Any, *a: Any, _hook: Any = hook, _name: str = name,
                    **kw: Any) -> Any:
            t = time.perf_counter()
            try:
                return _hook(self, *a, **kw)
            finally:
                seconds[(_name, self.role.name)] += time.perf_counter() - t

        setattr(KvtierConnector, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=1500)
    args = p.parse_args()
    seconds: Counter[tuple[str, str]] = Counter()
    _timed(seconds)
    rng = random.Random(0)
    reqs = [ReqSpec(key=f"r{i}", req_id=f"r{i}", max_tokens=args.max_tokens, arrival=0,
                    prompt=[rng.randrange(1, 1000) for _ in range(args.prompt_len)])
            for i in range(args.requests)]
    sc = _base(0, reqs, FaultPlan(), num_blocks=400, max_steps=4 * args.max_tokens,
               chunk_tokens=256, dram_size=f"{256 * 4096 * 64}B", async_scheduling=True,
               v2_runner=True)
    with quiet():
        drv = Driver(sc)
        drv.run()
        drv.close()
    steps = drv.steps
    per_role: Counter[str] = Counter()
    print(f"{steps} engine steps; µs per step:")
    for (name, role), s in sorted(seconds.items(), key=lambda x: -x[1]):
        print(f"  {name:32s} {role:9s} {s / steps * 1e6:7.1f}")
        per_role[role] += s
    print("  total: " + ", ".join(f"{r} {s / steps * 1e6:.1f}" for r, s in per_role.items()))


if __name__ == "__main__":
    main()
