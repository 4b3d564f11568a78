"""Every layout family of docs/design.md §2.2 as a portable *recipe*, and the engine round trip
the GPU data path must pass on each.

A recipe records what vLLM registers for one family: the raw buffers (sizes only), every
registered tensor as ``(buffer, dtype, shape, stride, storage offset)``, the tensors kept on
the layer objects (scales, the backend's inline-scale alias views), the KV-cache groups, and
vLLM's own block addressing (``kv[b]``, ``kv[:, b]``, ``kv[b*r:(b+1)*r]``, ...).
:func:`live_recipes` builds them with vLLM 0.32's own allocation path (``tests/_vllm032.py``)
and vLLM 0.25.1's committed backend table (``tests/data/vllm025_kv_layouts.json``), on CPU;
``tests/data/kv_families.json`` holds the same recipes so that the GPU host (which has neither
vLLM build) can :func:`materialize` them on CUDA. ``python tests/_families.py`` rewrites the
file; ``test_gpu_kernels.py`` checks that it still equals what vLLM builds.

:func:`check_engine` runs the GPU data path on one materialized family: random scattered
saves of every group into slab slots, compared with the reference codec; then every storage
poisoned, loads (with SKIP positions) into other random blocks, compared through vLLM's own
block addressing, and every byte outside the written blocks checked to still hold its poison.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from _kvcheck import byte_view, expected_block, storage_bytes
from kvtier import codec
from kvtier.geometry import Geometry
from kvtier.layout import GroupKind, GroupSpec, Layout, build_layout
from kvtier.protocol import SKIP, Job, TransferOp
from kvtier.slab import HostSlab, lay_out_slab
from kvtier.transfer import ChunkMover, Completion

ROOT = Path(__file__).resolve().parent
RECIPES_PATH = ROOT / "data" / "kv_families.json"
NB = 37  # a prime: no other dimension of these caches is a multiple of it

Recipe = dict[str, Any]


# --- recipes -------------------------------------------------------------------------------

class _Recorder:
    """Collects tensors into a recipe, naming buffers by storage."""

    def __init__(self, name: str, num_blocks: int, kv_cache_dtype: str) -> None:
        self.r: Recipe = {"name": name, "num_blocks": num_blocks,
                          "kv_cache_dtype": kv_cache_dtype, "buffers": [], "tensors": {},
                          "kv_caches": {}, "layers": {}, "groups": [], "addressers": []}
        self._buf: dict[int, int] = {}
        self._key: dict[tuple, str] = {}

    def tensor(self, t: torch.Tensor) -> str:
        st = t.untyped_storage()
        if st.data_ptr() not in self._buf:
            self._buf[st.data_ptr()] = len(self.r["buffers"])
            self.r["buffers"].append(st.nbytes())
        ident = (st.data_ptr(), str(t.dtype), tuple(t.shape), tuple(t.stride()),
                 t.storage_offset())
        if ident not in self._key:
            key = f"t{len(self._key)}"
            self._key[ident] = key
            self.r["tensors"][key] = {
                "buffer": self._buf[st.data_ptr()], "dtype": str(t.dtype).removeprefix("torch."),
                "shape": list(t.shape), "stride": list(t.stride()),
                "offset": t.storage_offset(),
                "value": float(t.item()) if t.numel() == 1 else None,
            }
        return self._key[ident]

    def kv(self, name: str, value: torch.Tensor | list[torch.Tensor]) -> None:
        self.r["kv_caches"][name] = (self.tensor(value) if isinstance(value, torch.Tensor)
                                     else [self.tensor(t) for t in value])

    def layer_attr(self, name: str, attr: str, t: torch.Tensor) -> None:
        self.r["layers"].setdefault(name, {})[attr] = self.tensor(t)

    def group(self, spec: GroupSpec, addressers: list[tuple[torch.Tensor, int, int]]) -> None:
        self.r["groups"].append({"kind": spec.kind.value, "block_size": spec.block_size,
                                 "layers": list(spec.layer_names),
                                 "window": spec.sliding_window})
        self.r["addressers"].append([[self.tensor(t), dim, ratio] for t, dim, ratio in addressers])


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _vllm032_recipes() -> list[Recipe]:
    from dataclasses import replace

    from vllm.model_executor.layers.mamba.mamba_utils import (
        MambaStateDtypeCalculator,
        MambaStateShapeCalculator,
    )
    from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend
    from vllm.v1.attention.backends.mla.flashmla import FlashMLABackend
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import DeepseekV32IndexerBackend
    from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        SparseCacheRole,
        get_kv_quant_mode,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout as L
    from vllm.v1.worker.utils import (
        add_kv_sharing_layers_to_kv_cache_groups,
        customize_attention_spec,
        select_common_block_size,
    )

    from _vllm032 import Allocated, allocate

    def dense(backend: type, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
              kv_cache_dtype: str = "auto", heads: int = 4, head_size: int = 64) -> Any:
        # Attention.get_kv_cache_spec, then the runner's customize_attention_spec.
        return customize_attention_spec(backend, FullAttentionSpec(
            block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype,
            kv_quant_mode=get_kv_quant_mode(kv_cache_dtype)))

    def mla(backend: type, block_size: int, kv_cache_dtype: str = "auto",
            dtype: torch.dtype = torch.bfloat16) -> Any:
        return customize_attention_spec(backend, MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, max_tp_shards=1, head_size=576, dtype=dtype,
            cache_dtype_str=kv_cache_dtype, kv_quant_mode=get_kv_quant_mode(kv_cache_dtype),
            state_content_bytes={"fp8_ds_mla": 656}.get(kv_cache_dtype)))

    out: list[Recipe] = []

    def record(name: str, a: Allocated, kv_cache_dtype: str = "auto",
               layer_attrs: dict[str, dict[str, torch.Tensor]] | None = None,
               extra: dict[str, list[tuple[torch.Tensor, int, int]]] | None = None) -> None:
        rec = _Recorder(name, a.num_blocks, kv_cache_dtype)
        for n in sorted(a.kv_caches):
            rec.kv(n, a.kv_caches[n])
        for n, attrs in (layer_attrs or {}).items():
            for attr, t in attrs.items():
                rec.layer_attr(n, attr, t)
        for gid, (spec, g) in enumerate(zip(a.group_specs(), a.config.kv_cache_groups)):
            names = sorted(g.layer_names, key=lambda n: (int(n.split(".")[2]), n))
            adr: list[tuple[torch.Tensor, int, int]] = []
            seen: set[tuple] = set()
            for n in names:
                kv = a.kv_caches[n]
                ident = (id(kv),)
                if ident in seen:  # cross-layer sharing: the same bytes, addressed once
                    continue
                seen.add(ident)
                if isinstance(kv, torch.Tensor):
                    adr.append((kv, 0, a.ratio(gid)))
                else:  # mamba: a list of state tensors, block axis first
                    adr += [(t, 0, 1) for t in kv]
                adr += (extra or {}).get(n, [])
            rec.group(spec, adr)
        out.append(rec.r)

    for lay in (L.LBHNC, L.LBNHC, L.BLHNC, L.BHLNC):
        specs = {_attn(i): dense(FlashAttentionBackend) for i in range(3)}
        record(f"v032_flash_{lay.name}", allocate(specs, lay, NB))
    for kvd, dt in (("auto", torch.bfloat16), ("fp8", torch.uint8)):
        spec = mla(FlashMLABackend, 64, kvd, dt)
        record(f"v032_mla_{kvd}", allocate({_attn(i): spec for i in range(3)}, L.LBHNC, NB), kvd)
    spec = mla(FlashMLABackend, 128)
    kbs = select_common_block_size(128, [FlashMLABackend], [spec])
    record("v032_mla_kernel_blocks",
           allocate({_attn(i): spec for i in range(2)}, L.LBNHC, NB, kernel_block_sizes=[kbs]))
    sparse = replace(mla(FlashMLASparseBackend, 64, "fp8_ds_mla", torch.uint8),
                     is_index_group_leader=True)
    index = customize_attention_spec(DeepseekV32IndexerBackend, MLAAttentionSpec(
        block_size=64, num_kv_heads=1, max_tp_shards=1, head_size=132, dtype=torch.uint8,
        cache_role=SparseCacheRole.INDEXER))
    idx = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(2)]
    record("v032_sparse_mla_indexer", allocate(
        {_attn(0): sparse, idx[0]: index, _attn(1): sparse, idx[1]: index}, L.LBHNC, NB),
        "fp8_ds_mla")
    # fp8 with per-token-head scales inline (Triton backend pads the head; the impl carves
    # alias views out of the cache at its first forward).
    spec = dense(TritonAttentionBackend, dtype=torch.uint8, kv_cache_dtype="fp8_per_token_head")
    a = allocate({_attn(i): spec for i in range(2)}, L.LBNHC, NB)
    attrs: dict[str, dict[str, torch.Tensor]] = {}
    for i in range(2):
        impl = TritonAttentionImpl(num_heads=8, head_size=64, scale=0.125, num_kv_heads=4,
                                   alibi_slopes=None, sliding_window=None,
                                   kv_cache_dtype="fp8_per_token_head")
        impl._ensure_scale_caches(a.kv_caches[_attn(i)])
        attrs[_attn(i)] = {"_k_scale": torch.tensor(1.0), "_v_scale": torch.tensor(1.0),
                           "impl._k_scale_cache": impl._k_scale_cache,
                           "impl._v_scale_cache": impl._v_scale_cache}
    record("v032_fp8_inline_scales", a, "fp8_per_token_head", attrs)
    # fp8 with per-token-head float32 scales as separate tensors on the layer (ROCm/ATOM).
    spec = dense(TritonAttentionBackend, dtype=torch.uint8, kv_cache_dtype="fp8_e4m3")
    a = allocate({_attn(i): spec for i in range(2)}, L.LBHNC, NB)
    attrs, extra = {}, {}
    for i in range(2):
        k, v = torch.empty(NB, 16, 4), torch.empty(NB, 16, 4)
        attrs[_attn(i)] = {"_k_scale": torch.tensor(1.0), "_v_scale": torch.tensor(1.0),
                           "k_scale": k, "v_scale": v}
        extra[_attn(i)] = [(k, 0, 1), (v, 0, 1)]
    record("v032_fp8_scales_on_layer", a, "fp8_e4m3", attrs, extra)
    # Sliding window beside full attention: two groups.
    full = dense(FlashAttentionBackend)
    swa = customize_attention_spec(FlashAttentionBackend, SlidingWindowSpec(
        block_size=16, num_kv_heads=4, head_size=64, dtype=torch.bfloat16, sliding_window=128))
    record("v032_sliding_window", allocate(
        {_attn(i): (full if i % 2 == 0 else swa) for i in range(4)}, L.LBHNC, NB))
    # Recurrent state (mamba2, align mode) beside attention: two groups.
    shapes = MambaStateShapeCalculator.mamba2_state_shape(
        tp_world_size=1, intermediate_size=256, n_groups=1, num_heads=8, head_dim=32,
        state_size=16, conv_kernel=4)
    dtypes = MambaStateDtypeCalculator.mamba2_state_dtype(torch.bfloat16, "auto", "float32")
    mamba = MambaSpec(block_size=64, shapes=shapes, dtypes=dtypes, mamba_cache_mode="align")
    full = dense(FlashAttentionBackend, block_size=64)
    names = ["model.layers.0.mixer", _attn(1), "model.layers.2.mixer", _attn(3)]
    record("v032_mamba_hybrid", allocate(
        {n: (mamba if "mixer" in n else full) for n in names}, L.LBHNC, NB))
    # Cross-layer KV sharing: layer 2 reads layer 0's cache; its bytes move once.
    specs = {_attn(i): dense(FlashAttentionBackend) for i in range(2)}
    a = allocate(specs, L.LBHNC, NB)
    add_kv_sharing_layers_to_kv_cache_groups({_attn(2): _attn(0)}, a.config.kv_cache_groups)
    a.kv_caches[_attn(2)] = a.kv_caches[_attn(0)]
    record("v032_cross_layer_sharing", a)
    return out


def _vllm025_recipes() -> list[Recipe]:
    """From the committed table of 0.25.1's backends, by 0.25.1's procedure
    (``raw.view(dtype).view(physical).permute(*inv_order)``, one buffer per layer)."""
    table = json.loads((ROOT / "data" / "vllm025_kv_layouts.json").read_text())
    nb = table["num_blocks"]

    def pick(backend: str, **params: Any) -> dict[str, Any]:
        for r in table["records"]:
            p = r["params"]
            if (r["backend"] == backend and r.get("shape")
                    and not p.get("include_num_layers_dimension")
                    and all(p.get(k) == v for k, v in params.items())):
                return r
        raise LookupError(f"{backend} {params}")

    def build(rec: dict[str, Any]) -> torch.Tensor:
        shape = tuple(rec["shape"])
        order = tuple(rec["stride_order"] or range(len(shape)))
        dtype = torch.bfloat16 if rec["params"]["cache_dtype_str"] == "auto" else torch.uint8
        raw = torch.empty(math.prod(shape) * dtype.itemsize, dtype=torch.int8)
        inv = [order.index(i) for i in range(len(order))]
        return raw.view(dtype).view(tuple(shape[i] for i in order)).permute(*inv)

    def block_dim(rec: dict[str, Any]) -> int:
        dims = rec.get("dims")
        if isinstance(dims, str):
            dims = dims.split(",")
        for label in ("blocks", "B"):
            if dims and label in dims:
                return int(dims.index(label))
        return list(rec["shape"]).index(nb)

    out = []
    for name, rec in (
        ("v025_flash_hnd", pick("FLASH_ATTN", num_kv_heads=8, block_size=16,
                                cache_dtype_str="auto", kv_cache_layout="HND")),
        ("v025_rocm_split_kv_fp8", pick("ROCM_ATTN", num_kv_heads=2, cache_dtype_str="fp8")),
        ("v025_flashmla", pick("FLASHMLA", cache_dtype_str="auto")),
        ("v025_indexer", pick("DEEPSEEK_V32_INDEXER")),
    ):
        r = _Recorder(name, nb, rec["params"]["cache_dtype_str"])
        names = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
        kvs = {n: build(rec) for n in names}
        for n in names:
            r.kv(n, kvs[n])
        bd = block_dim(rec)
        r.group(GroupSpec(GroupKind.FULL, rec["params"]["block_size"], tuple(names)),
                [(kvs[n], bd, 1) for n in names])
        out.append(r.r)
    return out


def live_recipes() -> list[Recipe]:
    """Every family, built now by vLLM's code (needs vLLM 0.32 importable)."""
    return _vllm032_recipes() + _vllm025_recipes()


