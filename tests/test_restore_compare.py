"""The restore check's output comparisons (kvtier.testing.restore.same_tokens / same_logprobs)
on vLLM's own output types, built the way the engine builds them (list and flat logprobs):
each comparison must see a difference in its half alone, whatever the other half says."""

from __future__ import annotations

import math
from typing import Any

import pytest

pytest.importorskip("vllm")

from vllm.logprobs import append_logprobs_for_next_position, create_sample_logprobs
from vllm.outputs import CompletionOutput, RequestOutput

from kvtier.testing.restore import same_logprobs, same_tokens

# per generated position: (sampled token, its rank, top-k token ids, their logprobs)
Step = tuple[int, int, list[int], list[float]]
BASE: list[Step] = [
    (11, 1, [11, 7, 3], [-0.25, -1.5, -2.75]),
    (7, 1, [7, 12, 5], [-0.125, -2.0, -3.0]),
    (40, 2, [9, 40, 2], [-0.5, -0.75, -4.0]),
]


def output(steps: list[Step], flat: bool, tokens: list[int] | None = None) -> Any:
    """A RequestOutput with one completion whose logprobs vLLM's own helper appended."""
    lps = create_sample_logprobs(flat_logprobs=flat)
    for tok, rank, ids, vals in steps:
        append_logprobs_for_next_position(lps, [tok, *ids], [vals[ids.index(tok)], *vals],
                                          [None] * (len(ids) + 1), rank, len(ids))
    toks = tokens if tokens is not None else [s[0] for s in steps]
    comp = CompletionOutput(index=0, text="", token_ids=toks, cumulative_logprob=None,
                            logprobs=lps)
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[1, 2, 3],
                         prompt_logprobs=None, outputs=[comp], finished=True)


def with_step(i: int, step: Step) -> list[Step]:
    out = list(BASE)
    out[i] = step
    return out


FLAT = pytest.mark.parametrize("flat", [False, True], ids=["list", "flat"])


@FLAT
def test_identical_outputs_compare_equal(flat: bool) -> None:
    a, b = output(BASE, flat), output(BASE, flat)
    assert same_tokens(a, b) and same_logprobs(a, b)


@FLAT
def test_a_one_ulp_logprob_difference_with_equal_tokens_is_seen(flat: bool) -> None:
    tok, rank, ids, vals = BASE[1]
    nudged = [vals[0], math.nextafter(vals[1], 0.0), vals[2]]  # an alternative's value only
    a, b = output(BASE, flat), output(with_step(1, (tok, rank, ids, nudged)), flat)
    assert same_tokens(a, b)
    assert not same_logprobs(a, b)


@FLAT
def test_a_different_alternative_in_the_top_k_is_seen(flat: bool) -> None:
    tok, rank, ids, vals = BASE[2]
    other = [*ids[:2], 6]  # the last alternative replaced, every value as it was
    a, b = output(BASE, flat), output(with_step(2, (tok, rank, other, vals)), flat)
    assert same_tokens(a, b)
    assert not same_logprobs(a, b)


@FLAT
def test_swapped_ranks_of_two_alternatives_are_seen(flat: bool) -> None:
    tok, rank, ids, vals = BASE[0]
    swapped = (tok, rank, [ids[0], ids[2], ids[1]], [vals[0], vals[2], vals[1]])
    a, b = output(BASE, flat), output(with_step(0, swapped), flat)  # same token -> value
    assert same_tokens(a, b)
    assert not same_logprobs(a, b)


@FLAT
def test_different_tokens_with_equal_logprobs_are_seen(flat: bool) -> None:
    a = output(BASE, flat)
    b = output(BASE, flat, tokens=[11, 7, 9])  # the logprobs as in a, the last token not
    assert same_logprobs(a, b)
    assert not same_tokens(a, b)
    assert not same_tokens(a, output(BASE[:2], flat))  # a shorter output differs too


def test_outputs_without_logprobs_are_refused_not_passed() -> None:
    """Without top-k logprobs the logprob half would compare two empty lists."""
    a = output(BASE, False)
    bare = output(BASE, False)
    bare.outputs[0].logprobs = None
    with pytest.raises(ValueError, match="logprobs"):
        same_logprobs(a, bare)
    short = output(BASE[:2], False, tokens=[s[0] for s in BASE])  # a position without them
    with pytest.raises(ValueError, match="logprobs"):
        same_logprobs(a, short)


