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

import contextlib
import errno
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


THP_SYSFS = "/sys/kernel/mm/transparent_hugepage"
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux 5.14+: fault every page of a range in, writable, or fail with an errno (never a
SIGBUS). Python's mmap module names it from 3.13 on; the number is Linux's."""


def _selected(path: str) -> str | None:
    """The bracketed choice of a THP sysfs setting (``always [advise] never`` -> ``advise``)."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def shared_huge_pages_allowed(sysfs: str = THP_SYSFS) -> bool:
    """Whether shared memory (shmem: a memfd) can get 2 MiB pages here when its mapping asks
    with ``MADV_HUGEPAGE``: the global ``shmem_enabled`` is ``always``, ``within_size``,
    ``advise`` or ``force``, or the 2 MiB size's own setting (Linux 6.11+) says so. Most
    distributions ship ``never``: then shared memory is 4 KiB pages whatever it asks."""
    allowing = {"always", "within_size", "advise", "force"}
    top = _selected(f"{sysfs}/shmem_enabled")
    per_size = _selected(f"{sysfs}/hugepages-2048kB/shmem_enabled")
    if per_size is not None and per_size != "inherit":
        return per_size in allowing
    return top in allowing


def fault_in_shared(fd: int, size: int) -> bool:
    """Fault every page of the memfd ``fd`` (``size`` bytes, already sized) in through a
    mapping that asks for huge pages, so that the file's memory is 2 MiB pages where the host
    allows them for shared memory (:func:`shared_huge_pages_allowed`): the pages stay the
    file's after the mapping closes, and every later mapping sees the same physically
    contiguous 2 MiB runs, which a GPU copies to and from faster than scattered 4 KiB pages.
    Returns whether it ran; False where the host gives shared memory no huge pages or the
    kernel lacks ``MADV_POPULATE_WRITE`` (the caller reserves the bytes as before). An
    allocation failure raises ``OSError`` (ENOMEM), never a SIGBUS."""
    if size <= 0 or not shared_huge_pages_allowed():
        return False
    mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    try:
        if hasattr(mmap, "MADV_HUGEPAGE"):
            mapping.madvise(mmap.MADV_HUGEPAGE)
        try:
            mapping.madvise(MADV_POPULATE_WRITE)
        except OSError as e:
            if e.errno == errno.EINVAL:  # a kernel before 5.14: fallocate reserves instead
                return False
            raise
    finally:
        mapping.close()
    return True


def ask_huge_pages(mapping: mmap.mmap) -> None:
    """Ask that ``mapping`` (shared) be mapped with 2 MiB pages where its pages are 2 MiB
    (a CPU TLB matter only: DMA pinning sees the physical runs whatever the mapping). Where
    the kernel refuses, nothing changes."""
    if hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            mapping.madvise(mmap.MADV_HUGEPAGE)
