"""Eviction policies: recency, leaf-first order, scan resistance, admission."""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import example, given, settings

from _tools import load_tool
from kvtier.config import KvtierConfig
from kvtier.index.base import Entry
from kvtier.index.memory import GroupIndexSpec, MemoryIndex
from kvtier.policy import POLICIES, SecondSight, make_admission, make_policy
from kvtier.policy.base import EvictionPolicy
from kvtier.policy.slru import SLRUPolicy
from kvtier.slab import SlotAllocator


def always(_: object) -> bool:
    return True


def fill_with_eviction(p: EvictionPolicy, keys: list[str]) -> list[str]:
    """Insert keys one by one into a full policy, evicting one per insert; return the evicted."""
    evicted = []
    for k in keys:
        if len(p) >= p.capacity:
            v = p.victim(always)
            assert v is not None
            evicted.append(v)
        p.insert(k)
    return evicted


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_victims_respect_the_evictable_predicate(name: str) -> None:
    p = make_policy(name, 4)
    for k in "abcd":
        p.insert(k)
    assert p.victim(lambda k: k == "c") == "c"
    assert "c" not in p and len(p) == 3
    assert p.victim(lambda k: False) is None
    assert len(p) == 3  # refused keys stay


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_remove_forgets_and_unknown_keys_are_fine(name: str) -> None:
    p = make_policy(name, 4)
    p.insert("a")
    p.remove("a")
    p.remove("never-seen")
    p.touch("never-seen")
    assert len(p) == 0 and p.victim(always) is None


def test_lru_evicts_least_recent_and_touch_refreshes() -> None:
    p = make_policy("lru", 3)
    for k in "abc":
        p.insert(k)
    p.touch("a")
    assert p.victim(always) == "b"
    assert p.victim(always) == "c"
    assert p.victim(always) == "a"


@pytest.mark.parametrize("name", ["lru", "slru"])
def test_a_child_is_placed_just_older_than_its_parent(name: str) -> None:
    """Leaves of a prefix go before their ancestors without scanning past them."""
    p = make_policy(name, 8)
    p.insert("root")
    p.insert("other")
    p.insert("child", parent="root")
    p.insert("grandchild", parent="child")
    assert [p.victim(always) for _ in range(4)] == ["grandchild", "child", "root", "other"]


@pytest.mark.parametrize("name,survives", [("lru", False), ("s3fifo", True)])
def test_one_pass_scan_of_twice_the_capacity(name: str, survives: bool) -> None:
    """A hot set hit a few times, then a one-pass scan of 2x capacity of new keys. (SLRU's
    answer depends on the hot set's rhythm: the two tests below.)"""
    cap = 100
    p = make_policy(name, cap)
    hot = [f"hot{i}" for i in range(20)]
    fill_with_eviction(p, hot)
    for _ in range(3):
        for k in hot:
            p.touch(k)
    # let the hot set settle past the admission filter of S3-FIFO, as real traffic would
    fill_with_eviction(p, [f"warm{i}" for i in range(cap)])
    for k in hot:
        p.touch(k)
    fill_with_eviction(p, [f"scan{i}" for i in range(2 * cap)])
    kept = sum(k in p for k in hot)
    if survives:
        assert kept == len(hot), f"{name} lost {len(hot) - kept} hot keys to a scan"
    else:
        assert kept == 0, f"{name} unexpectedly kept {kept} hot keys"


@pytest.mark.parametrize("name,survives", [("lru", False), ("slru", True), ("s3fifo", True)])
def test_a_hot_set_in_use_through_a_long_scan(name: str, survives: bool) -> None:
    """A system prompt among one-off prompts: 20 hot keys used after every 90 new keys, 4x
    the capacity of new keys in all. LRU loses it (90 + 20 > 100); SLRU keeps it (it is
    never idle for twice its interval)."""
    cap = 100
    p = make_policy(name, cap)
    hot = [f"hot{i}" for i in range(20)]
    fill_with_eviction(p, hot)
    for r in range(5):
        _passes(p, hot, 1)
        fill_with_eviction(p, [f"scan{r}-{i}" for i in range(90)])
    kept = sum(k in p for k in hot)
    assert (kept == len(hot)) == survives, f"{name} kept {kept} of {len(hot)}"


