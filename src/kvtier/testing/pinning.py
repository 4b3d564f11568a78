"""TEST ONLY: a :class:`kvtier.slab.Pinner` that keeps the ranges registered with it, so the
host side of pinning (which ranges, when they are given back, on which thread) is checked
without a GPU; the CUDA side is in ``tests/test_gpu_cuda.py``."""

from __future__ import annotations

import threading


class RecordingPinner:
    """``pinned``: start address -> length of every range registered and not yet
    unregistered. ``refuse``: the index of a :meth:`register` call that fails as CUDA would.
    ``gate``: while cleared, :meth:`register` waits for it (a pinning that takes long, as
    64 GiB does), up to ``gate_timeout`` seconds, then fails rather than hang a test."""

    def __init__(self, refuse: int = -1, gate_timeout: float = 30.0) -> None:
        self.refuse = refuse
        self.pinned: dict[int, int] = {}
        self.calls = 0  # register calls, ever
        self.released: list[int] = []  # unregistered starts, in order
        self.threads: set[str] = set()  # names of the threads that registered
        self.gate = threading.Event()
        self.gate.set()
        self.gate_timeout = gate_timeout
        self._lock = threading.Lock()

    def register(self, ptr: int, length: int) -> None:
        if not self.gate.wait(self.gate_timeout):
            raise RuntimeError("pinning held past the test's timeout")
        with self._lock:
            self.calls += 1
            self.threads.add(threading.current_thread().name)
            if self.calls - 1 == self.refuse:
                raise RuntimeError("cudaError 2")
            if any(p < ptr + length and ptr < p + n for p, n in self.pinned.items()):
                raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")  # as CUDA says
            self.pinned[ptr] = length

    def unregister(self, ptr: int) -> None:
        with self._lock:
            del self.pinned[ptr]  # KeyError: a range never registered (CUDA refuses it too)
            self.released.append(ptr)
