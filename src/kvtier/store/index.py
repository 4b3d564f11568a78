"""The :class:`~kvtier.index.base.Index` of an engine attached to the store.

Every call is one request to the store (:mod:`kvtier.store.ops`), answered before it
returns, within the client's timeout. Contract beyond :class:`~kvtier.index.base.Index`:

- While the store is unreachable the index is *down* and answers as an empty store that
  cannot take writes: ``match`` 0 and ``is_ready`` False (the engine recomputes),
  ``reserve`` :attr:`~kvtier.protocol.SaveDrop.FULL`, ``commit`` False; ``unpin``, ``abort``,
  ``discard`` and ``touch`` do nothing (the store released all of it when the connection
  closed). It never waits for the store beyond one timeout. It attaches again only in
  :meth:`StoreIndex.poll`, at most every ``retry_seconds`` (logged once per outage and once
  per return), which the engine calls once per step after the step's plan is built: every
  request of one step belongs to one epoch, the plan's (``epoch``, what the workers follow,
  :class:`kvtier.store.attach.StoreMapping`).
- ``pin`` of a chunk the last lookup leased, while the store is down, still returns its
  slot: the lease kept it from eviction and a dead store writes nothing, so a load decided
  before the crash reads the right bytes from the old mapping.
- Each attach is an *epoch*; an entry handed out in one epoch is inert in later ones
  (its handle belongs to a closed connection).
- Requests whose answer nobody waits for (``unpin``, ``abort``, ``discard``, ``touch`` and
  :meth:`~kvtier.index.base.Index.commit_without_answer`) cost no round trip of their own:
  they are queued and go out, in order, ahead of the next request on the connection (the
  store runs them first, :data:`kvtier.store.ops.DEFERRABLE`), or at the latest with
  :meth:`StoreIndex.flush`, which the scheduler calls at the end of each worker report (its
  commits and unpins: one round trip), and :meth:`StoreIndex.poll`, once per step. Every answer the engine reads therefore reflects
  them; other engines see them at most one step later. Queued requests of a lost connection
  are dropped (the store released everything the connection held).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvtier.geometry import Geometry
from kvtier.index.base import ChunkReserve, Entry, Index, IndexStats
from kvtier.index.memory import GroupIndexSpec
from kvtier.protocol import SaveDrop
from kvtier.slab import SlabLayout
from kvtier.store.client import Attachment, StoreClient, StoreDown, StoreRefused
from kvtier.store.pool import pool_identity
from kvtier.store.space import encode_geometry, encode_layout

logger = logging.getLogger("kvtier.store")
_MAX_LEASED = 1 << 16  # remembered leased slots (for pins while the store is down)
_READS = frozenset({"view", "is_ready", "match", "get", "stats", "check", "flush",
                    "stored_or_writing"})


class StoreOpFailed(StoreDown):
    """A request failed in the store (it answered an error, the connection stays): every
    caller answers as it does while the store is down (a miss, a dropped save, a failed
    commit), without dropping the connection."""


class StoreEntry(Entry):
    __slots__ = ("epoch", "handle")

    def __init__(self, group: int, key: bytes, slot: int, handle: int, epoch: int) -> None:
        super().__init__(group, key, slot, None)
        self.handle = handle
        self.epoch = epoch


def attach_spec(namespace: bytes, specs: Sequence[GroupIndexSpec], layout: SlabLayout,
                geometry: Geometry | None = None,
                checksums: list[list[object]] | None = None) -> dict[str, Any]:
    """What an engine attaches with: its namespace, its slab layout (the arena's size, slot
    counts, and where slots and checksum tables lie) and its groups' index specs (the
    scheduler's, see :func:`geometry_specs`); ``geometry``: what the store's disk tier needs
    to find a namespace's hits (without it the namespace gets no disk tier); ``checksums``
    (a worker with ``verify_checksums``: :func:`kvtier.transfer.checksum_spec`): how its slots
    are checksummed, so the store checks each slot before writing it to a tier."""
    spec = {"namespace": namespace, "arena_bytes": layout.total_bytes,
            "slots": [c.num_slots for c in layout.classes],
            "groups": [[s.slot_class, s.chained, s.boundary_state] for s in specs],
            "layout": encode_layout(layout)}
    if geometry is not None:
        spec["geometry"] = encode_geometry(geometry)
    if checksums is not None:
        spec["checksums"] = checksums
    return spec


def geometry_specs(geometry: Geometry) -> list[GroupIndexSpec]:
    """The index specs the scheduler builds for ``geometry`` (policies aside: the store's
    own), for a worker's attach, which must match its scheduler's."""
    full, state = set(geometry.full_groups), set(geometry.state_groups)
    return [GroupIndexSpec(slot_class=c, policy=None, chained=g in full,  # type: ignore[arg-type]
                           boundary_state=g in state)
            for g, c in enumerate(geometry.slot_classes)]


class StoreIndex(Index):
    def __init__(self, client: StoreClient, spec: dict[str, Any], retry_seconds: float = 5.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_attach: Callable[[Attachment, int], None] | None = None) -> None:
        self.client = client
        self.spec = spec
        self.retry_seconds = retry_seconds
        self._clock = clock
        self.on_attach = on_attach  # (attachment, epoch): the new pool (descriptor is yours)
        self.epoch = 0
        self.attachment: Attachment | None = None
        self.pool: tuple[int, int] | None = None  # pool_identity of the epoch's pool
        self._next_try = 0.0
        self._leased: dict[tuple[int, bytes], int] = {}
        self.outages = 0  # times the store was found absent or lost
        self.failed_requests = 0  # requests the store answered as failed (StoreOpFailed)
        self._logged_down = False
        self._view_keys: list[bytes] = []
        self._view_slots: list[list[int]] = []
        self._view_pos: dict[bytes, int] = {}
        self._view_until = 0.0
        self._deferred: list[dict[str, Any]] = []  # requests that go out with the next one
        self.poll()

    # -- the connection ---------------------------------------------------------------------
    def poll(self) -> bool:
        """Attach again if down and ``retry_seconds`` passed; whether attached now."""
        self._drop_view()
        if self.client.connected:
            self.flush()
            return self.client.connected
        now = self._clock()
        if now < self._next_try:
            return False
        self._next_try = now + self.retry_seconds
        try:
            att = self.client.connect(self.spec)
        except (StoreDown, StoreRefused) as e:
            if not self._logged_down:
                self._logged_down = True
                self.outages += 1
                logger.warning("kvtier store unavailable: kvtier serves from recompute and "
                               "retries every %.1fs (%s)", self.retry_seconds, e)
            return False
        self.epoch += 1
        self.attachment = att
        self.pool = pool_identity(att.pool_fd)  # what this epoch's plans name (StepPlan)
        self._leased.clear()
        self._deferred.clear()
        self._logged_down = False
        logger.info("kvtier attached to the store %s (epoch %d)", self.client.path, self.epoch)
        if self.on_attach is not None:
            self.on_attach(att, self.epoch)
        else:
            os.close(att.pool_fd)  # the scheduler half maps nothing
        return True

    def _call(self, op: str, **args: Any) -> Any:
        if op not in _READS:
            self._drop_view()
        if not self.client.connected:
            self._deferred.clear()
            raise StoreDown("down")
        if self._deferred:
            args["pre"], self._deferred = self._deferred, []
        try:
            return self.client.call(op, **args)
        except StoreRefused as e:
            if not e.failed:
                raise
            self._op_failed(op, e)
            raise StoreOpFailed(str(e)) from None
        except StoreDown as e:
            self.outages += 1
            self._logged_down = True
            self._next_try = self._clock() + self.retry_seconds
            logger.warning("kvtier store connection lost: recomputing until it returns, "
                           "retrying every %.1fs (%s)", self.retry_seconds, e)
            raise

    def _op_failed(self, op: str, e: StoreRefused) -> None:
        self.failed_requests += 1
        n = self.failed_requests
        if n <= 20 or n % 100 == 0:
            logger.warning("kvtier store: request %r failed in the store (%d so far): "
                           "answered as a miss or a failed write: %s", op, n, e)

    def _defer(self, op: str, **args: Any) -> None:
        """Queue a request whose answer nobody waits for (module docstring)."""
        if op != "touch":
            self._drop_view()  # a commit, abort or discard changes what is ready
        self._deferred.append({"op": op, **args})

    def flush(self) -> None:
        """Send the queued requests now (one round trip; nothing if none is queued)."""
        if self._deferred and self.client.connected:
            with contextlib.suppress(StoreDown):
                self._call("flush")

    @property
    def up(self) -> bool:
        return self.client.connected

    def _live(self, e: Entry) -> bool:
        return isinstance(e, StoreEntry) and e.epoch == self.epoch and self.client.connected

    def _remember(self, group: int, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        if len(self._leased) > _MAX_LEASED:
            self._leased.clear()
        for k, s in zip(keys, slots):
            self._leased[(group, k)] = s

    # -- lookups ----------------------------------------------------------------------------
    # One lookup asks ``match`` and ``is_ready`` of several groups over one request's keys:
    # the first ``match`` fetches every group's answer for those keys in one round trip (the
    # store leases what is ready) and the rest of the lookup reads that view. The view is
    # dropped by any write, pin or poll, and after half a lease TTL: while it lives, what it
    # says is ready is leased, so still ready.
    def match(self, group: int, keys: Sequence[bytes]) -> int:
        slots = self._view_of(keys)
        if slots is None:
            return 0
        n = 0
        for s in slots[group][: len(keys)]:
            if s < 0:
                break
            n += 1
        return n

    def is_ready(self, group: int, key: bytes) -> bool:
        pos = self._view_pos.get(key) if self._view_fresh() else None
        if pos is not None:
            return self._view_slots[group][pos] >= 0
        try:
            ready, slot = self._call("is_ready", g=group, key=key)
        except StoreDown:
            return False
        if ready:
            self._remember(group, [key], [slot])
        return bool(ready)

    def _view_fresh(self) -> bool:
        return self._clock() < self._view_until

    def _view_of(self, keys: Sequence[bytes]) -> list[list[int]] | None:
        cached = self._view_keys
        if (self._view_fresh() and len(keys) <= len(cached)
                and all(a == b for a, b in zip(keys, cached))):
            return self._view_slots
        try:
            slots = self._call("view", keys=list(keys))
        except StoreDown:
            return None
        ttl = self.attachment.lease_ttl if self.attachment is not None else 0.0
        self._view_keys, self._view_slots = list(keys), slots
        self._view_pos = {k: i for i, k in enumerate(keys)}
        self._view_until = self._clock() + ttl / 2
        for g, per in enumerate(slots):
            self._remember(g, [k for k, s in zip(keys, per) if s >= 0],
                           [s for s in per if s >= 0])
        return slots

    def _drop_view(self) -> None:
        self._view_until = 0.0

    def get(self, group: int, key: bytes) -> Entry | None:
        try:
            r = self._call("get", g=group, key=key)
        except StoreDown:
            return None
        return None if r is None else StoreEntry(group, key, int(r[0]), 0, -1)

    def stored_or_writing(self, num_groups: int, keys: Sequence[bytes]) -> list[list[bool]]:
        """One round trip; while down, nothing is (every save then drops at its reserve)."""
        try:
            return [list(map(bool, per)) for per in self._call(
                "stored_or_writing", n=num_groups, keys=list(keys))]
        except StoreDown:
            return [[False] * len(keys) for _ in range(num_groups)]

    # -- writes -----------------------------------------------------------------------------
    def reserve(self, group: int, key: bytes, parent_key: bytes | None) -> Entry | SaveDrop:
        try:
            r = self._call("reserve", g=group, key=key, parent=parent_key)
        except StoreDown:
            return SaveDrop.FULL
        if "drop" in r:
            return SaveDrop(r["drop"])
        return StoreEntry(group, key, int(r["slot"]), int(r["h"]), self.epoch)

    def reserve_chunks(self, chunks: Sequence[ChunkReserve]) -> list[list[Entry] | SaveDrop]:
        """One round trip (the store stops after a FULL, as the contract says); while down,
        or when the request fails in the store, the first chunk is FULL and nothing else."""
        if not chunks:
            return []
        try:
            r = self._call("reserve_chunks",
                           chunks=[[c.key, c.parent_key, list(c.groups)] for c in chunks])
        except StoreDown:
            return [SaveDrop.FULL]
        out: list[list[Entry] | SaveDrop] = []
        for c, got in zip(chunks, r):
            out.append(SaveDrop(got) if isinstance(got, str) else
                       [StoreEntry(g, c.key, int(slot), int(h), self.epoch)
                        for g, (h, slot) in zip(c.groups, got)])
        return out

    def commit(self, entry: Entry) -> bool:
        if not self._live(entry):
            return False
        try:
            return bool(self._call("commit", h=entry.handle))  # type: ignore[attr-defined]
        except StoreDown:
            return False

    def commit_without_answer(self, entry: Entry) -> None:
        self._on_entry("commit", entry)

    def abort(self, entry: Entry) -> None:
        self._on_entry("abort", entry)

    def discard(self, entry: Entry) -> None:
        self._on_entry("discard", entry)

    def _on_entry(self, op: str, entry: Entry) -> None:
        if self._live(entry):
            self._defer(op, h=entry.handle)  # type: ignore[attr-defined]

    # -- pins -------------------------------------------------------------------------------
    def pin(self, group: int, keys: Sequence[bytes]) -> list[Entry]:
        try:
            pinned = self._call("pin", g=group, keys=list(keys))
        except (StoreRefused, StoreOpFailed) as e:  # the load is declined: recompute
            raise KeyError(str(e)) from None
        except StoreDown:
            return self._pin_leased(group, keys)
        for k in keys:
            self._leased.pop((group, k), None)
        return [StoreEntry(group, k, int(s), int(h), self.epoch)
                for k, (h, s) in zip(keys, pinned)]

    def _pin_leased(self, group: int, keys: Sequence[bytes]) -> list[Entry]:
        missing = [k for k in keys if (group, k) not in self._leased]
        if missing:
            raise KeyError(f"{len(missing)} chunk(s) of group {group} were never leased")
        return [StoreEntry(group, k, self._leased[(group, k)], 0, -1) for k in keys]

    def unpin(self, entries: Sequence[Entry]) -> None:
        live = [e.handle for e in entries if self._live(e)]  # type: ignore[attr-defined]
        if live:
            self._defer("unpin", hs=live)

    def touch(self, group: int, keys: Sequence[bytes]) -> None:
        if self.client.connected:
            self._defer("touch", g=group, keys=list(keys))

    def reset(self) -> int:
        try:
            return int(self._call("reset"))
        except StoreDown:
            return 0

    # -- the store's disk (kvtier.store.tiers) ----------------------------------------------
    @property
    def has_lower(self) -> bool:
        """The store has tiers below the pool for this namespace (as of the current attach)."""
        return self.up and self.attachment is not None and self.attachment.lower

    @property
    def tier_names(self) -> tuple[str, ...]:
        """The store's tiers below the pool for this namespace, top first."""
        return self.attachment.tiers if self.has_lower else ()  # type: ignore[union-attr]

    @property
    def discovers(self) -> bool:
        """A tier of the store finds out what it holds by asking (the remote server)."""
        return self.has_lower and self.attachment.discovers  # type: ignore[union-attr]

    def discover(self, req_id: str, keys: Sequence[bytes], num_tokens: int) -> bool:
        """Whether the store's tiers are still finding out which of ``keys`` they hold for
        this request (ask again next step); False when down. End with :meth:`forget`."""
        try:
            return bool(self._call("discover", req=req_id, keys=list(keys),
                                   num_tokens=num_tokens))
        except StoreDown:
            return False

    def forget(self, req_id: str) -> None:
        """The request is over: the store drops what its discovery kept (no round trip)."""
        if self.client.connected:
            self._deferred.append({"op": "forget", "req": req_id})

    def promote(self, keys: Sequence[bytes], num_tokens: int,
                hbm_tokens: int) -> tuple[int, int, dict[str, int]] | None:
        """Ask the store to promote what its tiers add to this lookup's DRAM hit: (the
        store's job, tokens it adds, those tokens per tier), or None (nothing to add, or
        the store is down)."""
        try:
            r = self._call("promote", keys=list(keys), num_tokens=num_tokens,
                           hbm_tokens=hbm_tokens)
        except StoreDown:
            return None
        if r is None:
            return None
        by = {str(k): int(v) for k, v in r[2].items()} if len(r) > 2 else {"disk": int(r[1])}
        return int(r[0]), int(r[1]), by

    def promoted(self, jobs: Sequence[int]) -> dict[int, bool] | None:
        """Of this epoch's promotion ``jobs``, those that landed (whether each verified
        whole); None if the store is down (they are lost with its epoch)."""
        try:
            r = self._call("promoted", jobs=list(jobs))
        except StoreDown:
            return None
        return {int(j): bool(ok) for j, ok in r.items()}

    def disk_stats(self) -> dict[str, Any] | None:
        """The namespace's disk tier (stored chunks per group, capacity, counters), or None."""
        return self.tier_stats().get("disk")

    def tier_stats(self) -> dict[str, dict[str, Any]]:
        """Per tier of the store below the pool (``disk``, ``remote``): stored chunks per
        group, capacity, counters; {} when down or without tiers."""
        try:
            r = self._call("stats")
        except StoreDown:
            return {}
        return dict(r.get("tiers") or ({"disk": r["disk"]} if r.get("disk") else {}))

    # -- accounting -------------------------------------------------------------------------
    def stats(self) -> IndexStats:
        """The namespace's stats; ``pinned`` counts only this engine's hard pins (what its
        scheduler's drained check compares with its own count)."""
        try:
            r = self._call("stats")
        except StoreDown:
            return IndexStats()
        return IndexStats(stored=r["stored"], writing=r["writing"], pinned=r["mine"]["pins"],
                          doomed=r["doomed"], evictions=r["evictions"],
                          free_slots=r["free_slots"])

    @property
    def evictions(self) -> int:
        """Evictions in this namespace's arena so far (every engine's), as
        ``MemoryIndex.evictions`` (the connector's metrics read it); 0 while down."""
        return self.stats().evictions

    def holds(self) -> dict[str, int]:
        """What this engine holds in the store: writes, hard pins, leases."""
        return dict(self._call("stats")["mine"])

    def check_invariants(self) -> None:
        """The store checks its index of this namespace (AssertionError if inconsistent)."""
        try:
            self._call("check")
        except (StoreRefused, StoreOpFailed) as e:
            raise AssertionError(str(e)) from None
        except StoreDown:
            pass
