"""CPU per chunk of the tier's write and read passes (process CPU: all threads, user+sys)."""
import os, sys, time, resource
from pathlib import Path
from kvtier.bench.disk import _tier_pass, DeviceRequests
import kvtier.bench.disk as bd

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime, r.ru_stime

root = Path(sys.argv[1]); n = int(sys.argv[2]) if len(sys.argv) > 2 else 256
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
chunk = 2 << 20
req = DeviceRequests(root.parent)
orig = bd._tier_pass
for _ in range(reps):
    # time write and read separately by wrapping the runner's timed via monkeypatching counting
    marks = {}
    class R(DeviceRequests):
        pass
    import contextlib
    @contextlib.contextmanager
    def counting(name, _orig=req.counting):
        u0, s0 = cpu(); t0 = time.perf_counter()
        with _orig(name):
            yield
        u1, s1 = cpu(); marks[name] = ((u1-u0)/n*1e3, (s1-s0)/n*1e3, n*chunk/(time.perf_counter()-t0)/1e9)
    req.counting = counting
    _tier_pass(root, chunk, n, 4, 16, req)  # (write, read[, fsync ms]); the CPU is read around it
    for k, (u, s, g) in marks.items():
        print(f"{k}: user {u:.3f} ms/chunk sys {s:.3f} ms/chunk total {u+s:.3f}  ~{g:.2f} GB/s  kib {req.kib.get(k, [0])[-1]:.0f}")
    req.counting = DeviceRequests.counting.__get__(req)
