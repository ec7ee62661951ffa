"""Output tokens/s of each system by batch size, one panel per dtype, from `bench throughput` JSON."""
from __future__ import annotations

SYSTEM_COLOURS = {"radarlab": "tab:blue", "radarlab_eager": "cornflowerblue",
                  "radarlab_torch": "lightsteelblue",
                  "transformers": "tab:orange", "vllm": "tab:green", "vllm_eager": "yellowgreen"}


def plot_throughput(doc: dict):
    """Grouped bars: x = batch size, one bar per system, labelled with tokens/s."""
    import matplotlib.pyplot as plt
    import numpy as np

    results = doc.get("results") if isinstance(doc, dict) else None
    if not results:
        raise ValueError("doc must be a `bench throughput` JSON document with a non-empty 'results' list")
    dtypes = list(dict.fromkeys(r["dtype"] for r in results))
    systems = [s for s in SYSTEM_COLOURS if any(r["system"] == s for r in results)]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(5.5 * len(dtypes), 3.8), squeeze=False)
    for ax, dtype in zip(axes[0], dtypes):
        rows = [r for r in results if r["dtype"] == dtype]
        sizes = sorted({r["batch_size"] for r in rows})
        x = np.arange(len(sizes))
        width = 0.8 / len(systems)
        for i, system in enumerate(systems):
            vals = {r["batch_size"]: r["tokens_per_s"] for r in rows if r["system"] == system}
            heights = [vals.get(b, 0.0) for b in sizes]
            bars = ax.bar(x + (i - (len(systems) - 1) / 2) * width, heights, width, label=system,
                          color=SYSTEM_COLOURS[system])
            ax.bar_label(bars, labels=[f"{h:.0f}" if h else "" for h in heights], fontsize=7, padding=1)
        ax.set_xticks(x, [str(b) for b in sizes])
        ax.set_xlabel("batch size (requests submitted at once)")
        ax.set_ylabel("output tokens/s")
        ax.set_title(dtype)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig
