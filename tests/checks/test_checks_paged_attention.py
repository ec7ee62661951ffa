"""Notebook 04's checkers: the solution passes, and typical mistakes fail with a counterexample that says
why."""
from __future__ import annotations

import os

import pytest
import torch
import triton
import triton.language as tl

from radarlab.checks import check_online_softmax_update, check_reshape_and_cache, check_store_kv_kernel


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
    assert capsys.readouterr().out.startswith("FAIL reshape_and_cache: for 3 tokens into "
                                              "slots [5, 6, 7] of 3 blocks of 4 (block 1, rows 1-3), 1 KV "
                                              "head, head_dim 2 it raised IndexError")


def test_reshape_and_cache_that_mixes_up_k_and_v_fails(capsys):
    def mixed(k, v, k_cache, v_cache, slot_mapping):
        good_reshape_and_cache(v, k, k_cache, v_cache, slot_mapping)

    assert not check_reshape_and_cache(mixed)
    assert capsys.readouterr().out.startswith(
        "FAIL reshape_and_cache: for 3 tokens into slots [5, 6, 7] of 3 blocks of 4 (block "
        "1, rows 1-3), 1 KV head, head_dim 2 k_cache[1, 1] (slot 5) holds")


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


# --- the store-KV kernel in Triton ----------------------------------------------------------------
# Test kernels are module-level functions: Triton reads a kernel's source to run it.
@triton.jit
def store_kv_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    src = token * stride_kt + h * stride_kh + d
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _stub_kernel(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                 stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                 BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    tl.program_id(0)
    raise NotImplementedError()


@triton.jit
def _writes_padding(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    src = token * stride_kt + h * stride_kh + d
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _slot_as_block(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                   stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                   BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    src = token * stride_kt + h * stride_kh + d
    dst = slot * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


@triton.jit
def _k_and_v_swapped(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim)
    src = token * stride_kt + h * stride_kh + d
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)


@triton.jit
def _first_head_only(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                     stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                     BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    d = tl.arange(0, DIM_PAD)
    mask = d < head_dim
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + token * stride_kt + d, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + token * stride_kt + d, mask=mask), mask=mask)


def launcher(kernel):
    """The notebook's launcher around a kernel: one program per token, the last dimension contiguous."""
    def store_kv(k, v, k_cache, v_cache, slot_mapping):
        k, v = k.contiguous(), v.contiguous()
        num_tokens, num_kv_heads, head_dim = k.shape
        kernel[(num_tokens,)](k, v, k_cache, v_cache, slot_mapping.contiguous(), k.stride(0), k.stride(1),
                              *k_cache.stride()[:3], num_kv_heads, head_dim, BLOCK_SIZE=k_cache.shape[1],
                              HEADS_PAD=triton.next_power_of_2(num_kv_heads),
                              DIM_PAD=triton.next_power_of_2(head_dim))
    return store_kv


def test_store_kv_kernel_solution_passes(capsys):
    assert check_store_kv_kernel(launcher(store_kv_kernel)) is True
    assert capsys.readouterr().out == "PASS store_kv_kernel\n"


@pytest.mark.parametrize("kernel,message", [
    (_stub_kernel, "the kernel is not written yet (it raises NotImplementedError)"),
    (_writes_padding,
     "for 4 tokens with slots [9, -1, 2, -1] in 3 blocks of 4 (-1 is padding: nothing is written "
                      "for it) it wrote 32 values into the memory just before k_cache "
                      "(slot -1 is padding: skip it"),
    (_slot_as_block,
     "for 3 tokens into slots [5, 6, 7] of a pool of 3 blocks of 4 (block 1, rows 1-3), 2 KV heads, "
                     "head_dim 16 it wrote past the end of k_cache, into block 5 of a "
                     "pool of 3 (is the slot used as a block id?"),
    (_k_and_v_swapped, "head_dim 16, k_cache[1, 1, 0] (slot 5, KV head 0) holds"),
    (_first_head_only,
     "k_cache[1, 1, 1] (slot 5, KV head 1) holds [7, 7, 7, ...] instead of token 0's key for that "
                       "head (nothing was written there: store every KV head"),
])
def test_store_kv_kernel_mistakes(capsys, kernel, message):
    assert check_store_kv_kernel(launcher(kernel)) is False
    out = capsys.readouterr().out
    assert out.startswith("FAIL store_kv_kernel: ") and message in out, out
    if kernel is _k_and_v_swapped:
        assert "instead of token 0's key for that head (it holds token 0's value: K goes to k_cache" in out


@triton.jit
def _scalar_in_mask(k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
                    stride_kt, stride_kh, stride_cb, stride_cs, stride_ch, num_kv_heads, head_dim,
                    BLOCK_SIZE: tl.constexpr, HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    h = tl.arange(0, HEADS_PAD)[:, None]
    d = tl.arange(0, DIM_PAD)[None, :]
    mask = (h < num_kv_heads) & (d < head_dim) & (slot >= 0)
    src = token * stride_kt + h * stride_kh + d
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + h * stride_ch + d
    tl.store(k_cache_ptr + dst, tl.load(k_ptr + src, mask=mask), mask=mask)
    tl.store(v_cache_ptr + dst, tl.load(v_ptr + src, mask=mask), mask=mask)


def test_store_kv_kernel_with_a_scalar_in_the_mask(capsys):
    """Right on a GPU; the interpreter rejects a mask that mixes a block with a single value, and the
    checker says how to write it instead."""
    passed = check_store_kv_kernel(launcher(_scalar_in_mask))
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
