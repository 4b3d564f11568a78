"""Session-wide test settings.

Hypothesis runs derandomized by default (profile ``ci``): every run draws the same examples,
so a CI run cannot pass by missing a bug that another run would have found, and a failure
reproduces. Random exploration is for soak runs (``KVTIER_SOAK=1``, the ``soak`` marker):
profile ``soak`` draws fresh examples each time.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

SOAK = os.environ.get("KVTIER_SOAK") == "1"

settings.register_profile("ci", derandomize=True)
settings.register_profile("soak", derandomize=False)
settings.load_profile("soak" if SOAK else "ci")

# Files that need TRITON_INTERPRET=1 for the whole process. They run in a subprocess of their
# own (tests/test_gpu_interpreted.py); collected here they would need the variable in this
# process, where it would also turn the CUDA tests' kernel into the interpreted one.
INTERPRETED_FILES = frozenset({"test_gpu_kernels.py", "test_gpu_checksum_kernels.py",
                               "test_gpu_verify.py"})


def interpreted_process() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name in INTERPRETED_FILES and not interpreted_process():
        return True
    return None


@pytest.fixture
def kvtier_caplog(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """``caplog`` for kvtier's loggers (``vllm.kvtier.*``) at WARNING and above. Its handler is
    attached to ``vllm.kvtier`` itself: once vLLM configured logging, records under ``vllm``
    do not propagate to the root logger where caplog listens, and another test module may
    have raised the level through VLLM_LOGGING_LEVEL."""
    from kvtier.log import ROOT_LOGGER

    logger = logging.getLogger(ROOT_LOGGER)
    level, propagate = logger.level, logger.propagate
    logger.addHandler(caplog.handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False  # caplog's handler also sits on the root logger: once, not twice
    try:
        yield caplog
    finally:
        logger.removeHandler(caplog.handler)
        logger.setLevel(level)
        logger.propagate = propagate
