"""The store_url setting and the ``kvtier store`` command's start-up errors (issue 18)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from _store import SRC
from kvtier.config import ConfigError, KvtierConfig


def test_store_url_takes_a_unix_socket_url_only() -> None:
    assert KvtierConfig.load({"store_url": "unix:///run/kvtier/s.sock"}).store_url == \
        "unix:///run/kvtier/s.sock"
    assert KvtierConfig.load({}, environ={}).store_url is None
    for bad in ("/run/s.sock", "unix://relative", "tcp://host:1", "unix:///a\x00b"):
        with pytest.raises(ConfigError, match="unix:///absolute/socket/path"):
            KvtierConfig.load({"store_url": bad}, environ={})


def test_store_url_excludes_an_engine_disk_or_remote_tier() -> None:
    with pytest.raises(ConfigError, match="store_url excludes disk_path and remote_url") as e:
        KvtierConfig.load({"store_url": "unix:///s", "disk_path": "/d", "disk_size": "1GiB"},
                          environ={})
    assert "kvtier store --disk-path" in str(e.value)  # where the store's disk is configured
    with pytest.raises(ConfigError, match="store_url excludes disk_path and remote_url"):
        KvtierConfig.load({"store_url": "unix:///s", "remote_url": "redis://127.0.0.1:6379"},
                          environ={})


@pytest.mark.parametrize(("args", "message"), [
    (["--size", "64"], "unit"),
    (["--size", "100TiB"], "more than this process can take"),
    (["--size", "8MiB", "--lease-ttl", "0"], "--lease-ttl must be positive"),
])
def test_kvtier_store_refuses_bad_settings_at_start(tmp_path, args, message) -> None:  # type: ignore[no-untyped-def]
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "store", "--socket",
                        str(tmp_path / "s.sock"), *args], capture_output=True, text=True,
                       timeout=120, env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r
    assert message in r.stderr
    assert not (tmp_path / "s.sock").exists()


@pytest.mark.parametrize(("disk", "message"), [
    (["--disk-path", "{tmp}/d"], "--disk-path and --disk-size go together"),
    (["--disk-path", "/dev/shm/kvtier-store-test-{pid}", "--disk-size", "1MiB"], "tmpfs"),
    (["--disk-path", "{tmp}/d", "--disk-size", "100000TiB"], "lower disk_size"),
])
def test_kvtier_store_refuses_a_bad_disk_at_start(tmp_path, disk, message) -> None:  # type: ignore[no-untyped-def]
    args = [a.replace("{tmp}", str(tmp_path)).replace("{pid}", str(os.getpid()))
            for a in disk]
    try:
        r = subprocess.run([sys.executable, "-m", "kvtier.cli", "store", "--socket",
                            str(tmp_path / "s.sock"), "--size", "8MiB", *args],
                           capture_output=True, text=True, timeout=120,
                           env={"PYTHONPATH": SRC, "PATH": "/usr/bin:/bin"})
    finally:
        if args[1].startswith("/dev/shm/"):
            shutil.rmtree(args[1], ignore_errors=True)
    assert r.returncode == 2, r
    assert message in r.stderr and "--disk-path" in r.stderr
    assert not (tmp_path / "s.sock").exists()


def test_kvtier_store_without_a_remote_starts_where_redis_is_not_installed(  # type: ignore[no-untyped-def]
        tmp_path, monkeypatch) -> None:
    """Only a store given --remote-url needs the redis client (the `remote` extra): on a host
    without it (the H200 image, 2026-12-02) the store must start, and a store asked for a
    remote refuses at start with exit 2 naming the extra. A `redis` package that fails to
    import stands for its absence."""
    from pathlib import Path

    from kvtier.testing.store_process import StoreProcess

    shadow = tmp_path / "no-redis" / "redis"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('redis is not installed here')\n")
    monkeypatch.setenv("PYTHONPATH", str(shadow.parent))
    store = StoreProcess(Path(tmp_path), size="8MiB").start(timeout=120)
    assert "ready on" in store.ready_line
    store.stop()
    r = subprocess.run([sys.executable, "-m", "kvtier.cli", "store", "--socket",
                        str(tmp_path / "r.sock"), "--size", "8MiB",
                        "--remote-url", "redis://127.0.0.1:1"],
                       capture_output=True, text=True, timeout=120,
                       env={"PYTHONPATH": SRC + os.pathsep + str(shadow.parent),
                            "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2, r
    assert "kvtier[remote]" in r.stderr and "Traceback" not in r.stderr
