"""Upstream vLLM fixes the GPU tools apply to vLLM 0.25.x in their own process (test machinery:
kvtier itself never patches vLLM). Each fix is the merged upstream change, applied to the
classes before the engine is built, so it reaches the worker only where the engine core and
its worker run in the tool's process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, the uni-process
executor: every GPU tool runs so). :func:`apply_vllm_fixes` returns what it applied, and the
tools record that list in their results.

1. **fp8_ds_mla spec** (vllm-project/vllm#48378, fixed by #48379): 0.25.1's
   ``MLAAttention.get_kv_cache_spec`` leaves ``kv_quant_mode`` NONE, so the runner reshapes
   the 656-byte ``fp8_ds_mla`` pages as 576 elements and every DSA model with fp8 KV fails at
   start-up. The fix sets the quant mode from the spec's own ``cache_dtype_str``.
2. **MiniMax-M3 top-k layout** (vllm-project/vllm#48603, fixed by #49149; 0.32 has it): the
   NVIDIA model allocates the shared ``topk_indices_buffer`` token-major ``[T, H, K]`` (for the
   SM100 MSA path), while the Triton indexer and attend impls, the only ones off SM100, slice
   it as head-major ``[H, T, K]``: ``buf[:, nd:, :]`` cuts the head axis and the kernels, which
   address by strides, then write the top-k of (head h, token n) where (h - 1, n + 4) reads
   it. A query then attends the blocks another token (of its own request or the next one)
   selected; where the first of them lies after the query, every score of that block is
   masked and the online softmax computes ``exp2(-inf - -inf)``: NaN, which the residual
   stream carries to every later token (H200, 2026-12-01: the second prompt of a batched
   prefill all NaN, the first finite). The fix hands both impls the head-major view
   ``buf.transpose(0, 1)`` of the same storage, as #49149 does.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

FIX_MLA_QUANT_MODE = ("MLAAttention.get_kv_cache_spec sets kv_quant_mode from cache_dtype_str "
                      "(vllm-project/vllm#48379, for #48378: fp8_ds_mla reshape)")
FIX_M3_TOPK_LAYOUT = ("MiniMax-M3 Triton indexer and attend read the token-major top-k buffer "
                      "through its head-major view (vllm-project/vllm#49149, for #48603: "
                      "NaN in batched prefills off SM100)")


def with_quant_mode(spec: Any) -> Any:
    """An MLA spec whose ``cache_dtype_str`` is quantized but whose ``kv_quant_mode`` is NONE
    (0.25.1's ``MLAAttention.get_kv_cache_spec``), with the quant mode set from that string;
    any other spec unchanged. Page size and every other field stay as they were."""
    from vllm.v1.kv_cache_interface import KVQuantMode, MLAAttentionSpec, get_kv_quant_mode

    if not isinstance(spec, MLAAttentionSpec) or spec.kv_quant_mode != KVQuantMode.NONE:
        return spec
    mode = get_kv_quant_mode(spec.cache_dtype_str or "auto")
    return spec if mode == KVQuantMode.NONE else dataclasses.replace(spec, kv_quant_mode=mode)


def head_major_topk(buffer: Any) -> Any:
    """The head-major ``[H, T, K]`` view the Triton indexer and attend impls of 0.25.1 slice,
    of the NVIDIA model's token-major ``[T, H, K]`` top-k buffer (same storage: element
    (h, n, k) of the view is element (n, h, k) of the buffer); None stays None."""
    return None if buffer is None else buffer.transpose(0, 1)


def _reading_head_major(forward: Callable[..., Any], owner: Callable[..., Any]) -> Any:
    """``forward`` run while ``owner(self, *args)`` (the object whose ``topk_indices_buffer``
    the impl reads) holds the head-major view of its buffer; restored after the call."""
    @functools.wraps(forward)
    def wrapped(self: Any, *args: Any, **kwargs: Any) -> Any:
        obj = owner(self, *args)
        token_major = obj.topk_indices_buffer
        obj.topk_indices_buffer = head_major_topk(token_major)
        try:
            return forward(self, *args, **kwargs)
        finally:
            obj.topk_indices_buffer = token_major

    wrapped.kvtier_fix = True  # type: ignore[attr-defined]
    return wrapped


def _fix_mla_quant_mode() -> str:
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention

    original: Callable[..., Any] = MLAAttention.get_kv_cache_spec
    if not getattr(original, "kvtier_fix", False):
        def get_kv_cache_spec(self: Any, vllm_config: Any) -> Any:
            return with_quant_mode(original(self, vllm_config))

        get_kv_cache_spec.kvtier_fix = True  # type: ignore[attr-defined]
        MLAAttention.get_kv_cache_spec = get_kv_cache_spec  # type: ignore[method-assign]
    return FIX_MLA_QUANT_MODE


def _fix_m3_topk_layout() -> str | None:
    """Wrap the Triton impls' ``forward`` (the indexer reads ``self.topk_indices_buffer``, the
    attend ``layer.topk_indices_buffer``, its first argument); None where the fix does not
    apply (ROCm: its model allocates the buffer head-major)."""
    from vllm.platforms import current_platform

    if current_platform.is_rocm():
        return None
    from vllm.models.minimax_m3.common.indexer import MiniMaxM3IndexerTritonImpl
    from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseTritonImpl

    if not getattr(MiniMaxM3IndexerTritonImpl.forward, "kvtier_fix", False):
        MiniMaxM3IndexerTritonImpl.forward = _reading_head_major(  # type: ignore[method-assign]
            MiniMaxM3IndexerTritonImpl.forward, lambda impl, *a: impl)
    if not getattr(MiniMaxM3SparseTritonImpl.forward, "kvtier_fix", False):
        MiniMaxM3SparseTritonImpl.forward = _reading_head_major(  # type: ignore[method-assign]
            MiniMaxM3SparseTritonImpl.forward, lambda impl, layer, *a: layer)
    return FIX_M3_TOPK_LAYOUT


def apply_vllm_fixes() -> list[str]:
    """On vLLM 0.25.x, the fixes of the module docstring (idempotent); the fixes applied,
    none on other versions."""
    import vllm

    if not vllm.__version__.startswith("0.25."):
        return []
    applied = [_fix_mla_quant_mode(), _fix_m3_topk_layout()]
    return [f for f in applied if f]
