"""The store process: the pool, the namespaces' indexes, and the control socket.

Contract:

- The socket is a Unix stream socket created mode 0600 (bound under umask 0177, so it is
  never reachable by others, not even for an instant); a stale socket file is replaced only
  if nothing answers on it. Every connection's peer credentials (SO_PEERCRED) are checked:
  a peer of another uid is closed before any frame is read.
- One thread per connection, one lock over all state: every request is answered in order,
  and a request never waits for another connection.
- ``attach`` is a connection's first request: it names the namespace and its slot layout,
  and the reply carries the pool's descriptor (SCM_RIGHTS) and the arena's place in it.
- A closed connection (exit, crash, kill -9) releases everything its client held
  (:meth:`kvtier.store.leases.ClientHolds.release_all`).
- Leases expire ``lease_ttl`` seconds after the lookup that took them (a sweeper checks four
  times per TTL); hard pins never do.
- With ``tiers`` (:class:`kvtier.store.tiers.StoreTiers`: a disk, a remote server, or both)
  every namespace whose engines bring their geometry gets those tiers below its arena
  (:mod:`kvtier.store.tiers`), driven by a tier thread under the same lock; the store maps
  its own pool for that I/O.
- A request that fails in the store (any exception of its op) is answered with an error
  (the client counts it and treats it as a miss or a failed write) and logged; the
  connection keeps serving. A queued request that fails is reported in its carrier's
  ``pre_errors``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING, Any

from kvtier.config import format_bytes
from kvtier.store import framing
from kvtier.store.client import FAILED  # a request that failed in the store (not a refusal)
from kvtier.store.leases import ClientHolds
from kvtier.store.ops import DEFERRABLE, OPS
from kvtier.store.pool import ArenaMap, PoolError, create_pool_fd
from kvtier.store.space import Space, decode_geometry, decode_layout, layout_id

if TYPE_CHECKING:
    from kvtier.store.tiers import StoreTiers

logger = logging.getLogger("kvtier.store")
_UCRED = struct.Struct("3i")


def peer_uid(sock: socket.socket) -> int:
    _pid, uid, _gid = _UCRED.unpack(
        sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def bind_private(path: str) -> socket.socket:
    """A listening socket at ``path``, mode 0600; refuses if a live store already owns it."""
    if os.path.exists(path):
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # stale: nothing listens there
        else:
            raise PoolError(f"a store already listens on {path}")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        sock.bind(path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    sock.listen(64)
    return sock


class StoreServer:
    def __init__(self, path: str, pool_size: int, lease_ttl: float = 30.0,
                 policy: str = "lru", tiers: StoreTiers | None = None) -> None:
        self.path = path
        self.tiers = tiers
        self.pool_size = pool_size
        self.lease_ttl = lease_ttl
        self.policy = policy
        self.pool_fd = create_pool_fd(pool_size)
        self.arenas = ArenaMap(pool_size)
        self.spaces: dict[bytes, Space] = {}
        self.lock = threading.Lock()
        self.released = {"writes": 0, "pins": 0, "leases": 0, "expired": 0}
        self.clients: set[ClientHolds] = set()
        self._stop = threading.Event()
        self.stopped = threading.Event()  # shutdown finished (write-back, tiers closed)
        self._pool_view: Any = None  # the store's own mapping of the pool (tier I/O)
        self.failed_requests = 0
        if tiers is not None:
            from kvtier.store.pool import map_pool
            from kvtier.store.tiers import pool_tensor

            self._mapping = map_pool(self.pool_fd, pool_size)
            self._pool_view = pool_tensor(self._mapping)
        self.sock = bind_private(path)

    # -- the loop ---------------------------------------------------------------------------
    def serve_forever(self) -> None:
        threading.Thread(target=self._sweep, daemon=True, name="kvtier-store-sweep").start()
        if self.tiers is not None:
            threading.Thread(target=self._tiers, daemon=True, name="kvtier-store-tiers").start()
        logger.info("kvtier store on %s: pool %s, lease ttl %.1fs", self.path,
                    format_bytes(self.pool_size), self.lease_ttl)
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                break
            if peer_uid(conn) != os.geteuid():
                logger.warning("kvtier store: refused a peer of another uid")
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def shutdown(self, write_back_s: float = 0.0) -> None:
        """Stop: no new connection; with a disk tier, up to ``write_back_s`` seconds writing
        what the pool holds and the disk lacks to the disk (and finishing the remote tier's
        write-through), so a restarted store finds it; then the tiers close."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if write_back_s > 0:
            self._write_back(time.monotonic() + write_back_s)
        with self.lock:
            for space in self.spaces.values():
                if space.tier is not None:
                    space.tier.close()
                    space.tier = None
        if self.tiers is not None:
            self.tiers.close()
        self.stopped.set()

    def _write_back(self, deadline: float) -> None:
        from kvtier.store.tiers import TICK_S

        t0, left = time.monotonic(), True
        while left and time.monotonic() < deadline:
            with self.lock:
                left = False
                for space in self.spaces.values():
                    if space.tier is not None:
                        left = space.tier.write_back() or left
            time.sleep(TICK_S)
        written = {ns.hex()[:8]: s.tier.stats().get("disk", {}).get("demotions")
                   for ns, s in self.spaces.items() if s.tier is not None}
        logger.info("kvtier store: write-back at stop %s in %.1fs (disk demotions per "
                    "namespace: %s)", "cut short" if left else "done",
                    time.monotonic() - t0, written)

    def _tiers(self) -> None:
        from kvtier.store.tiers import TICK_S

        while not self._stop.wait(TICK_S):
            with self.lock:
                for space in self.spaces.values():
                    if space.tier is not None:
                        try:
                            space.tier.tick()
                        except Exception:  # a broken round must not end the tier thread
                            logger.exception("kvtier store: a tier round failed")

    def _sweep(self) -> None:
        while not self._stop.wait(self.lease_ttl / 4):
            self.expire_leases(time.monotonic())

    def expire_leases(self, now: float) -> None:
        with self.lock:
            for holds in list(self.clients):
                self.released["expired"] += holds.expire(now)

    # -- one connection ---------------------------------------------------------------------
    def _serve(self, conn: socket.socket) -> None:
        session = Session(self)
        try:
            while True:
                msg, fds = framing.recv(conn)
                for fd in fds:  # clients never send descriptors
                    os.close(fd)
                reply, send_fds = session.handle(msg)
                framing.send(conn, reply, send_fds)
        except (ConnectionError, OSError):
            pass
        except framing.ProtocolError as e:  # the stream is out of step: nothing more to read
            logger.warning("kvtier store: closed a connection that sent a bad frame: %s", e)
        finally:
            session.close()
            conn.close()


