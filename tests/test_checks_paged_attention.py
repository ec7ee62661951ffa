"""Notebook 04's checkers: the solution passes, and typical mistakes fail with a counterexample that says why."""
from __future__ import annotations

import torch

from radarlab.checks import check_online_softmax_update, check_reshape_and_cache


# --- reshape_and_cache ----------------------------------------------------------------------------
def good_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = k[keep].to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = v[keep].to(v_cache.dtype)


def test_reshape_and_cache_solution_passes(capsys):
    assert check_reshape_and_cache(good_reshape_and_cache)
    assert capsys.readouterr().out == "PASS reshape_and_cache\n"


def test_reshape_and_cache_that_writes_padding_fails_with_a_hint(capsys):
    def writes_padding(k, v, k_cache, v_cache, slot_mapping):  # -1 wraps round to the pool's last slot
        k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
        v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)

    assert not check_reshape_and_cache(writes_padding)
    out = capsys.readouterr().out
    assert out.startswith("FAIL reshape_and_cache: for 4 tokens with slots [9, -1, 2, -1]")
    assert "k_cache[2, 3] (slot 11)" in out and "slot -1 is padding" in out


def test_reshape_and_cache_with_block_and_row_swapped_fails(capsys):
    def swapped(k, v, k_cache, v_cache, slot_mapping):
        keep = slot_mapping >= 0
        slots = slot_mapping[keep]
        bs = k_cache.shape[1]
        k_cache[slots % bs, slots // bs] = k[keep]
        v_cache[slots % bs, slots // bs] = v[keep]

    assert not check_reshape_and_cache(swapped)
    assert capsys.readouterr().out.startswith("FAIL reshape_and_cache: for 3 tokens into slots [5, 6, 7] of 3 blocks "
                                              "of 4 (block 1, rows 1-3), 1 KV head, head_dim 2 it raised IndexError")


def test_reshape_and_cache_that_mixes_up_k_and_v_fails(capsys):
    def mixed(k, v, k_cache, v_cache, slot_mapping):
        good_reshape_and_cache(v, k, k_cache, v_cache, slot_mapping)

    assert not check_reshape_and_cache(mixed)
    assert capsys.readouterr().out.startswith(
        "FAIL reshape_and_cache: for 3 tokens into slots [5, 6, 7] of 3 blocks of 4 (block 1, rows 1-3), 1 KV head, "
        "head_dim 2 k_cache[1, 1] (slot 5) holds")


def test_reshape_and_cache_that_returns_a_new_pool_fails(capsys):
    def not_in_place(k, v, k_cache, v_cache, slot_mapping):
        k_cache = k_cache.clone()
        good_reshape_and_cache(k, v, k_cache, v_cache.clone(), slot_mapping)
        return k_cache

    assert not check_reshape_and_cache(not_in_place)
    assert "instead of token 0's key" in capsys.readouterr().out


def test_reshape_and_cache_stub_and_crash(capsys):
    def stub(*args):
        raise NotImplementedError()

    assert not check_reshape_and_cache(stub)
    assert "not written yet" in capsys.readouterr().out
    assert not check_reshape_and_cache(lambda *args: 1 / 0)
    assert "raised ZeroDivisionError" in capsys.readouterr().out


# --- online_softmax_update ------------------------------------------------------------------------
def good_update(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values


def test_online_softmax_solution_passes(capsys):
    assert check_online_softmax_update(good_update)
    assert capsys.readouterr().out == "PASS online_softmax_update\n"


def test_online_softmax_without_rescaling_fails(capsys):
    def no_rescale(m, l, acc, scores, values):
        m_new = torch.maximum(m, scores.max(dim=1).values)
        p = torch.exp(scores - m_new[:, None])
        return m_new, l + p.sum(dim=1), acc + p @ values

    assert not check_online_softmax_update(no_rescale)
    out = capsys.readouterr().out
    assert out.startswith("FAIL online_softmax_update: for two blocks")
    assert "scale the old l and acc by exp(m_old - m_new)" in out


def test_online_softmax_with_unscaled_sums_fails(capsys):
    """exp of the raw scores gives the right ratio acc / l (until it overflows) but the wrong l."""
    def raw_exp(m, l, acc, scores, values):
        p = torch.exp(scores)
        return torch.maximum(m, scores.max(dim=1).values), l + p.sum(dim=1), acc + p @ values

    assert not check_online_softmax_update(raw_exp)
    out = capsys.readouterr().out
    assert "acc / l is right but l ended as" in out and "divide once at the end" in out


def test_online_softmax_that_overflows_fails_with_a_hint(capsys):
    def late_max(m, l, acc, scores, values):
        m_new = torch.maximum(m, scores.max(dim=1).values)
        alpha = torch.exp(m) / torch.exp(m_new)
        p = torch.exp(scores) / torch.exp(m_new)[:, None]
        return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values

    assert not check_online_softmax_update(late_max)
    out = capsys.readouterr().out
    assert out.startswith("FAIL online_softmax_update: for large scores") and "overflows float32" in out


def test_online_softmax_normalising_every_step_fails(capsys):
    def normalised(m, l, acc, scores, values):
        m_new, l_new, acc_new = good_update(m, l, acc * l[:, None], scores, values)
        return m_new, l_new, acc_new / l_new[:, None]

    assert not check_online_softmax_update(normalised)
    assert "acc / l is" in capsys.readouterr().out


def test_online_softmax_wrong_return_shape(capsys):
    assert not check_online_softmax_update(lambda m, l, acc, s, v: (m, l))
    assert "expected a tuple (m, l, acc)" in capsys.readouterr().out
    assert not check_online_softmax_update(lambda m, l, acc, s, v: (m, l, acc.sum(-1)))
    assert "returned acc of shape (1,), expected (1, 1)" in capsys.readouterr().out
