"""Test support: a kvtier connector that also records what vLLM itself says, so checks can be
made independently of kvtier's own bookkeeping. Never used in production.

- Scheduler side: per finished request, vLLM's block table as its workers hold it: built from
  every ``SchedulerOutput`` the way a model runner builds it (new requests, appended blocks,
  resumed requests replaced), overlaid with the ids vLLM passes to
  ``request_finished_all_groups`` (the mirror fills only a state group's null positions).
  The mirror matters for recurrent state: a mamba "align" table nulls its interior states as
  the request advances (they stay in HBM as cached blocks), so the manager's own table at the
  end no longer names the state block of an earlier boundary, while the worker's table, which
  the forward used, still does.
- Worker side: the tensors vLLM registered, untouched, so a check can read a block through
  vLLM's indexing (``kv[b]``) and overwrite every block with a fill pattern; and its transfer
  engine wrapped in a :class:`~kvtier.testing.faults.FaultyEngine` (every fault off until a
  test switches one on) around a :class:`~kvtier.testing.controls.MaskedLoads` (the restore
  check's byte-level negative controls, off until a test sets a mask).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import torch

from kvtier.layout import GroupKind
from kvtier.testing.controls import MaskedLoads, masked_factory
from kvtier.testing.faults import FaultyEngine, faulty_factory
from kvtier.transfer import ChunkMover, TransferEngine, find_engine
from kvtier.vllm.connector import KvtierConnector


class ProbeConnector(KvtierConnector):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.finished_blocks: list[tuple[tuple[int, ...], tuple[list[int], ...]]] = []
        self._tables: dict[str, list[list[int]]] = {}  # worker-side mirror, per request
        self.vllm_kv_caches: dict[str, Any] = {}
        self.num_blocks = int(self._kv_cache_config.num_blocks)

    def build_connector_meta(self, scheduler_output: Any, **kwargs: Any) -> Any:
        self._mirror(scheduler_output)
        return super().build_connector_meta(scheduler_output, **kwargs)

    def _mirror(self, so: Any) -> None:
        """Update the worker-side block tables as a model runner does (both versions)."""
        for req_id in so.finished_req_ids:
            self._tables.pop(req_id, None)
        for nr in so.scheduled_new_reqs:
            self._tables[nr.req_id] = [list(b) for b in nr.block_ids]
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", None) or set()
        for req_id, new_ids in zip(cached.req_ids, cached.new_block_ids):
            if req_id in resumed and new_ids is not None:
                self._tables[req_id] = [list(b) for b in new_ids]
            elif new_ids is not None and req_id in self._tables:
                for table, ids in zip(self._tables[req_id], new_ids):
                    table.extend(ids)

    def request_finished_all_groups(self, request: Any, block_ids: Any, **kwargs: Any
                                    ) -> tuple[bool, dict[str, Any] | None]:
        prompt = tuple(request.prompt_token_ids or ())
        mirror = self._tables.get(request.request_id)
        state = {e for e, spec in zip(self.groups.engine_ids, self.groups.specs)
                 if spec.kind is GroupKind.STATE}
        tables = []
        for g, ids in enumerate(block_ids):
            ids = list(ids)
            if mirror is not None and g in state:  # nulled interior states: the worker's id
                ids = [b or (mirror[g][i] if i < len(mirror[g]) else 0)
                       for i, b in enumerate(ids)]
            tables.append(ids)
        self.finished_blocks.append((prompt, tuple(tables)))
        return super().request_finished_all_groups(request, block_ids, **kwargs)

    def blocks_of(self, prompt: list[int]) -> tuple[list[int], ...]:
        """vLLM's block table (as its workers hold it) of the latest finished request with this
        prompt."""
        key = tuple(prompt)
        for p, blocks in reversed(self.finished_blocks):
            if p == key:
                return blocks
        raise KeyError("no finished request with this prompt")

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self.vllm_kv_caches = dict(kv_caches)
        super().register_kv_caches(kv_caches)

    def _engine_factory(self, device_is_cuda: bool
                        ) -> Callable[[ChunkMover], TransferEngine] | None:
        return faulty_factory(masked_factory(super()._engine_factory(device_is_cuda)))

    @property
    def faults(self) -> FaultyEngine:
        """The fault switches of this worker's transfer engine."""
        worker = self.worker_side.worker
        faults = find_engine(worker.engine if worker is not None else None, FaultyEngine)
        assert faults is not None, "no FaultyEngine in this worker's engine stack"
        return faults

    @property
    def load_controls(self) -> MaskedLoads:
        """The byte-level negative controls of this worker's loads."""
        controls = find_engine(self.faults, MaskedLoads)
        assert controls is not None, "no MaskedLoads in this worker's engine stack"
        return controls

    # -- worker-side checks, through vLLM's tensors only -----------------------------------
    def _tensors(self, value: Any) -> list[torch.Tensor]:
        return [value] if isinstance(value, torch.Tensor) else list(value)

    def block_checksums(self, layer_names: list[str], block_ids: list[int]) -> list[str]:
        """One digest per block over every listed layer, read as ``kv[b]`` (kernel blocks
        folded: ``kv[b*r:(b+1)*r]`` when dim 0 counts kernel blocks)."""
        out = []
        for b in block_ids:
            h = hashlib.blake2b(digest_size=16)
            for name in layer_names:
                for t in self._tensors(self.vllm_kv_caches[name]):
                    r = t.shape[0] // self.num_blocks
                    piece = t[b * r:(b + 1) * r] if r > 1 else t[b]
                    h.update(piece.contiguous().view(torch.uint8).cpu().numpy().tobytes())
            out.append(h.hexdigest())
        return out

    def fill_all(self, byte: int = 0x47) -> int:
        """Overwrite every byte of every registered cache (and state) storage. Waits for
        kvtier's transfers first: a save still reading must not see the pattern. The default
        byte makes large values in any float format (0x4747... is 5.1e4 in float32 and
        bfloat16), so an unrestored block is loud in the output."""
        if self.worker_side.worker is not None:
            self.worker_side.worker.drain()
        seen: set[int] = set()
        n = 0
        for value in self.vllm_kv_caches.values():
            for t in self._tensors(value):
                st = t.untyped_storage()
                if st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                torch.empty(0, dtype=torch.uint8, device=t.device).set_(st).fill_(byte)
                n += st.nbytes()
        return n


    def fill_keeping(self, byte: int, keep: list[tuple[list[str], list[int]]]) -> int:
        """:meth:`fill_all`, except the blocks listed per group (layer names, block ids, read
        as :meth:`block_checksums` reads them), which keep their bytes: what vLLM's prefix
        cache holds for a prompt stays, everything around it becomes the pattern. Storages
        shared between groups are safe: every kept piece is read before the fill and written
        back after it, so aliased pieces get back the bytes they had."""
        if self.worker_side.worker is not None:
            self.worker_side.worker.drain()
        saved = []
        for layers, ids in keep:
            for name in layers:
                for t in self._tensors(self.vllm_kv_caches[name]):
                    r = t.shape[0] // self.num_blocks
                    for b in ids:
                        piece = t[b * r:(b + 1) * r] if r > 1 else t[b]
                        saved.append((piece, piece.clone()))
        n = self.fill_all(byte)
        for piece, copy in saved:
            piece.copy_(copy)
        return n


