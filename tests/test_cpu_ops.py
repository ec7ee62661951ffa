"""radarlab's fused C++ operators (radarlab/csrc: layernorm, activation, rotary) against the torch
code in radarlab.models.llama that they replace, and the model with them against the model without.

In bf16 and fp16 they round where torch's unfused ops round, so most elements are bit-identical; the
rest differ by one unit in the last place, where a sum or an exp is ordered differently.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import radarlab.cpu_ops as cpu_ops_module
from radarlab.cpu_ops import CpuOpsUnavailable, find_compiler, load_cpu_ops
from radarlab.models.llama import RMSNorm, apply_rope

from cpu_ops_build import built_or_fail, needs_compiler

pytestmark = needs_compiler


@pytest.fixture(scope="module", autouse=True)
def built_ops():
    """Every test here needs the build; where a compiler exists, a failed build fails them all."""
    return built_or_fail()


DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element, how many representable values of a's dtype lie between a and b (0: identical)."""
    assert a.dtype == b.dtype
    bits = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[a.dtype]
    return (a.view(bits).int() - b.view(bits).int()).abs()


def assert_as_torch_rounds(ours, ref, *, identical=0.97, most=1):
    """fp32: within 1e-6 relative. 16-bit: at most `most` ulps anywhere, bit-identical almost everywhere."""
    assert ours.dtype == ref.dtype and ours.shape == ref.shape
    if ours.dtype == torch.float32:
        torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
        return
    diff = ulps(ours, ref)
    assert int(diff.max()) <= most, f"{int(diff.max())} ulps apart"
    assert float((diff == 0).float().mean()) >= identical


