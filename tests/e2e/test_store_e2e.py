"""Engines on the vLLM CPU build attached to one node-wide store (issue 18): a prefix that
one engine computed is restored by the next engine (a restart, or a second server), with
equal tokens and logprobs, through the store's index and pool."""

from __future__ import annotations

import time
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
        st = a.kvtier.stats
        assert st.saves_committed >= 4, (st.saves_planned, st.saves_failed,
                                         dict(st.saves_dropped), a.kvtier.index.up)
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


def test_an_engine_whose_store_is_absent_serves_and_attaches_later(
        tiny_llama_dir: str, tmp_path: Path) -> None:
    store = StoreProcess(tmp_path / "later", size="512MiB")
    (tmp_path / "later").mkdir()
    h = _engine(tiny_llama_dir, store.url)
    try:
        index = h.kvtier.index
        assert isinstance(index, StoreIndex) and not index.up and index.outages == 1
        p = prompt(2 * C + 5, seed=19)
        out = generate(h, [p], greedy())[0]  # served: kvtier off in effect
        assert len(out.outputs[0].token_ids) == 8 and h.kvtier.stats.saves_committed == 0
        store.start()
        time.sleep(index.retry_seconds + 0.5)  # the next retry is due
        generate(h, [prompt(40, seed=20)], greedy())  # a step polls: attached
        assert index.up and index.epoch == 1
        q = prompt(2 * C + 5, seed=21)
        generate(h, [q], greedy())
        assert h.kvtier.stats.saves_committed >= 2
    finally:
        shutdown(h.llm)
        store.stop()
