"""What every notebook's checkers share: the one-line verdict, running a learner's code so that a bug
reads as a counterexample, the fallback to radarlab's reference, and the tensor comparison."""
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
    print(f"the cells below use radarlab's {reference.__module__}.{reference.__qualname__} in place of your "
          f"{name}")
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
