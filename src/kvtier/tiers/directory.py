"""The disk tier's directory: start-up checks of ``disk_path``, the lock that keeps a second
engine out, and the scan that rebuilds the index after a restart.

- :func:`check_disk_path`: the directory is created if needed and must be writable, on a
  local block filesystem (tmpfs and ramfs are memory, not disk; network filesystems have
  neither the latency nor the rename semantics the tier assumes: both are refused by their
  ``statfs`` type, with the type in the message), with ``disk_size`` free (counting what this
  namespace already stores there).
- :class:`DirectoryLock`: an exclusive ``flock`` on ``<disk_path>/kvtier.lock``, held by the
  scheduler process for the engine's life; a second engine is refused with the holder's pid.
- :func:`scan`: every chunk present in every shard directory of a namespace, from file names
  only (no byte is read: the checksum is verified when a chunk is promoted); leftover
  temporary files of a killed writer are removed, files kvtier did not write are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import fcntl
import os
from dataclasses import dataclass
from pathlib import Path

from kvtier.config import ConfigError, format_bytes
from kvtier.tiers.disk import ChunkName, parse_chunk_name, shard_dir

LOCK_NAME = "kvtier.lock"

# statfs f_type magics (linux/magic.h) of filesystems the disk tier refuses
_REFUSED_FS = {
    0x01021994: "tmpfs (memory, not disk)",
    0x858458F6: "ramfs (memory, not disk)",
    0x6969: "nfs (a network filesystem)",
    0x517B: "smb (a network filesystem)",
    0xFF534D42: "cifs (a network filesystem)",
    0xFE534D42: "smb2 (a network filesystem)",
    0x00C36400: "ceph (a network filesystem)",
    0x01021997: "9p (a network filesystem)",
    0x5346414F: "afs (a network filesystem)",
    0x0BD00BD0: "lustre (a network filesystem)",
    0x65735546: "fuse (sshfs, glusterfs and other network filesystems are fuse)",
}


def statfs_type(path: str | os.PathLike[str]) -> int:
    """The ``f_type`` magic of the filesystem holding ``path`` (Linux ``statfs``)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type is its first word
    if libc.statfs(os.fsencode(os.fspath(path)), buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), os.fspath(path))
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF


def dir_bytes(path: Path) -> int:
    """Bytes of the files under ``path`` (0 if absent)."""
    total = 0
    for dirpath, _, names in os.walk(path):
        for n in names:
            with contextlib.suppress(OSError):
                total += os.stat(os.path.join(dirpath, n)).st_size
    return total


def check_disk_path(disk_path: str, disk_size: int, namespace_root: Path | None = None,
                    allow_memory_fs: bool = False) -> None:
    """Raise :class:`ConfigError`, with the reason, unless ``disk_path`` can hold the tier.

    ``allow_memory_fs`` lets tests run on tmpfs; no setting reaches it."""
    where = f"kvtier setting disk_path={disk_path!r}"
    try:
        os.makedirs(disk_path, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"{where}: cannot create the directory ({e.strerror})") from None
    if not os.access(disk_path, os.W_OK | os.X_OK):
        raise ConfigError(f"{where}: the directory is not writable by this process")
    kind = _REFUSED_FS.get(statfs_type(disk_path))
    if kind is not None and not (allow_memory_fs and "memory" in kind):
        raise ConfigError(f"{where}: the directory is on {kind}; the disk tier needs a local "
                          "disk: point disk_path at one")
    st = os.statvfs(disk_path)
    free = st.f_bavail * st.f_frsize
    have = dir_bytes(namespace_root) if namespace_root is not None else 0
    if free + have < disk_size:
        raise ConfigError(
            f"kvtier setting disk_size={format_bytes(disk_size)}: {disk_path} has "
            f"{format_bytes(free)} free (and this model's chunks take {format_bytes(have)}); "
            "lower disk_size or free space")


class DirectoryLock:
    """Exclusive use of ``disk_path`` by one engine (released at :meth:`close` or exit)."""

    def __init__(self, disk_path: str) -> None:
        self.path = Path(disk_path) / LOCK_NAME
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(self._fd, 64, 0).decode(errors="replace").strip() or "unknown"
            os.close(self._fd)
            raise ConfigError(
                f"kvtier setting disk_path={disk_path!r}: another engine (pid {holder}) uses "
                "this directory; give every engine its own disk_path") from None
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


@dataclass(frozen=True)
class StoredChunk:
    name: ChunkName
    mtime: float  # the oldest shard's: the restart's recency order


@dataclass
class ScanResult:
    chunks: list[StoredChunk]
    partial: list[tuple[int, ChunkName]]  # (shard, chunk) present in some shards only
    temporaries_removed: int = 0
    foreign_files: int = 0


def scan(root: Path, num_shards: int) -> ScanResult:
    """Chunks present in every shard directory under ``root`` (see the module doc)."""
    seen: list[dict[ChunkName, float]] = []
    temporaries = foreign = 0
    for shard in range(num_shards):
        found: dict[ChunkName, float] = {}
        d = shard_dir(root, shard)
        entries = list(os.scandir(d)) if d.is_dir() else []
        for entry in entries:
            if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                with contextlib.suppress(OSError):
                    os.unlink(entry.path)
                    temporaries += 1
                continue
            parsed = parse_chunk_name(entry.name)
            if parsed is None or not entry.is_file(follow_symlinks=False):
                foreign += 1
                continue
            found[parsed] = entry.stat().st_mtime
        seen.append(found)
    common = set(seen[0]).intersection(*seen[1:]) if seen else set()
    chunks = [StoredChunk(c, min(s[c] for s in seen)) for c in common]
    partial = [(shard, c) for shard, s in enumerate(seen) for c in s if c not in common]
    return ScanResult(chunks, partial, temporaries, foreign)
