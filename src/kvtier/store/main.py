"""``kvtier store``: run the node-wide store in the foreground until SIGTERM or SIGINT.

Prints one line ``kvtier store ready on unix://PATH`` once the pool is reserved and the
socket listens (what scripts and tests wait for). Exit status 2 on a bad setting or a pool
the host cannot hold.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from types import FrameType
from typing import TYPE_CHECKING

from kvtier.config import ConfigError, format_bytes, parse_bytes
from kvtier.store.client import SCHEME
from kvtier.store.pool import PoolError

if TYPE_CHECKING:
    from kvtier.store.remote import StoreRemote
    from kvtier.store.tiers import StoreDisk, StoreTiers

HELP = "run the node-wide store that engines attach to with store_url"



def default_socket() -> str:
    base = os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kvtier-{os.geteuid()}"
    return os.path.join(base, "kvtier-store.sock")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=None,
                   help=f"socket path (default {default_socket()}); engines use "
                   "store_url=unix://PATH")
    p.add_argument("--size", required=True,
                   help="the DRAM pool, all namespaces together, with a unit (e.g. 64GiB)")
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a lookup's lease lasts until it becomes a load (a load's "
                   "pin never expires)")
    p.add_argument("--policy", default="lru", choices=("lru", "slru", "s3fifo"),
                   help="eviction policy inside each namespace's arena")
    p.add_argument("--disk-path", default=None,
                   help="directory of the store's disk tier below the pool (a local disk; "
                   "the store owns it). Unset: no disk tier")
    p.add_argument("--disk-size", default=None,
                   help="bytes the disk tier may use, all namespaces together, with a unit "
                   "(e.g. 500GiB); each namespace gets its arena's share of the pool")
    p.add_argument("--disk-max-pending-chunks", type=int, default=256,
                   help="chunks in flight to or from each tier (disk, remote) per namespace")
    p.add_argument("--stop-write-back-s", type=float, default=30.0,
                   help="at SIGTERM/SIGINT, seconds the store may spend writing what its pool "
                   "holds and its disk lacks to the disk (and finishing the remote tier's "
                   "write-through) before it exits, so a restarted store finds it; 0: none "
                   "(a second signal, or SIGKILL, ends it at once)")
    add_remote_arguments(p)


def add_remote_arguments(p: argparse.ArgumentParser) -> None:
    """``--remote-url`` and the engine's other remote settings, one flag each."""
    from kvtier.config import KvtierConfig
    from kvtier.store.remote_settings import PASSWORD_ENV, SETTINGS

    fields = KvtierConfig.model_fields
    p.add_argument("--remote-url", default=None,
                   help="redis://host:port or rediss://host:port of the store's remote tier "
                   "(Redis or Valkey), below the disk with --disk-path, else right below the "
                   "pool; every chunk an engine commits is written through to it, and a "
                   "restarted store finds its chunks there. The password comes from "
                   f"${PASSWORD_ENV}. Unset: no remote tier")
    for name in SETTINGS[1:]:
        flag = "--" + name.replace("_", "-")
        f = fields[name]
        if f.annotation is bool:
            p.add_argument(flag, action="store_true", default=None, help=f.description)
        elif name == "remote_size":
            p.add_argument(flag, default=None,
                           help="bytes of the remote tier the store counts on, all namespaces "
                           "together (each gets its arena's share), with a unit (default "
                           f"{format_bytes(f.default)})")
        else:
            p.add_argument(flag, default=None,
                           help=f"{f.description} (the engine setting {name}; default "
                           f"{f.default})")


def open_remote(args: argparse.Namespace) -> StoreRemote | None:
    """The store's remote tier of ``--remote-url`` and the remote flags (ConfigError), or
    None."""
    from pydantic import ValidationError

    from kvtier.store.remote_settings import SETTINGS

    given = {n: getattr(args, n, None) for n in SETTINGS}
    given = {n: v for n, v in given.items() if v is not None}
    if "remote_url" not in given:
        if given:
            raise ConfigError(f"--{next(iter(given)).replace('_', '-')} needs --remote-url")
        return None
    try:  # redis (the `remote` extra): only a store with a remote needs it
        from kvtier.store.remote import StoreRemote
    except ImportError as e:
        raise ConfigError("--remote-url needs the redis client: pip install 'kvtier[remote]'") from e

    try:
        return StoreRemote(given)
    except ValidationError as e:  # one line, naming the flags
        why = "; ".join(f"--{'-'.join(str(p) for p in err['loc']).replace('_', '-')}: "
                        f"{err['msg']}" if err["loc"] else err["msg"] for err in e.errors())
        raise ConfigError(f"the store's remote tier: {why}") from None


def open_tiers(args: argparse.Namespace) -> StoreTiers | None:
    """The store's tiers below its pool (ConfigError), or None without any."""
    if args.disk_max_pending_chunks < 1:
        raise ConfigError("--disk-max-pending-chunks must be at least 1")
    disk, remote = open_disk(args), open_remote(args)
    if disk is None and remote is None:
        return None
    from kvtier.store.tiers import StoreTiers

    return StoreTiers(disk, remote, args.disk_max_pending_chunks)


def open_disk(args: argparse.Namespace) -> StoreDisk | None:
    """The store's disk tier of ``--disk-path``/``--disk-size`` (ConfigError), or None."""
    if (args.disk_path is None) != (args.disk_size is None):
        raise ConfigError("--disk-path and --disk-size go together: set both for a disk "
                          "tier, or neither")
    if args.disk_path is None:
        return None
    from kvtier.store.tiers import StoreDisk  # imports torch: only with a disk

    try:
        return StoreDisk(os.path.abspath(args.disk_path), parse_bytes(args.disk_size))
    except ConfigError as e:  # its text names the engine's settings: say which flags
        raise ConfigError(f"--disk-path/--disk-size: {e}") from None


def run(args: argparse.Namespace) -> int:
    from kvtier.store.server import StoreServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    path = args.socket or default_socket()
    try:
        size = parse_bytes(args.size)
        if args.lease_ttl <= 0:
            raise ConfigError("--lease-ttl must be positive")
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        tiers = open_tiers(args)
        t0 = time.perf_counter()
        server = StoreServer(path, size, lease_ttl=args.lease_ttl, policy=args.policy,
                             tiers=tiers)
        reserve_s = time.perf_counter() - t0
    except (ValueError, PoolError, OSError) as e:  # ConfigError is a ValueError
        print(f"kvtier store: {e}", file=sys.stderr)
        return 2

    stopping = threading.Event()

    def stop(_sig: int, _frame: FrameType | None) -> None:
        if stopping.is_set():  # a second signal: no more write-back
            os._exit(0)
        stopping.set()
        threading.Thread(target=server.shutdown, args=(args.stop_write_back_s,),
                         daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    where = "" if tiers is None else f", {tiers.describe()}"
    print(f"kvtier store ready on {SCHEME}{path} (pool {format_bytes(size)} reserved in "
          f"{reserve_s:.3f}s{where})", flush=True)
    server.serve_forever()
    server.stopped.wait(args.stop_write_back_s + 30)  # the write-back, the tiers' last I/O
    return 0
