"""The remote tier's bytes: chunks in a Redis or Valkey server (standalone or cluster),
shared by every engine that uses the same server and namespace.

Keys: ``<prefix>:{<namespace>:<key>:g<group>:s<shard>}:<part>``, ``part`` being ``h`` (the
head) or ``0``, ``1``, ... (the payload in parts of at most ``part_bytes``). The namespace and
the key are DRAM's own (:mod:`kvtier.keys`: model, revision, layout fingerprint, dtype, chunk
size, codec version, salt), so two engines of one model and layout find each other's chunks,
and any difference between them is a miss, never wrong bytes. The braces are a cluster hash
tag: one chunk's keys live on one node, so its write is one transaction, while chunks spread
over the nodes. ``prefix`` (``remote_key_prefix``) is what an ACL key pattern confines a
deployment's user to (``namespace_extra`` separates keys; it is not access control).

The head is msgpack: ``{"v", "ns", "key", "parent", "group", "shard", "len", "parts", "sum"}``,
``sum`` being :func:`kvtier.checksum.checksum` of the payload (zero-padded to 8 bytes) under
:func:`kvtier.checksum.chunk_seed`. A write sets the parts and then the head in one
MULTI/EXEC, so a reader sees a chunk whole or not at all; a part the server evicted, a short
part or a flipped bit fails the read (:class:`ChunkCorrupt`: a miss and a counter).

Never a stall: every call has the client's socket timeout (``remote_timeout_ms``) and no
retries; failures feed a :class:`~kvtier.tiers.breaker.CircuitBreaker`, and while it is open
every get is a miss and every put a dropped write at once. A server out of memory declines
writes (:class:`TierFull`) and keeps serving reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

try:
    import redis
except ImportError as e:  # the `remote` extra: only a remote tier needs it
    raise ImportError(f"kvtier's remote tier (remote_url) needs the redis client: "
                      f"pip install 'kvtier[remote]' ({e})") from e

from kvtier.checksum import checksum, chunk_seed
from kvtier.tiers.breaker import BreakerOpen, CircuitBreaker
from kvtier.tiers.seam import ChunkCorrupt, ChunkStore, TierFull

FORMAT_VERSION = 1
HEAD = "h"


class RemoteUnavailable(Exception):
    """The remote call failed, timed out, or the breaker refused it: a miss or dropped write."""


@dataclass(frozen=True)
class RemoteKeys:
    """Where one deployment's chunks live on the server."""

    prefix: str
    namespace: bytes

    def tag(self, group: int, key: bytes, shard: int) -> str:
        return f"{self.prefix}:{{{self.namespace.hex()}:{key.hex()}:g{group}:s{shard}}}"

    def head(self, group: int, key: bytes, shard: int) -> str:
        return f"{self.tag(group, key, shard)}:{HEAD}"

    def parts(self, group: int, key: bytes, shard: int, n: int) -> list[str]:
        tag = self.tag(group, key, shard)
        return [f"{tag}:{i}" for i in range(n)]


def payload_checksum(data: np.ndarray, seed: int) -> int:
    """:func:`checksum` of ``data`` (uint8) zero-padded to a multiple of 8 bytes."""
    if data.size % 8:
        padded = np.zeros((data.size + 7) // 8 * 8, dtype=np.uint8)
        padded[: data.size] = data
        data = padded
    return checksum(torch.from_numpy(data), seed)


_FAILURES = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)