def test_slru_takes_a_hot_set_idle_past_twice_its_interval_for_dead_until_it_returns() -> None:
    """The same burst of new keys is a one-pass scan or a new working set; SLRU tells them
    apart by the protected keys' history. A hot set used after every 60 new keys and then
    idle for 200 is taken for dead and goes before the burst (as the old sessions must when
    a new set of agent sessions starts, the H200 agent run's round 2). Once it returns, it
    keeps the interval it returned after as a floor: the next such burst leaves it whole."""
    cap = 100
    p = make_policy("slru", cap)
    hot = [f"hot{i}" for i in range(20)]
    fill_with_eviction(p, hot)
    for r in range(3):
        fill_with_eviction(p, [f"warm{r}-{i}" for i in range(60)])
        assert _passes(p, hot, 1) == [20]
    fill_with_eviction(p, [f"scan0-{i}" for i in range(2 * cap)])
    assert sum(k in p for k in hot) == 0
    assert _passes(p, hot, 2) == [0, 20]
    for r in range(1, 3):
        fill_with_eviction(p, [f"scan{r}-{i}" for i in range(2 * cap)])
        assert sum(k in p for k in hot) == len(hot), r
        assert _passes(p, hot, 1) == [20]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_a_new_working_set_reused_beyond_probation_is_kept_after_a_shift(name: str) -> None:
    """The pool full of workload A (each key hit several times: all protected), then workload
    B: 60 keys in round-robin, each reused after 59 others, more than SLRU's probation (20)
    or S3-FIFO's small queue (10) holds. A miss saves the key again (insert), a hit touches
    it. Every policy must come to hit B (seen on the H200 with SLRU: after the shift B never
    hit, because protected kept A forever and B never outlived probation)."""
    cap = 100
    p = make_policy(name, cap)
    a = [f"a{i}" for i in range(cap)]
    fill_with_eviction(p, a)
    for _ in range(3):
        for k in a:
            p.touch(k)
    b = [f"b{i}" for i in range(60)]
    hits_per_round = []
    for _ in range(6):
        hits = 0
        for k in b:
            if k in p:
                p.touch(k)
                hits += 1
            else:
                fill_with_eviction(p, [k])
        hits_per_round.append(hits)
    assert hits_per_round[-1] == len(b), f"{name}: hits per round of B {hits_per_round}"


def test_a_one_pass_scan_leaves_only_ghosts_and_ghosts_are_bounded() -> None:
    """SLRU's ghost keeps keys, never capacity: a long scan fills it to ``capacity`` keys and
    the hot set, used after every 8 new keys (LRU would lose it: 5 + 8 > 10), stays
    protected."""
    p = make_policy("slru", 10)
    hot = [f"hot{i}" for i in range(5)]
    fill_with_eviction(p, hot)
    for r in range(13):
        _passes(p, hot, 1)
        fill_with_eviction(p, [f"scan{r}-{i}" for i in range(8)])
    assert all(k in p for k in hot) and len(p) == 10
    assert len(p._ghost) == 10  # type: ignore[attr-defined]


def test_slru_protected_segment_is_bounded() -> None:
    p = make_policy("slru", 10, KvtierConfig(slru_protected_fraction=0.5))
    keys = [f"k{i}" for i in range(10)]
    for k in keys:
        p.insert(k)
    for k in keys:
        p.touch(k)
    assert len(p._protected) == 5 and len(p._probation) == 5  # type: ignore[attr-defined]
    assert len(p) == 10


def test_s3fifo_ghost_readmits_to_main() -> None:
    p = make_policy("s3fifo", 10)
    fill_with_eviction(p, [f"k{i}" for i in range(11)])  # k0 evicted from small into ghost
    assert "k0" not in p
    p.insert("k0") if len(p) < p.capacity else fill_with_eviction(p, ["k0"])
    assert "k0" in p._main  # type: ignore[attr-defined]


def test_second_sight_admits_from_the_second_offer_and_forgets_beyond_memory() -> None:
    a = SecondSight(memory=2)
    assert not a.admit("x") and a.admit("x") and a.admit("x")
    assert not a.admit("y") and not a.admit("z")  # x forgotten now (memory 2)
    assert not a.admit("x")
    assert make_admission(KvtierConfig()).admit("anything")
    assert isinstance(make_admission(KvtierConfig(admission="second_sight")), SecondSight)


def test_unknown_policy_name() -> None:
    with pytest.raises(ValueError, match="choose one of"):
        make_policy("mru", 4)


def test_s3fifo_offers_a_small_queue_leaf_when_main_holds_only_parents() -> None:
    """insert a; touch a; insert b as a's child; only b may go -> b is offered (it was None:
    the search cycled through the main queue, where a is a parent, and never looked at small)."""
    p = make_policy("s3fifo", 10)
    p.insert("a")
    p.touch("a")
    p.insert("b", parent="a")
    assert p.victim(lambda k: k == "b") == "b"
    assert "a" in p and "b" not in p
    assert p.victim(lambda k: False) is None and "a" in p  # the refused key stays listed


