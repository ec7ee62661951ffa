"""Exercises: learner copies made by nbgrader's ClearSolutions, and the exercise convention in notebooks.

nbgrader stays out of the learners' environment (it would add its menus to their JupyterLab), so the
copy test goes through `make exercises`, which runs the generator in its own venv, .venv-maint.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from radarlab.exercises import checker_cells, course_notebooks, exercise_cells, exercises_without_checker

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = course_notebooks(ROOT / "notebooks")
# Building .venv-maint the first time downloads nbgrader and its dependencies (~1.5 min here).
MAKE_TIMEOUT_S = 900

EXERCISE_SOURCE = '''\
def double(x):
    """Return twice x."""
    ### BEGIN SOLUTION
    y = 2 * x
    return y
    ### END SOLUTION


print("kept after the markers")'''


def _demo_notebook():
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    intro = nbformat.v4.new_markdown_cell("## Exercise: double\nWrite `double(x)`.")
    exercise = nbformat.v4.new_code_cell(EXERCISE_SOURCE, execution_count=3)
    exercise.outputs = [nbformat.v4.new_output("stream", name="stdout", text="kept after the markers\n")]
    check = nbformat.v4.new_code_cell("# NBVAL_CHECK_OUTPUT\nradarlab.checks.check_double(double)",
                                      execution_count=4)
    check.outputs = [nbformat.v4.new_output("execute_result", data={"text/plain": "True"}, execution_count=4)]
    check.metadata["execution"] = {"iopub.execute_input": "2026-11-30T18:00:00.000000Z",
                                   "shell.execute_reply": "2026-11-30T18:00:01.000000Z"}
    nb.cells = [intro, exercise, check]
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": {}, "version_major": 2}}
    return nb


@pytest.fixture(scope="module")
def learner_copies(tmp_path_factory):
    """Run `make exercises` on a folder holding one course notebook and one that is not numbered."""
    src = tmp_path_factory.mktemp("src")
    out = tmp_path_factory.mktemp("out") / "exercises"
    nbformat.write(_demo_notebook(), src / "00_demo.ipynb")
    nbformat.write(_demo_notebook(), src / "scratch.ipynb")
    result = subprocess.run(
        ["make", "-s", "exercises", f"EXERCISES_SRC={src}", f"EXERCISES_OUT={out}"],
        cwd=ROOT, capture_output=True, text=True, timeout=MAKE_TIMEOUT_S,
    )
    assert result.returncode == 0, f"make exercises failed:\n{result.stdout}\n{result.stderr}"
    return out, result.stdout


@pytest.fixture(scope="module")
def fresh_course_copies(tmp_path_factory):
    """`make exercises` on the course notebooks as they are now, into a temporary folder."""
    out = tmp_path_factory.mktemp("course") / "exercises"
    result = subprocess.run(["make", "-s", "exercises", f"EXERCISES_OUT={out}"], cwd=ROOT,
                            capture_output=True, text=True, timeout=MAKE_TIMEOUT_S)
    assert result.returncode == 0, f"make exercises failed:\n{result.stdout}\n{result.stderr}"
    return out


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_committed_learner_copies_are_fresh(fresh_course_copies, path):
    """notebooks/exercises/ is what learners open: it must be what `make exercises` makes of the
    notebooks now, cell for cell, so a change to a notebook cannot leave a stale copy behind."""
    committed = ROOT / "notebooks" / "exercises" / path.name
    assert committed.exists(), f"{committed} is missing: run `make exercises`"
    want, got = (_read(fresh_course_copies / path.name), _read(committed))
    cells = [(c["cell_type"], _text(c)) for c in want["cells"]]
    assert [(c["cell_type"], _text(c)) for c in got["cells"]] == cells, (
        f"notebooks/exercises/{path.name} is stale: run `make exercises` and commit it")


def test_solution_replaced_and_text_around_markers_kept(learner_copies):
    out, _ = learner_copies
    nb = nbformat.read(out / "00_demo.ipynb", as_version=4)
    source = nb.cells[1].source
    assert "raise NotImplementedError()" in source
    assert "2 * x" not in source and "return y" not in source
    assert "BEGIN SOLUTION" not in source and "END SOLUTION" not in source
    # The stub takes the markers' indentation; the lines outside the markers are untouched.
    assert source == (
        'def double(x):\n    """Return twice x."""\n    # YOUR CODE HERE\n    raise NotImplementedError()\n'
        '\n\nprint("kept after the markers")'
    )
    assert nb.cells[0].source == "## Exercise: double\nWrite `double(x)`."
    assert nb.cells[2].source == "# NBVAL_CHECK_OUTPUT\nradarlab.checks.check_double(double)"


def test_outputs_cleared(learner_copies):
    out, _ = learner_copies
    nb = nbformat.read(out / "00_demo.ipynb", as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
        assert "execution" not in cell.metadata  # no timestamps of the maintainer's run
    assert "widgets" not in nb.metadata  # nor the state of its widgets


def test_only_numbered_notebooks_are_copied(learner_copies):
    out, stdout = learner_copies
    assert sorted(p.name for p in out.iterdir()) == ["00_demo.ipynb"]
    assert "1 exercise cleared" in stdout


def test_nbgrader_is_not_in_the_learners_environment():
    """nbgrader in .venv would put 'Nbgrader', 'Validate' and 'Create Assignment' into JupyterLab."""
    assert importlib.util.find_spec("nbgrader") is None, (
        "nbgrader is installed in the environment that runs JupyterLab; it belongs in .venv-maint "
        "(make exercises installs it there)"
    )
    from jupyter_core.paths import jupyter_config_path, jupyter_path

    labext = [p for d in jupyter_path("labextensions") for p in Path(d).glob("*nbgrader*")]
    labext += [p for d in jupyter_path("labextensions") for p in Path(d).glob("@*/*nbgrader*")]
    assert not labext, f"nbgrader lab extensions are installed: {labext}"
    server_conf = [p for d in jupyter_config_path()
                   for p in Path(d).glob("jupyter_server_config.d/*nbgrader*")]
    assert not server_conf, f"nbgrader server extension is configured: {server_conf}"


def test_missing_nbgrader_says_how_to_get_it(monkeypatch):
    from radarlab.exercises import learner_copy

    monkeypatch.setitem(sys.modules, "nbgrader", None)  # makes `import nbgrader` fail, as in .venv
    monkeypatch.setitem(sys.modules, "nbgrader.preprocessors", None)
    with pytest.raises(RuntimeError, match="make exercises"):
        learner_copy(_demo_notebook())


# --- the convention in the committed notebooks ----------------------------------------------------

def _read(path: Path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _text(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def _output_text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if "text" in out:
            parts.append("".join(out["text"]) if isinstance(out["text"], list) else out["text"])
        plain = out.get("data", {}).get("text/plain")
        if plain:
            parts.append("".join(plain) if isinstance(plain, list) else plain)
    return "".join(parts)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_every_exercise_has_a_checker_after_it(path):
    nb = _read(path)
    missing = exercises_without_checker(nb)
    assert not missing, (
        f"{path.name}: the exercise in cell(s) {missing} has no `radarlab.checks.<checker>(...)` call "
        f"after it; every exercise ends with a checker that prints PASS or a counterexample"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_checkers_are_compared_by_nbval_and_pass_with_the_solution(path):
    """The checker's line is deterministic, so nbval compares it; with the committed solution it is a PASS."""
    nb = _read(path)
    for start, index in checker_cells(nb).items():
        if index is None:
            continue  # reported by test_every_exercise_has_a_checker_after_it
        checker = nb["cells"][index]
        assert _text(checker).startswith("# NBVAL_CHECK_OUTPUT"), (
            f"{path.name}: the checker cell after the exercise in cell {start} should start with "
            f"`# NBVAL_CHECK_OUTPUT`"
        )
        assert "PASS" in _output_text(checker), (
            f"{path.name}: the checker after the exercise in cell {start} does not show PASS in its saved "
            f"output; execute the notebook with its solution in place"
        )