class RedisChunkStore(ChunkStore):
    """One shard's chunks on a Redis server or cluster, through ``client`` (a ``redis.Redis``
    or ``redis.cluster.RedisCluster`` whose calls time out, see
    :func:`kvtier.tiers.remote_client.connect`)."""

    def __init__(self, client: Any, keys: RemoteKeys, shard: int, part_bytes: int,
                 breaker: CircuitBreaker, ttl_s: int = 0) -> None:
        self.client = client
        self.keys = keys
        self.shard = shard
        self.part_bytes = part_bytes
        self.breaker = breaker
        self.ttl_s = ttl_s or None

    def _call(self, fn: Any) -> Any:
        """Run ``fn()`` (one round trip) under the breaker."""
        try:
            self.breaker.admit()
        except BreakerOpen as e:
            raise RemoteUnavailable(str(e)) from None
        try:
            out = fn()
        except redis.exceptions.ResponseError as e:
            self.breaker.succeeded()  # the server answered
            if isinstance(e, redis.exceptions.OutOfMemoryError) or "maxmemory" in str(e):
                raise TierFull(f"remote tier: {e}") from None
            raise
        except _FAILURES as e:
            self.breaker.failed()
            raise RemoteUnavailable(f"remote tier: {type(e).__name__}: {e}") from None
        self.breaker.succeeded()
        return out

    def num_parts(self, nbytes: int) -> int:
        return max(1, (nbytes + self.part_bytes - 1) // self.part_bytes)

    # -- ChunkStore ------------------------------------------------------------------------------
    def put(self, group: int, key: bytes, parent: bytes | None, data: torch.Tensor) -> int:
        raw = data.numpy()
        n = raw.size
        k = self.num_parts(n)
        head = msgpack.packb({
            "v": FORMAT_VERSION, "ns": self.keys.namespace, "key": key, "parent": parent,
            "group": group, "shard": self.shard, "len": n, "parts": k,
            "sum": payload_checksum(raw, chunk_seed(key, group, self.shard))})
        view = memoryview(raw)
        names = self.keys.parts(group, key, self.shard, k)

        def write() -> None:
            pipe = self.client.pipeline(transaction=True)
            for i, name in enumerate(names):
                pipe.set(name, view[i * self.part_bytes:(i + 1) * self.part_bytes],
                         ex=self.ttl_s)
            pipe.set(self.keys.head(group, key, self.shard), head, ex=self.ttl_s)
            pipe.execute()

        self._call(write)
        return n + len(head)

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        n = out.numel()
        k = self.num_parts(n)
        names = [self.keys.head(group, key, self.shard),
                 *self.keys.parts(group, key, self.shard, k)]

        def read() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            return pipe.execute()

        head_raw, *parts = self._call(read)
        if head_raw is None:
            raise KeyError(f"chunk {key.hex()[:8]} of group {group} is not on the remote tier")
        want_sum = self._verify(head_raw, group, key, parent, n, k, parts)
        dst = out.numpy()
        at = 0
        for p in parts:
            assert p is not None
            dst[at:at + len(p)] = np.frombuffer(p, dtype=np.uint8)
            at += len(p)
        if payload_checksum(dst, chunk_seed(key, group, self.shard)) != want_sum:
            raise ChunkCorrupt(f"chunk {key.hex()[:8]} of group {group}: checksum mismatch")
        return n + len(head_raw)

    def _verify(self, head_raw: bytes, group: int, key: bytes, parent: bytes | None,
                n: int, k: int, parts: Sequence[bytes | None]) -> int:
        """Check the head and the parts' lengths; returns the payload checksum the head holds."""
        try:
            h = msgpack.unpackb(head_raw)
            want = (FORMAT_VERSION, self.keys.namespace, key, parent, group, self.shard, n, k)
            got = (h["v"], h["ns"], h["key"], h["parent"], h["group"], h["shard"], h["len"],
                   h["parts"])
            want_sum = int(h["sum"])
        except (ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            raise ChunkCorrupt(f"chunk {key.hex()[:8]}: unreadable head ({e})") from None
        if got != want:
            raise ChunkCorrupt(f"chunk {key.hex()[:8]}: head names another chunk or format")
        sizes = [len(p) if p is not None else -1 for p in parts]
        expect = [min(self.part_bytes, n - i * self.part_bytes) for i in range(k)]
        if sizes != expect:
            raise ChunkCorrupt(f"chunk {key.hex()[:8]}: parts missing or short ({sizes})")
        return want_sum

    def delete(self, group: int, key: bytes, parent: bytes | None) -> None:
        head = self.keys.head(group, key, self.shard)
        raw = self._call(lambda: self.client.get(head))
        try:
            k = int(msgpack.unpackb(raw)["parts"]) if raw is not None else 0
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            k = 0
        names = [head, *self.keys.parts(group, key, self.shard, k)]

        def remove() -> None:
            pipe = self.client.pipeline(transaction=False)
            for name in names:
                pipe.delete(name)
            pipe.execute()

        self._call(remove)

    def present(self, group: int, keys: Sequence[bytes]) -> list[bool]:
        """Whether the head of each chunk is on the server (one round trip)."""
        def exists() -> list[int]:
            pipe = self.client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self.keys.head(group, k, self.shard))
            return pipe.execute()

        return [bool(x) for x in self._call(exists)]

    def close(self) -> None:
        self.client.close()
