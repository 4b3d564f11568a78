"""The restore check, for an in-process vLLM engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``)
whose connector is :class:`kvtier.testing.probe.ProbeConnector`.

Run A computes the prompts; the probe reads per-block checksums through vLLM's block table
of each request: every KV block kvtier restores and, for a recurrent-state group, the one state
block of the boundary. Run C repeats them with vLLM's own prefix cache (the reference at the
same boundary). With ``hit_controls``, two controls of vLLM's own hit follow: run C2 repeats C
on the same cached blocks (is vLLM's hit reproducible at all? where it is not, no output
comparison can tell a restore's bytes from another run's, and the check rests on the
checksums), and run CF fills everything but the prompts' cached blocks and hits them again
(do vLLM's outputs depend on bytes outside the blocks it hits? B has the fill there too, so
where CF differs from C, CF is B's reference: the two differ only in where the blocks sit).
Then the prefix cache is reset and every byte of every registered KV and state
tensor overwritten with a fill pattern; run B repeats the prompts, so whatever it did not
recompute came from kvtier. The check passes only if kvtier restored exactly the whole-chunk
prefixes, run B's blocks (KV and state) hold run A's bytes, and run B's greedy tokens and
top-k logprobs equal run C's bit for bit and, where a cold reference is given (run D: an
engine with prefix caching off, see :mod:`kvtier.testing.reference`), run D's too. With
``one_at_a_time`` runs C and B generate each prompt alone, each B after its own reset and
fill (prompts sharing a prefix each restore it): the form whose bit-equality means something
where vLLM's kernels are not batch-invariant.

How to call it (any vLLM version kvtier supports; in-process engine core)::

    h = handles(LLM(..., kv_transfer_config=<ProbeConnector>, enable_prefix_caching=True))
    sharpen_dummy_weights(h)                    # dummy weights only
    res = restore_check(h, prompts, SamplingParams(temperature=0, logprobs=5, ...), cold=ref)
    res.passed, res.to_json()

``ref`` is ``reference.cold_reference(llm_off, prompts, params)`` from an engine with the same
weights and prefix caching off (run it first, or in another process, where memory is short:
:class:`~kvtier.testing.reference.Generated` is JSON). The negative control:
``h.llm.collective_rpc(rpc_skip_state_loads, args=(True,))`` (:mod:`kvtier.testing.probe`)
makes every load skip its state objects while reporting success: the check must fail.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvtier.layout import GroupKind
from kvtier.testing.reference import Generated


@dataclass
class EngineHandles:
    """An LLM whose EngineCore runs in this process. ``worker_connector`` is the worker
    half when the worker runs here too (one rank, uni-process executor), else None: checks
    then reach every rank through ``collective_rpc``."""

    llm: Any
    core: Any
    scheduler_connector: Any
    worker_connector: Any | None

    @property
    def kvtier(self) -> Any:
        """The scheduler half's engine-agnostic core (OffloadScheduler)."""
        return self.scheduler_connector.scheduler_side.scheduler

    @property
    def faults(self) -> Any:
        """The in-process worker's fault switches (a kvtier.testing.faults.FaultyEngine)."""
        assert self.worker_connector is not None, "the worker runs in another process"
        return self.worker_connector.faults


def handles(llm: Any) -> EngineHandles:
    core = llm.llm_engine.engine_core.engine_core  # requires the in-process engine core
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    local = get_kv_transfer_group() if has_kv_transfer_group() else None
    h = EngineHandles(llm, core, core.scheduler.connector, local)
    if h.kvtier is None:  # the layout handshake happens in the first engine step
        from vllm import SamplingParams

        llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)
        settle(h)
    return h


