"""Who may use the remote tier, against real servers: ACL users confined to their own key
prefix cannot read or write each other's chunks, credentials never reach a message or a
log, TLS with a verified certificate, and cluster mode on the three-node cluster."""

from __future__ import annotations

import logging
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import torch
from pydantic import ValidationError

from _redis import RedisProcess, cluster_nodes, standalone, unique_prefix
from kvtier.config import KvtierConfig
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.remote import RedisChunkStore, RemoteKeys, RemoteUnavailable
from kvtier.tiers.remote_client import connect, describe
from kvtier.tiers.seam import TierJob, TierJobKind, TierOp, TierRunner

NS = bytes(range(16))
KEY = b"K" * 16


def store_for(cfg: KvtierConfig, part_bytes: int = 4096) -> RedisChunkStore:
    return RedisChunkStore(connect(cfg), RemoteKeys(cfg.remote_key_prefix, NS), 0,
                           part_bytes, CircuitBreaker(3, 1.0))


def data(n: int = 9000, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, (n,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))


@pytest.fixture
def two_deployments() -> Iterator[tuple[int, list[tuple[str, str, str]]]]:
    """Two ACL users on the shared server, each confined to its own key prefix."""
    _, port = standalone()
    admin = redis.Redis(port=port, socket_timeout=2)
    users = []
    for _ in range(2):
        name, prefix, password = unique_prefix(), unique_prefix(), uuid.uuid4().hex
        admin.execute_command("ACL", "SETUSER", name, "on", f">{password}", "resetkeys",
                              f"~{prefix}:*", "+@all", "-@admin", "-@dangerous")
        users.append((name, prefix, password))
    yield port, users
    for name, prefix, _ in users:
        admin.execute_command("ACL", "DELUSER", name)
        for k in admin.scan_iter(f"{prefix}:*"):
            admin.delete(k)


def _cfg(port: int, user: str, password: str, prefix: str, **kw: object) -> KvtierConfig:
    return KvtierConfig.model_validate({
        "remote_url": f"redis://127.0.0.1:{port}", "remote_username": user,
        "remote_password": password, "remote_key_prefix": prefix, **kw})


def test_acl_users_cannot_read_or_write_each_others_chunks(
        two_deployments: tuple[int, list[tuple[str, str, str]]]) -> None:
    port, ((ua, pa, wa), (ub, pb, wb)) = two_deployments
    a, b = store_for(_cfg(port, ua, wa, pa)), store_for(_cfg(port, ub, wb, pb))
    mine = data(seed=1)
    b.put(0, KEY, None, mine)
    out = torch.zeros_like(mine)
    b.get(0, KEY, None, out)
    assert torch.equal(out, mine)
    # A, configured with B's prefix (namespace_extra would not stop it: same key names), is
    # refused by the server for every read and write
    intruder = store_for(_cfg(port, ua, wa, pb))
    for attempt in (lambda: intruder.get(0, KEY, None, out),
                    lambda: intruder.put(0, KEY, None, data(seed=2)),
                    lambda: intruder.delete(0, KEY, None)):
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
    raw_a = redis.Redis(port=port, username=ua, password=wa, socket_timeout=2)
    with pytest.raises(redis.exceptions.NoPermissionError):
        raw_a.get(b.keys.head(0, KEY, 0))
    b.get(0, KEY, None, out)  # B's chunk is untouched
    assert torch.equal(out, mine)
    with pytest.raises(KeyError):  # and A's own prefix does not hold it
        a.get(0, KEY, None, out)
    for s in (a, b, intruder):
        s.close()


def test_credentials_never_reach_a_message_or_a_log(
        two_deployments: tuple[int, list[tuple[str, str, str]]],
        caplog: pytest.LogCaptureFixture) -> None:
    port, ((ua, pa, wa), _) = two_deployments
    cfg = _cfg(port, ua, wa, pa)
    shown = [repr(cfg), str(cfg), cfg.model_dump_json(), describe(cfg),
             str(cfg.model_dump())]
    assert not [s for s in shown if wa in s] and ua in describe(cfg)
    wrong = "Wr0ng" + wa
    bad = store_for(_cfg(port, ua, wrong, pa))
    slab = data()
    caplog.set_level(logging.DEBUG)
    runner = TierRunner(bad, lambda g, s: slab, name="remote")
    runner.submit(TierJob(1, TierJobKind.PROMOTE, [TierOp(0, 0, KEY)]))
    runner.drain()
    (done,) = runner.poll()
    runner.close()
    assert not done.ok and "AuthenticationError" in done.error, done.error
    text = caplog.text + done.error
    assert wrong not in text and wa not in text
    with pytest.raises(ValidationError) as e:
        KvtierConfig.model_validate({"remote_url": f"redis://u:{wa}@127.0.0.1:{port}"})
    assert wa not in str(e.value)


