"""Plots of the latency sweep (radarlab.bench.latency): what users wait for, and what the server does.

The numbers come from `python -m radarlab.bench latency` (its JSON "results" and "budget_sweep"
lists) or radarlab.bench.latency.run / run_budget_sweep; nothing is computed here but unit conversions.
"""
from __future__ import annotations

from typing import Sequence


def _log_axes(ax, xs, base_x: int = 2) -> None:
    from matplotlib.ticker import FuncFormatter, NullLocator

    ax.set_xscale("log", base=base_x)
    ax.set_xticks(xs, [f"{x:g}" for x in xs])
    ax.xaxis.set_minor_locator(NullLocator())
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_yscale() == "log":
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.1e}"[0] in "25" else ""))


def _quantiles(ax, xs, rows, key: str, scale: float) -> None:
    for q, style in [("p50", "o-"), ("p99", "s--")]:
        ax.plot(xs, [r[key][q] * scale if r[key][q] is not None else float("nan") for r in rows], style,
                label=q)


def plot_latency_sweep(results: Sequence[dict], budget_sweep: Sequence[dict] | None = None,
                       max_num_seqs: int | None = None, title: str | None = None):
    """A Figure: TTFT p50/p99 and ITL p50/p99 against the request rate (log-log); the time-weighted
    concurrency against the rate, in the system and in the batch, with lambda x W beside L (Little's
    law) and max_num_seqs as a line if given; and, with a budget sweep, ITL p50/p99 against
    max_num_batched_tokens. Save it with radarlab.viz.plots.save_figure(fig, "latency_sweep")."""
    import matplotlib.pyplot as plt

    if not results:
        raise ValueError("results is empty")
    rows = sorted(results, key=lambda r: r["rate"])
    rates = [r["rate"] for r in rows]
    budgets = sorted(budget_sweep or [], key=lambda r: r["max_num_batched_tokens"])

    fig, axes = plt.subplots(1, 4 if budgets else 3, figsize=(18 if budgets else 14, 4.2))
    for ax, key, label, scale, unit in [(axes[0], "ttft_s", "time to first token", 1.0, "s"),
                                        (axes[1], "itl_s", "inter-token latency", 1e3, "ms")]:
        _quantiles(ax, rates, rows, key, scale)
        ax.set_yscale("log")
        _log_axes(ax, rates)
        ax.set_xlabel("request rate (requests / s, Poisson)")
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(label)
        ax.legend()

    ax = axes[2]
    conc = [r["concurrency"] for r in rows]
    ax.plot(rates, [c["in_system_time_weighted"] for c in conc], "o-", label="L: in the system")
    ax.plot(rates, [r["littles_law"]["lambda_x_W"] for r in rows], "x", markersize=10, label="lambda x W")
    ax.plot(rates, [c["running_time_weighted"] for c in conc], "s-", label="in the batch")
    if max_num_seqs is not None:
        ax.axhline(max_num_seqs, color="gray", linestyle=":", label=f"max_num_seqs = {max_num_seqs}")
    _log_axes(ax, rates)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("request rate (requests / s, Poisson)")
    ax.set_ylabel("requests (time-weighted mean)")
    ax.set_title("concurrency and Little's law")
    ax.legend(fontsize=8)

    if budgets:
        ax = axes[3]
        xs = [r["max_num_batched_tokens"] for r in budgets]
        _quantiles(ax, xs, budgets, "itl_s", 1e3)
        _log_axes(ax, xs)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("max_num_batched_tokens (token budget per step)")
        ax.set_ylabel("inter-token latency (ms)")
        ax.set_title(f"ITL vs token budget at {budgets[0]['rate']:g} requests / s")
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
