"""Draw an engine timeline: one row per request, one column per step, coloured by what it did."""
from __future__ import annotations

from typing import Hashable, Sequence

from radarlab.lab.timeline import (
    DECODE,
    DONE,
    PREFILL,
    RECOMPUTE,
    STATES,
    VERIFY,
    WAITING,
    StepRecord,
    state_grid,
)

STATE_COLORS = {WAITING: "#d9d9d9", PREFILL: "tab:orange", RECOMPUTE: "tab:red", DECODE: "tab:blue",
                VERIFY: "tab:green", DONE: "white"}
STATE_LABELS = {WAITING: "waiting", PREFILL: "prefill (chunk)", RECOMPUTE: "recompute after preemption",
                DECODE: "decode (1 token)", VERIFY: "verify (1 token + drafts)", DONE: "done"}


def draw_timeline(ax, records: Sequence[StepRecord], request_ids: Sequence[Hashable], *, labels=None,
                  annotate: bool = False, legend: bool = True, title: str | None = None):
    """Draw records on ax: cells coloured by state (radarlab.lab.timeline.state_grid), a black x
    where a request was preempted. annotate writes each prefill or recompute chunk's token count in
    its cell. labels name the rows (default: the request ids). Returns ax."""
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    if not records:
        raise ValueError("records is empty: nothing to draw")
    grid = state_grid(records, request_ids)
    codes = np.array([[STATES.index(s) for s in row] for row in grid])
    cmap = ListedColormap([STATE_COLORS[s] for s in STATES])
    steps = [r.step for r in records]
    ax.imshow(codes, cmap=cmap, vmin=-0.5, vmax=len(STATES) - 0.5, aspect="auto", interpolation="nearest",
              extent=(steps[0] - 0.5, steps[-1] + 0.5, len(request_ids) - 0.5, -0.5))
    row_of = {rid: i for i, rid in enumerate(request_ids)}
    for rec in records:
        for rid in rec.preempted:
            if rid in row_of:
                ax.plot(rec.step, row_of[rid], marker="x", color="black", markersize=7, mew=2)
        if annotate:
            for w in rec.scheduled:
                if w.kind in (PREFILL, RECOMPUTE) and w.request_id in row_of:
                    ax.text(rec.step, row_of[w.request_id], str(w.num_tokens), ha="center", va="center",
                            fontsize=7, color="white" if w.kind == RECOMPUTE else "black")
    # thin separators between rows and steps, so that adjacent cells of one colour stay countable
    for y in range(len(request_ids) - 1):
        ax.axhline(y + 0.5, color="white", lw=0.6)
    if len(steps) <= 80:
        for x in steps[:-1]:
            ax.axvline(x + 0.5, color="white", lw=0.4)
    ax.set_yticks(range(len(request_ids)), [str(x) for x in (labels or request_ids)])
    ax.set_xlabel("engine step")
    ax.set_ylabel("request")
    if title:
        ax.set_title(title, fontsize=10, loc="left")
    if legend:
        used = {s for row in grid for s in row}
        handles = [Patch(facecolor=STATE_COLORS[s], edgecolor="gray", label=STATE_LABELS[s]) for s in STATES
                   if s in used]
        if any(rec.preempted for rec in records):
            from matplotlib.lines import Line2D
            handles.append(Line2D([], [], marker="x", color="black", ls="", mew=2, label="preempted"))
        ax.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax
