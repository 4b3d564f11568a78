"""tests/test_gpu_kernels.py and tests/test_gpu_checksum_kernels.py, each in a process of its
own, with ``TRITON_INTERPRET=1`` and no CUDA device visible, so that no CUDA test ever runs the
interpreted kernel (Triton decides between compiling and interpreting a kernel when its module
is imported, once per process)."""

from __future__ import annotations

import os
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

from _background import Background

HERE = Path(__file__).resolve().parent
# Each file and the fewest tests it must run (a collection that silently shrinks fails).
FILES = {"test_gpu_kernels.py": 40, "test_gpu_checksum_kernels.py": 20,
         "test_gpu_verify.py": 31}


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, tuple[Background, Path]]]:
    """The three interpreted processes, all started at once: each is one busy Python thread
    (the Triton interpreter), so on two cores they take about half as long together as one
    after another. Each test then waits for its own."""
    tmp = tmp_path_factory.mktemp("interpreted")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    started: dict[str, tuple[Background, Path]] = {}
    try:
        for name in sorted(FILES):
            report = tmp / f"{name}.xml"
            started[name] = (Background(
                [sys.executable, "-m", "pytest", str(HERE / name), "-q", "-p",
                 "no:cacheprovider", "-rfEs", f"--junitxml={report}"],
                tmp / f"{name}.log", env=env, cwd=HERE.parent), report)
        yield started
    finally:
        for run, _ in started.values():
            run.kill()


@pytest.mark.parametrize("name", sorted(FILES))
def test_interpreted_kernel_suite(suites: dict[str, tuple[Background, Path]],
                                  name: str) -> None:
    run, report = suites[name]
    rc, log = run.result(800)
    out = log[-8000:]
    assert rc == 0, f"{name} failed in its interpreted process:\n{out}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, out
    n = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert n["failures"] == n["errors"] == 0, out
    assert n["tests"] - n["skipped"] >= FILES[name], \
        f"too few interpreted-kernel tests ran: {n}\n{out}"
