"""Run by test_layout_vllm025.py in a subprocess with the vLLM 0.25.1 sources first on the path.

Registers tiny caches (1 and 2 blocks, with and without kernel-block splitting) exactly as
0.25.1 builds them: the backend's ``get_kv_cache_shape(kernel_num_blocks, ...)`` and
``get_kv_cache_stride_order()`` through vLLM's own ``_reshape_attention_kv_cache``
(v1/worker/gpu/attn_utils.py), the hybrid restride of
``gpu_model_runner._update_hybrid_attention_mamba_layout`` and its mamba state views. Then:
``kvtier.vllm.block_axes.registered_block_axes`` gives vLLM's own block dim
(``AttentionBackend.get_kv_cache_block_dim``), kvtier's core refuses to guess it from sizes,
and the layout built with it moves exactly the bytes vLLM addresses as each block.

Prints one JSON line: the cases checked. Any failure raises (non-zero exit).
"""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch
import vllm
import vllm.v1.attention.backends.utils as backend_utils
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MambaSpec,
)
from vllm.v1.worker.gpu.attn_utils import _reshape_attention_kv_cache

from _kvcheck import check_group
from kvtier.layout import GroupKind, GroupSpec, LayoutError, build_layout
from kvtier.vllm.block_axes import BlockAxisUnknown, registered_block_axes

assert vllm.__version__.startswith("0.25.1"), vllm.__version__

KERNEL_BLOCK = 16
HEADS, HEAD_SIZE = 8, 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(2)]


def attention_caches(backend: type, num_blocks: int, ratio: int, restride: bool = False,
                     ) -> tuple[dict[str, torch.Tensor], FullAttentionSpec]:
    """Two layers registered the way 0.25.1's runner registers them (one raw buffer each)."""
    spec = FullAttentionSpec(block_size=KERNEL_BLOCK * ratio, num_kv_heads=HEADS,
                             head_size=HEAD_SIZE, dtype=torch.bfloat16)
    kernel_num_blocks = num_blocks * ratio
    shape = backend.get_kv_cache_shape(kernel_num_blocks, KERNEL_BLOCK, HEADS, HEAD_SIZE,
                                       cache_dtype_str="auto")
    try:
        order = tuple(backend.get_kv_cache_stride_order())
    except (AttributeError, NotImplementedError):
        order = tuple(range(len(shape)))
    kvs = {}
    for name in NAMES:
        raw = torch.zeros(num_blocks * spec.page_size_bytes, dtype=torch.int8)
        kv = _reshape_attention_kv_cache(raw, spec, shape, order, kernel_num_blocks, None)
        if restride:  # gpu_model_runner._update_hybrid_attention_mamba_layout, block dim 1
            hidden = kv.shape[2:].numel()
            kv.as_strided_(size=kv.shape, stride=(hidden, 2 * hidden, *kv.stride()[2:]))
        kvs[name] = kv
    return kvs, spec


def config(num_blocks: int, groups: list[tuple[list[str], object]], sizes: dict[str, int],
           ) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=sizes[n], shared_by=[n]) for n in sizes],
        kv_cache_groups=[KVCacheGroupSpec(names, spec) for names, spec in groups],
    )


def check_every_block(layout_group: object, addressers: list, num_blocks: int) -> None:
    check_group(layout_group, addressers, ids=list(range(num_blocks)), blocks_per_chunk=1)


def attention_case(backend: type, num_blocks: int, ratio: int, restride: bool) -> str:
    kvs, spec = attention_caches(backend, num_blocks, ratio, restride)
    cfg = config(num_blocks, [(NAMES, spec)], {n: num_blocks * spec.page_size_bytes
                                                for n in NAMES})
    layers = {n: SimpleNamespace(attn_backend=backend) for n in NAMES}
    truth = backend.get_kv_cache_block_dim(KERNEL_BLOCK, HEADS, HEAD_SIZE)  # vLLM's own
    axes = registered_block_axes(kvs, cfg, layers, "auto")
    assert axes == {n: truth for n in NAMES}, (axes, truth)
    groups = [GroupSpec(GroupKind.FULL, spec.block_size, tuple(NAMES))]
    try:
        build_layout(kvs, groups, num_blocks)
    except LayoutError as e:
        assert "ambiguous" in str(e), e
    else:
        raise AssertionError(f"{backend.__name__} x{num_blocks}: the block axis was guessed "
                             f"from sizes {tuple(kvs[NAMES[0]].shape)}")
    lay = build_layout(kvs, groups, num_blocks, block_axes=axes)
    assert lay.group(0).bytes_per_block == 2 * spec.page_size_bytes
    check_every_block(lay.group(0), [lambda b, kv=kvs[n]: kv.narrow(truth, b * ratio, ratio)
                                     for n in NAMES], num_blocks)
    return f"{backend.__name__} nb={num_blocks} ratio={ratio} restride={restride}"


