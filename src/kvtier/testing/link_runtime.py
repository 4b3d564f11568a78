"""TEST ONLY: a :class:`~kvtier.testing.host_runtime.HostRuntime` whose events tell time on a
simulated clock, with copies that take the time a link of known speed would.

Every stream has a clock in seconds. A copy on a stream starts when the stream's earlier work
ended and lasts ``bytes / (gbps * 1e9)``; waiting for an event moves a stream's clock to the
event's time; an event records its stream's clock, and ``elapsed_time`` is in milliseconds,
as CUDA's. Each stream is a link of its own (the GPU engine copies each direction on one
stream), and kernels and id uploads take no time. So the times the engine measures with
events are exact, and a link estimate built from them can be checked against ``gbps``.
The copies themselves are done at once with memmove, as on :class:`HostRuntime`.
"""

from __future__ import annotations

from typing import Any

from kvtier.gpu.dma import Descriptors
from kvtier.testing.host_runtime import HostRuntime


class ClockStream:
    """A stream's simulated clock (seconds); waits move it forward."""

    cuda_stream = 0

    def __init__(self) -> None:
        self.clock = 0.0

    def wait_event(self, event: ClockEvent) -> None:
        self.clock = max(self.clock, event.time)

    def wait_stream(self, stream: ClockStream) -> None:
        self.clock = max(self.clock, stream.clock)


class ClockEvent:
    """Complete at once; its time is its stream's clock when it was recorded."""

    def __init__(self, runtime: LinkRuntime) -> None:
        self._runtime = runtime
        self.time = 0.0

    def record(self, stream: ClockStream | None = None) -> None:
        self.time = (stream or self._runtime.current()).clock

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: ClockEvent) -> float:
        return (other.time - self.time) * 1e3


class LinkRuntime(HostRuntime):
    """Copies at ``gbps`` (1e9 bytes per second) per stream, on simulated clocks.

    ``copied``: bytes copied so far; ``busy``: seconds of copying so far, over all streams.
    """

    def __init__(self, gbps: float) -> None:
        self.gbps = gbps
        self.compute = ClockStream()
        self.copied = 0
        self.busy = 0.0

    def stream(self, high_priority: bool = False) -> Any:
        return ClockStream()

    def event(self, timing: bool = False) -> Any:
        return ClockEvent(self)

    def current(self) -> Any:
        return self.compute

    def copy(self, desc: Descriptors, stream: Any) -> None:
        super().copy(desc, stream)
        n = int(desc[2].sum())
        seconds = n / (self.gbps * 1e9)
        stream.clock += seconds
        self.copied += n
        self.busy += seconds
