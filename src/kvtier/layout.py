"""Segments: where the bytes of one KV block live in the tensors an engine registers.

A *segment* is a strided byte run: for block ``b`` its bytes are
``storage[offset + b * block_stride : offset + b * block_stride + run]``. A KV-cache group's
block is the concatenation of its segments in a fixed order, and that order *is* the byte
format of a stored chunk, so it is part of the layout fingerprint.

How a registered tensor becomes segments (``num_blocks`` is always passed explicitly; it is
never read from dim 0, which may hold tokens or kernel blocks):

- The *block axis* is the dimension whose size is ``num_blocks * f`` for a whole ``f`` (``f > 1``
  for token-major MLA caches ``(nb*bs, 1, 576)`` and for vLLM's kernel-block splitting, where
  dim 0 is ``num_blocks`` times the kernel blocks per block). The engine adapter says which
  dimension it is (``block_axes``, from what the engine declares). Without it, the shape is
  trusted only when exactly one dimension is a whole multiple of ``num_blocks``; anything else
  (``num_blocks == 1``, where every dimension is; a K/V axis of 2 beside ``2 * f`` kernel blocks
  when ``num_blocks == 2``; two dimensions of exactly ``num_blocks``) is a coincidence of sizes,
  and a :class:`LayoutError` asks for ``block_axes`` instead of guessing.
- Dimensions with a larger stride than the block axis are *outer*: each index combination is
  its own segment (K and V regions of a ``(2, nb, ...)`` tensor, a ``(nb, 2, ...)`` view whose
  dim 1 jumps the whole K region, or the heads of a head-outer layout). They must not overlap
  the blocks.
- Dimensions with a smaller stride (and the kernel blocks of one block) make up the block:
  those that tile each other from one element up form one dense run; the rest are *pieces*
  with gaps between them (a head-major interior of a block-outer layout such as vLLM's
  BHLNC, where the other layers' pages of the same head sit in between): one run per piece,
  in memory order. A gap after the last byte (padded pages) is fine. Anything that overlaps
  itself or its neighbours cannot be segmented and is a :class:`LayoutError` naming the layer,
  shape and strides.

The bytes of one block of one tensor are therefore its bytes in memory order (its dimensions
sorted outermost first), and a group's block is its tensors' blocks in format order.

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
from collections.abc import Callable, Mapping, Sequence
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
    # Position among its layer's segments (memory order within a tensor); breaks ties in the
    # format order so that piece 10 never sorts before piece 2.
    order: int = 0
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


def _pick_block_axis(
    dims: list[tuple[int, int, int]], num_blocks: int, fail: Callable[[str], LayoutError]
) -> tuple[int, int, int]:
    """The block axis among ``(index, size, byte stride)`` dims when the caller did not say:
    the one dimension whose size is a whole multiple of ``num_blocks``, or an error."""
    candidates = [d for d in dims if d[1] % num_blocks == 0 and d[1] >= num_blocks]
    if not candidates:
        raise fail("no dimension is a whole multiple of num_blocks")
    if len(candidates) > 1:
        names = ", ".join(f"dim {d[0]} (size {d[1]})" for d in candidates)
        raise fail(
            f"the block axis is ambiguous: {names} could each hold the blocks, and sizes "
            "alone never decide it; pass block_axes={layer: dim} from what the engine declares"
        )
    return candidates[0]


@dataclass(frozen=True)
class _BlockSplit:
    """How one tensor's dimensions divide around its block axis (see the module docstring)."""

    axis: int  # index of the block axis
    ratio: int  # kernel blocks per manager block
    block_stride: int  # bytes from one block to the next
    outer: list[tuple[int, int, int]]  # (index, size, byte stride), memory order
    run: int  # bytes of the dense run
    run_dims: list[tuple[int, int, int]]  # the inner dims that make up the run
    piece_dims: list[tuple[int, int, int]]  # the inner dims with gaps: one run per index


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
    if t.numel() == 0:
        raise fail("the tensor is empty")
    es = t.element_size()
    dims = [(i, int(size), int(stride) * es) for i, (size, stride) in
            enumerate(zip(t.shape, t.stride()))]
    if block_axis is None:
        axis = _pick_block_axis(dims, num_blocks, fail)
    else:
        if not -t.dim() <= block_axis < t.dim():
            raise fail(f"block axis {block_axis} is not a dimension of the tensor")
        axis = dims[block_axis % t.dim()]
        if axis[1] % num_blocks or axis[1] == 0:
            raise fail(f"dim {axis[0]} is not a multiple of num_blocks")
    split = _split_around(dims, axis, num_blocks, es, fail)
    segments = _segments_of(name, t, role, num_blocks, split)
    for s in segments:
        lo, hi = s.offset, s.offset + (num_blocks - 1) * s.block_stride + s.run
        if lo < 0 or hi > s.storage.numel():
            raise fail("the view reaches outside its storage")
    return segments


