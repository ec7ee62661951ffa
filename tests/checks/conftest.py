"""The checkers' tests share one harness: run a checker on an answer and read its one-line verdict."""
from __future__ import annotations

import pytest


@pytest.fixture
def verdict(capsys):
    """`verdict(check, answer)` asserts the checker passes the answer; `verdict(check, answer, words)`
    asserts it fails it with a one-line counterexample containing `words`. `name` is the exercise the
    verdict names (the checker's name without `check_` unless given)."""

    def run(check, answer, words: str | None = None, name: str | None = None) -> str:
        name = name or check.__name__.removeprefix("check_")
        passed = check(answer)
        out = capsys.readouterr().out
        if words is None:
            assert passed is True and out == f"PASS {name}\n", out
        else:
            assert passed is False, out
            assert out.startswith(f"FAIL {name}: ") and out.count("\n") == 1, out
            assert words in out, out
        return out

    return run
