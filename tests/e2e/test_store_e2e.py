"""Engines on the vLLM CPU build attached to one node-wide store (issue 18): a prefix that
one engine computed is restored by the next engine (a restart, or a second server), with
equal tokens and logprobs, through the store's index and pool."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvtier.store.index import StoreIndex
from kvtier.testing.restore import generate, handles, sharpen_dummy_weights
from kvtier.testing.store_process import StoreProcess
from tests.e2e.conftest import greedy, make_llm, prompt, shutdown

pytestmark = pytest.mark.e2e

C = 256


@pytest.fixture
def store(tmp_path: Path) -> Iterator[StoreProcess]:
    s = StoreProcess(tmp_path, size="512MiB").start()
    yield s
    s.stop()


def _engine(model: str, url: str) -> Any:
    h = handles(make_llm(model, {"store_url": url}))
    sharpen_dummy_weights(h)
    return h


def test_a_prefix_one_engine_computed_is_restored_by_the_next(
        tiny_llama_dir: str, store: StoreProcess) -> None:
    p = prompt(4 * C + 5, seed=18)
    a = _engine(tiny_llama_dir, store.url)
    try:
        assert isinstance(a.kvtier.index, StoreIndex) and a.kvtier.index.up
        out_a = generate(a, [p], greedy())[0]
        assert out_a.num_cached_tokens == 0
        assert a.kvtier.stats.saves_committed >= 4
    finally:
        shutdown(a.llm)
    b = _engine(tiny_llama_dir, store.url)  # a fresh engine: its HBM cache is empty
    try:
        out_b = generate(b, [p], greedy())[0]
        assert out_b.num_cached_tokens == 4 * C  # every whole chunk, from the store
        assert b.kvtier.stats.loaded_tokens == 4 * C and b.kvtier.stats.loads_failed == 0
        assert list(out_b.outputs[0].token_ids) == list(out_a.outputs[0].token_ids)
        assert out_b.outputs[0].logprobs == out_a.outputs[0].logprobs
        b.kvtier.check_drained()
    finally:
        shutdown(b.llm)
