"""kvtier's loggers, and the worker's start-up line.

Contract:
- Every kvtier logger is ``vllm.kvtier`` or a child of it (``get_logger("gpu")`` ->
  ``vllm.kvtier.gpu``). Inside vLLM its records therefore reach vLLM's own handler on the
  ``vllm`` logger (vLLM's format, with time and process) and obey ``VLLM_LOGGING_LEVEL``.
- The ``vllm.kvtier`` level is ``VLLM_LOGGING_LEVEL`` (default INFO, as in vLLM), so kvtier's
  INFO lines show outside vLLM too; with ``VLLM_LOGGING_CONFIG_PATH`` set, that file decides.
- Outside vLLM (no handler on ``vllm`` or the root logger when a record is emitted) kvtier's
  own stderr handler writes it; once vLLM (or the application) has configured a handler,
  kvtier's stays silent, so no line is written twice whatever the import order.

This module imports only the standard library (the core may use it; it never imports vLLM).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.layout import Layout

ROOT_LOGGER = "vllm.kvtier"
FORMAT = "%(levelname)s %(asctime)s kvtier[%(process)d] [%(filename)s:%(lineno)d] %(message)s"
DATEFMT = "%m-%d %H:%M:%S"


class FallbackHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to stderr only while no ancestor of ``vllm.kvtier`` has a handler."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter(FORMAT, DATEFMT))

    def emit(self, record: logging.LogRecord) -> None:
        if logging.getLogger("vllm").handlers or logging.getLogger().handlers:
            return  # the record propagates to that handler
        self.stream = sys.stderr  # the current stderr (tests and daemons replace it)
        super().emit(record)


def _configure(root: logging.Logger) -> None:
    if any(isinstance(h, FallbackHandler) for h in root.handlers):
        return
    root.addHandler(FallbackHandler())
    if not os.environ.get("VLLM_LOGGING_CONFIG_PATH"):
        level = os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper()
        root.setLevel(level if isinstance(logging.getLevelName(level), int) else "INFO")


def get_logger(name: str | None = None) -> logging.Logger:
    """kvtier's logger (``vllm.kvtier``), or its child ``vllm.kvtier.NAME``."""
    root = logging.getLogger(ROOT_LOGGER)
    _configure(root)
    return root if not name else root.getChild(name.removeprefix("kvtier."))


def _size(n: int) -> str:
    for unit, f in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= f:
            return f"{n / f:.1f} {unit}"
    return f"{n} B"


def worker_census(rank: int, layout: Layout, chunk_tokens: int, slab_bytes: int,
                  transfer: str) -> str:
    """The worker's one start-up INFO line: what kvtier found in the KV cache and how it
    will move it (``transfer``: e.g. ``cpu threads`` or ``cuda auto``)."""
    per_block = " + ".join(f"{g.bytes_per_block:,}" for g in layout.groups)
    segments = sum(len(g.segments) for g in layout.groups)
    return (f"kvtier worker {rank}: {len(layout.groups)} KV-cache group(s), {segments} "
            f"segment(s), {per_block} bytes per block, chunk {chunk_tokens} tokens, slab "
            f"{_size(slab_bytes)}, transfer {transfer}, layout {layout.fingerprint}")
