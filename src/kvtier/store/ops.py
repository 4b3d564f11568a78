"""The store's index requests, one function each: ``(space, holds, msg, lease_ttl) -> reply``.

They mirror :class:`kvtier.index.base.Index` (the client's
:class:`~kvtier.store.index.StoreIndex` is its other half). Keys travel as bytes, entries as
the client's handles. ``match`` and ``is_ready`` lease what they find ready and return its
slots, so that a load the engine decides on that lookup reads bytes nobody could evict, and
could still read them from its mapping if the store died before the pin.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvtier.index.base import ChunkReserve, Entry
from kvtier.store.leases import ClientHolds
from kvtier.store.space import Space

Op = Callable[[Space, ClientHolds, dict[str, Any], float], Any]
# requests a client may queue and send ahead of its next one (``pre``): nobody waits for
# their answer (kvtier.store.index.StoreIndex)
DEFERRABLE = frozenset({"commit", "abort", "discard", "unpin", "touch", "forget"})


def _lease_ready(space: Space, holds: ClientHolds, group: int, keys: list[bytes],
                 ttl: float) -> list[int]:
    deadline = time.monotonic() + ttl
    slots = []
    for k in keys:
        e = space.index.get(group, k)
        assert e is not None
        holds.lease(e, deadline)
        slots.append(e.slot)
    return slots


def match(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    g, keys = int(msg["g"]), [bytes(k) for k in msg["keys"]]
    n = space.index.match(g, keys)
    return [n, _lease_ready(space, holds, g, keys[:n], ttl)]


def is_ready(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    g, key = int(msg["g"]), bytes(msg["key"])
    if not space.index.is_ready(g, key):
        return [False, -1]
    return [True, _lease_ready(space, holds, g, [key], ttl)[0]]


def view(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    """One lookup's round trip: for every group, the slot of each of ``keys`` that is ready
    (-1: not), each ready one leased."""
    keys = [bytes(k) for k in msg["keys"]]
    deadline = time.monotonic() + ttl
    out = []
    for g in range(len(space.index.groups)):
        slots = []
        for k in keys:
            if space.index.is_ready(g, k):
                e = space.index.get(g, k)
                assert e is not None
                holds.lease(e, deadline)
                slots.append(e.slot)
            else:
                slots.append(-1)
        out.append(slots)
    return out


def stored_or_writing(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float
                      ) -> Any:
    """Per group, whether each of ``keys`` has a live entry (ready or being written)."""
    keys = [bytes(k) for k in msg["keys"]]
    return [[space.index.get(g, k) is not None for k in keys]
            for g in range(min(int(msg["n"]), len(space.index.groups)))]


def flush(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    """Nothing: what the client queued ahead of it (``pre``) is the point."""
    return None


def get(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    e = space.index.get(int(msg["g"]), bytes(msg["key"]))
    return None if e is None else [e.slot, e.ready]


def reserve(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    parent = msg.get("parent")
    e = space.index.reserve(int(msg["g"]), bytes(msg["key"]),
                            None if parent is None else bytes(parent))
    if not isinstance(e, Entry):
        return {"drop": e.value}
    if space.tier is not None:
        space.tier.saves += 1  # the burst its demotions leave room for
    return {"h": holds.add_write(e), "slot": e.slot}


def reserve_chunks(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    """One request's saves of one step (:meth:`kvtier.index.base.Index.reserve_chunks`):
    ``chunks`` is ``[[key, parent, [group, ...]], ...]``; the answer has one item per chunk
    answered: ``[[handle, slot], ...]`` (one per group) or the drop's value. It stops after a
    drop of the later chunks (FULL), so nothing is reserved, nor evicted, past it."""
    asked = [ChunkReserve(bytes(k), None if p is None else bytes(p), [int(g) for g in gs])
             for k, p, gs in msg["chunks"]]
    out: list[Any] = []
    for got in space.index.reserve_chunks(asked):
        if not isinstance(got, list):
            out.append(got.value)
            continue
        out.append([[holds.add_write(e), e.slot] for e in got])
        if space.tier is not None:
            space.tier.saves += len(got)  # the burst its demotions leave room for
    return out


def commit(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    e = holds.end_write(int(msg["h"]))
    done = space.index.commit(e)
    if done and space.tier is not None:
        space.tier.note_saved(e)  # the remote tier writes it through
    return done


def abort(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    space.index.abort(holds.end_write(int(msg["h"])))


def pin(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    return holds.pin(int(msg["g"]), [bytes(k) for k in msg["keys"]])


def unpin(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    holds.unpin([int(h) for h in msg["hs"]])


def discard(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    e = holds.handles.get(int(msg["h"]))
    if e is not None:
        space.index.discard(e)


def touch(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    space.index.touch(int(msg["g"]), [bytes(k) for k in msg["keys"]])


def reset(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    if space.tier is not None:
        space.tier.reset()
    return space.index.reset()


def discover(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    """Whether a tier is still finding out which of ``keys`` it holds for request ``req``
    (the lookup defers and asks again; ``forget`` ends the request's state)."""
    if space.tier is None:
        return False
    return space.tier.discovering(holds, str(msg["req"]), [bytes(k) for k in msg["keys"]],
                                  int(msg["num_tokens"]))


def forget(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    if space.tier is not None:
        space.tier.forget_request(holds, str(msg["req"]))


def promote(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    """A lookup's DRAM hit extended from the store's tiers: [job, tokens added, those tokens
    per tier] while the chunks are read into reserved slots (poll ``promoted``), or None."""
    if space.tier is None:
        return None
    return space.tier.promote(holds, [bytes(k) for k in msg["keys"]], int(msg["num_tokens"]),
                              int(msg["hbm_tokens"]))


def promoted(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    """{job: verified whole} of the asked promotions that landed (each answered once)."""
    if space.tier is None:
        return {}
    return space.tier.promoted(holds, [int(j) for j in msg["jobs"]])


def stats(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    s = space.index.stats()
    tiers = {} if space.tier is None else space.tier.stats()
    return {"stored": s.stored, "writing": s.writing, "pinned": s.pinned, "doomed": s.doomed,
            "evictions": s.evictions, "free_slots": s.free_slots,
            "mine": {"writes": len(holds.writes), "pins": sum(holds.pins.values()),
                     "leases": len(holds.leases)},
            "disk": tiers.get("disk"), "tiers": tiers}


def check(space: Space, holds: ClientHolds, msg: dict[str, Any], ttl: float) -> Any:
    space.index.check_invariants()


OPS: dict[str, Op] = {f.__name__: f for f in (match, is_ready, view, get, reserve,
                                               reserve_chunks, commit, abort,
                                               pin, unpin, discard, touch, reset, stats, check,
                                               stored_or_writing, flush, promote, promoted,
                                               discover, forget)}
