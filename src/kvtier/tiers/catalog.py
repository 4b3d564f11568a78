"""The scheduler's index of one lower tier: which chunks it holds, per group, within a chunk
budget, evicted leaves first; and the deletes of what it forgot, for the workers to apply.

It is a :class:`~kvtier.index.memory.MemoryIndex` over *virtual* slots (a slot is a chunk's
share of the tier's budget, not an address: the tier finds a chunk by its key), so the tier
inherits every lifecycle rule of the DRAM index: a chunk is visible only once every rank
wrote it (commit), a child needs its parent stored, only leaves leave, pins protect what a
promotion reads, and a reset dooms what is in flight.

Deletes: every chunk whose budget slot is freed is forgotten by the tier too, unless the same
key is stored again meanwhile (a chunk's file name is a function of its key, and its parent of
its key: a late delete of an old copy must not remove the new one). The worker applies them in
order with the writes, so a delete never overtakes a later write of the same chunk.
"""

from __future__ import annotations

from kvtier.index.base import Entry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.policy.lru import LRUPolicy
from kvtier.protocol import SaveDrop
from kvtier.slab import SlotAllocator
from kvtier.tiers.directory import ScanResult
from kvtier.tiers.seam import TierOp


class TierCatalog:
    def __init__(self, num_groups: int, capacity_chunks: int) -> None:
        if capacity_chunks < 1:
            raise ValueError("a tier needs room for at least one chunk of every group")
        self.capacity = capacity_chunks
        specs = [GroupIndexSpec(slot_class=g, policy=LRUPolicy(capacity_chunks), chained=True)
                 for g in range(num_groups)]
        self.index = MemoryIndex(specs, SlotAllocator([capacity_chunks] * num_groups),
                                 on_free=self._freed)
        self.parents: dict[tuple[int, bytes], bytes | None] = {}
        self.deletes: list[TierOp] = []

    def reserve(self, group: int, key: bytes, parent: bytes | None) -> Entry | SaveDrop:
        """A WRITING entry for ``key`` (evicting a tier leaf if the budget is spent)."""
        e = self.index.reserve(group, key, parent)
        if isinstance(e, Entry):
            self.parents[(group, key)] = parent
        return e

    def _freed(self, group: int, key: bytes) -> None:
        if self.index.get(group, key) is not None:
            return  # stored again: its file is the new copy's
        parent = self.parents.pop((group, key), None)
        self.deletes.append(TierOp(group, -1, key, parent))

    def take_deletes(self) -> list[TierOp]:
        out, self.deletes = self.deletes, []
        return out

    def stored(self, group: int) -> int:
        return self.index.num_stored(group)

    def rebuild(self, found: ScanResult) -> int:
        """Register the chunks a directory scan found, parents first, older first (the LRU
        order survives the restart); chunks whose parent is missing, chunks only some shards
        hold and chunks beyond the budget are deleted. Returns the chunks registered."""
        by_key = {(c.name.group, c.name.key): c for c in found.chunks}
        depth: dict[tuple[int, bytes], int] = {}
        for gk in by_key:
            chain = [gk]  # walk up to a chunk of known depth, a root, or a missing parent
            while True:
                parent = by_key[chain[-1]].name.parent
                up = (gk[0], parent) if parent is not None else None
                if up is None or up not in by_key or up in depth:
                    break
                chain.append(up)
            top = by_key[chain[-1]].name.parent
            base = depth.get((gk[0], top), -1) if top is not None else -1
            for i, item in enumerate(reversed(chain)):
                depth.setdefault(item, base + 1 + i)
        order = sorted(by_key, key=lambda gk: (depth[gk], by_key[gk].mtime))
        for gk in order:
            c = by_key[gk].name
            e = self.reserve(c.group, c.key, c.parent)
            if not isinstance(e, Entry):
                self.deletes.append(TierOp(c.group, -1, c.key, c.parent))  # an orphan
                continue
            self.index.commit(e)
        self.deletes.extend(TierOp(c.group, -1, c.key, c.parent) for _, c in found.partial)
        return sum(self.index.num_stored(g) for g in range(len(self.index.groups)))

    def check_invariants(self) -> None:
        self.index.check_invariants()

