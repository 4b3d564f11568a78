"""Segments: where the bytes of one KV block live in the tensors an engine registers.

A *segment* is a strided byte run: for block ``b`` its bytes are
``storage[offset + b * block_stride : offset + b * block_stride + run]``. A KV-cache group's
block is the concatenation of its segments in a fixed order, and that order *is* the byte
format of a stored chunk, so it is part of the layout fingerprint.

How a registered tensor becomes segments (``num_blocks`` is always passed explicitly; it is
never read from dim 0, which may hold tokens or kernel blocks):

- The *block axis* is the dimension whose size is ``num_blocks * f`` for a whole ``f`` (``f > 1``
  for token-major MLA caches ``(nb*bs, 1, 576)`` and for kernel-block splitting). Among several,
  an exact ``num_blocks`` wins, then the outermost.
- Dimensions with a larger stride than the block axis are *outer*: each index combination is
  its own segment (K and V regions of a ``(2, nb, ...)`` tensor, or a ``(nb, 2, ...)`` view whose
  dim 1 jumps the whole K region).
- Dimensions with a smaller stride must be dense (a gap only after the last byte, as in padded
  pages); anything else cannot be segmented and is a :class:`LayoutError` naming the layer,
  shape and strides.

Layer objects are inspected for scale tensors (ROCm/ATOM keep them beside the cache): a
single-element scale goes into the key namespace; a multi-element one that aliases a registered
cache (vLLM's inline per-token-head scales, viewed by the backend at its first forward) already
travels with the block and is skipped; one whose leading axis is the block axis is a segment;
any other is an error.

Within a group, exact duplicates (cross-layer KV sharing) are moved once and adjacent runs
of one storage are merged (block-outer layouts keep all layers of a block in one run).
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum

import msgpack
import torch

CODEC_VERSION = 1
MAX_SEGMENTS_PER_TENSOR = 1024

ROLE_ORDER = ("kv", "k", "v", "k_scale", "v_scale", "scale", "index", "index_scale", "state")


class LayoutError(ValueError):
    """A registered tensor or layer attribute kvtier cannot move as opaque block bytes."""


class GroupKind(str, Enum):
    FULL = "full"
    SLIDING_WINDOW = "sliding_window"
    STATE = "state"


@dataclass(frozen=True)
class GroupSpec:
    """One KV-cache group as the engine manages it.

    ``block_size`` is in tokens (the manager's block, not a kernel block). ``sliding_window`` is
    in tokens and only set for SLIDING_WINDOW groups. STATE groups hold recurrent state: one
    block is one opaque state object.
    """

    kind: GroupKind
    block_size: int
    layer_names: tuple[str, ...]
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise LayoutError(f"block size must be positive, got {self.block_size}")
        if self.kind is GroupKind.SLIDING_WINDOW and not self.sliding_window:
            raise LayoutError("a sliding-window group needs its window size in tokens")


@dataclass(eq=False)
class Segment:
    """One strided byte run per block. ``storage`` is a 1-D uint8 view of the whole storage."""

    layer: str
    role: str
    layer_index: int
    storage: torch.Tensor
    offset: int
    block_stride: int
    run: int
    num_blocks: int
    # Geometry that defines the byte format, for the fingerprint (no addresses, no num_blocks).
    describe: tuple = field(default=())

    def blocks(self) -> torch.Tensor:
        """A ``(num_blocks, run)`` uint8 view; row ``b`` is block ``b``'s bytes."""
        return torch.as_strided(
            self.storage, (self.num_blocks, self.run), (self.block_stride, 1), self.offset
        )

    @property
    def address(self) -> tuple[int, int, int, int]:
        return (self.storage.data_ptr(), self.offset, self.block_stride, self.run)

    def span(self) -> tuple[int, int]:
        """First and one-past-last byte (in storage) this segment covers."""
        base = self.storage.data_ptr() + self.offset
        return base, base + (self.num_blocks - 1) * self.block_stride + self.run


@dataclass(eq=False)
class GroupLayout:
    group_id: int
    spec: GroupSpec
    segments: list[Segment]

    @property
    def bytes_per_block(self) -> int:
        return sum(s.run for s in self.segments)

    @property
    def num_blocks(self) -> int:
        return self.segments[0].num_blocks if self.segments else 0


@dataclass(eq=False)
class Layout:
    groups: list[GroupLayout]
    kv_cache_dtype: str
    fixed_scales: dict[str, float]
    fingerprint: str

    def group(self, group_id: int) -> GroupLayout:
        return self.groups[group_id]


def layer_index(name: str) -> int:
    """The decoder-layer number in a layer name ("model.layers.12.self_attn.attn" -> 12)."""
    m = re.search(r"layers?\.(\d+)", name) or re.search(r"(\d+)", name)
    return int(m.group(1)) if m else -1


def default_role(name: str) -> str:
    lowered = name.lower()
    if "indexer" in lowered or lowered.endswith(".index_cache"):
        return "index"
    return "kv"


def _role_rank(role: str) -> int:
    base = role.split(".")[0]
    return ROLE_ORDER.index(base) if base in ROLE_ORDER else len(ROLE_ORDER)


def _byte_storage(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())


def segment_tensor(
    name: str,
    t: torch.Tensor,
    num_blocks: int,
    role: str,
    block_axis: int | None = None,
) -> list[Segment]:
    """Split one tensor into block-contiguous segments (see the module docstring)."""

    def fail(why: str) -> LayoutError:
        return LayoutError(
            f"layer {name!r}: {why} (shape {tuple(t.shape)}, strides {tuple(t.stride())}, "
            f"dtype {t.dtype}, num_blocks {num_blocks})"
        )

    if num_blocks <= 0:
        raise fail("num_blocks must be positive")
    es = t.element_size()
    dims = [(i, int(size), int(stride) * es) for i, (size, stride) in
            enumerate(zip(t.shape, t.stride()))]
    if block_axis is None:
        exact = [d for d in dims if d[1] == num_blocks]
        multiples = [d for d in dims if d[1] > num_blocks and d[1] % num_blocks == 0]
        candidates = exact or multiples
        if not candidates:
            raise fail("no dimension is a whole multiple of num_blocks")
        axis = max(candidates, key=lambda d: (d[2], -d[0]))
    else:
        axis = dims[block_axis]
        if axis[1] % num_blocks:
            raise fail(f"dim {block_axis} is not a multiple of num_blocks")
    a_idx, a_size, a_stride = axis
    ratio = a_size // num_blocks
    if num_blocks > 1 and a_stride <= 0:
        raise fail("the block axis has no stride")
    inner = sorted((d for d in dims if d[0] != a_idx and d[1] > 1 and d[2] < a_stride),
                   key=lambda d: d[2])
    outer = [d for d in dims if d[0] != a_idx and d[1] > 1 and d[2] >= a_stride]
    if any(d[2] == a_stride for d in outer):
        raise fail("another dimension shares the block axis stride")
    expected = es
    for _, size, stride in inner:
        if stride != expected:
            raise fail("the bytes of one block are not contiguous")
        expected *= size
    dense_bytes = expected
    if dense_bytes > a_stride and (num_blocks > 1 or ratio > 1):
        raise fail("blocks overlap")
    if ratio > 1 and dense_bytes == a_stride:
        runs = [(0, ratio * a_stride)]  # kernel blocks of one manager block are adjacent
    elif ratio > 1:
        runs = [(j * a_stride, dense_bytes) for j in range(ratio)]
    else:
        runs = [(0, dense_bytes)]
    n_outer = math.prod(d[1] for d in outer)
    if n_outer * len(runs) > MAX_SEGMENTS_PER_TENSOR:
        raise fail(f"{n_outer * len(runs)} pieces per block, more than {MAX_SEGMENTS_PER_TENSOR}")
    storage = _byte_storage(t)
    base = t.storage_offset() * es
    inner_desc = tuple((size, stride) for _, size, stride in inner)
    segments = []
    outer_sorted = sorted(outer, key=lambda d: d[0])
    split_kv = len(outer_sorted) == 1 and outer_sorted[0][1] == 2 and role == "kv"
    for flat in range(n_outer):
        idx, rem, off = [], flat, base
        for _, size, stride in reversed(outer_sorted):
            rem, i = divmod(rem, size)
            idx.append(i)
            off += i * stride
        idx.reverse()
        if split_kv:
            part_role = ("k", "v")[idx[0]]
        elif outer_sorted:
            part_role = role + "." + "_".join(map(str, idx))
        else:
            part_role = role
        for j, (run_off, run) in enumerate(runs):
            r = part_role if len(runs) == 1 else f"{part_role}.kb{j}"
            segments.append(Segment(
                layer=name, role=r, layer_index=layer_index(name), storage=storage,
                offset=off + run_off, block_stride=a_stride * ratio, run=run,
                num_blocks=num_blocks,
                describe=(name, r, str(t.dtype), inner_desc, ratio, run),
            ))
    for s in segments:
        lo, hi = s.offset, s.offset + (num_blocks - 1) * s.block_stride + s.run
        if lo < 0 or hi > storage.numel():
            raise fail("the view reaches outside its storage")
    return segments


def _scale_role(attr: str) -> str:
    a = attr.lower().lstrip("_")
    if "index" in a:
        return "index_scale"
    if a.startswith("k") or "key" in a:
        return "k_scale"
    if a.startswith("v") or "value" in a:
        return "v_scale"
    return "scale"


def _tensor_attrs(obj: object) -> list[tuple[str, torch.Tensor]]:
    found: dict[str, torch.Tensor] = {}
    for mod in (obj, getattr(obj, "impl", None)):
        if mod is None:
            continue
        items = dict(vars(mod))
        items.update(getattr(mod, "_buffers", {}) or {})
        items.update(getattr(mod, "_parameters", {}) or {})
        for attr, value in items.items():
            if isinstance(value, torch.Tensor) and "scale" in attr.lower():
                found.setdefault(attr, value)
    return sorted(found.items())


def _aliases(t: torch.Tensor, spans: list[tuple[int, int]]) -> bool:
    if t.numel() == 0:
        return True
    ptr = t.untyped_storage().data_ptr()
    end = ptr + t.untyped_storage().nbytes()
    return any(lo < end and ptr < hi for lo, hi in spans)


def _as_tensors(value: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return list(value)


def build_layout(
    kv_caches: Mapping[str, torch.Tensor | Sequence[torch.Tensor]],
    groups: Sequence[GroupSpec],
    num_blocks: int,
    kv_cache_dtype: str = "auto",
    layers: Mapping[str, object] | None = None,
    block_axes: Mapping[str, int] | None = None,
    roles: Mapping[str, str] | None = None,
    extra_fingerprint: Mapping[str, object] | None = None,
) -> Layout:
    """Segments per group, in format order, and the fingerprint of the whole geometry.

    ``kv_caches`` maps layer name -> tensor (or a list of tensors for state layers that
    register several); ``layers`` maps layer name -> layer object (for scales kept on the
    layer); ``block_axes`` and ``roles`` override the inference per layer. Raises
    :class:`LayoutError` for anything that cannot be moved as opaque block bytes.
    """
    if not groups:
        raise LayoutError("no KV-cache groups")
    known = {n for g in groups for n in g.layer_names}
    missing = sorted(known - set(kv_caches))
    if missing:
        raise LayoutError(f"layers {missing} are in a KV-cache group but have no registered cache")
    block_axes = block_axes or {}
    roles = roles or {}
    all_spans = [
        (t.untyped_storage().data_ptr(),
         t.untyped_storage().data_ptr() + t.untyped_storage().nbytes())
        for v in kv_caches.values() for t in _as_tensors(v)
    ]
    fixed_scales: dict[str, float] = {}
    out: list[GroupLayout] = []
    for gid, spec in enumerate(groups):
        segs: list[Segment] = []
        for name in spec.layer_names:
            tensors = _as_tensors(kv_caches[name])
            base_role = roles.get(name) or ("state" if spec.kind is GroupKind.STATE
                                            else default_role(name))
            for ti, t in enumerate(tensors):
                role = base_role if len(tensors) == 1 else f"{base_role}.{ti}"
                segs += segment_tensor(name, t, num_blocks, role, block_axes.get(name))
            layer_obj = (layers or {}).get(name)
            if layer_obj is None:
                continue
            for attr, t in _tensor_attrs(layer_obj):
                if t.numel() == 1:
                    fixed_scales[f"{name}.{attr}"] = float(t.detach().float().cpu().item())
                elif _aliases(t, all_spans):
                    continue  # inline scales: their bytes already travel with the block
                elif t.dim() >= 1 and t.shape[0] % num_blocks == 0:
                    segs += segment_tensor(f"{name}.{attr}", t, num_blocks, _scale_role(attr), 0)
                else:
                    raise LayoutError(
                        f"layer {name!r}: scale tensor {attr!r} has {t.numel()} elements but no "
                        f"leading block axis (shape {tuple(t.shape)}, strides {tuple(t.stride())},"
                        f" num_blocks {num_blocks}); kvtier cannot tell which bytes belong to "
                        "which block"
                    )
        segs = _order_and_merge(segs, gid)
        if not segs:
            raise LayoutError(f"KV-cache group {gid} has no bytes to move")
        out.append(GroupLayout(group_id=gid, spec=spec, segments=segs))
    fp = fingerprint(out, kv_cache_dtype, fixed_scales, extra_fingerprint or {})
    return Layout(groups=out, kv_cache_dtype=kv_cache_dtype, fixed_scales=fixed_scales,
                  fingerprint=fp)


def _order_and_merge(segs: list[Segment], gid: int) -> list[Segment]:
    segs.sort(key=lambda s: (s.layer_index, _role_rank(s.role), s.layer, s.role))
    seen: dict[tuple[int, int, int, int], Segment] = {}
    unique: list[Segment] = []
    for s in segs:
        if s.address in seen:
            continue  # an aliased layer (cross-layer KV sharing): its bytes move once
        seen[s.address] = s
        unique.append(s)
    by_start = sorted(unique, key=lambda s: s.span())
    for a, b in zip(by_start, by_start[1:]):
        if a.storage.data_ptr() != b.storage.data_ptr():
            continue
        if _overlap(a, b):
            raise LayoutError(
                f"KV-cache group {gid}: segments {a.layer}/{a.role} and {b.layer}/{b.role} "
                "overlap without being the same bytes"
            )
    merged: list[Segment] = []
    for s in unique:
        p = merged[-1] if merged else None
        if (p is not None and p.storage.data_ptr() == s.storage.data_ptr()
                and p.block_stride == s.block_stride and p.offset + p.run == s.offset):
            merged[-1] = Segment(
                layer=p.layer, role=p.role, layer_index=p.layer_index, storage=p.storage,
                offset=p.offset, block_stride=p.block_stride, run=p.run + s.run,
                num_blocks=p.num_blocks, describe=(*p.describe, "+", *s.describe),
            )
        else:
            merged.append(s)
    return merged


def _overlap(a: Segment, b: Segment) -> bool:
    """Do two segments of one storage share a byte? Exact for equal strides, else by span."""
    if a.block_stride == b.block_stride and a.block_stride > 0:
        lo_a, lo_b = a.offset % a.block_stride, b.offset % b.block_stride
        return lo_a < lo_b + b.run and lo_b < lo_a + a.run and _spans_meet(a, b)
    return _spans_meet(a, b)


def _spans_meet(a: Segment, b: Segment) -> bool:
    (a0, a1), (b0, b1) = a.span(), b.span()
    return a0 < b1 and b0 < a1


def fingerprint(
    groups: Sequence[GroupLayout],
    kv_cache_dtype: str,
    fixed_scales: Mapping[str, float],
    extra: Mapping[str, object],
) -> str:
    """Hash of everything that defines the stored byte format (no addresses, no block count)."""
    desc = {
        "codec": CODEC_VERSION,
        "kv_cache_dtype": kv_cache_dtype,
        "fixed_scales": sorted(fixed_scales.items()),
        "extra": sorted((k, repr(v)) for k, v in extra.items()),
        "groups": [
            {
                "kind": g.spec.kind.value,
                "block_size": g.spec.block_size,
                "window": g.spec.sliding_window,
                "segments": [list(_plain(s.describe)) for s in g.segments],
            }
            for g in groups
        ],
    }
    blob = msgpack.packb(_plain(desc), use_bin_type=True)
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _plain(x: object) -> object:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
