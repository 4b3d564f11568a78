"""The shared-memory segment that the ranks of one engine map (tensor parallelism > 1).

Contract of :func:`map_shared_segment`, called by every rank of one :class:`RankGroup`:

- Rank 0 creates the segment under a name of its own, ``kvtier-<engine id>-<random>``, with
  ``O_CREAT|O_EXCL|O_NOFOLLOW`` and mode 0600, so two engines never share a store (even with
  one engine id) and nothing pre-created is ever taken over. It reserves every byte
  (``posix_fallocate``): a ``/dev/shm`` too small is a start-up error that says how much is
  needed, never a SIGBUS at the first write past free space.
- Rank 0 hands the name and the file's identity (device, inode) to the other ranks through
  the group; each opens it, checks that it is that file, a regular file of this user, mode
  0600, of the expected size, and maps it.
- Once every rank reported, the segment is unlinked: the memory lives exactly as long as the
  mappings, so nothing is left in ``/dev/shm`` after any exit, ``kill -9`` included.
- Every rank returns a mapping of the same memory, or every rank raises :class:`SlabError`
  with the first rank's reason; no rank waits for a rank that failed. A rank that dies
  mid-way leaves the others in the group's collective, bounded by the process group's
  timeout (under vLLM the executor stops the engine when a worker dies).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch.distributed as dist

from kvtier.config import format_bytes
from kvtier.hostmem import check_dram_size


class SlabError(RuntimeError):
    """The host cannot provide the slab that was asked for."""


SHM_DIR = "/dev/shm"
_CREATE_ATTEMPTS = 8  # fresh random names tried before giving up (a clash is ~2**-64 each)


class RankGroup(Protocol):
    """The processes that map one segment (one engine's tensor-parallel ranks)."""

    @property
    def rank(self) -> int: ...

    @property
    def size(self) -> int: ...

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank (the others' arguments are ignored)."""
        ...

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        ...


class ProcessGroupRanks:
    """A :class:`RankGroup` over a torch.distributed process group of the CPU (gloo)
    backend: vLLM's tensor-parallel ``cpu_group``, or any gloo group."""

    def __init__(self, group: Any = None) -> None:
        self._group = group
        self._rank = dist.get_rank(group)
        self._size = dist.get_world_size(group)
        self._src = dist.get_global_rank(group, 0) if group is not None else 0

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def size(self) -> int:
        return self._size

    def broadcast(self, obj: Any) -> Any:
        box = [obj]
        dist.broadcast_object_list(box, src=self._src, group=self._group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self._size
        dist.all_gather_object(out, obj, group=self._group)
        return out


@dataclass(frozen=True)
class SharedSlab:
    """How a slab is shared: the engine it belongs to (for the segment's name), the ranks
    that map it, and the shared-memory directory."""

    engine_id: str
    ranks: RankGroup = field(compare=False)
    directory: str = SHM_DIR


def segment_name(engine_id: str) -> str:
    """``kvtier-<engine id>-<16 hex digits>``: readable, unique per call, a valid file name."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", str(engine_id))[:64] or "engine"
    return f"kvtier-{safe}-{secrets.token_hex(8)}"


def shm_shortage(directory: str, size: int, free: int | None = None) -> str:
    """The start-up error for a ``directory`` that cannot hold ``size`` bytes."""
    have = f"{format_bytes(free)} free" if free is not None else "too little space"
    return (
        f"{directory} has {have}, the slab needs {format_bytes(size)} (dram_size) beside what "
        f"vLLM uses there: enlarge {directory} (docker run --shm-size=..., Kubernetes: an "
        "emptyDir with medium: Memory and a sizeLimit; on a host: mount -o remount,size=... "
        f"{directory}) or lower dram_size"
    )


def _free_bytes(directory: str) -> int:
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def create_segment(directory: str, engine_id: str, size: int) -> tuple[int, str]:
    """Create, exclusively, a 0600 file of ``size`` reserved bytes under a fresh name; return
    its descriptor and path. Refuse (SlabError, ConfigError) with nothing left behind."""
    free = _free_bytes(directory)
    if free < size:
        raise SlabError(shm_shortage(directory, size, free))
    check_dram_size(size)  # the creator takes the memory for every rank: the host's headroom
    for _ in range(_CREATE_ATTEMPTS):
        path = os.path.join(directory, segment_name(engine_id))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except FileExistsError:
            continue
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            _reserve(fd, directory, size)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return fd, path
    raise SlabError(f"could not create a shared slab in {directory}: {_CREATE_ATTEMPTS} fresh "
                    "names all existed")


def _reserve(fd: int, directory: str, size: int) -> None:
    """Give the file ``size`` bytes of real pages now, so that no later write can find the
    filesystem full (a sparse file would SIGBUS there)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as e:
        if e.errno in (errno.ENOSPC, errno.EDQUOT):
            raise SlabError(shm_shortage(directory, size, _free_bytes(directory))) from None
        if e.errno == errno.EFBIG:
            raise SlabError(f"the slab needs a {format_bytes(size)} file in {directory}, above "
                            "this process's file size limit (ulimit -f): raise the limit or "
                            "lower dram_size") from None
        raise SlabError(f"reserving {format_bytes(size)} in {directory} failed: {e}") from e


def attach_segment(path: str, size: int, identity: tuple[int, int]) -> int:
    """Open the segment rank 0 created; return its descriptor. It must be the file rank 0
    made (``identity``: device, inode), a regular file of this user, mode 0600, ``size``
    bytes; anything else is refused (SlabError)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError as e:
        raise SlabError(f"cannot open the shared slab {path} that rank 0 created ({e}); every "
                        "rank of an engine must run on one host and see one /dev/shm") from None
    try:
        st = os.fstat(fd)
        wrong = _wrong_segment(st, size, identity)
        if wrong:
            raise SlabError(f"refusing the shared slab {path}: {wrong}")
    except BaseException:
        os.close(fd)
        raise
    return fd


def _wrong_segment(st: os.stat_result, size: int, identity: tuple[int, int]) -> str | None:
    if (st.st_dev, st.st_ino) != tuple(identity):
        return "it is not the file rank 0 created"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user ({os.geteuid()})"
    if stat.S_IMODE(st.st_mode) != 0o600:
        return f"mode {stat.S_IMODE(st.st_mode):o}, not 600"
    if st.st_size != size:
        return f"{st.st_size} bytes, this engine's slab layout needs {size}"
    return None


def _map(fd: int, size: int) -> mmap.mmap:
    try:
        return mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


def map_shared_segment(shared: SharedSlab, size: int) -> mmap.mmap:
    """Every rank of ``shared.ranks`` calls this together; see the module's contract."""
    ranks, path = shared.ranks, None
    mapping: mmap.mmap | None = None
    error: str | None = None
    try:
        if ranks.rank == 0:
            try:
                fd, path = create_segment(shared.directory, shared.engine_id, size)
                st = os.fstat(fd)
                mapping = _map(fd, size)
                offer: tuple[Any, ...] = (path, (st.st_dev, st.st_ino), None)
            except Exception as e:  # reported to every rank: none may wait for this one
                error = f"rank 0: {e}"
                offer = (None, None, error)
            ranks.broadcast(offer)
        else:
            path, identity, error = ranks.broadcast(None)
            if error is None:
                try:
                    mapping = _map(attach_segment(path, size, identity), size)
                except Exception as e:
                    error = f"rank {ranks.rank}: {e}"
        errors = [e for e in ranks.gather(error) if e is not None]
        if ranks.rank == 0 and path is not None:  # every rank has it mapped, or gave up
            os.unlink(path)
            path = None
        ranks.gather(None)  # no rank returns before the name is gone
    finally:
        if ranks.rank == 0 and path is not None:  # a collective failed: still leave nothing
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if errors:
        if mapping is not None:
            mapping.close()
        raise SlabError(errors[0])
    assert mapping is not None
    return mapping
