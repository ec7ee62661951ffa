"""The C++ paged decode kernel (radarlab/csrc/paged_decode.cpp) against fp32 math on the same values.

Cases come from test_paged_attention.make_case: shuffled block tables and every unused slot NaN, so
a read outside a sequence's blocks poisons the output. The kernel has three vector paths (AVX-512,
AVX2, plain loops); this machine's is tested in process, the other two in child processes built
with -march=haswell and -march=x86-64.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from radarlab.attention.cpu_decode import paged_decode_cpu
from radarlab.attention.sdpa_paged import KERNEL_MAX_QUERIES, paged_attention_sdpa, plan_paged_sdpa
from radarlab.cpu_ops import load_cpu_ops
from radarlab.device import cpu_arch, cpu_flags

from cpu_ops_build import built_or_fail, needs_compiler
from test_paged_attention import TOL, make_case, max_error

pytestmark = needs_compiler


@pytest.fixture(scope="module", autouse=True)
def built_ops():
    """Every test here needs the build; where a compiler exists, a failed build fails them all."""
    return built_or_fail()


DECODES = [1, 5, 16, 23, 40]  # one token, exactly a block of 16, lengths that are not multiples
# (query heads, KV heads, head_dim): the course model's (GQA 3, 64), 128, no GQA, GQA 4, and sizes
# that are not a multiple of the vector width (the run-time head_dim path)
HEADS = [(9, 3, 64), (4, 2, 128), (2, 2, 64), (8, 2, 64), (6, 3, 40), (2, 1, 8)]


def decode(case, **kw):
    return paged_decode_cpu(case.q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale,
                            **kw)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "x".join(map(str, h)))
# 8 >= 2 threads: whole sequences
@pytest.mark.parametrize("batch", [1, 8], ids=["per_kv_head", "per_sequence"])
def test_fp32_equals_the_reference(block_size, heads, batch):
    lens = (DECODES * 2)[:batch] if batch > 1 else [37]
    case = make_case(lens, [1] * len(lens), block_size, *heads, seed=block_size + batch)
    out = decode(case)
    assert out.dtype == torch.float32 and out.shape == case.q.shape
    assert max_error(out, case.expected) < TOL


@pytest.mark.parametrize("dtype, q_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16),
                                            (torch.bfloat16, torch.float32), (torch.float16, torch.float32)],
                         ids=["bf16", "fp16", "fp32_q_bf16_pool", "fp32_q_fp16_pool"])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 128), (6, 3, 40)], ids=lambda h: "x".join(map(str, h)))
def test_16_bit_pools_are_read_exactly_and_accumulated_in_fp32(dtype, q_dtype, heads):
    """The pool's 16-bit values are widened exactly; the only rounding left is the output's own."""
    case = make_case(DECODES, [1] * len(DECODES), 4, *heads, seed=5, dtype=dtype)
    out = paged_decode_cpu(case.q.to(q_dtype), case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                           case.scale)
    assert out.dtype == q_dtype and not out.isnan().any()
    if q_dtype == torch.float32:
        assert max_error(out, case.expected) < TOL
    else:  # one rounding of the fp32 result to the output dtype
        torch.testing.assert_close(out.float(), case.expected, rtol=2 ** -7, atol=2 ** -9)


def test_rows_place_each_decode_and_leave_other_rows_alone():
    """In a mixed step the decodes are some of q's rows: rows[i] is sequence i's."""
    case = make_case([9, 30, 4], [1, 1, 1], 4, 9, 3, 64, seed=2)
    q = torch.randn(6, 9, 64)
    rows = torch.tensor([4, 0, 2])
    q[rows] = case.q
    out = torch.full_like(q, 7.0)
    paged_decode_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale, out=out,
                     rows=rows)
    assert max_error(out[rows], case.expected) < TOL
    assert (out[[1, 3, 5]] == 7.0).all()


def test_q_may_be_a_view_of_the_fused_projection():
    """q arrives as a view of the qkv GEMM's output: rows strided past k and v."""
    case = make_case(DECODES, [1] * len(DECODES), 4, 9, 3, 64, seed=8)
    qkv = torch.randn(len(DECODES), 9 * 64 + 2 * 3 * 64)
    qkv[:, :9 * 64] = case.q.reshape(len(DECODES), -1)
    q = qkv[:, :9 * 64].view(len(DECODES), 9, 64)
    assert not q.is_contiguous()
    out = paged_decode_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    assert max_error(out, case.expected) < TOL


