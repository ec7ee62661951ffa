"""`python -m radarlab.exercises SRC_DIR OUT_DIR`: learner copies of the course notebooks.

The committed notebooks carry worked solutions between `### BEGIN SOLUTION` and `### END SOLUTION`.
Learners get copies in which nbgrader's ClearSolutions has replaced each solution with
`raise NotImplementedError()` and every output is cleared, so nothing gives the answer away.

nbgrader is a maintainers' dependency that `make exercises` installs into its own venv (.venv-maint);
it is imported only when copies are written. The helpers that merely inspect notebooks (used by the
tests' lint of the exercise convention) need nothing beyond the standard library.
"""
from __future__ import annotations

import argparse
import copy
import re
import sys
from pathlib import Path

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
NOTEBOOK_GLOB = "[0-9][0-9]_*.ipynb"
# A checker call written out in full, e.g. `radarlab.checks.check_rms_norm(rms_norm)`.
CHECKER_CALL = re.compile(r"\bradarlab\.checks\.[A-Za-z_]\w*\s*\(")
_FROM_CHECKS = re.compile(r"^[ \t]*from\s+radarlab\.checks\s+import\s*(?:\(([\w\s,]+)\)|([\w \t,]+))", re.M)
_CHECKS_MODULE = re.compile(r"^\s*from\s+radarlab\s+import\s+[^\n]*\bchecks\b", re.M)
INSTALL_HINT = "make exercises   (it installs nbgrader==0.9.6 into .venv-maint and runs this there)"


def course_notebooks(src: Path) -> list[Path]:
    """The numbered notebooks NN_topic.ipynb in src, in course order."""
    return sorted(p for p in Path(src).glob(NOTEBOOK_GLOB) if p.is_file())


def _source(cell) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def exercise_cells(nb) -> list[int]:
    """Indices of cells holding a solution region (works on nbformat nodes and on plain json dicts)."""
    return [i for i, cell in enumerate(nb["cells"]) if BEGIN in _source(cell)]


def checker_pattern(nb) -> re.Pattern:
    """What a checker call looks like in this notebook: `radarlab.checks.NAME(`, or a checker imported
    by name with `from radarlab.checks import NAME`, or `checks.NAME(` after `from radarlab import checks`."""
    text = "\n".join(_source(c) for c in nb["cells"] if c.get("cell_type") == "code")
    forms = [CHECKER_CALL.pattern]
    imported = ",".join(m.group(1) or m.group(2) for m in _FROM_CHECKS.finditer(text))
    names = sorted({re.split(r"\s+as\s+", n.strip())[-1] for n in imported.split(",")} - {""})
    if names:
        forms.append(r"(?<![\w.])(?:" + "|".join(map(re.escape, names)) + r")\s*\(")
    if _CHECKS_MODULE.search(text):
        forms.append(r"(?<![\w.])checks\.[A-Za-z_]\w*\s*\(")
    return re.compile("|".join(forms))


def checker_cells(nb) -> dict[int, int | None]:
    """For each exercise cell, the code cell that checks it (None if there is none).

    The course's convention is that every exercise is followed by a checker from radarlab.checks that
    prints PASS or a counterexample, so a learner always knows whether their answer is right. The
    checker may sit in the exercise cell itself after END SOLUTION, or in a later code cell before the
    next exercise.
    """
    cells = nb["cells"]
    marks = exercise_cells(nb)
    call = checker_pattern(nb)
    found: dict[int, int | None] = {}
    for n, start in enumerate(marks):
        stop = marks[n + 1] if n + 1 < len(marks) else len(cells)
        found[start] = None
        if call.search(_source(cells[start]).split(END)[-1]):
            found[start] = start
            continue
        for i in range(start + 1, stop):
            if cells[i].get("cell_type") == "code" and call.search(_source(cells[i])):
                found[start] = i
                break
    return found


def exercises_without_checker(nb) -> list[int]:
    """Exercise cells that no checker call follows."""
    return [start for start, checker in checker_cells(nb).items() if checker is None]


def learner_copy(nb):
    """A copy of nb with solutions replaced by nbgrader's stub, all outputs cleared and no execution
    metadata (the timestamps nbclient records in each cell, the widget state of the maintainer's run)."""
    try:
        from nbconvert.preprocessors import ClearOutputPreprocessor
        from nbgrader.preprocessors import ClearSolutions
    except ImportError as err:
        raise RuntimeError(
            f"nbgrader is needed to write learner copies ({err}). It is kept out of the learners' "
            f"environment on purpose; run:\n    {INSTALL_HINT}"
        ) from err
    out = copy.deepcopy(nb)
    # enforce_metadata=False: our solution cells are plain cells with markers, not nbgrader-tagged
    # cells, because the course does not use the rest of nbgrader's pipeline.
    out, resources = ClearSolutions(enforce_metadata=False).preprocess(out, {})
    out, _ = ClearOutputPreprocessor().preprocess(out, resources)
    for cell in out.cells:  # when and how long the maintainer's run took is nobody's business
        cell.get("metadata", {}).pop("execution", None)
    out.metadata.pop("widgets", None)  # the saved state of widgets whose outputs were just cleared
    return out


def write_learner_copies(src: Path, out_dir: Path) -> dict[Path, int]:
    """Write a learner copy of every numbered notebook in src to out_dir.

    Returns each path written with the number of exercises cleared in it."""
    import nbformat

    src, out_dir = Path(src), Path(out_dir)
    if not src.is_dir():
        raise FileNotFoundError(f"{src} is not a directory")
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for path in course_notebooks(src):
        nb = nbformat.read(path, as_version=4)
        try:
            copy_nb = learner_copy(nb)
        except RuntimeError as err:  # e.g. a BEGIN SOLUTION without its END: name the notebook
            raise RuntimeError(f"{path}: {err}") from err
        nbformat.validate(copy_nb)
        target = out_dir / path.name
        nbformat.write(copy_nb, target)
        written[target] = len(exercise_cells(nb))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radarlab.exercises",
        description="Write learner copies of notebooks/NN_*.ipynb with solutions and outputs removed.",
    )
    parser.add_argument("src", type=Path, help="folder with the numbered notebooks (notebooks)")
    parser.add_argument("out", type=Path, help="folder for the learner copies (notebooks/exercises)")
    args = parser.parse_args(argv)
    try:
        written = write_learner_copies(args.src, args.out)
    except (RuntimeError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path, count in written.items():
        print(f"{path}  ({count} exercise{'s' if count != 1 else ''} cleared)" if count else str(path))
    if not written:
        print(f"no notebooks matching {NOTEBOOK_GLOB} in {args.src}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
