"""An engine's connection to the store: attach, then one request at a time.

Contract: every request either returns the store's answer, raises :class:`StoreRefused`
(the store answered no: e.g. a pin on a chunk that is not ready, a layout mismatch) or
raises :class:`StoreDown` (no store, the connection broke, or no answer within
``timeout`` seconds); after StoreDown the connection is closed and the caller decides when
to :meth:`StoreClient.connect` again. A request never blocks longer than ``timeout``.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

from kvtier.store import framing

SCHEME = "unix://"
logger = logging.getLogger("kvtier.store")


class StoreDown(ConnectionError):
    """The store is not reachable (absent, exited, or too slow to answer)."""


class StoreRefused(RuntimeError):
    """The store answered a request with an error."""

    def __init__(self, kind: str, msg: str) -> None:
        super().__init__(f"{kind}: {msg}")
        self.kind = kind

    @property
    def failed(self) -> bool:
        """The request failed in the store (a bug, a bad request), not a refusal of the
        index's contract (:data:`kvtier.store.server.FAILED`)."""
        return self.kind == FAILED


FAILED = "StoreFailed"


def socket_path(store_url: str) -> str:
    """The socket path of a ``unix:///abs/path`` URL (validated by the config)."""
    if not store_url.startswith(SCHEME) or not store_url[len(SCHEME):].startswith("/"):
        raise ValueError(f"store_url {store_url!r} is not unix:///absolute/path")
    return store_url[len(SCHEME):]


@dataclass
class Attachment:
    """The store's answer to ``attach``: the pool's descriptor and the arena in it."""

    pool_fd: int
    pool_bytes: int
    arena_offset: int
    arena_bytes: int
    lease_ttl: float
    lower: bool = False  # the store has tiers below the pool for this namespace
    tiers: tuple[str, ...] = ()  # their names, top first ("disk", "remote")
    discovers: bool = False  # a tier finds out what it holds by asking (the remote server)


class StoreClient:
    def __init__(self, store_url: str, timeout: float = 2.0) -> None:
        self.path = socket_path(store_url)
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, spec: dict[str, Any]) -> Attachment:
        """Connect and attach to ``spec['namespace']`` (raises StoreDown, StoreRefused)."""
        self.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            raise StoreDown(f"no kvtier store at {self.path}: {e}") from None
        self._sock = sock
        try:
            reply, fds = self._exchange({"op": "attach", **spec})
        except StoreRefused:
            self.close()  # not attached: no request may go out on this connection
            raise
        if not fds:
            self.close()
            raise StoreDown("the store sent no pool descriptor")
        for extra in fds[1:]:
            os.close(extra)
        return Attachment(fds[0], int(reply["pool_bytes"]), int(reply["arena_offset"]),
                          int(reply["arena_bytes"]), float(reply["lease_ttl"]),
                          bool(reply.get("lower", False)),
                          tuple(reply.get("tiers") or (("disk",) if reply.get("lower") else ())),
                          bool(reply.get("discovers", False)))

    def call(self, op: str, **args: Any) -> Any:
        """``op``'s answer; ``pre``: requests run first whose answers nobody waits for
        (what of them failed is logged)."""
        reply, fds = self._exchange({"op": op, **args})
        for fd in fds:
            os.close(fd)
        if reply.get("pre_errors"):
            logger.warning("kvtier store: queued requests failed: %s", reply["pre_errors"])
        return reply.get("r")

    def _exchange(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        with self._lock:
            sock = self._sock
            if sock is None:
                raise StoreDown("not connected to the kvtier store")
            msg["id"] = next(self._ids)
            try:
                framing.send(sock, msg)
                reply, fds = framing.recv(sock)
            except (OSError, framing.ProtocolError) as e:  # socket.timeout is an OSError
                self._close_locked()
                raise StoreDown(f"the kvtier store stopped answering: {e}") from None
        if reply.get("id") != msg["id"]:
            self.close()
            raise StoreDown("the store answered another request")
        if not reply.get("ok"):
            for fd in fds:
                os.close(fd)
            raise StoreRefused(str(reply.get("error")), str(reply.get("msg")))
        return reply, fds

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