@pytest.mark.parametrize("bad, why", [
    ({"remote_url": "http://h:1"}, "redis://host:port"),
    ({"remote_url": "redis://h:1", "remote_tls_ca_file": "/ca.pem"}, "rediss://"),
    ({"remote_url": "rediss://h:1", "remote_tls_cert_file": "/c.pem"}, "go together"),
    ({"remote_url": "redis://h:1", "remote_username": "u"}, "needs remote_password"),
    ({"remote_url": "redis://h:1", "remote_key_prefix": "a:b"}, "remote_key_prefix"),
    ({"remote_url": "redis://h:1", "remote_timeout_ms": 0}, "remote_timeout_ms"),
])
def test_remote_settings_are_validated(bad: dict[str, object], why: str) -> None:
    with pytest.raises(ValidationError, match=why):
        KvtierConfig.model_validate(bad)


def _certs(tmp: Path) -> tuple[Path, Path, Path]:
    ca_key, ca, key, csr, cert = (tmp / n for n in ("ca.key", "ca.pem", "s.key", "s.csr",
                                                     "s.pem"))
    run = [("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key,
            "-out", ca, "-days", "1", "-subj", "/CN=kvtier test CA"),
           ("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr,
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost"),
           ("openssl", "x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key,
            "-CAcreateserial", "-out", cert, "-days", "1", "-copy_extensions", "copy")]
    for argv in run:
        subprocess.run([str(a) for a in argv], check=True, capture_output=True)
    return ca, cert, key


def test_tls_with_a_verified_certificate(tmp_path: Path) -> None:
    ca, cert, key = _certs(tmp_path)
    server = RedisProcess(tmp_path, tls=(ca, cert, key))
    tls_port = server.port
    try:
        cfg = KvtierConfig.model_validate({"remote_url": f"rediss://localhost:{tls_port}",
                                           "remote_tls_ca_file": str(ca),
                                           "remote_timeout_ms": 2000})
        s = store_for(cfg)
        d = data()
        s.put(0, KEY, None, d)
        out = torch.zeros_like(d)
        s.get(0, KEY, None, out)
        assert torch.equal(out, d)
        s.close()
        plain = store_for(KvtierConfig.model_validate(  # no TLS to a TLS port: a miss
            {"remote_url": f"redis://localhost:{tls_port}", "remote_timeout_ms": 300}))
        with pytest.raises(RemoteUnavailable):
            plain.get(0, KEY, None, out)
        plain.close()
    finally:
        server.close()


def test_cluster_mode_spreads_chunks_over_the_nodes_and_keeps_each_whole() -> None:
    nodes = cluster_nodes()
    host, port = nodes[0]
    prefix = unique_prefix()
    cfg = KvtierConfig.model_validate({"remote_url": f"redis://{host}:{port}",
                                       "remote_cluster": True, "remote_key_prefix": prefix,
                                       "remote_timeout_ms": 1000})
    s = store_for(cfg, part_bytes=2048)
    chunks = {bytes([i]) * 16: data(7000, seed=i) for i in range(24)}
    for k, d in chunks.items():
        s.put(0, k, None, d)
    out = torch.zeros(7000, dtype=torch.uint8)
    for k, d in chunks.items():
        s.get(0, k, None, out)
        assert torch.equal(out, d)
    assert s.present(0, [*chunks, b"z" * 16]) == [True] * 24 + [False]
    held = []
    for h, p in nodes:
        node = redis.Redis(host=h, port=p, socket_timeout=2)
        keys = [k.decode() for k in node.scan_iter(f"{prefix}:*")]
        held.append(len(keys))
        tags = {k.rsplit(":", 1)[0] for k in keys}
        assert all(len([k for k in keys if k.startswith(t + ":")]) == 5 for t in tags)
    assert sum(held) == 24 * 5 and sum(n > 0 for n in held) >= 2, held
    for k in chunks:
        s.delete(0, k, None)
    assert s.present(0, list(chunks)) == [False] * 24
    s.close()
