"""Host memory in fixed-size slots: the geometry (shared by scheduler and workers), the slot
allocator (scheduler), and the memory itself (workers).

- One *size class* per KV-cache group (one slot = one chunk of that group) and one for
  recurrent-state objects. Slots of a class are equal, so there is no fragmentation, and
  allocate/free are O(1) stack operations.
- Every KV group gets the same number of slots: a hit needs the same chunks of every group.
- A *shard* is one rank's copy of every slot. Layouts replicated across TP ranks (MLA) keep one
  shard that every rank reads; others keep one shard per rank, in the same slot numbering.
- With more than one rank the memory is a shared-memory segment (:mod:`kvtier.shm`: reserved
  up front, private to this engine, unlinked once every rank mapped it) so that ranks can
  read each other's shards; with one, plain process memory (no /dev/shm needed).
- Every slot class has a *checksum table* (int64, ``entries`` per slot: one per block position
  of its chunk, :mod:`kvtier.checksum`) in each shard, after the slots: inside ``dram_size``
  and, under TP, inside the shared segment, so every rank sees every shard's table. The
  region is laid out whether or not checksums are verified, so the setting never changes
  the layout.
- For a GPU, memory is registered (pinned) after the device is set, through a
  :class:`Pinner` (for CUDA :class:`kvtier.gpu.pinning.CudaPinner`; this module makes no
  device call), in steps of at most ``pin_step`` bytes that never split a slot; a size the
  host cannot provide is refused at start-up with the numbers.
"""

from __future__ import annotations

import contextlib
import mmap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from kvtier.config import format_bytes
from kvtier.hostmem import check_dram_size
from kvtier.huge_pages import huge_page_buffer
from kvtier.shm import SharedSlab, SlabError, map_shared_segment

ALIGN = 4096


def _align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class SizeClass:
    name: str
    slot_bytes: int  # payload bytes of one slot
    stride: int  # slot_bytes rounded up to ALIGN
    num_slots: int
    offset: int  # of slot 0 inside a shard
    sums_entries: int = 1  # checksum entries (int64) per slot: one per block position
    sums_offset: int = 0  # of the class's checksum table inside a shard (8-byte aligned)

    @property
    def bytes(self) -> int:
        return self.stride * self.num_slots

    @property
    def sums_bytes(self) -> int:
        return 8 * self.sums_entries * self.num_slots


@dataclass(frozen=True)
class SlabLayout:
    """Where every slot of every size class lies in the slab (both halves derive it alike)."""

    classes: tuple[SizeClass, ...]
    shard_bytes: int
    num_shards: int

    @property
    def total_bytes(self) -> int:
        return self.shard_bytes * self.num_shards

    def offset(self, cls: int, slot: int, shard: int = 0) -> int:
        c = self.classes[cls]
        if not 0 <= slot < c.num_slots:
            raise IndexError(f"slot {slot} outside class {c.name} ({c.num_slots} slots)")
        return shard * self.shard_bytes + c.offset + slot * c.stride


