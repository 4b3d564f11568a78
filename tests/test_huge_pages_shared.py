"""kvtier.huge_pages' shared-memory side: when the host gives a memfd 2 MiB pages, and that the
store's pool is reserved whole either way (real memfds, a sysfs tree written in a tmp folder)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvtier import huge_pages
from kvtier.store.pool import create_pool_fd, map_pool


def _sysfs(tmp_path: Path, top: str, per_size: str | None = None) -> str:
    (tmp_path / "shmem_enabled").write_text(top + "\n")
    if per_size is not None:
        (tmp_path / "hugepages-2048kB").mkdir()
        (tmp_path / "hugepages-2048kB" / "shmem_enabled").write_text(per_size + "\n")
    return str(tmp_path)


@pytest.mark.parametrize(("top", "per_size", "allowed"), [
    ("always within_size advise [never] deny force", None, False),
    ("always within_size [advise] never deny force", None, True),
    ("[always] within_size advise never deny force", None, True),
    ("always within_size advise never [deny] force", None, False),
    ("always within_size advise [never] deny force", "always inherit within_size [advise] never", True),
    ("always within_size [advise] never deny force", "always inherit within_size advise [never]", False),
    ("always within_size [advise] never deny force", "always [inherit] within_size advise never", True),
    ("always within_size advise [never] deny force", "always [inherit] within_size advise never", False),
])
def test_shared_huge_pages_allowed_reads_the_global_and_the_2mib_setting(
        tmp_path: Path, top: str, per_size: str | None, allowed: bool) -> None:
    assert huge_pages.shared_huge_pages_allowed(_sysfs(tmp_path, top, per_size)) is allowed


def test_no_sysfs_means_no_huge_pages(tmp_path: Path) -> None:
    assert huge_pages.shared_huge_pages_allowed(str(tmp_path / "absent")) is False


def _resident_bytes(fd: int) -> int:
    """Bytes of the memfd's pages in memory (its st_blocks: 512-byte units)."""
    return os.fstat(fd).st_blocks * 512


@pytest.mark.parametrize("allow", [False, True])
def test_pool_is_reserved_whole_whether_or_not_it_gets_huge_pages(
        monkeypatch: pytest.MonkeyPatch, allow: bool) -> None:
    """With the host's answer forced either way the pool's every byte is allocated at
    creation (fault_in_shared's populate, or fallocate after it), and it maps and holds
    writes. On a host whose shmem_enabled is never, a populate through a MADV_HUGEPAGE
    mapping gives 4 KiB pages: the same bytes, only slower for a GPU."""
    monkeypatch.setattr(huge_pages, "shared_huge_pages_allowed", lambda sysfs=None: allow)
    size = 8 * huge_pages.HUGE_PAGE
    fd = create_pool_fd(size)
    try:
        assert _resident_bytes(fd) >= size
        mapping = map_pool(fd, size)
        mapping[size - 1] = 7
        assert mapping[size - 1] == 7 and mapping[0] == 0
        mapping.close()
    finally:
        os.close(fd)


def test_fault_in_shared_runs_only_where_allowed(monkeypatch: pytest.MonkeyPatch) -> None:
    size = 2 * huge_pages.HUGE_PAGE
    fd = os.memfd_create("t")
    try:
        os.ftruncate(fd, size)
        monkeypatch.setattr(huge_pages, "shared_huge_pages_allowed", lambda sysfs=None: False)
        assert huge_pages.fault_in_shared(fd, size) is False
        assert _resident_bytes(fd) == 0
        monkeypatch.setattr(huge_pages, "shared_huge_pages_allowed", lambda sysfs=None: True)
        assert huge_pages.fault_in_shared(fd, size) is True
        assert _resident_bytes(fd) == size
    finally:
        os.close(fd)
