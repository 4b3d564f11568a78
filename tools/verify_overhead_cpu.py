"""What verified restores cost on a vLLM CPU engine: step time of save passes and restore
passes with ``verify_checksums`` on and off, alternating, in one in-process engine.

    flock /tmp/kvtier-heavy.lock python tools/verify_overhead_cpu.py [--rounds 6] [--chunks 6]

Each round takes fresh prompts (so their chunks are saved and restored under the same
setting), runs them once (computed: every chunk saved) and, after the HBM prefix cache is
reset, again (restored from kvtier), with the worker's verification switched on or off for
the whole round (the CPU engine reads ``ChunkMover.verify`` per job). Prints, per pass and
setting, the median of the pass's wall time (prompt in to last token out, transfers settled)
and of its busy steps (steps over 1 ms: a restore pass also spins through empty steps while
its load runs), and the relative differences. Test machinery only: it uses
``kvtier.testing`` and the in-process engine of ``tests/e2e``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _timed_steps(h: Any, prompts: list[list[int]], params: Any) -> list[float]:
    """Run the prompts to completion stepping the engine by hand: each step's seconds."""
    eng = h.llm.llm_engine
    for i, p in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": p}, params)
    steps = []
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t0)
    return steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=6, help="rounds per setting (alternating)")
    ap.add_argument("--chunks", type=int, default=6, help="whole chunks per prompt")
    ap.add_argument("--prompts", type=int, default=2, help="prompts per round")
    args = ap.parse_args()
    import tempfile

    from kvtier.testing.models import tiny_llama
    from kvtier.testing.restore import handles, settle, sharpen_dummy_weights
    from tests.e2e.conftest import greedy, make_llm, prompt

    model = tiny_llama(tempfile.mkdtemp(prefix="kvtier-verify-"))
    llm = make_llm(model, extra={"dram_size": "512MiB"})
    h = handles(llm)
    sharpen_dummy_weights(h)
    worker = h.worker_connector.worker_side.worker
    c = h.kvtier.geometry.chunk_tokens
    params = greedy(max_tokens=4, logprobs=0)
    times: dict[tuple[str, bool], list[float]] = {}
    walls: dict[tuple[str, bool], list[float]] = {}
    seed = 1000
    for r in range(2 * args.rounds):
        verify = r % 2 == 0
        worker.mover.verify = verify
        prompts = [prompt(args.chunks * c + 7, seed=seed + i) for i in range(args.prompts)]
        seed += args.prompts
        for what in ("save", "restore"):
            h.llm.reset_prefix_cache()
            before = h.kvtier.stats.loaded_tokens
            t0 = time.perf_counter()
            times.setdefault((what, verify), []).extend(_timed_steps(h, prompts, params))
            settle(h)
            walls.setdefault((what, verify), []).append(time.perf_counter() - t0)
        assert h.kvtier.stats.loaded_tokens > before, "nothing was restored"
    assert worker.checksum_failures == 0
    for what in ("save", "restore"):
        w_on, w_off = (statistics.median(walls[(what, v)]) for v in (True, False))
        busy = {v: [t for t in times[(what, v)] if t > 1e-3] for v in (True, False)}
        s_on, s_off = (statistics.median(busy[v]) for v in (True, False))
        print(f"{what:8s} pass: wall {w_on * 1e3:7.1f} ms on, {w_off * 1e3:7.1f} ms off "
              f"({(w_on / w_off - 1) * 100:+.1f} %); busy step {s_on * 1e3:6.2f} ms on, "
              f"{s_off * 1e3:6.2f} ms off ({(s_on / s_off - 1) * 100:+.1f} %); "
              f"{len(busy[True])}/{len(busy[False])} busy steps")


if __name__ == "__main__":
    main()
