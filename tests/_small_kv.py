"""A small real KV cache on CPU for the worker and transfer tests: a full-attention group
(16-token blocks, a ``(num_blocks, 2, 16, 2, 8)`` float32 tensor per layer) and a recurrent-
state group (one conv and one ssm tensor per layer, one state object per block)."""

from __future__ import annotations

import torch

from kvtier.config import KvtierConfig
from kvtier.layout import GroupKind, GroupSpec, Layout, build_layout

NUM_BLOCKS = 23
CHUNK_TOKENS = 32  # 2 attention blocks per chunk; a state chunk is one block
ATTN = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
MIXER = ("model.layers.2.mixer",)
CONFIG = KvtierConfig(dram_size="1MiB", verify_checksums=True)  # the checks under test


class SmallKV:
    def __init__(self, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.attn = {n: torch.randn(NUM_BLOCKS, 2, 16, 2, 8, generator=gen) for n in ATTN}
        self.state = {n: [torch.randn(NUM_BLOCKS, 3, 8, generator=gen),
                          torch.randn(NUM_BLOCKS, 2, 4, 4, generator=gen)] for n in MIXER}
        caches: dict[str, torch.Tensor | list[torch.Tensor]] = {**self.attn, **self.state}
        self.layout: Layout = build_layout(caches, [
            GroupSpec(GroupKind.FULL, 16, ATTN),
            GroupSpec(GroupKind.STATE, CHUNK_TOKENS, MIXER),
        ], NUM_BLOCKS)

    def attn_block(self, b: int) -> list[torch.Tensor]:
        return [t[b].clone() for t in self.attn.values()]

    def state_block(self, b: int) -> list[torch.Tensor]:
        return [t[b].clone() for ts in self.state.values() for t in ts]

    def wipe(self, value: float = 0.0) -> None:
        for t in self.attn.values():
            t.fill_(value)
        for ts in self.state.values():
            for t in ts:
                t.fill_(value)


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Bit-exact: compared as bytes, so a NaN pattern or -0.0 would count as different."""
    return len(a) == len(b) and all(
        torch.equal(x.contiguous().view(torch.uint8), y.contiguous().view(torch.uint8))
        for x, y in zip(a, b))
