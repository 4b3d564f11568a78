"""The restore checksum: a 64-bit, position-mixed, seeded sum over a chunk's 8-byte words.

Definition (all arithmetic modulo 2**64, words little-endian, ``i`` the word's index inside the
chunk)::

    term(w, i) = xs32(w * M) * r(i)        xs32(y) = y ^ (y >> 32) (logical shift)
    r(i)       = fmix64(i + R0) | 1        a pseudo-random odd multiplier per position
    sum(words) = sum of term(w_i, i)       over any set of words: partial sums add up
    checksum(chunk, seed) = seal(seed, 0) + sum(all words)
    seal(seed, j) = fmix64(seed + (j + 1) * S)

``fmix64`` is MurmurHash3's 64-bit finalizer (a bijection). Because the value is a sum of
per-word terms, a chunk can be checksummed in pieces (tiles of a GPU kernel, runs of a block)
and the pieces added, in any order: :func:`block_sums` gives one partial per block position of
a chunk in the byte format of :mod:`kvtier.codec` (segment-major, then block), which is what a
load with skipped positions verifies (only the blocks it writes); block ``j``'s stored value is
its partial plus ``seal(seed, j)`` (:func:`seal`, :func:`block_checksums`), so one block is the
whole checksum. A seal is never the value of a zeroed table entry for an all-zero block except
for one pseudo-random seed.

What it guarantees (``tests/test_checksum.py`` checks each):

- *Every single-bit flip changes it*: ``w -> xs32(w * M)`` is a bijection (``M`` is odd) and
  ``r(i)`` is odd, so a word that changes changes its term by ``d * r(i)`` with ``d != 0`` and
  ``r(i)`` odd, which is never 0 modulo 2**64 (the same holds for any change of one word).
- *Another chunk's seed changes it*: the seed enters through the bijection ``fmix64``, so the
  same bytes under two different seeds never give the same value (the same for each block).
- *Swapped words and blocks change it* with probability ``1 - 2**-32`` or better: the
  difference is ``(t_a - t_b) * (r(i) - r(j))``; the mixing leaves the first factor with fewer
  than 32 trailing zero bits except for pathological word pairs, and ``r`` is pseudo-random.
  Swapped blocks add many such differences (about ``2**-63``).

Not a cryptographic MAC: it detects corruption (bit flips, misdirected or stale copies), not an
adversary who can write host memory.

Speed: the torch reference (:func:`checksum_torch`, any device) is eight elementwise passes; the
CPU path (:func:`checksum`, :func:`block_sums` on CPU tensors) runs the same arithmetic in NumPy
on 1 MiB pieces, five passes that stay in cache (``tools/bench_checksum.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import torch

MASK64 = (1 << 64) - 1
WORD_MULT = 0x9E3779B97F4A7C15
"""``M``: odd, so multiplying by it is a bijection of 64-bit words."""
POS_OFFSET = 0x2545F4914F6CDD1D
"""``R0``: positions are offset before mixing so that word 0's multiplier is not fmix64(0)=0|1."""
FMIX1 = 0xFF51AFD7ED558CCD
FMIX2 = 0xC4CEB9FE1A85EC53
SEAL_STEP = 0xD6E8FEB86659FD93
"""``S``: block ``j``'s seal is ``fmix64(seed + (j + 1) * SEAL_STEP)``."""

_PIECE_WORDS = 1 << 17  # 1 MiB per NumPy pass: measured fastest (fewer calls, still cache-resident)
_U = np.uint64


class ChecksumError(ValueError):
    """A buffer the checksum is not defined for (not uint8, not whole words)."""


def fmix64(x: int) -> int:
    """MurmurHash3's 64-bit finalizer on a Python int (taken modulo 2**64)."""
    x &= MASK64
    x ^= x >> 33
    x = (x * FMIX1) & MASK64
    x ^= x >> 33
    x = (x * FMIX2) & MASK64
    return x ^ (x >> 33)


def chunk_seed(key: bytes, group: int, shard: int) -> int:
    """The seed of one group's chunk in one shard: from the chunk's key (:mod:`kvtier.keys`,
    16 bytes), so that a slot holding another chunk's bytes, another group's or another rank's
    shard fails verification. ``shard_seed(key_seed(key), group, shard)``."""
    return shard_seed(key_seed(key), group, shard)


def key_seed(key: bytes) -> int:
    """The 64-bit digest of a chunk's key that the scheduler puts in a
    :class:`~kvtier.protocol.TransferOp` (the same for every group and rank)."""
    if len(key) < 8:
        raise ChecksumError(f"a chunk key has at least 8 bytes, got {len(key)}")
    lo = int.from_bytes(key[:8], "little")
    hi = int.from_bytes(key[8:16].ljust(8, b"\0"), "little")
    return fmix64(lo ^ fmix64(hi))


def shard_seed(digest: int, group: int, shard: int) -> int:
    """What a worker of ``shard`` seeds ``group``'s chunk with, from its key's digest."""
    return fmix64(digest ^ fmix64((group << 32) ^ shard ^ POS_OFFSET))