def _split_around(dims: list[tuple[int, int, int]], axis: tuple[int, int, int],
                  num_blocks: int, es: int, fail: Callable[[str], LayoutError]) -> _BlockSplit:
    """Outer dims, the dense run and the pieces of a block; errors for overlapping bytes."""
    a_idx, a_size, a_stride = axis
    ratio = a_size // num_blocks
    if a_size > 1 and a_stride <= 0:
        raise fail("the block axis has no stride")
    others = [d for d in dims if d[0] != a_idx and d[1] > 1]
    if any(d[2] <= 0 for d in others):
        raise fail("a dimension has stride 0 or less (broadcast or flipped bytes)")
    if a_size > 1 and any(d[2] == a_stride for d in others):
        raise fail("another dimension shares the block axis stride")
    # A block axis of size 1 (one block, no kernel blocks) has a stride that locates nothing:
    # a dimension with the same stride cannot lie inside the block (it would overlap the next
    # block if there were one), so it is outer, as it is with more blocks (head-outer layouts).
    outer = sorted((d for d in others if d[2] > a_stride or (a_size == 1 and d[2] == a_stride)),
                   key=lambda d: -d[2])  # memory order
    inner = [d for d in others if d[2] < a_stride]
    block_stride = a_stride * ratio
    if ratio > 1:
        # The kernel blocks of one manager block: an inner dimension of the manager block.
        inner.append((a_idx, ratio, a_stride))
    inner.sort(key=lambda d: d[2])
    # The dense run: inner dims that tile each other exactly from one element up.
    run, k = es, 0
    while k < len(inner) and inner[k][2] == run:
        run *= inner[k][1]
        k += 1
    piece_dims = inner[k:]  # gaps between them: one run per index combination
    extent = run
    for _, size, stride in piece_dims:
        if stride < extent:
            raise fail("the bytes of one block overlap each other")
        extent += stride * (size - 1)
    if extent > block_stride and num_blocks > 1:
        raise fail("blocks overlap")
    region = (num_blocks - 1) * block_stride + extent
    for _, size, stride in sorted(outer, key=lambda d: d[2]):
        if stride < region:
            raise fail("a dimension outside the block axis overlaps the blocks")
        region += stride * (size - 1)
    n_pieces = math.prod(d[1] for d in outer) * math.prod(d[1] for d in piece_dims)
    if n_pieces > MAX_SEGMENTS_PER_TENSOR:
        raise fail(f"{n_pieces} pieces per block, more than {MAX_SEGMENTS_PER_TENSOR}")
    return _BlockSplit(a_idx, ratio, block_stride, outer, run, inner[:k], piece_dims)


def _segments_of(name: str, t: torch.Tensor, role: str, num_blocks: int,
                 split: _BlockSplit) -> list[Segment]:
    """One segment per outer index combination and piece, in memory order."""
    outer, piece_dims, a_idx = split.outer, split.piece_dims, split.axis
    storage = _byte_storage(t)
    base = t.storage_offset() * t.element_size()
    inner_desc = tuple((size, stride) for _, size, stride in split.run_dims)
    piece_desc = tuple((size, stride) for _, size, stride in piece_dims)
    # Pieces in memory order (outermost piece dim first): offsets increase.
    piece_offsets = [0]
    for _, size, stride in sorted(piece_dims, key=lambda d: -d[2]):
        piece_offsets = [o + i * stride for o in piece_offsets for i in range(size)]
    split_kv = len(outer) == 1 and outer[0][1] == 2 and role == "kv"
    segments = []
    for flat in range(math.prod(d[1] for d in outer)):
        idx, rem, off = [], flat, base
        for _, size, stride in reversed(outer):
            rem, i = divmod(rem, size)
            idx.append(i)
            off += i * stride
        idx.reverse()
        if split_kv:
            part_role = ("k", "v")[idx[0]]
        elif outer:
            part_role = role + "." + "_".join(map(str, idx))
        else:
            part_role = role
        for j, p_off in enumerate(piece_offsets):
            r = part_role if len(piece_offsets) == 1 else f"{part_role}.p{j}"
            segments.append(Segment(
                layer=name, role=r, layer_index=layer_index(name), storage=storage,
                offset=off + p_off, block_stride=split.block_stride, run=split.run,
                num_blocks=num_blocks, order=len(segments),
                describe=(name, r, str(t.dtype), tuple(t.shape[:a_idx]),
                          tuple(t.shape[a_idx + 1:]), split.ratio, inner_desc, piece_desc,
                          p_off, split.run),
            ))
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
            layer_segs: list[Segment] = []
            for ti, t in enumerate(tensors):
                role = base_role if len(tensors) == 1 else f"{base_role}.{ti}"
                layer_segs += segment_tensor(name, t, num_blocks, role, block_axes.get(name))
            layer_obj = (layers or {}).get(name)
            for attr, t in _tensor_attrs(layer_obj) if layer_obj is not None else []:
                if t.numel() == 1:
                    fixed_scales[f"{name}.{attr}"] = float(t.detach().float().cpu().item())
                elif _aliases(t, all_spans):
                    continue  # inline scales: their bytes already travel with the block
                elif t.dim() >= 1 and t.shape[0] % num_blocks == 0 and t.shape[0] > 0:
                    layer_segs += segment_tensor(
                        f"{name}.{attr}", t, num_blocks, _scale_role(attr), 0
                    )
                else:
                    raise LayoutError(
                        f"layer {name!r}: scale tensor {attr!r} has {t.numel()} elements but no "
                        f"leading block axis (shape {tuple(t.shape)}, strides {tuple(t.stride())},"
                        f" num_blocks {num_blocks}); kvtier cannot tell which bytes belong to "
                        "which block"
                    )
            for i, s in enumerate(layer_segs):
                s.order = i
            segs += layer_segs
        segs = _order_and_merge(segs, gid)
        if not segs:
            raise LayoutError(f"KV-cache group {gid} has no bytes to move")
        out.append(GroupLayout(group_id=gid, spec=spec, segments=segs))
    fp = fingerprint(out, kv_cache_dtype, fixed_scales, extra_fingerprint or {})
    return Layout(groups=out, kv_cache_dtype=kv_cache_dtype, fixed_scales=fixed_scales,
                  fingerprint=fp)


