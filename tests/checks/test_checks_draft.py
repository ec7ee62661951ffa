"""The checkers of notebook 09: a reference passes, a stub and plausible mistakes get a plain
counterexample."""
from __future__ import annotations

import pytest

from radarlab.checks import (
    check_acceptance_counts,
    check_first_costly_batch,
    reference_acceptance_counts,
    reference_first_costly_batch,
)
from radarlab.lab.roofline import decode_step


def _stub(*args):
    raise NotImplementedError()


def _fails(capsys, checker, fn, name, words):
    assert checker(fn) is False
    out = capsys.readouterr().out
    assert out.startswith(f"FAIL {name}: "), out
    assert words in out, out


# --- acceptance_counts ---------------------------------------------------------------------------

def counts_by_hand(verify_log, k):
    per_pos = [0] * k
    for _, accepted in verify_log:
        for i in range(accepted):
            per_pos[i] += 1
    steps = len(verify_log)
    return per_pos, (sum(a for _, a in verify_log) + steps) / steps if steps else float("nan")


def _exactly(verify_log, k):  # a histogram of acceptance lengths, not positions
    per_pos = [sum(1 for _, a in verify_log if a == i + 1) for i in range(k)]
    return per_pos, counts_by_hand(verify_log, k)[1]


def _no_bonus(verify_log, k):
    per_pos, _ = counts_by_hand(verify_log, k)
    return per_pos, sum(a for _, a in verify_log) / len(verify_log) if verify_log else float("nan")


def _drafting_steps_only(verify_log, k):
    per_pos, _ = counts_by_hand(verify_log, k)
    drafting = [a for d, a in verify_log if d]
    return per_pos, (sum(drafting) + len(drafting)) / len(drafting) if drafting else float("nan")


def test_acceptance_reference_and_hand_count_pass(capsys):
    assert check_acceptance_counts(reference_acceptance_counts) is True
    assert check_acceptance_counts(counts_by_hand) is True
    assert capsys.readouterr().out == "PASS acceptance_counts\nPASS acceptance_counts\n"


def test_acceptance_reference_values():
    per_pos, tps = reference_acceptance_counts([(4, 4), (4, 0), (4, 2), (0, 0), (3, 1)], 4)
    assert per_pos == [3, 2, 1, 1]
    assert tps == pytest.approx((7 + 5) / 5)


@pytest.mark.parametrize("fn, words", [
    (_stub, "not written yet"),
    (_exactly, "exactly i + 1"),
    (_no_bonus, "the target's own token"),
    (_drafting_steps_only, "steps without drafts"),
])
def test_acceptance_mistakes_are_described(capsys, fn, words):
    _fails(capsys, check_acceptance_counts, fn, "acceptance_counts", words)


# --- first_costly_batch --------------------------------------------------------------------------

def costly_by_formula(dims, k, context, peak, bw, dtype, tolerance):
    for b in range(1, 4097):
        one = decode_step(dims, b, context, dtype, dtype)
        verify_s = max((k + 1) * one.flops / peak, one.bytes / bw)
        if verify_s > tolerance * one.time_bound_s(peak, bw):
            return b
    return None


def _kv_per_token(dims, k, context, peak, bw, dtype, tolerance):  # reads each sequence's KV k + 1 times
    for b in range(1, 4097):
        plain = decode_step(dims, b, context, dtype, dtype).time_bound_s(peak, bw)
        if decode_step(dims, b * (k + 1), context, dtype, dtype).time_bound_s(peak, bw) > tolerance * plain:
            return b
    return None


def _decode_ridge(dims, k, context, peak, bw, dtype, tolerance):  # where plain decode turns compute-bound
    return next((b for b in range(1, 4097) if decode_step(dims, b, context, dtype,
                                                          dtype).intensity >= peak / bw), None)


def test_costly_reference_and_formula_pass(capsys):
    assert check_first_costly_batch(reference_first_costly_batch) is True
    assert check_first_costly_batch(costly_by_formula) is True
    assert capsys.readouterr().out == "PASS first_costly_batch\nPASS first_costly_batch\n"


@pytest.mark.parametrize("fn, words", [
    (_stub, "not written yet"),
    (_kv_per_token, "expected 3"),
    (_decode_ridge, "plain decode step turns compute-bound"),
])
def test_costly_mistakes_are_described(capsys, fn, words):
    _fails(capsys, check_first_costly_batch, fn, "first_costly_batch", words)
