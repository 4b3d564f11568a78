"""One vLLM CPU engine attached to a node-wide store, in a process of its own, driven by JSON
lines on stdin (for tests that run several engines at once on one store).

    python -m tests.e2e.store_engine MODEL_DIR STORE_URL [--after-go]

``--after-go``: import vLLM, then wait for a ``GO`` line on stdin before building the engine
(a restart whose imports ran while the engine it replaces was still up; the engine itself,
and its attach to the store, come only after ``GO``). Prints ``READY`` once the engine serves, then answers each request line with one JSON line:

- ``{"prompt": [ids...]}``: generate 8 greedy tokens (top-5 logprobs), wait until kvtier has
  nothing in flight; answer ``tokens``, ``logprobs`` (``[[[id, logprob], ...] per token]``,
  floats exact through JSON), ``cached`` (vLLM's num_cached_tokens: HBM hit plus kvtier's
  load), ``loaded_tokens`` and ``saves_committed`` (kvtier's totals so far), ``store_up``;
- ``{"quit": true}``: stop the engine and exit.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from typing import Any

from kvtier.store.index import StoreIndex
from kvtier.testing.restore import generate, handles, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, shutdown


def answer(h: Any, prompt: list[int]) -> dict[str, Any]:
    out = generate(h, [prompt], greedy())[0]
    lp = [sorted([tok, v.logprob] for tok, v in step.items()) for step in out.outputs[0].logprobs]
    st, index = h.kvtier.stats, h.kvtier.index
    return {"tokens": list(out.outputs[0].token_ids), "logprobs": lp,
            "cached": out.num_cached_tokens, "loaded_tokens": st.loaded_tokens,
            "loads_failed": st.loads_failed, "saves_committed": st.saves_committed,
            "store_up": isinstance(index, StoreIndex) and index.up}


def main(model: str, url: str, after_go: bool = False) -> None:
    # answers go to the original stdout; everything else printed there (vLLM logs to
    # stdout too) goes to stderr, so the reader sees only READY and answer lines
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    if after_go:
        # the slow part of a start, before GO: importing vLLM, its engine core and worker
        for module in ("vllm.entrypoints.llm", "vllm.v1.engine.core",
                       "vllm.v1.worker.cpu_worker"):
            importlib.import_module(module)
        if sys.stdin.readline().strip() != "GO":
            return
    h = handles(make_llm(model, {"store_url": url}))
    sharpen_dummy_weights(h)
    print("READY", file=answers)
    for line in sys.stdin:
        msg = json.loads(line)
        if msg.get("quit"):
            break
        print(json.dumps(answer(h, msg["prompt"])), file=answers)
    shutdown(h.llm)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], after_go="--after-go" in sys.argv[3:])
