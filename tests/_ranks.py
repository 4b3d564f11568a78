"""Real multi-process rank groups for tests: every rank a spawned process in one gloo world
(the backend of vLLM's tensor-parallel CPU group), so shared-memory code runs across
processes exactly as under an engine."""

from __future__ import annotations

import multiprocessing as mp
import queue
from collections.abc import Callable
from datetime import timedelta
from typing import Any

RANK_TIMEOUT_S = 120.0  # per run: spawn + import torch + the test's work on a loaded 2-core box


def _rank_main(target: Callable[..., Any], rank: int, world: int, store: str,
               results: Any, args: tuple[Any, ...]) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=60))
    try:
        results.put((rank, True, target(rank, results, *args)))
    except Exception as e:
        results.put((rank, False, f"{type(e).__name__}: {e}"))
    finally:
        dist.destroy_process_group()


class Ranks:
    """``world`` processes, rank r running ``target(r, results, *args)`` in a gloo world.
    ``target`` may put extra ``(rank, "note", value)`` messages on ``results``."""

    def __init__(self, target: Callable[..., Any], world: int, store: str,
                 *args: Any) -> None:
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.procs = [ctx.Process(target=_rank_main, daemon=True,
                                  args=(target, r, world, store, self.results, args))
                      for r in range(world)]
        for p in self.procs:
            p.start()

    def next_message(self, timeout: float = RANK_TIMEOUT_S) -> tuple[int, Any, Any]:
        try:
            return self.results.get(timeout=timeout)
        except queue.Empty:
            self.kill()
            raise AssertionError(f"no rank reported within {timeout:.0f}s") from None

    def outcomes(self) -> list[tuple[bool, Any]]:
        """(ok, return value or error text) of every rank, in rank order."""
        got: dict[int, tuple[bool, Any]] = {}
        while len(got) < len(self.procs):
            rank, ok, value = self.next_message()
            if ok != "note":
                got[rank] = (ok, value)
        self.join()
        return [got[r] for r in range(len(self.procs))]

    def join(self) -> None:
        for p in self.procs:
            p.join(timeout=30)
        self.kill()

    def kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


def run_ranks(target: Callable[..., Any], world: int, store: str,
              *args: Any) -> list[tuple[bool, Any]]:
    """Run ``target`` on ``world`` ranks; every rank's (ok, value or error text)."""
    return Ranks(target, world, store, *args).outcomes()