def fill_worker_kv_caches(worker: Any, byte: int = 0x47) -> int:
    """For ``LLM.collective_rpc``: overwrite every KV cache byte of this worker (through the
    model runner's own tensors) after kvtier's in-flight transfers finished."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    connector = get_kv_transfer_group()
    if connector.worker_side.worker is not None:
        connector.worker_side.worker.drain()
    seen: set[int] = set()
    n = 0
    for t in worker.model_runner.kv_caches:
        for part in ([t] if isinstance(t, torch.Tensor) else list(t)):
            st = part.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                torch.empty(0, dtype=torch.uint8, device=part.device).set_(st).fill_(byte)
                n += st.nbytes()
    return n


# -- worker-side checks through LLM.collective_rpc (any executor, any TP size) -------------
def rpc_block_checksums(worker: Any, groups: list[tuple[list[str], list[int]]]) -> list[list[str]]:
    """Per group (layer names, block ids): checksums read through vLLM's tensors."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    probe = get_kv_transfer_group()
    return [probe.block_checksums(layers, ids) for layers, ids in groups]


def rpc_fill(worker: Any, byte: int = 0x47) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return int(get_kv_transfer_group().fill_all(byte))


def rpc_fill_keeping(worker: Any, byte: int, keep: list[tuple[list[str], list[int]]]) -> int:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return int(get_kv_transfer_group().fill_keeping(byte, keep))


def rpc_worker_facts(worker: Any) -> dict[str, Any]:
    """This rank's kvtier worker: rank, shards, whether it writes, bytes moved so far."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    w = get_kv_transfer_group().worker_side.worker
    return {"rank": w.rank, "shards": w.slab_layout.num_shards, "writes": w.writes,
            "replicated": w.replicated, "bytes_stored": w.total_bytes_stored,
            "bytes_loaded": w.total_bytes_loaded}


def rpc_skip_state_loads(worker: Any, skip: bool = True) -> int:
    """The restore check's negative control for hybrids, on every rank: loads skip their
    recurrent-state ops while reporting success (:class:`~kvtier.testing.faults.FaultyEngine`
    ``skip_state_loads``). Returns the faults this rank injected so far."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    faults = get_kv_transfer_group().faults
    faults.skip_state_loads = skip
    return int(faults.injected)


def rpc_fail_next_loads(worker: Any, rank: int, n: int = 1) -> bool:
    """Make the next ``n`` loads fail on one rank only."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    probe = get_kv_transfer_group()
    if probe.worker_side.worker.rank == rank:
        probe.faults.fail_loads = n
        return True
    return False
