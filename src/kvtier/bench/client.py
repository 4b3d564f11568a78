"""A streaming client for OpenAI-compatible ``/v1/completions`` endpoints, and the load driver.

Contracts:

- Prompts are token ids (``"prompt": [ids]``), sent with ``stream: true`` and
  ``stream_options.include_usage``; ``ignore_eos`` keeps the output length fixed on vLLM.
- TTFT is the time from sending the request to the first streamed chunk that carries a
  choice (a token); ITL is the gap between consecutive such chunks. Times are wall-clock
  (``time.perf_counter``) on the client, so they include the HTTP round trip.
- ``cached_tokens`` is the server's ``usage.prompt_tokens_details.cached_tokens`` (vLLM:
  prefix-cache hits plus tokens a KV connector supplied), or None when the server sent none.
- The driver keeps exactly ``concurrency`` requests in flight (fixed-concurrency mode),
  starts requests at seeded arrival times (fixed-rate mode, Poisson or constant gaps), or at
  each request's own ``at`` (schedule mode: a replayed trace's timestamps), and
  stops issuing after ``requests`` requests or ``duration`` seconds; requests in flight then
  run to completion and are counted. A workload request that waits on one in flight (the next
  turn of a session) delays its slot or its arrival; it is never reordered.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from kvtier.bench.workloads import RequestSpec, Workload


@dataclass
class RequestResult:
    """What one request measured. Times are seconds; ``start`` counts from the run's start."""

    index: int
    group: str
    turn: int
    reuse_tokens: int
    prompt_tokens: int
    max_tokens: int
    start: float = 0.0
    ttft: float | None = None
    latency: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    output_ids: list[int] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft is not None

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("output_ids")
        return d


