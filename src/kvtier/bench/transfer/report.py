"""The outputs of ``kvtier bench transfer``: the targets met or missed, the table (stdout and
``.md``), the JSON and the PNG."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from kvtier.bench.transfer.cases import KIB, MIB

TARGETS = {"large": 0.90, "small": 0.75, "both": 0.80, "gemm_link": 0.80, "gemm_slow": 0.05}
KINDS = ("save", "load", "both")


def _name(c: dict[str, Any]) -> str:
    return f"{c['family']} {c['chunk_target'] // KIB}KiB"


def _link_misses(result: dict[str, Any], lo: int, hi: int | None, frac: float,
                 link: dict[str, float]) -> list[str]:
    """Cells of chunk targets in [lo, hi) whose auto path saves or loads below ``frac`` of
    the link."""
    misses = []
    for c in result["cells"]:
        if not (c["chunk_target"] >= lo and (hi is None or c["chunk_target"] < hi)):
            continue
        if not c.get("auto"):
            misses.append(f"{_name(c)}: no measurement of the auto path ({c.get('errors')})")
            continue
        m = c["modes"][c["auto"]]
        for kind in ("save", "load"):
            if m[kind]["gbps"] < frac * link[kind]:
                misses.append(f"{_name(c)} {kind} {m[kind]['gbps']:.1f} < "
                              f"{frac * link[kind]:.1f}")
    return misses


def _both_misses(result: dict[str, Any], bidir: float) -> list[str]:
    misses = []
    for c in result["cells"]:
        if c.get("auto") and c["chunk_target"] >= 2 * MIB:
            g = c["modes"][c["auto"]]["both"]["gbps"]
            if g < TARGETS["both"] * bidir:
                misses.append(f"{_name(c)} both {g:.1f} < {TARGETS['both'] * bidir:.1f}")
    return misses


def _gemm_misses(result: dict[str, Any], link: dict[str, float]) -> tuple[bool, list[str]]:
    """(any run under the GEMM, the misses)."""
    misses = []
    seen = False
    for c in result["cells"]:
        m = c["modes"].get(c.get("auto") or "", {})
        for kind in ("save", "load"):
            g = m.get("gemm_" + kind)
            if not g:
                continue
            seen = True
            if g["gbps"] < TARGETS["gemm_link"] * link[kind]:
                misses.append(f"{_name(c)} {kind} {g['gbps']:.1f} GB/s under GEMM")
            if not g["slowdown"] < TARGETS["gemm_slow"]:
                misses.append(f"{_name(c)} {kind} GEMM slowed {100 * g['slowdown']:.1f}%")
    return seen, misses


def targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue target, met or not, on the auto path (the one the engine picks)."""
    ceil = result.get("ceiling")
    if not ceil:
        return []
    link = {"save": ceil["d2h"]["gbps"], "load": ceil["h2d"]["gbps"]}
    out = []

    def add(name: str, what: str, ok: bool, detail: list[str]) -> None:
        out.append({"name": name, "what": what, "met": ok, "misses": detail})

    for name, lo, hi, frac in (("2MiB", 2 * MIB, None, TARGETS["large"]),
                               ("256KiB", 0, 2 * MIB, TARGETS["small"])):
        misses = _link_misses(result, lo, hi, frac, link)
        add(name, f"save and load >= {frac:.0%} of the link for "
            f"{'chunks >= 2 MiB' if hi is None else '256 KiB chunks'}", not misses, misses)
    misses = _both_misses(result, ceil["both"]["gbps"])
    add("both", "save and load at once >= 80% of the bidirectional ceiling (chunks >= 2 MiB)",
        not misses, misses)
    seen, misses = _gemm_misses(result, link)
    add("gemm", "under the GEMM: transfers >= 80% of the link, GEMM slowed < 5%",
        seen and not misses, misses)
    return out


def line(mode: str, m: dict[str, Any]) -> str:
    """One mode's figures on one line (the progress output)."""
    s = (f"{mode:6s} save {m['save']['gbps']:6.1f}  load {m['load']['gbps']:6.1f}  "
         f"both {m['both']['gbps']:6.1f} GB/s")
    if "gemm_save" in m:
        s += "  | under GEMM: " + "  ".join(
            f"{k} {m['gemm_' + k]['gbps']:.1f} ({100 * m['gemm_' + k]['slowdown']:+.1f}%)"
            for k in KINDS)
    return s + f"  [{','.join(m['paths'])}]"


