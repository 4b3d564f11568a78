"""Session-wide test settings.

Hypothesis runs derandomized by default (profile ``ci``): every run draws the same examples,
so a CI run cannot pass by missing a bug that another run would have found, and a failure
reproduces. Random exploration is for soak runs (``KVTIER_SOAK=1``, the ``soak`` marker):
profile ``soak`` draws fresh examples each time.
"""

from __future__ import annotations

import os
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
INTERPRETED_FILES = frozenset({"test_gpu_kernels.py"})


def interpreted_process() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if collection_path.name in INTERPRETED_FILES and not interpreted_process():
        return True
    return None