@dataclass(frozen=True)
class LoadShape:
    """How requests are issued: one of ``concurrency``, ``rate``, ``schedule``; ``requests``
    xor ``duration``."""

    concurrency: int | None = 4
    rate: float | None = None
    arrival: str = "poisson"
    requests: int | None = 32
    duration: float | None = None
    seed: int = 0
    schedule: bool = False

    def __post_init__(self) -> None:
        if (self.concurrency is not None) + (self.rate is not None) + self.schedule != 1:
            raise ValueError("give exactly one of concurrency, rate and a schedule")
        if (self.requests is None) == (self.duration is None):
            raise ValueError("give exactly one of requests and duration")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate must be > 0 requests/s, got {self.rate}")
        if self.arrival not in ("poisson", "constant"):
            raise ValueError(f"arrival must be 'poisson' or 'constant', got {self.arrival!r}")
        if self.requests is not None and self.requests < 1:
            raise ValueError(f"requests must be >= 1, got {self.requests}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"duration must be > 0 s, got {self.duration}")

    def describe(self) -> str:
        how = (f"concurrency {self.concurrency}" if self.concurrency is not None
               else "the trace's timestamps" if self.schedule
               else f"{self.rate:g} req/s ({self.arrival})")
        until = (f"{self.requests} requests" if self.requests is not None
                 else f"{self.duration:g} s")
        return f"{how}, {until}"


def completion_body(model: str, spec: RequestSpec, want_ids: bool,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model, "prompt": spec.prompt, "max_tokens": spec.max_tokens,
        "temperature": 0.0, "ignore_eos": True, "stream": True,
        "stream_options": {"include_usage": True},
    }
    if want_ids:
        body["return_token_ids"] = True  # vLLM: token ids in every chunk (no tokenizer needed)
    body.update(extra or {})
    return body


async def _sse_events(resp: aiohttp.ClientResponse) -> Any:
    """The ``data:`` payloads of a server-sent-event stream (lines of any length)."""
    buf = b""
    async for piece in resp.content.iter_any():
        buf += piece
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            line = line.strip()
            if line.startswith(b"data:"):
                yield line[5:].strip()
    if buf.strip().startswith(b"data:"):
        yield buf.strip()[5:].strip()


async def send(session: aiohttp.ClientSession, url: str, model: str, spec: RequestSpec,
               t0: float, want_ids: bool = False, extra: dict[str, Any] | None = None
               ) -> RequestResult:
    """Send one streaming completion and measure it. Never raises for server or network
    errors: they end up in ``RequestResult.error``."""
    res = RequestResult(spec.index, spec.group, spec.turn, spec.reuse_tokens, len(spec.prompt),
                        spec.max_tokens)
    body = completion_body(model, spec, want_ids, extra)
    ids: list[int] = []
    got_ids = False
    events = 0
    start = time.perf_counter()
    res.start = start - t0
    last = start
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for data in _sse_events(resp):
                if data == b"[DONE]":
                    break
                now = time.perf_counter()
                msg = json.loads(data)
                if "error" in msg:
                    res.error = f"stream error: {str(msg['error'])[:300]}"
                    break
                choices = msg.get("choices") or []
                if choices:
                    if res.ttft is None:
                        res.ttft = now - start
                    else:
                        res.itl.append(now - last)
                    last = now
                    for c in choices:
                        tids = c.get("token_ids")
                        if tids is not None:
                            got_ids = True
                            ids.extend(tids)
                            events += len(tids)
                        else:
                            events += 1
                        if c.get("finish_reason") in ("error", "abort"):
                            res.error = f"finish_reason {c['finish_reason']}"
                usage = msg.get("usage")
                if usage:
                    res.output_tokens = int(usage.get("completion_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        res.cached_tokens = int(details["cached_tokens"])
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError, OSError) as e:
        res.error = f"{type(e).__name__}: {e}"[:300]
    res.latency = time.perf_counter() - start
    if res.output_tokens == 0:
        res.output_tokens = events
    if got_ids:
        res.output_ids = ids
    if res.error is None and res.ttft is None:
        res.error = "no token streamed"
    return res


class _Source:
    """Hands out the workload's requests until the count or the deadline is reached."""

    def __init__(self, workload: Workload, load: LoadShape, t0: float) -> None:
        self.workload = workload
        self.load = load
        self.deadline = None if load.duration is None else t0 + load.duration
        self.issued = 0
        self.cond = asyncio.Condition()

    def _stopped(self) -> bool:
        if self.workload.exhausted:
            return True
        if self.load.requests is not None and self.issued >= self.load.requests:
            return True
        return self.deadline is not None and time.perf_counter() >= self.deadline

    async def acquire(self) -> RequestSpec | None:
        async with self.cond:
            while not self._stopped():
                spec = self.workload.next_request()
                if spec is not None:
                    self.issued += 1
                    return spec
                if self.workload.exhausted:
                    return None
                timeout = None if self.deadline is None else max(
                    0.0, self.deadline - time.perf_counter())
                try:
                    await asyncio.wait_for(self.cond.wait(), timeout)
                except asyncio.TimeoutError:
                    return None
            return None

    async def release(self, spec: RequestSpec, res: RequestResult) -> None:
        async with self.cond:
            self.workload.complete(spec, res.output_ids, res.output_tokens, ok=res.ok)
            self.cond.notify_all()


async def drive(url: str, model: str, workload: Workload, load: LoadShape,
                on_done: Callable[[RequestResult], None] | None = None,
                extra: dict[str, Any] | None = None, request_timeout: float = 900.0
                ) -> tuple[list[RequestResult], float]:
    """Run ``workload`` against ``url`` under ``load``. Returns the results in issue order and
    the wall time from the first send to the last completion."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=30, sock_read=request_timeout)
    results: list[RequestResult] = []
    want_ids = workload.needs_output_ids
    async with aiohttp.ClientSession(timeout=timeout,
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()
        source = _Source(workload, load, t0)

        async def one(spec: RequestSpec) -> None:
            res = await send(session, url, model, spec, t0, want_ids, extra)
            results.append(res)
            await source.release(spec, res)
            if on_done is not None:
                on_done(res)

        if load.concurrency is not None:
            async def worker() -> None:
                while (spec := await source.acquire()) is not None:
                    await one(spec)

            await asyncio.gather(*(worker() for _ in range(load.concurrency)))
        elif load.schedule:
            tasks: list[asyncio.Task[None]] = []
            while (spec := await source.acquire()) is not None:
                delay = t0 + (spec.at or 0.0) - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                tasks.append(asyncio.create_task(one(spec)))
            await asyncio.gather(*tasks)
        else:
            assert load.rate is not None
            rng = random.Random(f"arrivals-{load.seed}")
            tasks = []
            due = t0
            while True:
                delay = due - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                spec = await source.acquire()
                if spec is None:
                    break
                tasks.append(asyncio.create_task(one(spec)))
                gap = (rng.expovariate(load.rate) if load.arrival == "poisson"
                       else 1.0 / load.rate)
                due += gap
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    results.sort(key=lambda r: r.index)
    return results, wall


async def discover_model(url: str) -> str:
    """The first model the server lists at ``/v1/models``."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s, \
            s.get(f"{url}/v1/models") as r:
        r.raise_for_status()
        data = await r.json()
    models = data.get("data") or []
    if not models:
        raise RuntimeError(f"{url}/v1/models lists no model: pass --model")
    return str(models[0]["id"])
