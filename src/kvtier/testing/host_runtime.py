"""TEST ONLY: a :class:`kvtier.gpu.runtime.Runtime` on CPU tensors, for running
:class:`kvtier.gpu.engine.CudaTransferEngine` without a GPU.

Every copy and kernel runs at once, in enqueue order (kernels through ``TRITON_INTERPRET=1``),
and every event is complete: the engine's batching, validation, bookkeeping and bytes are
checked on CPU (``tests/test_gpu_kernels.py``, ``kvtier bench transfer --smoke``). What it
cannot check is the ordering between streams, which only a real device has; for that,
:class:`kvtier.testing.stream_races.RaceCheckingRuntime` checks every access against the
streams' events.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kvtier.gpu.dma import Descriptors, run_on_host


class HostEvent:
    """Always complete."""

    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class HostStream:
    """Nothing to wait for: work ran when it was enqueued."""

    cuda_stream = 0

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


class HostRuntime:
    """Copies with memmove (:func:`kvtier.gpu.dma.run_on_host`) as they are enqueued."""

    device = torch.device("cpu")

    def stream(self, high_priority: bool = False) -> Any:
        return HostStream()

    def event(self, timing: bool = False) -> Any:
        return HostEvent()

    def current(self) -> Any:
        return HostStream()

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return contextlib.nullcontext()

    def copy(self, desc: Descriptors, stream: Any) -> None:
        run_on_host(desc)

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype)


class FailingCopyRuntime(HostRuntime):
    """A :class:`HostRuntime` whose next ``failures`` copies raise before copying anything, as
    a driver call that fails while a batch is being enqueued would."""

    def __init__(self, failures: int = 1) -> None:
        self.failures = failures

    def copy(self, desc: Descriptors, stream: Any) -> None:
        if self.failures > 0:
            self.failures -= 1
            raise RuntimeError("injected DMA failure")
        super().copy(desc, stream)