def settle(h: EngineHandles, timeout_s: float = 120.0) -> int:
    """Step the engine until kvtier has nothing in flight; returns the steps taken.

    Bounded by wall time, not steps: on CPU the transfer thread needs the GIL, and an idle
    engine spins through empty steps far faster than a copy finishes.
    """
    deadline = time.monotonic() + timeout_s
    n = 0
    core = h.core
    while time.monotonic() < deadline:
        queued = bool(getattr(core, "batch_queue", None))
        if (not queued and not h.scheduler_connector.has_pending_push_work()
                and not core.scheduler.has_requests()):
            return n
        # step_fn, not step: with async scheduling (the GPU default) a batch may still sit in
        # the engine's batch queue, its output (and kvtier's reports in it) not yet applied
        core.step_fn()
        n += 1
        time.sleep(0.001)  # let the transfer thread run
    sched = h.kvtier
    jobs = {j: (js.kind, js.step, js.ok, js.failed) for j, js in sched.jobs.items()} if sched else {}
    raise TimeoutError(
        f"kvtier still had work in flight after {timeout_s}s ({n} steps): scheduler jobs {jobs}")


def generate(h: EngineHandles, prompts: list[list[int]], params: Any) -> list[Any]:
    outs = h.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    settle(h)
    return outs


@dataclass
class PromptResult:
    """One prompt's comparisons. ``*_cold`` are None where no cold reference was given;
    ``blocks_compared`` counts, per group kind, the blocks whose checksums were compared
    (summed over ranks), so a report shows that state blocks were checked too."""

    prompt_len: int
    expected_restored: int
    checksums_equal: bool
    tokens_equal: bool
    logprobs_equal: bool
    tokens_equal_cold: bool | None = None
    logprobs_equal_cold: bool | None = None
    # vLLM's own prefix-cache hit (C) against the cold run (D): where vLLM's cache is not
    # bit-equal to a recompute (a recurrent scan split at other chunk ends), B cannot be either
    hbm_hit_equal_cold: bool | None = None
    # B against run A, this engine's own computation of the prompt from nothing (prefix
    # caching on, nothing cached): the recompute that splits a recurrent scan at the same
    # chunk ends as the cached runs, so it is the reference a state restore can equal
    # bit for bit where the cold run (D, one prefill step) cannot
    tokens_equal_first: bool | None = None
    logprobs_equal_first: bool | None = None
    blocks_compared: dict[str, int] = field(default_factory=dict)
    # C2 (C again, on the same cached blocks) against C: False where vLLM's own prefix-cache
    # hit is not run-to-run deterministic; then B's outputs cannot be held to C's
    hbm_hit_repeatable: bool | None = None
    # CF (C after everything but the cached blocks was filled) against C: False where vLLM's
    # outputs depend on bytes outside the blocks it hits (slots past a sequence's end, other
    # blocks); B against CF: the same surroundings, other block ids
    hbm_hit_fill_equal: bool | None = None
    # C's blocks at the positions kvtier restores, against run A's: False where vLLM's hit
    # recomputed some of them with other bits (it drops the last block of a draft model's hit
    # and computes it again, in another step than A did); B restores A's bytes there, so B's
    # outputs cannot be held to C's
    hbm_hit_bytes_equal: bool | None = None
    tokens_equal_fill: bool | None = None
    logprobs_equal_fill: bool | None = None
    tokens_b: list[int] = field(default_factory=list)
    tokens_c: list[int] = field(default_factory=list)
    # B or C produced NaN logprobs: the comparison of outputs is void, the check cannot pass
    nan_outputs: bool = False
    # every run's completion (Generated.to_json) by run name (a, b, c, and c2, cf where run):
    # the values themselves, so runs of other sessions can be compared with these
    outputs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return (self.checksums_equal and self.tokens_equal and self.logprobs_equal
                and not self.nan_outputs
                and self.tokens_equal_cold is not False and self.logprobs_equal_cold is not False)

    @property
    def passed_where_vllm_is_exact(self) -> bool:
        """:attr:`passed`, held only to what vLLM's own cache achieves: a difference from the
        cold run counts only where vLLM's prefix-cache hit equals the cold run, and a
        difference from C only where C repeats itself (C2). The checksums always count: where
        vLLM's outputs are not reproducible, the bytes are what the check rests on."""
        cold_ok = (self.hbm_hit_equal_cold is False
                   or (self.tokens_equal_cold is not False
                       and self.logprobs_equal_cold is not False))
        if self.hbm_hit_repeatable is False or self.hbm_hit_bytes_equal is False:
            # vLLM's own hit differs from itself, or recomputed bytes B restores: B's outputs
            # cannot be held to C's
            hit_ok = True
        elif self.hbm_hit_fill_equal is False:  # B's reference is CF (module docstring)
            hit_ok = bool(self.tokens_equal_fill and self.logprobs_equal_fill)
        else:
            hit_ok = self.tokens_equal and self.logprobs_equal
        return self.checksums_equal and hit_ok and cold_ok and not self.nan_outputs

    @property
    def why_failed(self) -> str:
        """What failed, in words ('' when :attr:`passed`)."""
        parts = [] if self.checksums_equal else ["restored bytes differ from run A's"]
        if not self.tokens_equal or not self.logprobs_equal:
            what = "logprobs" if self.tokens_equal else "tokens"
            parts.append(f"B differs from vLLM's own hit C ({what})"
                         + (" and C differs from C again (vLLM's hit is not reproducible)"
                            if self.hbm_hit_repeatable is False else "")
                         + (" and C recomputed restored blocks with other bits than run A"
                            if self.hbm_hit_bytes_equal is False else "")
                         + (" and C differs from CF (vLLM's hit depends on bytes outside "
                            f"its blocks; B against CF: {self._fill_words()})"
                            if self.hbm_hit_fill_equal is False else ""))
        if self.tokens_equal_cold is False or self.logprobs_equal_cold is False:
            parts.append("B differs from the cold run"
                         + (" as vLLM's own hit does" if self.hbm_hit_equal_cold is False
                            else ""))
        if self.nan_outputs:
            parts.append("NaN outputs")
        return "; ".join(parts)

    def _fill_words(self) -> str:
        if self.tokens_equal_fill and self.logprobs_equal_fill:
            return "equal"
        return "logprobs differ" if self.tokens_equal_fill else "tokens differ"


