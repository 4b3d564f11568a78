"""A TP=2 engine with kvtier in a process of its own, for tests that kill it: it restores one
prompt, prints ``READY <engine id> <worker pids>`` and waits to be killed.

    python -m tests.e2e.tp2_engine MODEL_DIR
"""

from __future__ import annotations

import multiprocessing
import sys
import time

from tests.e2e.conftest import greedy, make_llm, prompt


def main(model: str) -> None:
    llm = make_llm(model, tensor_parallel_size=2, num_gpu_blocks_override=256)
    for _ in range(2):  # saved, then restored: the slab is in use
        llm.generate([{"prompt_token_ids": prompt(300, seed=3)}], greedy(), use_tqdm=False)
    engine_id = llm.llm_engine.vllm_config.kv_transfer_config.engine_id
    workers = " ".join(str(p.pid) for p in multiprocessing.active_children())
    print(f"READY {engine_id} {workers}", flush=True)
    time.sleep(3600)


if __name__ == "__main__":
    main(sys.argv[1])
