"""One namespace in the store: its arena of the pool, its index and who is attached.

The index is a :class:`~kvtier.index.memory.MemoryIndex` over the arena's slots, shared by
every engine of the namespace (hits computed by one are loads for the others). The first
engine to attach fixes the slot layout (``layout_id``: the slot count of every class, the
group specs and the slab layout); an engine of the same namespace with another layout is
refused. With the store's disk (:mod:`kvtier.store.tiers`) the namespace has a ``tier``,
opened at the first attach that brings the engine's geometry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import msgpack

from kvtier.geometry import Geometry, GroupGeometry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.layout import GroupKind
from kvtier.policy import make_policy
from kvtier.slab import SizeClass, SlabLayout, SlotAllocator
from kvtier.store.pool import Arena

if TYPE_CHECKING:
    from kvtier.store.tiers import SpaceTier


def layout_id(spec: dict[str, Any]) -> bytes:
    """The digest of what engines of one namespace must agree on."""
    fields = [spec["arena_bytes"], list(spec["slots"]), [list(g) for g in spec["groups"]],
              spec.get("layout")]
    return hashlib.blake2b(msgpack.packb(fields), digest_size=16).digest()


class Space:
    def __init__(self, arena: Arena, slots: Sequence[int], groups: Sequence[Sequence[Any]],
                 policy: str) -> None:
        self.arena = arena
        self.allocator = SlotAllocator(list(slots))
        specs = [GroupIndexSpec(slot_class=int(cls), chained=bool(chained),
                                boundary_state=bool(state),
                                policy=make_policy(policy, int(slots[int(cls)])))
                 for cls, chained, state in groups]
        self.index = MemoryIndex(specs, self.allocator)
        self.attached = 0
        self.detached_at = 0.0  # monotonic seconds when the last client left
        self.tier: SpaceTier | None = None  # its share of the store's disk
        self.tier_tried = False  # a tier was opened or refused for this namespace

    def free_slots(self) -> list[int]:
        return [self.allocator.num_free(c) for c in range(len(self.allocator._total))]


def encode_layout(layout: SlabLayout) -> list[Any]:
    """A slab layout as plain lists (what an attach carries)."""
    return [layout.shard_bytes, layout.num_shards,
            [[c.name, c.slot_bytes, c.stride, c.num_slots, c.offset, c.sums_entries,
              c.sums_offset] for c in layout.classes]]


def decode_layout(raw: Sequence[Any]) -> SlabLayout:
    shard_bytes, num_shards, classes = raw
    return SlabLayout(tuple(SizeClass(str(n), int(b), int(st), int(ns), int(off), int(e),
                                      int(so))
                            for n, b, st, ns, off, e, so in classes),
                      int(shard_bytes), int(num_shards))


def encode_geometry(geometry: Geometry) -> dict[str, Any]:
    """An engine's geometry as plain values (what an attach carries for the store's disk)."""
    return {"chunk_tokens": geometry.chunk_tokens, "fingerprint": geometry.fingerprint,
            "groups": [[g.kind.value, g.block_size, g.bytes_per_block, g.sliding_window]
                       for g in geometry.groups]}


def decode_geometry(raw: dict[str, Any]) -> Geometry:
    return Geometry(int(raw["chunk_tokens"]), tuple(
        GroupGeometry(GroupKind(k), int(b), int(n), None if w is None else int(w))
        for k, b, n, w in raw["groups"]), str(raw["fingerprint"]))