@FLAT
def test_nan_logprobs_compare_bitwise_and_are_flagged(flat: bool) -> None:
    """A model that computes NaN (dummy weights that overflow: MiniMax-M3 on the H200,
    2026-12-01) computes it in both runs: bit-equal, yet flagged, since its greedy tokens are
    argmaxes of NaN and prove nothing; and -0.0 is not 0.0."""
    from kvtier.testing.restore import has_nan

    tok, rank, ids, vals = BASE[0]
    nan_step = (tok, rank, ids, [math.nan, vals[1], vals[2]])
    a, b = output(with_step(0, nan_step), flat), output(with_step(0, nan_step), flat)
    assert same_logprobs(a, b)
    assert has_nan(a) and not has_nan(output(BASE, flat))
    zero = (tok, rank, ids, [0.0, vals[1], vals[2]])
    negzero = (tok, rank, ids, [-0.0, vals[1], vals[2]])
    assert not same_logprobs(output(with_step(0, zero), flat), output(with_step(0, negzero), flat))


def verdict(**fields: Any) -> Any:
    from kvtier.testing.restore import PromptResult

    base = dict(prompt_len=10, expected_restored=8, checksums_equal=True, tokens_equal=True,
                logprobs_equal=True, tokens_equal_cold=True, logprobs_equal_cold=True,
                hbm_hit_equal_cold=True, hbm_hit_repeatable=True)
    return PromptResult(**{**base, **fields})


def test_a_restore_held_to_vllm_s_hit_fails_on_outputs_only_where_that_hit_repeats() -> None:
    # B differs from C while C repeats itself: kvtier's difference, both verdicts fail
    r = verdict(logprobs_equal=False, logprobs_equal_cold=False)
    assert not r.passed and not r.passed_where_vllm_is_exact
    assert "B differs from vLLM's own hit C (logprobs)" in r.why_failed
    # C differs from C2 (vLLM's own hit is not reproducible): the output comparison is void,
    # the strict verdict still fails and says why
    r = verdict(logprobs_equal=False, logprobs_equal_cold=False, hbm_hit_equal_cold=False,
                hbm_hit_repeatable=False)
    assert not r.passed and r.passed_where_vllm_is_exact
    assert "not reproducible" in r.why_failed
    # CF differs from C (vLLM's hit reads bytes outside its blocks): B is held to CF, which
    # has B's surroundings, not to C
    r = verdict(logprobs_equal=False, hbm_hit_fill_equal=False, tokens_equal_fill=True,
                logprobs_equal_fill=True)
    assert not r.passed and r.passed_where_vllm_is_exact
    assert "bytes outside its blocks; B against CF: equal" in r.why_failed
    r = verdict(logprobs_equal=False, hbm_hit_fill_equal=False, tokens_equal_fill=True,
                logprobs_equal_fill=False)
    assert not r.passed_where_vllm_is_exact and "B against CF: logprobs differ" in r.why_failed
    # the bytes always count: a checksum difference fails both, whatever vLLM reproduces
    r = verdict(checksums_equal=False, hbm_hit_repeatable=False, tokens_equal=False,
                logprobs_equal=False)
    assert not r.passed and not r.passed_where_vllm_is_exact
    assert r.why_failed.startswith("restored bytes differ")
    # NaN outputs void the check both ways
    assert not verdict(nan_outputs=True).passed_where_vllm_is_exact
    assert verdict().passed and verdict().why_failed == ""


def test_where_vllm_s_hit_recomputed_restored_blocks_b_rests_on_the_bytes() -> None:
    """A draft model's HBM hit drops its last block and computes it again: where those bytes
    differ from run A's (the bytes kvtier restores), B cannot be held to C's outputs; the
    check rests on B's bytes. Where C's bytes equal A's, B's outputs must equal C's."""
    r = verdict(tokens_equal=False, logprobs_equal=False, hbm_hit_bytes_equal=False)
    assert not r.passed and r.passed_where_vllm_is_exact
    assert "C recomputed restored blocks with other bits than run A" in r.why_failed
    r = verdict(tokens_equal=False, logprobs_equal=False, hbm_hit_bytes_equal=True)
    assert not r.passed_where_vllm_is_exact
    assert "C recomputed" not in r.why_failed
    r = verdict(checksums_equal=False, hbm_hit_bytes_equal=False)
    assert not r.passed_where_vllm_is_exact  # B's own bytes always count
