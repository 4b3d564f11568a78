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

from kvtier.config import ConfigError, format_bytes, parse_bytes
from kvtier.store.client import SCHEME
from kvtier.store.pool import PoolError

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


def run(args: argparse.Namespace) -> int:
    from kvtier.store.server import StoreServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    path = args.socket or default_socket()
    try:
        size = parse_bytes(args.size)
        if args.lease_ttl <= 0:
            raise ConfigError("--lease-ttl must be positive")
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        t0 = time.perf_counter()
        server = StoreServer(path, size, lease_ttl=args.lease_ttl, policy=args.policy)
        reserve_s = time.perf_counter() - t0
    except (ValueError, PoolError, OSError) as e:  # ConfigError is a ValueError
        print(f"kvtier store: {e}", file=sys.stderr)
        return 2

    def stop(_sig: int, _frame: FrameType | None) -> None:
        threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"kvtier store ready on {SCHEME}{path} (pool {format_bytes(size)} reserved in "
          f"{reserve_s:.3f}s)", flush=True)
    server.serve_forever()
    return 0