def seal_of(seed: int, block: int) -> int:
    """What block position ``block`` of a chunk seeded ``seed`` adds to its partial sum."""
    return fmix64(seed + (block + 1) * SEAL_STEP)


def seal(sums: Sequence[int], seed: int) -> list[int]:
    """Per-block checksums as a slot stores them: block ``j``'s partial sum plus its seal."""
    return [(s + seal_of(seed, j)) & MASK64 for j, s in enumerate(sums)]


def block_checksums(buf: torch.Tensor, runs: Sequence[int], blocks_per_chunk: int,
                    seed: int) -> list[int]:
    """What a slot stores for one chunk: :func:`seal` of :func:`block_sums`. With one block
    (and any runs), the single entry is :func:`checksum`."""
    return seal(block_sums(buf, runs, blocks_per_chunk), seed)


def mismatched_blocks(stored: Sequence[int], sums: Sequence[int], seed: int,
                      positions: Sequence[int]) -> list[int]:
    """The block positions among ``positions`` whose freshly computed partial sums (``sums``,
    indexed by position) do not match the ``stored`` per-block checksums under ``seed``."""
    sealed = seal(sums, seed)
    return [j for j in positions if sealed[j] != (stored[j] & MASK64)]


# --- the words -----------------------------------------------------------------------------

def _check(buf: torch.Tensor) -> None:
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ChecksumError(f"checksums are over 1-D uint8 tensors, got {buf.dtype} {tuple(buf.shape)}")
    if buf.numel() % 8:
        raise ChecksumError(f"checksums are over whole 8-byte words, got {buf.numel()} bytes")


def _words_np(buf: torch.Tensor) -> np.ndarray:
    """The buffer's words as a uint64 NumPy view (a copy if it is not contiguous or aligned)."""
    a = buf.numpy()
    if not a.flags.c_contiguous or a.ctypes.data % 8:
        a = np.ascontiguousarray(a).copy()
    return a.view(_U)


