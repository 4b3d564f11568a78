"""Private host memory backed by transparent huge pages, for bytes a block device moves
directly (O_DIRECT): the private slab, the disk tier's staging buffers.

Why (measured on the CI machine's virtio disk, ext4, 2 MiB chunks, O_DIRECT, cold, 2026-12-02;
``kvtier bench disk`` prints the KiB per request of every pass): the kernel gives a direct I/O
one request segment per physically contiguous run of the buffer, and the device caps a
request's segments, so a buffer of scattered 4 KiB pages splits every 2 MiB read or write into
four 512 KiB requests (0.8-1.1 GB/s read at queue depth 1, 2 or 4, the same file), while a
buffer of 2 MiB huge pages moves in one request (1.9-2.5 GB/s read). Whether ``dd``'s own
buffer is contiguous is luck, hence its bimodal bandwidth on that disk (0.8-1.2 GB/s in 512 KiB
requests, 1.4-2.3 in 2 MiB ones).

The mapping is MAP_PRIVATE: transparent huge pages apply to private anonymous memory (THP
``enabled`` = ``always`` or ``madvise``; this asks with ``MADV_HUGEPAGE``), while
``mmap.mmap(-1, n)`` is MAP_SHARED, i.e. shmem, which THP leaves alone unless
``shmem_enabled`` says otherwise. Where THP is off or no huge page is free the memory is plain
4 KiB pages: nothing changes but speed. The memory is zeroed and committed on first touch, a
huge page at a time.

``MADV_DONTFORK``: a child forked from this process does not get the mapping. A private
mapping would otherwise be copied for the child, eagerly where pages are pinned for DMA
(``cudaHostRegister``: the kernel copies pinned anonymous pages at fork), i.e. the whole slab;
the shared mapping this replaces cost a fork nothing, and no child uses this memory.
"""

from __future__ import annotations

import mmap

import numpy as np
import torch

HUGE_PAGE = 2 << 20
"""The x86-64 and arm64 (4 KiB base pages) PMD size: what THP maps anonymous memory in."""


def huge_page_buffer(nbytes: int) -> tuple[mmap.mmap, torch.Tensor]:
    """``nbytes`` of zeroed private memory as a uint8 tensor whose first byte is huge-page
    aligned, and the mapping it lies in (the caller closes it when no view is left). The
    mapping is up to one huge page longer than asked (address space only: the slack is never
    touched, so never committed)."""
    nbytes = max(nbytes, 1)
    mapping = mmap.mmap(-1, nbytes + HUGE_PAGE - mmap.PAGESIZE,
                        flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    for advice in ("MADV_HUGEPAGE", "MADV_DONTFORK"):
        if hasattr(mmap, advice):
            mapping.madvise(getattr(mmap, advice))
    probe = np.frombuffer(mapping, dtype=np.uint8, count=1)
    offset = -probe.ctypes.data % HUGE_PAGE
    del probe  # its buffer export would keep the mapping from closing
    return mapping, torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=offset)
