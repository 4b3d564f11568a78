"""Negative controls for the restore check: loads that leave chosen bytes of each restored
block unrestored, while reporting success. Never used in production: nothing a user
configures reaches this module.

A restore check that passes proves something only if it fails when a part of the block is
missing. The parts that matter for the sparse and draft families are not whole ops (that is
:attr:`kvtier.testing.faults.FaultyEngine.skip_load_chunk`) but bytes inside each block:

- a whole layer's cache: the DSA indexer's ``k_cache`` (:func:`layer_bytes` with
  :func:`indexer_layers`), or the MTP/EAGLE draft layers (:func:`draft_layers`);
- the inline scales of fp8 rows: bytes 512-527 of each 656-byte ``fp8_ds_mla`` token row
  (:func:`fp8_ds_mla_scale_bytes`), the float32 after each head of the Triton backend's
  ``fp8_per_token_head`` layout (:func:`per_token_head_scale_bytes`).

A :class:`ByteMask` names those bytes per storage, through the registered tensors' own
shapes and strides, so it is exact whatever kvtier's segments look like (merged runs of a
block-outer buffer included). :class:`MaskedLoads` wraps any
:class:`~kvtier.transfer.TransferEngine`: before a load starts it keeps the masked bytes of
the job's destination blocks; when the load is reported finished it writes them back, so
those bytes hold what they held before the load (the check's fill pattern) and every other
byte of the block is restored. Install it with :func:`masked_factory`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.layout import Layout, layer_index
from kvtier.protocol import SKIP, Job
from kvtier.transfer import (
    ChunkMover,
    Completion,
    EngineWrapper,
    ThreadedTransferEngine,
    TransferEngine,
)

EngineFactory = Callable[[ChunkMover], TransferEngine]
Tensors = torch.Tensor | Sequence[torch.Tensor]

FP8_DS_MLA_ROW = 656
"""Bytes of one token of vLLM's ``fp8_ds_mla`` cache (FlashMLA sparse, DeepSeek V3.2 and
GLM-5.x): 512 fp8 NoPE values, 4 float32 scales (one per 128 values), 64 bf16 RoPE values
(vLLM 0.25.1 ``v1/attention/backends/mla/flashmla_sparse.py``, module note and
``get_kv_cache_shape``)."""
FP8_DS_MLA_SCALES = range(512, 528)


def _tensors(value: Tensors) -> list[torch.Tensor]:
    return [value] if isinstance(value, torch.Tensor) else list(value)


@dataclass
class ByteMask:
    """The bytes a masked load must leave alone: per storage (keyed by its data pointer), a
    bool tensor over the storage's bytes, on the CPU."""

    marks: dict[int, torch.Tensor] = field(default_factory=dict)

    def byte_view(self, t: torch.Tensor) -> torch.Tensor:
        """The mask's bytes under ``t``: shape ``t.shape + (element size,)``, the same
        elements as ``t`` (so ``view[..., lo:hi, :]`` marks elements ``lo..hi-1`` of the last
        dimension)."""
        st = t.untyped_storage()
        mark = self.marks.setdefault(st.data_ptr(), torch.zeros(st.nbytes(), dtype=torch.bool))
        es = t.element_size()
        return torch.as_strided(mark, (*t.shape, es), (*(s * es for s in t.stride()), 1),
                                t.storage_offset() * es)

    def count(self) -> int:
        return int(sum(int(m.sum()) for m in self.marks.values()))

    def positions(self, storage_ptr: int, first: int, run: int) -> torch.Tensor | None:
        """Storage byte offsets in ``[first, first + run)`` that are masked, or None."""
        mark = self.marks.get(storage_ptr)
        if mark is None:
            return None
        hit = mark[first:first + run].nonzero().flatten()
        return hit + first if hit.numel() else None


def layer_bytes(kv_caches: Mapping[str, Tensors], names: Iterable[str],
                mask: ByteMask | None = None) -> ByteMask:
    """Every byte of the listed layers' registered caches."""
    mask = mask or ByteMask()
    for name in names:
        for t in _tensors(kv_caches[name]):
            mask.byte_view(t)[...] = True
    return mask


