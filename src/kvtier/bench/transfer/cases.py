"""What ``kvtier bench transfer`` moves: one layout family at one chunk size in bytes (a
:class:`CacheCase`), and that cache allocated with its save and load jobs (a :class:`Cell`,
whose mover takes the cache's :class:`~kvtier.geometry.Geometry`).

A cache is sized for at least ``span`` bytes of distinct blocks per direction; where one block
of the model is larger than the chunk, the cache is one rank's shard (:func:`_shard`). Torch
and the engine are imported inside the functions: the CLI imports this package to build its
parser.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
CHUNKS = (256 * KIB, 2 * MIB, 8 * MIB)
FAMILIES = ("mha", "mla_bf16", "mla_fp8", "kv_fp8_scales", "indexer", "hybrid")
# Layouts a model registers, at their own chunk (one cell each, whatever --chunks says):
# kvtier.bench.transfer.registered.
REGISTERED_LAYOUTS = ("kimi_linear", "deepseek_v32", "glm_moe_dsa", "minimax_m3",
                      "deepseek_v3_mtp")
STEP_BYTES = 64 * MIB  # saves submitted per engine step; bytes per load job


@dataclass
class CacheCase:
    """One family at one chunk size: what to allocate and how chunks are made."""

    family: str
    chunk_target: int
    tensors: dict[str, Any]  # layer -> (shape, dtype) or list of them; see _allocate
    groups: list[tuple[str, int, list[str]]]  # (kind, block_size, layers)
    num_blocks: int
    bpc: list[int]
    scales: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    state_every: int = 0  # KV chunks per state object (hybrid)
    page_bytes: dict[str, int] = field(default_factory=dict)  # padded state pages (vLLM's)
    note: str = ""
    kv_cache_dtype: str = "auto"


def _shard(per_layer: Callable[[int], int], heads: int, layers: int, chunk: int,
           shardable: bool = True) -> tuple[int, int, str]:
    """(heads, layers, note): the fewest TP shards, then the fewest layers, so that one block
    is at most ``chunk`` bytes."""
    h, note = heads, ""
    while shardable and h > 1 and per_layer(h) * layers > chunk:
        h //= 2
    if h != heads:
        note = f"TP{heads // h} shard ({h} KV head{'s' if h > 1 else ''})"
    n = layers
    if per_layer(h) * n > chunk:
        n = max(1, chunk // per_layer(h))
        note = (note + ", " if note else "") + f"PP stage of {n} of {layers} layers"
    return h, n, note


@dataclass(frozen=True)
class _Sizing:
    """The chunk target and distinct-byte span of one case, and the model depths."""

    chunk: int
    span: int
    smoke: bool

    @property
    def layers_llama(self) -> int:
        return 32 if not self.smoke else 4

    @property
    def layers_ds(self) -> int:
        return 61 if not self.smoke else 6

    def bpc(self, block_bytes: int) -> int:
        return max(1, round(self.chunk / block_bytes))

    def num_blocks(self, block_bytes: int) -> int:
        """Two disjoint sets (saves, loads) of whole chunks covering ``span`` each; odd and
        above every other dimension, so the block axis is never ambiguous."""
        bpc = self.bpc(block_bytes)
        chunks = -(-self.span // (bpc * block_bytes))
        return max(601, 2 * chunks * bpc + 8) | 1


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _mha(family: str, z: _Sizing) -> CacheCase:
    def per(h: int) -> int:
        return 2 * 16 * h * 128 * 2
    h, n, note = _shard(per, 8, z.layers_llama, z.chunk)
    bb = per(h) * n
    nb = z.num_blocks(bb)
    return CacheCase(family, z.chunk, {_attn(i): ((nb, 2, 16, h, 128), "bfloat16")
                                      for i in range(n)},
                    [("full", 16, [_attn(i) for i in range(n)])], nb, [z.bpc(bb)], note=note)


def _mla(family: str, z: _Sizing) -> CacheCase:
    es = 2 if family == "mla_bf16" else 1
    dt = "bfloat16" if es == 2 else "uint8"
    _, n, note = _shard(lambda h: 64 * 576 * es, 1, z.layers_ds, z.chunk, shardable=False)
    bb = 64 * 576 * es * n
    nb = z.num_blocks(bb)
    return CacheCase(family, z.chunk, {_attn(i): ((nb, 64, 576), dt) for i in range(n)},
                    [("full", 64, [_attn(i) for i in range(n)])], nb, [z.bpc(bb)],
                    note=note, kv_cache_dtype="auto" if es == 2 else "fp8")


def _kv_fp8_scales(family: str, z: _Sizing) -> CacheCase:
    def per(h: int) -> int:
        return 2 * 16 * h * 128 + 2 * 16 * h * 4
    h, n, note = _shard(per, 8, z.layers_llama, z.chunk)
    bb = per(h) * n
    nb = z.num_blocks(bb)
    return CacheCase(family, z.chunk, {_attn(i): ((2, nb, 16, h, 128), "uint8")
                                      for i in range(n)},
                    [("full", 16, [_attn(i) for i in range(n)])], nb, [z.bpc(bb)],
                    scales={_attn(i): ((nb, 16, h), "float32") for i in range(n)},
                    note=note, kv_cache_dtype="fp8_e4m3")


def _indexer(family: str, z: _Sizing) -> CacheCase:
    _, n, note = _shard(lambda h: 64 * 132, 1, z.layers_ds, z.chunk, shardable=False)
    bb = 64 * 132 * n
    nb = z.num_blocks(bb)
    names = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(n)]
    return CacheCase(family, z.chunk, {nm: ((nb, 64, 132), "uint8") for nm in names},
                    [("full", 64, names)], nb, [z.bpc(bb)], note=note)


def _hybrid(family: str, z: _Sizing) -> CacheCase:
    n_attn, n_mamba = 4, (24 if not z.smoke else 2)
    conv, ssm = ((3, 4352), (64, 64, 128)) if not z.smoke else ((3, 64), (2, 8, 16))
    bb = n_attn * 2 * 16 * 8 * 128 * 2
    nb = 257 if not z.smoke else 17
    state = [f"model.layers.{i}.mixer" for i in range(n_attn, n_attn + n_mamba)]
    tensors: dict[str, Any] = {_attn(i): ((nb, 2, 16, 8, 128), "bfloat16")
                               for i in range(n_attn)}
    for nm in state:
        tensors[nm] = [((nb, *conv), "bfloat16"), ((nb, *ssm), "bfloat16")]
    bpc = z.bpc(bb)
    return CacheCase(family, z.chunk, tensors,
                    [("full", 16, [_attn(i) for i in range(n_attn)]),
                     ("state", 16 * bpc, state)],
                    nb, [bpc, 1], state_every=max(1, STEP_BYTES // (bpc * bb)),
                    note=f"{nb} blocks for both groups; blocks repeat across chunks")


_BUILDERS: dict[str, Callable[[str, _Sizing], CacheCase]] = {
    "mha": _mha, "mla_bf16": _mla, "mla_fp8": _mla, "kv_fp8_scales": _kv_fp8_scales,
    "indexer": _indexer, "hybrid": _hybrid,
}


def cache_case(family: str, chunk: int, span: int, smoke: bool = False) -> CacheCase:
    """The cache for ``family`` with chunks of about ``chunk`` bytes and at least ``span``
    bytes of distinct blocks (two sets: saves and loads)."""
    from kvtier.bench.transfer.registered import BUILDERS  # they build on this module

    build = _BUILDERS.get(family) or BUILDERS.get(family)
    if build is None:
        raise ValueError(f"unknown family {family!r}")
    return build(family, _Sizing(chunk, span, smoke))


# --- one cell --------------------------------------------------------------------------------

class _Slab:
    """Slab slots over a slice of one pinned buffer (the engine needs ``layout`` and
    ``buffer``; the spot checks ``view``)."""

    def __init__(self, layout: Any, buffer: Any, sums_entries: Sequence[int] = ()) -> None:
        import torch

        self.layout = layout
        self.buffer = buffer[: layout.total_bytes]
        # checksum tables (--verify): one int64 per block position of a slot, as the slab's
        self._sums = [torch.zeros((c.num_slots, n), dtype=torch.int64)
                      for c, n in zip(layout.classes, sums_entries)]

    def view(self, cls: int, slot: int, shard: int = 0) -> Any:
        off = self.layout.offset(cls, slot, shard)
        return self.buffer[off: off + self.layout.classes[cls].slot_bytes]

    def sums(self, cls: int, shard: int = 0) -> Any:
        return self._sums[cls]

    def close(self) -> None:
        pass


@dataclass
class Cell:
    geo: CacheCase
    layout: Any
    mover: Any
    storages: list[Any]
    chunk_bytes: list[int]
    save_jobs: list[Any]  # slot set A
    load_jobs: list[Any]  # from slot set A into the load blocks
    both_saves: list[Any]  # into slot set B
    sizes: dict[str, int]


def _allocate(geo: CacheCase, device: Any) -> tuple[dict[str, Any], dict[str, Any], list[Any]]:
    """The cache tensors (random bytes, never all zeros), the layer objects holding scales,
    and every storage."""
    import torch

    gen = torch.Generator(device=device).manual_seed(1)
    storages = []

    def make(shape: tuple[int, ...], dtype: str) -> Any:
        t = torch.empty(math.prod(shape) * getattr(torch, dtype).itemsize, dtype=torch.uint8,
                        device=device)
        t.random_(0, 256, generator=gen)  # never zeros
        storages.append(t)
        return t.view(getattr(torch, dtype)).view(shape)

    def page_views(specs: list[tuple[tuple[int, ...], str]], page: int = 0) -> list[Any]:
        """Several per-block tensors back to back in one page per block (how vLLM lays out
        a mamba layer's conv and ssm state), the page padded to ``page`` bytes if given."""
        nb = specs[0][0][0]
        sizes = [math.prod(sh[1:]) * getattr(torch, dt).itemsize for sh, dt in specs]
        page = max(page, sum(sizes))
        raw = make((nb * page,), "uint8")
        out, off = [], 0
        for (shape, dt), size in zip(specs, sizes):
            dtype = getattr(torch, dt)
            inner = torch.empty(shape[1:], device="meta").stride()
            out.append(torch.as_strided(raw.view(dtype), shape,
                                        (page // dtype.itemsize, *inner),
                                        off // dtype.itemsize))
            off += size
        return out

    kv: dict[str, Any] = {}
    for name, spec in geo.tensors.items():
        kv[name] = (make(*spec) if isinstance(spec, tuple)
                    else page_views(spec, geo.page_bytes.get(name, 0)))
    layers: dict[str, Any] = {}
    for name, (shape, dtype) in geo.scales.items():
        obj = type("Layer", (), {})()
        obj.k_scale = make(shape, dtype)
        obj.v_scale = make(shape, dtype)
        if not shape:  # a per-tensor scale: vLLM's default, 1.0 (random bytes may be NaN)
            obj.k_scale.fill_(1.0)
            obj.v_scale.fill_(1.0)
        layers[name] = obj
    return kv, layers, storages


def _slab_layout(kv_cb: int, state_cb: int, n_chunks: int, n_states: int) -> Any:
    """Two slot sets (saves land in A or B) of every class: ``n_chunks`` KV chunks and
    ``n_states`` state objects each."""
    from kvtier.slab import ALIGN, SizeClass, SlabLayout

    classes, pos = [], 0
    for i, (cb, n) in enumerate(((kv_cb, n_chunks), (state_cb, n_states))):
        if not cb:
            continue
        stride = -(-cb // ALIGN) * ALIGN
        classes.append(SizeClass(f"c{i}", cb, stride, 2 * n, pos))
        pos += stride * 2 * n
    return SlabLayout(tuple(classes), pos, 1)


@dataclass
class _Blocks:
    """The block ids of a cell's chunks: saves read ``src``, loads write ``dst``."""

    src: list[list[int]]
    dst: list[list[int]]
    state_src: list[int]
    state_dst: list[int]


def _blocks(geo: CacheCase, n_chunks: int, n_states: int, seed: int) -> _Blocks:
    """Randomly scattered, disjoint save and load blocks (except the hybrid's, which repeat)."""
    rng = random.Random(seed)
    nb = geo.num_blocks
    perm = list(range(nb))
    rng.shuffle(perm)
    save_blocks, load_blocks = perm[: nb // 2], perm[nb // 2:]
    bpc = geo.bpc[0]

    def rows(pool: list[int], n: int) -> list[list[int]]:
        out, i = [], 0
        for _ in range(n):
            if i + bpc > len(pool):  # the hybrid's small block count: blocks repeat
                rng.shuffle(pool)
                i = 0
            out.append(pool[i:i + bpc])
            i += bpc
        return out

    src, dst = rows(save_blocks, n_chunks), rows(load_blocks, n_chunks)
    def states(pool: list[int], n: int) -> list[int]:  # distinct where the pool allows
        return rng.sample(pool, n) if n <= len(pool) else [rng.choice(pool) for _ in range(n)]

    state_src, state_dst = states(save_blocks, n_states), states(load_blocks, n_states)
    return _Blocks(src, dst, state_src, state_dst)


def _save_jobs(geo: CacheCase, b: _Blocks, n_chunks: int, n_states: int, first_slot: int,
               base_id: int) -> list[Any]:
    """One job per chunk, into slots from ``first_slot``; every ``state_every``-th chunk also
    saves a state object."""
    from kvtier.protocol import Job, TransferOp

    jobs = []
    for c in range(n_chunks):
        ops = [TransferOp(0, first_slot + c, b.src[c])]
        if geo.state_every and c % geo.state_every == geo.state_every - 1:
            k = c // geo.state_every
            ops.append(TransferOp(1, (first_slot // n_chunks) * n_states + k, [b.state_src[k]]))
        jobs.append(Job(base_id + c, f"s{c}", ops, chunk=c))
    return jobs


def _load_jobs(geo: CacheCase, b: _Blocks, n_chunks: int, kv_cb: int) -> list[Any]:
    """Jobs of :data:`STEP_BYTES` of KV chunks each, from slot set A into ``dst``."""
    from kvtier.protocol import Job, TransferOp

    per_job = max(1, STEP_BYTES // kv_cb)
    loads = []
    for j, a in enumerate(range(0, n_chunks, per_job)):
        ops = [TransferOp(0, c, b.dst[c]) for c in range(a, min(n_chunks, a + per_job))]
        for c in range(a, min(n_chunks, a + per_job)):
            if geo.state_every and c % geo.state_every == geo.state_every - 1:
                k = c // geo.state_every
                ops.append(TransferOp(1, k, [b.state_dst[k]]))
        loads.append(Job(10**7 + j, f"l{j}", ops))
    return loads


def build_cell(geo: CacheCase, device: Any, pinned: Any, span: int, seed: int,
               verify: bool = False) -> Cell:
    """Allocate ``geo`` on ``device`` with slab slots in ``pinned``, and its jobs: saves into
    slot set A, loads from A, and saves into B (to run at the same time as the loads)."""
    from kvtier.geometry import Geometry
    from kvtier.layout import GroupKind, GroupSpec, build_layout
    from kvtier.transfer import ChunkMover

    kv, layers, storages = _allocate(geo, device)
    specs = [GroupSpec(GroupKind(kind), bs, tuple(names)) for kind, bs, names in geo.groups]
    layout = build_layout(kv, specs, geo.num_blocks, kv_cache_dtype=geo.kv_cache_dtype,
                          layers=layers)
    # the chunk in tokens: the first group's blocks per chunk (a state chunk is one block)
    geometry = Geometry.of_layout(layout, geo.bpc[0] * layout.groups[0].spec.block_size)
    cbytes = [geometry.chunk_bytes(g) for g in range(len(geometry.groups))]
    kv_cb = cbytes[0]
    state_cb = cbytes[1] if len(cbytes) > 1 else 0
    per_boundary = kv_cb + (state_cb / geo.state_every if geo.state_every else 0)
    n_chunks = max(2, math.ceil(span / per_boundary))
    n_states = -(-n_chunks // geo.state_every) if geo.state_every else 0
    slab_layout = _slab_layout(kv_cb, state_cb, n_chunks, n_states)
    if slab_layout.total_bytes > pinned.numel():
        raise RuntimeError(f"{geo.family}: needs {slab_layout.total_bytes} pinned bytes, "
                           f"have {pinned.numel()}")
    entries = [geometry.blocks_per_chunk(g) for g in range(len(geometry.groups))]
    mover = ChunkMover(layout, geometry, _Slab(slab_layout, pinned, entries), 0, verify=verify)
    b = _blocks(geo, n_chunks, n_states, seed)
    g0 = layout.groups[0]
    sizes = {"chunk_bytes": kv_cb, "bytes_per_block": g0.bytes_per_block,
             "blocks_per_chunk": geo.bpc[0], "pieces_per_chunk": len(g0.segments) * geo.bpc[0],
             "min_piece": min(s.run for s in g0.segments),
             "max_piece": max(s.run for s in g0.segments), "segments": len(g0.segments),
             "num_blocks": geo.num_blocks, "chunks": n_chunks, "state_objects": n_states,
             "state_bytes": state_cb, "cache_bytes": sum(int(s.numel()) for s in storages)}
    return Cell(geo, layout, mover, storages, cbytes,
                _save_jobs(geo, b, n_chunks, n_states, 0, 0), _load_jobs(geo, b, n_chunks, kv_cb),
                _save_jobs(geo, b, n_chunks, n_states, n_chunks, 2 * 10**7), sizes)
