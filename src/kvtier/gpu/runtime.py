"""What the GPU engine needs of a device: streams, events, pinned memory and DMA.

:class:`Runtime` is the engine's one dependency on the device; :class:`CudaRuntime` is the
production one. Tests pass a stand-in that runs everything at once on CPU tensors
(:class:`kvtier.testing.host_runtime.HostRuntime`), so the engine's batching, validation and
bookkeeping are checked without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch

from kvtier.gpu.dma import Descriptors, Driver


class Runtime(Protocol):
    """Contract: streams run their work in enqueue order; an event recorded on a stream
    completes once everything enqueued on it before completed; ``copy`` enqueues (never
    waits for) the copies of ``desc`` on ``stream``; ``pinned`` returns page-locked host
    memory the copies may use."""

    device: torch.device

    def stream(self, high_priority: bool = False) -> Any: ...

    def event(self, timing: bool = False) -> Any: ...

    def current(self) -> Any: ...

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]: ...

    def copy(self, desc: Descriptors, stream: Any) -> None: ...

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor: ...


class CudaRuntime:
    """Streams, events, pinned memory and DMA of one CUDA device."""

    def __init__(self, device: torch.device, dma: Driver | None = None) -> None:
        self.device = device
        self.driver = dma or Driver()

    def stream(self, high_priority: bool = False) -> Any:
        return torch.cuda.Stream(self.device, priority=-1 if high_priority else 0)

    def event(self, timing: bool = False) -> Any:
        return torch.cuda.Event(enable_timing=timing)

    def current(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def copy(self, desc: Descriptors, stream: Any) -> None:
        self.driver.run(desc, stream.cuda_stream)

    def pinned(self, n: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(n, dtype=dtype, pin_memory=True)
