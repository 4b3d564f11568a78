"""The scheduler half and one worker on the small CPU KV cache of ``tests/_small_kv.py``, wired
as the connector wires them (plan -> worker -> report -> scheduler), for tests of whole
lifecycles: prefill a prompt chunk by chunk (saving every chunk with its recurrent state), then
look it up and restore it into other blocks."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from _small_kv import CHUNK_TOKENS, CONFIG, SmallKV
from kvtier.config import KvtierConfig
from kvtier.scheduler import NewRequest, OffloadScheduler, ScheduledTokens, StepInput
from kvtier.transfer import ChunkMover, TransferEngine
from kvtier.worker import OffloadWorker, StepResult

PROMPT = 3 * CHUNK_TOKENS + 1  # three whole chunks: a hit restores 96 tokens
FULL_A, STATE_A = list(range(1, 8)), list(range(1, 5))  # the first request's blocks
FULL_B, STATE_B = list(range(10, 17)), list(range(10, 14))  # the second's


def prompt(seed: int = 0) -> list[int]:
    return [(seed * 7919 + 31 * i) % 997 + 3 for i in range(PROMPT)]


class Tier:
    def __init__(self, config: KvtierConfig | None = None, seed: int = 0,
                 engine: Callable[[ChunkMover], TransferEngine] | None = None,
                 **scheduler_kw: object) -> None:
        self.config = config or CONFIG.model_copy(update={"cost_model": False})
        self.kv = SmallKV(seed=seed)
        self.worker = OffloadWorker(self.config, self.kv.layout, CHUNK_TOKENS,
                                    engine_factory=engine)
        self.sched = OffloadScheduler(self.config, self.worker.geometry, b"t" * 16,
                                      self.worker.slab_layout, **scheduler_kw)  # type: ignore[arg-type]

    def step(self, step: StepInput | None = None) -> StepResult:
        """One engine step: the plan, the worker's transfers (given time to finish), the
        report back."""
        plan = self.sched.schedule_step(step or StepInput())
        w = self.worker
        w.fence(plan)
        w.begin_step(plan)
        w.end_step(plan)
        w.drain()
        res = w.collect()
        self.sched.on_report(res.report)
        return res

    def prefill(self, req: str, tokens: Sequence[int], full: list[int] = FULL_A,
                state: list[int] = STATE_A) -> None:
        """Compute ``tokens`` one chunk per step (so every chunk's state is saved) and
        finish the request."""
        self.sched.add_request(req)
        assert self.sched.lookup(req, tokens, 0) == 0
        n = len(tokens)
        done = 0
        first = True
        while done < n:
            done = min(n, done + CHUNK_TOKENS)
            new = [NewRequest(req, [full, state])] if first else []
            first = False
            self.step(StepInput(new=new, scheduled=[ScheduledTokens(req, tokens, done, n)]))
        self.sched.request_finished(req)
        self.step()

    def restore(self, req: str, tokens: Sequence[int], full: list[int] = FULL_B,
                state: list[int] = STATE_B) -> tuple[int, StepResult]:
        """Look ``tokens`` up and, on a hit, load it into ``full``/``state``: (tokens
        promised, the step's result)."""
        self.sched.add_request(req)
        n = self.sched.lookup(req, tokens, 0)
        if n:
            self.sched.start_load(req, n, [full, state])
        return n, self.step(StepInput(new=[NewRequest(req, [full, state])]))

    def close(self) -> None:
        self.worker.close()
