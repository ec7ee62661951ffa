"""What every checker does: an exercise not written yet (it raises NotImplementedError) gets a friendly
line, not a traceback."""
from __future__ import annotations

import pytest

import radarlab.checks as checks

CHECKERS = sorted(name for name in dir(checks) if name.startswith("check_"))
EXERCISE = {"check_preemption_rule": "preempt"}  # the verdict names the learner's function


def stub(*args, **kwargs):
    raise NotImplementedError()


class KernelStub:
    """A Triton kernel not written yet, as its launch kernel[grid](...) behaves."""

    def __getitem__(self, grid):
        return stub


STUBS = {"check_paged_decode_kernel": KernelStub()}  # checkers that take a kernel, not a function


def test_every_notebook_has_checkers():
    assert len(CHECKERS) >= 20, CHECKERS


@pytest.mark.parametrize("name", CHECKERS)
def test_a_stub_reads_as_not_written_yet(verdict, name):
    out = verdict(getattr(checks, name), STUBS.get(name, stub),
                  "is not written yet (it raises NotImplementedError)", EXERCISE.get(name))
    assert "Traceback" not in out
