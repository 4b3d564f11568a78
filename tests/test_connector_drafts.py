"""The connector reads EAGLE/MTP drafts from vLLM's configuration and its scheduler half keys
chunks with the next token (issue 14): two requests that share a chunk and differ right after
it, through the connector's own hooks (vLLM's Request objects, the handshake's worker
metadata), on a configuration without an engine."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvtier.geometry import Geometry, GroupGeometry
from kvtier.layout import GroupKind
from kvtier.vllm.setup import draft_lookahead
from tests.test_connector_startup import _configs

BLOCK = 16  # tests.harness.compat.BLOCK_SIZE
CHUNK = 256


def _speculative(method: str) -> Any:
    """vLLM's SpeculativeConfig with only its method set: building it in full loads the draft
    model's configuration, and ``use_eagle()`` reads nothing but the method."""
    from vllm.config import SpeculativeConfig

    spec = SpeculativeConfig.__new__(SpeculativeConfig)
    object.__setattr__(spec, "method", method)
    return spec


@pytest.mark.parametrize("method, lookahead", [("mtp", 1), ("eagle", 1), ("eagle3", 1),
                                               ("ngram", 0), ("draft_model", 0)])
def test_draft_methods_that_write_lookahead_kv(method: str, lookahead: int) -> None:
    assert draft_lookahead(SimpleNamespace(speculative_config=_speculative(method))) == lookahead
    assert draft_lookahead(SimpleNamespace(speculative_config=None)) == 0


def _scheduler_connector(method: str | None) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvtier.vllm.connector import KvtierConnector
    from kvtier.vllm.metadata import KvtierWorkerMetadata

    cfg, kvc = _configs("recompute", {"dram_size": "8MiB", "cost_model": "false"})
    if method is not None:
        object.__setattr__(cfg, "speculative_config", _speculative(method))
    c = KvtierConnector(cfg, KVConnectorRole.SCHEDULER, kvc)
    geo = Geometry(CHUNK, (GroupGeometry(GroupKind.FULL, BLOCK, 1024),), "fp")
    c.update_connector_output(SimpleNamespace(
        kv_connector_worker_meta=KvtierWorkerMetadata(geometries=[geo])))
    assert c.scheduler_side.scheduler is not None  # the handshake made the scheduler half
    return c


def _request(req_id: str, prompt: list[int]) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, prompt, SamplingParams(max_tokens=4), None, 0)


def _store_prompt(c: Any, req: Any) -> None:
    """Commit the chunks of ``req`` as if its prefill had run and been saved."""
    sched = c.scheduler_side.scheduler
    sched.add_request(req.request_id)
    st = sched.requests[req.request_id]
    st.block_ids = [list(range(1, req.num_tokens // BLOCK + 2))]
    jobs = sched.plan_saves(req.request_id, req.all_token_ids, req.num_tokens, req.num_tokens)
    from kvtier.protocol import WorkerReport

    sched.on_report(WorkerReport(saves={j.job_id: [1, 0] for j in jobs}))
    assert jobs


@pytest.mark.parametrize("method, hit", [("mtp", 0), (None, CHUNK)])
def test_two_prompts_sharing_a_chunk_and_differing_right_after_it(method: str | None,
                                                                  hit: int) -> None:
    c = _scheduler_connector(method)
    shared = [(7 * i) % 900 + 1 for i in range(CHUNK)]
    a = _request("a", [*shared, 11, 12, 13])
    b = _request("b", [*shared, 21, 12, 13])  # differs at the token after the chunk
    _store_prompt(c, a)
    c.on_new_request(b)
    assert c.get_num_new_matched_tokens(b, 0) == (hit, hit > 0)
    # the prompt that saved the chunk finds it whole, drafts or not
    a2 = _request("a2", a.prompt_token_ids)
    c.on_new_request(a2)
    assert c.get_num_new_matched_tokens(a2, 0) == (CHUNK, True)
