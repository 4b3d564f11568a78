"""What verified restores cost on a vLLM CPU engine: step time of save passes and restore
passes with ``verify_checksums`` on and off, alternating, in one in-process engine.

    flock /tmp/kvtier-heavy.lock python tools/verify_overhead_cpu.py [--rounds 6] [--chunks 6]

Each round takes fresh prompts (so their chunks are saved and restored under the same
setting), runs them once (computed: every chunk saved) and, after the HBM prefix cache is
reset, again (restored from kvtier), with the worker's verification switched on or off for
the whole round (the CPU engine reads ``ChunkMover.verify`` per job). Prints the median step
time of each pass and setting and the relative difference. Test machinery only: it uses
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
    seed = 1000
    for r in range(2 * args.rounds):
        verify = r % 2 == 0
        worker.mover.verify = verify
        prompts = [prompt(args.chunks * c + 7, seed=seed + i) for i in range(args.prompts)]
        seed += args.prompts
        h.llm.reset_prefix_cache()
        times.setdefault(("save", verify), []).extend(_timed_steps(h, prompts, params))
        settle(h)
        h.llm.reset_prefix_cache()
        before = h.kvtier.stats.loaded_tokens
        times.setdefault(("restore", verify), []).extend(_timed_steps(h, prompts, params))
        settle(h)
        assert h.kvtier.stats.loaded_tokens > before, "nothing was restored"
    assert worker.checksum_failures == 0
    for what in ("save", "restore"):
        on = statistics.median(times[(what, True)])
        off = statistics.median(times[(what, False)])
        print(f"{what:8s} passes: median step {on * 1e3:7.2f} ms verify on, "
              f"{off * 1e3:7.2f} ms off ({(on / off - 1) * 100:+.1f} %), "
              f"{len(times[(what, True)])}/{len(times[(what, False)])} steps")


if __name__ == "__main__":
    main()
