"""The one check every layout test uses: kvtier's segments move exactly the bytes vLLM
addresses as a block, and nothing else.

A *block addresser* is a function ``b -> tensor`` that returns, through the registered tensor's
own indexing, what the engine calls block ``b`` of one layer (``kv[b]``, ``kv[:, b]`` for a
``(2, nb, ...)`` cache, ``kv[b * r:(b + 1) * r]`` for ``r`` kernel blocks per block, ...). The
addressers of a group, in the group's format order, define the expected bytes of a stored
block: each block's bytes in *physical order* (the view's dimensions sorted by stride,
outermost first, which is how the bytes lie in memory), addresser after addresser.

:func:`check_group` then, on random contents and random scattered block ids:

1. gathers one block per chunk and compares with those expected bytes;
2. gathers and scatters several blocks per chunk (the chunk-major format) and checks the
   round trip is bit-identical;
3. poisons every byte of every storage involved, scatters, and checks that every listed block
   reads back (through vLLM's indexing) exactly the expected bytes while every other byte of
   every storage still holds its poison.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch

from kvtier.codec import chunk_bytes, gather, scatter
from kvtier.layout import GroupLayout

BlockAddresser = Callable[[int], torch.Tensor]


def byte_view(t: torch.Tensor, storage: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` as bytes: shape ``(*t.shape, element_size)``, over ``storage`` (a 1-D uint8 tensor
    the size of ``t``'s storage; default: ``t``'s own storage)."""
    es = t.element_size()
    if storage is None:
        storage = storage_bytes(t)
    return torch.as_strided(
        storage,
        (*t.shape, es),
        (*(s * es for s in t.stride()), 1),
        t.storage_offset() * es,
    )


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    """The whole storage under ``t`` as a 1-D uint8 tensor (shares memory)."""
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def physical_order(v: torch.Tensor) -> torch.Tensor:
    """``v`` with its dimensions permuted outermost-stride first (how it lies in memory)."""
    order = sorted(range(v.dim()), key=lambda d: (-v.stride(d), d))
    return v.permute(*order)


def phys_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` in memory order, as a 1-D uint8 copy."""
    return physical_order(byte_view(t)).contiguous().view(-1).clone()


def expected_block(addressers: Sequence[BlockAddresser], b: int) -> torch.Tensor:
    return torch.cat([phys_bytes(a(b)).cpu() for a in addressers])


def _storages(group: GroupLayout, addressers: Sequence[BlockAddresser]) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for s in group.segments:
        seen.setdefault(s.storage.data_ptr(), s.storage)
    for a in addressers:
        st = storage_bytes(a(0))
        seen.setdefault(st.data_ptr(), st)
    return list(seen.values())


def _fill_random(storages: Sequence[torch.Tensor], gen: torch.Generator) -> None:
    for st in storages:
        st.copy_(torch.randint(0, 256, (st.numel(),), dtype=torch.uint8, generator=gen))


def poison(storages: Sequence[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """Fill with random bytes; return copies to compare against."""
    _fill_random(storages, torch.Generator().manual_seed(seed))
    return [st.clone() for st in storages]


def group_storages(group: GroupLayout) -> list[torch.Tensor]:
    return _storages(group, [])


def random_block_ids(num_blocks: int, count: int, rng: random.Random) -> list[int]:
    """``count`` distinct ids, scattered over the whole cache and out of order."""
    ids = rng.sample(range(num_blocks), count)
    rng.shuffle(ids)
    return ids


def check_group(
    group: GroupLayout,
    addressers: Sequence[BlockAddresser],
    *,
    seed: int = 0,
    count: int | None = None,
    blocks_per_chunk: int = 2,
    ids: Sequence[int] | None = None,
    buffer_device: torch.device | str = "cpu",
) -> list[int]:
    """Run the three checks of the module docstring on ``group``; return the ids used.

    ``ids`` (default: ``count`` random scattered ids) are the blocks; byte buffers live on
    ``buffer_device`` (the cache may be on another device)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    nb = group.num_blocks
    if ids is None:
        if count is None:
            count = min(nb, max(2, nb // 3)) // blocks_per_chunk * blocks_per_chunk
        ids = random_block_ids(nb, count, rng)
    ids = list(ids)
    storages = _storages(group, addressers)

    # 1. vLLM's bytes of each block, in the group's format order.
    _fill_random(storages, gen)
    expected = {b: expected_block(addressers, b) for b in ids}
    assert all(e.numel() == group.bytes_per_block for e in expected.values()), (
        f"the addressed block holds {next(iter(expected.values())).numel()} bytes, "
        f"the layout moves {group.bytes_per_block}"
    )
    out = torch.empty(len(ids) * group.bytes_per_block, dtype=torch.uint8, device=buffer_device)
    gather(group, ids, 1, out)
    out = out.cpu()
    want = torch.cat([expected[b] for b in ids]) if ids else out
    if not torch.equal(out, want):
        bad = int((out != want).nonzero()[0]) if out.numel() == want.numel() else -1
        raise AssertionError(
            f"gathered bytes differ from vLLM's block bytes (first at byte {bad} of "
            f"{out.numel()}); segments: {[(s.layer, s.role, s.offset, s.run) for s in group.segments]}"
        )

    # 2. chunk-major round trip with several blocks per chunk.
    cb = chunk_bytes(group, blocks_per_chunk)
    usable = len(ids) // blocks_per_chunk * blocks_per_chunk
    multi = torch.empty(usable // blocks_per_chunk * cb, dtype=torch.uint8, device=buffer_device)
    gather(group, ids[:usable], blocks_per_chunk, multi)

    # 3. poison everything, scatter, read back through vLLM's indexing.
    _fill_random(storages, gen)
    poison = [st.clone() for st in storages]
    masks = [torch.zeros_like(st) for st in storages]
    by_ptr = {st.data_ptr(): i for i, st in enumerate(storages)}
    for b in ids[:usable]:
        for a in addressers:
            v = a(b)
            i = by_ptr[storage_bytes(v).data_ptr()]
            byte_view(v, masks[i]).fill_(1)
    scatter(group, ids[:usable], blocks_per_chunk, multi)
    for b in ids[:usable]:
        got = expected_block(addressers, b)
        assert torch.equal(got, expected[b]), f"block {b} does not read back what was saved"
    for st, p, m in zip(storages, poison, masks):
        untouched = m == 0
        changed = int((st[untouched] != p[untouched]).sum())
        assert changed == 0, f"scatter wrote {changed} bytes outside the listed blocks"
    # And the round trip of the chunk-major buffer is bit-identical.
    again = torch.empty_like(multi)
    gather(group, ids[:usable], blocks_per_chunk, again)
    assert torch.equal(again, multi)
    return ids