class Session:
    """One connection's requests, against one namespace once attached."""

    def __init__(self, server: StoreServer) -> None:
        self.server = server
        self.space: Space | None = None
        self.holds: ClientHolds | None = None

    def handle(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        op = msg.get("op")
        rid = msg.get("id")
        try:
            with self.server.lock:
                if op == "attach":
                    return {"id": rid, "ok": True, **self._attach(msg)}, [self.server.pool_fd]
                if self.holds is None or self.space is None:
                    raise framing.ProtocolError("attach first")
                failed = self._run_queued(msg.get("pre") or ())
                fn = OPS.get(str(op))
                if fn is None:
                    raise framing.ProtocolError(f"unknown op {op!r}")
                reply = {"id": rid, "ok": True, "r": fn(self.space, self.holds, msg,
                                                        self.server.lease_ttl)}
                if failed:
                    reply["pre_errors"] = failed
                return reply, []
        except KeyError as e:
            return {"id": rid, "ok": False, "error": "KeyError", "msg": str(e)}, []
        except (PoolError, ValueError, AssertionError, framing.ProtocolError) as e:
            return {"id": rid, "ok": False, "error": type(e).__name__, "msg": str(e)}, []
        except Exception as e:  # a bug or a bad request: answer it, keep serving the rest
            self._failed(f"request {op!r}", e)
            return {"id": rid, "ok": False, "error": FAILED, "msg": f"{type(e).__name__}: {e}"
                    }, []

    def _failed(self, what: str, e: Exception) -> None:
        """Log a request that failed in the store (bounded: the first 20, then every 100th)."""
        srv = self.server
        srv.failed_requests += 1
        n = srv.failed_requests
        if n <= 20 or n % 100 == 0:
            logger.error("kvtier store: %s failed in the store (%d so far), answered as an "
                         "error: %s: %s", what, n, type(e).__name__, e,
                         exc_info=n <= 3)

    def _run_queued(self, queued: Any) -> list[str]:
        """The requests the client queued ahead of this one (``DEFERRABLE``), in order; what
        failed (its client logs it: nobody waits for their answers)."""
        assert self.space is not None and self.holds is not None
        failed = []
        for sub in queued:
            name = str(sub.get("op")) if isinstance(sub, dict) else "?"
            if name not in DEFERRABLE:
                raise framing.ProtocolError(f"op {name!r} cannot be queued")
            try:
                OPS[name](self.space, self.holds, sub, self.server.lease_ttl)
            except (KeyError, ValueError, AssertionError) as e:
                failed.append(f"{name}: {type(e).__name__}: {e}")
            except Exception as e:
                self._failed(f"queued request {name!r}", e)
                failed.append(f"{name}: {FAILED}: {type(e).__name__}: {e}")
        return failed

    def _attach(self, msg: dict[str, Any]) -> dict[str, Any]:
        if self.space is not None:
            raise framing.ProtocolError("attached already")
        srv, ns = self.server, bytes(msg["namespace"])
        lid = layout_id(msg)
        space = srv.spaces.get(ns)
        if space is not None and space.arena.layout_id != lid:
            raise PoolError("this namespace is attached with another slot layout (dram_size, "
                            "chunk_tokens or groups differ): use the same settings on "
                            "every engine of one model")
        if space is None:
            space = self._new_space(ns, msg, lid)
        if not space.tier_tried and "geometry" in msg and "layout" in msg:
            self._open_tier(space, msg)
        space.attached += 1
        self.space, self.holds = space, ClientHolds(space.index)
        srv.clients.add(self.holds)
        if space.tier is not None and "checksums" in msg:
            space.tier.verify_with(msg["checksums"])
        tier = space.tier
        return {"pool_bytes": srv.pool_size, "arena_offset": space.arena.offset,
                "arena_bytes": space.arena.size, "lease_ttl": srv.lease_ttl,
                "lower": tier is not None, "tiers": [] if tier is None else tier.names,
                "discovers": tier is not None and tier.discovers}

    def _open_tier(self, space: Space, msg: dict[str, Any]) -> None:
        """The namespace's share of the store's tiers (none without any, or for a model with
        other than full-attention groups)."""
        srv = self.server
        space.tier_tried = True
        if srv.tiers is None:
            return
        from kvtier.layout import GroupKind
        from kvtier.store.tiers import SpaceTier

        geometry = decode_geometry(msg["geometry"])
        if any(g.kind is not GroupKind.FULL for g in geometry.groups):
            logger.info("kvtier store: a namespace with other than full-attention groups "
                        "keeps no chunks in the store's tiers")
            return
        try:
            space.tier = SpaceTier(srv.tiers, space.arena.namespace, geometry,
                                   decode_layout(msg["layout"]), space.arena, srv._pool_view,
                                   space.index, space.allocator,
                                   space.arena.size / srv.pool_size, srv.lease_ttl)
        except ValueError as e:
            logger.warning("kvtier store: no tiers below the pool for a namespace: %s", e)

    def _new_space(self, ns: bytes, msg: dict[str, Any], lid: bytes) -> Space:
        srv, size = self.server, int(msg["arena_bytes"])
        arena = srv.arenas.place(ns, size, lid)
        idle = sorted((s for s in srv.spaces.values() if not s.attached),
                      key=lambda s: s.detached_at)
        while arena is None and idle:
            gone = idle.pop(0)
            srv.arenas.drop(gone.arena.namespace)
            del srv.spaces[gone.arena.namespace]
            if gone.tier is not None:  # its files stay: the namespace finds them again
                gone.tier.close()
            logger.info("kvtier store: dropped an idle namespace's arena for a new one")
            arena = srv.arenas.place(ns, size, lid)
        if arena is None:
            raise PoolError(f"the pool has {format_bytes(srv.arenas.free_bytes())} free for "
                            f"a {format_bytes(size)} arena: lower dram_size or raise the "
                            "store's --size")
        space = Space(arena, msg["slots"], msg["groups"], srv.policy)
        srv.spaces[ns] = space
        return space

    def close(self) -> None:
        with self.server.lock:
            if self.holds is not None:
                w, p, le = self.holds.release_all()
                rel = self.server.released
                rel["writes"] += w
                rel["pins"] += p
                rel["leases"] += le
                if w or p or le:
                    logger.info("kvtier store: a client left holding %d writes, %d pins, %d "
                                "leases: released", w, p, le)
                self.server.clients.discard(self.holds)
                if self.space is not None and self.space.tier is not None:
                    self.space.tier.forget(self.holds)
            if self.space is not None:
                self.space.attached -= 1
                self.space.detached_at = time.monotonic()

