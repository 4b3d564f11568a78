"""Wall seconds by kind of step for `kvtier bench offline` run JSONs written before the bench
recorded each step's kind and batch (H200 sessions 14-16), through the bench's own
:func:`kvtier.bench.steps.step_kinds`.

Those JSONs keep each step's token count but not its requests' phases, so a step is taken
as a decode step of ``tokens`` requests when it scheduled at least one and at most
``--max-decode-tokens`` tokens (the run's ``max_num_seqs``: a decode step schedules one
token per request; a prefill step that small would be counted as a decode). JSONs that
have the kinds are read as they are.

    python tools/step_kinds_legacy.py --max-decode-tokens 16 \\
        bench/results/2026-12-04-gpu-h200-session16/seed-scale/*-r0.json.gz
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
from typing import Any

from kvtier.bench.steps import STEP_KINDS, step_kinds


def with_kinds(steps: list[dict[str, Any]], max_decode_tokens: int) -> list[dict[str, Any]]:
    out = []
    for s in steps:
        if "kind" not in s:
            tokens = s["tokens"]
            if s["parked"]:
                kind = "parked"
            elif tokens == 0:
                kind = "idle"
            else:
                kind = "decode" if tokens <= max_decode_tokens else "prefill"
            s = {**s, "kind": kind, "batch": tokens if kind == "decode" else 0}
        out.append(s)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", help="run JSONs (.json or .json.gz)")
    p.add_argument("--max-decode-tokens", type=int, required=True)
    args = p.parse_args(argv)
    for path in args.runs:
        with (gzip.open if path.endswith(".gz") else open)(path, "rt") as f:
            run = json.load(f)
        kinds = step_kinds(with_kinds(run["steps"], args.max_decode_tokens))
        cells = ", ".join(f"{k} {kinds[k]['steps']} steps {kinds[k]['seconds']:.2f} s"
                          for k in STEP_KINDS)
        medians = ", ".join(f"{b}: {1000 * v:.2f}"
                            for b, v in kinds["decode_median_s_by_batch"].items())
        print(f"{os.path.basename(path)}: wall {run['wall_s']:.2f} s; {cells}; "
              f"decode median ms by batch {{{medians}}}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
