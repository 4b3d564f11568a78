"""An in-memory :class:`~kvtier.tiers.seam.ChunkStore`: a real tier (bytes kept, checksums
verified on every get, a byte budget that declines writes when full) without a disk, so that
the scheduler's and the runner's handling of a tier is unit-tested on real data paths."""

from __future__ import annotations

import threading

import torch

from kvtier.checksum import checksum, chunk_seed
from kvtier.tiers.seam import ChunkCorrupt, ChunkStore, TierFull


class MemoryChunkStore(ChunkStore):
    """One shard's chunks in process memory; ``capacity`` bytes (None: unbounded)."""

    def __init__(self, shard: int = 0, capacity: int | None = None) -> None:
        self.shard = shard
        self.capacity = capacity
        self.used = 0
        self._chunks: dict[tuple[int, bytes], tuple[bytes | None, torch.Tensor, int]] = {}
        self._lock = threading.Lock()  # tests read it from the main thread

    def _padded(self, data: torch.Tensor) -> torch.Tensor:
        n = data.numel()
        out = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8)
        out[:n].copy_(data)
        return out

    def put(self, group: int, key: bytes, parent: bytes | None, data: torch.Tensor) -> int:
        body = self._padded(data)
        with self._lock:
            old = self._chunks.get((group, key))
            grow = body.numel() - (old[1].numel() if old else 0)
            if self.capacity is not None and self.used + grow > self.capacity:
                raise TierFull(f"memory tier holds {self.used} of {self.capacity} bytes")
            self._chunks[(group, key)] = (parent, body,
                                          checksum(body, chunk_seed(key, group, self.shard)))
            self.used += grow
        return body.numel()

    def get(self, group: int, key: bytes, parent: bytes | None, out: torch.Tensor) -> int:
        with self._lock:
            found = self._chunks.get((group, key))
        if found is None:
            raise KeyError(f"chunk {key.hex()[:8]} of group {group} is not stored")
        stored_parent, body, value = found
        if stored_parent != parent or body.numel() != (out.numel() + 7) // 8 * 8:
            raise ChunkCorrupt("stored under another parent or length")
        if checksum(body, chunk_seed(key, group, self.shard)) != value:
            raise ChunkCorrupt("checksum mismatch")
        out.copy_(body[: out.numel()])
        return body.numel()

    def delete(self, group: int, key: bytes, parent: bytes | None) -> None:
        with self._lock:
            found = self._chunks.pop((group, key), None)
            if found is not None:
                self.used -= found[1].numel()

    # -- for tests: what is stored, and damage to it ------------------------------------------
    def keys(self) -> set[tuple[int, bytes]]:
        with self._lock:
            return set(self._chunks)

    def flip_byte(self, group: int, key: bytes, offset: int = 0) -> None:
        with self._lock:
            self._chunks[(group, key)][1][offset] ^= 0xFF
