"""The index: which chunks are stored, in which slot, and which may leave.

Lifecycle of a stored chunk (one per group and key)::

    reserve -> WRITING --commit--> READY --(evict | reset)--> gone
                  \\--abort--> gone (with every stored descendant)

- ``reserve`` takes a slot (evicting an unpinned, ready leaf if none is free) and creates a
  WRITING entry, invisible to lookups. A full-attention chunk needs its parent stored (ready or
  writing), so the store never holds orphans; while a child is stored its parent cannot leave.
- ``commit`` makes it visible (every rank wrote its bytes); ``abort`` drops it and its subtree.
- ``pin`` protects ready chunks a decided load reads; ``unpin`` when the load ends, whatever
  its outcome. A pin never expires in-process.
- ``reset`` drops everything; pinned or writing entries become *doomed*: invisible at once,
  their slot freed when their last pin or write ends.
- Recurrent state: the state objects of one boundary (one per state group, under the key of
  the chunk that ends there) are one unit. Reserve every member before committing any: a
  set committed without all its members, or without the boundary's chunk, is dropped. A set
  is ready only whole (``match``, ``is_ready``, ``pin`` see it so), leaves whole (eviction
  pressure takes a whole set, never one pinned in any member), and leaves with its chunk.

Handles (:class:`Entry`) make the late operations exact: a ``commit`` or ``unpin`` for an entry
that was reset and re-created under the same key acts on the old one only.

A lookup may be answered later by an index that lives in another process (docs/design.md §2.11):
``match`` returns ``None`` to say "ask again next step".
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.protocol import SaveDrop


class Entry:
    """One stored chunk. Mutated only by its index."""

    __slots__ = ("children", "doomed", "group", "key", "leaving", "parent", "pins", "ready",
                 "slot")

    def __init__(self, group: int, key: bytes, slot: int, parent: Entry | None) -> None:
        self.group = group
        self.key = key
        self.slot = slot
        self.parent = parent
        self.children: list[Entry] | None = None
        self.pins = 0
        self.ready = False
        self.doomed = False
        self.leaving = False  # on its way to a lower tier (MemoryIndex.begin_leave)

    def __repr__(self) -> str:
        state = "doomed" if self.doomed else ("ready" if self.ready else "writing")
        return f"Entry(g{self.group} {self.key.hex()[:8]} slot={self.slot} {state} pins={self.pins})"


class ChunkReserve(NamedTuple):
    """One chunk's writes asked of :meth:`Index.reserve_chunks`: ``groups`` in this order, all
    under ``key`` (``parent_key`` for the chained groups, as :meth:`Index.reserve`)."""

    key: bytes
    parent_key: bytes | None
    groups: Sequence[int]


@dataclass
class IndexStats:
    stored: int = 0
    writing: int = 0
    pinned: int = 0
    doomed: int = 0
    evictions: int = 0
    free_slots: int = 0


class Index(ABC):
    @abstractmethod
    def match(self, group: int, keys: Sequence[bytes]) -> int | None:
        """Number of leading ``keys`` that are READY in ``group`` (None: ask again later)."""

    @abstractmethod
    def is_ready(self, group: int, key: bytes) -> bool: ...

    @abstractmethod
    def get(self, group: int, key: bytes) -> Entry | None:
        """The live (not doomed) entry for ``key``, ready or writing."""

    @abstractmethod
    def reserve(
        self, group: int, key: bytes, parent_key: bytes | None
    ) -> Entry | SaveDrop:
        """A WRITING entry, or why not: STORED, NO_PARENT or FULL."""

    @abstractmethod
    def commit(self, entry: Entry) -> bool:
        """WRITING -> READY. False when the entry was doomed meanwhile, or is a state object
        whose set or chunk is not stored (its slot is freed, with the set's other members)."""

    def reserve_chunks(self, chunks: Sequence[ChunkReserve]) -> list[list[Entry] | SaveDrop]:
        """:meth:`reserve` of each chunk's groups, chunk by chunk in order, asked at once (one
        round trip for an index behind a socket). Per chunk answered: its entries (one per
        group, in ``groups`` order), or the drop of its first refused group, the entries of
        its earlier groups aborted. After a drop whose
        :attr:`~kvtier.protocol.SaveDrop.drops_later_chunks` is true nothing more is reserved
        and the answer ends (it is shorter than ``chunks``): a later chunk would be an orphan,
        and reserving it could evict a stored chunk for nothing. If a reserve raises, every
        entry of this call is aborted first."""
        out: list[list[Entry] | SaveDrop] = []
        try:
            for c in chunks:
                got = self._reserve_chunk(c)
                out.append(got)
                if isinstance(got, SaveDrop) and got.drops_later_chunks:
                    break
        except BaseException:
            for entries in reversed(out):
                if not isinstance(entries, SaveDrop):
                    for e in reversed(entries):
                        self.abort(e)
            raise
        return out

    def _reserve_chunk(self, c: ChunkReserve) -> list[Entry] | SaveDrop:
        entries: list[Entry] = []
        try:
            for g in c.groups:
                e = self.reserve(g, c.key, c.parent_key)
                if not isinstance(e, Entry):
                    for done in entries:  # the chunk is one unit: none of it is written
                        self.abort(done)
                    return e
                entries.append(e)
        except BaseException:
            for done in reversed(entries):
                self.abort(done)
            raise
        return entries

    def stored_or_writing(self, num_groups: int, keys: Sequence[bytes]) -> list[list[bool]]:
        """For each of the first ``num_groups`` groups, whether each of ``keys`` has a live
        entry (:meth:`get` is not None), asked at once (one round trip for an index behind
        a socket)."""
        return [[self.get(g, k) is not None for k in keys] for g in range(num_groups)]

    def flush(self) -> None:
        """Send what :meth:`commit_without_answer` and the other answerless calls queued
        (an index behind a socket); nothing to do for an in-process index."""
        return None

    def commit_without_answer(self, entry: Entry) -> None:
        """:meth:`commit` where the caller needs no answer: an index behind a socket may send
        it later, ahead of its next request (:class:`kvtier.store.index.StoreIndex`)."""
        self.commit(entry)

    @abstractmethod
    def abort(self, entry: Entry) -> None: ...

    @abstractmethod
    def pin(self, group: int, keys: Sequence[bytes]) -> list[Entry]:
        """Pin READY chunks; raises KeyError if one is not ready (decide, then pin)."""

    @abstractmethod
    def unpin(self, entries: Sequence[Entry]) -> None: ...

    @abstractmethod
    def discard(self, entry: Entry) -> None:
        """Drop a READY entry whose stored bytes are bad (a checksum mismatch), with every
        stored descendant and, for a chunk, its boundary's state set: none is usable without
        it. Pinned entries become doomed (their slot is freed when their last pin ends); an
        entry already gone is left alone."""

    @abstractmethod
    def touch(self, group: int, keys: Sequence[bytes]) -> None:
        """A hit on a prefix: refresh it leaf-first so its root is the newest."""

    @abstractmethod
    def reset(self) -> int:
        """Drop everything (pinned/writing entries are doomed). Returns entries dropped."""

    @abstractmethod
    def stats(self) -> IndexStats: ...
