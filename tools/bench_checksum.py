"""CPU speed of the restore checksum against the CPU engine's copy path, on one chunk.

    python tools/bench_checksum.py [--mib 32] [--threads 1]

Prints GB/s of :func:`kvtier.checksum.checksum`, :func:`~kvtier.checksum.block_sums` (16 blocks,
two segments) and of the copy it rides on (the reference codec's gather: index_select of the
blocks into a slot), best of five.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from kvtier import checksum


def _best(fn: Callable[[], object], reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=32, help="chunk size in MiB")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    bpc, nseg = 16, 2
    run = args.mib * 2**20 // (bpc * nseg)
    segs = [torch.randint(0, 256, (4 * bpc, run), dtype=torch.uint8) for _ in range(nseg)]
    slot = torch.empty(nseg * bpc * run, dtype=torch.uint8)
    idx = torch.randperm(4 * bpc)[:bpc]

    def gather() -> None:
        for k, s in enumerate(segs):
            slot[k * bpc * run:(k + 1) * bpc * run].view(bpc, run).copy_(s.index_select(0, idx))

    n = slot.numel()
    for name, fn in (("copy path (gather)", gather),
                     ("checksum", lambda: checksum.checksum(slot, 1)),
                     ("block_sums", lambda: checksum.block_sums(slot, [run] * nseg, bpc))):
        print(f"{name:20s} {n / _best(fn) / 1e9:6.2f} GB/s")


if __name__ == "__main__":
    main()
