"""What a shared remote tier holds that this engine did not write: a lookup asks, the
answer comes from a thread of the scheduler process (one pipelined EXISTS per shard), and
the lookup defers meanwhile within the tier's bound (never a remote call on the step loop).

Another engine's chunks are unknown to this engine's catalog until a lookup finds them here;
then they are registered in the catalog and promoted like any chunk of the tier."""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvtier.log import get_logger
from kvtier.tiers.remote import RedisChunkStore

logger = get_logger("tiers")


@dataclass
class Query:
    """Which of ``keys`` (a request's chunk keys, in order) every shard holds, per group."""

    groups: Sequence[int]
    keys: Sequence[bytes]
    present: dict[int, list[bool]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    failed: bool = False


class RemoteDirectory:
    """Answers :class:`Query` s on its own thread; at most ``max_queued`` wait (past it a
    query is refused: :meth:`ask` returns None and the lookup goes on without the tier)."""

    def __init__(self, shards: Sequence[RedisChunkStore], max_queued: int = 64) -> None:
        self.shards = list(shards)
        self._queue: queue.Queue[Query | None] = queue.Queue(maxsize=max_queued)
        self.failed = 0  # queries that failed (server down, breaker open)
        self._thread = threading.Thread(target=self._loop, name="kvtier-remote-dir",
                                        daemon=True)
        self._thread.start()

    def ask(self, groups: Sequence[int], keys: Sequence[bytes]) -> Query | None:
        q = Query(groups, keys)
        try:
            self._queue.put_nowait(q)
        except queue.Full:
            return None
        return q

    def _loop(self) -> None:
        while True:
            q = self._queue.get()
            if q is None:
                return
            try:
                for g in q.groups:
                    have = [True] * len(q.keys)
                    for store in self.shards:
                        have = [a and b for a, b in zip(have, store.present(g, q.keys))]
                    q.present[g] = have
            except Exception as e:  # a miss: the lookup goes on with what DRAM holds
                q.failed = True
                self.failed += 1
                if self.failed <= 20 or self.failed % 100 == 0:
                    logger.warning("kvtier remote tier: lookup failed (%d so far): %s",
                                   self.failed, e)
            q.done.set()

    def close(self) -> None:
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=1)
        self._thread.join(timeout=5)
        for s in self.shards:
            s.close()
