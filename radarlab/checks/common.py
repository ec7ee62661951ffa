"""What every notebook's checkers share: the one-line verdict, running a learner's code so that a bug
reads as a counterexample, a Triton stub recognised as not written yet, the fallback to radarlab's
reference, and the tensor comparison."""
from __future__ import annotations

from collections.abc import Callable


def verdict(exercise: str, counterexample: str | None) -> bool:
    """Print the one-line result of a checker."""
    if counterexample is None:
        print(f"PASS {exercise}")
        return True
    print(f"FAIL {exercise}: {counterexample}")
    return False


def learner_or_reference(name: str, learner, passed: bool, reference):
    """What the cells after an exercise use: the learner's code if it passed its checker, otherwise
    radarlab's reference, said in one line, so a skipped exercise never breaks the rest."""
    if passed:
        return learner
    fn = getattr(reference, "fn", reference)  # a Triton jit function: the Python function it wraps
    print(f"the cells below use radarlab's {fn.__module__}.{fn.__qualname__} in place of your {name}")
    return reference


def call_learner(thunk: Callable[[], object], description: str) -> tuple[object, str | None]:
    """Run a learner's code: (result, None), or (None, a plain-words problem) when it is not written
    yet or crashes, so that a learner's bug reads as a counterexample rather than a traceback."""
    try:
        return thunk(), None
    except NotImplementedError:
        return None, "the function is not written yet (it raises NotImplementedError)"
    except Exception as err:
        return None, f"for {description} it raised {type(err).__name__}: {err}"


def raised_not_written(err: BaseException) -> bool:
    """Whether an error comes from the stub's bare `raise NotImplementedError()`, also when Triton wraps
    it: the interpreter raises InterpreterError from it, and the compiler rejects the raise statement
    quoting its source. Triton's own NotImplementedErrors carry a message, so they do not count."""
    while err is not None:
        bare = isinstance(err, NotImplementedError) and not str(err)
        if bare or "raise NotImplementedError()" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def kernel_error(name: str, err: BaseException, described: str, what: str = "kernel") -> bool:
    """The verdict on Triton code that raised (what: a kernel, or a jit function a kernel calls): not
    written yet, or the learner's own error rather than Triton's wrapper around it."""
    if raised_not_written(err):
        return verdict(name, f"the {what} is not written yet (it raises NotImplementedError)")
    while err.__cause__ is not None:
        err = err.__cause__
    return verdict(name, f"for {described} it raised {type(err).__name__}: {err}")


def first_tensor_difference(got, want, atol: float, rtol: float) -> str | None:
    """Describe how a returned tensor differs from the expected one (type, shape, dtype, then values)."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype} (the input's dtype)"
    g, w = got.detach().float().cpu(), want.float()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return f"{g[idx].item():.6g} at index {idx}, expected {w[idx].item():.6g}"
