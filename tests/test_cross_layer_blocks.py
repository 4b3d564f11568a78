"""``cross_layer_blocks``: vLLM 0.25.1's one KV-cache tensor of every layer
(``allocate_uniform_kv_caches``, then ``register_cross_layers_kv_cache`` in place of
``register_kv_caches``), through kvtier's real worker side on CPU tensors.

vLLM 0.32 (the CPU build these tests run) has no cross-layer path, so the tensor is built here
as 0.25.1 builds it: the backend's ``get_kv_cache_shape`` with a layer axis in front, in the
physical order of ``get_kv_cache_stride_order(include_num_layers_dimension=True)``; the
backend below answers both as 0.25.1's FLASH_ATTN does (``attention/backends/flash_attn.py``),
for its NHD and HND cache layouts.
"""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from kvtier.protocol import Job, TransferOp
from tests.harness.compat import BLOCK_SIZE, LAYERS
from tests.test_connector_startup import _configs

ORDERS = {"NHD": (1, 0, 2, 3, 4, 5), "HND": (1, 4, 0, 2, 3, 5)}


def _backend(layout: str) -> type:
    class FlashAttnLike:
        @staticmethod
        def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int,
                               head_size: int, cache_dtype_str: str = "auto"
                               ) -> tuple[int, ...]:
            return (num_blocks, 2, block_size, num_kv_heads, head_size)

        @staticmethod
        def get_kv_cache_stride_order(include_num_layers_dimension: bool = False
                                      ) -> tuple[int, ...]:
            assert include_num_layers_dimension
            return ORDERS[layout]

    FlashAttnLike.__name__ = f"FlashAttnLike{layout}"
    return FlashAttnLike


def _connector(extra: dict[str, Any]) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.connector import KvtierConnector

    cfg, kvc = _configs("recompute", {"dram_size": "8MiB", **extra})
    return KvtierConnector(cfg, KVConnectorRole.WORKER, kvc), kvc


def _cross_tensor(layout: str, num_blocks: int) -> tuple[torch.Tensor, int]:
    """The cross-layer tensor as allocate_uniform_kv_caches makes it, filled with distinct
    values, and its block axis."""
    spec = _configs("recompute", {})[1].kv_cache_groups[0].kv_cache_spec
    shape = _backend(layout).get_kv_cache_shape(num_blocks, BLOCK_SIZE, spec.num_kv_heads,
                                                spec.head_size)
    logical = (len(LAYERS), *shape)
    physical = tuple(logical[i] for i in ORDERS[layout])
    kv = torch.arange(torch.Size(physical).numel(), dtype=torch.float32).view(physical)
    return kv, ORDERS[layout].index(1)


def _drain(engine: Any, want: set[int]) -> dict[int, Any]:
    got: dict[int, Any] = {}
    deadline = time.monotonic() + 30
    while not want <= set(got) and time.monotonic() < deadline:
        engine.wait(0.05)
        got.update({c.job_id: c for c in engine.poll()})
    assert want <= set(got), f"jobs {want - set(got)} never completed"
    return got


def test_asked_for_only_where_the_block_is_just_bytes() -> None:
    on, _ = _connector({"cross_layer_blocks": True})
    off, _ = _connector({})
    assert on.prefer_cross_layer_blocks and not off.prefer_cross_layer_blocks
    fp8, _ = _connector({"cross_layer_blocks": True})
    object.__setattr__(fp8.worker_side.setup, "kv_cache_dtype", "fp8")  # scales per layer
    assert not fp8.prefer_cross_layer_blocks
    drafts, _ = _connector({"cross_layer_blocks": True})
    object.__setattr__(drafts.worker_side.setup, "draft_lookahead", 1)
    assert not drafts.prefer_cross_layer_blocks


