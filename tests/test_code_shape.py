"""The shape rules the project keeps (docs/design.md): short functions in src/, and comments
that point inside the repository."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_FUNCTION_LINES = 80
# Spelled in pieces so that this file does not cite them itself.
OUTSIDE = re.compile("DESIGN" + r"\.md|\.\./" + "shared")


def test_no_function_in_src_is_longer_than_80_lines() -> None:
    long = []
    for path in sorted((ROOT / "src").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                n = node.end_lineno - start + 1 if node.end_lineno else 0
                if n > MAX_FUNCTION_LINES:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "functions over ~80 lines (split them):\n" + "\n".join(long)


def test_nothing_cites_the_design_notes_outside_the_repository() -> None:
    found = []
    for top in ("src", "tests", "tools"):
        for path in sorted((ROOT / top).rglob("*")):
            if not path.is_file() or path.suffix in (".pyc", ".so"):
                continue
            try:
                text = path.read_text()
            except UnicodeDecodeError:
                continue
            for i, line in enumerate(text.splitlines(), 1):
                if OUTSIDE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not found, ("cite docs/design.md §N instead of the notes outside the repository:\n"
                       + "\n".join(found))
