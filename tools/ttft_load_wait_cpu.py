"""Why a restored prefix's TTFT on vLLM's CPU build was ~270 ms in-process: the worker's
idle-step wait (``OffloadWorker.idle_wait_s``, :meth:`kvtier.transfer.TransferEngine.wait`)
off and on, alternating, in one in-process engine. Prints one JSON object: per restored
request its TTFT and the engine steps it took, and how long its load's copy ran on the
transfer thread.

    python tools/ttft_load_wait_cpu.py [--prefixes 8]

Same model, prompts and settings as tools/store_ttft_cpu.py (three chunks restored per
request, one output token).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.e2e.conftest

import store_ttft_cpu as ttft

from kvtier import transfer
from kvtier.protocol import JobKind


def main() -> None:
    from kvtier.testing.models import tiny_llama
    from kvtier.worker import IDLE_WAIT_S
    from tests.e2e.conftest import shutdown

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=8)
    a = ap.parse_args()
    copies: list[float] = []
    run = transfer.ThreadedTransferEngine._run

    def timed(self: Any, kind: JobKind, job: Any) -> Any:
        c = run(self, kind, job)
        if kind is JobKind.LOAD:
            copies.append(c.seconds)
        return c

    transfer.ThreadedTransferEngine._run = timed  # type: ignore[method-assign]
    out: dict[str, Any] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        h = ttft.engine(tiny_llama(os.path.join(tmp, "model"), layers=4, hidden=512), None)
        try:
            worker = h.worker_connector.worker_side.worker
            pre = [ttft.tokens(3 * ttft.C, seed=100 + i) for i in range(a.prefixes)]
            for i, p in enumerate(pre):
                ttft.latency(h, p + ttft.tokens(37, 500 + i))
            h.llm.reset_prefix_cache()
            for i, p in enumerate(pre):
                mode = "off" if i % 2 == 0 else "on"
                worker.idle_wait_s = 0.0 if mode == "off" else IDLE_WAIT_S
                copies.clear()
                step0 = h.kvtier._step
                dt = ttft.latency(h, p + ttft.tokens(37, 900 + i))
                out[mode].append({"ttft_s": round(dt, 4), "engine_steps": h.kvtier._step - step0,
                                  "load_copy_s": [round(x, 4) for x in copies]})
            out["loaded_tokens"] = h.kvtier.stats.loaded_tokens
        finally:
            shutdown(h.llm)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
