"""One simulated worker: a fake paged KV cache, a fake forward, and a real worker-side
KvtierConnector driven in vLLM's order.

Per step (vLLM's Model Runner V1 and ``KVConnectorModelRunnerMixin``, both versions)::

    handle_preemptions(meta) -> update request states -> bind_connector_metadata(meta)
    -> [start_load_kv: 0.25.1 always here] -> forward -> [start_load_kv: 0.32 here]
    -> wait_for_save [not on 0.25.1 steps without a forward]
    -> get_transfer_results (0.32) | get_finished (0.25.1) -> get_block_ids_with_load_errors
    -> get_kv_connector_stats -> build_connector_worker_meta -> clear_connector_metadata

The runner mirrors the requests from each ``SchedulerOutput`` the way vLLM's runner does (new
requests, cached requests appending blocks, resumed requests replacing their table, finished
requests dropped), and its forward:

- *reads* every position before the scheduled ones (what attention reads) and checks each
  holds the bytes of this request's prefix (:mod:`.content`); a mismatch is an oracle finding;
- *writes* the scheduled positions; and samples the next token when the prompt is done.

Its engine is a :class:`~.transport.HarnessEngine` swapped in after ``register_kv_caches``.
"""

from __future__ import annotations

import os
import pickle
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np
import torch

from kvtier.slab import HostSlab
from kvtier.vllm import worker_side
from kvtier.vllm.connector import KvtierConnector

from . import content
from .compat import IS_025, LAYERS, KVConnectorRole, ModelRunnerOutput, kv_output, runner_output
from .transport import HarnessEngine, Transport
from .workload import BLOCK_SIZE

if TYPE_CHECKING:
    from .oracle import Oracle


class FakeCache:
    """Per-layer uint8 tensors (num_blocks, block_size, POS_BYTES) and a write tag per block."""

    def __init__(self, num_blocks: int, rank: int) -> None:
        self.rank = rank
        self.tensors = {name: torch.zeros(num_blocks, BLOCK_SIZE, content.POS_BYTES,
                                          dtype=torch.uint8) for name in LAYERS}
        self.words = [t.view(torch.int64).numpy().reshape(num_blocks, BLOCK_SIZE)
                      for t in self.tensors.values()]
        self.tags = np.zeros(num_blocks, dtype=np.int64)
        self._gen = 0

    def tag(self, block: int) -> int:
        return int(self.tags[block])

    def touch(self, blocks: list[int]) -> None:
        if blocks:
            self._gen += 1
            self.tags[blocks] = self._gen

    def write(self, blocks: np.ndarray, offs: np.ndarray, chain: np.ndarray) -> None:
        for layer, w in enumerate(self.words):
            w[blocks, offs] = content.values(chain, layer, self.rank).view(np.int64)
        self.touch(sorted(set(blocks.tolist())))

    def mismatch(self, blocks: np.ndarray, offs: np.ndarray, chain: np.ndarray) -> int:
        """Index of the first position whose bytes differ in any layer, or -1."""
        bad = np.zeros(len(chain), dtype=bool)
        for layer, w in enumerate(self.words):
            bad |= w[blocks, offs] != content.values(chain, layer, self.rank).view(np.int64)
        idx = np.flatnonzero(bad)
        return int(idx[0]) if len(idx) else -1


@dataclass
class ReqState:
    req_id: str
    tokens: list[int]
    num_prompt: int
    block_ids: list[int]
    num_computed: int
    chain: list[int] = field(default_factory=list)

    def chain_array(self, n: int) -> np.ndarray:
        if len(self.chain) < n:
            content.extend_chain(self.chain, self.tokens[:n])
        return np.asarray(self.chain[:n], dtype=np.uint64)