def gemv_error(ops, seed: int = 0) -> dict:
    """radarlab's GEMV against the same matmul in fp64, over 1-4 rows, K with and without a vector tail,
    three weights side by side (blocks cut short by each weight's end), with and without a bias:
    {dtype: largest error beyond one rounding to the dtype (eps |exact|), relative to sum |x w|}. An
    fp32 sum of K products is off by at most about K * 2^-24 of that sum (in practice far less); the
    order of the sums differs between vector widths, so it is a bound, not bits. The other-ISA builds
    call it too (tests/attention/test_cpu_decode.py)."""
    g = torch.Generator().manual_seed(seed)
    worst = {}
    for dtype in DTYPES:
        for rows in (1, 2, 3, 4):
            for k, outs in ((100, (40, 8, 13)), (576, (64, 576 // 3, 21))):
                x = torch.randn(rows, k, generator=g).to(dtype)
                ws = [(torch.randn(n, k, generator=g) * 0.1).to(dtype) for n in outs]
                for bias in (None, torch.randn(sum(outs), generator=g).to(dtype)):
                    got = ops.gemv(x, ws, bias).double()
                    w = torch.cat(ws).double()
                    b = torch.zeros(()) if bias is None else bias.double()
                    exact = x.double() @ w.T + b
                    scale = x.double().abs() @ w.abs().T + b.abs()
                    beyond = ((got - exact).abs() - torch.finfo(dtype).eps * exact.abs()).clamp(min=0)
                    worst[str(dtype)] = max(worst.get(str(dtype), 0.0), float((beyond / scale).max()))
    return worst


def argmax_agrees(ops, seed: int = 0) -> bool:
    """argmax_rows equals torch's fp32 argmax, in every dtype, on random rows, ties, NaNs and -inf."""
    g = torch.Generator().manual_seed(seed)
    for dtype in DTYPES:
        for v in (1, 7, 16, 33, 1000):
            x = torch.randn(5, v, generator=g).to(dtype)
            x[1] = torch.randint(0, 2, (v,), generator=g).to(dtype)
            x[2] = float("-inf")
            x[3, v // 2] = float("nan")
            if not torch.equal(ops.argmax_rows(x), x.float().argmax(-1)):
                return False
    return True


def test_gemv_equals_the_fp64_matmul_rounded_once():
    """Sums in fp32, rounded once to the dtype: beyond that rounding, within 1e-6 of sum |x w| (a
    16-bit GEMV that rounded its products or partial sums would be ~1e-3 off)."""
    worst = gemv_error(load_cpu_ops())
    assert all(e < 1e-6 for e in worst.values()), worst


def test_gemv_matches_f_linear_on_one_weight():
    ops = load_cpu_ops()
    x, w = torch.randn(3, 64), torch.randn(48, 64)
    torch.testing.assert_close(ops.gemv(x, [w]), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_gemv_bad_inputs_raise_and_name_the_problem():
    ops = load_cpu_ops()
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="1 to 4 rows, got 5"):
        ops.gemv(torch.randn(5, 8), [w])
    with pytest.raises(RuntimeError, match=r"weight 1 must be a contiguous \[N, 8\] CPU tensor"):
        ops.gemv(x, [w, torch.randn(4, 9)])
    with pytest.raises(RuntimeError, match=r"weight 0 must be a contiguous"):
        ops.gemv(x, [torch.randn(8, 4).t()])
    with pytest.raises(RuntimeError, match="weight 0 is BFloat16, x is Float"):
        ops.gemv(x, [w.bfloat16()])
    with pytest.raises(RuntimeError, match=r"bias must be a contiguous \[4\] Float CPU tensor"):
        ops.gemv(x, [w], torch.randn(5))
    with pytest.raises(RuntimeError, match="x must be a contiguous"):
        ops.gemv(torch.randn(8, 2).t(), [w])
    with pytest.raises(RuntimeError, match="no weights"):
        ops.gemv(x, [])
    with pytest.raises(RuntimeError, match="expected float32, bfloat16 or float16"):
        ops.gemv(x.double(), [w.double()])


def test_argmax_rows_is_torchs_argmax():
    ops = load_cpu_ops()
    assert argmax_agrees(ops)
    with pytest.raises(RuntimeError, match=r"logits must be a \[rows, vocab\] CPU tensor"):
        ops.argmax_rows(torch.randn(4, 3).t())
    with pytest.raises(RuntimeError, match="the vocabulary must have 1 to"):
        ops.argmax_rows(torch.randn(4, 0))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 37])
def test_rms_norm_equals_the_torch_code(dtype, rows):
    torch.manual_seed(rows)
    norm = RMSNorm(576, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(576) + 0.5)
    x = (torch.randn(rows, 576) * 3).to(dtype)
    with torch.inference_mode():  # two roundings (x / rms, then times a weight up to 1.5): up to 2 ulps
        assert_as_torch_rounds(norm(x, load_cpu_ops()), norm(x), most=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm_updates_the_residual_and_norms_it(dtype):
    """vLLM's fused_add_rms_norm: x += delta in place (as torch's add rounds), then the norm of x."""
    torch.manual_seed(3)
    norm = RMSNorm(576, 1e-5).to(dtype)
    x, delta = (torch.randn(9, 576) * 3).to(dtype), torch.randn(9, 576).to(dtype)
    with torch.inference_mode():
        want_x = x + delta
        want = norm(want_x)
        got = norm.add_forward(x, delta, load_cpu_ops())
    assert torch.equal(x, want_x)  # the residual stream, in place and bit for bit
    assert_as_torch_rounds(got, want, most=2)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_reads_the_fused_gemm_output_in_place(dtype):
    torch.manual_seed(1)
    gate_up = (torch.randn(19, 2 * 1536) * 4).to(dtype)
    gate, up = gate_up.split(1536, dim=-1)  # views with a row stride of 3072, as fused_linear returns
    out = load_cpu_ops().silu_and_mul(gate, up)
    assert_as_torch_rounds(out, F.silu(gate) * up)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128, 10])
def test_rotary_embedding_rotates_q_and_k_in_place(dtype, head_dim):
    torch.manual_seed(head_dim)
    t, heads, kv_heads = 23, 9, 3
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim).to(dtype)
    q, k, _ = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.view(t, heads, head_dim), k.view(t, kv_heads, head_dim)
    angles = torch.arange(t)[:, None] * 0.37 ** torch.arange(head_dim // 2)[None, :]
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    want_q, want_k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    untouched = qkv[:, (heads + kv_heads) * head_dim:].clone()
    load_cpu_ops().rotary_embedding(q, k, cos, sin)
    assert_as_torch_rounds(q, want_q, identical=1.0 if dtype != torch.float32 else 0)
    assert_as_torch_rounds(k, want_k, identical=1.0 if dtype != torch.float32 else 0)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], untouched)  # v is not touched


