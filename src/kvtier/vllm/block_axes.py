"""The block axis of every registered KV-cache tensor, from what vLLM declares.

:mod:`kvtier.layout` never takes the block axis from sizes: with 1 or 2 blocks (or a K/V axis
of 2 beside kernel blocks) sizes are coincidences, and a wrong axis copies the wrong bytes
silently. This module asks vLLM instead, per layer of kvtier's groups:

- vLLM 0.32 registers views made by ``create_kv_cache_views``, block-major by construction:
  axis 0 of every view.
- vLLM 0.25.1 registers, per attention layer, ``raw.view(physical).permute(*inv_order)`` with
  ``physical`` the backend's ``get_kv_cache_shape(kernel_num_blocks, ...)`` reordered by
  ``get_kv_cache_stride_order()`` (v1/worker/gpu/attn_utils.py ``_reshape_attention_kv_cache``;
  the hybrid restride only changes strides). The registered tensor is therefore in the
  *logical* order of ``get_kv_cache_shape``, and its block axis is where a sentinel block count
  lands in that shape: the probe of vLLM's ``AttentionBackend.get_kv_cache_block_dim``, done
  with two sentinels so that a token-major ``(nb * bs, ...)`` shape is found too. (The stride
  order maps it to a *physical* position, which only a tensor kept in physical order needs:
  the cross-layer tensor of ``register_cross_layers_kv_cache``, :func:`cross_layer_block_axis`.)
  A layer whose backend cannot be probed falls back to the allocation's page size (how vLLM's
  OffloadingConnector addresses blocks), only where it cannot be a coincidence: the one
  dimension that steps ``page_size_bytes`` per manager block must also be the only one whose
  size is a multiple of ``num_blocks`` (with 2 blocks, a K/V axis of 2 in front also steps a
  page, so there it is an error, not a guess).
- A mamba layer (``MambaSpec``) registers a list of ``(num_blocks, *state_shape)`` tensors:
  axis 0 of each.

Where none of these tells, :class:`BlockAxisUnknown` names the layer, and the engine does not
start with a layout kvtier would have had to guess.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from kvtier.layout import LayoutError

try:  # vLLM 0.32: every layer is a [B, ...] view made by create_kv_cache_views
    from vllm.v1.kv_cache_interface import create_kv_cache_views  # noqa: F401

    VIEWS_ARE_BLOCK_MAJOR = True
except ImportError:
    VIEWS_ARE_BLOCK_MAJOR = False

# Two block counts no other dimension of a KV cache has (primes, far above head counts, head
# sizes and block sizes): the one dimension that follows them is the block axis.
SENTINELS = (1_234_567, 7_654_321)


class BlockAxisUnknown(LayoutError):
    """vLLM does not say which dimension of a registered tensor holds the blocks."""


def registered_block_axes(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    kv_cache_config: Any,
    layers: Mapping[str, Any],
    cache_dtype: str,
) -> dict[str, int]:
    """``{layer: block axis}`` for every registered layer of ``kv_cache_config``'s groups.

    ``layers`` maps layer names to vLLM's layer objects (``static_forward_context``), whose
    ``attn_backend`` is probed; ``cache_dtype`` is the engine's ``cache_config.cache_dtype``.
    Raises :class:`BlockAxisUnknown` for a layer whose axis vLLM does not declare.
    """
    num_blocks = int(kv_cache_config.num_blocks)
    axes: dict[str, int] = {}
    for group in kv_cache_config.kv_cache_groups:
        per_layer = getattr(group.kv_cache_spec, "kv_cache_specs", None) or {}
        for name in group.layer_names:
            if name not in kv_caches:
                continue  # build_layout reports layers without a cache
            spec = per_layer.get(name, group.kv_cache_spec)
            axes[name] = _block_axis(name, kv_caches[name], spec, layers.get(name),
                                     cache_dtype, num_blocks)
    return axes


def _block_axis(name: str, kv: torch.Tensor | Sequence[torch.Tensor], spec: Any, layer: Any,
                cache_dtype: str, num_blocks: int) -> int:
    if VIEWS_ARE_BLOCK_MAJOR or _is_state(spec):
        return 0
    if not isinstance(kv, torch.Tensor):
        raise BlockAxisUnknown(f"layer {name!r}: an attention spec ({type(spec).__name__}) "
                               f"registered {type(kv).__name__}, not one tensor")
    backend = _backend_of(layer)
    why = "its layer has no attention backend to ask"
    if backend is not None:
        try:
            axis, rank = probe_block_dim(backend, spec, cache_dtype)
        except (ValueError, TypeError, AssertionError, NotImplementedError) as e:
            why = f"{backend.__name__}.get_kv_cache_shape could not be probed ({e})"
        else:
            if kv.dim() != rank or kv.shape[axis] % num_blocks:
                raise BlockAxisUnknown(
                    f"layer {name!r}: {backend.__name__} declares block dim {axis} of a "
                    f"{rank}-dim shape, but the registered tensor is {tuple(kv.shape)} for "
                    f"{num_blocks} blocks")
            return axis
    axis = page_size_axis(kv, spec, num_blocks)
    if axis is None:
        raise BlockAxisUnknown(
            f"layer {name!r}: vLLM does not say which dimension holds the blocks: {why}, and "
            f"no single dimension steps the page size ({_page_bytes(spec)} bytes) per block "
            f"(shape {tuple(kv.shape)}, strides {tuple(kv.stride())}, "
            f"num_blocks {num_blocks})")
    return axis


def cross_layer_block_axis(kv: torch.Tensor, backend: Any, spec: Any, cache_dtype: str,
                           num_blocks: int) -> int:
    """The block axis of 0.25.1's cross-layer tensor (``allocate_uniform_kv_caches``): the
    backend's ``get_kv_cache_shape`` with a layer axis in front, in the physical order of
    ``get_kv_cache_stride_order(include_num_layers_dimension=True)`` (identity where the
    backend has none). Raises :class:`BlockAxisUnknown` where the tensor does not match."""
    try:
        axis, rank = probe_block_dim(backend, spec, cache_dtype)
    except (ValueError, TypeError, AssertionError, NotImplementedError) as e:
        raise BlockAxisUnknown(f"the cross-layer KV cache: {getattr(backend, '__name__', backend)}"
                               f".get_kv_cache_shape could not be probed ({e})") from None
    try:
        order = tuple(backend.get_kv_cache_stride_order(include_num_layers_dimension=True))
    except (AttributeError, NotImplementedError, TypeError):
        order = tuple(range(rank + 1))
    if sorted(order) != list(range(rank + 1)) or kv.dim() != rank + 1:
        raise BlockAxisUnknown(f"the cross-layer KV cache {tuple(kv.shape)}: its backend's "
                               f"stride order {order} does not fit a {rank}-dim shape plus "
                               "the layer axis")
    physical = order.index(axis + 1)
    if kv.shape[physical] % num_blocks:
        raise BlockAxisUnknown(f"the cross-layer KV cache {tuple(kv.shape)}: dimension "
                               f"{physical} (the blocks, by the backend) is not a multiple of "
                               f"{num_blocks} blocks")
    return physical


def probe_block_dim(backend: Any, spec: Any, cache_dtype: str) -> tuple[int, int]:
    """``(block dim, rank)`` of ``backend.get_kv_cache_shape`` for the layer's own block size,
    heads, head size and cache dtype: the one dimension that follows the block count."""
    a, b = (_probe(backend, spec, cache_dtype, s) for s in SENTINELS)
    moved = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != len(b) or len(moved) != 1 or a[moved[0]] % SENTINELS[0]:
        raise ValueError(f"no single dimension follows the block count: {a} vs {b}")
    return moved[0], len(a)


def _probe(backend: Any, spec: Any, cache_dtype: str, num_blocks: int) -> tuple[int, ...]:
    block_size = int(getattr(spec, "storage_block_size", None) or spec.block_size)
    return tuple(backend.get_kv_cache_shape(
        num_blocks, block_size, int(spec.num_kv_heads), int(spec.head_size),
        cache_dtype_str=_layer_cache_dtype(spec, cache_dtype)))


def _layer_cache_dtype(spec: Any, cache_dtype: str) -> str:
    """The cache dtype string 0.25.1's runner passes for this layer (unquantized: 'auto')."""
    mode = getattr(spec, "kv_quant_mode", None)
    if mode is not None and getattr(mode, "name", "") == "NONE":
        return "auto"
    return str(getattr(spec, "cache_dtype_str", None) or cache_dtype)


