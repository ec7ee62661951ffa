"""The learner copies in notebooks/exercises run top to bottom with every exercise unwritten.

A learner who skips an exercise, or opens the copy just to read it, must still reach the end: each
checker says FAIL in a friendly line (not a traceback), and each `learner_or_reference` cell says that
the cells below use radarlab's reference. The committed notebooks (every exercise written, as the
reference) run under nbval in `make test`; test_exercises.py checks that the copies are fresh.

Each copy takes as long as its notebook (minutes in all), hence `slow`.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from radarlab.exercises import checker_cells, course_notebooks

ROOT = Path(__file__).resolve().parents[1]
COPIES = course_notebooks(ROOT / "notebooks" / "exercises")
CELL_TIMEOUT_S = 600
STUB = "raise NotImplementedError()"
FALLBACK = re.compile(r"^\s*(\w+)\s*=\s*learner_or_reference\(", re.M)


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
        elif out.get("output_type") == "error":
            parts.append(f"{out.get('ename')}: {out.get('evalue')}")
    return "".join(parts)


def test_there_is_a_learner_copy_of_every_notebook():
    assert [p.name for p in COPIES] == [p.name for p in course_notebooks(ROOT / "notebooks")]


@pytest.mark.slow
@pytest.mark.parametrize("path", COPIES, ids=[p.name for p in COPIES])
def test_learner_copy_runs_with_every_exercise_unwritten(path):
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    checkers = checker_cells(nb)
    unwritten = all(STUB in "".join(nb.cells[i].source) for i in checkers)
    assert unwritten, f"{path.name}: an exercise is not a stub"
    client = NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()  # raises CellExecutionError, with the cell and its traceback, if any cell fails
    for start, index in checkers.items():
        if index is None:
            continue
        said = _text(nb.cells[index])
        assert "FAIL" in said, (f"{path.name}: cell {index} checks the unwritten exercise in cell {start} "
                                f"but does not say FAIL:\n{said}")
        for name in FALLBACK.findall("".join(nb.cells[index].source)):
            assert f"in place of your {name}" in said, (
                f"{path.name}: cell {index} falls back to radarlab's reference for {name} without saying "
                f"so:\n{said}")