@dataclass
class RestoreResult:
    restored_tokens: int
    expected_restored: int
    prompts: list[PromptResult]
    loads_ok: int
    loads_failed: int
    cold_checked: bool = False
    one_at_a_time: bool = False  # runs C and B generated each prompt alone (restore_check)

    @property
    def passed(self) -> bool:
        return self.restored_tokens == self.expected_restored and all(
            p.passed for p in self.prompts)

    @property
    def passed_where_vllm_is_exact(self) -> bool:
        return self.restored_tokens == self.expected_restored and all(
            p.passed_where_vllm_is_exact for p in self.prompts)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "passed": self.passed,
                "passed_where_vllm_is_exact": self.passed_where_vllm_is_exact,
                "prompts": [{**asdict(p), "passed": p.passed,
                             "passed_where_vllm_is_exact": p.passed_where_vllm_is_exact,
                             "why_failed": p.why_failed}
                            for p in self.prompts]}


def _restored_blocks(h: EngineHandles, group: int, prompt_len: int) -> range:
    """Positions in ``group``'s block table of the blocks kvtier restores for a prompt of
    ``prompt_len`` tokens: the chunks a load covers, or, for a recurrent-state group, the one
    block holding the state after the boundary's last token."""
    geo = h.kvtier.geometry
    c = geo.chunk_tokens
    boundary = (prompt_len - 1) // c
    g = geo.groups[group]
    end = boundary * c // g.block_size
    if g.kind is GroupKind.STATE:
        return range(max(end - 1, 0), end)
    if g.kind is GroupKind.SLIDING_WINDOW:
        first = geo.window_chunks(group, boundary).start * c
    else:
        first = 0
    return range(first // g.block_size, end)


Sums = list[list[dict[int, str]]]  # per rank, per kvtier group: {block position: checksum}


def _checksums(h: EngineHandles, prompt: list[int]) -> Sums:
    """Per rank, per kvtier group: {block position: checksum} of the blocks kvtier restores
    for this prompt (KV and state), read through vLLM's block table of the latest finished
    request with this prompt. Positions vLLM already released (null blocks: out of a sliding
    window, or an interior state, by the end of the request) are left out."""
    from kvtier.testing.probe import rpc_block_checksums

    positions, asks = _restored(h, prompt)
    per_rank = h.llm.collective_rpc(rpc_block_checksums, args=(asks,))
    return [[dict(zip(pos, sums)) for pos, sums in zip(positions, rank)] for rank in per_rank]


def _restored(h: EngineHandles, prompt: list[int]
              ) -> tuple[list[list[int]], list[tuple[list[str], list[int]]]]:
    """Per kvtier group, the block-table positions of :func:`_restored_blocks` that vLLM's
    table of the latest finished request with ``prompt`` still holds (not null), and (the
    group's layer names, the block ids at those positions)."""
    blocks = h.scheduler_connector.blocks_of(prompt)
    groups = h.scheduler_connector.groups
    positions, asks = [], []
    for kg, eg in enumerate(groups.engine_ids):
        table = blocks[eg]
        pos = [i for i in _restored_blocks(h, kg, len(prompt)) if i < len(table) and table[i]]
        positions.append(pos)
        asks.append((list(groups.specs[kg].layer_names), [table[i] for i in pos]))
    return positions, asks


def _same_blocks(a: Sums, b: Sums) -> bool:
    """On every rank, every group has restored blocks in both runs, and they agree where
    both runs kept them."""
    return len(a) == len(b) and all(_same_rank(x, y) for x, y in zip(a, b))


def _same_rank(a: list[dict[int, str]], b: list[dict[int, str]]) -> bool:
    for ga, gb in zip(a, b):
        common = ga.keys() & gb.keys()
        if not common or any(ga[i] != gb[i] for i in common):
            return False
    return len(a) == len(b)


def _compared(h: EngineHandles, a: Sums, b: Sums) -> dict[str, int]:
    kinds = [s.kind.value for s in h.scheduler_connector.groups.specs]
    out: dict[str, int] = {}
    for ra, rb in zip(a, b):
        for kind, ga, gb in zip(kinds, ra, rb):
            out[kind] = out.get(kind, 0) + len(ga.keys() & gb.keys())
    return out


def same_tokens(b: Any, c: Any) -> bool:
    """Two ``RequestOutput``s (or :class:`Generated`) generated the same tokens (their first
    completions)."""
    return Generated.of(b).token_ids == Generated.of(c).token_ids


def same_logprobs(b: Any, c: Any) -> bool:
    """Two ``RequestOutput``s (or :class:`Generated`) have bit-equal top-k logprobs (token,
    float value and rank) at every generated position, whatever their tokens. Bit-equal, not
    ``==``: a NaN equals the same NaN (a model that computes NaN computes it in both runs; that
    such a check proves little is :func:`has_nan`'s to say), and -0.0 differs from 0.0."""
    return _logprob_bits(Generated.of(b)) == _logprob_bits(Generated.of(c))


def has_nan(out: Any) -> bool:
    """Whether some top-k logprob of a completion is NaN: its greedy tokens are then argmaxes
    of NaN (dummy weights that overflow), and token equality proves nothing about the KV."""
    return any(math.isnan(v) for step in Generated.of(out).logprobs for _, v, _ in step)


def _logprob_bits(g: Generated) -> tuple[tuple[tuple[int, bytes, int | None], ...], ...]:
    return tuple(tuple((t, struct.pack("<d", v), r) for t, v, r in step) for step in g.logprobs)


FILL_BYTE = 0x47
"""The fill pattern's byte (:meth:`kvtier.testing.probe.ProbeConnector.fill_all`): large
values in every float format, so a block kvtier did not restore changes the outputs."""


def restore_check(h: EngineHandles, prompts: list[list[int]], params: Any,
                  cold: Sequence[Generated] | None = None,
                  one_at_a_time: bool = False, fill_byte: int = FILL_BYTE,
                  hit_controls: bool = False) -> RestoreResult:
    """Runs A, C, fill, B (module docstring); ``cold``: run D's outputs for ``prompts``.

    ``one_at_a_time``: runs C and B generate each prompt alone (A still computes them
    together, from nothing), and before each prompt's run B the prefix cache is reset and
    every tensor filled again, so each restores its whole-chunk prefix from kvtier on its own,
    prompts sharing a prefix restoring the same chunks. B and C then run the same batch (one
    request, the same computed tail), so bit-equality is meaningful where vLLM's kernels are
    not batch-invariant: batched, B's requests leave their parked loads in other steps than
    C's hits and are batched differently. ``cold`` must then be run D's one-at-a-time
    outputs too.

    ``fill_byte``: the fill's byte. ``0`` tells a restore error from outputs that depend on
    bytes no restore writes (slots past a sequence's end in its last, partial block, which
    hold the fill in B and earlier tokens in C): with zeros there, a kernel that reads them
    before masking sees what an unused block holds, not 5.1e4.

    ``hit_controls``: runs C2 and CF (module docstring), for GPU kernels that may not be
    deterministic; vLLM's CPU build is, and its checks leave them out."""
    if cold is not None and len(cold) != len(prompts):
        raise ValueError(f"{len(cold)} cold reference outputs for {len(prompts)} prompts")
    h.llm.reset_prefix_cache()  # run A computes: nothing left in HBM from earlier checks
    outs_a = generate(h, prompts, params)
    sums_a = [_checksums(h, p) for p in prompts]
    # C: vLLM's own prefix cache at the same boundary, and its blocks at the restored
    # positions (read through C's block table, before anything else runs)
    if one_at_a_time:
        outs_c, sums_c = [], []
        for p in prompts:
            outs_c.append(generate(h, [p], params)[0])
            sums_c.append(_checksums(h, p))
    else:
        outs_c = generate(h, prompts, params)
        sums_c = [_checksums(h, p) for p in prompts]
    outs_c2: list[Any] = [None] * len(prompts)
    outs_cf: list[Any] = [None] * len(prompts)
    if hit_controls:
        outs_c2, outs_cf = _hit_controls(h, prompts, params, one_at_a_time, fill_byte)
    stats = h.kvtier.stats
    before = (stats.loaded_tokens, stats.loads_ok, stats.loads_failed)
    outs_b, sums_b = [], []
    for group in ([[p] for p in prompts] if one_at_a_time else [prompts]):
        _reset_and_fill(h, fill_byte)
        outs_b += generate(h, group, params)
        sums_b += [_checksums(h, p) for p in group]  # before the next fill overwrites them
    c = h.kvtier.geometry.chunk_tokens
    results = [_compare(h, p, c, a, b, oa, oc, ob, cold[i] if cold is not None else None,
                        oc2, ocf, sc)
               for i, (p, a, b, oa, oc, ob, oc2, ocf, sc) in enumerate(
                   zip(prompts, sums_a, sums_b, outs_a, outs_c, outs_b, outs_c2, outs_cf,
                       sums_c))]
    return RestoreResult(
        restored_tokens=stats.loaded_tokens - before[0],
        expected_restored=sum(r.expected_restored for r in results),
        prompts=results,
        loads_ok=stats.loads_ok - before[1],
        loads_failed=stats.loads_failed - before[2],
        cold_checked=cold is not None,
        one_at_a_time=one_at_a_time,
    )


def _hit_controls(h: EngineHandles, prompts: list[list[int]], params: Any,
                  one_at_a_time: bool, fill_byte: int) -> tuple[list[Any], list[Any]]:
    """Runs C2 and CF of :func:`restore_check`, right after C. CF keeps every prompt's cached
    blocks (those kvtier restores, which C hit) and fills the rest, before each of its runs:
    run by run, the surroundings B gets from its own reset and fill."""
    from kvtier.testing.probe import rpc_fill_keeping

    groups = [[p] for p in prompts] if one_at_a_time else [prompts]
    outs_c2 = [o for g in groups for o in generate(h, g, params)]
    keep: dict[int, tuple[list[str], set[int]]] = {}
    for p in prompts:
        for kg, (layers, ids) in enumerate(_restored(h, p)[1]):
            keep.setdefault(kg, (layers, set()))[1].update(ids)
    asks = [(layers, sorted(ids)) for layers, ids in keep.values()]
    outs_cf = []
    for g in groups:
        assert all(n > 0 for n in h.llm.collective_rpc(rpc_fill_keeping,
                                                       args=(fill_byte, asks)))
        outs_cf += generate(h, g, params)
    return outs_c2, outs_cf


def _reset_and_fill(h: EngineHandles, fill_byte: int = FILL_BYTE) -> None:
    """Nothing in HBM's prefix cache, and every registered tensor overwritten: what run B
    does not recompute must come from kvtier."""
    from kvtier.testing.probe import rpc_fill

    h.llm.reset_prefix_cache()
    assert all(n > 0 for n in h.llm.collective_rpc(rpc_fill, args=(fill_byte,)))


def _compare(h: EngineHandles, p: list[int], chunk: int, a: Sums, b: Sums, oa: Any, oc: Any,
             ob: Any, d: Generated | None, oc2: Any = None, ocf: Any = None,
             c: Sums | None = None) -> PromptResult:
    """One prompt's comparisons: B's blocks against A's (and C's, where given), B's outputs
    against C's (and A's, and the cold run D's where given), C's against C2's and CF's, and
    B's against CF's, where given."""
    return PromptResult(
        prompt_len=len(p), expected_restored=(len(p) - 1) // chunk * chunk,
        checksums_equal=_same_blocks(a, b),
        tokens_equal=same_tokens(ob, oc),
        logprobs_equal=same_logprobs(ob, oc),
        tokens_equal_cold=None if d is None else same_tokens(ob, d),
        logprobs_equal_cold=None if d is None else same_logprobs(ob, d),
        hbm_hit_equal_cold=None if d is None else (same_tokens(oc, d)
                                                   and same_logprobs(oc, d)),
        tokens_equal_first=same_tokens(ob, oa), logprobs_equal_first=same_logprobs(ob, oa),
        hbm_hit_repeatable=None if oc2 is None else (same_tokens(oc, oc2)
                                                     and same_logprobs(oc, oc2)),
        hbm_hit_fill_equal=None if ocf is None else (same_tokens(oc, ocf)
                                                     and same_logprobs(oc, ocf)),
        hbm_hit_bytes_equal=None if c is None else _same_blocks(a, c),
        tokens_equal_fill=None if ocf is None else same_tokens(ob, ocf),
        logprobs_equal_fill=None if ocf is None else same_logprobs(ob, ocf),
        blocks_compared=_compared(h, a, b),
        tokens_b=list(ob.outputs[0].token_ids), tokens_c=list(oc.outputs[0].token_ids),
        nan_outputs=has_nan(ob) or has_nan(oc),
        outputs={name: Generated.of(o).to_json()
                 for name, o in (("a", oa), ("b", ob), ("c", oc), ("c2", oc2), ("cf", ocf))
                 if o is not None},
    )


def sharpen_dummy_weights(h: EngineHandles | Any, seed: int = 0) -> None:
    """:func:`sharpen_worker_weights` on every rank of ``h`` (EngineHandles, or any LLM: the
    cold reference's engine gets the same weights this way)."""
    llm = h.llm if isinstance(h, EngineHandles) else h
    llm.collective_rpc(sharpen_worker_weights, args=(seed,))


def sharpen_worker_weights(worker: Any, seed: int = 0) -> int:
    """Re-draw the dummy weights so the output depends on the context (also usable through
    ``LLM.collective_rpc``).

    vLLM's dummy weights are uniform in [-1e-3, 1e-3], norms included: the residual stream
    then dominates and attention barely moves the logits, so a wrong KV block can leave the
    tokens unchanged. Here: norms 1, matrices uniform in +-1/sqrt(fan_in), deterministic.
    """
    import torch

    model = worker.model_runner.model
    gen = torch.Generator(device="cpu").manual_seed(seed)
    n = 0
    with torch.no_grad():
        for _name, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                bound = 1.0 / float(p.shape[-1]) ** 0.5
                p.copy_(((torch.rand(p.shape, generator=gen) * 2 - 1) * bound).to(p.device))
            n += 1
    return n