def fp8_ds_mla_scale_bytes(kv_caches: Mapping[str, Tensors], names: Iterable[str],
                           mask: ByteMask | None = None) -> ByteMask:
    """The 16 scale bytes (4 float32) of every 656-byte token row of the listed
    ``fp8_ds_mla`` caches (uint8, last dimension 656)."""
    mask = mask or ByteMask()
    for name in names:
        for t in _tensors(kv_caches[name]):
            if t.element_size() != 1 or t.shape[-1] != FP8_DS_MLA_ROW:
                raise ValueError(f"{name}: not fp8_ds_mla rows (shape {tuple(t.shape)}, "
                                 f"dtype {t.dtype})")
            mask.byte_view(t)[..., FP8_DS_MLA_SCALES.start:FP8_DS_MLA_SCALES.stop, :] = True
    return mask


def per_token_head_scale_bytes(kv_caches: Mapping[str, Tensors], names: Iterable[str],
                               mask: ByteMask | None = None) -> ByteMask:
    """The float32 scale of every token and head, K and V, of the Triton backend's
    per-token-head caches (``fp8_per_token_head``; ``pad = 4 / element size`` elements):

    - vLLM 0.25.1, ``(num_blocks, 2, block_size, heads, head_size + pad)``: the last ``pad``
      elements of each head (``TritonAttentionBackend.get_kv_cache_shape``,
      ``TritonAttentionImpl._ensure_scale_caches``);
    - vLLM 0.32, ``(num_blocks, heads, block_size, 2 * (head_size + pad))``, content
      ``[K | K scale | V | V scale]``: the last ``pad`` elements of each half (same methods).
    """
    mask = mask or ByteMask()
    for name in names:
        for t in _tensors(kv_caches[name]):
            pad = 4 // t.element_size()
            view = mask.byte_view(t)
            if t.dim() == 5:
                view[..., t.shape[-1] - pad:, :] = True
            elif t.dim() == 4 and t.shape[-1] % 2 == 0:
                half = t.shape[-1] // 2
                view[..., half - pad:half, :] = True
                view[..., 2 * half - pad:, :] = True
            else:
                raise ValueError(f"{name}: not a per-token-head cache of vLLM 0.25.1 or 0.32 "
                                 f"(shape {tuple(t.shape)})")
    return mask


def indexer_layers(names: Iterable[str]) -> list[str]:
    """The sparse-attention index caches among registered layer names: the DSA indexer's
    (``...indexer.k_cache``) and MiniMax-M3's (``...attn.index_cache``, vLLM 0.25.1
    ``models/minimax_m3/common/indexer.py``: the cache registers under the attention layer's
    name, so ``.indexer`` alone found none on the H200, 2026-12-01)."""
    return [n for n in names if ".indexer" in n or n.endswith(".index_cache")]


def draft_layers(names: Iterable[str], num_target_layers: int) -> list[str]:
    """The MTP draft layers among registered layer names: vLLM numbers a DeepSeek-style MTP
    block after the target's layers (``model.layers.{num_hidden_layers + i}``)."""
    return [n for n in names if layer_index(n) >= num_target_layers]


@dataclass
class _Kept:
    storage: torch.Tensor  # 1-D uint8 view of the whole storage
    positions: torch.Tensor  # byte offsets, on the storage's device
    values: torch.Tensor


