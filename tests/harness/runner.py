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
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from unittest import mock

import numpy as np
import torch

from kvtier.load_retry import RetryingLoads
from kvtier.slab import HostSlab
from kvtier.transfer import TransferEngine, find_engine
from kvtier.vllm import worker_side
from kvtier.vllm.connector import KvtierConnector

from . import content
from .compat import (
    IS_025,
    STATE_SHAPE,
    KVConnectorRole,
    ModelRunnerOutput,
    group_layers,
    kv_output,
    runner_output,
)
from .transport import HarnessEngine, Transport
from .workload import BLOCK_SIZE

if TYPE_CHECKING:
    from .oracle import Oracle


NULL_BLOCK = 0  # vLLM's placeholder block (positions a group does not hold)


class FakeCache:
    """The KV cache of every group, over one pool of block ids (vLLM's): per attention layer a
    uint8 tensor (num_blocks, block_size, POS_BYTES), per mamba layer two uint8 tensors
    (num_blocks, 8) of state; and a write tag per block.

    Layers are numbered in engine order (group 0's two, then one per further group); a KV
    position holds :func:`content.values` of its prefix for its layer, a state tensor
    :func:`content.state_value` of the tokens its state has seen."""

    def __init__(self, num_blocks: int, rank: int, groups: tuple[str, ...] = ("full",)) -> None:
        self.rank = rank
        self.kinds = groups
        self.tensors: dict[str, Any] = {}
        # per group: (layer number, int64 view) of every KV layer, or of every state tensor
        self.views: list[list[tuple[int, np.ndarray]]] = []
        layer = 0
        for kind, names in zip(groups, group_layers(groups)):
            views = []
            for name in names:
                if kind == "mamba":
                    ts = [torch.zeros(num_blocks, *STATE_SHAPE, dtype=torch.uint8)
                          for _ in range(content.STATE_TENSORS)]
                    self.tensors[name] = ts
                    views += [(layer, t.view(torch.int64).numpy().reshape(num_blocks))
                              for t in ts]
                else:
                    t = torch.zeros(num_blocks, BLOCK_SIZE, content.POS_BYTES, dtype=torch.uint8)
                    self.tensors[name] = t
                    views.append((layer, t.view(torch.int64).numpy().reshape(num_blocks,
                                                                             BLOCK_SIZE)))
                layer += 1
            self.views.append(views)
        self.tags = np.zeros(num_blocks, dtype=np.int64)
        self._gen = 0

    def tag(self, block: int) -> int:
        return int(self.tags[block])

    def touch(self, blocks: list[int]) -> None:
        if blocks:
            self._gen += 1
            self.tags[blocks] = self._gen

    def write(self, blocks: np.ndarray, offs: np.ndarray, chain: np.ndarray,
              group: int = 0) -> None:
        for layer, w in self.views[group]:
            w[blocks, offs] = content.values(chain, layer, self.rank).view(np.int64)
        self.touch(sorted(set(blocks.tolist())))

    def mismatch(self, blocks: np.ndarray, offs: np.ndarray, chain: np.ndarray,
                 group: int = 0) -> int:
        """Index of the first position whose bytes differ in any layer of ``group``, or -1."""
        idx = np.flatnonzero(self.mismatches(blocks, offs, chain, group))
        return int(idx[0]) if len(idx) else -1

    def mismatches(self, blocks: np.ndarray, offs: np.ndarray, chain: np.ndarray,
                   group: int = 0) -> np.ndarray:
        """Per position: whether its bytes differ in any layer of ``group``."""
        bad = np.zeros(len(chain), dtype=bool)
        for layer, w in self.views[group]:
            bad |= w[blocks, offs] != content.values(chain, layer, self.rank).view(np.int64)
        return bad

    def _state_values(self, group: int, chain_value: int) -> list[np.int64]:
        return [content.state_value(chain_value, layer, i % content.STATE_TENSORS, self.rank)
                for i, (layer, _) in enumerate(self.views[group])]

    def write_state(self, group: int, block: int, chain_value: int) -> None:
        """State group ``group``'s state after the tokens ending in ``chain_value``."""
        for (_, w), v in zip(self.views[group], self._state_values(group, chain_value)):
            w[block] = v
        self.touch([block])

    def state_matches(self, group: int, block: int, chain_value: int) -> bool:
        return all(w[block] == v for (_, w), v in
                   zip(self.views[group], self._state_values(group, chain_value)))


