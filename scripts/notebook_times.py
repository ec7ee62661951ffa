"""`python scripts/notebook_times.py [--write | --check]`: each notebook's run time, from its cell timestamps.

Every executed notebook keeps, in each code cell's metadata, when the kernel started that cell
(`execution.iopub.execute_input`) and when it replied (`execution.shell.execute_reply`). A notebook's
time is the sum of those spans over its code cells: what it took when it was last executed top to
bottom. The times are shown whole seconds under a minute, else to the nearest half minute ("1.5 min").

They are written in two places, README.md's course map (its `time` column) and docs/WORKSHOP.md's
table of notebook times (its `runs in` column), each with a last row for all notebooks together. A row
whose notebook is not in notebooks/ yet reads "not yet written". With no option this prints the times
and says which rows differ; `--write` rewrites those rows; `--check` exits 1 when any row differs
(tests/test_readme.py runs the same check). Only the standard library is needed.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"  # the course notebooks; notebooks/exercises/ are learner copies
START_KEY, END_KEY = "iopub.execute_input", "shell.execute_reply"
NOT_WRITTEN = "not yet written"
TOTAL_LABEL = "all notebooks"
# The file, the heading of its section, and the header of the time column in that section's table.
TABLES = (("README.md", "## Course map", "time"),
          ("docs/WORKSHOP.md", "## How long each notebook takes", "runs in"))


class TimesError(ValueError):
    """A notebook without timestamps, or a table that cannot be matched with the notebooks."""


def _timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def notebook_seconds(path: Path) -> float:
    """The sum of the run times of path's code cells, from their execution timestamps."""
    nb = json.loads(Path(path).read_text(encoding="utf-8"))
    total, untimed = 0.0, []
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code" or not "".join(cell["source"]).strip():
            continue
        execution = cell.get("metadata", {}).get("execution", {})
        start, end = execution.get(START_KEY), execution.get(END_KEY)
        if not (start and end):
            untimed.append(index)
            continue
        seconds = (_timestamp(end) - _timestamp(start)).total_seconds()
        if seconds < 0:
            raise TimesError(f"{Path(path).name}: cell {index} replied before it started ({start} -> {end})")
        total += seconds
    if untimed:
        raise TimesError(f"{Path(path).name}: code cells {untimed} carry no execution timestamps "
                         f"(metadata.execution.{START_KEY} and .{END_KEY}); execute the whole notebook "
                         "(jupyter nbconvert --to notebook --execute --inplace) and commit it")
    return total


def measured(root: Path = ROOT) -> dict[str, float]:
    """{notebook stem: seconds} for every course notebook in root/notebooks, in order."""
    return {nb.stem: notebook_seconds(nb) for nb in sorted((Path(root) / "notebooks").glob(NOTEBOOK_GLOB))}


def format_time(seconds: float) -> str:
    """Whole seconds under a minute ("8 s"), else minutes to the nearest half ("1 min", "2.5 min")."""
    if round(seconds) < 60:
        return f"{round(seconds)} s"
    return f"{round(seconds / 30) / 2:g} min"


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(lines: list[str], heading: str, name: str) -> tuple[int, int]:
    """The first and one-past-last line of the first table under heading."""
    try:
        start = lines.index(heading)
    except ValueError:
        raise TimesError(f"{name} has no {heading!r} section") from None
    level = heading.split(" ")[0] + " "
    first = None
    for i in range(start + 1, len(lines)):
        if first is None and lines[i].startswith(level):
            break
        if lines[i].startswith("|"):
            first = i if first is None else first
        elif first is not None:
            return first, i
    if first is None:
        raise TimesError(f"{name}: no table under {heading!r}")
    return first, len(lines)


def update(text: str, heading: str, column: str, times: dict[str, float],
           name: str = "the file") -> tuple[str, list[tuple[str, str, str]]]:
    """text with the time column of the table under heading set from times ({stem: seconds}), and the
    rows that changed as (row, old, new). Raises TimesError for a notebook without a row, a row whose
    number names another notebook, or a table without the column."""
    lines = text.split("\n")
    first, end = _table(lines, heading, name)
    header = _cells(lines[first])
    if column not in header:
        raise TimesError(f"{name}: the table under {heading!r} has no {column!r} column (header: {header})")
    col = header.index(column)
    by_number = {stem[:2]: stem for stem in times}
    seen, changes = set(), []
    for i in range(first + 2, end):  # past the header and the |---| line
        cells = _cells(lines[i])
        number, topic = cells[0], cells[1]
        if re.fullmatch(r"\d\d", number):
            stem = f"{number}_{topic}"
            if number in by_number and by_number[number] != stem:
                raise TimesError(f"{name}: row {number} is {topic!r}, but the notebook is "
                                 f"notebooks/{by_number[number]}.ipynb")
            new = format_time(times[stem]) if stem in times else NOT_WRITTEN
            seen.add(stem)
        elif topic == TOTAL_LABEL:
            new = format_time(sum(times.values()))
        else:
            continue
        if cells[col] != new:
            changes.append((f"{number} {topic}".strip(), cells[col], new))
            cells[col] = new
            lines[i] = "| " + " | ".join(cells) + " |"
    missing = [stem for stem in times if stem not in seen]
    if missing:
        raise TimesError(f"{name}: the table under {heading!r} has no row for {missing}; add one "
                         "(its time is then filled in by scripts/notebook_times.py --write)")
    return "\n".join(lines), changes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="rewrite the rows that differ")
    mode.add_argument("--check", action="store_true", help="exit 1 if any row differs")
    args = parser.parse_args(argv)
    try:
        times = measured()
        for stem, seconds in times.items():
            print(f"{stem:<28} {seconds:7.1f} s  {format_time(seconds)}")
        print(f"{TOTAL_LABEL:<28} {sum(times.values()):7.1f} s  {format_time(sum(times.values()))}")
        stale = False
        for file, heading, column in TABLES:
            path = ROOT / file
            text, changes = update(path.read_text(encoding="utf-8"), heading, column, times, file)
            for row, old, new in changes:
                print(f"{file}: {row}: {old!r} -> {new!r}")
            if changes and args.write:
                path.write_text(text, encoding="utf-8")
                print(f"{file}: {len(changes)} rows rewritten")
            elif changes:
                stale = True
            else:
                print(f"{file}: up to date")
    except TimesError as e:
        print(f"notebook_times: {e}", file=sys.stderr)
        return 2
    if stale:
        print("run scripts/notebook_times.py --write to update them")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
