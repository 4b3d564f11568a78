"""kvtier.codec: blocks <-> chunk-major bytes, on random layouts (hypothesis) and on CUDA.

Random layouts: a tensor per layer with the block axis anywhere (``num_blocks`` times 1-3
kernel blocks / tokens), 0-3 other dims, an optional size-2 K/V dim, a random physical order
(so K/V regions, head-outer, token-major and block-outer layouts all occur), padding gaps in
any dim and a storage offset. Dtypes include both fp8 formats. Every example goes through
:func:`_kvcheck.check_group`: gathered bytes equal the addressed block bytes, the chunk-major
round trip is bit-identical, and nothing outside the listed blocks is written (poisoned).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from _kvcheck import BlockAddresser, check_group, group_storages, poison
from kvtier.codec import (
    CodecError,
    chunk_bytes,
    gather,
    scatter,
    scatter_positions,
    segment_offsets,
)
from kvtier.layout import GroupKind, GroupLayout, GroupSpec, build_layout

SOAK = bool(os.environ.get("KVTIER_SOAK"))
EXAMPLES = 2000 if SOAK else 60
DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8, torch.bfloat16,
          torch.float16, torch.float32]
PRIMES = [7, 11, 13]  # num_blocks: no other dim (at most 5) is a multiple of it


@dataclass
class RandomLayer:
    tensor: torch.Tensor
    block_dim: int
    ratio: int

    def addresser(self) -> BlockAddresser:
        t, d, r = self.tensor, self.block_dim, self.ratio
        if r == 1:
            return lambda b: t.select(d, b)
        return lambda b: t.narrow(d, b * r, r)


@st.composite
def random_layer(draw: st.DrawFn, nb: int, device: str = "cpu") -> RandomLayer:
    dtype = draw(st.sampled_from(DTYPES))
    other = draw(st.lists(st.integers(1, 5), min_size=0, max_size=3))
    if draw(st.booleans()):
        other.insert(draw(st.integers(0, len(other))), 2)  # K and V
    ratio = draw(st.sampled_from([1, 1, 2, 3]))
    block_dim = draw(st.integers(0, len(other)))
    logical = [*other[:block_dim], nb * ratio, *other[block_dim:]]
    order = draw(st.permutations(range(len(logical))))  # physical order, outermost first
    physical = [logical[i] for i in order]
    pads = [draw(st.integers(0, 2)) if draw(st.booleans()) else 0 for _ in physical]
    padded = [p + q for p, q in zip(physical, pads)]
    lead = draw(st.integers(0, 3))
    base = torch.empty(lead + math.prod(padded), dtype=dtype, device=device)
    t = base[lead:].view(padded)[tuple(slice(0, p) for p in physical)]
    inv = [order.index(i) for i in range(len(order))]
    return RandomLayer(t.permute(*inv), block_dim, ratio)


@st.composite
def random_group(draw: st.DrawFn, device: str = "cpu"
                 ) -> tuple[GroupLayout, list[RandomLayer], int]:
    nb = draw(st.sampled_from(PRIMES))
    n = draw(st.integers(1, 3))
    layers = [draw(random_layer(nb, device)) for _ in range(n)]
    names = [f"model.layers.{i}.attn" for i in range(n)]
    lay = build_layout(dict(zip(names, (x.tensor for x in layers))),
                       [GroupSpec(GroupKind.FULL, 16, tuple(names))], nb)
    return lay.group(0), layers, nb


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
@pytest.mark.soak
def test_round_trip_on_random_layouts(data: st.DataObject) -> None:
    group, layers, nb = data.draw(random_group())
    per_chunk = data.draw(st.integers(1, 3))
    count = data.draw(st.integers(0, nb // per_chunk)) * per_chunk
    ids = data.draw(st.permutations(range(nb)))[:count]
    check_group(group, [x.addresser() for x in layers], ids=ids, blocks_per_chunk=per_chunk,
                seed=data.draw(st.integers(0, 2**16)))


@settings(max_examples=EXAMPLES, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
@pytest.mark.soak
def test_bad_block_ids_are_rejected_before_a_byte_moves(data: st.DataObject) -> None:
    group, _, nb = data.draw(random_group())
    per_chunk = data.draw(st.integers(1, 3))
    good = data.draw(st.permutations(range(nb)))[: (nb // per_chunk) * per_chunk]
    kind = data.draw(st.sampled_from(["duplicate", "negative", "too_large", "ragged"]))
    ids = list(good)
    if kind == "duplicate":
        if len(ids) < 2:
            ids = [0, 0] * per_chunk
        else:
            ids[data.draw(st.integers(1, len(ids) - 1))] = ids[0]
    elif kind == "negative":
        ids[data.draw(st.integers(0, max(0, len(ids) - 1)))] = -data.draw(st.integers(1, 50))
    elif kind == "too_large":
        ids[data.draw(st.integers(0, max(0, len(ids) - 1)))] = nb + data.draw(st.integers(0, 9))
    else:
        if per_chunk == 1:
            per_chunk = 2
        ids = ids[: per_chunk + 1] if len(ids) > per_chunk else [0] * (per_chunk - 1) + [1]
        ids = list(dict.fromkeys(ids))
        if len(ids) % per_chunk == 0:
            ids = ids[:-1]
    storages = group_storages(group)
    before = poison(storages, seed=1)
    n_chunks = max(1, math.ceil(len(ids) / per_chunk))
    buf = torch.zeros(n_chunks * chunk_bytes(group, per_chunk), dtype=torch.uint8)
    with pytest.raises(CodecError):
        gather(group, ids, per_chunk, buf)
    assert int(buf.count_nonzero()) == 0
    with pytest.raises(CodecError):
        scatter(group, ids, per_chunk, buf)
    assert all(torch.equal(s, b) for s, b in zip(storages, before))


# --- the byte format and the buffer contract --------------------------------------------------

def _simple_group(nb: int = 7) -> tuple[GroupLayout, torch.Tensor, torch.Tensor]:
    k = torch.arange(2 * nb * 4 * 3, dtype=torch.int16).view(2, nb, 4, 3)  # K/V regions
    s = torch.arange(nb * 5, dtype=torch.float32).view(nb, 5) + 0.5
    lay = build_layout({"model.layers.0.attn": k, "model.layers.1.attn": s},
                       [GroupSpec(GroupKind.FULL, 16, ("model.layers.0.attn",
                                                        "model.layers.1.attn"))], nb)
    return lay.group(0), k, s


def test_chunk_major_format() -> None:
    group, k, s = _simple_group()
    assert [seg.role for seg in group.segments] == ["k", "v", "kv"]
    ids = [3, 1, 6, 0]
    out = torch.empty(2 * chunk_bytes(group, 2), dtype=torch.uint8)
    gather(group, ids, 2, out)
    offs = segment_offsets(group, 2)
    assert offs == [0, 2 * 24, 4 * 24]
    for c, chunk in enumerate(out.view(2, -1)):
        blocks = ids[2 * c : 2 * c + 2]
        want = torch.cat([
            *(k[0, b].contiguous().view(torch.uint8).flatten() for b in blocks),
            *(k[1, b].contiguous().view(torch.uint8).flatten() for b in blocks),
            *(s[b].contiguous().view(torch.uint8).flatten() for b in blocks),
        ])
        assert torch.equal(chunk, want)


def test_empty_block_list_moves_nothing() -> None:
    group, k, _ = _simple_group()
    before = k.clone()
    gather(group, [], 1, torch.empty(0, dtype=torch.uint8))
    scatter(group, [], 3, torch.empty(0, dtype=torch.uint8))
    assert torch.equal(k, before)


@pytest.mark.parametrize("buf", [
    torch.empty(10, dtype=torch.uint8),  # too small
    torch.empty(1000, dtype=torch.int8),  # wrong dtype
    torch.empty(2, 1000, dtype=torch.uint8),  # not 1-D
    torch.empty(2000, dtype=torch.uint8)[::2],  # not contiguous
])
def test_bad_buffers_are_rejected(buf: torch.Tensor) -> None:
    group, k, _ = _simple_group()
    before = k.clone()
    with pytest.raises(CodecError):
        gather(group, [1, 2], 2, buf)
    with pytest.raises(CodecError):
        scatter(group, [1, 2], 2, buf)
    assert torch.equal(k, before)


def test_buffer_bytes_beyond_the_chunks_are_untouched() -> None:
    group, _, _ = _simple_group()
    need = chunk_bytes(group, 1) * 2
    buf = torch.full((need + 17,), 0xAB, dtype=torch.uint8)
    gather(group, [4, 2], 1, buf)
    assert bool((buf[need:] == 0xAB).all())


@pytest.mark.parametrize("ids", [[1.0, 2.0], [True, False], ["1", "2"], [1.5, 2]])
def test_block_ids_must_be_integers(ids: Sequence[object]) -> None:
    group, _, _ = _simple_group()
    with pytest.raises(CodecError):
        gather(group, ids, 1, torch.empty(2 * chunk_bytes(group, 1), dtype=torch.uint8))  # type: ignore[arg-type]


def test_numpy_and_tensor_ids_are_accepted() -> None:
    import numpy as np

    group, _, _ = _simple_group()
    a = torch.empty(2 * chunk_bytes(group, 1), dtype=torch.uint8)
    b, c = torch.empty_like(a), torch.empty_like(a)
    gather(group, [5, 2], 1, a)
    gather(group, np.array([5, 2]), 1, b)  # type: ignore[arg-type]
    gather(group, torch.tensor([5, 2]), 1, c)  # type: ignore[arg-type]
    assert torch.equal(a, b) and torch.equal(a, c)


def test_scatter_positions_skips_null_blocks() -> None:
    """One chunk loaded into a request whose block table holds null blocks (outside a
    sliding window, or already in the prefix cache): only the real positions are written."""
    group, _, _ = _simple_group()
    src = torch.empty(chunk_bytes(group, 3), dtype=torch.uint8)
    gather(group, [4, 5, 6], 3, src)
    block5 = torch.empty(chunk_bytes(group, 1), dtype=torch.uint8)
    gather(group, [5], 1, block5)
    storages = group_storages(group)
    before = poison(storages, seed=5)
    poisoned2 = torch.empty_like(block5)
    gather(group, [2], 1, poisoned2)
    scatter_positions(group, [0, 2, 0], 3, src, skip=0)  # position 1 (block 5's) -> block 2
    got = torch.empty_like(block5)
    gather(group, [2], 1, got)
    assert torch.equal(got, block5)
    scatter(group, [2], 1, poisoned2)  # undo block 2: then nothing else may differ
    assert all(torch.equal(st_, b) for st_, b in zip(storages, before))
    for bad in ([1, 1, 0], [1, 99, 0], [1, 2]):
        with pytest.raises(CodecError):
            scatter_positions(group, bad, 3, src, skip=0)
    assert all(torch.equal(st_, b) for st_, b in zip(storages, before))


# --- CUDA ----------------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@settings(max_examples=30 if not SOAK else 500, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_round_trip_on_cuda(data: st.DataObject) -> None:
    group, layers, nb = data.draw(random_group(device="cuda"))
    per_chunk = data.draw(st.integers(1, 3))
    count = data.draw(st.integers(1, nb // per_chunk)) * per_chunk
    ids = data.draw(st.permutations(range(nb)))[:count]
    for buffer_device in ("cpu", "cuda"):
        check_group(group, [x.addresser() for x in layers], ids=ids,
                    blocks_per_chunk=per_chunk, buffer_device=buffer_device)
    torch.cuda.synchronize()