@dataclass
class ReqState:
    req_id: str
    tokens: list[int]
    num_prompt: int
    block_ids: list[list[int]]  # per group
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
        self.kinds: tuple[str, ...] = oracle.scenario.groups
        self.window = oracle.scenario.sliding_window
        self.cache = FakeCache(kv_cache_config.num_blocks, rank, self.kinds)
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
        # whether a uniform decode batch replays a FULL graph: the same on every rank, and
        # drawn apart from the transport's faults (their seeds stay as found)
        self._graph_rng = random.Random(transport.seed ^ 0x6A7)
        original = worker.engine
        engine: TransferEngine = HarnessEngine(transport, rank, worker.mover)
        if isinstance(original, RetryingLoads):  # vLLM 0.25.1, several groups: kvtier's own
            engine = RetryingLoads(engine, original.retries)  # re-issue stays in the path
            transport.failable_load_attempts = 1
        worker.engine = engine
        original.close()
        self.requests: dict[str, ReqState] = {}
        self.scheduler: Any = None  # set by the driver: checks the mirrored block tables
        self.layer_names = [name for names in group_layers(self.kinds) for name in names]
        # this step's reads that found wrong bytes, judged once the step's report is known:
        # (req_id, first position, context length, blocks, wrong positions, group, tokens)
        self._wrong_reads: list[tuple[Any, ...]] = []

    # -- request states ----------------------------------------------------------------------
    def _update_states(self, so: Any) -> None:
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
        for nr in so.scheduled_new_reqs:
            # Model Runner V2: resumed requests come as new ones, with all their tokens
            tokens = getattr(nr, "prefill_token_ids", None) or nr.prompt_token_ids
            self.requests[nr.req_id] = ReqState(
                nr.req_id, list(tokens), len(nr.prompt_token_ids),
                [list(ids) for ids in nr.block_ids], nr.num_computed_tokens)
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
                st.block_ids = [list(ids) for ids in new_ids]
            elif new_ids is not None:
                for table, ids in zip(st.block_ids, new_ids):
                    table.extend(ids)

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
        self._wrong_reads = []
        if forward:
            self._wait_for_layers(so)
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
        self._judge_reads(set(invalid or ()))
        stats = conn.get_kv_connector_stats()
        meta_out = conn.build_connector_worker_meta()
        conn.clear_connector_metadata()
        kv = kv_output(set(recving or ()), set(failed or ()), set(invalid or ()), meta_out, stats)
        self.oracle.on_rank_report(self.rank, kv)
        return runner_output(req_ids, sampled, kv)

    def _wait_for_layers(self, so: Any) -> None:
        """vLLM's attention hook, ``wait_for_layer_load`` per layer in order, before the fake
        forward reads (it reads every layer at once). A step of nothing but one-token queries
        (a uniform decode batch) replays a FULL CUDA graph (``full_graph_replay_p``, half the
        steps by default) and skips every hook, as vLLM's default FULL_AND_PIECEWISE does
        where a graph of that size was captured. With ``skip_layer_wait`` a step with layer-by-layer loads skips them all
        besides (a graph where none should be: kvtier recomputes, or under the asynchronous
        scheduler stops the engine, so not injected there)."""
        f, rng = self.transport.faults, self.transport.rng
        if (max(so.num_scheduled_tokens.values(), default=0) <= 1
                and self._graph_rng.random() < f.full_graph_replay_p):
            self.transport.injected["full_graph_replay"] += 1
            return
        if (f.skip_layer_wait_p and self.worker.loading_by_layer
                and not self.worker.layer_failures_fatal
                and rng.random() < f.skip_layer_wait_p):
            self.transport.injected["skip_layer_wait"] += 1
            return
        for name in self.layer_names:
            self.connector.wait_for_layer_load(name)

    def harness_engine(self) -> HarnessEngine:
        engine = find_engine(self.worker.engine, HarnessEngine)
        assert engine is not None
        return engine

    def _judge_reads(self, invalid: set[int]) -> None:
        """A read that found wrong bytes is a finding unless its block is one of this step's
        layer-by-layer loads that this rank reports to recompute in this very step, or that
        the oracle excuses (another rank's report, the AsyncScheduler's step after one: see
        :meth:`Oracle.excused_blocks`); vLLM then drops what the step computed for the
        requests holding them. Every other wrong position is still a finding."""
        tolerated = (invalid & self.harness_engine().by_layer_blocks) | (
            self.oracle.excused_blocks(self.transport.now))
        for req_id, first, nc, blocks, wrong, g, tokens in self._wrong_reads:
            excused = np.isin(blocks, list(tolerated)) if tolerated else np.zeros(len(blocks),
                                                                                   bool)
            if (wrong & excused).any():
                self.oracle.checked["by_layer_reads_recomputed"] += 1
            bad = np.flatnonzero(wrong & ~excused)
            if len(bad):
                at = int(bad[0])
                self.oracle.wrong_read(self.rank, req_id, first + at, int(blocks[at]), nc,
                                       tokens, g)
        self._wrong_reads = []

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
            for g, kind in enumerate(self.kinds):
                if kind == "mamba":
                    self._forward_state(req_id, st, g, nc, end, chain)
                else:
                    self._forward_kv(req_id, st, g, nc, end, chain)
            st.num_computed = end
            req_ids.append(req_id)
            if end >= len(st.tokens):
                tok = content.next_token(st.chain)
                st.tokens.append(tok)
                sampled.append([tok])
            else:
                sampled.append([])
        return req_ids, sampled

    def _forward_kv(self, req_id: str, st: ReqState, g: int, nc: int, end: int,
                    chain: np.ndarray) -> None:
        """Attention: read what the step's queries attend to (every earlier position; in a
        sliding window only the window before the first query), then write the new ones."""
        first = max(0, nc - self.window + 1) if self.kinds[g] == "swa" else 0
        table = st.block_ids[g]
        if nc > first:
            blocks, offs = positions(table, first, nc)
            wrong = self.cache.mismatches(blocks, offs, chain[first:nc], g)
            if wrong.any():
                self._wrong_reads.append((req_id, first, nc, blocks, wrong, g, st.tokens[:nc]))
        blocks, offs = positions(table, nc, end)
        if (blocks == NULL_BLOCK).any():
            self.oracle.violation("harness", f"rank {self.rank}: {req_id} writes positions "
                                  f"[{nc}, {end}) of group {g} into the null block: {table}")
        self.cache.write(blocks, offs, chain[nc:end], g)

    def _forward_state(self, req_id: str, st: ReqState, g: int, nc: int, end: int,
                       chain: np.ndarray) -> None:
        """A recurrent layer in vLLM's ``align`` mode: the step starts from the state after
        ``nc`` tokens, which must be in block ``(nc - 1) // block_size`` of the group's
        table (null or wrong bytes: ``wrong_state_read``), and leaves the state after ``end``
        tokens in block ``(end - 1) // block_size``."""
        table = st.block_ids[g]
        if nc > 0:
            self.oracle.checked["state_reads"] += 1
            k = (nc - 1) // BLOCK_SIZE
            block = table[k] if k < len(table) else NULL_BLOCK
            if block == NULL_BLOCK or not self.cache.state_matches(g, block, int(chain[nc - 1])):
                self.oracle.wrong_state(self.rank, req_id, g, nc, k, block)
        k = (end - 1) // BLOCK_SIZE
        block = table[k] if k < len(table) else NULL_BLOCK
        if block == NULL_BLOCK:
            self.oracle.violation("harness", f"rank {self.rank}: {req_id} has no state block "
                                  f"at position {k} of group {g} to write: {table}")
            return
        self.cache.write_state(g, block, int(chain[end - 1]))

    def _check_table(self, req_id: str, st: ReqState) -> None:
        """The runner's mirror of the request's block table (built from the scheduler output,
        as a model runner builds it) is a prefix of the scheduler's own. An error reading the
        scheduler's table is the harness's to fix: it propagates (a ``crash`` finding)."""
        tables = self.scheduler.kv_cache_manager.get_block_ids(req_id)
        for g, (kind, mirror) in enumerate(zip(self.kinds, st.block_ids)):
            real = list(tables[g])
            # a sliding-window or state group's released positions read null there (vLLM's
            # remove_skipped_blocks); a worker is never told, and never reads them
            same = len(real) >= len(mirror) and all(
                m == r or (kind != "full" and r == NULL_BLOCK) for m, r in zip(mirror, real))
            if not same:
                self.oracle.violation("harness", f"rank {self.rank}: mirrored block table of "
                                      f"{req_id} group {g} {mirror} != scheduler's {real}")

    def close(self) -> None:
        self.connector.shutdown()
