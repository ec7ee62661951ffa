"""Notebook 04's checkers: the solution passes, and typical mistakes fail with a counterexample that says
why."""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from radarlab.checks import (
    check_online_softmax_update,
    check_paged_decode_kernel,
    check_reshape_and_cache,
    check_store_kv_kernel,
)


# --- reshape_and_cache ----------------------------------------------------------------------------
def good_reshape_and_cache(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    k_cache[slots // bs, slots % bs] = k[keep].to(k_cache.dtype)
    v_cache[slots // bs, slots % bs] = v[keep].to(v_cache.dtype)


def _writes_padding(k, v, k_cache, v_cache, slot_mapping):  # -1 wraps round to the pool's last slot
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping] = k.to(k_cache.dtype)
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping] = v.to(v_cache.dtype)


def _block_and_row_swapped(k, v, k_cache, v_cache, slot_mapping):
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    bs = k_cache.shape[1]
    k_cache[slots % bs, slots // bs] = k[keep]
    v_cache[slots % bs, slots // bs] = v[keep]


def _k_and_v_mixed(k, v, k_cache, v_cache, slot_mapping):
    good_reshape_and_cache(v, k, k_cache, v_cache, slot_mapping)


def _returns_a_new_pool(k, v, k_cache, v_cache, slot_mapping):
    k_cache = k_cache.clone()
    good_reshape_and_cache(k, v, k_cache, v_cache.clone(), slot_mapping)
    return k_cache


CONTEXT = "for 3 tokens into slots [5, 6, 7] of 3 blocks of 4 (block 1, rows 1-3), 1 KV head, head_dim 2"


@pytest.mark.parametrize("fn, words", [
    (good_reshape_and_cache, None),
    (_writes_padding, "for 4 tokens with slots [9, -1, 2, -1]"),
    (_block_and_row_swapped, f"{CONTEXT} it raised IndexError"),
    (_k_and_v_mixed, f"{CONTEXT} k_cache[1, 1] (slot 5) holds"),
    (_returns_a_new_pool, "instead of token 0's key"),
    (lambda *args: 1 / 0, "raised ZeroDivisionError"),
])
def test_reshape_and_cache_checker(verdict, fn, words):
    out = verdict(check_reshape_and_cache, fn, words)
    if fn is _writes_padding:
        assert "k_cache[2, 3] (slot 11)" in out and "slot -1 is padding" in out


# --- online_softmax_update ------------------------------------------------------------------------
def good_update(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    alpha = torch.exp(m - m_new)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values


def _no_rescale(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    p = torch.exp(scores - m_new[:, None])
    return m_new, l + p.sum(dim=1), acc + p @ values


def _raw_exp(m, l, acc, scores, values):
    """exp of the raw scores gives the right ratio acc / l (until it overflows) but the wrong l."""
    p = torch.exp(scores)
    return torch.maximum(m, scores.max(dim=1).values), l + p.sum(dim=1), acc + p @ values


def _late_max(m, l, acc, scores, values):
    m_new = torch.maximum(m, scores.max(dim=1).values)
    alpha = torch.exp(m) / torch.exp(m_new)
    p = torch.exp(scores) / torch.exp(m_new)[:, None]
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values


def _normalised(m, l, acc, scores, values):
    m_new, l_new, acc_new = good_update(m, l, acc * l[:, None], scores, values)
    return m_new, l_new, acc_new / l_new[:, None]


@pytest.mark.parametrize("fn, words", [
    (good_update, None),
    (_no_rescale, "scale the old l and acc by exp(m_old - m_new)"),
    (_raw_exp, "acc / l is right but l ended as"),
    (_late_max, "overflows float32"),
    (_normalised, "acc / l is"),
    (lambda m, l, acc, s, v: (m, l), "expected a tuple (m, l, acc)"),
    (lambda m, l, acc, s, v: (m, l, acc.sum(-1)), "returned acc of shape (1,), expected (1, 1)"),
])
def test_online_softmax_checker(verdict, fn, words):
    out = verdict(check_online_softmax_update, fn, words)
    if fn is _no_rescale:
        assert out.startswith("FAIL online_softmax_update: for two blocks")
    if fn is _raw_exp:
        assert "divide once at the end" in out
    if fn is _late_max:
        assert out.startswith("FAIL online_softmax_update: for large scores")


# --- the store-KV kernel in Triton ----------------------------------------------------------------
# Test kernels are module-level functions: Triton reads a kernel's source to run it. The solution and its
# plausible mistakes are one kernel: MISTAKE, a compile-time constant, picks the mistake (0: none).
STUB = tl.constexpr(1)
WRITES_PADDING = tl.constexpr(2)  # no `if slot < 0: return`
SLOT_AS_BLOCK = tl.constexpr(3)  # block = slot, not slot // BLOCK_SIZE
K_AND_V_SWAPPED = tl.constexpr(4)
FIRST_HEAD_ONLY = tl.constexpr(5)  # every row of the tile writes KV head 0
SCALAR_IN_MASK = tl.constexpr(6)  # padding skipped through the mask, not a return


@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                    MISTAKE: tl.constexpr = 0):
    token = tl.program_id(0)
    if MISTAKE == STUB:
        raise NotImplementedError()
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if MISTAKE != WRITES_PADDING and MISTAKE != SCALAR_IN_MASK:
        if slot < 0:
            return
    h = tl.arange(0, HEADS_PAD)[:, None]
    if MISTAKE == FIRST_HEAD_ONLY:
        h = h * 0
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    if MISTAKE == SCALAR_IN_MASK:
        mask = mask & (slot >= 0)
    src = token * stride_kt + h * stride_kh + d
    block = slot // BLOCK_SIZE
    if MISTAKE == SLOT_AS_BLOCK:
        block = slot
    dst = block * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    k_src, v_src = k_ptr, v_ptr
    if MISTAKE == K_AND_V_SWAPPED:
        k_src, v_src = v_ptr, k_ptr
    tl.store(k_cache_ptr + dst, tl.load(k_src + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_src + src, mask=mask), mask=mask)


def launcher(mistake=0):
    """The notebook's launcher around the kernel: one program per token, the last dimension contiguous."""
    def store_kv(k, v, k_cache, v_cache, slot_mapping):
        k, v = k.contiguous(), v.contiguous()
        num_tokens, num_kv_heads, head_dim = k.shape
        store_kv_kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping.contiguous(), k.stride(0),
                                       k.stride(1), *k_cache.stride()[:3], num_kv_heads, head_dim,
                                       BLOCK_SIZE=k_cache.shape[1],
                                       HEADS_PAD=triton.next_power_of_2(num_kv_heads),
                                       DIM_PAD=triton.next_power_of_2(head_dim), MISTAKE=mistake)
    return store_kv


def test_store_kv_kernel_solution_passes(verdict):
    verdict(check_store_kv_kernel, launcher())


@pytest.mark.parametrize("mistake,message", [
    (STUB, "the kernel is not written yet (it raises NotImplementedError)"),
    (WRITES_PADDING,
     "for 4 tokens with slots [9, -1, 2, -1] in 3 blocks of 4 (-1 is padding: nothing is written "
     "for it) it wrote 32 values into the memory just before k_cache (slot -1 is padding: skip it"),
    (SLOT_AS_BLOCK,
     "for 3 tokens into slots [5, 6, 7] of a pool of 3 blocks of 4 (block 1, rows 1-3), 2 KV heads, "
     "head_dim 16 it wrote past the end of k_cache, into block 5 of a pool of 3 (is the slot used as a block "
     "id?"),
    (K_AND_V_SWAPPED, "head_dim 16, k_cache[1, 1, 0] (slot 5, KV head 0) holds"),
    (FIRST_HEAD_ONLY,
     "k_cache[1, 1, 1] (slot 5, KV head 1) holds [7, 7, 7, ...] instead of token 0's key for that "
     "head (nothing was written there: store every KV head"),
])
def test_store_kv_kernel_mistakes(verdict, mistake, message):
    out = verdict(check_store_kv_kernel, launcher(mistake), message)
    if mistake == K_AND_V_SWAPPED:
        assert "instead of token 0's key for that head (it holds token 0's value: K goes to k_cache" in out


def test_store_kv_kernel_with_a_scalar_in_the_mask(capsys):
    """Right on a GPU; the interpreter rejects a mask that mixes a block with a single value, and the
    checker says how to write it instead."""
    passed = check_store_kv_kernel(launcher(SCALAR_IN_MASK))
    out = capsys.readouterr().out
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert not passed and "mask has unsupported dtype" in out and "`if slot < 0: return`" in out, out
    else:
        assert passed, out


def test_store_kv_kernel_stub_compiled_on_a_gpu(capsys):
    """Compiled Triton rejects the stub's raise statement, quoting it; that too reads as not written yet,
    while Triton's own NotImplementedError (a construct it lacks) reads as an error."""
    import ast

    from triton.compiler.errors import UnsupportedLanguageConstruct

    source = "def store_kv_kernel(k_ptr):\n    token = tl.program_id(0)\n    raise NotImplementedError()\n"
    raise_node = ast.parse(source).body[0].body[1]

    def compiled_stub(*args):
        raise UnsupportedLanguageConstruct(source, raise_node, "unsupported AST node type: Raise")

    def setitem(*args):
        raise NotImplementedError("__setitem__ is not supported in triton")

    assert not check_store_kv_kernel(compiled_stub)
    assert capsys.readouterr().out == ("FAIL store_kv_kernel: the kernel is not written yet (it raises "
                                       "NotImplementedError)\n")
    assert not check_store_kv_kernel(setitem)
    assert "it raised NotImplementedError: __setitem__ is not supported in triton" in capsys.readouterr().out


# --- the paged-decode kernel (the main exercise) ---------------------------------------------------------
# One kernel again, the learner's solution, with MISTAKE picking a plausible error (0: none).
GQA_MODULO = tl.constexpr(2)  # query head h reads KV head h % num_kv_heads, not h // GROUP
NO_RESCALE = tl.constexpr(3)  # acc and l are not rescaled when the running max grows
NO_MASK = tl.constexpr(4)  # positions past seq_len are scored (their loads unmasked)
NO_BLOCK_TABLE = tl.constexpr(5)  # position p read from block p // BLOCK_SIZE, not from the table
NO_SCALE = tl.constexpr(6)  # the query is not multiplied by the scale


@triton.jit
def decode_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, block_tables_ptr, seq_lens_ptr, scale,
                  stride_qt, stride_qh, stride_qd, stride_ot, stride_oh, stride_od,
                  stride_cb, stride_cs, stride_ch, stride_cd, stride_bt, head_dim,
                  GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                  BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr, MISTAKE: tl.constexpr = 0):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    if MISTAKE == STUB:
        raise NotImplementedError()
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    if MISTAKE == GQA_MODULO:
        heads = g * tl.num_programs(1) + kv_head
    dim_ok = d < head_dim
    q_mask = (g < GROUP)[:, None] & dim_ok[None, :]
    q = tl.load(q_ptr + seq * stride_qt + heads[:, None] * stride_qh + d[None, :] * stride_qd, mask=q_mask,
                other=0.0).to(tl.float32)
    if MISTAKE != NO_SCALE:
        q = q * scale
    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    for start in range(0, seq_len, TILE_N):
        pos = start + tl.arange(0, TILE_N)
        pos_ok = pos < seq_len
        if MISTAKE == NO_MASK:
            pos_ok = pos >= 0
        block = tl.load(block_tables_ptr + seq * stride_bt + pos // BLOCK_SIZE, mask=pos_ok, other=0)
        block = block.to(tl.int64)
        if MISTAKE == NO_BLOCK_TABLE:
            block = (pos // BLOCK_SIZE).to(tl.int64)
        offsets = (block * stride_cb + (pos % BLOCK_SIZE) * stride_cs + kv_head * stride_ch)[:, None] \
            + d[None, :] * stride_cd
        kv_mask = pos_ok[:, None] & dim_ok[None, :]
        k = tl.load(k_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.where(pos_ok[None, :], tl.sum(q[:, None, :] * k[None, :, :], axis=2), float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        alpha = tl.exp(m - m_new)
        if MISTAKE == NO_RESCALE:
            alpha = alpha * 0 + 1
        p = tl.exp(scores - m_new[:, None])
        v = tl.load(v_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l = l * alpha + tl.sum(p, axis=1)
        m = m_new
    tl.store(out_ptr + seq * stride_ot + heads[:, None] * stride_oh + d[None, :] * stride_od,
             (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=q_mask)


class WithMistake:
    """decode_kernel as triton_paged_decode launches it (kernel[grid](...)), with MISTAKE set."""

    def __init__(self, mistake):
        self.mistake = mistake

    def __getitem__(self, grid):
        return lambda *args, **kwargs: decode_kernel[grid](*args, **kwargs, MISTAKE=self.mistake)


def test_paged_decode_kernel_solution_passes(verdict):
    verdict(check_paged_decode_kernel, decode_kernel)


@pytest.mark.parametrize("mistake,message", [
    (STUB, "the kernel is not written yet (it raises NotImplementedError)"),
    (GQA_MODULO, "GQA: 4 query heads over 2 KV heads, sequences of 6 and 13 tokens, block size 4: sequence "
                 "0, head 1 is wrong (wrong heads: [1, 2]); query head h reads KV head h // GROUP"),
    (NO_RESCALE, "rescale acc and l by exp(m_old - m_new)"),
    (NO_MASK, "NaN came out: positions past seq_len"),
    (NO_BLOCK_TABLE, "take each position's block from block_tables[seq, p // BLOCK_SIZE]"),
    (NO_SCALE, "the scores are missing the scale"),
])
def test_paged_decode_kernel_mistakes(verdict, mistake, message):
    verdict(check_paged_decode_kernel, WithMistake(mistake), message)
