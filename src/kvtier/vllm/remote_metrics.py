"""The remote tier's rows of kvtier's metrics table (:mod:`kvtier.vllm.counters`): where a
restored prefix came from (``remote_hits``), what write-through and discovery did, and the
bytes moved. Every series reads 0 on an engine without the remote tier."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvtier.vllm.counters import COUNTER, GAUGE, SCHEDULER, Metric, Series


def _remote(read: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """Read from the scheduler's remote tier, alone or below the disk (0 without one)."""
    def get(s: Any) -> Any:
        t = s.lower_tier("remote")
        return read(t) if t is not None else 0
    return get


REMOTE_METRICS: tuple[Metric, ...] = (
    Metric("remote_hits", COUNTER, SCHEDULER,
           "Loads of prefixes promoted from the remote tier into DRAM for them (restored "
           "from the shared store, perhaps written by another engine).",
           series=(Series("remote_hits", "", _remote(lambda t: t.stats.hits)),)),
    Metric("remote_hit_tokens", COUNTER, SCHEDULER,
           "Tokens of those loads the remote tier added to what DRAM held.",
           series=(Series("remote_hit_tokens", "", _remote(lambda t: t.stats.hit_tokens)),)),
    Metric("remote_chunks", COUNTER, SCHEDULER,
           "Chunks written through to the remote tier, not copied (budget, a missing parent, "
           "a failed or refused write), found there by lookups (written by another engine or "
           "an earlier run), and promoted from it into DRAM.", label="event",
           series=(Series("remote_written_through", "written_through",
                          _remote(lambda t: t.remote.written_through)),
                   Series("remote_write_through_dropped", "dropped",
                          _remote(lambda t: t.remote.write_through_dropped)),
                   Series("remote_discovered", "discovered",
                          _remote(lambda t: t.remote.discovered)),
                   Series("remote_promoted", "promoted",
                          _remote(lambda t: t.stats.promotions)))),
    Metric("remote_lookups", COUNTER, SCHEDULER,
           "Lookups that asked the remote tier what it holds, by outcome (failed: the server "
           "did not answer or the breaker was open; expired: the request went on before the "
           "answer).", label="outcome",
           series=(Series("remote_queries", "asked", _remote(lambda t: t.remote.queries)),
                   Series("remote_queries_failed", "failed",
                          _remote(lambda t: t.remote.queries_failed)),
                   Series("remote_queries_expired", "expired",
                          _remote(lambda t: t.remote.queries_expired)))),
    Metric("remote_bytes", COUNTER, SCHEDULER,
           "Bytes read from (promotions) and written to the remote tier, summed over ranks.",
           label="direction",
           series=(Series("remote_bytes_read", "read", _remote(lambda t: t.stats.bytes_read)),
                   Series("remote_bytes_written", "write",
                          _remote(lambda t: t.stats.bytes_written)))),
    Metric("remote_checksum_failures", COUNTER, SCHEDULER,
           "Remote chunks whose bytes did not verify (damaged, partial, evicted in part): "
           "misses.",
           series=(Series("remote_checksum_failures", "",
                          _remote(lambda t: t.stats.checksum_failures)),)),
    Metric("remote_declined_slower", COUNTER, SCHEDULER,
           "Promotions that left the remote tier out because reading it would be slower "
           "than recomputing (below a disk tier, the disk's part is still promoted).",
           series=(Series("remote_declined_slower", "",
                          _remote(lambda t: t.stats.declined_slower)),)),
    Metric("remote_chunks_known", GAUGE, SCHEDULER,
           "Chunks of the remote tier this engine's catalog knows of (all groups).",
           series=(Series("gauge_remote_chunks_known", "", _remote(
               lambda t: sum(t.catalog.stored(g) for g in t.geometry.full_groups))),)),
)
