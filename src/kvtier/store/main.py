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
    from kvtier.store.tiers import StoreDisk

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
                   help="chunks in flight to or from the disk per namespace")


def open_disk(args: argparse.Namespace) -> StoreDisk | None:
    """The store's disk tier of ``--disk-path``/``--disk-size`` (ConfigError), or None."""
    if (args.disk_path is None) != (args.disk_size is None):
        raise ConfigError("--disk-path and --disk-size go together: set both for a disk "
                          "tier, or neither")
    if args.disk_path is None:
        return None
    if args.disk_max_pending_chunks < 1:
        raise ConfigError("--disk-max-pending-chunks must be at least 1")
    from kvtier.store.tiers import StoreDisk  # imports torch: only with a disk

    try:
        return StoreDisk(os.path.abspath(args.disk_path), parse_bytes(args.disk_size),
                         args.disk_max_pending_chunks)
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
        disk = open_disk(args)
        t0 = time.perf_counter()
        server = StoreServer(path, size, lease_ttl=args.lease_ttl, policy=args.policy,
                             disk=disk)
        reserve_s = time.perf_counter() - t0
    except (ValueError, PoolError, OSError) as e:  # ConfigError is a ValueError
        print(f"kvtier store: {e}", file=sys.stderr)
        return 2

    def stop(_sig: int, _frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    where = "" if disk is None else f", disk {format_bytes(disk.size)} at {disk.path}"
    print(f"kvtier store ready on {SCHEME}{path} (pool {format_bytes(size)} reserved in "
          f"{reserve_s:.3f}s{where})", flush=True)
    server.serve_forever()
    return 0
