"""Plots of the latency sweep (radarlab.bench.latency): what users wait for, and what the server does.

The numbers come from `python -m radarlab.bench latency` (its JSON "results" list) or
radarlab.bench.latency.run; nothing is computed here but unit conversions.
"""
from __future__ import annotations

from typing import Sequence


def plot_latency_sweep(results: Sequence[dict], title: str | None = None):
    """A Figure with three panels: TTFT p50/p99 vs request rate, ITL p50/p99 vs request rate (both
    log-log), and output throughput vs mean concurrency, each point labelled with its rate.
    Save it with radarlab.viz.plots.save_figure(fig, "latency_sweep")."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullLocator

    if not results:
        raise ValueError("results is empty")
    rows = sorted(results, key=lambda r: r["rate"])
    rates = [r["rate"] for r in rows]

    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, key, label, scale, unit in [(axes[0], "ttft_s", "time to first token", 1.0, "s"),
                                        (axes[1], "itl_s", "inter-token latency", 1e3, "ms")]:
        for q, style in [("p50", "o-"), ("p99", "s--")]:
            values = [r[key][q] * scale if r[key][q] is not None else float("nan") for r in rows]
            ax.plot(rates, values, style, label=q)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(rates, [f"{r:g}" for r in rates])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))
        ax.set_xlabel("request rate (requests / s, Poisson)")
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()

    ax = axes[2]
    conc = [r["concurrency"]["mean"] for r in rows]
    tput = [r["output_throughput_tok_s"] for r in rows]
    ax.plot(conc, tput, "o-")
    for c, t, rate in zip(conc, tput, rates):
        ax.annotate(f"{rate:g}/s", (c, t), textcoords="offset points", xytext=(5, -10), fontsize=8)
    ax.set_xlim(left=0)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("mean concurrency (requests per step)")
    ax.set_ylabel("output throughput (tokens / s)")
    ax.set_title("throughput vs concurrency")
    ax.grid(True, alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