def _cell_rows(result: dict[str, Any]) -> list[str]:
    lines = ["| layout | chunk | pieces (B) | path | save | load | both | save+GEMM (slow) | "
             "load+GEMM (slow) | both+GEMM (slow) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        for mode, m in c["modes"].items():
            star = "*" if mode == c.get("auto") else ""

            def g(k: str, m: dict[str, Any] = m) -> str:
                x = m.get("gemm_" + k)
                return f"{x['gbps']:.1f} ({100 * x['slowdown']:+.1f}%)" if x else "-"
            lines.append(
                f"| {c['family']} | {c['chunk_bytes'] / KIB:.0f} KiB x{c['blocks_per_chunk']} | "
                f"{c['min_piece']}..{c['max_piece']} | {mode}{star} | {m['save']['gbps']:.1f} | "
                f"{m['load']['gbps']:.1f} | {m['both']['gbps']:.1f} | {g('save')} | "
                f"{g('load')} | {g('both')} |")
    return lines


def _reference_rows(result: dict[str, Any]) -> list[str]:
    """The ceilings, the naive path, the GEMM alone and the targets, where measured."""
    out: list[str] = []
    if result.get("ceiling"):
        c = result["ceiling"]
        out += ["", "| ceiling (pinned 1 GiB, median) | measured GB/s | design.md §3 | "
                "within 5% |", "|---|---|---|---|"]
        for k in ("d2h", "h2d", "both"):
            out.append(f"| {k} | {c[k]['gbps']:.1f} | {c[k]['design']} | "
                       f"{'yes' if c[k]['within_5pct_of_design'] else 'NO'} |")
    if result.get("naive"):
        n = result["naive"]
        out += ["", f"naive, one copy_ per 64 KiB piece (mha 2 MiB chunks): save "
                f"{n['save']:.2f} GB/s, load {n['load']:.2f} GB/s"]
    if result.get("gemm_ms_alone"):
        out += ["", f"GEMM bf16 8192^3 alone: {result['gemm_ms_alone']:.3f} ms"]
    if result.get("targets"):
        out += ["", "| target | met | misses |", "|---|---|---|"]
        for t in result["targets"]:
            out.append(f"| {t['what']} | {'MET' if t['met'] else 'not met'} | "
                       f"{'; '.join(t['misses'][:6])}{' ...' if len(t['misses']) > 6 else ''} |")
    return out


def table(result: dict[str, Any]) -> str:
    out = ["GB/s; * = the path the engine picks (auto); (slow) = GEMM slowdown", "",
           *_cell_rows(result), *_reference_rows(result)]
    return "\n".join(out)


def plot(path: str, result: dict[str, Any]) -> None:
    """GB/s per cell and path, alone and under the GEMM, against the pinned ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cells = result["cells"]
    fig, axes = plt.subplots(2, 3, figsize=(16, 8), sharey="col")
    for row, gemm in enumerate(("", "gemm_")):
        for col, kind in enumerate(KINDS):
            ax = axes[row][col]
            labels = [f"{c['family']}\n{c['chunk_bytes'] / KIB:.0f}K" for c in cells]
            x = range(len(cells))
            width = 0.28
            for i, mode in enumerate(("dma", "kernel", "auto")):
                ys = [c["modes"].get(mode, {}).get(gemm + kind, {}).get("gbps", 0) for c in cells]
                if any(ys):
                    ax.bar([v + (i - 1) * width for v in x], ys, width, label=mode)
            if result.get("ceiling"):
                ref = result["ceiling"]["both" if kind == "both" else
                                        "d2h" if kind == "save" else "h2d"]["gbps"]
                ax.axhline(ref, color="k", lw=1, ls="--", label="pinned ceiling")
            ax.set_xticks(list(x), labels, fontsize=6, rotation=90)
            ax.set_title(f"{kind}{' under GEMM' if gemm else ''} (GB/s)", fontsize=9)
            ax.legend(fontsize=7)
    fig.suptitle(f"kvtier bench transfer, {result['meta'].get('gpu')}, "
                 f"{result['meta'].get('date')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write(args: argparse.Namespace, result: dict[str, Any], quiet: bool = False) -> None:
    """The JSON (always: what is done survives a time-out); unless ``quiet`` also the table
    (printed and ``.md``) and the PNG."""
    os.makedirs(args.out, exist_ok=True)
    gpu = str(result["meta"].get("gpu", "gpu")).replace(" ", "-")
    stem = os.path.join(args.out, f"transfer-{result['meta']['date'][:10]}-{gpu}"
                                  f"{'-' + args.tag if args.tag else ''}")
    with open(stem + ".json", "w") as f:
        json.dump(result, f, indent=1, default=float)
        f.write("\n")
    if quiet:
        return
    text = table(result)
    with open(stem + ".md", "w") as f:
        f.write(f"# kvtier bench transfer\n\n{result['meta']['date']}, {result['meta']['gpu']}, "
                f"`{result['meta']['command']}`\n\n{text}\n")
    try:
        plot(stem + ".png", result)
    except ImportError as e:
        print(f"no plot: {e}", file=sys.stderr)
    print("\n" + text)
    print(f"\nwrote {stem}.json, .md, .png")