def positions(block_ids: list[int], start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
    pos = np.arange(start, end)
    table = np.asarray(block_ids, dtype=np.int64)
    return table[pos // BLOCK_SIZE], pos % BLOCK_SIZE


class FakeRunner:
    def __init__(self, rank: int, vllm_config: Any, kv_cache_config: Any, transport: Transport,
                 oracle: Oracle, slab_of_rank0: HostSlab | None = None) -> None:
        self.rank = rank
        self.oracle = oracle
        self.transport = transport
        self.cache = FakeCache(kv_cache_config.num_blocks, rank)
        transport.caches[rank] = self.cache
        self.connector = KvtierConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        old = os.environ.get("RANK")
        os.environ["RANK"] = str(rank)  # kvtier reads the rank from vLLM's world group, or RANK
        try:
            # Every rank of the harness lives in this one process, where no collective across
            # ranks can run: each builds a private slab (no shared segment), and rank 0's slab
            # then serves every rank, as the one shared segment does for real ranks.
            with mock.patch.object(worker_side, "engine_shared_slab", lambda _config: None):
                self.connector.register_kv_caches(dict(self.cache.tensors))
        finally:
            if old is None:
                del os.environ["RANK"]
            else:
                os.environ["RANK"] = old
        worker = self.connector.worker_side.worker
        assert worker is not None, "kvtier did not start its worker half"
        if slab_of_rank0 is not None:
            worker.slab.close()
            worker.slab = worker.mover.slab = slab_of_rank0
        self.worker = worker
        original = worker.engine
        worker.engine = HarnessEngine(transport, rank, worker.mover)
        original.close()
        self.requests: dict[str, ReqState] = {}
        self.scheduler: Any = None  # set by the driver: checks the mirrored block tables

    # -- request states ----------------------------------------------------------------------
    def _update_states(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for nr in so.scheduled_new_reqs:
            # Model Runner V2: resumed requests come as new ones, with all their tokens
            tokens = getattr(nr, "prefill_token_ids", None) or nr.prompt_token_ids
            self.requests[nr.req_id] = ReqState(
                nr.req_id, list(tokens), len(nr.prompt_token_ids),
                list(nr.block_ids[0]), nr.num_computed_tokens)
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for i, req_id in enumerate(cached.req_ids):
            st = self.requests[req_id]
            st.num_computed = cached.num_computed_tokens[i]
            n_out = cached.num_output_tokens[i]
            all_ids = (cached.all_token_ids or {}).get(req_id)
            if req_id in resumed and all_ids is not None and n_out > 0:
                st.tokens = st.tokens[: st.num_prompt] + list(all_ids[-n_out:])
                st.chain = []
            elif n_out < len(st.tokens) - st.num_prompt:
                del st.tokens[st.num_prompt + n_out:]
            if len(st.chain) > len(st.tokens):
                del st.chain[len(st.tokens):]
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                assert new_ids is not None
                st.block_ids = list(new_ids[0])
            elif new_ids is not None:
                st.block_ids.extend(new_ids[0])

    # -- the step ----------------------------------------------------------------------------
    def execute(self, so: Any) -> ModelRunnerOutput:
        conn = self.connector
        meta = pickle.loads(pickle.dumps(so.kv_connector_metadata))  # a worker gets a copy
        conn.handle_preemptions(meta)
        self._update_states(so)
        forward = so.total_num_scheduled_tokens > 0
        conn.bind_connector_metadata(meta)
        before = IS_025 or bool(getattr(so, "has_sync_kv_loads", False))
        if before:
            conn.start_load_kv(None)
        req_ids: list[str] = []
        sampled: list[list[int]] = []
        if forward:
            req_ids, sampled = self._forward(so)
        if not before:
            conn.start_load_kv(None)
        if forward or not IS_025:
            conn.wait_for_save()
        if IS_025:
            _sending, recving = conn.get_finished(so.finished_req_ids)
            failed: set[str] = set()
        else:
            res = conn.get_transfer_results(so.finished_req_ids)
            recving, failed = res.finished_recving, res.failed_recving
        invalid = conn.get_block_ids_with_load_errors()
        stats = conn.get_kv_connector_stats()
        meta_out = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        kv = kv_output(set(recving or ()), set(failed or ()), set(invalid or ()), meta_out, stats)
        self.oracle.on_rank_report(self.rank, kv)
        return runner_output(req_ids, sampled, kv)

    def _forward(self, so: Any) -> tuple[list[str], list[list[int]]]:
        req_ids, sampled = [], []
        for req_id, n in so.num_scheduled_tokens.items():
            st = self.requests[req_id]
            nc = st.num_computed
            end = nc + n
            if end > len(st.tokens):
                self.oracle.violation(
                    "harness", f"rank {self.rank}: {req_id} scheduled to {end} tokens but the "
                    f"runner knows {len(st.tokens)}")
                end = len(st.tokens)
            if self.scheduler is not None:
                self._check_table(req_id, st)
            chain = st.chain_array(end)
            if nc > 0:
                blocks, offs = positions(st.block_ids, 0, nc)
                bad = self.cache.mismatch(blocks, offs, chain[:nc])
                if bad >= 0:
                    self.oracle.wrong_read(self.rank, req_id, bad, int(blocks[bad]), nc,
                                           st.tokens[:nc])
            blocks, offs = positions(st.block_ids, nc, end)
            self.cache.write(blocks, offs, chain[nc:end])
            st.num_computed = end
            req_ids.append(req_id)
            if end >= len(st.tokens):
                tok = content.next_token(st.chain)
                st.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return req_ids, sampled

    def _check_table(self, req_id: str, st: ReqState) -> None:
        """The runner's mirror of the request's block table (built from the scheduler output,
        as a model runner builds it) is a prefix of the scheduler's own. An error reading the
        scheduler's table is the harness's to fix: it propagates (a ``crash`` finding)."""
        real = list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])
        if real[: len(st.block_ids)] != st.block_ids:
            self.oracle.violation("harness", f"rank {self.rank}: mirrored block table of {req_id} "
                                  f"{st.block_ids} != scheduler's {real}")

    def close(self) -> None:
        self.connector.shutdown()