def test_the_result_does_not_depend_on_the_thread_count():
    """Each item is computed by one thread in a fixed order, so 1 and 2 threads agree bit for bit."""
    case = make_case(DECODES * 2, [1] * 10, 4, 9, 3, 64, seed=4)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode(case)
        torch.set_num_threads(2)
        two = decode(case)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_the_engine_plan_sends_decodes_and_short_chunks_to_the_kernel_and_long_chunks_to_sdpa():
    """plan_paged_sdpa(decode_kernel=True): decodes through the kernel (no buckets), and a 6-query chunk
    (a verify step) as 6 kernel rows, query i over the first 35 + i tokens; the 18-query prefill and
    a chunk one query past KERNEL_MAX_QUERIES through SDPA, in one step; equal to the reference."""
    long = KERNEL_MAX_QUERIES + 1
    lens, q_lens = [7, 40, 3, 18, 1, 25, 30], [1, 6, 1, 18, 1, 1, long]
    case = make_case(lens, q_lens, 4, 9, 3, 64, seed=6)
    plan = plan_paged_sdpa(case.block_tables, case.seq_lens, case.query_start_loc, 4, decode_kernel=True)
    assert plan.decodes == () and plan.kernel is not None and plan.context == 40
    assert plan.kernel.rows.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 26, 27]
    assert plan.kernel.seq_lens.tolist() == [7, 35, 36, 37, 38, 39, 40, 3, 1, 25]
    assert [(p.lo, p.hi) for p in plan.prefills] == [(8, 26), (28, 28 + long)]
    out = paged_attention_sdpa(case.q, case.k_cache, case.v_cache, plan, case.scale)
    assert max_error(out, case.expected) < TOL
    decodes_only = plan_paged_sdpa(case.block_tables[[0, 2]], case.seq_lens[[0, 2]], torch.arange(3), 4,
                                   decode_kernel=True)
    assert decodes_only.kernel.rows is None  # every row a decode, in order: no scatter


def test_bad_inputs_raise_and_name_the_problem():
    case = make_case([5, 9], [1, 1], 4, 4, 2, 16)
    with pytest.raises(ValueError, match="outside the pool"):
        bad = case.block_tables.clone()
        bad[0, 0] = case.k_cache.shape[0]
        paged_decode_cpu(case.q, case.k_cache, case.v_cache, bad, case.seq_lens, case.scale)
    with pytest.raises(ValueError, match="at least one token"):
        paged_decode_cpu(case.q, case.k_cache, case.v_cache, case.block_tables, torch.tensor([0, 9]),
                         case.scale)
    with pytest.raises(ValueError, match="pass rows"):
        paged_decode_cpu(case.q[:1], case.k_cache, case.v_cache, case.block_tables, case.seq_lens, case.scale)
    op = load_cpu_ops().paged_decode
    tables, lens = case.block_tables.int(), case.seq_lens.int()
    out = torch.empty_like(case.q)
    with pytest.raises(RuntimeError, match="BFloat16 over a Float pool is not supported"):
        op(out.bfloat16(), case.q.bfloat16(), case.k_cache, case.v_cache, tables, lens, None, 1.0)
    with pytest.raises(RuntimeError, match="int32"):
        op(out, case.q, case.k_cache, case.v_cache, case.block_tables.long(), lens, None, 1.0)
    with pytest.raises(RuntimeError, match="contiguous"):
        op(out, case.q, case.k_cache.transpose(0, 1), case.v_cache.transpose(0, 1), tables, lens, None, 1.0)
    with pytest.raises(RuntimeError, match="head_dim"):
        op(out, case.q[..., :8], case.k_cache, case.v_cache, tables, lens, None, 1.0)


_OTHER_ISA = textwrap.dedent("""
    import json, sys, torch
    import torch.nn.functional as F
    sys.path[:0] = {tests!r}
    from radarlab.cpu_ops import load_cpu_ops
    from radarlab.attention.cpu_decode import paged_decode_cpu
    from radarlab.models.llama import RMSNorm, apply_rope
    from test_paged_attention import make_case
    from test_cpu_ops import argmax_agrees, gemv_error, ulps
    ops = load_cpu_ops()
    errors = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for heads in ((9, 3, 64), (4, 2, 128), (6, 3, 40)):
            for lens in ([37], [1, 5, 16, 23, 40, 2, 9, 31]):
                case = make_case(lens, [1] * len(lens), 4, *heads, seed=len(lens), dtype=dtype)
                q = case.q.float()
                out = paged_decode_cpu(q, case.k_cache, case.v_cache, case.block_tables, case.seq_lens,
                                       case.scale)
                errors.append(float((out - case.expected).abs().max()))
    fused_ulps = []  # the fused operators against the torch code, in 16-bit: ulps apart at most
    torch.manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x = (torch.randn(7, 100) * 3).to(dtype)  # 100: vectors and a scalar tail
        norm = RMSNorm(100, 1e-5).to(dtype)
        with torch.inference_mode():
            fused_ulps.append(int(ulps(norm(x, ops), norm(x)).max()))
        gate, up = (torch.randn(7, 200) * 4).to(dtype).split(100, dim=-1)
        out = ops.silu_and_mul(gate, up)
        fused_ulps.append(int(ulps(out, F.silu(gate) * up).max()))
        # half = 36: vectors and a tail
        q, k = torch.randn(5, 9, 72).to(dtype), torch.randn(5, 3, 72).to(dtype)
        emb = torch.arange(5)[:, None] * 0.3 ** torch.arange(36)[None, :]
        cos, sin = torch.cat((emb, emb), -1).cos().to(dtype), torch.cat((emb, emb), -1).sin().to(dtype)
        want = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ops.rotary_embedding(q, k, cos, sin)
        fused_ulps.append(max(int(ulps(q, want[0]).max()), int(ulps(k, want[1]).max())))
    print(json.dumps({{"attention": errors, "fused_ulps": fused_ulps, "gemv": gemv_error(ops),
                      "argmax": argmax_agrees(ops)}}))
""")