def lay_out_slab(
    total_bytes: int,
    kv_slot_bytes: Sequence[int],
    num_shards: int = 1,
    state_slot_bytes: int | None = None,
    state_bytes: int | None = None,
    checksum_entries: Sequence[int] | None = None,
) -> SlabLayout:
    """Split ``total_bytes`` (all shards) into size classes and their checksum tables.

    KV classes come first (one per group, same slot count), the state class last, with
    ``state_bytes`` of the total (default a quarter). A model with only recurrent state (no
    KV classes) gives all of ``total_bytes`` to state. ``checksum_entries``: per class (KV
    classes, then state), the checksum entries of one slot (default 1 each). Each shard is
    the KV slots, the KV tables, the state slots, the state table, each region aligned.
    """
    if num_shards < 1:
        raise SlabError("num_shards must be at least 1")
    per_shard = total_bytes // num_shards
    state_share = 0
    strides = [_align_up(b) for b in kv_slot_bytes]
    n_classes = len(strides) + (1 if state_slot_bytes else 0)
    entries = list(checksum_entries) if checksum_entries is not None else [1] * n_classes
    if len(entries) != n_classes or any(e < 1 for e in entries):
        raise SlabError(f"checksum entries {entries} for {n_classes} slot classes")
    if state_slot_bytes and not strides:
        state_share = per_shard  # only recurrent state: nothing else to leave room for
    elif state_slot_bytes:
        state_share = (state_bytes if state_bytes is not None else total_bytes // 4) // num_shards
    kv_entries = entries[: len(strides)]
    kv_slots = _slots_fitting(per_shard - state_share, sum(strides), 8 * sum(kv_entries))
    if strides and kv_slots < 1:
        raise SlabError(
            f"dram_size {format_bytes(total_bytes)} holds no chunk: one chunk of every group "
            f"needs {format_bytes(sum(strides) * num_shards)} over {num_shards} shard(s); "
            "raise dram_size or lower chunk_tokens"
        )
    classes, pos = [], 0
    for g, (b, s) in enumerate(zip(kv_slot_bytes, strides)):
        classes.append(SizeClass(f"g{g}", b, s, kv_slots, pos, kv_entries[g]))
        pos += s * kv_slots
    for g in range(len(classes)):
        classes[g] = replace(classes[g], sums_offset=pos)
        pos += classes[g].sums_bytes
    pos = _align_up(pos)
    if state_slot_bytes:
        stride = _align_up(state_slot_bytes)
        n_state = _slots_fitting(state_share, stride, 8 * entries[-1])
        if n_state < 1:
            raise SlabError(
                f"the state share {format_bytes(state_share * num_shards)} holds no recurrent-"
                f"state object of {format_bytes(state_slot_bytes)}; raise state_size"
            )
        state = SizeClass("state", state_slot_bytes, stride, n_state, pos, entries[-1])
        pos += stride * n_state
        classes.append(replace(state, sums_offset=pos))
        pos += state.sums_bytes
    return SlabLayout(tuple(classes), _align_up(pos), num_shards)


def _slots_fitting(budget: int, stride: int, table_bytes: int) -> int:
    """The most slots of ``stride`` bytes (per slot also ``table_bytes`` of checksum table,
    the table rounded up to :data:`ALIGN`) within ``budget`` bytes."""
    if stride <= 0 or budget <= 0:
        return 0
    n = budget // (stride + table_bytes)
    while n > 0 and n * stride + _align_up(n * table_bytes) > budget:
        n -= 1
    return n


class SlotAllocator:
    """Free slots per class as a stack: O(1) allocate and free, double frees caught."""

    def __init__(self, slots_per_class: Sequence[int]) -> None:
        self._free = [list(range(n - 1, -1, -1)) for n in slots_per_class]
        self._used = [bytearray(n) for n in slots_per_class]
        self._total = list(slots_per_class)

    @classmethod
    def for_layout(cls, layout: SlabLayout) -> SlotAllocator:
        return cls([c.num_slots for c in layout.classes])

    def num_slots(self, cls: int) -> int:
        return self._total[cls]

    def num_free(self, cls: int) -> int:
        return len(self._free[cls])

    def can_allocate(self, cls: int) -> bool:
        return bool(self._free[cls])

    def allocate(self, cls: int) -> int | None:
        if not self._free[cls]:
            return None
        slot = self._free[cls].pop()
        self._used[cls][slot] = 1
        return slot

    def free(self, cls: int, slot: int) -> None:
        if not self._used[cls][slot]:
            raise ValueError(f"slot {slot} of class {cls} freed twice")
        self._used[cls][slot] = 0
        self._free[cls].append(slot)


class Pinner(Protocol):
    """Page-locks host memory for a device's DMA engines (:class:`kvtier.gpu.pinning.
    CudaPinner` for CUDA)."""

    def register(self, ptr: int, length: int) -> None:
        """Pin ``length`` bytes at address ``ptr``; raise, with the device's reason, if the
        host cannot."""
        ...

    def unregister(self, ptr: int) -> None:
        """Undo the registration that starts at ``ptr``."""
        ...


class HostSlab:
    """The slab's memory in one process: every shard mapped, this rank's shard writable.

    ``shared``: the slab is one shared-memory segment that every rank of ``shared.ranks`` maps
    (:func:`kvtier.shm.map_shared_segment`: every rank constructs its HostSlab together; the
    segment is reserved up front and already unlinked when this returns). None: private
    memory (an anonymous mapping: every slot starts on a page).
    ``pinner``: pins the memory, in :func:`pin_ranges` of at most ``pin_step`` bytes, and
    unpins it at ``close``; None: not pinned.
    ``region``: the slab lies in a mapping made elsewhere (the node-wide store's pool,
    :mod:`kvtier.store.attach`), at that byte offset; the slab owns the mapping from now on
    and closes it at ``close``.
    """

    def __init__(
        self,
        layout: SlabLayout,
        shared: SharedSlab | None = None,
        pin_step: int = 2**30,
        pinner: Pinner | None = None,
        region: tuple[mmap.mmap, int] | None = None,
    ) -> None:
        self.layout = layout
        self.shared = shared
        self._mmap: mmap.mmap | None = None
        self._registered: list[int] = []
        self._pinner: Pinner | None = None
        total = layout.total_bytes
        if region is not None:
            self._mmap = region[0]
            self.buffer = torch.frombuffer(region[0], dtype=torch.uint8, count=total,
                                           offset=region[1])
        elif shared is None:
            check_dram_size(total)  # MemAvailable and the cgroup's headroom (ConfigError)
            # private huge-page memory, not torch.empty (64-byte aligned): page-aligned
            # slots, so the disk tier's O_DIRECT reads and writes move them without a
            # staging copy, each chunk in one device request (kvtier.huge_pages)
            self._mmap, self.buffer = huge_page_buffer(total)
            self.buffer = self.buffer[:total]
        else:
            self.buffer = self._map_shared(shared, total)
        if pinner is not None:
            self._pin(pinner, pin_step)

    def _map_shared(self, shared: SharedSlab, size: int) -> torch.Tensor:
        self._mmap = map_shared_segment(shared, size)
        return torch.frombuffer(self._mmap, dtype=torch.uint8)

    def _pin(self, pinner: Pinner, pin_step: int) -> None:
        """Register every :func:`pin_ranges` piece; on a refusal undo what was registered."""
        self._pinner = pinner
        try:
            self._registered = pin_region(pinner, self.buffer.data_ptr(), self.layout, pin_step)
        except SlabError:
            self.close()
            raise

    def vacate(self) -> tuple[Callable[[], None], Callable[[], None]]:
        """Stop using the slab's memory now; returns how to release it, which the caller may
        run on another thread: ``unpin`` (unregister every pinned range) and then ``unmap``.

        Contract: nothing copies to or from the slab any more (the caller drained it). From
        now until :meth:`occupy` the buffer is empty, so a copy that still came would fail
        on its bounds instead of reading or writing memory the slab no longer stands for.
        """
        registered, pinner, mapping = self._registered, self._pinner, self._mmap
        self._registered, self._mmap = [], None
        self.buffer = torch.empty(0, dtype=torch.uint8)

        def unpin() -> None:
            if pinner is not None:
                for ptr in registered:
                    pinner.unregister(ptr)

        def unmap() -> None:  # after unpin: CUDA's registration is of the mapped pages
            if mapping is not None:
                with contextlib.suppress(BufferError):  # a view alive: unmapped with it
                    mapping.close()

        return unpin, unmap

    def occupy(self, region: tuple[mmap.mmap, int], registered: Sequence[int],
               pinner: Pinner | None) -> None:
        """Take ``region`` (a mapping and the slab's byte offset in it, owned by the slab from
        now on) as the slab's memory, after :meth:`vacate`. ``registered``: the starts of
        its ranges ``pinner`` already pinned (:func:`pin_region`), unpinned at close."""
        # vLLM calls the worker's step hooks under torch.inference_mode; the transfer thread
        # writes the slab outside it, which an inference tensor refuses
        with torch.inference_mode(False):
            self.buffer = torch.frombuffer(region[0], dtype=torch.uint8,
                                           count=self.layout.total_bytes, offset=region[1])
        self._mmap = region[0]
        self._registered = list(registered)
        self._pinner = pinner

    @property
    def registered(self) -> list[int]:
        """Start addresses of the slab's pinned (registered) ranges, in order."""
        return list(self._registered)

    def view(self, cls: int, slot: int, shard: int = 0) -> torch.Tensor:
        """The ``slot_bytes`` of one slot of one shard, as a uint8 tensor."""
        off = self.layout.offset(cls, slot, shard)
        return self.buffer[off : off + self.layout.classes[cls].slot_bytes]

    def sums(self, cls: int, shard: int = 0) -> torch.Tensor:
        """The checksum table of one class in one shard: ``(num_slots, entries)`` int64, a
        view of the slab memory (written by the rank that saves the slot, read by loads)."""
        c = self.layout.classes[cls]
        off = shard * self.layout.shard_bytes + c.sums_offset
        return self.buffer[off : off + c.sums_bytes].view(torch.int64).view(
            c.num_slots, c.sums_entries)

    def close(self) -> None:
        if self._pinner is not None:
            for ptr in self._registered:
                self._pinner.unregister(ptr)
        self._registered.clear()
        self._pinner = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        if self._mmap is not None:
            # a view may still be alive; then the mapping goes with the process
            with contextlib.suppress(BufferError):
                self._mmap.close()
            self._mmap = None


def pin_region(pinner: Pinner, base: int, layout: SlabLayout, pin_step: int) -> list[int]:
    """Register the :func:`pin_ranges` of a slab of ``layout`` whose memory starts at
    ``base``; returns their start addresses in order. On a refusal every range registered so
    far is unregistered and :class:`SlabError` says which piece failed."""
    done: list[int] = []
    for start, length in pin_ranges(layout, pin_step):
        try:
            pinner.register(base + start, length)
        except Exception as e:
            for ptr in done:
                pinner.unregister(ptr)
            raise SlabError(
                f"pinning {format_bytes(length)} of host memory at offset {start} failed "
                f"({e}); lower dram_size"
            ) from e
        done.append(base + start)
    return done


def pin_ranges(layout: SlabLayout, pin_step: int) -> list[tuple[int, int]]:
    """(offset, length) pieces covering the slab, each at most ``pin_step`` bytes (or one slot
    if a slot is larger) and never splitting a slot, so that every copy is within one
    registration."""
    ranges = []
    for shard in range(layout.num_shards):
        base = shard * layout.shard_bytes
        for c in layout.classes:
            per = max(1, pin_step // c.stride)
            for first in range(0, c.num_slots, per):
                n = min(per, c.num_slots - first)
                ranges.append((base + c.offset + first * c.stride, n * c.stride))
    return ranges
