"""The local disk tier's bytes: one file per chunk and shard, written with O_DIRECT and made
visible by an atomic rename.

Why files and not LMDB (both measured on the CI machine's ext4 disk, 2 MiB chunks, page cache
bypassed on reads; ``kvtier bench disk``): O_DIRECT files wrote 1.3 GB/s and read 0.9-1.2
GB/s, LMDB 0.12-0.22 GB/s and 0.07-0.56 GB/s (every value is copied through its memory map
and the page cache, which O_DIRECT skips; one writer lock per environment would also serialise
the TP ranks). A file per chunk makes deletion and eviction one ``unlink``, and its name
carries what a restart needs to rebuild the index without reading a byte of it.

Layout of ``<disk_path>/kvtier-<namespace>/shard<r>/``: ``<key>.<parent|root>.g<group>.kvc``,
one file per chunk of this shard; temporary files start with ``.`` and end with ``.tmp``.
A file is a 4 KiB header, then the payload padded to 4 KiB (O_DIRECT needs aligned lengths):

    magic(8) version(4) group(4) shard(4) 0(4) payload_len(8) checksum(8) namespace(16)
    key(16) parent(16) has_parent(1) header_digest(8, blake2b of what precedes it), then zeros

``checksum`` is :func:`file_checksum`: XXH3-64 of the padded payload seeded with
:func:`kvtier.checksum.chunk_seed` (key, group, shard), so a file holding another chunk's,
group's or shard's bytes fails like a flipped bit; every byte of the file is checked on read
(the payload and its padding by the checksum, the header's fields by its digest and against
the chunk asked for, the rest of the header page for zeros). A file of another format version
(version 1 summed its payload with :func:`kvtier.checksum.checksum`) is no chunk of this one:
:class:`OtherFormat`, a miss that is forgotten like an absent chunk, never read as bytes.
Crash safety: a writer killed mid-write leaves only its temporary file (removed at the next
start); a rename either happened whole or not at all. Power loss is not covered by ordering (no
fsync per chunk, for speed): a torn file there fails its checksum on read and is a miss, never
wrong bytes.

Why XXH3 and not the slab's checksum (:mod:`kvtier.checksum`): the file's checksum is the
tier's CPU cost per chunk on every read and write, and on the 2-core CI machine that cost is
what kept the tier under ``dd``'s bandwidth. NumPy's position-mixed sum runs at 4-7 GB/s on
one core and holds the GIL between its passes; XXH3 (the ``xxhash`` package, which releases
the GIL) at 19-27 GB/s on a 2 MiB chunk from memory, about 60 from cache (the tier's reads
went from 64% to 89% of ``dd``: bench/results/2026-12-02-cpu-disk-read). The slab's checksum
stays where its properties are needed (partial sums per block position, computed in pieces
on the GPU); a file is checked whole, so a good 64-bit hash serves, and a corrupted or
foreign payload passes with probability about 2**-64, as with the sum.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import mmap
import os
import struct
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import xxhash

from kvtier.checksum import chunk_seed
from kvtier.huge_pages import huge_page_buffer
from kvtier.keys import KEY_BYTES
from kvtier.tiers.seam import ChunkCorrupt, ChunkStore, TierFull

PAGE = 4096
MAGIC = b"KVTCHNK1"
FORMAT_VERSION = 2
"""2: the payload's checksum is XXH3-64 (:func:`file_checksum`); 1 (until 2026-12-02): the
slab's :func:`kvtier.checksum.checksum`."""
SUFFIX = ".kvc"
_HEAD = struct.Struct("<8sIIII QQ 16s16s16s B")
_DIGEST = 8
_HEAD_TAIL = bytes(PAGE - _HEAD.size - _DIGEST)  # what a header page holds past its fields
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
DEFAULT_IO_DEPTH = 8
"""Chunks in flight per shard. On the CI machine's virtio disk (ext4, 2 MiB chunks, O_DIRECT,
2 shared cores) reads reached 44-71% of ``dd``'s bandwidth one chunk at a time, 51-65% two
at a time, 77-101% four at a time, 73% at eight while the checksum was NumPy's (the cores
oversubscribed; ``kvtier bench disk --io-depth``, bench/results/2026-12-01-disk-cpu). With the
file's checksum XXH3 (format 2), alternated runs of 12-20 pairs per depth on the same VM
(bench/results/2026-12-02-cpu-disk-read, "Depth"): writes 1.14 GB/s at 4, 1.28 at 8, 1.32 at
12 (medians), reads 1.70, 1.71, 1.80: a write is a file created and allocated, and more of
them in flight hide that latency. 8 takes most of it at half the threads (and half the
start-up probe, which moves ``2 * depth`` chunks) of 12; NVMe devices want more, never
fewer."""