def offset_of(shapes: tuple[tuple[int, ...], ...], dtypes: tuple[torch.dtype, ...]) -> int:
    return sum(math.prod(sh) * dt.itemsize for sh, dt in zip(shapes, dtypes))


def mamba_case(num_blocks: int) -> str:
    """A mamba layer's list of state views beside an attention layer (axis 0 of each)."""
    kvs_attn, attn_spec = attention_caches(FlashAttentionBackend, num_blocks, 1)
    shapes, dtypes = ((3, 288), (8, 32, 16)), (torch.bfloat16, torch.float32)
    mspec = MambaSpec(block_size=KERNEL_BLOCK, shapes=shapes, dtypes=dtypes,
                      page_size_padded=offset_of(shapes, dtypes) + 4096)  # padded pages
    raw = torch.zeros(num_blocks * mspec.page_size_bytes, dtype=torch.int8)
    states, offset = [], 0
    for shape, dtype in zip(shapes, dtypes):  # gpu_model_runner._reshape_kv_cache_tensors
        stride = torch.empty((num_blocks, *shape)).stride()
        states.append(torch.as_strided(raw.view(dtype), (num_blocks, *shape),
                                       (mspec.page_size_bytes // dtype.itemsize, *stride[1:]),
                                       offset // dtype.itemsize))
        offset += stride[0] * dtype.itemsize
    mixer = "model.layers.2.mixer"
    kvs = {NAMES[0]: kvs_attn[NAMES[0]], mixer: states}
    cfg = config(num_blocks, [([NAMES[0]], attn_spec), ([mixer], mspec)],
                 {NAMES[0]: num_blocks * attn_spec.page_size_bytes,
                  mixer: num_blocks * mspec.page_size_bytes})
    layers = {NAMES[0]: SimpleNamespace(attn_backend=FlashAttentionBackend)}
    axes = registered_block_axes(kvs, cfg, layers, "auto")
    assert axes == {NAMES[0]: 0, mixer: 0}, axes
    groups = [GroupSpec(GroupKind.FULL, KERNEL_BLOCK, (NAMES[0],)),
              GroupSpec(GroupKind.STATE, KERNEL_BLOCK, (mixer,))]
    lay = build_layout(kvs, groups, num_blocks, block_axes=axes)
    assert lay.group(1).bytes_per_block == offset
    check_every_block(lay.group(1), [lambda b, t=t: t[b] for t in states], num_blocks)
    check_every_block(lay.group(0), [lambda b: kvs_attn[NAMES[0]][b]], num_blocks)
    return f"mamba nb={num_blocks}"


def page_size_fallback_case() -> str:
    """A layer without a backend to ask: the page size decides only where no other dimension
    could hold the blocks (7 blocks); with 2 blocks it is a clear error, not a guess."""
    for backend, num_blocks, want in ((FlashAttentionBackend, 7, 0),
                                      (RocmAttentionBackend, 7, None),
                                      (FlashAttentionBackend, 2, None),
                                      (RocmAttentionBackend, 2, None)):
        kvs, spec = attention_caches(backend, num_blocks, 1)
        cfg = config(num_blocks, [(NAMES, spec)], {n: num_blocks * spec.page_size_bytes
                                                    for n in NAMES})
        if want is None:
            try:
                registered_block_axes(kvs, cfg, {}, "auto")
            except BlockAxisUnknown as e:
                assert repr(NAMES[0]) in str(e) and "page size" in str(e), e
            else:
                raise AssertionError(f"{backend.__name__} x{num_blocks}: guessed an axis")
        else:
            assert registered_block_axes(kvs, cfg, {}, "auto") == {n: want for n in NAMES}
    return "page-size fallback"


def main() -> None:
    done = []
    for layout in ("NHD", "HND"):
        backend_utils._KV_CACHE_LAYOUT_OVERRIDE = layout  # type: ignore[assignment]
        for num_blocks in (1, 2):
            for ratio in (1, 2):
                done.append(layout + " " + attention_case(FlashAttentionBackend, num_blocks,
                                                          ratio, False))
    for num_blocks in (1, 2):
        for ratio in (1, 2):
            for backend in (RocmAttentionBackend, TritonAttentionBackend):
                done.append(attention_case(backend, num_blocks, ratio, False))
            done.append(attention_case(RocmAttentionBackend, num_blocks, ratio, True))
        done.append(mamba_case(num_blocks))
    done.append(page_size_fallback_case())
    print(json.dumps(done))


if __name__ == "__main__":
    main()
