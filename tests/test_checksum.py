"""The restore checksum (:mod:`kvtier.checksum`): what it must catch, the NumPy path against
the torch reference (CPU and CUDA), per-block sums against the whole, and pinned values."""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier import checksum as C


def _rand(n: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


def _flip(buf: torch.Tensor, bit: int) -> torch.Tensor:
    out = buf.clone()
    out[bit // 8] ^= 1 << (bit % 8)
    return out


# --- pinned values: the definition may not drift (stored checksums would all fail) ---------

KNOWN = [  # (bytes, seed, checksum)
    (b"", 0, 0xE514FD3BA51117AD),
    (bytes(8), 0, 0xE514FD3BA51117AD),  # a zero word adds nothing; the seal is never 0
    (bytes(range(16)), 1, 0x4DCFA350101F69F3),
    (bytes(range(64)), 0xDEADBEEF, 0xD29D3E67836B02E4),
    (b"kvtier restore checksum!", 2**64 - 1, 0xB46C0FE446ACE53F),
]


def _spec(data: bytes, seed: int) -> int:
    """The definition in kvtier.checksum's docstring, word by word in plain Python."""
    m = C.MASK64
    total = C.fmix64(seed + C.SEAL_STEP)
    for i in range(len(data) // 8):
        w = int.from_bytes(data[8 * i:8 * i + 8], "little")
        y = (w * C.WORD_MULT) & m
        y ^= y >> 32
        r = C.fmix64(i + C.POS_OFFSET) | 1
        total = (total + y * r) & m
    return total


@pytest.mark.parametrize(("data", "seed", "want"), KNOWN)
def test_known_answers(data: bytes, seed: int, want: int) -> None:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    assert C.checksum(buf, seed) == want
    assert C.checksum_torch(buf, seed) == want
    assert _spec(data, seed) == want


@settings(max_examples=20, deadline=None)
@given(data=st.binary(max_size=200).map(lambda b: b[: len(b) // 8 * 8]),
       seed=st.integers(0, 2**64 - 1))
def test_implementations_follow_the_definition(data: bytes, seed: int) -> None:
    buf = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else \
        torch.empty(0, dtype=torch.uint8)
    assert C.checksum(buf, seed) == C.checksum_torch(buf, seed) == _spec(data, seed)


def test_known_multipliers_and_seeds() -> None:
    assert C.fmix64(0) == 0
    assert C.fmix64(1) == 0xB456BCFC34C2CB2C
    assert [int(x) for x in C.MULTIPLIERS.numpy(3)] == [
        0xB800BD6C02472607, 0xBA1F03598DD83005, 0xE40DB472C9C1CD83]
    assert C.chunk_seed(bytes(range(16)), 2, 1) == 0x103E78EBA420306D


# --- what it catches -----------------------------------------------------------------------

@pytest.mark.parametrize("n", [8, 24, 64])
@pytest.mark.parametrize("content", ["zeros", "ones", "random"])
def test_every_single_bit_flip_of_a_small_buffer(n: int, content: str) -> None:
    buf = {"zeros": torch.zeros(n, dtype=torch.uint8),
           "ones": torch.full((n,), 255, dtype=torch.uint8),
           "random": _rand(n, n)}[content]
    base = C.checksum(buf, 7)
    seen = {base}
    for bit in range(n * 8):
        v = C.checksum(_flip(buf, bit), 7)
        assert v != base, f"flipping bit {bit} of {n} {content} bytes went unnoticed"
        seen.add(v)
    assert len(seen) == n * 8 + 1, "two different single-bit flips gave the same checksum"


@settings(max_examples=40, deadline=None)
@given(words=st.integers(1, 1 << 14), bit=st.integers(0, 2**40), seed=st.integers(0, 2**64 - 1),
       data_seed=st.integers(0, 2**31))
def test_random_single_bit_flip_of_a_large_buffer(words: int, bit: int, seed: int,
                                                  data_seed: int) -> None:
    buf = _rand(words * 8, data_seed)
    bit %= words * 64
    assert C.checksum(_flip(buf, bit), seed) != C.checksum(buf, seed)


@settings(max_examples=60, deadline=None)
@given(data=st.lists(st.integers(0, 2**64 - 1), min_size=2, max_size=64),
       i=st.integers(0, 63), j=st.integers(0, 63), seed=st.integers(0, 2**64 - 1))
def test_swapped_words(data: list[int], i: int, j: int, seed: int) -> None:
    i, j = i % len(data), j % len(data)
    if data[i] == data[j]:
        data[j] ^= 1 << 63  # a swap must move different words: differ only in the top bit
    if i == j:
        j = (i + 1) % len(data)
    buf = torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in data],
                       dtype=torch.int64).view(torch.uint8)
    swapped = list(data)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    if swapped == data:
        return
    other = torch.tensor([x - (1 << 64) if x >= 1 << 63 else x for x in swapped],
                         dtype=torch.int64).view(torch.uint8)
    assert C.checksum(other, seed) != C.checksum(buf, seed)


@pytest.mark.parametrize("pattern", ["top_bit", "sign_bits", "one_low_bit"])
def test_swapped_words_that_differ_in_one_or_two_bits(pattern: str) -> None:
    """The mixing's weakest pairs: words differing only in the top bit (or in bits 63 and 31,
    which the inner xorshift maps onto each other), at every pair of positions of 64 words."""
    diff = {"top_bit": 1 << 63, "sign_bits": (1 << 63) | (1 << 31), "one_low_bit": 1}[pattern]
    base = _rand(64 * 8, 5).view(torch.int64).clone()
    ref = C.checksum(base.view(torch.uint8), 3)
    for i in range(64):
        for j in range(i + 1, 64):
            t = base.clone()
            t[j] = t[i] ^ C._signed(diff)
            before = C.checksum(t.view(torch.uint8), 3)
            t[i], t[j] = t[j].clone(), t[i].clone()
            assert C.checksum(t.view(torch.uint8), 3) != before, (pattern, i, j)
    assert ref == C.checksum(base.view(torch.uint8), 3)


@pytest.mark.parametrize(("block", "a", "b"), [(16, 0, 1), (4096, 0, 3), (4096, 1, 2),
                                               (65536, 0, 1)])
def test_swapped_blocks_inside_a_chunk(block: int, a: int, b: int) -> None:
    buf = _rand(4 * block, block + a)
    sw = buf.clone()
    sw[a * block:(a + 1) * block] = buf[b * block:(b + 1) * block]
    sw[b * block:(b + 1) * block] = buf[a * block:(a + 1) * block]
    assert C.checksum(sw, 11) != C.checksum(buf, 11)
    # Per block position (two segments of half a block each, in the codec's format): the two
    # swapped positions mismatch, the others match.
    runs = [block // 2, block // 2]
    chunk = _codec_chunk(buf.view(4, block), runs)
    stored = C.block_checksums(chunk, runs, 4, 11)
    swapped = _codec_chunk(sw.view(4, block), runs)
    bad = C.mismatched_blocks(stored, C.block_sums(swapped, runs, 4), 11, range(4))
    assert bad == sorted({a, b})


def _codec_chunk(blocks: torch.Tensor, runs: list[int]) -> torch.Tensor:
    """Blocks (bpc, sum(runs)) in the codec's format: segment-major, then block."""
    parts, pos = [], 0
    for r in runs:
        parts.append(blocks[:, pos:pos + r].reshape(-1))
        pos += r
    return torch.cat(parts)


def test_another_chunks_seed_fails() -> None:
    buf = _rand(1 << 16, 1)
    keys = [bytes([k]) * 16 for k in range(8)]
    seeds = {C.chunk_seed(k, g, s) for k in keys for g in range(3) for s in range(2)}
    assert len(seeds) == 8 * 3 * 2, "two chunks, groups or shards share a seed"
    values = {C.checksum(buf, s) for s in seeds}
    assert len(values) == len(seeds)
    stored = C.block_checksums(buf, [4096], 16, C.chunk_seed(keys[0], 0, 0))
    sums = C.block_sums(buf, [4096], 16)
    assert C.mismatched_blocks(stored, sums, C.chunk_seed(keys[0], 0, 0), range(16)) == []
    assert C.mismatched_blocks(stored, sums, C.chunk_seed(keys[1], 0, 0), range(16)) == \
        list(range(16))
    assert C.mismatched_blocks(stored, sums, C.chunk_seed(keys[0], 0, 1), [3, 5]) == [3, 5]


# --- consistency -----------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(runs=st.lists(st.integers(1, 600).map(lambda x: 8 * x), min_size=1, max_size=4),
       bpc=st.integers(1, 5), seed=st.integers(0, 2**64 - 1), data_seed=st.integers(0, 99))
def test_block_sums_add_up_and_match_the_reference(runs: list[int], bpc: int, seed: int,
                                                   data_seed: int) -> None:
    buf = _rand(sum(runs) * bpc, data_seed)
    sums = C.block_sums(buf, runs, bpc)
    assert sums == C.block_sums_torch(buf, runs, bpc)
    whole = C.block_sums(buf, None, 1)[0]
    assert sum(sums) % 2**64 == whole
    assert C.checksum(buf, seed) == C.checksum_torch(buf, seed) == (C.seal_of(seed, 0) + whole) % 2**64
    if bpc == 1:
        assert C.block_checksums(buf, runs, 1, seed) == [C.checksum(buf, seed)]


def test_pieces_larger_than_one_numpy_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs that straddle the NumPy path's passes, and passes that hold many runs."""
    monkeypatch.setattr(C, "_PIECE_WORDS", 64)
    runs = [8 * 100, 8 * 3, 8 * 64]
    buf = _rand(sum(runs) * 7, 3)
    assert C.block_sums(buf, runs, 7) == C.block_sums_torch(buf, runs, 7)
    assert C.checksum(buf, 9) == C.checksum_torch(buf, 9)


def test_views_at_any_offset_and_slab_slices() -> None:
    big = _rand(4096 + 8 * 33, 2)
    for off in (0, 1, 3, 8, 4096):
        view = big[off:off + 8 * 32]
        want = C.checksum_torch(view.clone(), 5)
        assert C.checksum(view, 5) == want
        assert C.checksum_torch(view, 5) == want


def test_refuses_what_it_is_not_defined_for() -> None:
    with pytest.raises(C.ChecksumError):
        C.checksum(torch.zeros(12, dtype=torch.uint8), 0)
    with pytest.raises(C.ChecksumError):
        C.checksum(torch.zeros(16, dtype=torch.int8), 0)
    with pytest.raises(C.ChecksumError):
        C.block_sums(torch.zeros(64, dtype=torch.uint8), [12, 4], 2)  # not whole words
    with pytest.raises(C.ChecksumError):
        C.block_sums(torch.zeros(64, dtype=torch.uint8), [16], 2)  # 32 bytes, not 64
    with pytest.raises(C.ChecksumError):
        C.block_sums(torch.zeros(64, dtype=torch.uint8), None, 2)
    with pytest.raises(C.ChecksumError):
        C.chunk_seed(b"short", 0, 0)


@pytest.mark.cuda
def test_cuda_equals_cpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    runs = [8 * 1000, 8 * 24]
    buf = _rand(sum(runs) * 16, 4)
    dev = buf.cuda()
    assert C.checksum(dev, 77) == C.checksum(buf, 77)
    assert C.block_sums(dev, runs, 16) == C.block_sums(buf, runs, 16)
    assert C.checksum(dev[8:], 1) == C.checksum(buf[8:], 1)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["v032_flash_BHLNC", "v032_mamba_hybrid", "v025_flash_hnd"])
def test_compiled_device_kernels_equal_cpu(name: str) -> None:
    """The compiled Triton kernels (this process does not interpret them) give the CPU's sums:
    the fused gather, the cache-only pass and stage_sums."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from _families import blocks_per_chunk, materialize, stored_recipes
    from kvtier.gpu import kernels

    fam = materialize({r["name"]: r for r in stored_recipes()}[name], "cuda")
    _, bpc = blocks_per_chunk(fam.layout)
    for group, b in zip(fam.layout.groups, bpc):
        for s in {id(seg.storage): seg.storage for seg in group.segments}.values():
            s.copy_(torch.randint(0, 256, s.shape, dtype=torch.uint8, device="cuda"))
        t = kernels.TileTable.build(group, b)
        n = max(1, min(3, group.num_blocks // b))
        ids = torch.randperm(group.num_blocks, device="cuda")[: n * b].to(torch.int64)
        stage = torch.zeros(n * t.chunk_bytes, dtype=torch.uint8, device="cuda")
        part = torch.empty(t.work_items(ids.numel()), dtype=torch.int64, device="cuda")
        t.launch(stage, 0, ids, True, max_programs=16, sums=part)
        got = [int(x) & C.MASK64 for x in t.block_sums(part, ids.numel()).tolist()]
        host = stage.cpu()
        runs = [s.run for s in group.segments]
        want = []
        for c in range(n):
            want += C.block_sums(host[c * t.chunk_bytes:(c + 1) * t.chunk_bytes], runs, b)
        assert got == want
        again = torch.empty_like(part)
        t.launch(stage, 0, ids, False, max_programs=16, sums=again, move=False)
        assert torch.equal(again, part)
        whole = kernels.stage_sums(stage, 0, n, t.chunk_bytes)
        assert [int(x) & C.MASK64 for x in whole.tolist()] == [
            sum(want[c * b:(c + 1) * b]) & C.MASK64 for c in range(n)]


def test_the_seed_of_an_op_is_the_chunk_seed_in_two_steps() -> None:
    """The scheduler sends key_seed(key); each worker mixes in group and shard: the same
    value as chunk_seed, and every group, shard and key gives another."""
    keys = [bytes([k]) * 16 for k in range(4)]
    seeds = set()
    for key in keys:
        for group in range(3):
            for shard in range(2):
                s = C.shard_seed(C.key_seed(key), group, shard)
                assert s == C.chunk_seed(key, group, shard)
                seeds.add(s)
    assert len(seeds) == 4 * 3 * 2


def test_piece_sums_add_up_to_the_checksum() -> None:
    buf = torch.randint(0, 256, (3 * 2**20 + 4096,), dtype=torch.uint8)
    cuts = [0, 4096, 2**20 + 4096, 3 * 2**20, buf.numel()]
    pieces = [C.piece_sum(buf[a:b], a // 8) for a, b in itertools.pairwise(cuts)]
    assert (C.seal_of(11, 0) + sum(pieces)) & C.MASK64 == C.checksum(buf, 11)
