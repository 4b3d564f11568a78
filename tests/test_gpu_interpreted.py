"""tests/test_gpu_kernels.py and tests/test_gpu_checksum_kernels.py, each in a process of its
own, with ``TRITON_INTERPRET=1`` and no CUDA device visible, so that no CUDA test ever runs the
interpreted kernel (Triton decides between compiling and interpreting a kernel when its module
is imported, once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Each file and the fewest tests it must run (a collection that silently shrinks fails).
FILES = {"test_gpu_kernels.py": 40, "test_gpu_checksum_kernels.py": 20,
         "test_gpu_verify.py": 21}


@pytest.fixture(scope="module")
def suites(tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], Path]]]:
    """The three interpreted processes, all started at once: each is one busy Python thread
    (the Triton interpreter), so on two cores they take about half as long together as one
    after another. Each test then waits for its own."""
    tmp = tmp_path_factory.mktemp("interpreted")
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    started: dict[str, tuple[subprocess.Popen[bytes], Path]] = {}
    try:
        for name in sorted(FILES):
            report = tmp / f"{name}.xml"
            with open(tmp / f"{name}.out", "wb") as out, open(tmp / f"{name}.err", "wb") as err:
                started[name] = (subprocess.Popen(
                    [sys.executable, "-m", "pytest", str(HERE / name), "-q", "-p",
                     "no:cacheprovider", "-rfEs", f"--junitxml={report}"],
                    cwd=HERE.parent, env=env, stdout=out, stderr=err), report)
        yield started
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


@pytest.mark.parametrize("name", sorted(FILES))
def test_interpreted_kernel_suite(
        suites: dict[str, tuple[subprocess.Popen[bytes], Path]], name: str) -> None:
    proc, report = suites[name]
    proc.wait(timeout=800)
    out = (report.with_suffix(".out").read_text(errors="replace")[-6000:]
           + report.with_suffix(".err").read_text(errors="replace")[-2000:])
    assert proc.returncode == 0, f"{name} failed in its interpreted process:\n{out}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, out
    n = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert n["failures"] == n["errors"] == 0, out
    assert n["tests"] - n["skipped"] >= FILES[name], \
        f"too few interpreted-kernel tests ran: {n}\n{out}"
