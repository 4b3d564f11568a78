"""The GPU engine's verified restores: checksums computed on the device, compared on the host.

A batch with checksums owns a :class:`BatchCheck`: a device buffer of per-work-item partial
sums that the transfer's kernel writes (the fused gather/scatter of the kernel path, or the
cache-only pass ``move=False`` of the DMA path, see :mod:`kvtier.gpu.kernels`), reduced per
block position and copied into pinned host memory on the same stream before the batch's
``done`` event. Once ``done`` fired, :meth:`BatchCheck.finish` seals the sums with each row's
seed (:mod:`kvtier.checksum`) and either stores them in the slab's checksum table (a save,
before the job is reported complete) or compares them with it (a load: the positions the load
wrote, i.e. what crossed the link, against what was stored; SKIP positions are 0 and not
compared).

So the check covers the device, the link and host memory end to end. Groups whose pieces are
not whole 8-byte words (``TileTable.vec < 8``: no family today) are checked on the host
instead (:class:`~kvtier.transfer.ChunkMover`): the slot's checksum when a save completed, and
the slots before a load is enqueued.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier import checksum
from kvtier.protocol import TransferOp
from kvtier.transfer import ChunkMover, Mismatch


@dataclass
class Rows:
    """The chunks of one batch of one group, in launch order."""

    group: int
    slot_class: int
    slots: np.ndarray  # (n,) int64 slot numbers
    digests: np.ndarray  # (n,) uint64 key digests (TransferOp.seed)
    ids: np.ndarray  # (n, bpc) int64 block ids (SKIP = -1 in loads)
    owners: list[int]  # job id of each row


class BatchCheck:
    """The device sums of one batch (see the module docstring). :meth:`device_sums` is the
    kernel's ``sums`` argument and :meth:`to_host` copies the result out, both on the stream
    that runs the kernel."""

    def __init__(self, rt: Any, tiles: Any, rows: Rows) -> None:
        self.rows = rows
        self.tiles = tiles
        self.rt = rt
        self.n_pos = rows.ids.size
        self.part: torch.Tensor | None = None
        self.reduced: torch.Tensor | None = None
        self.host = rt.pinned(max(1, self.n_pos), torch.int64)

    def device_sums(self) -> torch.Tensor:
        """The per-work-item sums buffer, allocated and zeroed on the *current* stream, which
        must be the one that launches the kernel writing it. Contract: never on another
        stream. The fill is stream-ordered work: on the caller's compute stream it could run
        after the kernel on the side stream had written some partials (zeroing them: a false
        mismatch at load, or a stored sum that no longer covers the data, which can let a
        real corruption pass), and the caching allocator hands a block out in the order of
        the stream it is allocated on only."""
        if self.part is None:
            self.part = torch.zeros(max(1, self.tiles.work_items(self.n_pos)),
                                    dtype=torch.int64, device=self.rt.device)
        return self.part

    def reduce(self) -> None:
        """Reduce the partials per block position, on the current stream (the kernel's: the
        result is allocated there). The result stays referenced by this check, and so
        allocated, until the batch is finished, whichever stream :meth:`copy_out` uses."""
        assert self.part is not None, "reduce before the kernel's device_sums"
        self.reduced = self.tiles.block_sums(self.part, self.n_pos)

    def copy_out(self) -> None:
        """Copy the reduced sums to pinned memory, on the current stream, which must be
        ordered after :meth:`reduce` (the same stream, or one waiting for an event recorded
        after it). Not on the kernel stream, in the staged paths: a device-to-host copy
        there holds the next batch's kernel until it completes, and it may queue behind a
        save's DMA on the same copy engine."""
        self.host[: self.n_pos].copy_(self.reduced, non_blocking=True)

    def to_host(self) -> None:
        """:meth:`reduce` and :meth:`copy_out` on the current stream (the kernel's)."""
        self.reduce()
        self.copy_out()

    def _sealed(self, shard: int) -> np.ndarray:
        r = self.rows
        sums = self.host[: self.n_pos].numpy().view(np.uint64).reshape(r.ids.shape)
        seeds = checksum.shard_seeds_np(r.digests, r.group, shard)
        with np.errstate(over="ignore"):
            return sums + checksum.seals_np(seeds, r.ids.shape[1])

    def finish_save(self, slab: Any, shard: int) -> None:
        """Store the sealed sums in the slab's table (``done`` fired)."""
        vals = self._sealed(shard).view(np.int64)
        table = slab.sums(self.rows.slot_class, shard)
        table[torch.from_numpy(self.rows.slots), : vals.shape[1]] = torch.from_numpy(vals)

    def finish_load(self, slab: Any, shard: int) -> dict[int, list[Mismatch]]:
        """Job id -> the rows whose written positions do not match the table."""
        r = self.rows
        got = self._sealed(shard)
        table = slab.sums(r.slot_class, shard)
        stored = table[torch.from_numpy(r.slots), : got.shape[1]].numpy().view(np.uint64)
        bad = (got != stored) & (r.ids >= 0)
        out: dict[int, list[Mismatch]] = {}
        for i in np.flatnonzero(bad.any(axis=1)).tolist():
            blocks = tuple(np.flatnonzero(bad[i]).tolist())
            out.setdefault(r.owners[i], []).append(
                Mismatch(r.group, r.slot_class, int(r.slots[i]), blocks))
        return out


def host_store(mover: ChunkMover, rows: Rows) -> None:
    """Saves of a group checked on the host: checksum each slot as written."""
    for slot, digest in zip(rows.slots.tolist(), rows.digests.tolist()):
        mover.store_sums(TransferOp(rows.group, slot, [], int(digest)))
