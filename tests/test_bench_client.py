"""The streaming client and the load driver, against an in-process fake OpenAI server."""

from __future__ import annotations

import asyncio
import time

import pytest

from kvtier.bench.client import LoadShape, RequestResult, discover_model, drive, send
from kvtier.bench.workloads import AgentSessions, NoReuse, RequestSpec, SharedPrefix
from tests._fake_openai import FakeServer, FakeState


def _run(state: FakeState, coro_fn):  # type: ignore[no-untyped-def]
    async def main():  # type: ignore[no-untyped-def]
        async with FakeServer(state) as url:
            return await coro_fn(url)

    return asyncio.run(main())


def test_send_measures_ttft_itl_and_usage() -> None:
    state = FakeState(first_delay=0.03, itl=0.01)

    async def go(url: str) -> RequestResult:
        import aiohttp

        async with aiohttp.ClientSession() as s:
            spec = RequestSpec(0, list(range(3, 103)), 5, "g")
            t0 = time.perf_counter()
            return await send(s, url, "m", spec, t0, want_ids=True)

    r = _run(state, go)
    assert r.ok and r.error is None
    assert 0.03 <= r.ttft < 1.0  # type: ignore[operator]
    assert len(r.itl) == 4 and all(g >= 0.009 for g in r.itl)
    assert r.output_tokens == 5 and r.cached_tokens == 0
    assert r.output_ids is not None and len(r.output_ids) == 5
    assert r.latency is not None and r.latency >= r.ttft  # type: ignore[operator]
    body = state.bodies[0]
    assert body["prompt"] == list(range(3, 103)) and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["ignore_eos"] is True


def test_http_errors_are_recorded_not_raised() -> None:
    state = FakeState(fail_every=2)
    results, _ = _run(state, lambda url: drive(
        url, "m", NoReuse(prompt_len=40, output_len=2), LoadShape(concurrency=1, requests=4)))
    assert [r.ok for r in results] == [True, False, True, False]
    assert "HTTP 500" in (results[1].error or "")


def test_unreachable_server_is_an_error_per_request() -> None:
    async def go() -> list[RequestResult]:
        res, _ = await drive("http://127.0.0.1:9", "m", NoReuse(prompt_len=8, output_len=1),
                             LoadShape(concurrency=2, requests=2))
        return res

    results = asyncio.run(go())
    assert len(results) == 2 and all(not r.ok and r.error for r in results)


@pytest.mark.parametrize("conc", [1, 3])
def test_fixed_concurrency_is_kept_and_count_is_exact(conc: int) -> None:
    state = FakeState(first_delay=0.02, itl=0.002)
    done: list[int] = []
    results, wall = _run(state, lambda url: drive(
        url, "m", SharedPrefix(prefixes=4, prefix_len=64, suffix_len=8, output_len=3),
        LoadShape(concurrency=conc, requests=10), on_done=lambda r: done.append(r.index)))
    assert len(results) == 10 == len(done) == len(state.arrivals)
    assert [r.index for r in results] == list(range(10))
    assert state.max_in_flight == conc
    assert all(r.ok for r in results) and wall > 0
    # prefixes came back after a full round: the fake server reports them cached
    assert [r.cached_tokens for r in results[4:8]] == [64] * 4


def test_fixed_rate_spaces_arrivals() -> None:
    state = FakeState(first_delay=0.001, itl=0.001)
    results, wall = _run(state, lambda url: drive(
        url, "m", NoReuse(prompt_len=16, output_len=2),
        LoadShape(concurrency=None, rate=20.0, arrival="constant", requests=6)))
    gaps = [b - a for a, b in zip(state.arrivals, state.arrivals[1:])]
    assert len(results) == 6
    assert min(gaps) > 0.03 and 0.2 < wall < 2.0  # 5 gaps of 50 ms


def test_duration_stops_issuing() -> None:
    state = FakeState(first_delay=0.01, itl=0.001)
    t0 = time.perf_counter()
    results, _ = _run(state, lambda url: drive(
        url, "m", NoReuse(prompt_len=16, output_len=2),
        LoadShape(concurrency=2, requests=None, duration=0.3)))
    assert 0.3 <= time.perf_counter() - t0 < 3.0
    assert len(results) >= 4 and all(r.ok for r in results)
    assert max(r.start for r in results) < 0.35


def test_sessions_feed_server_output_ids_into_the_next_turn() -> None:
    state = FakeState(first_delay=0.002, itl=0.001)
    w = AgentSessions(sessions=2, turns=3, first_len=40, tool_len=5, message_len=2,
                      output_len=3, seed=0)
    results, _ = _run(state, lambda url: drive(url, "m", w, LoadShape(concurrency=4,
                                                                       requests=6)))
    assert state.max_in_flight <= 2  # each session has one turn in flight at most
    by_group: dict[str, list[RequestResult]] = {}
    for r in results:
        by_group.setdefault(r.group, []).append(r)
    for rs in by_group.values():
        assert [r.turn for r in rs] == list(range(len(rs)))
    # turn 1's prompt = turn 0's prompt + the ids the server returned + tool + message
    first, second = state.bodies[0], next(
        b for b in state.bodies[1:] if b["prompt"][:40] == state.bodies[0]["prompt"])
    returned = [(40 * 7 + i) % 900 + 3 for i in range(3)]
    assert second["prompt"][:43] == first["prompt"] + returned
    assert all(b.get("return_token_ids") for b in state.bodies)


def test_discover_model() -> None:
    assert _run(FakeState(), discover_model) == "fake-model"


@pytest.mark.parametrize("kw", [
    {"concurrency": None, "rate": None},
    {"concurrency": 2, "rate": 1.0},
    {"requests": None, "duration": None},
    {"concurrency": 0},
    {"rate": -1.0, "concurrency": None},
    {"arrival": "burst"},
])
def test_bad_load_shapes(kw: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        LoadShape(**kw)  # type: ignore[arg-type]
