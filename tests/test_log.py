"""kvtier's loggers: under ``vllm.kvtier``, written once by vLLM's real handler inside vLLM
and by kvtier's own outside it; and the worker's start-up census line.

Logging is process-global, so each scenario runs in a fresh interpreter.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap

import torch

from kvtier.layout import GroupKind, GroupSpec, build_layout
from kvtier.log import ROOT_LOGGER, get_logger, worker_census

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
# vLLM 0.32 configures logging when an engine or server starts (configure_logging); 0.25.1
# when vllm.logger is imported. Either way, this is the configuration vLLM processes run with.
CONFIGURE_VLLM = """
import vllm.logger as vl
if hasattr(vl, "configure_logging"):
    from vllm.config.logging import LoggingConfig
    vl.configure_logging(LoggingConfig())
"""
EMIT = """
from kvtier.log import get_logger
get_logger("gpu.engine").info("census-probe %d", 7)
get_logger().warning("warn-probe")
"""


def _run(code: str, **env: str) -> str:
    # a level another test module set in this process (tests/harness sets ERROR) must not leak
    inherited = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    e = {**inherited, "PYTHONPATH": SRC, **env}
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, env=e, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout + out.stderr


def test_every_kvtier_logger_is_under_vllm() -> None:
    assert get_logger().name == ROOT_LOGGER == "vllm.kvtier"
    lg = get_logger("gpu.engine")
    assert lg.name == "vllm.kvtier.gpu.engine" and get_logger("kvtier.gpu.engine") is lg
    assert lg.parent is not None and lg.parent.name == "vllm.kvtier"


def test_outside_vllm_kvtier_writes_its_info_lines_with_time_and_process() -> None:
    out = _run(EMIT)
    (line,) = [x for x in out.splitlines() if "census-probe" in x]
    assert re.match(r"INFO \d\d-\d\d \d\d:\d\d:\d\d kvtier\[\d+\] \[<string>:\d+\] "
                    r"census-probe 7$", line), line
    assert out.count("warn-probe") == 1


def test_under_vllm_logging_its_handler_writes_each_line_once() -> None:
    out = _run(EMIT + CONFIGURE_VLLM + EMIT.replace("7", "8"))  # before and after vLLM's
    for n in (7, 8):
        lines = [x for x in out.splitlines() if f"census-probe {n}" in x]
        assert len(lines) == 1, out
    (after,) = [x for x in out.splitlines() if "census-probe 8" in x]
    assert "kvtier[" not in after and re.search(r"\bINFO \d\d-\d\d ", after)  # vLLM's format
    assert out.count("warn-probe") == 2


def test_vllm_logging_level_applies_to_kvtier() -> None:
    out = _run(CONFIGURE_VLLM + EMIT, VLLM_LOGGING_LEVEL="WARNING")
    assert "census-probe" not in out and out.count("warn-probe") == 1


def test_worker_census_names_groups_segments_bytes_chunk_slab_and_path() -> None:
    nb = 6
    k = torch.zeros(2, nb, 32, 4, 8)  # K and V of one layer: two segments
    layout = build_layout({"model.layers.0.attn": k},
                          [GroupSpec(GroupKind.FULL, 32, ("model.layers.0.attn",))], nb)
    line = worker_census(1, layout, 256, 3 * 2**30, "cpu threads")
    per_block = layout.groups[0].bytes_per_block
    assert per_block == 2 * 32 * 4 * 8 * 4
    assert line == (f"kvtier worker 1: 1 KV-cache group(s), 2 segment(s), {per_block:,} bytes "
                    f"per block, chunk 256 tokens, slab 3.0 GiB, transfer cpu threads, layout "
                    f"{layout.fingerprint}")
