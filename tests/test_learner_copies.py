"""The learner copies in notebooks/exercises run top to bottom with every exercise unwritten.

A learner who skips an exercise, or opens the copy just to read it, must still reach the end: each
checker says FAIL in a friendly line (not a traceback), and each `learner_or_reference` cell says that
the cells below use radarlab's reference. The committed notebooks (every exercise written, as the
reference) run under nbval in `make test`; test_exercises.py checks that the copies are fresh.

The copies take as long as the notebooks (minutes in all), hence `slow`. Most notebooks run torch on
one thread, so the copies run two at a time, each in its own nbconvert process and kernel.
"""
from __future__ import annotations

import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import nbformat
import pytest

from radarlab.exercises import checker_cells, course_notebooks

ROOT = Path(__file__).resolve().parents[1]
COPIES = course_notebooks(ROOT / "notebooks" / "exercises")
CELL_TIMEOUT_S = 600
NOTEBOOK_TIMEOUT_S = 900
AT_ONCE = 2
STUB = "raise NotImplementedError()"
FALLBACK = re.compile(r"^\s*(\w+)\s*=\s*learner_or_reference\(", re.M)


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.get("output_type") == "stream":
            parts.append(out.get("text", ""))
        elif out.get("output_type") in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


def _execute(path: Path, out_dir: Path) -> tuple[Path | None, str]:
    """Run one copy top to bottom in a fresh kernel: (the executed notebook, "") or (None, what failed)."""
    out = out_dir / path.name
    cmd = [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", f"--output={out}",
           f"--ExecutePreprocessor.timeout={CELL_TIMEOUT_S}", str(path)]
    try:
        done = subprocess.run(cmd, cwd=path.parent, capture_output=True, text=True,
                              timeout=NOTEBOOK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"did not finish in {NOTEBOOK_TIMEOUT_S} s"
    if done.returncode != 0:
        return None, done.stderr[-4000:]
    return out, ""


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("learner_copies")
    with ThreadPoolExecutor(AT_ONCE) as pool:
        runs = dict(zip(COPIES, pool.map(lambda p: _execute(p, out_dir), COPIES)))
    return runs


def test_there_is_a_learner_copy_of_every_notebook():
    assert [p.name for p in COPIES] == [p.name for p in course_notebooks(ROOT / "notebooks")]


@pytest.mark.slow
@pytest.mark.parametrize("path", COPIES, ids=[p.name for p in COPIES])
def test_learner_copy_runs_with_every_exercise_unwritten(executed, path):
    checkers = checker_cells(nbformat.read(path, as_version=4))
    unwritten = all(STUB in "".join(nbformat.read(path, as_version=4).cells[i].source) for i in checkers)
    assert unwritten, f"{path.name}: an exercise is not a stub"
    out, failure = executed[path]
    assert out is not None, f"{path.name} stopped before its end:\n{failure}"
    nb = nbformat.read(out, as_version=4)
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
