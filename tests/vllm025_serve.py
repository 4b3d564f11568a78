"""``kvtier serve --dry-run`` on vLLM 0.25.1: the server module it would run and vLLM 0.25.1's
own parser checking the command (a known flag passes, a mistyped one is one line).

    cd tests && PYTHONPATH=../.cache/vllm-0.25.1:.:../src python -m vllm025_serve

0.25.1's sources here are its CUDA build, which finds no device on a CPU-only machine, and its
argument parser asks the platform for the device type; the script sets vLLM's CPU platform
(the one its CPU wheel selects), which changes nothing about the parser or the server module.
Prints one JSON line: the version, the printed command, the file of the module it names (it
imports) and whether it has ``run_server``, and the exit codes and stderr lines.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json

import vllm
import vllm.platforms
from vllm.platforms.cpu import CpuPlatform

from kvtier.cli import main


def dry_run(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(["serve", "m", "--dry-run", *argv])
    return code, out.getvalue(), err.getvalue()


if __name__ == "__main__":
    vllm.platforms.current_platform = CpuPlatform()
    ok = dry_run("--max-model-len", "512", "--dram-size", "1GiB")
    bad = dry_run("--max-model-lenn", "512")
    server = importlib.import_module(ok[1].split()[2])  # the module kvtier serve would run
    print(json.dumps({"version": vllm.__version__, "ok_code": ok[0], "command": ok[1].split(),
                      "server_file": server.__file__,
                      "server_runs": callable(getattr(server, "run_server", None)),
                      "bad_code": bad[0], "bad_err": bad[2].strip().splitlines()}))