def test_s3fifo_index_saves_past_a_parent_in_main() -> None:
    """The same case through the index: a full store whose only evictable chunk is a leaf in
    the small queue accepts a new save instead of declining it as full."""
    idx = MemoryIndex([GroupIndexSpec(0, make_policy("s3fifo", 2))], SlotAllocator([2]))
    a = idx.reserve(0, b"a", None)
    assert isinstance(a, Entry) and idx.commit(a)
    idx.touch(0, [b"a"])
    b = idx.reserve(0, b"b", b"a")
    assert isinstance(b, Entry) and idx.commit(b)
    c = idx.reserve(0, b"c", None)
    assert isinstance(c, Entry), c
    assert idx.is_ready(0, b"a") and not idx.is_ready(0, b"b")
    idx.check_invariants()


KEYS = st.integers(0, 5)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), KEYS, st.one_of(st.none(), KEYS)),
        st.tuples(st.just("touch"), KEYS, st.none()),
        st.tuples(st.just("remove"), KEYS, st.none()),
        st.tuples(st.just("victim"), st.frozensets(KEYS), st.none()),
    ),
    max_size=60,
)
Op = tuple[str, object, object]


def replay(name: str, capacity: int, ops: list[Op]) -> tuple[EvictionPolicy, set[int]]:
    """Apply ``ops`` to a fresh policy, checking every victim against the keys that may go:
    one of them iff one is listed, and exactly that one forgotten. Returns the policy and the
    keys it must still list."""
    p = make_policy(name, capacity)
    listed: set[int] = set()
    for op, arg, parent in ops:
        if op == "insert":
            if arg in listed or len(listed) >= capacity:
                continue
            p.insert(arg, parent if parent in listed else None)
            listed.add(arg)  # type: ignore[arg-type]
        elif op == "touch":
            p.touch(arg)
        elif op == "remove":
            p.remove(arg)
            listed.discard(arg)  # type: ignore[arg-type]
        else:
            may_go: frozenset[int] = arg  # type: ignore[assignment]
            v = p.victim(lambda k, may_go=may_go: k in may_go)  # type: ignore[misc]
            if listed & may_go:
                assert v in listed & may_go, (v, listed, may_go)
                listed.discard(v)  # type: ignore[arg-type]
            else:
                assert v is None, v
        assert len(p) == len(listed) and all(k in p for k in listed)
    return p, listed


@pytest.mark.parametrize("name", sorted(POLICIES))
@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 8), ops=OPS)
@example(capacity=10, ops=[("insert", 0, None), ("touch", 0, None), ("insert", 1, 0)])
def test_a_victim_is_offered_whenever_some_key_may_go(
    name: str, capacity: int, ops: list[Op]
) -> None:
    """Random insert / touch / remove / victim sequences, each victim call with a random set of
    keys that may go; then, from the final state, each listed key alone may go and must be the
    one offered. Refused keys stay listed."""
    _, listed = replay(name, capacity, ops)
    for only in listed:
        p, _ = replay(name, capacity, ops)
        assert p.victim(lambda k, only=only: k == only) == only, (only, listed)  # type: ignore[misc]
        assert len(p) == len(listed) - 1


def _passes(p: EvictionPolicy, keys: list[str], n: int) -> list[int]:
    """``n`` round-robin passes over ``keys``: a hit touches, a miss saves again."""
    hits_per_pass = []
    for _ in range(n):
        hits = 0
        for k in keys:
            if k in p:
                p.touch(k)
                hits += 1
            else:
                fill_with_eviction(p, [k])
        hits_per_pass.append(hits)
    return hits_per_pass


def test_after_a_shift_slru_keeps_each_later_working_set_from_its_second_pass() -> None:
    """A pool protected full of A, then B, C, D in turn, each 60 keys reused beyond
    probation. The first shift costs B a second miss (its keys must fall out of probation
    to be remembered); the ghost hits then shrink protected, so C and D are hit from their
    second pass as under LRU (before the adaptive size: every later set missed twice, the
    H200 agent runs' 17% of lost restores in every round after the first)."""
    p = make_policy("slru", 100)
    fill_with_eviction(p, [f"a{i}" for i in range(100)])
    for _ in range(3):
        for i in range(100):
            p.touch(f"a{i}")
    assert _passes(p, [f"b{i}" for i in range(60)], 4) == [0, 0, 60, 60]
    assert p.protected_capacity < 100 - 60  # type: ignore[attr-defined]
    for name in "cd":
        assert _passes(p, [f"{name}{i}" for i in range(60)], 3) == [0, 60, 60]