def _align(n: int, a: int = PAGE) -> int:
    return (n + a - 1) // a * a


def namespace_dir(disk_path: str | os.PathLike[str], namespace: bytes) -> Path:
    """Where one namespace's chunks live: another model, layout, dtype, chunk size or codec
    version is another directory, so its files are never read (a miss, never wrong bytes)."""
    return Path(disk_path) / f"kvtier-{namespace.hex()}"


def shard_dir(root: Path, shard: int) -> Path:
    return root / f"shard{shard}"


def chunk_name(group: int, key: bytes, parent: bytes | None) -> str:
    return f"{key.hex()}.{parent.hex() if parent else 'root'}.g{group}{SUFFIX}"


@dataclass(frozen=True)
class ChunkName:
    group: int
    key: bytes
    parent: bytes | None


def parse_chunk_name(name: str) -> ChunkName | None:
    """The chunk a file name denotes, or None for a name kvtier did not write."""
    if not name.endswith(SUFFIX) or name.startswith("."):
        return None
    parts = name[: -len(SUFFIX)].split(".")
    if len(parts) != 3 or not parts[2].startswith("g") or not parts[2][1:].isdigit():
        return None
    try:
        key = bytes.fromhex(parts[0])
        parent = None if parts[1] == "root" else bytes.fromhex(parts[1])
    except ValueError:
        return None
    if len(key) != KEY_BYTES or (parent is not None and len(parent) != KEY_BYTES):
        return None
    return ChunkName(int(parts[2][1:]), key, parent)


class OtherFormat(KeyError):
    """A well-formed chunk file of another format version (an older kvtier's): not a chunk
    this version reads. A subclass of KeyError, so a promotion counts it absent (a miss, the
    chunk forgotten and its file deleted), not as corruption."""


def file_checksum(payload: torch.Tensor, key: bytes, group: int, shard: int) -> int:
    """The checksum a chunk file stores for ``payload`` (contiguous uint8, as written: padded
    to whole pages): XXH3-64 seeded with :func:`kvtier.checksum.chunk_seed` of the chunk's
    key, group and shard. The GIL is released while it runs."""
    return xxhash.xxh3_64_intdigest(memoryview(payload.numpy()),
                                    seed=chunk_seed(key, group, shard))


def file_bytes(payload_bytes: int) -> int:
    """Bytes one chunk of ``payload_bytes`` takes on disk (header and padding included)."""
    return PAGE + _align(payload_bytes)


