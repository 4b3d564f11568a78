"""The store's DRAM pool: one anonymous shared-memory file (memfd), and the arenas in it.

Contract:

- The pool is a ``memfd_create`` file (``MFD_CLOEXEC``): it has no name in any directory, so
  nothing is ever left behind, whatever way the store exits; its memory lives exactly as
  long as the store or any client holds the descriptor or a mapping (an engine's loads
  promised before a store crash finish from the old mapping). Every byte is reserved at
  start (``posix_fallocate``), after checking the host's memory headroom
  (:func:`kvtier.hostmem.check_dram_size`), so a pool the host cannot hold is a start-up
  error, never a SIGBUS at a later write.
- The pool is split into *arenas*, one per namespace (an engine's model, layout and chunk
  size: engines with one namespace share an arena, its index and its slots, and hence hits).
  An arena is a hard quota: its size is fixed when the first engine of the namespace
  attaches (its ``dram_size``), and nothing another namespace does can take its slots.
  Arenas are aligned to :data:`ARENA_ALIGN` (huge-page size).
- An arena outlives its engines (a restarted engine finds its prefixes). When a new
  namespace does not fit, arenas with no attached client are dropped, least recently
  detached first; if it still does not fit the attach is refused with the numbers.
"""

from __future__ import annotations

import errno
import mmap
import os
from dataclasses import dataclass

from kvtier.config import format_bytes
from kvtier.hostmem import check_dram_size

ARENA_ALIGN = 2 * 2**20


class PoolError(RuntimeError):
    """The pool cannot be created, or an arena does not fit."""


def _align_up(n: int, a: int = ARENA_ALIGN) -> int:
    return (n + a - 1) // a * a


def create_pool_fd(size: int) -> int:
    """A sealed-size memfd of ``size`` reserved bytes (raises PoolError or ConfigError)."""
    check_dram_size(size)
    fd = os.memfd_create("kvtier-store-pool", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        os.close(fd)
        if e.errno in (errno.ENOSPC, errno.ENOMEM, errno.EDQUOT):
            raise PoolError(f"the host cannot reserve a {format_bytes(size)} pool ({e}); "
                            "lower the store's --size") from None
        raise PoolError(f"reserving the {format_bytes(size)} pool failed: {e}") from e
    return fd


def map_pool(fd: int, size: int) -> mmap.mmap:
    """Map the whole pool, shared, read-write (the descriptor stays open)."""
    return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


@dataclass
class Arena:
    namespace: bytes
    offset: int
    size: int
    layout_id: bytes  # what every engine of the namespace must agree on (slot layout)


class ArenaMap:
    """First-fit placement of arenas in ``[0, pool_size)``."""

    def __init__(self, pool_size: int) -> None:
        self.pool_size = pool_size
        self.arenas: dict[bytes, Arena] = {}

    def place(self, namespace: bytes, size: int, layout_id: bytes) -> Arena | None:
        """A new arena of ``size`` bytes for ``namespace``, or None if no gap holds it."""
        need = _align_up(size)
        pos = 0
        for a in sorted(self.arenas.values(), key=lambda a: a.offset):
            if a.offset - pos >= need:
                break
            pos = _align_up(a.offset + a.size)
        if pos + need > self.pool_size:
            return None
        arena = Arena(namespace, pos, size, layout_id)
        self.arenas[namespace] = arena
        return arena

    def drop(self, namespace: bytes) -> None:
        del self.arenas[namespace]

    def free_bytes(self) -> int:
        return self.pool_size - sum(_align_up(a.size) for a in self.arenas.values())


def pool_identity(fd: int) -> tuple[int, int]:
    """The pool behind a descriptor: each store's memfd is a file of its own (a restarted
    store's pool is another), so equal identities are the same pool's bytes."""
    st = os.fstat(fd)
    return st.st_dev, st.st_ino
