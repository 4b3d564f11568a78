"""kvtier bench and aiperf on the demo's shape (scripts/demo.sh, one pair's workload), each
against a fresh `kvtier serve` with kvtier on, aiperf replaying the demo's own requests in
order (written as words of make_tokenizer.py's tokenizer, one word per token id).

    PYTHONPATH=src .venv/bin/python bench/results/2026-12-01-aiperf-cpu/crosscheck.py OUT

Needs /tmp/aiperf-venv (python3 -m venv /tmp/aiperf-venv && /tmp/aiperf-venv/bin/pip install
aiperf). Writes OUT/summary.json and prints the comparison.
"""
from __future__ import annotations

import asyncio
import json
import os
import statistics
import subprocess
import sys
import time

import aiohttp

from kvtier.bench import scrape
from kvtier.bench.client import RequestSpec, send
from kvtier.bench.serving import free_port
from kvtier.bench.workloads import SharedPrefix, warmup_prompts
from kvtier.testing.models import tiny_llama
from kvtier.vllm import serve

HERE = os.path.dirname(os.path.abspath(__file__))
AIPERF = "/tmp/aiperf-venv/bin/aiperf"
PREFIX_LEN, SUFFIX, OSL, PREFIXES, REQUESTS, CONC = 8192, 256, 16, 8, 32, 4
BLOCKS = (PREFIX_LEN + SUFFIX + OSL + 31) // 32
HBM_BLOCKS = 4 * BLOCKS + BLOCKS // 8
MAX_LEN = (PREFIX_LEN + SUFFIX + OSL + 1023) // 1024 * 1024


def serve_args(model: str, port: int) -> list[str]:
    return [model, "--served-model-name", "tiny", "--load-format", "dummy", "--dtype",
            "float32", "--block-size", "32", "--enforce-eager", "--max-model-len",
            str(MAX_LEN), "--num-gpu-blocks-override", str(HBM_BLOCKS), "--max-num-seqs", "4",
            "--dram-size", "1GiB", "--host", "127.0.0.1", "--port", str(port)]


def server_ttft(before: scrape.Samples, after: scrape.Samples) -> dict[str, float | None]:
    d = scrape.delta(after, before)
    n = scrape.total(d, "vllm:time_to_first_token_seconds_count")
    s = scrape.total(d, "vllm:time_to_first_token_seconds_sum")
    return {"requests": n, "mean_ms": 1000 * s / n if n and s is not None else None}


async def warm(url: str) -> None:
    async with aiohttp.ClientSession() as session:
        for i, p in enumerate(warmup_prompts(2, 128, 0, 1000)):
            await send(session, url, "tiny", RequestSpec(-1 - i, p, 4, "warmup"),
                       time.perf_counter())


def with_server(out: str, name: str, model: str, body) -> dict:
    port = free_port()
    sa = serve.parse(serve_args(model, port))
    url = f"http://127.0.0.1:{port}"
    log_path = os.path.join(out, f"server-{name}.log")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    with open(log_path, "wb") as log:
        proc = serve.launch(sa, log, env=env)
        try:
            serve.wait_ready(url, proc, 900, log_path)
            return body(url)
        finally:
            serve.stop(proc)


def run_kvtier_bench(out: str, url: str) -> dict:
    before = asyncio.run(scrape.scrape(url))
    d = os.path.join(out, "kvtier-bench")
    subprocess.run([sys.executable, "-m", "kvtier.cli", "bench", "--url", url, "--model", "tiny",
                    "--workload", "shared-prefix", "--prompt-prefix-pool-size", str(PREFIXES),
                    "--prompt-prefix-length", str(PREFIX_LEN), "--isl", str(SUFFIX), "--osl",
                    str(OSL), "--concurrency", str(CONC), "--requests", str(REQUESTS),
                    "--seed", "0", "--no-progress", "--no-plot", "--out", d], check=True)
    after = asyncio.run(scrape.scrape_settled(url))
    res = json.load(open(os.path.join(d, "results.json")))["runs"][0]
    ttft = {r["index"]: r["ttft"] for r in res["requests"]}
    return {"ttft_s_by_index": ttft, "wall_s": res["summary"]["duration_s"],
            "server": server_ttft(before, after)}


def run_aiperf(out: str, url: str, requests: str, model: str) -> dict:
    asyncio.run(warm(url))  # the same 2 warm-up prompts kvtier bench sends
    before = asyncio.run(scrape.scrape(url))
    d = os.path.join(out, "aiperf")
    cmd = [AIPERF, "profile", "--model", "tiny", "--url", url, "--endpoint-type", "completions",
           "--streaming", "--tokenizer", model, "--input-file", requests,
           "--custom-dataset-type", "single_turn", "--dataset-sampling-strategy", "sequential",
           "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
           "--concurrency", str(CONC), "--request-count", str(REQUESTS),
           "--random-seed", "0", "--output-artifact-dir", d,
           "--ui", "none", "--export-level", "records"]
    with open(os.path.join(out, "aiperf-command.txt"), "w") as f:
        f.write(" ".join(cmd) + "\n")
    with open(os.path.join(out, "aiperf.log"), "wb") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    after = asyncio.run(scrape.scrape_settled(url))
    return {"server": server_ttft(before, after), "artifacts": d}


def write_requests(path: str) -> list[RequestSpec]:
    w = SharedPrefix(PREFIXES, PREFIX_LEN, SUFFIX, OSL, "round-robin", 0, 1000)
    specs = [w.next_request() for _ in range(REQUESTS)]
    with open(path, "w") as f:
        for s in specs:
            f.write(json.dumps({"text": " ".join(f"w{t}" for t in s.prompt),
                                "output_length": OSL}) + "\n")
    return specs


def main() -> None:
    out = os.path.abspath(sys.argv[1])
    os.makedirs(out, exist_ok=True)
    model = os.path.join(out, "model")
    tiny_llama(model, max_len=max(8192, MAX_LEN))
    subprocess.run(["/tmp/aiperf-venv/bin/python", os.path.join(HERE, "make_tokenizer.py"),
                    model], check=True)
    requests = os.path.join(out, "requests.jsonl")
    write_requests(requests)
    kb_path = os.path.join(out, "kvtier-bench.json")
    if not os.path.exists(kb_path):  # a rerun of the aiperf half keeps the bench half
        kb = with_server(out, "kvtier-bench", model, lambda url: run_kvtier_bench(out, url))
        with open(kb_path, "w") as f:
            json.dump(kb, f, indent=1)
    with open(kb_path) as f:
        kb = json.load(f)
    ap = with_server(out, "aiperf", model, lambda url: run_aiperf(out, url, requests, model))
    json.dump({"kvtier_bench": kb, "aiperf": ap}, open(os.path.join(out, "raw.json"), "w"),
              indent=1)
    print(json.dumps({"kvtier_bench_server": kb["server"], "aiperf_server": ap["server"],
                      "kvtier_bench_ttft_p50_ms": 1000 * statistics.median(
                          kb["ttft_s_by_index"].values())}, indent=1))


if __name__ == "__main__":
    main()
