"""The eviction-policy interface: the order in which ready, evictable chunks leave.

A policy sees opaque keys and never owns memory. The index tells it when a chunk becomes ready
(``insert``), is hit (``touch``) or leaves for another reason (``remove``), and asks it for a
``victim`` when it needs a slot. Only the index knows whether a key may go right now (pinned,
writing, or the parent of stored chunks); the policy skips keys its ``evictable`` predicate
refuses and keeps them where they are, and gives up after ``scan_limit`` refusals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable

Evictable = Callable[[Hashable], bool]

DEFAULT_SCAN_LIMIT = 100_000


class EvictionPolicy(ABC):
    def __init__(self, capacity: int, scan_limit: int = DEFAULT_SCAN_LIMIT) -> None:
        if capacity <= 0:
            raise ValueError("a policy needs a positive capacity")
        self.capacity = capacity
        self.scan_limit = scan_limit

    @abstractmethod
    def insert(self, key: Hashable, parent: Hashable | None = None) -> None:
        """``key`` became ready. ``parent`` (if listed) is its prefix parent: a policy that
        orders by recency places the child just older than the parent, so leaves go first."""

    @abstractmethod
    def touch(self, key: Hashable) -> None:
        """``key`` was hit. Callers touch a prefix leaf-first, so its root ends up newest."""

    @abstractmethod
    def remove(self, key: Hashable) -> None:
        """``key`` left (evicted by the index, failed, reset); forget it. Unknown keys are ok."""

    @abstractmethod
    def victim(self, evictable: Evictable) -> Hashable | None:
        """Choose, forget and return the next key to evict, or None if none may go."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...
