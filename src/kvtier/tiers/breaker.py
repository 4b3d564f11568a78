"""A circuit breaker for calls to a remote server: after ``failures`` consecutive failures
(a timeout, a refused or reset connection) it opens, and for ``cooldown_s`` every call is
refused at once (a miss, a dropped write) instead of waiting on a dead or stopped server;
then one call goes through as a probe: its success closes the breaker, its failure opens it
for another cooldown. Thread-safe (the worker's I/O thread and the scheduler's lookups)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from enum import Enum


class BreakerState(str, Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerOpen(Exception):
    """The breaker refused the call without trying it."""


class CircuitBreaker:
    def __init__(self, failures: int, cooldown_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.failures = failures
        self.cooldown_s = cooldown_s
        self.clock = clock
        self._lock = threading.Lock()
        self._consecutive = 0
        self._opened_at: float | None = None
        self._probing = False
        self.opened = 0  # times the breaker opened, ever
        self.refused = 0  # calls refused while open

    @property
    def state(self) -> BreakerState:
        with self._lock:
            return self._state()

    def _state(self) -> BreakerState:
        if self._opened_at is None:
            return BreakerState.CLOSED
        if self.clock() - self._opened_at >= self.cooldown_s:
            return BreakerState.HALF_OPEN
        return BreakerState.OPEN

    def admit(self) -> None:
        """Raise :class:`BreakerOpen` unless the call may go to the server now."""
        with self._lock:
            state = self._state()
            if state is BreakerState.CLOSED:
                return
            if state is BreakerState.HALF_OPEN and not self._probing:
                self._probing = True  # this call is the probe; others wait for its answer
                return
            self.refused += 1
        raise BreakerOpen("remote tier unavailable (circuit breaker open)")

    def succeeded(self) -> None:
        with self._lock:
            self._consecutive = 0
            self._opened_at = None
            self._probing = False

    def failed(self) -> None:
        with self._lock:
            self._consecutive += 1
            if self._probing or self._consecutive >= self.failures:
                if self._opened_at is None or self._probing:
                    self.opened += 1
                self._opened_at = self.clock()
            self._probing = False
