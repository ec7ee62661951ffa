"""The learner copies in notebooks/exercises run top to bottom with every exercise unwritten.

A learner who skips an exercise, or opens the copy just to read it, must still reach the end: each
checker says FAIL in a friendly line (not a traceback), and each `learner_or_reference` cell says that
the cells below use radarlab's reference. The copies run without vLLM, so the notebooks' comparisons
with vLLM take the branch of a learner who has not run `make vllm`. The committed notebooks (every
exercise written, as the reference) run under nbval in `make test`; test_exercises.py checks that the
copies are fresh.

The copies take as long as the notebooks (minutes in all), hence `slow`. They run beside nbval's run of
the notebooks, on the core it leaves idle (tests/copy_runs.py), and these tests come last.
"""
from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from radarlab.exercises import checker_cells, course_notebooks

ROOT = Path(__file__).resolve().parents[1]
COPIES = course_notebooks(ROOT / "notebooks" / "exercises")
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


def test_there_is_a_learner_copy_of_every_notebook():
    assert [p.name for p in COPIES] == [p.name for p in course_notebooks(ROOT / "notebooks")]


@pytest.mark.slow
@pytest.mark.parametrize("path", COPIES, ids=[p.name for p in COPIES])
def test_learner_copy_runs_with_every_exercise_unwritten(copy_runs, path):
    checkers = checker_cells(nbformat.read(path, as_version=4))
    unwritten = all(STUB in "".join(nbformat.read(path, as_version=4).cells[i].source) for i in checkers)
    assert unwritten, f"{path.name}: an exercise is not a stub"
    out, failure = copy_runs.result(path)
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
    if any("run_vllm(" in cell.source for cell in nb.cells if cell.cell_type == "code"):
        # the copies run without vLLM (copy_runs.py): the branch a learner without `make vllm` takes
        assert any("`make vllm`" in _text(cell) for cell in nb.cells), (
            f"{path.name}: run without vLLM, no cell says that vLLM is missing and how to install it")


def _tiny_notebook(path: Path, source: str) -> Path:
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, path)
    return path


@pytest.mark.slow
def test_copy_runs_hands_out_each_run_and_names_what_failed(tmp_path):
    from copy_runs import CopyRuns

    good = _tiny_notebook(tmp_path / "good.ipynb", "print('reached the end')")
    bad = _tiny_notebook(tmp_path / "bad.ipynb", "raise ValueError('stopped here')")
    runs = CopyRuns([good, bad])
    runs.start(1)
    out, failure = runs.result(good)
    assert failure == "" and "reached the end" in _text(nbformat.read(out, as_version=4).cells[0])
    out, failure = runs.result(bad)
    assert out is None and "stopped here" in failure
    assert len(runs.workers) == 2  # result() added a worker for what was still queued
    with pytest.raises(KeyError, match="not one of the learner copies"):
        runs.result(tmp_path / "other.ipynb")
    runs.pytest_unconfigure(None)
    assert not runs.out_dir.exists()


class _Item:
    def __init__(self, name: str, fixturenames=(), copy: Path | None = None):
        self.path = Path(name)
        self.fixturenames = list(fixturenames)
        if copy is not None:
            self.callspec = type("CallSpec", (), {"params": {"path": copy}})()


def test_copy_runs_come_last_and_start_beside_the_first_notebook():
    from copy_runs import CopyRuns

    runs = CopyRuns([])
    items = [_Item("tests/test_learner_copies.py", ["copy_runs"]), _Item("tests/test_a.py"),
             _Item("notebooks/00_welcome.ipynb")]
    runs.pytest_collection_modifyitems(items)
    assert [str(i.path) for i in items] == ["tests/test_a.py", "notebooks/00_welcome.ipynb",
                                            "tests/test_learner_copies.py"]
    assert runs.wanted
    runs.pytest_runtest_setup(items[0])
    assert runs.workers == []  # a unit test does not start them
    runs.pytest_runtest_setup(items[1])
    assert len(runs.workers) == 1  # the first notebook does (nothing queued: the worker just ends)
    deselected = CopyRuns([])
    rest = [_Item("tests/test_learner_copies.py"), _Item("notebooks/00_welcome.ipynb")]
    deselected.pytest_collection_modifyitems(rest)
    deselected.pytest_runtest_setup(rest[0])
    assert not deselected.wanted and deselected.workers == []


def test_copy_runs_queue_only_the_copies_whose_tests_are_selected():
    from copy_runs import CopyRuns

    a, b, c = (Path(f"notebooks/exercises/0{i}_x.ipynb") for i in range(3))
    runs = CopyRuns([a, b, c])
    runs.pytest_collection_modifyitems([_Item("tests/test_learner_copies.py", ["copy_runs"], copy=c),
                                        _Item("tests/test_learner_copies.py", ["copy_runs"], copy=a)])
    assert runs.wanted and [runs.pending.get_nowait() for _ in range(2)] == [a, c]  # course order
    assert runs.pending.empty()
    everything = CopyRuns([a, b])  # a selected test that names no copy: all of them stay queued
    everything.pytest_collection_modifyitems([_Item("tests/test_learner_copies.py", ["copy_runs"])])
    assert [everything.pending.get_nowait() for _ in range(2)] == [a, b]
