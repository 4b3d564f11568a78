"""The scheduler half's side of the shared remote tier: what :class:`TierScheduler` does for
the disk (promotion before a promise, demotion of what eviction would lose), plus

- **write-through**: every chunk a save commits to DRAM is copied to the remote tier in the
  next step's plan (its DRAM slot pinned until every rank wrote it), so another engine can
  restore it while this one still holds it, and after this one restarts. Measured against
  on-eviction only (tools/bench_remote.py): see docs/notes/remote-tier.md;
- **discovery**: a lookup whose prefix the catalog does not cover asks the server
  (:class:`~kvtier.tiers.remote_directory.RemoteDirectory`, off the step loop) and defers
  within the scheduler's preparation bound (``prepare_timeout_ms`` / ``prepare_max_steps``,
  :mod:`kvtier.prepare`); the chunks found are registered in
  the catalog and promoted like any other.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvtier.index.base import Entry
from kvtier.tiers.remote_directory import Query, RemoteDirectory
from kvtier.tiers.schedule import TierScheduler, _TierJobState
from kvtier.tiers.seam import TierJob, TierJobKind, TierOp, TierPlan

QUERY_WAIT_S = 0.002
"""Longest a deferred lookup gives the directory's thread (as the disk tier's collect does)."""

MAX_QUERY_CHUNKS = 256
"""Chunks of one request a discovery asks about (its prefix; a longer prompt asks for these)."""


@dataclass
class RemoteStats:
    written_through: int = 0  # chunks committed to the remote tier by write-through
    write_through_dropped: int = 0  # chunks not copied (budget, a missing parent, failures)
    discovered: int = 0  # chunks another engine wrote, found by a lookup
    queries: int = 0
    queries_failed: int = 0
    queries_expired: int = 0  # lookups that went on before the server answered


@dataclass
class _Asked:
    query: Query | None
    since: float
    registered: bool = False


class RemoteTierScheduler(TierScheduler):
    discovers = True  # other engines' chunks are found by asking the server

    def __init__(self, *args: object, directory: RemoteDirectory | None = None,
                 query_wait_s: float = QUERY_WAIT_S, **kw: object) -> None:
        """``query_wait_s``: how long a deferred lookup waits for the directory's answer
        (0 in the node-wide store, which answers under its lock: the next lookup asks)."""
        super().__init__(*args, **kw)  # type: ignore[arg-type]
        self.directory = directory
        self.query_wait_s = query_wait_s
        self.remote = RemoteStats()
        self._through: list[Entry] = []  # DRAM chunks committed, pinned, to copy
        self._through_jobs: set[int] = set()
        self._asked: dict[str, _Asked] = {}

    # -- write-through ----------------------------------------------------------------------
    def note_saved(self, entry: Entry) -> None:
        if entry.group in self.geometry.full_groups and not self.catalog.index.get(
                entry.group, entry.key):
            self._through.extend(self.dram.pin(entry.group, [entry.key]))

    def take_plan(self, saves: int = 0) -> TierPlan | None:
        self._plan_write_through()
        return super().take_plan(saves)

    def _plan_write_through(self) -> None:
        todo, self._through = self._through, []
        ops: list[TierOp] = []
        reserved: list[Entry] = []
        pinned: list[Entry] = []
        budget = self.config.disk_max_pending_chunks - self._pending_chunks
        progress = True
        while todo and progress:  # parents first: a child's parent may come later in todo
            progress, later = False, []
            for e in todo:
                parent = e.parent.key if e.parent is not None else None
                r = self.catalog.reserve(e.group, e.key, parent) if len(ops) < budget else None
                if isinstance(r, Entry):
                    ops.append(TierOp(e.group, e.slot, e.key, parent))
                    reserved.append(r)
                    pinned.append(e)
                    progress = True
                elif r is None or self.catalog.index.get(e.group, e.key) is None:
                    later.append(e)
                else:
                    self.dram.unpin([e])  # stored there already
            todo = later
        self.remote.write_through_dropped += len(todo)
        self.dram.unpin(todo)
        if ops:
            job = TierJob(next(self._job_ids), TierJobKind.DEMOTE, ops)
            self.jobs[job.job_id] = _TierJobState(job, reserved, pinned)
            self._through_jobs.add(job.job_id)
            self._pending_chunks += len(ops)
            self._queued.append(job)

    def _finish_demotion(self, js: _TierJobState) -> None:
        if js.job.job_id not in self._through_jobs:
            return super()._finish_demotion(js)
        self._through_jobs.discard(js.job.job_id)
        for e in reversed(js.catalog_entries) if js.failed else js.catalog_entries:
            if js.failed:
                self.catalog.index.abort(e)
            elif self.catalog.index.commit(e):
                self.remote.written_through += 1
        if js.failed:
            self.remote.write_through_dropped += len(js.job.ops)
            self.stats.demotion_jobs_failed += 1
        self.dram.unpin(js.dram_entries)
        return None

    # -- discovery --------------------------------------------------------------------------
    def discovering(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> bool:
        """Ask the directory once per request which of its chunks other engines stored (when
        the catalog lacks some); defer until the answer is registered. Past the scheduler's
        preparation bound the lookup goes on with what DRAM holds (and this query, if it
        answers later, still registers what it found)."""
        asked = self._asked.get(req_id)
        if asked is not None:
            if asked.registered or asked.query is None:
                return False
            # an engine spinning through empty steps holds the GIL the answering thread
            # needs: give it up to QUERY_WAIT_S, only while a lookup waits for it
            if not asked.query.done.wait(self.query_wait_s):
                return True
            self._register(asked.query)
            asked.registered = True
            return False
        if self.directory is None:
            return False
        n = min(num_tokens // self.geometry.chunk_tokens, len(keys), MAX_QUERY_CHUNKS)
        groups = list(self.geometry.full_groups)
        if n == 0 or all(self.catalog.index.match(g, keys[:n]) == n for g in groups):
            return False
        query = self.directory.ask(groups, list(keys[:n]))
        self._asked[req_id] = _Asked(query, time.monotonic(), registered=query is None)
        if query is None:
            return False
        self.remote.queries += 1
        return True

    def _register(self, query: Query) -> None:
        """Enter the chunks every shard holds, a prefix per group, in the catalog."""
        if query.failed:
            self.remote.queries_failed += 1
            return
        for g, have in query.present.items():
            parent: bytes | None = None
            for key, there in zip(query.keys, have):
                if not there:
                    break
                if self.catalog.index.get(g, key) is None:
                    e = self.catalog.reserve(g, key, parent)
                    if not isinstance(e, Entry):
                        break
                    self.catalog.index.commit(e)
                    self.remote.discovered += 1
                parent = key

    def forget_request(self, req_id: str) -> None:
        asked = self._asked.pop(req_id, None)
        if asked is not None and asked.query is not None and not asked.registered:
            self.remote.queries_expired += 1  # the request went on before the answer

    def has_pending_work(self) -> bool:
        return bool(self._through) or super().has_pending_work()