def test_bad_inputs_raise_and_name_the_problem():
    ops = load_cpu_ops()
    x = torch.randn(4, 8)
    with pytest.raises(RuntimeError, match="weight must be a contiguous 1-D tensor of x's dtype"):
        ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 8\] with a contiguous last dimension"):
        ops.rms_norm(x.t(), torch.ones(8), 1e-5)
    with pytest.raises(RuntimeError, match="gate and up must share a dtype"):
        ops.silu_and_mul(x, x.double())
    with pytest.raises(RuntimeError, match="expected float32, bfloat16 or float16"):
        ops.silu_and_mul(x.double(), x.double())
    q = torch.randn(3, 2, 8)
    with pytest.raises(RuntimeError, match="head_dim must be even"):
        ops.rotary_embedding(q[..., :7], q[..., :7], torch.ones(3, 7), torch.ones(3, 7))
    with pytest.raises(RuntimeError, match="q, k, cos and sin must share a dtype"):
        ops.rotary_embedding(q, q.clone(), torch.ones(3, 8, dtype=torch.bfloat16),
                             torch.ones(3, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_model_with_the_operators_equals_the_model_without(model, dtype):
    """The course model's logits over a 100-token sequence, fused against the torch code. fp32 agrees
    to rounding (the GEMMs alone are ~1e-4 off exact at this length, test_llama). In bf16 each op
    rounds to 8 bits, so both are judged against the fp32 model: the fused model is as close."""
    import copy

    from radarlab.validate.hf import our_logits

    m = model if dtype == torch.float32 else copy.deepcopy(model).to(dtype)
    ids = torch.randint(0, m.config.vocab_size, (100,), generator=torch.Generator().manual_seed(0))
    try:
        m.use_cpu_ops = True
        fused = our_logits(m, ids)
        m.use_cpu_ops = False
        plain = our_logits(m, ids)
    finally:
        m.use_cpu_ops = None
    if dtype == torch.float32:
        assert (fused - plain).abs().max() < 5e-4
        assert torch.equal(fused.argmax(-1), plain.argmax(-1))
    else:
        exact = our_logits(model, ids)
        err_fused, err_plain = ((x.float() - exact).abs().mean() for x in (fused, plain))
        assert err_fused < 1.1 * err_plain and err_plain < 1.1 * err_fused, (err_fused, err_plain)


def test_use_cpu_ops_true_raises_where_they_cannot_be_built(tiny, monkeypatch):
    import radarlab.models.llama as llama

    monkeypatch.setattr(llama, "load_cpu_ops",
                        lambda: (_ for _ in ()).throw(CpuOpsUnavailable("no compiler")))
    tiny.use_cpu_ops = True
    try:
        with torch.no_grad(), pytest.raises(CpuOpsUnavailable, match="no compiler"):
            tiny.cpu_ops(torch.zeros(1))
    finally:
        tiny.use_cpu_ops = None
    with torch.enable_grad():
        assert tiny.cpu_ops(torch.zeros(1)) is None  # autograd: always the torch code


def test_a_forward_hook_sees_the_tensors_of_the_torch_code(model):
    """The operators rotate q and k and add to the residual stream in place. A hook that keeps the
    k_proj output (notebook 07 does) must keep what k_proj returned, and one that keeps a layer's
    output must keep that layer's output, not a tensor the next layer changes."""
    from radarlab.validate.hf import our_logits

    ids = torch.arange(5, 25)
    with torch.no_grad():
        x = model.embed_tokens(ids)
        want_k = model.layers[0].self_attn.k_proj(model.layers[0].input_layernorm(x, load_cpu_ops()))
    seen_k, seen_layer = [], []
    hooks = [model.layers[0].self_attn.k_proj.register_forward_hook(lambda m, a, out: seen_k.append(out))]
    try:
        our_logits(model, ids)
        hooks.append(model.layers[0].register_forward_hook(lambda m, a,
                                                           out: seen_layer.extend([out, out.clone()])))
        with torch.no_grad():
            assert model.cpu_ops(torch.zeros(1)) is None  # a layer hook: the torch code
        our_logits(model, ids)
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        assert model.cpu_ops(torch.zeros(1)) is not None  # hooks gone: the operators again
    assert torch.equal(seen_k[0], want_k)  # un-rotated, as k_proj returned it
    assert torch.equal(seen_layer[0], seen_layer[1])  # layer 0's output, as held, was not changed by layer 1


# --- where the build is expected: a compiler on PATH --------------------------------------------
def _fake_compiler(folder, name):
    path = folder / name
    path.write_text("#!/bin/sh\nexit 1\n")
    path.chmod(0o755)
    return path


def test_find_compiler_takes_cxx_then_the_first_on_path(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    assert find_compiler() is None
    clang = _fake_compiler(tmp_path, "clang++")
    assert find_compiler() == str(clang)
    gxx = _fake_compiler(tmp_path, "g++")
    assert find_compiler() == str(gxx)  # g++ before clang++, as COMPILERS orders them
    monkeypatch.setenv("CXX", "clang++")
    assert find_compiler() == str(clang)
    monkeypatch.setenv("CXX", "no-such-compiler")
    assert find_compiler() == str(gxx)


def test_no_compiler_says_so_without_trying_to_build(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CXX", raising=False)
    ops, reason = cpu_ops_module._build.__wrapped__()  # the uncached body: this process's build stays
    assert ops is None and "no C++ compiler on PATH" in reason and "g++" in reason


def test_a_failed_build_is_a_failure_where_a_compiler_exists(tmp_path, monkeypatch):
    """The rule of this file and test_cpu_decode.py: skip only without a compiler."""
    import cpu_ops_build

    def broken():
        raise CpuOpsUnavailable("could not build radarlab's C++ operators: error: expected ';'")

    monkeypatch.setattr(cpu_ops_build, "load_cpu_ops", broken)
    with pytest.raises(pytest.fail.Exception, match="must build: .*expected ';'"):
        cpu_ops_build.built_or_fail()


def test_a_lock_left_by_a_killed_build_is_cleared_and_a_fresh_one_kept(tmp_path):
    """torch's build lock outlives a killed build, and every later load would wait on it forever."""
    import os

    lock = tmp_path / "lock"
    assert cpu_ops_module._clear_stale_lock(lock) is False  # no lock: nothing to do
    lock.touch()
    assert cpu_ops_module._clear_stale_lock(lock) is False and lock.exists()  # a build may be running
    old = lock.stat().st_mtime - cpu_ops_module.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    with pytest.warns(UserWarning, match="stopped before it finished"):
        assert cpu_ops_module._clear_stale_lock(lock) is True
    assert not lock.exists()