def stored_recipes() -> list[Recipe]:
    return json.loads(RECIPES_PATH.read_text())["families"]


# --- materialize ---------------------------------------------------------------------------

class _Obj:
    """A stand-in layer (or backend impl) object holding tensor attributes."""


@dataclass
class Family:
    name: str
    layout: Layout
    addressers: list[list[Callable[[int], torch.Tensor]]]  # per group, vLLM's block addressing
    storages: list[torch.Tensor]  # uint8 views of every buffer


def materialize(recipe: Recipe, device: torch.device | str) -> Family:
    """Fresh buffers on ``device`` with every registered view as vLLM made it."""
    bufs = [torch.empty(n, dtype=torch.uint8, device=device) for n in recipe["buffers"]]
    tensors: dict[str, torch.Tensor] = {}
    for key, t in recipe["tensors"].items():
        dtype = getattr(torch, t["dtype"])
        if t["value"] is not None and math.prod(t["shape"]) == 1 and len(t["shape"]) == 0:
            tensors[key] = torch.tensor(t["value"], dtype=dtype, device=device)
            continue
        base = bufs[t["buffer"]].view(dtype)
        tensors[key] = torch.as_strided(base, t["shape"], t["stride"], t["offset"])
    kv: dict[str, torch.Tensor | list[torch.Tensor]] = {
        n: (tensors[k] if isinstance(k, str) else [tensors[x] for x in k])
        for n, k in recipe["kv_caches"].items()}
    layers: dict[str, object] = {}
    for n, attrs in recipe["layers"].items():
        obj = _Obj()
        for attr, key in attrs.items():
            holder = obj
            if attr.startswith("impl."):
                if not hasattr(obj, "impl"):
                    obj.impl = _Obj()  # type: ignore[attr-defined]
                holder, attr = obj.impl, attr[5:]  # type: ignore[attr-defined]
            setattr(holder, attr, tensors[key])
        layers[n] = obj
    groups = [GroupSpec(GroupKind(g["kind"]), g["block_size"], tuple(g["layers"]), g["window"])
              for g in recipe["groups"]]
    layout = build_layout(kv, groups, recipe["num_blocks"], kv_cache_dtype=recipe["kv_cache_dtype"],
                          layers=layers)

    def addresser(key: str, dim: int, ratio: int) -> Callable[[int], torch.Tensor]:
        t = tensors[key]
        if ratio == 1:
            return lambda b: t.select(dim, b)
        return lambda b: t.narrow(dim, b * ratio, ratio)

    adr = [[addresser(*a) for a in group] for group in recipe["addressers"]]
    return Family(recipe["name"], layout, adr, bufs)


