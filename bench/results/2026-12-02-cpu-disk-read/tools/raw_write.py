"""Ceiling of the tier's write pattern: raw create+pwritev+close+rename per 2 MiB chunk file
(O_DIRECT, huge-page buffer, no checksum, no runner), 1 or 4 threads, then fsync of every file
and the dir; alternated with dd oflag=direct conv=fsync. Also the tier itself (runner)."""
import os, sys, time, shutil, threading, subprocess, re, statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from kvtier.huge_pages import huge_page_buffer
from kvtier.bench.disk import DeviceRequests, _fsync_tree, _dd, _tier_pass
base = Path(sys.argv[1]); pairs = int(sys.argv[2]); n = 256; chunk = 2 << 20
base.mkdir(parents=True, exist_ok=True)
req = DeviceRequests(base)
m, buf = huge_page_buffer(16 * chunk + (2 << 20)); buf.fill_(5)
mv = memoryview(buf.numpy())
head = mv[16 * chunk: 16 * chunk + 4096]
bodies = [mv[i * chunk:(i + 1) * chunk] for i in range(16)]
def raw(threads, fsync=True):
    d = base / "raw"; shutil.rmtree(d, ignore_errors=True); d.mkdir()
    def one(i):
        tmp = f"{d}/.c{i}.tmp"; fin = f"{d}/c{i}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        os.pwritev(fd, [head, bodies[i % 16]], 0); os.close(fd); os.rename(tmp, fin)
    with req.counting(f"raw{threads}_write"):
        t0 = time.perf_counter()
        if threads == 1:
            for i in range(n): one(i)
        else:
            with ThreadPoolExecutor(threads) as ex: list(ex.map(one, range(n)))
        t1 = time.perf_counter()
        if fsync: _fsync_tree(d)
        t2 = time.perf_counter()
    shutil.rmtree(d)
    return n * chunk / (t2 - t0) / 1e9, (t2 - t1) * 1e3
res = {}
for p in range(pairs):
    for name, f in (("raw1", lambda: raw(1)), ("raw4", lambda: raw(4)),
                    ("tier", lambda: (_tier_pass(base / "tier", chunk, n, 4, 16, req)[0], 0)),
                    ("dd", lambda: (_dd_w(), 0))):
        if name == "dd":
            def _dd_w():
                with req.counting("dd_write"):
                    g = _dd(["if=/dev/zero", f"of={base}/dd.bin", f"bs={chunk}", f"count={n}", "oflag=direct", "conv=fsync"])
                os.unlink(f"{base}/dd.bin"); return g
        g, fs = f()
        res.setdefault(name, []).append(g)
        key = {"raw1": "raw1_write", "raw4": "raw4_write", "tier": "tier_write", "dd": "dd_write"}[name]
        kib = req.kib.get(key, [0])[-1]
        print(f"pair {p} {name}: {g:.2f} GB/s  fsync {fs:.0f} ms  kib {kib:.0f}", flush=True)
for k, v in res.items():
    print(k, f"median {statistics.median(v):.2f}", [round(x, 2) for x in v])