def _order_and_merge(segs: list[Segment], gid: int) -> list[Segment]:
    segs.sort(key=lambda s: (s.layer_index, _role_rank(s.role), s.layer, s.order))
    seen: dict[tuple[int, int, int, int], Segment] = {}
    unique: list[Segment] = []
    for s in segs:
        if s.address in seen:
            continue  # an aliased layer (cross-layer KV sharing): its bytes move once
        seen[s.address] = s
        unique.append(s)
    by_start = sorted(unique, key=lambda s: s.span())
    for i, a in enumerate(by_start):
        for b in by_start[i + 1:]:
            if b.span()[0] >= a.span()[1]:
                break
            if a.storage.data_ptr() == b.storage.data_ptr() and _overlap(a, b):
                raise LayoutError(
                    f"KV-cache group {gid}: segments {a.layer}/{a.role} and {b.layer}/{b.role}"
                    " overlap without being the same bytes"
                )
    merged: list[Segment] = []
    for s in unique:
        p = merged[-1] if merged else None
        if (p is not None and p.storage.data_ptr() == s.storage.data_ptr()
                and p.block_stride == s.block_stride and p.offset + p.run == s.offset):
            merged[-1] = Segment(
                layer=p.layer, role=p.role, layer_index=p.layer_index, storage=p.storage,
                offset=p.offset, block_stride=p.block_stride, run=p.run + s.run,
                num_blocks=p.num_blocks, order=p.order,
                describe=(*p.describe, "+", *s.describe),
            )
        else:
            merged.append(s)
    return merged


def _overlap(a: Segment, b: Segment) -> bool:
    """Do two segments of one storage share a byte? Exact for equal strides, else by span."""
    if a.block_stride == b.block_stride and a.block_stride > 0 and a.num_blocks == b.num_blocks:
        # Block i of a meets block j of b iff d - a.run < (i - j) * stride < d + b.run.
        stride, d, n = a.block_stride, b.offset - a.offset, a.num_blocks
        k = max((d - a.run) // stride + 1, -(n - 1))
        return k <= n - 1 and k * stride < d + b.run
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
    """Hash of everything that defines the stored byte format (no addresses, no block count).

    Segments enter as they were before adjacent runs were merged: which runs happen to touch
    depends on the block count (with one block, the layers of a layer-outer buffer do), and
    merging never changes the bytes of a chunk."""
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
                "segments": [list(_plain(d)) for s in g.segments for d in _unmerged(s.describe)],
            }
            for g in groups
        ],
    }
    blob = msgpack.packb(_plain(desc), use_bin_type=True)
    return hashlib.blake2b(blob, digest_size=16).hexdigest()


def _unmerged(describe: tuple) -> list[tuple]:
    """The describes a merged segment was made of (joined by "+" in ``_order_and_merge``)."""
    parts: list[tuple] = [()]
    for item in describe:
        if item == "+":
            parts.append(())
        else:
            parts[-1] = (*parts[-1], item)
    return parts


def _plain(x: object) -> object:
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x
