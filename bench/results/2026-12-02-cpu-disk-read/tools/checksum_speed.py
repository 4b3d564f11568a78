"""Per-2-MiB-chunk cost of candidate file checksums on one core: from cache (one chunk hashed
again and again) and from memory (a 256 MiB huge-page buffer walked chunk by chunk)."""
import time
import zlib

import blake3
import torch
import xxhash

from kvtier.checksum import checksum
from kvtier.huge_pages import huge_page_buffer

CHUNK = 2 << 20
_, big = huge_page_buffer(256 << 20)
big.copy_(torch.randint(0, 256, (256 << 20,), dtype=torch.uint8))
chunks = [big[i:i + CHUNK] for i in range(0, big.numel(), CHUNK)]
views = [memoryview(c.numpy()) for c in chunks]
CANDIDATES = {
    "kvtier.checksum.checksum (NumPy)": lambda i: checksum(chunks[i], 123),
    "xxhash.xxh3_64_intdigest": lambda i: xxhash.xxh3_64_intdigest(views[i], seed=123),
    "xxhash.xxh3_128_intdigest": lambda i: xxhash.xxh3_128_intdigest(views[i], seed=123),
    "xxhash.xxh64_intdigest": lambda i: xxhash.xxh64_intdigest(views[i], seed=123),
    "blake3 (1 thread)": lambda i: blake3.blake3(views[i]).digest(),
    "blake3 (AUTO threads)": lambda i: blake3.blake3(views[i],
                                                     max_threads=blake3.blake3.AUTO).digest(),
    "zlib.crc32": lambda i: zlib.crc32(views[i]),
}
print("| checksum | from cache, ms per 2 MiB (GB/s) | from memory, ms per 2 MiB (GB/s) |")
print("|---|---|---|")
for name, f in CANDIDATES.items():
    f(0)
    t0 = time.perf_counter()
    for _ in range(100):
        f(0)
    hot = (time.perf_counter() - t0) / 100
    t0 = time.perf_counter()
    for i in range(len(chunks)):
        f(i)
    cold = (time.perf_counter() - t0) / len(chunks)
    print(f"| {name} | {hot * 1e3:.3f} ({CHUNK / hot / 1e9:.1f}) | {cold * 1e3:.3f} "
          f"({CHUNK / cold / 1e9:.1f}) |")