def test_slru_protected_grows_back_when_demoted_keys_return() -> None:
    """After a shift shrank protected, a hot set lost once to a scan comes back from the
    ghost as once-protected keys: protected grows again and the next scans leave it whole."""
    p = make_policy("slru", 100)
    fill_with_eviction(p, [f"a{i}" for i in range(100)])
    for _ in range(3):
        for i in range(100):
            p.touch(f"a{i}")
    _passes(p, [f"b{i}" for i in range(60)], 4)
    shrunk = p.protected_capacity  # type: ignore[attr-defined]
    hot = [f"h{i}" for i in range(20)]
    kept = []
    for r in range(4):
        _passes(p, hot, 2)
        fill_with_eviction(p, [f"scan{r}-{i}" for i in range(150)])
        kept.append(sum(k in p for k in hot))
    assert p.protected_capacity > shrunk  # type: ignore[attr-defined]
    assert p.protected_capacity <= p.max_protected  # type: ignore[attr-defined]
    assert kept[-2:] == [20, 20], kept


def test_agent_session_replay_restores_as_much_as_lru_in_every_round() -> None:
    """tools/policy_replay.py at a small scale (8 sessions, 1,024-token starts, 32-token
    chunks, a pool of about one round): SLRU restores as much as LRU in every round,
    the first shift included (before the expiry of idle protected keys round 2 restored
    17% less: the new sessions' chunks fell out of probation before their first reuse)."""
    replay = load_tool("policy_replay").replay
    shape = dict(rounds=4, requests=48, sessions=8, first_len=1024, tool_len=128,
                 message_len=32, output_len=8, chunk_tokens=32)
    lru = replay("lru", 512, **shape)
    slru = replay("slru", 512, **shape)
    assert lru[0] > 0.95 and all(abs(s - lru[0]) < 1e-9 for s in lru)
    assert slru == lru, (slru, lru)


def test_slru_bookkeeping_stays_bounded_by_what_it_lists() -> None:
    """Per-key use records exist only for listed keys, the expiry heap's stale entries are
    dropped, and the expired keys' memory is bounded like the ghost: 20,000 random
    operations on a pool of 50."""
    import random

    rng = random.Random(7)
    p = make_policy("slru", 50)
    assert isinstance(p, SLRUPolicy)
    for step in range(20_000):
        key = rng.randrange(400) if step % 3 else rng.randrange(60)  # a hot set too
        op = rng.random()
        if op < 0.5:
            if key not in p:
                if len(p) >= p.capacity:
                    assert p.victim(always) is not None
                p.insert(key)
        elif op < 0.9:
            p.touch(key)
        else:
            p.remove(key)
        if step % 50 == 0:
            protected, probation = set(p._protected._next), set(p._probation._next)
            assert set(p._last_use) <= protected and set(p._interval) <= protected
            assert set(p._born) <= probation and set(p._expired_last_use) <= probation
            assert len(p._expiries) <= 4 * len(p._protected) + 64 + 1
            assert len(p._expired_ghost) <= p.ghost_capacity


def test_a_prefix_loop_larger_than_the_pool_keeps_slru_ahead_of_lru() -> None:
    """tools/policy_replay.py's prefix loop at a small scale (8 prefixes of 20 chunks, 4
    one-off chunks per request, 4 passes; the loop needs 192 slots, the pool has 170): the
    expiry of idle protected keys must not turn SLRU into LRU here, where every prefix keeps
    its rhythm (LRU 10%, SLRU 47.5%, S3-FIFO 93%)."""
    loop = load_tool("policy_replay").replay_prefix_loop
    shape = dict(prefixes=8, prefix_chunks=20, suffix_chunks=4, chunk_tokens=16)
    lru, slru = loop("lru", 170, **shape), loop("slru", 170, **shape)
    assert lru < 0.2 and slru > lru + 0.3, (lru, slru)
    assert loop("slru", 192, **shape) == 1.0


def test_an_expired_key_hit_before_it_goes_is_protected_again_from_its_last_use() -> None:
    """Two protected keys expire at one victim call; the first goes, the second is hit
    while it waits at probation's front: it is protected again, its interval the gap since
    its last use, and nothing remembers it as expired."""
    p = make_policy("slru", 20)
    assert isinstance(p, SLRUPolicy)
    for k in ("a", "b", "x1", "x2", "x3"):
        p.insert(k)
    p.touch("a")
    p.touch("b")  # last use at clock 5; intervals 4 and 3: deadlines 13 and 11
    for i in range(10):
        p.insert(f"y{i}")  # clock 15, no eviction (15 of 20)
    assert p.victim(always) == "a"  # both expired; a, moved to the front last, went first
    assert "b" in p._probation and "b" in p._expired_last_use  # type: ignore[attr-defined]
    p.touch("b")
    assert "b" in p._protected and "b" not in p._expired_last_use  # type: ignore[attr-defined]
    assert p._interval["b"] == 10  # type: ignore[attr-defined]
