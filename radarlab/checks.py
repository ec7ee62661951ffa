"""Exercise checkers. Each runs a learner's function on cases with known answers and prints one line:
a pass, or the first counterexample in plain words. They return True or False so tests can use them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


def verdict(exercise: str, counterexample: str | None) -> bool:
    """Print the one-line result of a checker."""
    if counterexample is None:
        print(f"PASS {exercise}")
        return True
    print(f"FAIL {exercise}: {counterexample}")
    return False


def first_counterexample(cases: Iterable[tuple[str, Callable[[], object], object]],
                         close: Callable[[object, object], bool] | None = None) -> str | None:
    """Run (description, thunk, expected) cases; describe the first whose result differs."""
    same = close or (lambda a, b: a == b)
    for description, thunk, expected in cases:
        try:
            got = thunk()
        except NotImplementedError:
            return "the function is not written yet (it raises NotImplementedError)"
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return f"for {description} it raised {type(err).__name__}: {err}"
        if not same(got, expected):
            return f"for {description} it returned {got!r}, expected {expected!r}"
    return None