class MaskedLoads(EngineWrapper):
    """Loads that leave :attr:`mask`'s bytes of their destination blocks as they were
    (``None``: the wrapped engine itself). ``masked`` counts the bytes kept, ever."""

    def __init__(self, inner: TransferEngine, layout: Layout) -> None:
        super().__init__(inner)
        self.layout = layout
        self.mask: ByteMask | None = None
        self.masked = 0
        self._kept: dict[int, list[_Kept]] = {}

    def load(self, job: Job) -> None:
        if self.mask is not None:
            self._kept[job.job_id] = self._keep(job, self.mask)
        self.inner.load(job)

    def _keep(self, job: Job, mask: ByteMask) -> list[_Kept]:
        kept = []
        for op in job.ops:
            for seg in self.layout.groups[op.group].segments:
                ptr = seg.storage.data_ptr()
                if ptr not in mask.marks:
                    continue
                for b in op.block_ids:
                    if b == SKIP:
                        continue
                    pos = mask.positions(ptr, seg.offset + b * seg.block_stride, seg.run)
                    if pos is not None:
                        pos = pos.to(seg.storage.device)
                        kept.append(_Kept(seg.storage, pos, seg.storage[pos].clone()))
        return kept

    def _finish(self, done: list[Completion]) -> list[Completion]:
        for c in done:
            for k in self._kept.pop(c.job_id, []):
                k.storage[k.positions] = k.values
                self.masked += k.positions.numel()
        return done

    def poll(self) -> list[Completion]:
        return self._finish(self.inner.poll())

    def query(self, job_ids: Sequence[int]) -> list[Completion]:
        return self._finish(self.inner.query(job_ids))


def masked_factory(inner: EngineFactory | None = None) -> Callable[[ChunkMover], MaskedLoads]:
    """An engine factory that wraps what ``inner`` makes (default: the CPU engine)."""

    def make(mover: ChunkMover) -> MaskedLoads:
        engine = inner(mover) if inner is not None else ThreadedTransferEngine(mover)
        return MaskedLoads(engine, mover.layout)

    return make


MASKS: dict[str, Callable[[Mapping[str, Tensors], Iterable[str]], ByteMask]] = {
    "layers": layer_bytes,
    "fp8_ds_mla_scales": fp8_ds_mla_scale_bytes,
    "per_token_head_scales": per_token_head_scale_bytes,
}
"""The controls by name, for :func:`rpc_mask_loads`."""


def rpc_mask_loads(worker: Any, control: str | None, names: list[str]) -> int:
    """For ``LLM.collective_rpc`` with :class:`kvtier.testing.probe.ProbeConnector`: from now
    on this rank's loads leave the bytes of ``MASKS[control]`` over the named layers'
    registered caches unrestored (``control=None``: every byte restored again). Returns the
    number of masked bytes in the whole cache (0 when off)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    probe = get_kv_transfer_group()
    engine = probe.load_controls
    engine.mask = None if control is None else MASKS[control](probe.vllm_kv_caches, names)
    return 0 if engine.mask is None else engine.mask.count()


def _target_layers(worker: Any) -> int:
    """The target model's layer count on a vLLM worker (the MTP block is numbered after it)."""
    config = worker.model_runner.model_config.hf_config
    return int(config.num_hidden_layers)


def rpc_mask_indexer(worker: Any, on: bool = True) -> int:
    """:func:`rpc_mask_loads` over this rank's DSA indexer caches (a restore that leaves the
    indexer keys out must fail the check); 0 layers found is an error, not a silent pass."""
    return _mask_named(worker, "layers", indexer_layers, on)


def rpc_mask_draft_layers(worker: Any, on: bool = True) -> int:
    """:func:`rpc_mask_loads` over this rank's MTP draft layers."""
    target = _target_layers(worker)
    return _mask_named(worker, "layers", lambda names: draft_layers(names, target), on)


def rpc_mask_fp8_ds_mla_scales(worker: Any, on: bool = True) -> int:
    """:func:`rpc_mask_loads` over the inline scales of this rank's ``fp8_ds_mla`` rows (every
    registered uint8 cache whose rows are 656 bytes; the indexer's are not)."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    caches = get_kv_transfer_group().vllm_kv_caches

    def rows(names: Iterable[str]) -> list[str]:
        return [n for n in names if all(t.element_size() == 1 and t.shape[-1] == FP8_DS_MLA_ROW
                                        for t in _tensors(caches[n]))]

    return _mask_named(worker, "fp8_ds_mla_scales", rows, on)


def _mask_named(worker: Any, control: str, choose: Callable[[Iterable[str]], list[str]],
                on: bool) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    if not on:
        return rpc_mask_loads(worker, None, [])
    names = choose(list(get_kv_transfer_group().vllm_kv_caches))
    if not names:
        raise ValueError(f"negative control {control}: no registered cache matches")
    return rpc_mask_loads(worker, control, names)
