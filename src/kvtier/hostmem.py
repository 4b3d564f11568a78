"""How much host memory the store may take: MemAvailable and the cgroup's headroom.

``dram_size`` is checked against every limit that applies to this process before the slab is
allocated: ``MemAvailable`` of ``/proc/meminfo``, and the memory cgroup's ``memory.max`` minus
``memory.current`` (cgroup v2) or ``memory.limit_in_bytes`` minus ``memory.usage_in_bytes``
(v1), at the process's cgroup and every ancestor up to the root of the mount. Above the
tightest one is an error (the kernel would OOM-kill the engine mid-serve, or the container
would be killed); above :data:`WARN_FRACTION` of it a warning (little is left for the engine,
its tokenizers and page cache). A limit that cannot be read does not apply.

The file locations are parameters so that tests can point them at files they wrote; they are
not settings.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier.config import ConfigError, format_bytes
from kvtier.log import get_logger

logger = get_logger("hostmem")

MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
WARN_FRACTION = 0.8
UNLIMITED = 2**60  # cgroup v1 writes "no limit" as a huge page-aligned number


@dataclass(frozen=True)
class MemoryLimit:
    """Bytes this process may still take, and where that number comes from."""

    available: int
    source: str


def memory_limits(meminfo: str = MEMINFO, cgroup_root: str = CGROUP_ROOT,
                  proc_cgroup: str = PROC_SELF_CGROUP) -> list[MemoryLimit]:
    """Every readable limit: MemAvailable, then the cgroup levels (v2, else v1)."""
    limits = []
    avail = _meminfo_available(meminfo)
    if avail is not None:
        limits.append(MemoryLimit(avail, f"MemAvailable in {meminfo}"))
    limits += _cgroup_limits(cgroup_root, proc_cgroup)
    return limits


def check_dram_size(dram_size: int, meminfo: str = MEMINFO, cgroup_root: str = CGROUP_ROOT,
                    proc_cgroup: str = PROC_SELF_CGROUP) -> None:
    """Raise :class:`ConfigError` if ``dram_size`` exceeds what this host or cgroup can give;
    log a warning above :data:`WARN_FRACTION` of it."""
    limits = memory_limits(meminfo, cgroup_root, proc_cgroup)
    if not limits:
        return
    tightest = min(limits, key=lambda m: m.available)
    if dram_size > tightest.available:
        raise ConfigError(
            f"kvtier dram_size {format_bytes(dram_size)} is more than this process can take: "
            f"{format_bytes(tightest.available)} ({tightest.source}); lower dram_size")
    if dram_size > WARN_FRACTION * tightest.available:
        logger.warning(
            "kvtier dram_size %s is more than %d%% of the %s this process can take (%s): "
            "little is left for the engine", format_bytes(dram_size), int(WARN_FRACTION * 100),
            format_bytes(tightest.available), tightest.source)


def _meminfo_available(path: str) -> int | None:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(":")
                if name == "MemAvailable":
                    return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_limits(root: str, proc_cgroup: str) -> list[MemoryLimit]:
    """The headroom at the process's memory cgroup and each ancestor: the v2 unified hierarchy
    and the v1 memory controller (a hybrid host has both lines; only one has the files)."""
    try:
        with open(proc_cgroup) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        hid, controllers, path = [*line.split(":", 2), "", ""][:3]
        if hid == "0" and controllers == "":
            out += _levels(root, path, "memory.max", "memory.current", "cgroup v2")
        elif "memory" in controllers.split(","):
            out += _levels(os.path.join(root, "memory"), path, "memory.limit_in_bytes",
                           "memory.usage_in_bytes", "cgroup v1")
    return out


def _levels(base: str, path: str, limit_file: str, usage_file: str, kind: str,
            ) -> list[MemoryLimit]:
    out = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        d = os.path.join(base, *parts[:depth])
        limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(
            os.path.join(d, usage_file))
        if limit is None or usage is None or limit >= UNLIMITED:
            continue
        out.append(MemoryLimit(max(0, limit - usage),
                               f"{kind} {limit_file} {format_bytes(limit)} minus "
                               f"{usage_file} {format_bytes(usage)} in {d}"))
    return out


def _read_int(path: str) -> int | None:
    """An integer file; None if absent, unreadable or 'max' (no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None
