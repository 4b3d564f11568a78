"""kvtier's benchmarks, one module per benchmark, registered here (and only here).

A benchmark module defines::

    HELP: str                                        # one line for `kvtier bench --help`
    def add_arguments(p: argparse.ArgumentParser) -> None
    def run(args: argparse.Namespace) -> int        # the exit code

and is listed in :data:`BENCHES` under its subcommand name; ``kvtier bench NAME ...`` then
runs it. Modules are imported when the CLI builds its parser, so keep their top level light
(no vLLM, no torch). ``kvtier bench`` without a name runs :data:`DEFAULT`.
"""

from __future__ import annotations

BENCHES: dict[str, str] = {
    "serving": "kvtier.bench.serving",
    "planner": "kvtier.bench.planner",
    "transfer": "kvtier.bench.transfer",
    "offline": "kvtier.bench.offline",
    "disk": "kvtier.bench.disk",
}

DEFAULT = "serving"
