"""The ``kvtier`` command.

    kvtier serve MODEL [vLLM args]     vLLM's OpenAI server with kvtier as its KV connector
    kvtier bench [NAME] [args]         a benchmark; NAME is one of kvtier.bench.BENCHES
                                       (default: serving, so `kvtier bench --compare ...` works)
    kvtier config [--json]             every kvtier setting with its default and its doc
    kvtier store --size SIZE           the node-wide store engines attach to (store_url)
    kvtier --version                   the installed kvtier's version

Subcommands import their heavy dependencies only when they run; ``kvtier --help`` imports no
vLLM and no torch; ``kvtier --version`` imports nothing beyond the standard library (it is
what one runs to report a broken install).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
import typing
from collections.abc import Sequence
from typing import Any

import kvtier
from kvtier import bench


def version_line() -> str:
    return f"kvtier {kvtier.__version__}"


def _bench_modules() -> dict[str, Any]:
    return {name: importlib.import_module(path) for name, path in bench.BENCHES.items()}


def build_parser() -> argparse.ArgumentParser:
    from kvtier.vllm import serve

    p = argparse.ArgumentParser(prog="kvtier", allow_abbrev=False,
                                description="kvtier: a KV-cache offload tier for vLLM.")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="command", required=True, metavar="{serve,bench,config,store}")

    sp = sub.add_parser("serve", allow_abbrev=False, help="start vLLM's OpenAI server with kvtier",
                        description="Start vLLM's OpenAI-compatible server with kvtier as its KV "
                        "connector. Arguments kvtier does not know go to vLLM unchanged.",
                        epilog="example: kvtier serve ./model --dram-size 32GiB --port 8000 "
                        "--max-model-len 32768")
    serve.add_arguments(sp)
    sp.add_argument("--dry-run", action="store_true",
                    help="check the arguments with vLLM's parser and print the vLLM command "
                    "instead of running it")
    sp.add_argument("--ready-timeout", type=float, default=900.0,
                    help="seconds to wait for the server to answer /health")

    bp = sub.add_parser("bench", allow_abbrev=False, help="run a benchmark",
                        description="Benchmarks. Without a name: "
                        f"`kvtier bench {bench.DEFAULT}`.")
    bsub = bp.add_subparsers(dest="bench", required=True, metavar="{" + ",".join(bench.BENCHES)
                             + "}")
    for name, mod in _bench_modules().items():
        mp = bsub.add_parser(name, allow_abbrev=False, help=mod.HELP, description=mod.HELP)
        mod.add_arguments(mp)

    cp = sub.add_parser("config", help="print every kvtier setting with its doc")
    cp.add_argument("--json", action="store_true", help="as JSON")

    from kvtier.store import main as store_main

    stp = sub.add_parser("store", allow_abbrev=False, help=store_main.HELP,
                         description=store_main.HELP)
    store_main.add_arguments(stp)
    return p


def _with_default_bench(argv: list[str]) -> list[str]:
    """``kvtier bench --flag ...`` means ``kvtier bench DEFAULT --flag ...``."""
    if (len(argv) >= 2 and argv[0] == "bench" and argv[1].startswith("-")
            and argv[1] not in ("-h", "--help")):
        return [argv[0], bench.DEFAULT, *argv[1:]]
    return argv


def settings_doc() -> list[dict[str, Any]]:
    """Every field of :class:`KvtierConfig`: name, type, default, env var and description."""
    from kvtier.config import ENV_PREFIX, KvtierConfig, format_bytes

    out = []
    for name, f in KvtierConfig.model_fields.items():
        default = f.get_default(call_default_factory=True)
        if isinstance(default, int) and not isinstance(default, bool) and (
                name.endswith("_size")):
            default = format_bytes(default)
        ann = f.annotation
        typ = getattr(ann, "__name__", None) or str(ann).replace("typing.", "")
        if typing.get_origin(ann) is typing.Literal:
            typ = "one of " + ", ".join(map(str, typing.get_args(ann)))
        if name.endswith("_size"):
            typ = "byte size (e.g. '64GiB')" + (" or None" if "None" in str(ann) else "")
        out.append({"name": name, "type": typ, "default": default,
                    "env": ENV_PREFIX + name.upper(), "doc": f.description or ""})
    return out


def _print_config(as_json: bool) -> int:
    rows = settings_doc()
    if as_json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    print("kvtier settings: put them in --kv-transfer-config's kv_connector_extra_config "
          "(or `kvtier serve --kvtier-set KEY=VALUE`), or set the environment variable.\n")
    for r in rows:
        print(f"{r['name']} = {r['default']!r}   [{r['type']}; {r['env']}]")
        print(f"    {r['doc']}")
    return 0


def _store(argv: list[str]) -> int:
    from kvtier.store import main as store_main

    p = argparse.ArgumentParser(prog="kvtier store", allow_abbrev=False,
                                description=store_main.HELP)
    store_main.add_arguments(p)
    return store_main.run(p.parse_args(argv))


def main(argv: Sequence[str] | None = None) -> int:
    args_in = _with_default_bench(list(sys.argv[1:] if argv is None else argv))
    if args_in == ["--version"]:  # before build_parser, which imports pydantic
        print(version_line())
        return 0
    if args_in[:1] == ["store"]:  # the store imports no vLLM and no benches
        return _store(args_in[1:])
    parser = build_parser()
    args, rest = parser.parse_known_args(args_in)
    if args.command != "serve" and rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "config":
        return _print_config(args.json)
    if args.command == "bench":
        return int(_bench_modules()[args.bench].run(args))

    from kvtier.config import ConfigError
    from kvtier.vllm import serve

    try:
        sa = serve.from_namespace(args, rest)
        if not args.dry_run:
            return serve.serve(sa, args.ready_timeout)
        cmd = serve.vllm_command(sa)
        serve.preflight(sa, cmd, check_port=False)
    except ConfigError as e:
        print(f"kvtier serve: {e}", file=sys.stderr)
        return 2
    import shlex

    print(shlex.join(cmd))
    return 0

if __name__ == "__main__":
    sys.exit(main())
