"""tools/gpu_seed_check.py without an engine: its prompts and the engine arguments of its
runs. The tool itself ran on vLLM 0.32's CPU build with Qwen3-Next (``--cpu``) and on the
H200 (bench/results/)."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from _tools import load_tool


def _tool() -> ModuleType:
    return load_tool("gpu_seed_check")


def test_prompts_cover_three_chunks_and_a_shared_two_chunk_prefix() -> None:
    tool = _tool()
    p = tool.prompts_for(1888, 4096)
    (long,) = p["long"]
    a, b = p["shared_batch"]
    assert len(long) == 3 * 1888 + 5 and a[:2 * 1888] == b[:2 * 1888]
    assert a[2 * 1888] != b[2 * 1888] or a[2 * 1888 + 1] != b[2 * 1888 + 1]
    assert all(100 <= t < 4096 for t in long + a + b)


def test_shared_prompts_end_a_few_tokens_past_whole_chunks() -> None:
    """Run C hits vLLM's HBM cache in whole blocks, run B restores whole chunks: with a tail
    shorter than any block both stop at the same boundary (a half-chunk tail made C hit
    blocks past it, so C computed fewer tokens than B). Each check has tokens of its own,
    so each one's run A computes instead of loading an earlier check's chunks."""
    tool = _tool()
    chunk = 1024
    p = tool.prompts_for(chunk, 4096)
    assert set(p) == set(tool.CHECKS) and set(tool.VERDICT) <= set(tool.CHECKS)
    assert {"shared_single"} == tool.ONE_AT_A_TIME
    for name in ("shared_single", "shared_batch"):
        a, b = p[name]
        assert a[:2 * chunk] == b[:2 * chunk] and a[2 * chunk] != b[2 * chunk]
        for q in (a, b):
            tail = len(q) - (len(q) - 1) // chunk * chunk
            assert (len(q) - 1) // chunk == 3 and 0 < tail < 16  # 16: vLLM's smallest block
    firsts = [q[0] for n in tool.CHECKS for q in p[n][:1]]
    assert len(set(firsts)) == len(firsts)


def test_the_cold_run_has_prefix_caching_off_and_no_connector(tmp_path: Path) -> None:
    tool = _tool()
    args = tool.argparse.Namespace(arch="kimi_linear", max_model_len=8192, eager=False,
                                   cpu=False, gpu_mem=0.3, dram="4GiB", chunk=1888)
    cold = tool.engine_kwargs(args, str(tmp_path), "cold")
    kv = tool.engine_kwargs(args, str(tmp_path), "kvtier")
    assert cold["enable_prefix_caching"] is False and "kv_transfer_config" not in cold
    assert kv["enable_prefix_caching"] is True
    assert kv["kv_transfer_config"].kv_connector == "ProbeConnector"
    extra = kv["kv_transfer_config"].kv_connector_extra_config
    assert extra["cost_model"] is False and extra["chunk_tokens"] == 1888
    # a state family's cold steps end where the cached runs' do (the long prompt's 3 chunks),
    # and both engines have the same budget (the compile range and graph sizes follow it)
    assert cold["max_num_batched_tokens"] == kv["max_num_batched_tokens"] == 3 * 1888
    args.arch = "deepseek_v32"
    assert tool.engine_kwargs(args, str(tmp_path), "kvtier")["max_num_batched_tokens"] == 8192


def _selected_tokens(arch: str, folder: Path) -> int:
    """How many tokens the seed's indexer lets a query attend, from its written config."""
    from kvtier.testing.seed_models import SEED_MODELS

    cfg = json.loads((Path(SEED_MODELS[arch].write(str(folder))) / "config.json").read_text())
    if "text_config" in cfg:  # MiniMax-M3: top-k blocks of the sparse block size
        sparse = cfg["text_config"]["sparse_attention_config"]
        return sparse["sparse_topk_blocks"] * sparse["sparse_block_size"]
    return cfg["index_topk"]


def test_sparse_prompts_outgrow_the_indexers_top_k(tmp_path: Path) -> None:
    """At 773 tokens DSA attends every key (top-2,048) and the indexer control could change
    only checksums (H200, 2026-12-01): every prompt of the sparse seeds' checks (the long one
    and both shared ones) must exceed what the indexer selects, and each chunk must be whole
    blocks of the seed's block size."""
    tool = _tool()
    for arch, block in (("deepseek_v32", 64), ("glm_moe_dsa", 64), ("minimax_m3", 128)):
        chunk = tool.GPU_CHUNKS[arch]
        assert chunk % block == 0
        prompts = tool.prompts_for(chunk, 4096)
        selected = _selected_tokens(arch, tmp_path / arch)
        assert selected == 2048
        assert all(len(p) > selected for p in prompts["long"] + prompts["shared_batch"]), arch


def test_a_child_writes_its_result_where_the_driver_waits_for_it(tmp_path: Path) -> None:
    """The chunk probe waited for ``<arch>_probe.json`` while its child wrote
    ``<arch>_kvtier.json`` (H200, 2026-12-01: "no chunk size" after a probe that ran): the
    driver now names the file in the child's arguments."""
    tool = _tool()
    path = str(tmp_path / "x_probe.json")
    args = tool.argparse.Namespace(arch="x", out=str(tmp_path), model_root=str(tmp_path),
                                   dram="1GiB", max_model_len=64, gpu_mem=0.1, chunk=0,
                                   timeout=1, cpu=False, eager=False)
    argv: list[list[str]] = []

    class Recorded:
        def __init__(self, a: list[str], **_: object) -> None:
            argv.append(a)

    real = tool.subprocess.Popen
    tool.subprocess.Popen = Recorded  # type: ignore[misc]
    try:
        _, got, _ = tool.spawn(args, "kvtier", None, path, "")
    finally:
        tool.subprocess.Popen = real  # type: ignore[misc]
    (a,) = argv
    assert got == path and a[a.index("--result") + 1] == path


def test_draft_models_tails_are_longer_than_the_decode_threshold() -> None:
    """With 3 draft tokens an MLA step of at most 4 tokens runs the decode kernel: the MTP
    seed's 3-token tail made run B's last step a decode-kernel step while run C (vLLM drops
    the last block of a draft model's hit) computed a block and the tail through the prefill
    kernel (H200, 2026-12-02: logprobs differed with every restored byte equal). Every tail
    of a draft model's prompts is longer than 1 + its draft tokens, and still shorter than a
    block, so C's hit and B's restore end at the same block boundary when no draft model
    runs; without drafts the prompts are the ones every earlier run used."""
    tool = _tool()
    assert tool.spec_tokens("deepseek_v3_mtp") == 3 and tool.spec_tokens("kimi_linear") == 0
    chunk = tool.GPU_CHUNKS["deepseek_v3_mtp"]
    p = tool.prompts_for(chunk, 4096, tool.spec_tokens("deepseek_v3_mtp"))
    for q in p["long"] + p["shared_single"] + p["shared_batch"]:
        tail = len(q) - 3 * chunk
        assert 1 + 3 < tail < 16, tail
    plain = tool.prompts_for(chunk, 4096)
    assert [len(q) - 3 * chunk for q in plain["long"] + plain["shared_single"]] == [5, 7, 3]
    assert plain == tool.prompts_for(chunk, 4096, 0)
