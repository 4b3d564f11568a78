"""A fake OpenAI-compatible streaming server for the bench tests (in-process or as a process).

- ``POST /v1/completions`` streams ``max_tokens`` chunks (token ids if ``return_token_ids``)
  after a delay that grows with the uncached prompt tokens, then a usage chunk whose
  ``cached_tokens`` is the longest whole-block prefix shared with an earlier prompt.
- A KV connector (``connector``, default: when ``kvtier``) "restores" the cached tokens
  beyond the first block; the first block counts as an HBM prefix-cache hit.
- ``GET /metrics`` exposes ``vllm:prompt_tokens_total``; with ``by_source`` (default on, as
  vLLM 0.25.1 and 0.32 do) ``vllm:prompt_tokens_by_source{source=local_compute|
  local_cache_hit|external_kv_transfer}``; when ``kvtier`` is on
  ``vllm:kvtier_restored_tokens_total`` (the connector's tokens) and
  ``vllm:kvtier_chunk_tokens``. ``connector`` without ``kvtier`` is a native/LMCache server.
- ``fail_every`` makes every n-th request answer HTTP 500.

    python tests/_fake_openai.py --port 8123 [--kvtier 0|1] [--connector 0|1] [--by-source 0|1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

BLOCK = 32


@dataclass
class FakeState:
    kvtier: bool = True
    connector: bool | None = None  # None: as kvtier
    by_source: bool = True
    first_delay: float = 0.005
    per_token: float = 2e-6
    itl: float = 0.002
    fail_every: int = 0
    prompts: list[list[int]] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    arrivals: list[float] = field(default_factory=list)
    bodies: list[dict[str, Any]] = field(default_factory=list)
    prompt_tokens: int = 0
    restored: int = 0
    hbm_hits: int = 0
    computed: int = 0

    @property
    def has_connector(self) -> bool:
        return self.kvtier if self.connector is None else self.connector

    def cached(self, prompt: list[int]) -> int:
        best = 0
        for p in self.prompts:
            n = 0
            for a, b in zip(p, prompt):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(prompt) - 1) // BLOCK * BLOCK


def make_app(state: FakeState) -> web.Application:
    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        state.arrivals.append(time.perf_counter())
        state.bodies.append(body)
        if state.fail_every and len(state.arrivals) % state.fail_every == 0:
            return web.Response(status=500, text="injected failure")
        prompt = list(body["prompt"])
        cached = state.cached(prompt)
        state.prompts.append(prompt)
        state.in_flight += 1
        state.max_in_flight = max(state.max_in_flight, state.in_flight)
        try:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            await asyncio.sleep(state.first_delay + state.per_token * (len(prompt) - cached))
            n = int(body["max_tokens"])
            for i in range(n):
                choice: dict[str, Any] = {"index": 0, "text": "", "finish_reason":
                                          "length" if i == n - 1 else None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = [(len(prompt) * 7 + i) % 900 + 3]
                await resp.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
                if i < n - 1:
                    await asyncio.sleep(state.itl)
            usage = {"prompt_tokens": len(prompt), "completion_tokens": n,
                     "total_tokens": len(prompt) + n,
                     "prompt_tokens_details": {"cached_tokens": cached}}
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
            state.prompt_tokens += len(prompt)
            external = max(0, cached - BLOCK) if state.has_connector else 0
            state.restored += external
            state.hbm_hits += cached - external
            state.computed += len(prompt) - cached
            return resp
        finally:
            state.in_flight -= 1

    async def metrics(_: web.Request) -> web.Response:
        lines = ["# TYPE vllm:prompt_tokens_total counter",
                 f'vllm:prompt_tokens_total{{engine="0",model_name="fake"}} {state.prompt_tokens}',
                 'vllm:prompt_tokens_created{engine="0",model_name="fake"} 1.7e9']
        if state.by_source:
            lines.append("# TYPE vllm:prompt_tokens_by_source counter")
            for source, n in (("local_compute", state.computed),
                              ("local_cache_hit", state.hbm_hits),
                              ("external_kv_transfer", state.restored)):
                lines.append(f'vllm:prompt_tokens_by_source{{engine="0",model_name="fake",'
                             f'source="{source}"}} {n}')
        if state.kvtier:
            lines += [f'vllm:kvtier_restored_tokens_total{{engine="0",model_name="fake"}} '
                      f"{state.restored}",
                      'vllm:kvtier_chunk_tokens{engine="0",model_name="fake"} 64']
        return web.Response(text="\n".join(lines) + "\n")

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "fake-model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def version(_: web.Request) -> web.Response:
        return web.json_response({"version": "fake-0"})

    app = web.Application()
    app.add_routes([web.post("/v1/completions", completions), web.get("/metrics", metrics),
                    web.get("/v1/models", models), web.get("/health", health),
                    web.get("/version", version)])
    return app


class FakeServer:
    """``async with FakeServer(state) as url:`` serves on a free local port."""

    def __init__(self, state: FakeState) -> None:
        self.state = state
        self.runner: web.AppRunner | None = None

    async def __aenter__(self) -> str:
        self.runner = web.AppRunner(make_app(self.state))
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        assert self.runner is not None
        await self.runner.cleanup()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--kvtier", type=int, default=1)
    p.add_argument("--connector", type=int, default=None)
    p.add_argument("--by-source", type=int, default=1)
    a = p.parse_args()
    state = FakeState(kvtier=bool(a.kvtier),
                      connector=None if a.connector is None else bool(a.connector),
                      by_source=bool(a.by_source))
    web.run_app(make_app(state), host=a.host, port=a.port, print=None)


if __name__ == "__main__":
    main()
