"""``kvtier serve``: the server module of the installed vLLM, checks before vLLM starts (a
held port, a mistyped flag), readiness only from its own child, and the child's life bound to
the wrapper's. Real processes throughout; the wrapper-death tests drive the very function
``kvtier serve`` spawns vLLM with (:func:`kvtier.vllm.child.spawn`) on a long-running child.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from _harness_runs import run_module_025
from kvtier.bench.serving import free_port
from kvtier.cli import main
from kvtier.config import ConfigError
from kvtier.vllm import child, entry, serve

ROOT = Path(__file__).resolve().parents[1]
VLLM025 = ROOT / ".cache" / "vllm-0.25.1" / "vllm"
FAKE = ROOT / "tests" / "_fake_openai.py"


def test_the_server_module_is_the_one_the_installed_vllm_has(tmp_path: Path) -> None:
    installed = entry.vllm_package_dir()
    assert installed is not None
    assert entry.server_module() == "vllm.entrypoints.launchers.api_server.entry"  # 0.32
    assert entry.server_entry() == entry.SERVERS[0]
    if not VLLM025.is_dir():
        pytest.skip("vLLM 0.25.1 sources not unpacked (scripts/fetch_vllm025.sh)")
    assert entry.server_entry(str(VLLM025)) == ("vllm.entrypoints.openai.api_server",
                                                "vllm.entrypoints.openai.cli_args")
    src = (VLLM025 / "entrypoints" / "openai" / "api_server.py").read_text()
    assert 'if __name__ == "__main__":' in src and "make_arg_parser" in src
    assert (VLLM025 / "entrypoints" / "openai" / "cli_args.py").is_file()
    with pytest.raises(ConfigError, match="none of the server modules"):
        entry.server_entry(str(tmp_path))


def test_the_command_runs_that_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.split()
    assert cmd[1:3] == ["-m", entry.server_module()]


@pytest.mark.parametrize("argv, line", [
    (["--max-model-lenn", "512"], "vLLM has no flag --max-model-lenn; did you mean "
                                  "--max-model-len?"),
    (["--gpu_memory_utilisation=0.5"], "did you mean --gpu-memory-utilization?"),
    (["--dtype", "float33"], "vLLM rejects the arguments: argument --dtype"),
    (["--port", "x"], "--port wants a number"),
])
def test_a_bad_vllm_flag_is_one_line_before_anything_starts(
        argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    t0 = time.monotonic()
    own_port = [] if "--port" in argv else ["--port", str(port)]
    assert main(["serve", "m", *own_port, *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and line in err, err
    assert "usage:" not in err
    assert not child.port_in_use("127.0.0.1", port) and time.monotonic() - t0 < 120


def _shm_free_plus_one_gib() -> str:
    st = os.statvfs("/dev/shm")
    return f"{st.f_bavail * st.f_frsize // 2**30 + 1}GiB"


KVTIER_JSON_FAIL = '{"kv_connector": "kvtier", "kv_role": "kv_both"}'  # vLLM's default: fail


@pytest.mark.parametrize("argv, line", [
    (["--chunk-tokens", "100", "--block-size", "32"],
     "kvtier serve: kvtier setting 'chunk_tokens' (100) is not a multiple of every KV-cache "
     "block size [32] (their LCM is 32): write chunk_tokens=96 or 128, or leave it unset"),
    (["--no-kvtier", "--kv-transfer-config", KVTIER_JSON_FAIL],
     "kvtier serve: kv_load_failure_policy='fail' is refused: a failed restore must recompute, "
     "not fail the request; set kv_load_failure_policy='recompute' in --kv-transfer-config, "
     "or set kvtier's allow_fail_policy=true to start anyway"),
    (["--dram-size", "1000TiB"], "kvtier serve: kvtier dram_size 1000TiB is more than this "
                                 "process can take: "),
    (["--tensor-parallel-size", "2", "--dram-size", _shm_free_plus_one_gib()],
     "kvtier serve: /dev/shm has "),
])
def test_what_the_connector_would_refuse_is_one_line_before_anything_starts(
        argv: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    port = free_port()
    assert main(["serve", "m", "--port", str(port), *argv]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith(line), err
    assert "starting vLLM" not in err and not child.port_in_use("127.0.0.1", port)
    if "/dev/shm" in line:
        assert "with --tensor-parallel-size 2 kvtier keeps its store" in err
        assert err.strip().endswith("; enlarge /dev/shm (docker --shm-size, or --ipc=host) or "
                                    "lower dram_size")


def test_the_checks_pass_what_the_connector_accepts(capsys: pytest.CaptureFixture[str]) -> None:
    ok = '{"kv_connector": "kvtier", "kv_role": "kv_both", "kv_load_failure_policy": "fail", ' \
         '"kv_connector_extra_config": {"allow_fail_policy": true}}'
    for argv in (["--chunk-tokens", "96", "--block-size", "32"],  # a multiple
                 ["--chunk-tokens", "100"],  # no --block-size: vLLM decides, the connector checks
                 ["--tensor-parallel-size", "2", "--dram-size", "64MiB"],
                 ["--pipeline-parallel-size", "2", "--tensor-parallel-size", "2", "--dram-size",
                  _shm_free_plus_one_gib()],  # kvtier is off with pipeline parallelism
                 ["--no-kvtier", "--kv-transfer-config", ok]):
        assert main(["serve", "m", *argv, "--dry-run"]) == 0, capsys.readouterr().err
        assert "--model m" in capsys.readouterr().out


def test_a_refusal_is_one_line_from_a_real_kvtier_serve(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "serve", "m", "--port",
                        str(free_port()), "--chunk-tokens", "100", "--block-size=32"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 2 and "starting vLLM" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith(
        "kvtier serve: kvtier setting 'chunk_tokens' (100) is not a multiple"), r.stderr
    assert r.stderr.count("kvtier") == 2  # that line only (vLLM's import notes aside)


@pytest.fixture
def other_server() -> Iterator[int]:
    """A server kvtier did not start, answering /health on a port."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(FAKE), "--port", str(port)],
                            start_new_session=True)
    try:
        serve.wait_ready(f"http://127.0.0.1:{port}", None, timeout=30)
        yield port
    finally:
        proc.terminate()
        proc.wait(10)


