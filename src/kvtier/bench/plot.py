"""The PNG of a bench run: TTFT distribution per configuration (one colour per configuration;
line style: all, repeated-prefix and first-seen requests), and where prompt tokens came from
(computed, HBM prefix cache, the KV connector)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvtier.bench.client import RequestResult
from kvtier.bench.metrics import Summary


def colour(i: int) -> str:
    """The colour of the i-th configuration (matplotlib's default cycle, C0..C9)."""
    return f"C{i % 10}"


SUBSETS: tuple[tuple[str, str, Callable[[RequestResult], bool]], ...] = (
    ("all", ":", lambda r: True),
    ("repeated-prefix", "-", lambda r: r.reuse_tokens > 0),
    ("first-seen", "--", lambda r: r.reuse_tokens == 0),
)


def cdf_lines(runs: Sequence[tuple[Summary, Sequence[RequestResult]]]
              ) -> list[tuple[str, str, str, str, list[float]]]:
    """The TTFT CDF lines: (configuration, subset, line style, colour, sorted TTFTs in ms);
    a configuration's lines share its colour, a subset's its style; empty subsets left out."""
    out = []
    for i, (s, results) in enumerate(runs):
        for label, style, keep in SUBSETS:
            xs = sorted(1000.0 * r.ttft for r in results if r.ok and r.ttft is not None
                        and keep(r))
            if xs:
                out.append((s.name, label, style, colour(i), xs))
    return out


def plot(path: str, runs: Sequence[tuple[Summary, Sequence[RequestResult]]], title: str) -> None:
    """Write the figure to ``path``. Uses matplotlib's Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.6), width_ratios=[1.6, 1])
    for name, label, style, col, xs in cdf_lines(runs):
        ys = [(k + 1) / len(xs) for k in range(len(xs))]
        ax1.step(xs, ys, style, where="post", color=col, label=f"{name} ({label})")
    ax1.set_xscale("log")
    ax1.set_xlabel("TTFT (ms, log scale)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("TTFT distribution")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)

    names = [s.name for s, _ in runs]
    hbm = [max(0, s.hbm_tokens or 0) for s, _ in runs]
    kvt = [s.connector_tokens for s, _ in runs]
    computed = [max(0, s.prompt_tokens - h - k) for s, h, k in zip((s for s, _ in runs), hbm, kvt)]
    x = range(len(names))
    ax2.bar(x, computed, label="computed", color="#bbbbbb")
    ax2.bar(x, hbm, bottom=computed, label="from HBM", color="#4c72b0")
    ax2.bar(x, kvt, bottom=[c + h for c, h in zip(computed, hbm)], label="from the KV connector",
            color="#dd8452")
    ax2.set_xticks(list(x), names)
    ax2.set_ylabel("prompt tokens")
    ax2.set_title("prompt tokens by source")
    ax2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
