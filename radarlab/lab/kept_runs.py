"""The kept runs in results/ (described in results/README.md): the full runs the notebooks read, too slow
to redo in them, and which one a notebook shows on a CPU of a given kind."""
from __future__ import annotations

import json
from pathlib import Path

from radarlab.device import cpu_kinds


def results_dir() -> Path:
    """The repository's results/ folder: the full runs the notebooks read, too slow to redo in them."""
    return Path(__file__).resolve().parents[2] / "results"


def load_kept(name: str, folder: str | Path | None = None) -> tuple[Path, dict | None]:
    """(path, its JSON) of a kept run, or (path, None) where the file is not there."""
    path = (results_dir() if folder is None else Path(folder)) / name
    return path, (json.loads(path.read_text()) if path.is_file() else None)


def kept_by_kind(prefix: str, folder: str | Path | None = None) -> dict[str, Path]:
    """The kept runs named PREFIX-KIND.json, by CPU kind, in radarlab.device.cpu_kinds()
    order; a name whose KIND is no CPU kind (spec-draft-x.json) is not one of them."""
    folder = results_dir() if folder is None else Path(folder)
    return {kind: folder / f"{prefix}-{kind}.json" for kind in cpu_kinds()
            if (folder / f"{prefix}-{kind}.json").is_file()}


def choose_kept_run(prefix: str, kind: str, what: str, how: str, folder: str | Path | None = None
                    ) -> tuple[Path | None, dict | None, str | None]:
    """(path, doc, sentence): the kept PREFIX-KIND.json a notebook shows on a CPU of this kind.

    Figures measured on one kind of CPU are kept for that kind, and a notebook looks for its own CPU's.
    Where results/ has none for this kind, it shows another kind's, the first in cpu_kinds() order (so
    every machine of one kind shows the same file), and the sentence tells the learner so: only ratios
    within that run compare with this machine. Where it has none at all: (None, None, how to make one).
    The sentence is None only when the run is this kind's own. what: the run's name in the sentence
    ("full throughput"); how: a sentence on the command that writes one for this CPU."""
    kept = kept_by_kind(prefix, folder)
    if kind in kept:
        return kept[kind], json.loads(kept[kind].read_text()), None
    if not kept:
        return None, None, (f"This CPU is of kind {kind!r}, and results/ keeps no {what} run from any "
                            f"kind of CPU. {how}")
    other, path = next(iter(kept.items()))
    return path, json.loads(path.read_text()), (
        f"This CPU is of kind {kind!r}, and results/ keeps no {what} run from that kind: the run shown, "
        f"{path.name}, is from a CPU of kind {other!r}. Only its ratios compare with "
        f"this machine; its absolute figures belong to that CPU. {how}")
