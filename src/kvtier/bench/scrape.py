"""Reading a server's Prometheus ``/metrics`` before and after a run.

Samples are keyed ``name{label="v",...}`` with labels sorted, so two scrapes can be
subtracted. The bench attributes prompt tokens to kvtier from these deltas (docs/bench.md).
"""

from __future__ import annotations

import asyncio
import re
import time

import aiohttp

Samples = dict[str, float]

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

KVTIER_PREFIX = "vllm:kvtier_"
RESTORED = "vllm:kvtier_restored_tokens_total"
# vLLM's own prompt-token attribution (0.25.1 and 0.32), whatever the connector (none, native
# offloading, LMCache, kvtier): local_compute + local_cache_hit + external_kv_transfer = total.
BY_SOURCE = "vllm:prompt_tokens_by_source"
SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
CHUNK_TOKENS = "vllm:kvtier_chunk_tokens"


def parse(text: str) -> Samples:
    """Prometheus text exposition -> {key: value}; ``_created`` samples are dropped."""
    out: Samples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.groups()
        if name.endswith("_created"):
            continue
        try:
            v = float(value)
        except ValueError:
            continue
        out[key(name, dict(_LABEL.findall(labels or "")))] = v
    return out


def key(name: str, labels: dict[str, str] | None = None) -> str:
    if not labels:
        return name
    inner = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return f"{name}{{{inner}}}"


def total(samples: Samples, name: str, **match: str) -> float | None:
    """Sum of every sample of ``name`` whose labels include ``match`` (None: no sample)."""
    found = None
    for k, v in samples.items():
        n, _, rest = k.partition("{")
        if n != name:
            continue
        labels = dict(_LABEL.findall(rest))
        if all(labels.get(a) == b for a, b in match.items()):
            found = (found or 0.0) + v
    return found


def delta(after: Samples, before: Samples) -> Samples:
    """Counter increases (and gauge changes) between two scrapes; unchanged samples dropped."""
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)}


def has_kvtier(samples: Samples) -> bool:
    return any(k.startswith(KVTIER_PREFIX) for k in samples)


async def scrape(url: str, timeout: float = 30.0) -> Samples:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as s, \
            s.get(f"{url}/metrics") as r:
        r.raise_for_status()
        return parse(await r.text())


async def scrape_settled(url: str, watch: tuple[str, ...] = (RESTORED, BY_SOURCE,
                                                           "vllm:prompt_tokens_total"),
                         interval: float = 0.5, limit: float = 10.0) -> Samples:
    """Scrape until the watched counters stop moving (engine stats reach the frontend a step
    or a logging interval after the responses), or ``limit`` seconds pass."""
    deadline = time.monotonic() + limit
    prev = await scrape(url)
    while time.monotonic() < deadline:
        await asyncio.sleep(interval)
        cur = await scrape(url)
        if all(total(cur, w) == total(prev, w) for w in watch):
            return cur
        prev = cur
    return prev
