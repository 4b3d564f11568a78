"""Reference outputs for the restore check: what a completion generated, as plain data, and the
cold recompute (run D: an engine with prefix caching off, so every token is computed).

A :class:`Generated` keeps exactly what :mod:`kvtier.testing.restore` compares (token ids and,
per generated token, the sorted ``(token, logprob, rank)`` of its top-k) and round-trips
through JSON bit for bit (Python writes floats as their shortest exact repr), so a GPU driver
can compute the cold reference in one engine (or process), free it, and start the kvtier
engine after.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

TopK = list[tuple[int, float, int | None]]


@dataclass(frozen=True)
class Generated:
    """One completion: its token ids and, per generated token, its sorted top-k logprobs."""

    token_ids: tuple[int, ...]
    logprobs: tuple[tuple[tuple[int, float, int | None], ...], ...]

    @classmethod
    def of(cls, out: Any) -> Generated:
        """The first completion of a vLLM ``RequestOutput`` (or a Generated, as it is).
        Raises if some generated token has no logprobs: a check without them would compare
        nothing."""
        if isinstance(out, Generated):
            return out
        comp = out.outputs[0]
        steps = comp.logprobs
        if steps is None or len(steps) != len(comp.token_ids):
            raise ValueError("the restore check needs top-k logprobs for every generated token "
                             "(SamplingParams(logprobs=k))")
        lps = tuple(tuple(sorted((int(tok), float(lp.logprob), lp.rank)
                                 for tok, lp in step.items())) for step in steps)
        return cls(tuple(int(t) for t in comp.token_ids), lps)

    def to_json(self) -> dict[str, Any]:
        return {"token_ids": list(self.token_ids),
                "logprobs": [[list(e) for e in step] for step in self.logprobs]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Generated:
        return cls(tuple(data["token_ids"]), tuple(
            tuple((int(t), float(v), None if r is None else int(r)) for t, v, r in step)
            for step in data["logprobs"]))


def cold_reference(llm: Any, prompts: Sequence[Sequence[int]], params: Any,
                   one_at_a_time: bool = False) -> list[Generated]:
    """Run D: generate ``prompts`` on ``llm``, an engine with the same weights as the checked
    one and prefix caching off (refused otherwise: a hit would not be a recompute), as one
    batch: pass the same prompt list the check gets, since vLLM is not batch-invariant (other
    co-scheduled prefills change the last bits of logprobs; seen on 0.32's CPU build), or,
    ``one_at_a_time``, each prompt alone (for ``restore_check(..., one_at_a_time=True)``).
    Dummy weights must be re-drawn first, as for the checked engine
    (:func:`kvtier.testing.restore.sharpen_dummy_weights` works on any LLM)."""
    config = llm.llm_engine.vllm_config
    if config.cache_config.enable_prefix_caching:
        raise ValueError("the cold reference needs an engine with enable_prefix_caching=False")
    batches = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs = [o for batch in batches for o in llm.generate(
        [{"prompt_token_ids": list(p)} for p in batch], params, use_tqdm=False)]
    return [Generated.of(o) for o in outs]
