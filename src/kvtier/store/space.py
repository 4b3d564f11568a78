"""One namespace in the store: its arena of the pool, its index and who is attached.

The index is a :class:`~kvtier.index.memory.MemoryIndex` over the arena's slots, shared by
every engine of the namespace (hits computed by one are loads for the others). The first
engine to attach fixes the slot layout (``layout_id``: the slot count of every class and the
group specs); an engine of the same namespace with another layout is refused.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import msgpack

from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.policy import make_policy
from kvtier.slab import SlotAllocator
from kvtier.store.pool import Arena


def layout_id(spec: dict[str, Any]) -> bytes:
    """The digest of what engines of one namespace must agree on."""
    fields = [spec["arena_bytes"], list(spec["slots"]), [list(g) for g in spec["groups"]]]
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

    def free_slots(self) -> list[int]:
        return [self.allocator.num_free(c) for c in range(len(self.allocator._total))]
