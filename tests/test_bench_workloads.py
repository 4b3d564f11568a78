"""The serving workloads: shapes, determinism, reuse accounting."""

from __future__ import annotations

import pytest

from kvtier.bench.workloads import (
    FIRST_TOKEN,
    AgentSessions,
    NoReuse,
    RequestSpec,
    SharedPrefix,
    warmup_prompts,
)


def _take(w: SharedPrefix | NoReuse, n: int, complete: bool = True) -> list[RequestSpec]:
    out = []
    for _ in range(n):
        s = w.next_request()
        assert s is not None
        if complete:
            w.complete(s, None, s.max_tokens)
        out.append(s)
    return out


def test_shared_prefix_shape_and_round_robin() -> None:
    w = SharedPrefix(prefixes=3, prefix_len=100, suffix_len=20, output_len=5, seed=1, vocab=50)
    specs = _take(w, 7)
    assert [s.group for s in specs] == ["prefix-0", "prefix-1", "prefix-2"] * 2 + ["prefix-0"]
    assert [s.reuse_tokens for s in specs] == [0, 0, 0, 100, 100, 100, 100]
    assert all(len(s.prompt) == 120 and s.max_tokens == 5 for s in specs)
    assert all(FIRST_TOKEN <= t < 50 for s in specs for t in s.prompt)
    assert specs[0].prompt[:100] == specs[3].prompt[:100] == specs[6].prompt[:100]
    assert specs[0].prompt[100:] != specs[3].prompt[100:]  # suffixes are unique
    assert specs[3].restorable(64) == 64 and specs[0].restorable(64) == 0
    assert [s.index for s in specs] == list(range(7))


def test_shared_prefix_reuse_needs_a_completed_request() -> None:
    w = SharedPrefix(prefixes=1, prefix_len=10, suffix_len=2, seed=0)
    a = w.next_request()
    b = w.next_request()  # a still in flight: its prefix is not computed yet
    assert (a.reuse_tokens, b.reuse_tokens) == (0, 0)
    w.complete(a, None, 1, ok=False)  # a failed request computed nothing
    assert w.next_request().reuse_tokens == 0
    w.complete(b, None, 1)
    assert w.next_request().reuse_tokens == 10


def test_same_seed_same_requests_other_seed_other_requests() -> None:
    def prompts(seed: int) -> list[list[int]]:
        return [s.prompt for s in _take(SharedPrefix(4, 64, 8, seed=seed), 8)]

    assert prompts(3) == prompts(3)
    assert prompts(3) != prompts(4)
    w = SharedPrefix(2, 16, 4, order="random", seed=5)
    groups = [s.group for s in _take(w, 20)]
    assert set(groups) == {"prefix-0", "prefix-1"}


def test_agent_sessions_turns_append_output_tool_and_message() -> None:
    w = AgentSessions(sessions=2, turns=3, first_len=50, tool_len=7, message_len=3,
                      output_len=4, seed=2)
    t0a = w.next_request()
    t0b = w.next_request()
    assert t0a is not None and t0b is not None
    assert (t0a.group, t0b.group) == ("session-0", "session-1")
    assert w.next_request() is None  # both sessions wait on their turn in flight
    w.complete(t0a, [11, 12, 13, 14], 4)
    t1a = w.next_request()
    assert t1a is not None and t1a.group == "session-0" and t1a.turn == 1
    assert t1a.prompt[:54] == [*t0a.prompt, 11, 12, 13, 14]
    assert len(t1a.prompt) == 50 + 4 + 7 + 3
    assert t1a.reuse_tokens == 50 + 3  # the last output token's KV was never computed
    w.complete(t1a, None, 4)  # no ids from the server: same-length stand-ins
    t2a = w.next_request()
    assert t2a is not None and len(t2a.prompt) == len(t1a.prompt) + 4 + 10
    assert t2a.prompt[:len(t1a.prompt)] == t1a.prompt
    w.complete(t2a, None, 4)
    nxt = w.next_request()  # session-0 ended after 3 turns; session-1 still busy
    assert nxt is not None and nxt.group == "session-2" and nxt.turn == 0
    assert nxt.reuse_tokens == 0


def test_agent_sessions_failed_turn_ends_the_session() -> None:
    w = AgentSessions(sessions=1, turns=5, first_len=8, output_len=2, seed=0)
    s = w.next_request()
    assert s is not None
    w.complete(s, None, 0, ok=False)
    nxt = w.next_request()
    assert nxt is not None and nxt.group == "session-1" and nxt.turn == 0


def test_no_reuse_prompts_are_unique() -> None:
    specs = _take(NoReuse(prompt_len=32, output_len=2, seed=0), 50)
    assert len({tuple(s.prompt) for s in specs}) == 50
    assert all(s.reuse_tokens == 0 and not s.repeat for s in specs)


def test_warmup_prompts_share_nothing_with_the_workload() -> None:
    w = SharedPrefix(2, 64, 8, seed=0)
    specs = _take(w, 2)
    warm = warmup_prompts(2, 64, seed=0, vocab=1000)
    assert all(p[:8] != s.prompt[:8] for p in warm for s in specs)


@pytest.mark.parametrize("make", [
    lambda: SharedPrefix(prefixes=0),
    lambda: SharedPrefix(order="zigzag"),
    lambda: AgentSessions(turns=0),
    lambda: NoReuse(prompt_len=0),
    lambda: NoReuse(vocab=3),
])
def test_bad_shapes_are_rejected(make: object) -> None:
    with pytest.raises(ValueError):
        make()  # type: ignore[operator]
