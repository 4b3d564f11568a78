"""docs/metrics.md against what is really exported: the series a Prometheus registry holds
after vLLM builds kvtier's metrics (kvtier.vllm.prom.KvtierPromMetrics, as vLLM does, on a
private registry), compared both ways with the documented table (names, types, labels and
their values), and every ``vllm:kvtier_*`` name the docs mention is one of them.

tests/test_metrics_table.py checks that the page is the table in the code; this checks the
table in the page is what a scrape shows, so a series registered outside the table, or a
label the table does not describe, fails here."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvtier.vllm.prom import KvtierPromMetrics

ROOT = Path(__file__).resolve().parent.parent
ENGINE_LABELS = ("model_name", "engine")  # vLLM's own labels on every connector series
BEGIN = "<!-- BEGIN GENERATED: python -m kvtier.vllm.counters -->\n"
Labels = dict[str, frozenset[str]]


def _exported() -> dict[str, tuple[str, Labels]]:
    """Exported name (a counter's with ``_total``) -> (type, label -> values), from a fresh
    registry before any traffic (every series exists from start-up)."""
    reg = CollectorRegistry()

    def bind(cls: type) -> type:
        class Bound(cls):  # type: ignore[misc,valid-type]
            def __init__(self, *a: Any, **kw: Any) -> None:
                kw.pop("multiprocess_mode", None)  # vLLM's gauge class takes it; this one not
                super().__init__(*a, registry=reg, **kw)
        return Bound

    class Cfg:
        kv_transfer_config = None

    types = {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)}
    KvtierPromMetrics(Cfg(), types, list(ENGINE_LABELS), {0: ["m", "0"], 1: ["m", "1"]})
    out: dict[str, tuple[str, Labels]] = {}
    for family in reg.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        labels: dict[str, set[str]] = {}
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue  # prometheus_client's creation timestamps, not kvtier's series
            for k, v in sample.labels.items():
                if k not in (*ENGINE_LABELS, "le"):
                    labels.setdefault(k, set()).add(v)
        out[name] = (family.type, {k: frozenset(v) for k, v in labels.items()})
    return out


def _documented() -> dict[str, tuple[str, Labels]]:
    """docs/metrics.md's table: name -> (type, label -> values, deprecated aliases included)."""
    text = (ROOT / "docs" / "metrics.md").read_text()
    rows = [line for line in text.split(BEGIN, 1)[1].splitlines()
            if line.startswith("| `vllm:")]
    out: dict[str, tuple[str, Labels]] = {}
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        name, kind, labels = cells[0].strip("`"), cells[1], cells[2]
        parsed: Labels = {}
        for part in filter(None, (p.strip() for p in labels.split(";"))):
            label, _, values = part.partition(":")
            parsed[label.strip("` ")] = frozenset(re.findall(r"`([^`]+)`", values))
        assert name not in out, f"{name} is documented twice"
        out[name] = (kind, parsed)
    return out


def test_the_documented_table_is_every_exported_series() -> None:
    exported, documented = _exported(), _documented()
    assert exported, "the registry holds no kvtier series"
    assert set(exported) - set(documented) == set(), "exported but not in docs/metrics.md"
    assert set(documented) - set(exported) == set(), "in docs/metrics.md but not exported"
    for name, (kind, labels) in exported.items():
        assert documented[name] == (kind, labels), (
            f"{name}: exported as {kind} {labels}, documented as {documented[name]}")


def test_every_kvtier_series_the_docs_name_is_exported() -> None:
    exported = _exported()
    suffixes = {name: ("",) if kind != "histogram" else ("", "_bucket", "_sum", "_count")
                for name, (kind, _) in exported.items()}
    series = {name + s for name, ss in suffixes.items() for s in ss}
    # `vllm:kvtier_disk_*` is a prefix; `vllm:kvtier_<key>_total` a template, not a name
    pattern = re.compile(r"(vllm:kvtier_[a-z0-9_]*)([*<]?)")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for name, wildcard in pattern.findall(path.read_text()):
            where = f"{path.relative_to(ROOT)} names {name}{wildcard}"
            if wildcard == "<":
                continue
            if wildcard:
                assert any(s.startswith(name) for s in series), f"{where}: no such series"
            else:
                assert name in series, f"{where}, not exported"
