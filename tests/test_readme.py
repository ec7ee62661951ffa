"""README's course map: its times are the notebooks' own (scripts/notebook_times.py, which also keeps
docs/WORKSHOP.md's table of times), and every figure it links is in images/, drawn by that row's notebook."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "notebook_times.py"
_spec = importlib.util.spec_from_file_location("notebook_times", SCRIPT)
times_script = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(times_script)

TABLES = times_script.TABLES  # (file, section heading, time column)
NOTEBOOKS = sorted((ROOT / "notebooks").glob(times_script.NOTEBOOK_GLOB))


def course_map() -> list[list[str]]:
    """The rows of README's course map table, as lists of cells (header and |---| line left out)."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").split("\n")
    first, end = times_script._table(lines, "## Course map", "README.md")
    return [times_script._cells(line) for line in lines[first + 2:end]]


@pytest.mark.parametrize("file, heading, column", TABLES, ids=[file for file, _, _ in TABLES])
def test_times_are_the_notebooks_own(file, heading, column):
    """Each row's time equals its notebook's cell timestamps, rounded as the script rounds; a row whose
    notebook is not written yet says so, and the last row is the total."""
    times = times_script.measured()
    assert set(times) == {nb.stem for nb in NOTEBOOKS}
    _, changes = times_script.update((ROOT / file).read_text(encoding="utf-8"), heading, column, times, file)
    assert not changes, (f"{file}'s times differ from the notebooks' timestamps (row, written, measured): "
                         f"{changes}; run: python scripts/notebook_times.py --write")


def test_every_linked_figure_exists_and_is_its_notebooks():
    """Every image the course map links is in images/ and is saved by that row's notebook
    (save_figure(fig, "name"), written by `make figures`)."""
    linked, problems = 0, []
    for row in course_map():
        for name in re.findall(r"\]\(images/([\w-]+)\.png\)", " | ".join(row)):
            linked += 1
            notebook = ROOT / "notebooks" / f"{row[0]}_{row[1]}.ipynb"
            if not (ROOT / "images" / f"{name}.png").is_file():
                problems.append(f"images/{name}.png is not in images/")
            if not notebook.is_file():
                problems.append(f"images/{name}.png is linked in the row of {notebook.name}, not written yet")
                continue
            sources = "".join("".join(cell["source"]) for cell in json.loads(notebook.read_text())["cells"])
            if f'save_figure(fig, "{name}")' not in sources:
                problems.append(f"{notebook.name} does not save images/{name}.png")
    assert linked, "the course map links no figure"
    assert not problems, "README's course map: " + "; ".join(problems)


def test_format_time():
    f = times_script.format_time
    assert [f(s) for s in (0.4, 8.4, 59.4, 59.6, 74.9, 75.1, 120, 135.9, 1012.9)] == [
        "0 s", "8 s", "59 s", "1 min", "1 min", "1.5 min", "2 min", "2.5 min", "17 min"]


def _notebook(path: Path, cells: list[dict]) -> Path:
    path.write_text(json.dumps({"cells": cells, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    return path


def _code(source: str, start: str | None = None, end: str | None = None) -> dict:
    execution = {} if start is None else {"iopub.execute_input": start, "shell.execute_reply": end}
    return {"cell_type": "code", "source": [source], "metadata": {"execution": execution}, "outputs": []}


def test_seconds_sum_the_code_cells(tmp_path):
    nb = _notebook(tmp_path / "00_x.ipynb", [
        {"cell_type": "markdown", "source": ["# 00"], "metadata": {}},
        _code("a = 1", "2026-01-01T00:00:00.000000Z", "2026-01-01T00:00:01.500000Z"),
        _code("b = 2", "2026-01-01T00:00:05.000000Z", "2026-01-01T00:01:05.000000Z"),
        _code("   "),  # an empty cell needs no timestamps
    ])
    assert times_script.notebook_seconds(nb) == pytest.approx(61.5)


def test_a_notebook_without_timestamps_is_named(tmp_path):
    nb = _notebook(tmp_path / "03_never_run.ipynb", [
        _code("a = 1", "2026-01-01T00:00:00.000000Z", "2026-01-01T00:00:01.000000Z"), _code("b = 2")])
    with pytest.raises(times_script.TimesError, match=r"03_never_run.ipynb: code cells \[1\]"):
        times_script.notebook_seconds(nb)


TABLE = """# t

## Course map

| # | notebook | time |
|---|---|---|
| 00 | welcome | 1 s |
| 01 | memory_wall | 1 s |
|  | all notebooks | 1 s |

## Next
"""


def test_update_rows_missing_notebooks_and_total():
    text, changes = times_script.update(TABLE, "## Course map", "time", {"00_welcome": 90.0})
    assert "| 00 | welcome | 1.5 min |" in text and "| 01 | memory_wall | not yet written |" in text
    assert "|  | all notebooks | 1.5 min |" in text and len(changes) == 3
    assert times_script.update(text, "## Course map", "time", {"00_welcome": 90.0}) == (text, [])
    with pytest.raises(times_script.TimesError, match=r"no row for \['02_kv_cache'\]"):
        times_script.update(TABLE, "## Course map", "time", {"00_welcome": 1.0, "02_kv_cache": 1.0})
    with pytest.raises(times_script.TimesError, match="row 01 is 'memory_wall'"):
        times_script.update(TABLE, "## Course map", "time", {"01_roofline": 1.0, "00_welcome": 1.0})
    with pytest.raises(times_script.TimesError, match="no 'runs in' column"):
        times_script.update(TABLE, "## Course map", "runs in", {})