def page_size_axis(kv: torch.Tensor, spec: Any, num_blocks: int) -> int | None:
    """The dimension that steps the allocation's page (``spec.page_size_bytes``, padding
    included) per block, if it is the only dimension whose size is a multiple of
    ``num_blocks``; else None (memory alone cannot tell K/V-first from block-first)."""
    page = _page_bytes(spec)
    if page is None:
        return None
    es = kv.element_size()
    multiples = [i for i, size in enumerate(kv.shape) if size % num_blocks == 0]
    if len(multiples) != 1:
        return None
    (i,) = multiples
    return i if kv.stride(i) * es * (kv.shape[i] // num_blocks) == page else None


def _page_bytes(spec: Any) -> int | None:
    page = getattr(spec, "page_size_bytes", None)
    return int(page) if page else None


def _is_state(spec: Any) -> bool:
    """Mamba-like recurrent state (the same test as kvtier.vllm.groups)."""
    return "Mamba" in type(spec).__name__ or hasattr(spec, "mamba_type")


def _backend_of(layer: Any) -> Any:
    if layer is None:
        return None
    get = getattr(layer, "get_attn_backend", None)
    if callable(get):
        try:
            return get()
        except (AttributeError, NotImplementedError):
            pass
    return getattr(layer, "attn_backend", None)
