"""The learner copies (notebooks/exercises) run top to bottom, each in its own nbconvert process and kernel,
beside the rest of the test session.

The course notebooks set torch to one thread, so while nbval runs them one of a 2-core machine's cores
is idle: the copies start on it, one at a time, as soon as the first notebook starts, and their tests
(moved to the end of the session) read what came out. Any worker left waiting then gets a second one.
Run without the notebooks (`pytest tests/test_learner_copies.py`), the copies run two at a time when
their tests first ask.
"""
from __future__ import annotations

import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

CELL_TIMEOUT_S = 600
NOTEBOOK_TIMEOUT_S = 900
AT_ONCE = 2
COPIES_TESTS = "test_learner_copies.py"
NO_VLLM = "no-vllm/bin/python"  # under the runs' folder; never created


def execute(path: Path, out_dir: Path) -> tuple[Path | None, str]:
    """Run one copy top to bottom in a fresh kernel: (the executed notebook, "") or (None, what failed).

    The copies run as a learner without vLLM does (RADARLAB_VLLM_PYTHON names no interpreter): nbval's
    run of the notebooks compares with vLLM, and the copies take the notebooks' other branch."""
    out = out_dir / path.name
    cmd = [sys.executable, "-m", "nbconvert", "--to", "notebook", "--execute", f"--output={out}",
           f"--ExecutePreprocessor.timeout={CELL_TIMEOUT_S}", str(path)]
    env = {**os.environ, "RADARLAB_VLLM_PYTHON": str(out_dir / NO_VLLM)}
    try:
        done = subprocess.run(cmd, cwd=path.parent, capture_output=True, text=True, env=env,
                              timeout=NOTEBOOK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return None, f"did not finish in {NOTEBOOK_TIMEOUT_S} s"
    if done.returncode != 0:
        return None, done.stderr[-4000:]
    return out, ""


class CopyRuns:
    """A pytest plugin: runs the copies on worker threads, in course order, and hands each result out."""

    def __init__(self, copies: list[Path]):
        self.copies = list(copies)
        self.out_dir = Path(tempfile.mkdtemp(prefix="learner_copies_"))
        self.pending: queue.Queue[Path] = queue.Queue()
        for path in self.copies:
            self.pending.put(path)
        self.results: dict[Path, tuple[Path | None, str]] = {}
        self.done = {path: threading.Event() for path in self.copies}
        self.workers: list[threading.Thread] = []
        self.wanted = False  # some selected test reads the runs

    def start(self, workers: int) -> None:
        """Make sure `workers` threads are taking copies off the queue (never fewer than already run)."""
        while len(self.workers) < workers:
            worker = threading.Thread(target=self._work, name=f"learner-copy-{len(self.workers)}",
                                      daemon=True)
            self.workers.append(worker)
            worker.start()

    def _work(self) -> None:
        while True:
            try:
                path = self.pending.get_nowait()
            except queue.Empty:
                return
            self.results[path] = execute(path, self.out_dir)
            self.done[path].set()

    def result(self, path: Path) -> tuple[Path | None, str]:
        """The executed copy (or what failed), waiting for it; what is still queued gets a second worker."""
        if path not in self.done:
            raise KeyError(f"{path} is not one of the learner copies")
        self.start(AT_ONCE)
        self.done[path].wait()
        return self.results[path]

    @pytest.hookimpl(trylast=True)  # after -m / -k have deselected
    def pytest_collection_modifyitems(self, items):
        copies = [item for item in items if item.path.name == COPIES_TESTS]
        rest = [item for item in items if item.path.name != COPIES_TESTS]
        items[:] = rest + copies
        selected = [item for item in copies if "copy_runs" in getattr(item, "fixturenames", ())]
        self.wanted = bool(selected)
        paths = {getattr(getattr(item, "callspec", None), "params", {}).get("path") for item in selected}
        if selected and None not in paths:  # every selected test names its copy: run just those
            self.keep_only(paths)

    def keep_only(self, paths) -> None:
        """Queue only these copies, in course order (a run that selects some copies' tests with -k)."""
        while True:
            try:
                self.pending.get_nowait()
            except queue.Empty:
                break
        for path in self.copies:
            if path in paths:
                self.pending.put(path)

    def pytest_runtest_setup(self, item):
        if self.wanted and item.path.suffix == ".ipynb":
            self.start(1)

    def pytest_unconfigure(self, config):
        shutil.rmtree(self.out_dir, ignore_errors=True)