class _Multipliers:
    """``r(i)`` for i in [0, n), computed once for the largest n asked (a prefix serves every
    smaller chunk), per device. 8 bytes per word of the largest chunk."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._np = np.empty(0, dtype=_U)
        self._dev: dict[torch.device, torch.Tensor] = {}

    def numpy(self, n: int) -> np.ndarray:
        if self._np.size < n:
            with self._lock:
                if self._np.size < n:
                    self._np = _multipliers_np(n)
        return self._np[:n]

    def torch(self, n: int, device: torch.device) -> torch.Tensor:
        t = self._dev.get(device)
        if t is None or t.numel() < n:
            with self._lock:
                t = torch.from_numpy(self.numpy(n).view(np.int64).copy()).to(device)
                self._dev[device] = t
        return t[:n]


def _multipliers_np(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=_U) + _U(POS_OFFSET)
        z ^= z >> _U(33)
        z *= _U(FMIX1)
        z ^= z >> _U(33)
        z *= _U(FMIX2)
        z ^= z >> _U(33)
        z |= _U(1)
    return z


MULTIPLIERS = _Multipliers()


def _terms_np(w: np.ndarray, r: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """term(w_k, i_k) for a piece whose multipliers are ``r``, in ``out`` (``tmp``: scratch)."""
    t, tmp = out[: w.size], tmp[: w.size]
    np.multiply(w, _U(WORD_MULT), out=t)
    np.right_shift(t, _U(32), out=tmp)
    np.bitwise_xor(t, tmp, out=t)
    np.multiply(t, r, out=t)
    return t


def _run_starts(runs: Sequence[int], bpc: int, nwords: int) -> tuple[np.ndarray, np.ndarray]:
    """Word index where every (segment, block) run starts, in chunk order, and its block."""
    if bpc < 1:
        raise ChecksumError(f"blocks_per_chunk must be positive, got {bpc}")
    bad = [r for r in runs if r <= 0 or r % 8]
    if bad:
        raise ChecksumError(f"per-block checksums need runs of whole words, got {bad}")
    if sum(runs) * bpc != nwords * 8:
        raise ChecksumError(f"runs {list(runs)} x {bpc} blocks is not the chunk's {nwords * 8} bytes")
    starts, blocks, pos = [], [], 0
    for r in runs:
        for j in range(bpc):
            starts.append(pos)
            blocks.append(j)
            pos += r // 8
    return np.asarray(starts, dtype=np.int64), np.asarray(blocks, dtype=np.int64)


def _sums_np(buf: torch.Tensor, runs: Sequence[int] | None, bpc: int) -> list[int]:
    w = _words_np(buf)
    n = w.size
    r = MULTIPLIERS.numpy(n)
    out = np.zeros(bpc, dtype=_U)
    scratch = np.empty(min(n, _PIECE_WORDS), dtype=_U)
    tmp = np.empty_like(scratch)
    starts, blocks = (None, None) if runs is None else _run_starts(runs, bpc, n)
    with np.errstate(over="ignore"):
        for a in range(0, n, _PIECE_WORDS):
            b = min(n, a + _PIECE_WORDS)
            t = _terms_np(w[a:b], r[a:b], scratch, tmp)
            if starts is None:
                out[0] += t.sum(dtype=_U)
                continue
            first = int(np.searchsorted(starts, a, side="right")) - 1
            last = int(np.searchsorted(starts, b, side="left"))
            cuts = starts[first:last].copy()
            cuts[0] = a
            np.add.at(out, blocks[first:last], np.add.reduceat(t, cuts - a, dtype=_U))
    return [int(x) for x in out]


# --- the torch reference (any device) ------------------------------------------------------

def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def _terms_torch(buf: torch.Tensor) -> torch.Tensor:
    """term(w_i, i) for every word, as int64 (two's complement: multiplication wraps; the
    logical shift is an arithmetic one masked to the low 32 bits)."""
    w = buf.contiguous()
    if w.storage_offset() % 8:
        w = w.clone()
    w = w.view(torch.int64)
    y = w * _signed(WORD_MULT)
    y ^= (y >> 32) & 0xFFFFFFFF
    return y * MULTIPLIERS.torch(w.numel(), w.device)


def block_sums_torch(buf: torch.Tensor, runs: Sequence[int] | None, blocks_per_chunk: int
                     ) -> list[int]:
    """The reference for :func:`block_sums`, in torch on the buffer's device."""
    _check(buf)
    t = _terms_torch(buf)
    if runs is None:
        if blocks_per_chunk != 1:
            raise ChecksumError("without runs there is one block")
        return [int(t.sum()) & MASK64]
    _run_starts(runs, blocks_per_chunk, t.numel())  # validates
    acc = torch.zeros(blocks_per_chunk, dtype=torch.int64, device=t.device)
    pos = 0
    for r in runs:
        width = r // 8 * blocks_per_chunk
        acc += t[pos:pos + width].view(blocks_per_chunk, r // 8).sum(1)
        pos += width
    return [int(x) & MASK64 for x in acc.tolist()]


def checksum_torch(buf: torch.Tensor, seed: int) -> int:
    """The reference :func:`checksum`, in torch on the buffer's device."""
    return (seal_of(seed, 0) + block_sums_torch(buf, None, 1)[0]) & MASK64


# --- the entry points ----------------------------------------------------------------------

def block_sums(buf: torch.Tensor, runs: Sequence[int] | None, blocks_per_chunk: int
               ) -> list[int]:
    """Unseeded partial sums per block position of one chunk in :mod:`kvtier.codec`'s byte
    format: ``runs`` are the segments' bytes per block in layout order (each a multiple of 8);
    ``None``: the whole buffer is one block. CPU tensors take the NumPy path, others torch."""
    _check(buf)
    if runs is None and blocks_per_chunk != 1:
        raise ChecksumError("without runs there is one block")
    if buf.device.type == "cpu":
        return _sums_np(buf, runs, blocks_per_chunk)
    return block_sums_torch(buf, runs, blocks_per_chunk)


def checksum(buf: torch.Tensor, seed: int) -> int:
    """The 64-bit checksum of ``buf`` (uint8, a multiple of 8 bytes) under ``seed``."""
    return (seal_of(seed, 0) + block_sums(buf, None, 1)[0]) & MASK64


def piece_sum(piece: torch.Tensor, first_word: int) -> int:
    """The unseeded sum of the terms of ``piece`` (a CPU uint8 tensor, whole words) as the
    words ``first_word``.. of a larger buffer: the pieces of a buffer add up (mod 2**64) to
    ``block_sums(buf, None, 1)[0]``, so ``seal_of(seed, 0)`` plus them is its
    :func:`checksum`, computed while the rest of the buffer is still being read."""
    _check(piece)
    w = _words_np(piece)
    r = MULTIPLIERS.numpy(first_word + w.size)[first_word:]
    total = _U(0)
    scratch = np.empty(min(w.size, _PIECE_WORDS), dtype=_U)
    tmp = np.empty_like(scratch)
    with np.errstate(over="ignore"):
        for a in range(0, w.size, _PIECE_WORDS):
            b = min(w.size, a + _PIECE_WORDS)
            total += _terms_np(w[a:b], r[a:b], scratch, tmp).sum(dtype=_U)
    return int(total)


# --- vectorized seeds and seals (the GPU engine's host side) -------------------------------

def _fmix64_np(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z ^ (z >> _U(33))
        z = z * _U(FMIX1)
        z = z ^ (z >> _U(33))
        z = z * _U(FMIX2)
        return z ^ (z >> _U(33))


def shard_seeds_np(digests: np.ndarray, group: int, shard: int) -> np.ndarray:
    """:func:`shard_seed` of every key digest (uint64) for one group and shard."""
    mix = _U(fmix64((group << 32) ^ shard ^ POS_OFFSET))
    return _fmix64_np(digests.astype(_U) ^ mix)


def seals_np(seeds: np.ndarray, blocks_per_chunk: int) -> np.ndarray:
    """``(n, blocks_per_chunk)`` uint64: :func:`seal_of` of every seed and block position."""
    steps = (np.arange(1, blocks_per_chunk + 1, dtype=_U) * _U(SEAL_STEP)).astype(_U)
    with np.errstate(over="ignore"):
        return _fmix64_np(seeds.astype(_U)[:, None] + steps[None, :])
