"""tests/test_gpu_kernels.py and tests/test_gpu_checksum_kernels.py, each in a process of its
own, with ``TRITON_INTERPRET=1`` and no CUDA device visible, so that no CUDA test ever runs the
interpreted kernel (Triton decides between compiling and interpreting a kernel when its module
is imported, once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
# Each file and the fewest tests it must run (a collection that silently shrinks fails).
FILES = {"test_gpu_kernels.py": 40, "test_gpu_checksum_kernels.py": 20,
         "test_gpu_verify.py": 21}


@pytest.mark.parametrize("name", sorted(FILES))
def test_interpreted_kernel_suite(tmp_path: Path, name: str) -> None:
    file = HERE / name
    report = tmp_path / "junit.xml"
    env = dict(os.environ, TRITON_INTERPRET="1", CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", str(file), "-q", "-p", "no:cacheprovider", "-rfEs",
         f"--junitxml={report}"],
        cwd=HERE.parent, env=env, capture_output=True, text=True, timeout=800)
    out = proc.stdout[-6000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, f"{name} failed in its interpreted process:\n{out}"
    suite = ET.parse(report).getroot()
    suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
    assert suite is not None, out
    n = {k: int(suite.get(k, "0")) for k in ("tests", "failures", "errors", "skipped")}
    assert n["failures"] == n["errors"] == 0, out
    assert n["tests"] - n["skipped"] >= FILES[name], \
        f"too few interpreted-kernel tests ran: {n}\n{out}"