@pytest.mark.parametrize("layout", sorted(ORDERS))
def test_one_segment_of_every_layer_and_an_exact_round_trip(layout: str) -> None:
    """The registered tensor becomes one segment per block (all layers' bytes of the block,
    in memory order); chunks saved from some blocks and loaded into others through the
    worker's own engine carry every layer's bytes; the fingerprint differs from the
    per-layer registration of the same cache (a slab shared with such an engine never mixes
    the two formats)."""
    c, kvc = _connector({"cross_layer_blocks": True})
    kv, axis = _cross_tensor(layout, kvc.num_blocks)
    c.register_cross_layers_kv_cache(kv, _backend(layout))
    worker = c.worker_side.worker
    assert worker is not None
    group = worker.mover.layout.group(0)
    page = kv.element_size() * kv[(slice(None),) * axis + (0,)].numel()
    assert len(group.segments) == 1 and group.bytes_per_block == page
    bpc = worker.geometry.blocks_per_chunk(0)
    src, dst = list(range(bpc)), list(range(2 * bpc, 3 * bpc))
    worker.engine.save(Job(1, "a", [TransferOp(0, 0, src, seed=11)]))
    assert _drain(worker.engine, {1})[1].ok
    before = kv.clone()
    worker.engine.load(Job(2, "r", [TransferOp(0, 0, dst, seed=11)]))
    assert _drain(worker.engine, {2})[2].ok
    for s, d in zip(src, dst):
        assert torch.equal(kv.select(axis, d), before.select(axis, s)), (s, d)
    untouched = [b for b in range(kvc.num_blocks) if b not in dst]
    assert torch.equal(kv.index_select(axis, torch.tensor(untouched)),
                       before.index_select(axis, torch.tensor(untouched)))

    per_layer, _ = _connector({})
    views = kv.permute(*[ORDERS[layout].index(i) for i in range(kv.dim())])
    per_layer.register_kv_caches({name: views[i] for i, name in enumerate(LAYERS)})
    assert per_layer.worker_side.worker is not None
    assert (per_layer.worker_side.worker.mover.layout.fingerprint
            != worker.mover.layout.fingerprint)
    for conn in (c, per_layer):
        conn.shutdown()


def test_a_per_layer_registration_under_the_setting_says_why(
        kvtier_caplog: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM may register one tensor per layer although ``cross_layer_blocks`` is set (0.25.1's
    V2 model runner never allocates the cross-layer tensor; a model that does not qualify is
    never offered it; 0.32, the build here, has no such path): kvtier serves per layer and
    says why in one warning; without the setting it says nothing."""
    from kvtier.vllm import compat

    spec = _configs("recompute", {})[1].kv_cache_groups[0].kv_cache_spec
    for extra, fp8, has_path, says in (
            ({"cross_layer_blocks": True}, False, True, "V1 model runner"),
            ({"cross_layer_blocks": True}, True, True, "does not qualify"),
            ({"cross_layer_blocks": True}, False, False, "no cross-layer registration"),
            ({}, False, True, None)):
        monkeypatch.setattr(compat, "HAS_CROSS_LAYER_REGISTRATION", has_path)
        kvtier_caplog.clear()
        c, kvc = _connector(extra)
        if fp8:
            object.__setattr__(c.worker_side.setup, "kv_cache_dtype", "fp8")
        shape = (kvc.num_blocks, 2, BLOCK_SIZE, spec.num_kv_heads, spec.head_size)
        c.register_kv_caches({name: torch.zeros(shape) for name in LAYERS})
        assert c.worker_side.worker is not None  # serves per layer
        warned = [r.getMessage() for r in kvtier_caplog.records
                  if "cross_layer_blocks" in r.getMessage()]
        if says is None:
            assert not warned, warned
        else:
            assert len(warned) == 1 and says in warned[0], warned
        c.shutdown()


@pytest.mark.parametrize("cut,says", [("blocks", "not a multiple of"),
                                       ("layers", "bytes per block")])
def test_a_tensor_that_does_not_fit_its_group_refuses_to_start(cut: str, says: str) -> None:
    """A block count the backend's block axis does not divide, or fewer layers than the
    group has: one ``kvtier: ...`` line, and no worker."""
    from kvtier.vllm.startup import StartupError

    c, kvc = _connector({"cross_layer_blocks": True})
    kv, _ = _cross_tensor("NHD", kvc.num_blocks)  # physical (blocks, layers, ...)
    bad = kv[:-1] if cut == "blocks" else kv[:, :1]
    with pytest.raises(StartupError) as e:
        c.register_cross_layers_kv_cache(bad, _backend("NHD"))
    line = str(e.value)
    assert "cross-layer KV cache" in line and says in line and "\n" not in line, line
    assert c.worker_side.worker is None


def test_the_layout_asked_of_vllm() -> None:
    """``kv_cache_layout``: vLLM's own choice by default (None), HND or NHD when set; a
    setting that does not parse asks for nothing here (the connector's start-up refuses it
    with its one line)."""
    from kvtier.vllm.connector import KvtierConnector

    for extra, want in (({}, None), ({"kv_cache_layout": "HND"}, "HND"),
                        ({"kv_cache_layout": "NHD"}, "NHD"),
                        ({"kv_cache_layout": "HDN"}, None)):
        cfg, _ = _configs("recompute", extra)
        assert KvtierConnector.get_required_kvcache_layout(cfg) == want, extra