class DiskChunkStore(ChunkStore):
    """One shard's chunk files under ``root`` (a namespace directory).

    ``direct``: open with O_DIRECT (the page cache is bypassed: the tier's reads are honest
    and do not evict the host's cache); filesystems that refuse it (tmpfs in tests) fall back
    to buffered I/O, which changes nothing but speed.

    ``io_depth`` (:attr:`max_in_flight`): chunks that may be written or read at once, each on
    its own thread with its own staging buffers. One chunk file is one write or one read of
    the whole file (the header page and the payload, one ``pwritev``/``preadv``), at queue
    depth 1; the checksum of one chunk is computed while another one's bytes move. A slot that
    starts on a page (the slab's) is read and written in place; its memory being huge pages
    (:mod:`kvtier.huge_pages`) makes a chunk one device request.
    """

    def __init__(self, root: Path, shard: int, namespace: bytes, direct: bool = True,
                 io_depth: int = DEFAULT_IO_DEPTH) -> None:
        self.root = root
        self.shard = shard
        self.namespace = namespace
        self.dir = shard_dir(root, shard)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.max_in_flight = max(1, io_depth)
        self._staging: dict[int, _Staging] = {}  # per I/O thread
        self._lock = threading.Lock()

    def _mine(self) -> _Staging:
        """This thread's staging buffers (an I/O thread moves one chunk at a time)."""
        me = threading.get_ident()
        staging = self._staging.get(me)
        if staging is None:  # not setdefault: that would map a page on every call
            with self._lock:
                staging = self._staging[me] = _Staging()
        return staging

    def _open(self, path: Path, flags: int) -> int:
        if self.direct:
            try:
                return os.open(path, flags | os.O_DIRECT, 0o644)
            except OSError as e:
                if e.errno != errno.EINVAL:
                    raise
                self.direct = False  # the filesystem refuses O_DIRECT
        return os.open(path, flags, 0o644)

    def _lands_in_place(self, data: torch.Tensor) -> bool:
        """Whether the device may move ``data``'s bytes directly (no staging copy): its
        length is whole pages (no padding on disk) and, under O_DIRECT, its address is
        page-aligned (the device DMAs there), as the slab's slots are."""
        return (data.is_contiguous() and data.numel() % PAGE == 0
                and (not self.direct or data.data_ptr() % PAGE == 0))

    # -- ChunkStore ------------------------------------------------------------------------------
    def put(self, group: int, key: bytes, parent: bytes | None, data: torch.Tensor) -> int:
        """Write the chunk's file in one I/O: the header page, then the payload straight
        from ``data`` when it can be moved in place (the slot is kept from reuse until the
        job is reported), else from a staging copy padded to whole pages."""
        n = data.numel()
        total = file_bytes(n)
        staging = self._mine()
        if self._lands_in_place(data):
            body = data
        else:
            body = staging.body(total - PAGE)
            # NumPy copies: torch's copy_ of a buffer this size costs several times more
            # under a loaded CPU (its intra-op threads), measured with kvtier bench disk
            np.copyto(body[:n].numpy(), data.numpy())
            body[n:].numpy().fill(0)
        self._write_header(staging.head, group, key, parent, n,
                           file_checksum(body, key, group, self.shard))
        final = self.dir / chunk_name(group, key, parent)
        tmp = self.dir / f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            fd = self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                written = os.pwritev(fd, [staging.head, memoryview(body.numpy())], 0)
            finally:
                os.close(fd)
            if written != total:
                raise OSError(errno.EIO, f"short write: {written} of {total} bytes")
            os.rename(tmp, final)
        except OSError as e:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            if e.errno in _FULL_ERRNOS:
                raise TierFull(f"{self.dir}: {os.strerror(e.errno)}") from e
            raise
        return total

    def _write_header(self, page: memoryview, group: int, key: bytes, parent: bytes | None,
                      n: int, digest: int) -> None:
        fields = _HEAD.pack(MAGIC, FORMAT_VERSION, group, self.shard, 0, n, digest,
                            self.namespace, key, parent or bytes(KEY_BYTES), parent is not None)
        fields += hashlib.blake2b(fields, digest_size=_DIGEST).digest()
        page[: len(fields)] = fields
        page[len(fields) : PAGE] = bytes(PAGE - len(fields))

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        """Read the chunk's file in one I/O and verify it. When ``out`` can take the payload
        as it lies on disk (page-aligned address and length, as slab slots are), the read
        lands in it directly and the checksum runs there: no staging copy, and the payload
        crosses memory once less. On :class:`ChunkCorrupt` ``out`` then holds the bytes that
        did not verify: the caller never uses them (the slot is not committed)."""
        n = out.numel()
        total = file_bytes(n)
        path = self.dir / chunk_name(group, key, parent)
        try:
            fd = self._open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise KeyError(f"{path.name} is not on disk") from None
        staging = self._mine()
        in_place = self._lands_in_place(out)
        body = out if in_place else staging.body(total - PAGE)
        try:
            size = os.fstat(fd).st_size
            if size != total:
                raise ChunkCorrupt(f"{path.name}: {size} bytes, expected {total}")
            got = os.preadv(fd, [staging.head, memoryview(body.numpy())], 0)  # one I/O
        finally:
            os.close(fd)
        if got != total:
            raise ChunkCorrupt(f"{path.name}: short read ({got} of {total} bytes)")
        stored = self._verify_header(staging.head, group, key, parent, n, path)
        if file_checksum(body, key, group, self.shard) != stored:
            raise ChunkCorrupt(f"{path.name}: checksum mismatch")
        if not in_place:
            np.copyto(out.numpy(), body[:n].numpy())
        return total

    def _verify_header(self, page: memoryview, group: int, key: bytes, parent: bytes | None,
                       n: int, path: Path) -> int:
        """Check the header page read from ``path`` against the chunk asked for; returns the
        payload checksum it stores. :class:`ChunkCorrupt` for any damage (the digest of the
        fields, a field naming another chunk, a byte past them that is not zero),
        :class:`OtherFormat` for an intact header of another format version."""
        end = _HEAD.size + _DIGEST
        head, digest = bytes(page[: _HEAD.size]), bytes(page[_HEAD.size : end])
        if hashlib.blake2b(head, digest_size=_DIGEST).digest() != digest:
            raise ChunkCorrupt(f"{path.name}: header digest mismatch")
        magic, ver, g, shard, _, length, stored, ns, k, p, has_p = _HEAD.unpack(head)
        if magic == MAGIC and ver != FORMAT_VERSION:
            raise OtherFormat(f"{path.name}: format version {ver}, this kvtier reads "
                              f"{FORMAT_VERSION}")
        want = (MAGIC, group, self.shard, n, self.namespace, key,
                parent or bytes(KEY_BYTES), parent is not None)
        if (magic, g, shard, length, ns, k, p, bool(has_p)) != want:
            raise ChunkCorrupt(f"{path.name}: header names another chunk or format")
        if page[end:PAGE] != _HEAD_TAIL:
            raise ChunkCorrupt(f"{path.name}: header page not zero past its fields")
        return int(stored)

    def delete(self, group: int, key: bytes, parent: bytes | None) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.dir / chunk_name(group, key, parent))

    def close(self) -> None:
        with self._lock:
            staging, self._staging = list(self._staging.values()), {}
        for st in staging:
            st.close()


class _Staging:
    """One I/O thread's page-aligned buffers: the header page of every read and write, and
    (made on first need, grown as needed) a payload buffer for chunks that cannot move in
    place. The payload buffer is huge-page backed, so a staged chunk too is one request."""

    def __init__(self) -> None:
        self._head_map = mmap.mmap(-1, PAGE)
        self.head = memoryview(self._head_map)
        self._body: tuple[mmap.mmap, torch.Tensor] | None = None

    def body(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` (whole pages) of the payload buffer."""
        if self._body is None or self._body[1].numel() < nbytes:
            self._close_body()
            self._body = huge_page_buffer(nbytes)
        return self._body[1][:nbytes]

    def _close_body(self) -> None:
        if self._body is not None:
            mapping, self._body = self._body[0], None  # drops the tensor over the map
            with contextlib.suppress(BufferError):  # a view still alive: goes with the process
                mapping.close()

    def close(self) -> None:
        self._close_body()
        self.head.release()
        self._head_map.close()
