"""Real Redis servers for the remote tier's tests.

scripts/test.sh (what .ci/run runs) starts a standalone server and a three-node cluster
(scripts/redis_servers.sh) and exports their addresses in ``KVTIER_TEST_REDIS`` and
``KVTIER_TEST_REDIS_CLUSTER`` with ``KVTIER_TEST_REDIS_REQUIRED=1``: there a missing server is
an error, never a skip. Elsewhere (a developer without Redis) the tests skip, saying why.
Tests that kill or stop a server start their own (:class:`RedisProcess`), from the same
Debian redis-server binary."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis

REQUIRED = os.environ.get("KVTIER_TEST_REDIS_REQUIRED") == "1"


def _absent(why: str) -> None:
    if REQUIRED:
        pytest.fail(f"the Redis servers CI started are missing: {why}", pytrace=False)
    pytest.skip(f"no Redis server for this test ({why}; scripts/test.sh starts them)")


def standalone() -> tuple[str, int]:
    addr = os.environ.get("KVTIER_TEST_REDIS")
    if not addr:
        _absent("KVTIER_TEST_REDIS is unset")
    host, port = addr.rsplit(":", 1)  # type: ignore[union-attr]
    try:
        redis.Redis(host=host, port=int(port), socket_timeout=2).ping()
    except redis.exceptions.RedisError as e:
        _absent(f"{addr} does not answer: {e}")
    return host, int(port)


def cluster_nodes() -> list[tuple[str, int]]:
    nodes = os.environ.get("KVTIER_TEST_REDIS_CLUSTER")
    if not nodes:
        _absent("KVTIER_TEST_REDIS_CLUSTER is unset")
    out = []
    for n in nodes.split(","):  # type: ignore[union-attr]
        host, port = n.rsplit(":", 1)
        out.append((host, int(port)))
    return out


def unique_prefix() -> str:
    """A key prefix no other test (or earlier run) uses on the shared servers."""
    return f"t{uuid.uuid4().hex[:12]}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProcess:
    """A private redis-server this test may kill, restart, stop (SIGSTOP) and continue."""

    def __init__(self, tmp: Path, *args: str, tls: tuple[Path, Path, Path] | None = None
                 ) -> None:
        """``tls``: (CA, certificate, key): the server speaks TLS only, on ``port``."""
        binary = shutil.which("redis-server")
        if binary is None:
            _absent("redis-server is not installed")
        self.binary = binary
        self.dir = tmp
        self.port = _free_port()
        self.args = args
        self.tls = tls
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    def start(self) -> None:
        ports = ["--port", str(self.port)]
        client = redis.Redis(port=self.port, socket_timeout=1)
        if self.tls is not None:
            ca, cert, key = (str(p) for p in self.tls)
            ports = ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", cert,
                     "--tls-key-file", key, "--tls-ca-cert-file", ca, "--tls-auth-clients", "no"]
            client = redis.Redis(host="localhost", port=self.port, socket_timeout=1, ssl=True,
                                 ssl_ca_certs=ca)
        self.proc = subprocess.Popen(
            [self.binary, *ports, "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", str(self.dir), *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                client.ping()
                return
            except redis.exceptions.RedisError:
                time.sleep(0.05)
        raise RuntimeError(f"redis-server on {self.port} did not start")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.kill()
            self.proc.wait()
