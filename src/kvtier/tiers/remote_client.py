"""A redis-py client for the remote tier from kvtier's settings: standalone or cluster, AUTH
(password or ACL user), TLS, and a timeout on every call with no retries (a retry is another
wait on a server that already failed to answer in time). The password reaches redis-py only:
it is never formatted into a message (:func:`describe` is what logs say)."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from kvtier.config import KvtierConfig


def connect(config: KvtierConfig) -> Any:
    """A client whose every call fails within ``remote_timeout_ms`` (connect or answer)."""
    assert config.remote_url is not None
    url = urlsplit(config.remote_url)
    timeout = config.remote_timeout_ms / 1e3
    kw: dict[str, Any] = {
        "host": url.hostname, "port": url.port or 6379,
        "username": config.remote_username,
        "password": (config.remote_password.get_secret_value()
                     if config.remote_password is not None else None),
        "socket_timeout": timeout, "socket_connect_timeout": timeout,
        "retry": Retry(NoBackoff(), 0), "client_name": "kvtier",
    }
    if url.scheme == "rediss":
        kw.update(ssl=True, ssl_ca_certs=config.remote_tls_ca_file,
                  ssl_certfile=config.remote_tls_cert_file,
                  ssl_keyfile=config.remote_tls_key_file)
    if config.remote_cluster:
        return RedisCluster(**kw)
    return redis.Redis(**kw, db=int((url.path or "/0").strip("/") or 0))


def describe(config: KvtierConfig) -> str:
    """The remote tier for logs: where, and who, never the password."""
    url = urlsplit(config.remote_url or "")
    who = f"user {config.remote_username}" if config.remote_username else (
        "password auth" if config.remote_password is not None else "no auth")
    mode = "cluster" if config.remote_cluster else "standalone"
    return f"{url.scheme}://{url.hostname}:{url.port or 6379} ({mode}, {who})"