MARCHES = {"avx2": "haswell", "plain_loops": "x86-64"}


@pytest.fixture(scope="module")
def other_isa_runs(tmp_path_factory):
    """The AVX2 build and the plain-loop build, each in a child process with a fresh cache, run at once,
    each as one translation unit (radarlab.cpu_ops.unity_source). {name: (returncode, stdout,
    stderr)}; a build this CPU cannot run is left out."""
    if cpu_arch() != "x86_64":
        return {}
    from pathlib import Path

    here = Path(__file__).resolve().parent  # test_paged_attention is here, test_cpu_ops one folder up
    script = _OTHER_ISA.format(tests=[str(here), str(here.parent)])
    children = {}
    for name, march in MARCHES.items():
        if march == "haswell" and not cpu_flags().get("avx2"):
            continue
        cache = str(tmp_path_factory.mktemp(name))  # a fresh build, not this machine's cached one
        env = {**os.environ, "RADARLAB_CPU_MARCH": march, "RADARLAB_CACHE": cache,
               "RADARLAB_CPU_OPS_ONE_UNIT": "1"}  # built to be checked, not timed: a third of the compile
        children[name] = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, text=True, env=env)
    runs = {}
    for name, child in children.items():
        out, err = child.communicate(timeout=900)
        runs[name] = (child.returncode, out, err)
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MARCHES))
def test_the_other_vector_paths_equal_the_reference(name, other_isa_runs):
    """The AVX2 build (what an AVX2-only CPU compiles) and the plain-loop build (no AVX at all), each
    in a child process, on this machine's CPU (which can run both): the decode kernel against fp32
    math, the fused operators against the torch code, the GEMV against fp64, the argmax against torch."""
    if name not in other_isa_runs:
        pytest.skip("needs an x86-64 CPU (with AVX2 for the haswell build)")
    returncode, out, err = other_isa_runs[name]
    assert returncode == 0, err[-2000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert len(result["attention"]) == 18 and max(result["attention"]) < TOL
    assert len(result["fused_ulps"]) == 6 and max(result["fused_ulps"]) <= 2, result["fused_ulps"]
    gemv = result["gemv"]  # the GEMV and the greedy argmax, as test_cpu_ops checks the native build
    assert all(e < 1e-6 for e in gemv.values()), gemv
    assert result["argmax"] is True


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_gives_the_same_tokens_with_and_without_the_kernel(model, prompts, dtype):
    """The course model, greedy, 8 prompts in one batch: the kernel (the default on a CPU) and the
    SDPA fallback agree token for token (fp32; bf16 pools under the fp32 model)."""
    from radarlab.engine import Engine, SamplingParams

    params = SamplingParams(max_tokens=12)
    runs = {}
    for kernel in (True, False):
        engine = Engine(model, num_blocks=128, block_size=16,
                        kv_cache_dtype="bfloat16" if dtype == torch.bfloat16 else "auto", cpu_ops=kernel)
        assert engine.cache.cpu_ops is kernel
        runs[kernel] = [o.output_token_ids for o in engine.generate(prompts, params)]
    assert runs[True] == runs[False]
    assert Engine(model, num_blocks=8).cache.cpu_ops  # the default, where the operators build


def test_the_kernel_is_refused_where_it_cannot_read_the_pool(tiny):
    from radarlab.kvcache.paged_cache import PagedKVCache

    with pytest.raises(ValueError, match="cpu_ops=True needs the torch backend.*fp8_e4m3"):
        PagedKVCache.for_model(tiny.config, 8, 4, kv_cache_dtype="fp8_e4m3", cpu_ops=True)
    with pytest.raises(ValueError, match="backend='triton'"):
        PagedKVCache.for_model(tiny.config, 8, 4, backend="triton", cpu_ops=True)
    assert not PagedKVCache.for_model(tiny.config, 8, 4, kv_cache_dtype="fp8_e4m3").cpu_ops  # auto: no
