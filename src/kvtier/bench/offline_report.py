"""The report of ``kvtier bench offline``: the short table, the seconds per category with their
gap to null-copy, the wall seconds by kind of step, and the PNG of per-request timelines.

Contract: every table uses, per configuration, its median-wall run (:func:`median_run`);
"tokens = big" counts requests whose greedy tokens equal the ``big`` run's (``hbm``'s when
there is no big run): big reads every prefix from vLLM's own cache, so a restored prefix must
give the same tokens (the restore check over every request); null-copy's are not expected to
(it restores whatever HBM held); the category gap needs a
``kvtier-null-copy`` run (:func:`kvtier.bench.steps.gap_table`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.bench.steps import CATEGORIES, PHASES, STEP_KINDS, gap_table

FLOOR = "kvtier-null-copy"
CATEGORY_NAMES = {
    "wait_s": "transfer wait", "parked_s": "parked steps",
    "connector_sched_s": "connector Python (scheduler)",
    "connector_worker_s": "connector Python (worker)", "scheduler_s": "vLLM scheduler Python",
    "forward_s": "forward (model runner)", "recorder_s": "bench recorder",
    "outside_s": "outside steps (LLM loop)",
}


def median_run(results: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    ok = sorted((r for r in results if "wall_s" in r), key=lambda r: r["wall_s"])
    return ok[(len(ok) - 1) // 2] if ok else None


def _medians(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> dict[str, Mapping[str, Any]]:
    out = {}
    for c, results in runs.items():
        m = median_run(results)
        if m is not None:
            out[c] = m
    return out


def _same_tokens(run: Mapping[str, Any], ref: Mapping[str, Any] | None) -> str:
    if ref is None:
        return "-"
    same = sum(a == b for a, b in zip(run["tokens"], ref["tokens"]))
    return f"{same}/{len(ref['tokens'])}"


def short_table(summary: Mapping[str, Any], runs: Mapping[str, Sequence[Mapping[str, Any]]]
                ) -> list[str]:
    med = _medians(runs)
    floor = med.get(FLOOR)
    lines = ["| config | wall s (median) | runs | x null-copy | cached prompt tokens | "
             + " | ".join(f"mean {p} s" for p in PHASES) + " | parks (steps: n) | tokens = big |",
             "|---" * (7 + len(PHASES)) + "|"]
    for c, info in summary["configs"].items():
        m = med.get(c)
        if m is None:
            err = info["errors"][0]["error"] if info["errors"] else "no run"
            lines.append(f"| {c} | failed: {err} |" + " |" * (5 + len(PHASES)))
            continue
        ratio = f"{m['wall_s'] / floor['wall_s']:.3f}" if floor else "-"
        runs_s = ", ".join(f"{w:.2f}" for w in info["wall_s"])
        phases = " | ".join(f"{m['phase_means_s'][p]:.3f}" for p in PHASES)
        parks = ", ".join(f"{k}: {v}" for k, v in m["park_steps"].items()) or "none"
        lines.append(f"| {c} | {m['wall_s']:.3f} | {runs_s} | {ratio} | "
                     f"{m['cached_prompt_tokens']:,} | {phases} | {parks} | "
                     f"{_same_tokens(m, med.get('big', med.get('hbm')))} |")
    return lines


def category_table(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    med = _medians(runs)
    names = list(med)
    lines = ["| seconds | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for k in CATEGORIES:
        lines.append(f"| {CATEGORY_NAMES[k]} | "
                     + " | ".join(f"{med[c]['categories_s'][k]:.3f}" for c in names) + " |")
    lines.append("| **wall** | " + " | ".join(f"{med[c]['wall_s']:.3f}" for c in names) + " |")
    if FLOOR not in med:
        return lines
    gap = gap_table({c: m["categories_s"] for c, m in med.items()},
                    {c: m["wall_s"] for c, m in med.items()}, FLOOR)
    lines += ["", f"Gap to {FLOOR} (seconds; 'explained': the named categories' sum over the "
              "wall gap, outside-steps and recorder time left out):", "",
              "| config | wall gap | " + " | ".join(CATEGORY_NAMES[k] for k in CATEGORIES)
              + " | explained |", "|---" * (len(CATEGORIES) + 3) + "|"]
    for c, row in gap.items():
        if c == FLOOR:
            continue
        lines.append(f"| {c} | {row['wall_gap_s']:+.3f} | "
                     + " | ".join(f"{row[k]:+.3f}" for k in CATEGORIES)
                     + f" | {100 * row['explained']:.0f}% |")
    return lines


def step_kind_table(runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> list[str]:
    """Wall seconds by kind of step, and a decode step's median milliseconds at each batch
    size every configuration ran at least 20 times (:func:`kvtier.bench.steps.step_kinds`)."""
    med = {c: m for c, m in _medians(runs).items() if "step_kinds" in m}
    if not med:
        return []
    names = list(med)
    lines = ["| steps: n, seconds | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for k in STEP_KINDS:
        lines.append(f"| {k} | " + " | ".join(
            f"{med[c]['step_kinds'][k]['steps']}, {med[c]['step_kinds'][k]['seconds']:.3f}"
            for c in names) + " |")
    batches = set.intersection(*(
        {int(b) for b in med[c]["step_kinds"]["decode_median_s_by_batch"]} for c in names))
    for b in sorted(batches):
        lines.append(f"| decode step at batch {b}, median ms | " + " | ".join(
            f"{1000 * _by_batch(med[c], b):.2f}" for c in names) + " |")
    return lines


def _by_batch(run: Mapping[str, Any], batch: int) -> float:
    table = run["step_kinds"]["decode_median_s_by_batch"]
    return float(table.get(batch, table.get(str(batch))))  # str keys after a JSON round trip


def markdown(summary: Mapping[str, Any], runs: Mapping[str, Sequence[Mapping[str, Any]]]) -> str:
    med = _medians(runs)
    out = [f"# Offline reference run: {summary['title']}", "",
           f"{summary['date']}, {summary['device']}, vLLM {summary['vllm']}, "
           f"{summary['rounds']} round(s), alternating order", "",
           f"    {summary['command']}", "", *short_table(summary, runs), "",
           "## Seconds per category (median-wall run of each configuration)", "",
           *category_table(runs)]
    kinds = step_kind_table(runs)
    if kinds:
        out += ["", "## Wall seconds by kind of step", "",
                "Under the asynchronous scheduler a step's GPU work overlaps the next step's "
                "Python, so seconds move between the forward and connector categories above; "
                "step wall times do not, and decode steps of one batch size do the same work "
                "in every configuration.", "", *kinds]
    nc = med.get(FLOOR, {}).get("null_copy")
    if nc:
        out += ["", f"Null-copy engine: jobs by engine steps from submission to report: {nc}"]
    for c, info in summary["configs"].items():
        for e in info["errors"]:
            out += ["", f"{c} failed ({e['error']}); end of its log:", "", "```",
                    e["log_tail"].rstrip(), "```"]
    return "\n".join(out) + "\n"


COLOURS = {"queued": "0.8", "parked": "tab:red", "prefill": "tab:blue", "decode": "tab:green"}


def plot(path: str, runs: Mapping[str, Sequence[Mapping[str, Any]]], title: str) -> None:
    """Per configuration (median-wall run), one row per request: its queued, parked, prefill
    and decode seconds as a horizontal bar from the run's start; matplotlib Agg."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    med = _medians(runs)
    fig, axes = plt.subplots(len(med), 1, figsize=(11, 1.2 + 1.6 * len(med)), squeeze=False,
                             sharex=True)
    for ax, (c, m) in zip(axes[:, 0], med.items()):
        for i, line in enumerate(m["timelines"]):
            left = line.get("start_s", 0.0)
            for p in PHASES:
                w = line.get(p + "_s", 0.0)
                ax.barh(i, w, left=left, color=COLOURS[p], height=0.8,
                        label=p if i == 0 else None)
                left += w
        ax.set_ylabel(c, rotation=0, ha="right", fontsize=8)
        ax.set_yticks([])
        ax.invert_yaxis()  # the first request on top
        ax.set_title(f"{c}: {m['wall_s']:.2f} s", fontsize=8, loc="left")
    axes[0, 0].legend(fontsize=7, ncol=4, loc="upper right")
    axes[-1, 0].set_xlabel("seconds from the run's start (phases stacked per request)")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
