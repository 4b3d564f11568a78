"""The kvtier command: config, serve (command building), bench (against a fake server)."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier import bench
from kvtier.bench.serving import free_port
from kvtier.cli import main
from kvtier.config import KvtierConfig
from kvtier.vllm import entry, serve

FAKE = os.path.join(os.path.dirname(__file__), "_fake_openai.py")


def test_config_prints_every_setting_with_its_doc(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    for name, f in KvtierConfig.model_fields.items():
        assert f"\n{name} = " in out and f.description and f.description in out
    assert "dram_size = '4GiB'" in out and "KVTIER_DRAM_SIZE" in out
    assert main(["config", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows] == list(KvtierConfig.model_fields)
    # each row checked against KvtierConfig itself, not against the function that prints it:
    # its doc is the field's, and its default and variable are what a user can type back
    default = KvtierConfig()
    for r in rows:
        name, f = r["name"], KvtierConfig.model_fields[r["name"]]
        assert r["doc"] == f.description and r["type"], r
        assert r["env"] == f"KVTIER_{name.upper()}", r
        typed = KvtierConfig.load({name: r["default"]}, environ={})
        assert getattr(typed, name) == getattr(default, name), r
        if r["default"] is not None:  # an environment variable cannot say None
            from_env = KvtierConfig.load({}, environ={r["env"]: str(r["default"])})
            assert getattr(from_env, name) == getattr(default, name), r


def _dry(capsys: pytest.CaptureFixture[str], *argv: str) -> list[str]:
    assert main(["serve", *argv, "--dry-run"]) == 0
    return shlex.split(capsys.readouterr().out.strip())


def test_serve_builds_the_vllm_command(capsys: pytest.CaptureFixture[str]) -> None:
    cmd = _dry(capsys, "/models/x", "--dtype", "float32", "--dram-size", "2GiB", "--policy",
               "lru", "--chunk-tokens", "512", "--port", "8123", "--kvtier-set",
               "max_pending_saves=64", "--block-size=32")
    assert cmd[:5] == [sys.executable, "-m", entry.server_module(), "--model", "/models/x"]
    assert cmd[5:9] == ["--dtype", "float32", "--port", "8123"] and "--block-size=32" in cmd
    ktc = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert ktc == {"kv_connector": "kvtier", "kv_role": "kv_both",
                   "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {"max_pending_saves": 64, "dram_size": "2GiB",
                                                 "policy": "lru", "chunk_tokens": 512}}
    assert cmd.count("--enable-prompt-tokens-details") == 1
    assert serve.base_url(cmd) == "http://localhost:8123"


def test_serve_without_kvtier(capsys: pytest.CaptureFixture[str]) -> None:
    cmd = _dry(capsys, "m", "--no-kvtier", "--no-enable-prompt-tokens-details")
    assert "--kv-transfer-config" not in cmd and "--enable-prompt-tokens-details" not in cmd


@pytest.mark.parametrize("argv, msg", [
    (["m", "--dram-size", "2G"], "unknown unit 'G'"),
    (["m", "--kvtier-set", "dram_sise=1GiB"], "did you mean 'dram_size'"),
    (["m", "--kvtier-set", "oops"], "KEY=VALUE"),
    (["m", "--kv-transfer-config", "{}"], "writes --kv-transfer-config itself"),
    (["m", "--no-kvtier", "--dram-size", "1GiB"], "with --no-kvtier"),
    (["m", "--model", "other"], "model once"),
])
def test_serve_rejects_bad_input_before_starting(argv: list[str], msg: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", *argv, "--dry-run"]) == 2
    assert msg in capsys.readouterr().err


def test_base_url_and_flag_values() -> None:
    assert serve.base_url([]) == "http://localhost:8000"
    assert serve.base_url(["--host", "0.0.0.0", "--port=9"]) == "http://localhost:9"
    assert serve.base_url(["--host", "10.0.0.2", "--port", "1", "--port", "2"]) == (
        "http://10.0.0.2:2")


def test_every_registered_bench_has_the_module_interface() -> None:
    assert bench.DEFAULT in bench.BENCHES
    for path in bench.BENCHES.values():
        mod = importlib.import_module(path)
        assert isinstance(mod.HELP, str) and callable(mod.add_arguments) and callable(mod.run)


def test_bench_rejects_bad_load_before_running(capsys: pytest.CaptureFixture[str],
                                               tmp_path: str) -> None:
    assert main(["bench", "--requests", "0", "--out", str(tmp_path)]) == 2
    assert "requests must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["bench", "--concurrency", "2", "--rate", "1"])



def _fake_server(port: int, kvtier: bool = True, log: Any = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, FAKE, "--port", str(port), "--kvtier",
                             str(int(kvtier))], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


@pytest.fixture
def fake_url() -> Iterator[str]:
    port = free_port()
    proc = _fake_server(port)
    url = f"http://127.0.0.1:{port}"
    try:
        serve.wait_ready(url, proc, timeout=30)
        yield url
    finally:
        serve.stop(proc, grace=10)


def test_bench_against_an_endpoint_writes_results(fake_url: str, tmp_path: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    out = os.path.join(tmp_path, "res")
    rc = main(["bench", "--url", fake_url, "--prefixes", "2", "--prefix-len", "128",
               "--suffix-len", "16", "--output-len", "3", "--requests", "6",
               "--concurrency", "2", "--no-progress", "--out", out, "--name", "fake"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == ["fake"]
    assert sorted(os.listdir(out)) == ["results.json", "results.png", "table.txt"]
    with open(os.path.join(out, "results.json")) as f:
        data = json.load(f)
    run = data["runs"][0]
    assert run["model"] == "fake-model" and run["vllm_version"] == "fake-0"
    assert len(run["requests"]) == 6 and run["summary"]["failed"] == 0
    assert run["summary"]["chunk_tokens"] == 64  # read from the server's gauge
    # warm-up requests are not measured: 2 of them reached the server before the run
    assert run["summary"]["repeat_requests"] == 4
    assert run["summary"]["connector_tokens"] == run["metrics_delta"][
        'vllm:kvtier_restored_tokens_total{engine="0",model_name="fake"}'] == run[
        "metrics_delta"]['vllm:prompt_tokens_by_source{engine="0",model_name="fake",'
                         'source="external_kv_transfer"}']
    assert data["meta"]["machine"]["cores"] and data["meta"]["command"].startswith("kvtier")


def test_bench_compare_starts_each_server_in_turn(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: str,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    launched: list[serve.ServeArgs] = []

    def fake_launch(sa: serve.ServeArgs, log: Any = None, env: Any = None
                    ) -> subprocess.Popen[bytes]:
        launched.append(sa)
        port = int(serve.flag_value(sa.vllm_args, "--port") or 0)
        return _fake_server(port, sa.kvtier, log)

    monkeypatch.setattr(serve, "launch", fake_launch)
    out = os.path.join(tmp_path, "cmp")
    rc = main(["bench", "--prefixes", "2", "--prefix-len", "128", "--suffix-len", "16",
               "--output-len", "2", "--requests", "4", "--concurrency", "1", "--no-progress",
               "--no-plot",
               "--out", out, "--compare", "HBM-only=m --no-kvtier --dtype float32",
               "--compare", "kvtier=m --dram-size 1GiB"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0].split() == ["HBM-only", "kvtier"]
    ratios = [x for x in text.splitlines() if x.startswith("kvtier vs HBM-only: ")]
    assert len(ratios) == 5 and ratios[0].startswith(
        "kvtier vs HBM-only: median TTFT of repeated-prefix requests ")
    assert [sa.kvtier for sa in launched] == [False, True]
    assert launched[1].settings == {"dram_size": "1GiB"}
    assert "--dtype" in launched[0].vllm_args and "--port" in launched[0].vllm_args
    assert sorted(os.listdir(out)) == ["results.json", "server-HBM-only.log",
                                       "server-kvtier.log", "table.txt"]


def test_bench_rounds_start_servers_together_and_write_each_finished_round(
        monkeypatch: pytest.MonkeyPatch, tmp_path: str,
        capsys: pytest.CaptureFixture[str]) -> None:
    """--rounds 3 --start-together: both servers are launched before the bench waits for
    either (on distinct ports), and table.txt / results.json hold every finished round
    before the next starts (a run cut short by a timeout keeps them)."""
    from kvtier.bench import serving

    events: list[str] = []

    def fake_launch(sa: serve.ServeArgs, log: Any = None, env: Any = None
                    ) -> subprocess.Popen[bytes]:
        events.append("launch")
        port = int(serve.flag_value(sa.vllm_args, "--port") or 0)
        return _fake_server(port, sa.kvtier, log)

    real_wait, real_measure = serve.wait_ready, serving._measure
    seen_before_round: dict[int, tuple[str, int]] = {}

    def wait_ready(*a: Any, **kw: Any) -> float:
        events.append("wait")
        return real_wait(*a, **kw)

    def measure(cfg: Any, url: str, waited: float, args: Any, round_: int) -> Any:
        if round_ not in seen_before_round and round_ > 0:
            with open(os.path.join(out, "table.txt")) as f:
                table_text = f.read()
            with open(os.path.join(out, "results.json")) as f:
                seen_before_round[round_] = (table_text, len(json.load(f)["runs"]))
        return real_measure(cfg, url, waited, args, round_)

    monkeypatch.setattr(serve, "launch", fake_launch)
    monkeypatch.setattr(serve, "wait_ready", wait_ready)
    monkeypatch.setattr(serving, "_measure", measure)
    out = os.path.join(tmp_path, "rounds")
    rc = main(["bench", "--prefixes", "2", "--prefix-len", "128", "--suffix-len", "16",
               "--output-len", "2", "--requests", "4", "--concurrency", "1", "--no-progress",
               "--no-plot", "--rounds", "3", "--start-together", "--out", out,
               "--compare", "HBM-only=m --no-kvtier --dtype float32",
               "--compare", "kvtier=m --dram-size 1GiB"])
    assert rc == 0
    assert events == ["launch", "launch", "wait", "wait"]
    assert "round 1 of 3" in seen_before_round[1][0] and seen_before_round[1][1] == 2
    assert "round 2 of 3" in seen_before_round[2][0] and seen_before_round[2][1] == 4
    assert "round 3 of 3" not in seen_before_round[2][0]
    with open(os.path.join(out, "results.json")) as f:
        assert len(json.load(f)["runs"]) == 6
    text = capsys.readouterr().out
    assert text.count("round 1 of 3") == 2  # once after round 1, once in the final report


def test_command_line_and_connector_import_without_the_remote_extra() -> None:
    """``redis`` is the ``remote`` extra's: without it, every subcommand's parser builds (the
    GPU image lacked it, and ``kvtier bench transfer`` failed at ``build_parser``), the
    connector imports, and only a remote tier asks for it."""
    script = (
        "import importlib.abc, sys\n"
        "class NoRedis(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'redis' or name.startswith('redis.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, NoRedis())\n"
        "from kvtier.cli import build_parser\n"
        "parser = build_parser()\n"
        "for argv in (['bench', 'transfer', '--help'], ['store', '--help']):\n"
        "    try:\n"
        "        parser.parse_args(argv)\n"
        "    except SystemExit as e:\n"
        "        assert e.code == 0, (argv, e.code)\n"
        "import kvtier.vllm.connector, kvtier.vllm.plugin\n"
        "assert not any(m == 'redis' or m.startswith('redis.') for m in sys.modules)\n"
        "print('ok')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
