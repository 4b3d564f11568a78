"""Time what attaching to the node-wide store costs a worker (issue 18): the store's pool
reservation, the descriptor hand-over, the client's mmap, the first touch of every page, and
(with --pin, on a CUDA host) cudaHostRegister of the whole arena in pin_step pieces.

    python tools/store_map_time.py --size 4GiB [--pin] [--json out.json]

The store runs as its own process (``kvtier store``); the numbers are this process's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

from kvtier.config import parse_bytes
from kvtier.slab import lay_out_slab
from kvtier.store.attach import MapTiming, store_slab
from kvtier.store.client import StoreClient
from kvtier.testing.store_process import StoreProcess

PAGE = 4096


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="1GiB")
    ap.add_argument("--pin", action="store_true", help="cudaHostRegister the arena (CUDA)")
    ap.add_argument("--pin-step", default="1GiB")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    size = parse_bytes(args.size)
    arena = size - 2 * 2**20
    layout = lay_out_slab(arena, [2 * 2**20])  # 2 MiB chunks
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        store = StoreProcess(Path(d), size=args.size, lease_ttl=30).start(timeout=600)
        start_s = time.perf_counter() - t0
        try:
            client = StoreClient(store.url, timeout=60)
            t1 = time.perf_counter()
            att = client.connect({"namespace": b"bench", "arena_bytes": layout.total_bytes,
                                  "slots": [c.num_slots for c in layout.classes],
                                  "groups": [[0, True, False]]})
            attach_s = time.perf_counter() - t1
            pinner = None
            if args.pin:
                from kvtier.gpu.pinning import CudaPinner

                pinner = CudaPinner()
            timing = MapTiming()
            slab = store_slab(layout, att, pinner=pinner, pin_step=parse_bytes(args.pin_step),
                              timing=timing)
            t2 = time.perf_counter()
            buf = slab.buffer
            buf[::PAGE].fill_(1)  # write one byte per page: the page tables of the mapping
            touch_s = time.perf_counter() - t2
            slab.close()
            client.close()
        finally:
            store.stop()
    out = {"pool_bytes": size, "arena_bytes": layout.total_bytes,
           "store_start_s (process start + memfd fallocate)": round(start_s, 4),
           "store_line": store.ready_line, "attach_s (socket + SCM_RIGHTS)": round(attach_s, 6),
           "mmap_s": round(timing.map_seconds, 6), "pin_s": round(timing.pin_seconds, 6),
           "first_touch_s": round(touch_s, 4), "pinned": bool(args.pin), "pid": os.getpid()}
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
