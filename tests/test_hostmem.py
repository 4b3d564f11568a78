"""kvtier.hostmem: dram_size against MemAvailable and the memory cgroup (v1 and v2), on
/proc and cgroup files the tests write (the paths are parameters, not settings)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.config import ConfigError
from kvtier.hostmem import check_dram_size, memory_limits

GiB, MiB = 2**30, 2**20
V1_UNLIMITED = 9223372036854771712  # what cgroup v1 writes for "no limit"


class Host:
    """A fake /proc/meminfo, /proc/self/cgroup and cgroup mount under ``tmp_path``."""

    def __init__(self, root: Path, mem_available: int = 64 * GiB) -> None:
        self.meminfo = root / "meminfo"
        self.meminfo.write_text(f"MemTotal:       {128 * GiB // 1024} kB\n"
                                f"MemFree:        {GiB // 1024} kB\n"
                                f"MemAvailable:   {mem_available // 1024} kB\n")
        self.proc_cgroup = root / "cgroup"
        self.proc_cgroup.write_text("0::/\n")
        self.cgroup_root = root / "sys_fs_cgroup"
        self.cgroup_root.mkdir()

    def cgroup(self, lines: str, files: dict[str, str]) -> None:
        self.proc_cgroup.write_text(lines)
        for rel, text in files.items():
            p = self.cgroup_root / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text + "\n")

    def check(self, dram_size: int) -> None:
        check_dram_size(dram_size, str(self.meminfo), str(self.cgroup_root),
                        str(self.proc_cgroup))


@pytest.fixture
def host(tmp_path: Path) -> Host:
    return Host(tmp_path)


def test_dram_size_above_mem_available_is_an_error(tmp_path: Path) -> None:
    h = Host(tmp_path, mem_available=8 * GiB)
    with pytest.raises(ConfigError) as e:
        h.check(9 * GiB)
    assert "9GiB" in str(e.value) and "MemAvailable" in str(e.value)
    assert "lower dram_size" in str(e.value)
    h.check(6 * GiB)


def test_above_80_percent_is_a_warning(tmp_path: Path, kvtier_caplog: pytest.LogCaptureFixture
                                       ) -> None:
    h = Host(tmp_path, mem_available=10 * GiB)
    h.check(8 * GiB)  # exactly 80%: fine
    assert not kvtier_caplog.records
    h.check(9 * GiB)
    (rec,) = kvtier_caplog.records
    assert "80%" in rec.getMessage() and "MemAvailable" in rec.getMessage()


def test_cgroup_v2_max_minus_current(host: Host, kvtier_caplog: pytest.LogCaptureFixture) -> None:
    host.cgroup("0::/kubepods/pod1/ctr\n", {
        "kubepods/pod1/ctr/memory.max": str(4 * GiB),
        "kubepods/pod1/ctr/memory.current": str(3 * GiB),
    })
    with pytest.raises(ConfigError, match=r"cgroup v2 memory\.max 4GiB minus memory\.current"):
        host.check(2 * GiB)
    host.check(900 * MiB)  # above 80% of the 1GiB left
    assert "cgroup v2" in kvtier_caplog.records[0].getMessage()
    host.check(512 * MiB)


def test_cgroup_v2_a_tighter_ancestor_wins_and_max_is_no_limit(host: Host) -> None:
    host.cgroup("0::/a/b\n", {
        "a/b/memory.max": "max", "a/b/memory.current": str(GiB),
        "a/memory.max": str(3 * GiB), "a/memory.current": str(2 * GiB),
    })
    with pytest.raises(ConfigError, match=r"in \S*/a\)"):
        host.check(2 * GiB)
    limits = memory_limits(str(host.meminfo), str(host.cgroup_root), str(host.proc_cgroup))
    assert [m.available for m in limits] == [64 * GiB, GiB]


def test_cgroup_v1_limit_minus_usage(host: Host) -> None:
    host.cgroup("12:cpu,cpuacct:/docker/x\n4:memory:/docker/x\n1:name=systemd:/docker/x\n", {
        "memory/docker/x/memory.limit_in_bytes": str(6 * GiB),
        "memory/docker/x/memory.usage_in_bytes": str(2 * GiB),
    })
    with pytest.raises(ConfigError, match=r"cgroup v1 memory\.limit_in_bytes 6GiB"):
        host.check(5 * GiB)
    host.check(3 * GiB)


def test_cgroup_v1_without_a_limit_and_a_hybrid_host(host: Host) -> None:
    """A container's namespaced v1 path is the mount root; v1 writes 'no limit' as a huge
    number; a hybrid host lists the v2 hierarchy too, without memory files."""
    host.cgroup("4:memory:/process_api/abc\n0::/\n", {
        "memory/memory.limit_in_bytes": str(V1_UNLIMITED),
        "memory/memory.usage_in_bytes": str(3 * GiB),
    })
    host.check(40 * GiB)
    host.cgroup("4:memory:/process_api/abc\n0::/\n", {
        "memory/memory.limit_in_bytes": str(2 * GiB)})
    with pytest.raises(ConfigError, match="cgroup v1"):
        host.check(40 * GiB)


def test_unreadable_files_impose_no_limit(tmp_path: Path) -> None:
    missing = str(tmp_path / "absent")
    check_dram_size(2**50, missing, missing, missing)
    assert memory_limits(missing, missing, missing) == []
