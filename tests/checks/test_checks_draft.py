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


@pytest.mark.parametrize("fn", [reference_acceptance_counts, counts_by_hand])
def test_acceptance_reference_and_hand_count_pass(verdict, fn):
    verdict(check_acceptance_counts, fn)


def test_acceptance_reference_values():
    per_pos, tps = reference_acceptance_counts([(4, 4), (4, 0), (4, 2), (0, 0), (3, 1)], 4)
    assert per_pos == [3, 2, 1, 1]
    assert tps == pytest.approx((7 + 5) / 5)


@pytest.mark.parametrize("fn, words", [
    (_exactly, "exactly i + 1"),
    (_no_bonus, "the target's own token"),
    (_drafting_steps_only, "steps without drafts"),
])
def test_acceptance_mistakes_are_described(verdict, fn, words):
    verdict(check_acceptance_counts, fn, words)


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


def _last_cheap_batch(dims, k, context, peak, bw, dtype, tolerance):  # off by one: the batch before it
    first = costly_by_formula(dims, k, context, peak, bw, dtype, tolerance)
    return None if first is None else first - 1


@pytest.mark.parametrize("fn", [reference_first_costly_batch, costly_by_formula])
def test_costly_reference_and_formula_pass(verdict, fn):
    verdict(check_first_costly_batch, fn)


@pytest.mark.parametrize("fn, words", [
    (_kv_per_token, "expected 3"),
    (_decode_ridge, "plain decode step turns compute-bound"),
    (_last_cheap_batch, "it returned 2, expected 3 (batch 2 is the last whose verify step still costs at "
                        "most 1.1 x a decode step: return the first that costs more)"),
])
def test_costly_mistakes_are_described(verdict, fn, words):
    verdict(check_first_costly_batch, fn, words)
