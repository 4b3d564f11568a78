"""A request that fails inside the store (issue 18): answered as an error, the connection
keeps serving, the engine's index treats it as a miss or a failed write and stays attached.
A real ``kvtier store`` process; the failing requests are ones the store's ops raise on (a
group the namespace does not have)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvtier.index.memory import GroupIndexSpec
from kvtier.slab import SizeClass, SlabLayout
from kvtier.store.client import StoreClient, StoreRefused
from kvtier.store.index import StoreIndex, attach_spec
from kvtier.testing.store_process import StoreProcess

SPEC = {"namespace": b"robust", "arena_bytes": 4 << 20, "slots": [4],
        "groups": [[0, False, False]]}


@pytest.fixture
def store(tmp_path: Path):  # type: ignore[no-untyped-def]
    s = StoreProcess(tmp_path, size="16MiB").start()
    yield s
    s.stop()


def test_a_request_that_fails_in_the_store_is_answered_and_the_connection_serves_on(
        store: StoreProcess) -> None:
    c = StoreClient(store.url)
    c.connect(SPEC)
    h = c.call("reserve", g=0, key=b"a", parent=None)["h"]
    with pytest.raises(StoreRefused) as e:
        c.call("is_ready", g=99, key=b"a")  # no group 99: the op raises in the store
    assert e.value.failed and "IndexError" in str(e.value)
    assert c.connected
    assert c.call("commit", h=h) is True  # the same connection, what it held intact
    assert c.call("match", g=0, keys=[b"a"])[0] == 1
    # a queued request that fails: reported with the request that carried it
    r = c.call("flush", pre=[{"op": "touch", "g": 99, "keys": [b"a"]}])
    assert r is None and c.connected
    assert c.call("stats")["stored"] == 1
    c.close()


def test_the_engines_index_treats_a_failed_request_as_a_miss_and_stays_attached(
        store: StoreProcess) -> None:
    specs = [GroupIndexSpec(slot_class=0, policy=None, chained=True)]  # type: ignore[arg-type]
    layout = SlabLayout((SizeClass("c0", 1 << 20, 1 << 20, 4, 0, 1, 4 << 20),), (4 << 20) + 32, 1)
    index = StoreIndex(StoreClient(store.url), attach_spec(b"robust2", specs, layout))
    try:
        assert index.up
        e = index.reserve(0, b"k", None)
        assert index.commit(e)  # type: ignore[arg-type]
        assert index.is_ready(99, b"k") is False  # failed in the store: a miss
        assert index.failed_requests == 1
        assert index.up and index.outages == 0  # still attached: nothing it held was lost
        assert index.match(0, [b"k"]) == 1
        with pytest.raises(KeyError):
            index.pin(99, [b"k"])  # a failed pin declines the load
        assert index.up and index.failed_requests == 2
        (pinned,) = index.pin(0, [b"k"])
        index.unpin([pinned])
        index.flush()
        assert index.holds() == {"writes": 0, "pins": 0, "leases": 0}  # the pin ended the lease
    finally:
        index.client.close()
