"""docs/troubleshooting.md quotes every start-up error kvtier raises: each ``raise`` of a
start-up error class in the production code (the configuration's validators, layout, slab,
shared memory, disk and remote tiers, the node-wide store, ``kvtier serve``) has the longest
literal part of its message on the page. A new refusal without its row fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "kvtier"
# The classes a deployer sees at start-up (ConfigError is what vLLM shows as a ValueError;
# config.py's validators raise plain ValueError, which pydantic turns into a ConfigError).
STARTUP_ERRORS = {"ConfigError", "LayoutError", "SlabError", "PoolError"}
NOT_PRODUCTION = ("testing", "bench")  # test support and benchmarks have no deployers
# Internal invariants: no setting, environment or input reaches them (a bug, not a page row).
INVARIANTS = {
    "num_shards must be at least 1",  # the slab layout of a world size >= 1
    "checksum entries",  # one checksum array per slot class, built together
    "a pinned slab cannot move to a new pool",  # the store's mapping is never pinned
}
MIN_LITERAL = 12  # shorter literal parts ("got ", ", ") say nothing on their own


def _literal_parts(node: ast.expr) -> list[str]:
    """The constant text of a message expression; a formatted value breaks it into parts."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.JoinedStr):
        out = [""]
        for v in node.values:
            if isinstance(v, ast.Constant) and isinstance(v.value, str):
                out[-1] += v.value
            else:
                out.append("")
        return out
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _literal_parts(node.left), _literal_parts(node.right)
        return [*left[:-1], left[-1] + right[0], *right[1:]]
    return [""]


def _startup_raises() -> list[tuple[str, str]]:
    """(where, the message's longest literal part) of every start-up error raised."""
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if path.relative_to(SRC).parts[0] in NOT_PRODUCTION:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call)
                    and node.exc.args and isinstance(node.exc.func, ast.Name)):
                continue
            name = node.exc.func.id
            if name not in STARTUP_ERRORS and not (name == "ValueError"
                                                   and path.name == "config.py"):
                continue
            parts = [p.strip() for p in _literal_parts(node.exc.args[0])]
            longest = max(parts, key=len)
            if len(longest) >= MIN_LITERAL:
                found.append((f"{path.relative_to(ROOT)}:{node.lineno}", longest))
    return found


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


def test_the_scan_finds_the_refusals_it_is_meant_to() -> None:
    found = {text for _, text in _startup_raises()}
    assert len(found) > 40  # every module's refusals, not an empty walk
    assert any(t.startswith("kvtier setting remote_url: the remote tier keeps") for t in found)
    assert any("is already in use (another server?)" in t for t in found)  # kvtier serve
    assert any("a store already listens on" in t for t in found)  # kvtier store


def test_every_startup_error_is_on_the_troubleshooting_page() -> None:
    page = _flat((ROOT / "docs" / "troubleshooting.md").read_text())
    missing = [f"{where}: {text!r}" for where, text in _startup_raises()
               if _flat(text) not in page and not any(i in text for i in INVARIANTS)]
    assert not missing, "not quoted in docs/troubleshooting.md:\n" + "\n".join(missing)
