"""Recurrent state end to end on vLLM 0.32's CPU build: Qwen3-Next (gated delta-net + gated
full attention, kvtier.testing.seed_models' real cache geometry, 4 layers) in bfloat16 with
prefix caching on, which makes vLLM choose ``mamba_cache_mode="align"``: four KV-cache groups
(three state groups, one per delta-net layer, and one full-attention group), one block size
in every group (vLLM raises the attention block so that pages match: 1,152 tokens on the
Intel machines, 640 on an AMD EPYC).

The restore check covers the state: the fill pattern overwrites every KV and state tensor, the
state block of each boundary is checksummed through the worker's block table, and run B's
greedy tokens and top-5 logprobs must equal an HBM prefix-cache hit at the same boundary (run
C), this engine's own first computation (run A), and a cold recompute on an engine with prefix
caching off (run D) wherever vLLM's own hit equals D (``passed_where_vllm_is_exact`` of
:mod:`kvtier.testing.restore`). Where C differs from D, vLLM's two engine modes (prefix caching
on with ``align``, off) compute the prompt differently before any hit or restore, which no
connector can close: on CPUs with AVX-512 BF16 the GDN kernels do (tokens equal, logprobs not;
seen 2026-12-02, as on the H200 for this model), on CPUs without them C = D and B must equal
both.
Each prompt runs alone in C and B (and D): on CPUs with AMX or AVX-512 BF16, vLLM's kernels
are not batch-invariant, and a batch of two gave B and C other last bits. The negative
control skips the state objects of every load (the KV comes back) and must fail; a load that
fails recomputes to the same output.
"""

from __future__ import annotations

from typing import Any

import pytest

from kvtier.layout import GroupKind
from kvtier.testing.reference import Generated, cold_reference
from kvtier.testing.restore import handles, restore_check, sharpen_dummy_weights
from tests.e2e.conftest import greedy, make_llm, prompt, shutdown

pytestmark = pytest.mark.e2e