def _names_used(source: str) -> set[str]:
    source = "\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines())
    return {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name) and isinstance(n.ctx,
                                                                                                ast.Load)}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_a_skipped_exercise_never_breaks_later_cells(path):
    """Whatever an exercise defines and a later cell uses passes through learner_or_reference in its
    checker cell: a learner who skips it gets radarlab's reference there, not a NotImplementedError."""
    nb = _read(path)
    cells = nb["cells"]
    for start, index in checker_cells(nb).items():
        if index is None:
            continue
        tree = ast.parse(_text(cells[start]))
        defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
        later = set().union(*(_names_used(_text(c)) for c in cells[index + 1:] if c["cell_type"] == "code"))
        for name in sorted(defined & later):
            assert f"{name} = learner_or_reference(" in _text(cells[index]), (
                f"{path.name}: cell {start}'s {name} is used after its checker, but "
                f"the checker cell does not fall back to a reference (`{name} = learner_or_reference(...)`)")


def test_learner_or_reference_falls_back_and_says_so(capsys):
    from radarlab.checks import learner_or_reference
    from radarlab.util import cdiv

    def mine(a, b):
        raise NotImplementedError()

    assert learner_or_reference("cdiv", mine, True, cdiv) is mine and capsys.readouterr().out == ""
    assert learner_or_reference("cdiv", mine, False, cdiv) is cdiv
    assert capsys.readouterr().out == ("the cells below use radarlab's radarlab.util.cdiv "
                                       "in place of your cdiv\n")


@pytest.mark.parametrize("name", ["00_welcome", "01_memory_wall"])
def test_first_notebooks_have_an_exercise(name):
    path = ROOT / "notebooks" / f"{name}.ipynb"
    if not path.exists():
        pytest.skip(f"{path.name} is not written yet")
    assert exercise_cells(_read(path)), f"{path.name} should have at least one exercise"


def test_makefile_installs_the_pinned_nbgrader():
    """`make exercises` and pyproject's `maintainer` extra must name the same nbgrader."""
    import tomllib

    with open(ROOT / "pyproject.toml", "rb") as f:
        extra = tomllib.load(f)["project"]["optional-dependencies"]["maintainer"]
    makefile = (ROOT / "Makefile").read_text()
    pinned = re.search(r"^NBGRADER_PKG\s*:?=\s*(\S+)", makefile, re.M)
    assert pinned, "the Makefile should pin nbgrader in NBGRADER_PKG"
    assert pinned.group(1) in extra, (f"Makefile pins {pinned.group(1)}, pyproject's maintainer extra "
                                      f"has {extra}")
