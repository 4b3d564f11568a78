"""Leases and quotas in the node-wide store (issue 18), against a real store process with a
short lease TTL, through real connections (one per engine)."""

from __future__ import annotations

import os
import time

import pytest

from _store import StoreProcess
from kvtier.store.client import StoreClient, StoreRefused

TTL = 0.5
ONE_SLOT = {"arena_bytes": 2 * 2**20, "slots": [1], "groups": [[0, False, False]]}


@pytest.fixture(scope="module")
def store(tmp_path_factory):  # type: ignore[no-untyped-def]
    s = StoreProcess(tmp_path_factory.mktemp("leases"), size="64MiB", lease_ttl=TTL).start()
    yield s
    s.stop()


def _attach(store: StoreProcess, ns: bytes, spec: dict = ONE_SLOT) -> StoreClient:  # type: ignore[type-arg]
    c = StoreClient(store.url)
    os.close(c.connect({"namespace": ns, **spec}).pool_fd)
    return c


def _store_chunk(c: StoreClient, key: bytes) -> dict:  # type: ignore[type-arg]
    r = c.call("reserve", g=0, key=key, parent=None)
    assert "h" in r, r
    assert c.call("commit", h=r["h"]) is True
    return r


def test_a_lookup_lease_protects_until_its_ttl(store: StoreProcess) -> None:
    a, b = _attach(store, b"lease1"), _attach(store, b"lease1")
    _store_chunk(a, b"k1")
    assert b.call("match", g=0, keys=[b"k1"])[0] == 1  # B's lookup leases k1
    assert a.call("reserve", g=0, key=b"k2", parent=None) == {"drop": "no_evictable_slot"}
    time.sleep(TTL * 1.5 + 0.2)  # past the TTL and a sweep
    assert b.call("stats")["mine"]["leases"] == 0
    assert "h" in a.call("reserve", g=0, key=b"k2", parent=None)  # k1 could be evicted
    a.close()
    b.close()


def test_a_load_never_expires_however_long_it_runs(store: StoreProcess) -> None:
    """The seed's crash: a read lease with a TTL expired under a long load. Here the load's
    pin outlives many TTLs, the chunk is never evicted under it, and the load's unpin is
    accepted at the end."""
    a, b = _attach(store, b"lease2"), _attach(store, b"lease2")
    _store_chunk(a, b"k1")
    assert b.call("match", g=0, keys=[b"k1"])[0] == 1
    [(h, _slot)] = b.call("pin", g=0, keys=[b"k1"])  # the lookup became a load
    assert b.call("stats")["mine"] == {"writes": 0, "pins": 1, "leases": 0}
    for _ in range(4):  # 4 TTLs, with sweeps
        time.sleep(TTL)
        assert a.call("reserve", g=0, key=b"k2", parent=None) == {"drop": "no_evictable_slot"}
    b.call("unpin", hs=[h])  # the long load ends: its pin is still there to end
    with pytest.raises(StoreRefused):
        b.call("unpin", hs=[h])  # and only once
    assert "h" in a.call("reserve", g=0, key=b"k2", parent=None)
    a.close()
    b.close()


def test_a_pin_after_the_lease_expired_still_pins_if_the_chunk_is_there(
        store: StoreProcess) -> None:
    a = _attach(store, b"lease3")
    _store_chunk(a, b"k1")
    assert a.call("match", g=0, keys=[b"k1"])[0] == 1
    time.sleep(TTL * 1.5 + 0.2)
    assert len(a.call("pin", g=0, keys=[b"k1"])) == 1
    with pytest.raises(StoreRefused, match="KeyError"):
        a.call("pin", g=0, keys=[b"absent"])
    a.close()


def test_one_namespace_cannot_evict_another_below_its_quota(store: StoreProcess) -> None:
    """Quotas: each namespace's arena is its own (fixed when its first engine attached);
    another namespace filling and churning its arena evicts only inside it."""
    four = {"arena_bytes": 4 * 2**20, "slots": [4], "groups": [[0, False, False]]}
    x, y = _attach(store, b"quota-x", four), _attach(store, b"quota-y", four)
    for i in range(4):
        _store_chunk(x, b"x%d" % i)
    for i in range(40):  # y churns ten times its own capacity
        _store_chunk(y, b"y%d" % i)
    assert x.call("match", g=0, keys=[b"x%d" % i for i in range(4)])[0] == 4
    sx, sy = x.call("stats"), y.call("stats")
    assert sx["stored"] == 4 and sx["evictions"] == 0
    assert sy["stored"] == 4 and sy["evictions"] == 36
    x.close()
    y.close()


def test_an_arena_that_does_not_fit_is_refused_and_idle_ones_make_room(
        store: StoreProcess) -> None:
    big = {"arena_bytes": 40 * 2**20, "slots": [1], "groups": [[0, False, False]]}
    p = _attach(store, b"big-p", big)
    _store_chunk(p, b"p")
    c = StoreClient(store.url)
    with pytest.raises(StoreRefused, match="free for a 40MiB arena"):
        c.connect({"namespace": b"big-q", **big})
    c.close()
    p.close()  # p's namespace is idle now: the next big one takes its room
    time.sleep(0.2)
    q = _attach(store, b"big-q", big)
    _store_chunk(q, b"q")
    q.close()
    p2 = _attach(store, b"big-p-again", {**big, "arena_bytes": 2 * 2**20})
    assert p2.call("match", g=0, keys=[b"p"])[0] == 0
    p2.close()


def test_a_namespace_with_another_layout_is_refused(store: StoreProcess) -> None:
    a = _attach(store, b"layout")
    c = StoreClient(store.url)
    with pytest.raises(StoreRefused, match="another slot layout"):
        c.connect({"namespace": b"layout", **ONE_SLOT, "slots": [2]})
    assert not c.connected  # a refused attach leaves no half-open connection behind
    c.close()
    a.close()