# The block size vLLM picks for every group in align mode (one chunk) depends on the CPU's
# attention kernels: 1,152 on the Intel (AMX) machines, 640 on an AMD EPYC (session 15). The
# prompts are sized from the larger; what a restore brings is taken from the engine's geometry.
C = 1152
ENGINE = dict(dtype="bfloat16", block_size=None, max_model_len=4096, enable_prefix_caching=True)
PROMPTS = {
    "two_chunks": prompt(2 * C + 5, seed=3),
    "one_chunk": prompt(C + 9, seed=4),
    "negative": prompt(2 * C + 7, seed=5),
    "failed_load": prompt(2 * C + 3, seed=6),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    from kvtier.testing.seed_models import qwen3_next

    return qwen3_next(str(tmp_path_factory.mktemp("qwen3-next")), layers=4)


BATCHES = (("two_chunks",), ("one_chunk",), ("negative",), ("failed_load",))  # as the checks run


@pytest.fixture(scope="module")
def cold(model_dir: str) -> dict[str, Generated]:
    """Run D for every prompt of this module, on its own engine (prefix caching off, no
    connector), stopped before the kvtier engine starts. Each batch as its check runs it:
    vLLM is not batch-invariant (one batch of all four prompts changed the last bits of one
    prompt's logprobs), so a reference must co-schedule the same requests."""
    from vllm import LLM

    llm = LLM(model=model_dir, load_format="dummy", skip_tokenizer_init=True,
              enforce_eager=True, dtype="bfloat16", max_model_len=4096, max_num_seqs=4, seed=0,
              enable_prefix_caching=False)
    out: dict[str, Generated] = {}
    try:
        sharpen_dummy_weights(llm)
        for names in BATCHES:
            out.update(zip(names, cold_reference(llm, [PROMPTS[n] for n in names], greedy())))
    finally:
        shutdown(llm)
    return out


@pytest.fixture(scope="module")
def engine(model_dir: str, cold: dict[str, Generated], shutdown_after: list[Any]) -> Any:
    llm = make_llm(model_dir, extra={"dram_size": "256MiB"}, **ENGINE)
    shutdown_after.append(llm)
    h = handles(llm)
    sharpen_dummy_weights(h)
    return h


def _check(engine: Any, cold: dict[str, Generated], *names: str,
           hit_controls: bool = False) -> Any:
    return restore_check(engine, [PROMPTS[n] for n in names], greedy(),
                         cold=[cold[n] for n in names], hit_controls=hit_controls,
                         one_at_a_time=True)


def test_four_groups_three_of_them_state_in_align_mode(engine: Any) -> None:
    config = engine.llm.llm_engine.vllm_config
    assert config.cache_config.mamba_cache_mode == "align"
    geo = engine.kvtier.geometry
    kinds = [g.kind for g in geo.groups]
    assert kinds.count(GroupKind.STATE) == 3 and kinds.count(GroupKind.FULL) == 1
    assert {g.block_size for g in geo.groups} == {geo.chunk_tokens}
    assert geo.chunk_tokens in (640, C), geo.chunk_tokens  # the two seen (above)
    layout = engine.worker_connector.worker_side.worker.layout
    for g in layout.groups:  # one state object per block: the delta-net layer's conv + ssm
        assert len(g.spec.layer_names) == 1 and g.bytes_per_block > 0


def test_restore_check_with_state_equals_hbm_hit_and_cold_recompute(
        engine: Any, cold: dict[str, Generated]) -> None:
    # one check per prompt: run A computes a check's prompts in one batch
    checks = [_check(engine, cold, name, hit_controls=True) for name in ("two_chunks", "one_chunk")]
    chunk = engine.kvtier.geometry.chunk_tokens
    # every whole chunk but one that would leave no token to compute
    want = [(len(PROMPTS[n]) - 1) // chunk * chunk for n in ("two_chunks", "one_chunk")]
    assert [r.restored_tokens for r in checks] == [r.expected_restored for r in checks] \
        == want, checks
    assert want[1] == chunk  # one chunk at least, whatever the CPU
    for res in checks:
        # the cold run D wherever vLLM's hit C equals it (module docstring)
        assert res.cold_checked and res.loads_failed == 0 and res.passed_where_vllm_is_exact
    for p in (p for res in checks for p in res.prompts):
        assert p.checksums_equal, p
        assert p.blocks_compared["state"] == 3 and p.blocks_compared["full"] >= 1, p
        assert p.tokens_equal and p.logprobs_equal, (p.tokens_b, p.tokens_c)
        assert p.tokens_equal_first and p.logprobs_equal_first, p  # run A, from nothing
        # C2 and CF (kvtier.testing.restore): with state groups sharing storage with the
        # attention group, filling around the cached blocks keeps what the hit reads
        assert p.hbm_hit_repeatable and p.hbm_hit_fill_equal, p
        assert p.tokens_equal_fill and p.logprobs_equal_fill, p


def test_negative_control_loads_without_state_objects_fail_the_check(
        engine: Any, cold: dict[str, Generated]) -> None:
    faults = engine.faults
    injected = faults.injected
    faults.skip_state_loads = True
    try:
        res = _check(engine, cold, "negative")
    finally:
        faults.skip_state_loads = False
        engine.llm.reset_prefix_cache()  # HBM now caches blocks computed from a wrong state
    (p,) = res.prompts
    assert faults.injected > injected
    assert res.restored_tokens == res.expected_restored  # the loads "succeeded"...
    assert p.blocks_compared["state"] == 3 and not p.checksums_equal  # ...the state did not
    # each output comparison sees it on its own, against either reference
    assert not p.logprobs_equal and not p.logprobs_equal_cold, p
    assert not p.logprobs_equal_first, p
    assert not res.passed


def test_a_failed_load_recomputes_to_the_same_output(
        engine: Any, cold: dict[str, Generated]) -> None:
    engine.faults.fail_loads = 1
    try:
        res = _check(engine, cold, "failed_load")
    finally:
        engine.faults.fail_loads = 0
    (p,) = res.prompts
    assert res.loads_failed == 1 and res.restored_tokens == 0
    assert p.tokens_equal and p.logprobs_equal, (p.tokens_b, p.tokens_c)
    assert p.tokens_equal_first and p.logprobs_equal_first, p  # run A, from nothing
    assert p.passed_where_vllm_is_exact, p  # = the cold run D wherever C = D (docstring)
    assert p.checksums_equal  # recomputed over the fill pattern: run A's KV and state again