# --- the engine round trip -----------------------------------------------------------------

def blocks_per_chunk(layout: Layout, scale: int = 2) -> tuple[int, list[int]]:
    """Chunk tokens (``scale`` times the largest block size) and blocks per chunk per group
    (1 for state groups)."""
    chunk = scale * math.lcm(*(g.spec.block_size for g in layout.groups))
    return chunk, [1 if g.spec.kind is GroupKind.STATE else chunk // g.spec.block_size
                   for g in layout.groups]


def make_mover(layout: Layout, chunk_tokens: int, bpc: list[int], slots: int, pin: bool,
               verify: bool = False) -> ChunkMover:
    geom = Geometry.of_layout(layout, chunk_tokens)
    assert list(geom.blocks_per_chunk(g) for g in range(len(geom.groups))) == bpc
    kv = [geom.chunk_bytes(g) for g in geom.kv_groups]
    state = [geom.chunk_bytes(g) for g in geom.state_groups]
    stride = sum(-(-b // 4096) * 4096 for b in kv + state)
    slab_layout = lay_out_slab(stride * slots * 2, kv,
                               state_slot_bytes=max(state) if state else None,
                               state_bytes=(stride * slots) if state else None,
                               checksum_entries=[geom.blocks_per_chunk(g) for g in geom.kv_groups]
                               + ([1] if state else []))
    slab = HostSlab(slab_layout, pinner=_cuda_pinner() if pin else None)
    return ChunkMover(layout, geom, slab, 0, verify=verify)


def _cuda_pinner() -> Any:
    from kvtier.gpu.pinning import CudaPinner

    return CudaPinner()


def _fill(storages: list[torch.Tensor], gen: torch.Generator) -> None:
    for st in storages:
        st.copy_(torch.randint(0, 256, (st.numel(),), dtype=torch.uint8, generator=gen))


def drain(engine: Any, expect: set[int]) -> dict[int, Completion]:
    """Wait for everything, then poll; every expected job exactly once, nothing else."""
    engine.drain()
    got: dict[int, Completion] = {}
    for _ in range(3):
        for c in engine.poll():
            assert c.job_id not in got, f"job {c.job_id} reported twice"
            got[c.job_id] = c
    assert set(got) == expect, f"reported {sorted(got)}, expected {sorted(expect)}"
    assert engine.pending() == 0
    return got


def check_engine(fam: Family, make_engine: Callable[[ChunkMover], Any], *, seed: int = 0,
                 n_chunks: int = 6, pin: bool = False, verify: bool = False) -> dict[str, int]:
    """Save random scattered chunks of every group, compare the slots with the reference
    codec; poison everything; load the slots (some positions SKIP) into other random blocks
    and compare through vLLM's addressing; check every other byte still holds its poison.
    ``verify``: with checksums, and every slot's table entry must be the reference checksum
    of its bytes. Returns byte counts moved."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lay = fam.layout
    chunk_tokens, bpc = blocks_per_chunk(lay)
    n_chunks = max(2, min(n_chunks, lay.groups[0].num_blocks // sum(bpc)))
    mover = make_mover(lay, chunk_tokens, bpc, n_chunks, pin, verify)
    engine = make_engine(mover)
    try:
        return _round_trip(fam, mover, engine, rng, gen, bpc, n_chunks)
    finally:
        engine.close()
        mover.slab.close()


def _round_trip(fam: Family, mover: ChunkMover, engine: Any, rng: random.Random,
                gen: torch.Generator, bpc: list[int], n_chunks: int) -> dict[str, int]:
    lay = fam.layout
    nb = lay.groups[0].num_blocks
    _fill(fam.storages, gen)
    # Saves: one job per chunk boundary, one op per group.
    src: dict[int, list[list[int]]] = {}
    jobs = []
    for g in range(len(lay.groups)):
        ids = rng.sample(range(nb), n_chunks * bpc[g])
        src[g] = [ids[i * bpc[g]:(i + 1) * bpc[g]] for i in range(n_chunks)]
    for c in range(n_chunks):
        jobs.append(Job(100 + c, f"r{c}", [TransferOp(g, c, src[g][c], seed=1000 + c)
                                           for g in range(len(lay.groups))], chunk=c))
    before = {(g, b): expected_block(fam.addressers[g], b)
              for g in range(len(lay.groups)) for ids in src[g] for b in ids}
    engine.tick()
    for j in jobs:
        engine.save(j)
    done = drain(engine, {j.job_id for j in jobs})
    assert all(c.ok for c in done.values()), [c.error for c in done.values() if not c.ok]
    saved = 0
    for g, group in enumerate(lay.groups):
        cb = codec.chunk_bytes(group, bpc[g])
        for c in range(n_chunks):
            want = torch.empty(cb, dtype=torch.uint8, device=group.segments[0].storage.device)
            codec.gather(group, src[g][c], bpc[g], want)
            slot = mover.slab.view(mover.slot_class[g], c)[:cb]
            assert torch.equal(slot, want.cpu()), (
                f"{fam.name}: group {g} chunk {c}: slot bytes differ from the reference codec")
            if mover.verify:
                op = TransferOp(g, c, src[g][c], seed=1000 + c)
                assert mover.check([op], skip=False) == [], (
                    f"{fam.name}: group {g} chunk {c}: the stored checksums are not the slot's")
            saved += cb
    # Loads into other blocks of a poisoned cache, some positions skipped.
    _fill(fam.storages, gen)
    poison = [st.clone() for st in fam.storages]
    masks = [torch.zeros_like(st) for st in fam.storages]
    by_ptr = {st.data_ptr(): i for i, st in enumerate(fam.storages)}
    # Groups may share buffers (vLLM's hybrid allocator gives block b of every group the same
    # memory; its block pool is shared), so the blocks written are distinct across groups.
    dst: dict[int, list[list[int]]] = {}
    pool = rng.sample(range(nb), n_chunks * sum(bpc))
    for g in range(len(lay.groups)):
        ids, pool = pool[:n_chunks * bpc[g]], pool[n_chunks * bpc[g]:]
        rows = [ids[i * bpc[g]:(i + 1) * bpc[g]] for i in range(n_chunks)]
        for c, row in enumerate(rows):
            if bpc[g] > 1 and c % 2 == 1:
                row[rng.randrange(bpc[g])] = SKIP
        dst[g] = rows
    loads = [Job(200 + c, f"r{c}", [TransferOp(g, c, list(dst[g][c]), seed=1000 + c)
                                    for g in range(len(lay.groups))]) for c in range(n_chunks)]
    engine.tick()
    for j in loads[: n_chunks // 2]:
        engine.load(j)
    engine.load(Job(300, "multi", [op for j in loads[n_chunks // 2:] for op in j.ops]))
    done = drain(engine, {j.job_id for j in loads[: n_chunks // 2]} | {300})
    assert all(c.ok for c in done.values()), [c.error for c in done.values() if not c.ok]
    loaded = 0
    for g in range(len(lay.groups)):
        for c in range(n_chunks):
            for j, b in enumerate(dst[g][c]):
                if b == SKIP:
                    continue
                got = expected_block(fam.addressers[g], b)
                assert torch.equal(got, before[(g, src[g][c][j])]), (
                    f"{fam.name}: group {g}: block {b} does not read back the saved block")
                loaded += got.numel()
                for a in fam.addressers[g]:
                    v = a(b)
                    byte_view(v, masks[by_ptr[storage_bytes(v).data_ptr()]]).fill_(1)
    for st, p, m in zip(fam.storages, poison, masks):
        untouched = m == 0
        changed = int((st[untouched] != p[untouched]).sum())
        assert changed == 0, f"{fam.name}: a load wrote {changed} bytes outside its blocks"
    return {"saved": saved, "loaded": loaded}


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    fams = live_recipes()
    RECIPES_PATH.write_text(json.dumps({
        "description": "Layout families of docs/design.md §2.2 as vLLM registers them (see "
                       "tests/_families.py); regenerate with `python tests/_families.py`.",
        "families": fams}, indent=1) + "\n")
    print(f"wrote {len(fams)} families to {RECIPES_PATH}")
