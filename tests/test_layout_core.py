"""kvtier.layout without an engine: block-axis inference, what cannot be segmented, format order.

(The families of docs/design.md §2.2 are tested on tensors vLLM builds, in test_layout_vllm032.py
and test_layout_vllm025.py.)
"""

from __future__ import annotations

import re

import pytest
import torch

from _kvcheck import check_group
from kvtier.layout import (
    GroupKind,
    GroupSpec,
    LayoutError,
    build_layout,
    layer_index,
    segment_tensor,
)

NB = 11


def one(name: str, t: torch.Tensor, nb: int = NB, **kw: object):  # type: ignore[no-untyped-def]
    return build_layout({name: t}, [GroupSpec(GroupKind.FULL, 16, (name,))], nb, **kw)  # type: ignore[arg-type]


def assert_names_layer_shape_strides(err: LayoutError, name: str, t: torch.Tensor) -> None:
    msg = str(err)
    assert repr(name) in msg, msg
    assert str(tuple(t.shape)) in msg and str(tuple(t.stride())) in msg, msg


@pytest.mark.parametrize(("why", "make"), [
    ("overlap", lambda: torch.empty(NB * 16)
     .as_strided((NB, 16), (8, 1))),  # blocks overlap each other
    ("overlap", lambda: torch.empty(64).as_strided((NB, 4, 4), (4, 1, 2))),  # inside a block
    ("stride 0", lambda: torch.empty(NB, 1, 8).expand(NB, 3, 8)),  # broadcast dim
    ("multiple of num_blocks", lambda: torch.empty(10, 3, 8)),
    ("overlaps the blocks", lambda: torch.empty(NB * 8 + 16).as_strided((NB, 2, 8), (8, 16, 1))),
])
def test_layouts_that_cannot_be_segmented(why: str, make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    with pytest.raises(LayoutError, match=why) as e:
        one("model.layers.4.self_attn.attn", t)
    assert_names_layer_shape_strides(e.value, "model.layers.4.self_attn.attn", t)


def test_ambiguous_block_axis_asks_for_block_axes() -> None:
    # dim 0 is 2 kernel blocks per block; dim 2 happens to be exactly num_blocks.
    t = torch.empty(2 * NB, 3, NB, 4)
    with pytest.raises(LayoutError, match="block_axes") as e:
        one("model.layers.0.attn", t)
    assert_names_layer_shape_strides(e.value, "model.layers.0.attn", t)
    lay = one("model.layers.0.attn", t, block_axes={"model.layers.0.attn": 0})
    assert lay.group(0).bytes_per_block == 2 * 3 * NB * 4 * 4
    check_group(lay.group(0), [lambda b: t[2 * b : 2 * b + 2]])
    # two dims of exactly num_blocks
    with pytest.raises(LayoutError, match="ambiguous"):
        one("model.layers.0.attn", torch.empty(NB, NB, 4))


@pytest.mark.parametrize("nb,make", [
    (1, lambda: torch.empty(1, 2, 16, 8)),  # one block: every dimension is a multiple of 1
    (1, lambda: torch.empty(2, 1, 16, 8)),
    (2, lambda: torch.empty(2, 4, 16, 8)),  # K/V first, 2 kernel blocks per block
    (2, lambda: torch.empty(4, 2, 16, 8)),  # blocks first, 2 kernel blocks, K/V
], ids=["1-blocks-first", "1-kv-first", "2-kv-first-kernel-blocks", "2-blocks-first"])
def test_tiny_block_counts_are_never_guessed(nb: int, make) -> None:  # type: ignore[no-untyped-def]
    """Sizes cannot tell a K/V axis of 2 from 2 blocks: asked for block_axes, never guessed
    (a (2, 4, ...) cache of 2 blocks had its K/V axis taken as the block axis)."""
    t = make()
    with pytest.raises(LayoutError, match="ambiguous") as e:
        one("model.layers.0.attn", t, nb)
    assert_names_layer_shape_strides(e.value, "model.layers.0.attn", t)


def test_kv_first_kernel_blocks_of_two_blocks_with_the_given_axis() -> None:
    t = torch.arange(2 * 4 * 16 * 8, dtype=torch.float32).view(2, 4, 16, 8)
    lay = one("model.layers.0.attn", t, 2, block_axes={"model.layers.0.attn": 1})
    assert [s.role for s in lay.group(0).segments] == ["k", "v"]
    check_group(lay.group(0), [lambda b: t[:, 2 * b : 2 * b + 2]], ids=[1, 0],
                blocks_per_chunk=1)


def test_one_block_of_a_head_outer_layout_keeps_every_head() -> None:
    """With one block the block axis' stride is whatever the view says; a head dimension with
    the same stride was neither inside nor outside the block, and half the bytes were lost."""
    t = torch.arange(2 * 16 * 8, dtype=torch.float32).view(2, 1, 16, 8).transpose(0, 1)
    assert t.stride(0) == t.stride(1)
    lay = one("model.layers.0.attn", t, 1, block_axes={"model.layers.0.attn": 0})
    assert lay.group(0).bytes_per_block == t.numel() * 4
    check_group(lay.group(0), [lambda b: t[b]], ids=[0], blocks_per_chunk=1)


def test_token_major_mla_uses_the_given_block_count() -> None:
    # Other engines store MLA latents token-major: (nb * bs, 1, 576).
    bs = 16
    t = torch.empty(NB * bs, 1, 576, dtype=torch.bfloat16)
    lay = one("model.layers.2.self_attn.attn", t)
    g = lay.group(0)
    assert g.num_blocks == NB and g.bytes_per_block == bs * 576 * 2
    assert len(g.segments) == 1
    check_group(g, [lambda b: t[b * bs : (b + 1) * bs]])


def test_format_order_is_layer_numeric_then_role() -> None:
    names = ["model.layers.10.attn", "model.layers.2.attn", "model.layers.2.indexer.k_cache",
             "model.layers.1.attn"]
    kvs = {n: torch.empty(2, NB, 4) if n.endswith("attn") else torch.empty(NB, 3)
           for n in names}
    lay = build_layout(kvs, [GroupSpec(GroupKind.FULL, 16, tuple(names))], NB)
    order = [(s.layer, s.role) for s in lay.group(0).segments]
    assert order == [
        ("model.layers.1.attn", "k"), ("model.layers.1.attn", "v"),
        ("model.layers.2.attn", "k"), ("model.layers.2.attn", "v"),
        ("model.layers.2.indexer.k_cache", "index"),
        ("model.layers.10.attn", "k"), ("model.layers.10.attn", "v"),
    ]
    assert [layer_index(n) for n in names] == [10, 2, 2, 1]


def test_twelve_pieces_keep_numeric_order() -> None:
    # Heads outside the block axis, 12 of them: region 10 comes after region 9.
    t = torch.arange(12 * NB * 4, dtype=torch.int32).view(12, NB, 4).transpose(0, 1)
    g = one("model.layers.0.attn", t).group(0)
    assert len(g.segments) == 12
    assert [s.offset for s in g.segments] == sorted(s.offset for s in g.segments)
    check_group(g, [lambda b: t[b]])


def test_several_tensors_per_layer_and_missing_layers() -> None:
    conv = torch.empty(NB, 3, 8)
    ssm = torch.empty(NB, 2, 4, 4)
    lay = build_layout({"model.layers.0.mixer": [conv, ssm]},
                       [GroupSpec(GroupKind.STATE, 64, ("model.layers.0.mixer",))], NB)
    g = lay.group(0)
    assert [s.role for s in g.segments] == ["state.0", "state.1"]
    check_group(g, [lambda b: conv[b], lambda b: ssm[b]])
    with pytest.raises(LayoutError, match=re.escape("['model.layers.1.attn']")):
        build_layout({}, [GroupSpec(GroupKind.FULL, 16, ("model.layers.1.attn",))], NB)
    with pytest.raises(LayoutError, match="no KV-cache groups"):
        build_layout({}, [], NB)
    with pytest.raises(LayoutError, match="window"):
        GroupSpec(GroupKind.SLIDING_WINDOW, 16, ("x",))


def test_partially_overlapping_layers_are_an_error() -> None:
    base = torch.empty(NB * 16)
    a = base.as_strided((NB, 8), (16, 1))
    b = base.as_strided((NB, 8), (16, 1), 4)  # shares half of every block with a
    with pytest.raises(LayoutError, match="overlap"):
        build_layout({"model.layers.0.attn": a, "model.layers.1.attn": b},
                     [GroupSpec(GroupKind.FULL, 16, ("model.layers.0.attn",
                                                      "model.layers.1.attn"))], NB)


def test_segment_tensor_is_usable_alone() -> None:
    t = torch.empty(2, NB, 5)
    segs = segment_tensor("model.layers.3.attn", t, NB, "kv")
    assert [(s.role, s.run, s.block_stride) for s in segs] == [("k", 20, 20), ("v", 20, 20)]
    assert segs[1].offset == NB * 20


def test_fingerprint_covers_dtype_shapes_order_and_codec_version(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def fp(kvs: dict[str, torch.Tensor], nb: int = NB, **kw: object) -> str:
        return build_layout(kvs, [GroupSpec(GroupKind.FULL, 16, tuple(sorted(kvs)))], nb,
                            **kw).fingerprint  # type: ignore[arg-type]

    a, b = "model.layers.0.attn", "model.layers.1.attn"
    base = fp({a: torch.empty(NB, 4, 8, dtype=torch.bfloat16),
               b: torch.empty(NB, 2, 8, dtype=torch.bfloat16)})
    assert fp({a: torch.empty(13, 4, 8, dtype=torch.bfloat16),
               b: torch.empty(13, 2, 8, dtype=torch.bfloat16)}, nb=13) == base  # not the count
    assert fp({a: torch.empty(NB, 4, 8, dtype=torch.float16),
               b: torch.empty(NB, 2, 8, dtype=torch.bfloat16)}) != base  # dtype
    assert fp({a: torch.empty(NB, 8, 4, dtype=torch.bfloat16),
               b: torch.empty(NB, 2, 8, dtype=torch.bfloat16)}) != base  # shape
    assert fp({a: torch.empty(8, NB, 4, dtype=torch.bfloat16).transpose(0, 1),
               b: torch.empty(NB, 2, 8, dtype=torch.bfloat16)}) != base  # strides
    assert fp({a: torch.empty(NB, 2, 8, dtype=torch.bfloat16),
               b: torch.empty(NB, 4, 8, dtype=torch.bfloat16)}) != base  # segment order
    assert fp({a: torch.empty(NB, 4, 8, dtype=torch.bfloat16),
               b: torch.empty(NB, 2, 8, dtype=torch.bfloat16)}, kv_cache_dtype="fp8") != base
    monkeypatch.setattr("kvtier.layout.CODEC_VERSION", 99)
    assert fp({a: torch.empty(NB, 4, 8, dtype=torch.bfloat16),
               b: torch.empty(NB, 2, 8, dtype=torch.bfloat16)}) != base  # codec version
