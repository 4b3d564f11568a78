"""TTFT of first-seen and repeated-prefix requests on vLLM's CPU build, per configuration, in
alternating rounds: agent sessions (``kvtier.bench.workloads.AgentSessions``) driven closed-
loop on one in-process engine, one engine process per run.

    flock /tmp/kvtier-heavy.lock python tools/first_seen_ttft_cpu.py --rounds 3 \\
        --configs none,kvtier,kvtier-null-copy --out /tmp/ttft

Configurations: ``none`` (no connector: vLLM's prefix cache only), ``kvtier``,
``kvtier-null-copy`` (kvtier's decisions, no byte moved: :mod:`kvtier.testing.null_copy`),
``kvtier-no-loads`` (kvtier saving only, every hit declined: what a first-seen request pays
for the saves alone). TTFT is from ``add_request`` to the end of the step whose output holds
the request's first token (no HTTP, no tokenizer). Per request it also records the steps it
waited before its first scheduled step, the steps it prefilled in and the steps' seconds;
per run the worker connector's and the scheduler connector's seconds in the steps that
prefilled a first-seen request (:class:`kvtier.bench.steps.StepRecorder`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

CONFIGS = ("none", "kvtier", "kvtier-null-copy", "kvtier-no-loads")


def engine(args: argparse.Namespace) -> Any:
    from vllm import EngineArgs, LLMEngine
    from vllm.config import KVTransferConfig

    from kvtier.testing.models import tiny_llama

    model = tiny_llama(os.path.join(args.model_root, "kvtier-ttft-tiny"), max_len=8192)
    kw: dict[str, Any] = dict(
        model=model, dtype="float32", block_size=32, load_format="dummy",
        skip_tokenizer_init=True, seed=0, enforce_eager=True, max_model_len=4096,
        num_gpu_blocks_override=args.hbm_blocks, max_num_batched_tokens=2048,
        max_num_seqs=args.concurrency, enable_prefix_caching=True)
    if args.config != "none":
        null = args.config == "kvtier-null-copy"
        extra: dict[str, Any] = {"dram_size": "1GiB"}
        if args.config == "kvtier-no-loads":
            extra["max_pending_loads"] = 1  # below any hit's chunks: every hit declined
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="NullCopyConnector" if null else "KvtierConnector",
            kv_connector_module_path="kvtier.testing.null_copy" if null
            else "kvtier.vllm.connector",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config=extra)
    return LLMEngine.from_engine_args(EngineArgs(**kw))


def run(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import SamplingParams

    from kvtier.bench import steps as st
    from kvtier.bench.workloads import AgentSessions

    eng = engine(args)
    core = eng.engine_core.engine_core
    rec = st.StepRecorder()
    from vllm.distributed.kv_transfer.kv_transfer_state import (
        get_kv_transfer_group,
        has_kv_transfer_group,
    )
    wconn = get_kv_transfer_group() if has_kv_transfer_group() else None
    rec.install(core, wconn, getattr(getattr(wconn, "worker_side", None), "worker", None))
    wl = AgentSessions(sessions=args.sessions, turns=args.turns, first_len=args.first_len,
                       tool_len=args.tool_len, message_len=args.message_len,
                       output_len=args.output_len, seed=args.seed, vocab=1000)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, detokenize=False,
                            temperature=0.0)
    # warm-up on an unrelated prompt, not timed
    eng.add_request("warm", {"prompt_token_ids": list(range(3, 515))}, params)
    while eng.has_unfinished_requests():
        eng.step()
    rec.reset()
    live: dict[str, dict[str, Any]] = {}
    done: list[dict[str, Any]] = []
    issued = 0
    t_start = time.perf_counter()
    while len(done) < args.requests:
        while len(live) < args.concurrency and issued < args.requests:
            spec = wl.next_request()
            if spec is None:
                break
            rid = f"r{spec.index}"
            eng.add_request(rid, {"prompt_token_ids": spec.prompt}, params)
            live[rid] = {"spec": spec, "t0": time.perf_counter(), "step0": len(rec.steps)}
            issued += 1
        for out in eng.step():
            r = live.get(out.request_id)
            if r is None:
                continue
            if "ttft_s" not in r and out.outputs and out.outputs[0].token_ids:
                r["ttft_s"] = time.perf_counter() - r["t0"]
                r["first_step"] = len(rec.steps)
            if out.finished:
                spec = r["spec"]
                wl.complete(spec, list(out.outputs[0].token_ids), len(out.outputs[0].token_ids))
                done.append({"index": spec.index, "turn": spec.turn,
                             "reuse": spec.reuse_tokens, "prompt": len(spec.prompt),
                             "ttft_s": r["ttft_s"], "cached": out.num_cached_tokens or 0,
                             "steps": [r["step0"], r["first_step"]]})
                del live[out.request_id]
    wall = time.perf_counter() - t_start
    steps = rec.steps
    return {"config": args.config, "wall_s": wall, "requests": done,
            "steps": [{"step_s": s.step_s, "tokens": s.tokens,
                       "connector_worker_s": s.connector_worker_s,
                       "connector_sched_s": s.connector_sched_s, "wait_s": s.wait_s,
                       "parked": s.parked} for s in steps]}


def summary(res: dict[str, Any]) -> dict[str, Any]:
    first = [r for r in res["requests"] if r["reuse"] == 0]
    rep = [r for r in res["requests"] if r["reuse"] > 0]
    steps = res["steps"]

    def span(r: dict[str, Any], key: str) -> float:
        a, b = r["steps"]
        return sum(s[key] for s in steps[a:b])

    def med(xs: list[float]) -> float:
        return statistics.median(xs) if xs else float("nan")

    return {"config": res["config"], "wall_s": res["wall_s"],
            "first_n": len(first), "repeat_n": len(rep),
            "ttft_first_p50_ms": 1e3 * med([r["ttft_s"] for r in first]),
            "ttft_repeat_p50_ms": 1e3 * med([r["ttft_s"] for r in rep]),
            "first_steps_p50": med([r["steps"][1] - r["steps"][0] for r in first]),
            "first_worker_ms_p50": 1e3 * med([span(r, "connector_worker_s") for r in first]),
            "first_sched_ms_p50": 1e3 * med([span(r, "connector_sched_s") for r in first]),
            "first_wait_ms_p50": 1e3 * med([span(r, "wait_s") for r in first]),
            "cached_first": sum(r["cached"] for r in first),
            "cached_repeat": sum(r["cached"] for r in rep)}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--first-len", type=int, default=2048)
    p.add_argument("--tool-len", type=int, default=256)
    p.add_argument("--message-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--hbm-blocks", type=int, default=220)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-root", default="/tmp")


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--config", choices=CONFIGS)
    p.add_argument("--configs", default="none,kvtier,kvtier-null-copy")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="/tmp/kvtier-ttft")
    add_arguments(p)
    args = p.parse_args()
    if args.config:  # one engine run, in this process
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        res = run(args)
        with open(os.path.join(args.out, f"{args.config}-r{args.seed}.json"), "w") as f:
            json.dump(res, f)
        print(json.dumps(summary(res)), flush=True)
        return 0
    os.makedirs(args.out, exist_ok=True)
    configs = args.configs.split(",")
    passthrough = ["--out", args.out]
    for k in ("sessions", "turns", "first_len", "tool_len", "message_len", "output_len",
              "requests", "concurrency", "hbm_blocks", "model_root"):
        passthrough += ["--" + k.replace("_", "-"), str(getattr(args, k))]
    rows = []
    for r in range(args.rounds):
        for c in (configs if r % 2 == 0 else configs[::-1]):
            cmd = [sys.executable, __file__, "--config", c, *passthrough, "--seed", str(r)]
            env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1")
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
            line = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
            if proc.returncode or not line.startswith("{"):
                print(f"{c} round {r} failed:\n{proc.stderr[-2000:]}", file=sys.stderr)
                continue
            row = {"round": r, **json.loads(line)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "rows.json"), "w") as f:
        json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
