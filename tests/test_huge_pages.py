"""kvtier.huge_pages: private memory the disk tier's direct I/O moves in whole huge pages."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvtier.huge_pages import HUGE_PAGE, huge_page_buffer

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_available() -> bool:
    """Whether this kernel gives private anonymous memory huge pages on MADV_HUGEPAGE."""
    return THP.exists() and "[never]" not in THP.read_text()


def smaps_field(addr: int, field: str) -> str:
    """``field`` of the mapping of this process that holds ``addr`` (/proc/self/smaps)."""
    current = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        m = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if m:
            current = int(m.group(1), 16) <= addr < int(m.group(2), 16)
        elif current and line.startswith(field + ":"):
            return line.split(":", 1)[1].strip()
    raise AssertionError(f"no mapping holds {addr:#x}, or it has no {field}")


def anon_huge_bytes(addr: int) -> int:
    """AnonHugePages of the mapping that holds ``addr``."""
    return int(smaps_field(addr, "AnonHugePages").split()[0]) * 1024


def test_the_buffer_is_zeroed_writable_and_starts_on_a_huge_page() -> None:
    mapping, t = huge_page_buffer(3 * HUGE_PAGE + 4096)
    assert t.numel() == 3 * HUGE_PAGE + 4096 and t.data_ptr() % HUGE_PAGE == 0
    assert int(t.count_nonzero()) == 0
    t.fill_(7)
    assert int(t[-1]) == 7 and int(t[0]) == 7
    del t
    mapping.close()


@pytest.mark.skipif(not thp_available(), reason="transparent huge pages are off on this kernel")
def test_the_buffer_is_backed_by_huge_pages() -> None:
    """What makes a 2 MiB direct read one device request (kvtier.huge_pages): the memory is
    private anonymous huge pages, not shmem (mmap.mmap(-1, n) is MAP_SHARED: never THP)."""
    _, t = huge_page_buffer(4 * HUGE_PAGE)
    t.fill_(1)
    assert anon_huge_bytes(t.data_ptr()) >= 2 * HUGE_PAGE
    del t


def test_a_forked_child_does_not_get_the_memory() -> None:
    """MADV_DONTFORK ("dc" in the mapping's VmFlags): a fork does not copy the private
    mapping (pinned pages would be copied eagerly), as the shared one it replaces did not."""
    mapping, t = huge_page_buffer(HUGE_PAGE)
    assert "dc" in smaps_field(t.data_ptr(), "VmFlags").split()
    del t
    mapping.close()