def test_serve_refuses_a_port_another_server_holds(other_server: int,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "m", "--port", str(other_server)]) == 2
    out = capsys.readouterr()
    assert f"port {other_server} on 0.0.0.0 is already in use" in out.err
    assert "serve: ready" not in out.out + out.err and "starting vLLM" not in out.err


def test_readiness_comes_only_from_the_childs_own_process(other_server: int) -> None:
    sleeper = child.spawn([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert child.owns_port(sleeper.pid, other_server) is False
        with pytest.raises(RuntimeError, match="not from the server kvtier started"):
            serve.wait_ready(f"http://127.0.0.1:{other_server}", sleeper, timeout=20)
    finally:
        serve.stop(sleeper, grace=5)
    port = free_port()
    own = child.spawn([sys.executable, str(FAKE), "--port", str(port)])
    try:
        assert serve.wait_ready(f"http://127.0.0.1:{port}", own, timeout=30) >= 0
        assert child.owns_port(own.pid, port) is True
    finally:
        serve.stop(own, grace=5)


def test_port_in_use_sees_a_listener_not_a_closed_socket() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert child.port_in_use("127.0.0.1", port) and child.port_in_use("0.0.0.0", port)
    assert not child.port_in_use("127.0.0.1", port)


WRAPPER = """
import sys, time
from kvtier.vllm import child
p = child.spawn([sys.executable, "-c", "import time; time.sleep(120)"])
print(p.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_the_child_ends_when_the_wrapper_is_killed(sig: signal.Signals) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    wrapper = subprocess.Popen([sys.executable, "-c", textwrap.dedent(WRAPPER)],
                               stdout=subprocess.PIPE, text=True, env=env)
    assert wrapper.stdout is not None
    pid = int(wrapper.stdout.readline())
    try:
        assert _alive(pid) and os.getsid(pid) == pid  # its own session: stoppable as a whole
        wrapper.send_signal(sig)
        wrapper.wait(10)
        deadline = time.monotonic() + 10
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(pid), f"child {pid} outlived its wrapper ({sig.name})"
    finally:
        wrapper.kill()
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_serve_on_vllm_025_runs_its_openai_server_and_checks_with_its_parser() -> None:
    """Issue 15: on 0.25.1 (no launchers package) ``kvtier serve`` names
    ``vllm.entrypoints.openai.api_server``, 0.25.1's own parser accepts the command, and a
    mistyped flag is refused by that parser in one line."""
    out = run_module_025("vllm025_serve", timeout=300)
    cmd = out["command"]
    assert cmd[1:5] == ["-m", "vllm.entrypoints.openai.api_server", "--model", "m"]
    assert out["ok_code"] == 0 and "--kv-transfer-config" in cmd
    assert out["server_file"].endswith("vllm-0.25.1/vllm/entrypoints/openai/api_server.py")
    assert out["server_runs"]
    assert out["bad_code"] == 2
    assert out["bad_err"] == ["kvtier serve: vLLM has no flag --max-model-lenn; did you mean "
                              "--max-model-len?"]
