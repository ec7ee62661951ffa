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


# checkers that take a kernel, not a function (check_fp8_load takes a jit function the kernel calls)
STUBS = {name: KernelStub() for name in ("check_paged_decode_kernel", "check_decode_tile",
                                         "check_dequant_tile")}


def test_every_notebook_has_checkers():
    assert len(CHECKERS) >= 20, CHECKERS


@pytest.mark.parametrize("name", CHECKERS)
def test_a_stub_reads_as_not_written_yet(verdict, name):
    out = verdict(getattr(checks, name), STUBS.get(name, stub),
                  "is not written yet (it raises NotImplementedError)", EXERCISE.get(name))
    assert "Traceback" not in out


def test_the_fallback_names_a_triton_reference(capsys):
    """A Triton kernel or jit function is named by the Python function it wraps, module and all."""
    from radarlab.attention import triton_quant

    reference = triton_quant._load_fp8
    assert checks.learner_or_reference("fp8_load", stub, False, reference) is reference
    assert capsys.readouterr().out == ("the cells below use radarlab's radarlab.attention.triton_quant."
                                       "_load_fp8 in place of your fp8_load\n")
