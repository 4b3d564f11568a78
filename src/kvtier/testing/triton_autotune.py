"""Fewer Triton autotune configurations for the GPU tools' engines (test machinery only).

vLLM's FLA kernels (KDA, gated delta-net) are ``@triton.autotune``-decorated with up to 144
configurations each; every new engine process compiles and times all of them at first use,
which took Kimi-Linear's engines past four minutes on the H200 before the first token (and six
engines starting at once took longer still). The tools of ``tools/gpu_*.py`` call
:func:`limit_autotune` before vLLM imports its kernels, so that every engine of a run does the
same, smaller search:

* ``keep=1``: one configuration per kernel, the same in every process: no timing at all, and
  the engines of a restore check (cold, kvtier, negative controls) run identical kernels, so a
  comparison across processes is not confounded by each process's autotuner picking another
  configuration (a different tile is a different summation order).
* ``keep=N``: N configurations spread over the list (first, last and evenly between); with
  ``TRITON_CACHE_AUTOTUNING=1`` the first process's choice is cached on disk for the others.

Never used by kvtier itself; every configuration of a comparison runs under the same limit.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "GPU_TOOLS_AUTOTUNE_KEEP"


def pick(configs: list[Any], keep: int) -> list[Any]:
    """``keep`` configurations of ``configs``, deterministic: for one, the one with the fewest
    pipeline stages, then warps nearest 4, then the smallest tile parameters (it always fits in
    shared memory when any does); for more, evenly spaced picks in list order."""
    configs = list(configs)
    if keep <= 0 or len(configs) <= keep:
        return configs
    if keep == 1:
        def cost(c: Any) -> tuple:
            kwargs = getattr(c, "kwargs", {}) or {}
            return (getattr(c, "num_stages", 0) or 0, abs((getattr(c, "num_warps", 4) or 4) - 4),
                    sum(v for v in kwargs.values() if isinstance(v, int)))
        return [min(configs, key=cost)]
    step = (len(configs) - 1) / (keep - 1)
    return [configs[round(i * step)] for i in range(keep)]


def limit_autotune(keep: int | None = None) -> int:
    """Make ``triton.autotune`` keep at most ``keep`` configurations (default: the
    ``GPU_TOOLS_AUTOTUNE_KEEP`` variable; 0 or unset changes nothing). Call before the
    kernels' modules are imported; returns the limit in force. Idempotent."""
    if keep is None:
        keep = int(os.environ.get(ENV, "0") or 0)
    if keep <= 0:
        return 0
    import triton

    original = getattr(triton.autotune, "__wrapped_autotune__", triton.autotune)

    def autotune(configs: list[Any], key: list[str], *args: Any, **kwargs: Any) -> Any:
        return original(pick(configs, keep), key, *args, **kwargs)

    autotune.__wrapped_autotune__ = original  # type: ignore[attr-defined]
    triton.autotune = autotune
    os.environ[ENV] = str(keep)  # the tools' child processes do the same
    return keep
