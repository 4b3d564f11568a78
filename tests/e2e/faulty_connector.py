"""A test connector for end-to-end tests whose workers run in other processes: kvtier's
connector with its transfer engine wrapped in :class:`kvtier.testing.faults.FaultyEngine`.

Load it with ``"kv_connector": "FaultyConnector", "kv_connector_module_path":
"tests.e2e.faulty_connector"``. The switches a worker starts with come from the environment
variable :data:`FAULTS_ENV` (a JSON object of FaultyEngine attributes, e.g.
``{"fail_loads": 1}``), which worker processes inherit; :func:`rpc_faults` reads them back
through ``LLM.collective_rpc``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from kvtier.testing.faults import FaultyEngine, faulty_factory
from kvtier.transfer import ChunkMover, TransferEngine
from kvtier.vllm.connector import KvtierConnector

FAULTS_ENV = "TESTS_KVTIER_FAULTS"  # not KVTIER_*: kvtier's settings reject unknown ones

SWITCHES = ("raise_in_jobs", "skip_load_chunk", "fail_loads", "hold_steps")


class FaultyConnector(KvtierConnector):
    def _engine_factory(self, device_is_cuda: bool
                        ) -> Callable[[ChunkMover], TransferEngine] | None:
        wrap = faulty_factory(super()._engine_factory(device_is_cuda))
        switches = json.loads(os.environ.get(FAULTS_ENV, "{}"))
        unknown = set(switches) - set(SWITCHES)
        if unknown:
            raise ValueError(f"{FAULTS_ENV}: unknown fault switches {sorted(unknown)}")

        def make(mover: ChunkMover) -> FaultyEngine:
            engine = wrap(mover)
            for name, value in switches.items():
                setattr(engine, name, int(value))
            return engine

        return make


def rpc_faults(worker: Any) -> dict[str, int]:
    """For ``LLM.collective_rpc``: this rank's switches and how many faults fired."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    engine = get_kv_transfer_group().worker_side.worker.engine
    assert isinstance(engine, FaultyEngine)
    return {name: getattr(engine, name) for name in (*SWITCHES, "injected")}
