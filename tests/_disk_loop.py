"""The scheduler half, one or two workers and a lower tier on a small full-attention CPU KV
cache, wired as the connector wires them (plan -> workers -> summed report -> scheduler).

"Computing" a prompt writes, into each of its blocks, bytes that are a function of the
prompt's tokens up to that block's end (:func:`block_bytes`): the same prefix computed in
other blocks gives the same bytes, so a restore is checked bit for bit against them."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kvtier.config import KvtierConfig
from kvtier.keys import Namespace, RequestKeys
from kvtier.layout import GroupKind, GroupSpec, build_layout
from kvtier.protocol import WorkerReport
from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput
from kvtier.tiers.setup import DiskTier, open_disk_tier
from kvtier.worker import OffloadWorker, TierStoreFactory, disk_store

NUM_BLOCKS = 64
BLOCK = 16
CHUNK = 32  # two blocks; a chunk is 2 layers x 2 blocks x 2 KiB = 8 KiB per shard
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
PROMPT = 3 * CHUNK + 1  # three whole chunks


def prompt(seed: int) -> list[int]:
    return [(seed * 7919 + 31 * i) % 997 + 3 for i in range(PROMPT)]


def config(tmp: Path, **kw: object) -> KvtierConfig:
    base: dict[str, object] = {"dram_size": "128KiB", "disk_path": str(tmp / "tier"),
                               "disk_size": "1MiB", "cost_model": False}
    return KvtierConfig.model_validate({**base, **kw})


def block_bytes(tokens: Sequence[int], end: int, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.blake2b(str(list(tokens[:end])).encode(),
                                          digest_size=8).digest(), "little")
    g = torch.Generator().manual_seed(seed & (2**63 - 1))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


class Rank:
    def __init__(self, cfg: KvtierConfig, rank: int, world: int,
                 tier_store: TierStoreFactory) -> None:
        self.caches = {n: torch.zeros(NUM_BLOCKS, 2, BLOCK, 2, 8) for n in LAYERS}
        layout = build_layout(self.caches, [GroupSpec(GroupKind.FULL, BLOCK, LAYERS)],
                              NUM_BLOCKS)
        self.worker = OffloadWorker(cfg, layout, CHUNK, rank=rank, world_size=world,
                                    tier_store=tier_store)

    def block(self, b: int) -> torch.Tensor:
        return torch.cat([t[b].contiguous().view(torch.uint8).flatten()
                          for t in self.caches.values()])

    def write_block(self, b: int, data: torch.Tensor) -> None:
        per = data.numel() // len(self.caches)
        for i, t in enumerate(self.caches.values()):
            t[b].view(torch.uint8).view(-1).copy_(data[i * per:(i + 1) * per])


class Loop:
    """``world`` ranks (private slabs of ``world`` shards each: every rank writes its own)."""

    def __init__(self, cfg: KvtierConfig, world: int = 1,
                 tier_store: TierStoreFactory = disk_store, open_store: object = None,
                 kv_cache_dtype: str = "float32", prepare_hits: bool = False,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.ranks = [Rank(cfg, r, world, tier_store) for r in range(world)]
        w = self.ranks[0].worker
        ns = Namespace(model="m", layout_fingerprint=w.geometry.fingerprint,
                       kv_cache_dtype=kv_cache_dtype, chunk_tokens=CHUNK,
                       model_revision=cfg.model_revision, extra=cfg.namespace_extra).digest()
        self.disk: DiskTier | None = None
        lower = None
        if cfg.disk_path is not None:
            self.disk = open_disk_tier(cfg, w.geometry, ns, w.slab_layout, world,
                                       store=open_store)  # type: ignore[arg-type]
            lower = self.disk.lower
        self.sched = OffloadScheduler(cfg, w.geometry, ns, w.slab_layout, world_size=world,
                                      lower=lower, prepare_hits=prepare_hits, clock=clock)
        self.reports: list[WorkerReport] = []
        self._next_block = 0

    def blocks(self, n: int) -> list[int]:
        out = [(self._next_block + i) % (NUM_BLOCKS - 1) + 1 for i in range(n)]  # 0 is null
        self._next_block += n
        return out

    def step(self, step: StepInput | None = None, ranks: Sequence[int] | None = None) -> None:
        plan = self.sched.schedule_step(step or StepInput())
        total = WorkerReport()
        for r in (self.ranks if ranks is None else [self.ranks[i] for i in ranks]):
            w = r.worker
            w.fence(plan)
            w.begin_step(plan)
            w.end_step(plan)
            w.drain()
            total.add(w.collect().report)
        self.reports.append(total)
        self.sched.on_report(total)

    def compute(self, req: str, tokens: Sequence[int], blocks: list[int], start: int = 0) -> None:
        nbytes = self.ranks[0].block(0).numel()
        for i, b in enumerate(blocks):
            end = min((i + 1) * BLOCK, len(tokens))
            if i * BLOCK >= start:
                for r in self.ranks:
                    r.write_block(b, block_bytes(tokens, end, nbytes))

    def prefill(self, req: str, tokens: Sequence[int]) -> list[int]:
        """Compute ``tokens`` in one step (every whole chunk is saved) and finish."""
        self.sched.add_request(req)
        assert self.sched.lookup(req, tokens, 0) in (0, None)
        blocks = self.blocks((len(tokens) + BLOCK - 1) // BLOCK)
        self.compute(req, tokens, blocks)
        n = len(tokens)
        self.step(StepInput(new=[NewRequest(req, [blocks])],
                            scheduled=[ScheduledTokens(req, tokens, n, n)]))
        self.sched.request_finished(req)
        self.step()
        return blocks

    def lookup(self, req: str, tokens: Sequence[int], max_steps: int = 50) -> tuple[int, int]:
        """Look up until kvtier answers: (tokens promised, lookups deferred)."""
        self.sched.add_request(req)
        for deferred in range(max_steps):
            n = self.sched.lookup(req, tokens, 0)
            if n is not None:
                return n, deferred
            self.step()
        raise AssertionError(f"{req}: still deferred after {max_steps} steps")

    def restore(self, req: str, tokens: Sequence[int]) -> tuple[int, int, bool]:
        """Look up, load the hit into fresh blocks, compute the rest: (tokens loaded, lookups
        deferred, every block bit-identical to computing the prompt)."""
        n, deferred = self.lookup(req, tokens)
        blocks = self.blocks((len(tokens) + BLOCK - 1) // BLOCK)
        for b in blocks:
            for r in self.ranks:
                r.write_block(b, torch.zeros_like(r.block(b)))
        if n:
            self.sched.start_load(req, n, [blocks])
        self.step(StepInput(new=[NewRequest(req, [blocks])]))
        self.compute(req, tokens, blocks, start=n)
        nbytes = self.ranks[0].block(0).numel()
        same = all(torch.equal(r.block(b), block_bytes(tokens, min((i + 1) * BLOCK,
                                                                  len(tokens)), nbytes))
                   for r in self.ranks for i, b in enumerate(blocks))
        self.sched.request_finished(req)
        self.step()
        return n, deferred, same

    def keys(self, tokens: Sequence[int]) -> list[bytes]:
        keys = RequestKeys(self.sched.namespace, CHUNK)
        keys.update(tokens)
        return list(keys.keys)

    def settle(self, steps: int = 5) -> None:
        for _ in range(steps):
            self.step()

    def close(self) -> None:
        for r in self.ranks:
            r.worker.close()
        if self.disk is not None:
            self.disk.close()
