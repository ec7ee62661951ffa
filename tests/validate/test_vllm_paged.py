"""Our paged KV cache against real vLLM (radarlab.validate.vllm_paged).

One vLLM worker process serves the whole module: the attention-op cases (vLLM's CPU
cpu_attention_with_kv_cache on the same inputs as ours; first with vLLM's own choice of kernel, then
with every kernel this CPU can run, by name), then one fp32 engine with block_size=32 and prefix
caching on, generating for the validation prompts and the shared-prefix workload.
"""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest
import torch

from radarlab.device import cpu_flags, cpu_kind
from radarlab.lab.machine import ATTENTION_ISAS, attention_isas_supported, isa_missing
from radarlab.models.paged_runner import paged_greedy_generate
from radarlab.validate import vllm_worker
from radarlab.validate.vllm import LOGPROB_TOL, VLLMError, run_vllm, vllm_python
from radarlab.validate.vllm_paged import (
    BACKENDS,
    ENGINE_BLOCK_SIZE,
    FP32_TOL,
    ISA_BLOCK_SIZE,
    ISA_MODES,
    MODES,
    attention_case,
    attention_cases,
    attention_op_request,
    compare_attention,
    compare_greedy_outputs,
    isa_cases,
    isa_dtypes,
    op_rows,
    op_tolerance,
    our_attention,
    our_prefix_run,
    prefix_workload,
    run_paged_session,
    vllm_prefix_counts,
)

NEW_TOKENS = 32
PREFIX_NEW_TOKENS = 8
TOP_K = 5
M = "/nowhere"  # a model path for requests that must fail their checks before any model is read


@pytest.fixture(scope="module")
def prefix_batches(tokenizer):
    return prefix_workload(tokenizer, ENGINE_BLOCK_SIZE)


@pytest.fixture(scope="module")
def cases():
    return attention_cases()


@pytest.fixture(scope="module")
def by_name():
    """The ISA sweep: every kernel this CPU runs, asked for by name."""
    return isa_cases()


@pytest.fixture(scope="module")
def session(prompts, prefix_batches, cases, by_name):
    """One worker process: vLLM's auto cases first, then the by-name ones (vLLM starts once)."""
    return run_paged_session(prompts, prefix_batches, cases + by_name, NEW_TOKENS, PREFIX_NEW_TOKENS, TOP_K)


@pytest.fixture(scope="module")
def our_prefix(model, prefix_batches):
    return our_prefix_run(model, prefix_batches, PREFIX_NEW_TOKENS, ENGINE_BLOCK_SIZE)


# --- 1. the attention op on identical inputs ----------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_op_matches_vllm(session, cases, backend):
    n = len(cases)
    results = compare_attention(cases, session.vllm_outputs[:n], session.isas[:n], backends=(backend,))
    assert len(results) == len(cases) == 2 * 2 * len(MODES)  # fp32 and bf16, blocks 16 and 32
    print(f"\n{session.vllm}, ours = {backend}")
    for r in results:
        print(f"  {r.mode:16s} {str(r.dtype):15s} block {r.block_size:3d} isa {r.isa:6s} "
              f"max |dout| {r.max_abs_err:.2e} (tol {r.tol:.1e})")
    failed = [r for r in results if not r.passed]
    assert not failed, failed
    fp32 = [r.max_abs_err for r in results if r.dtype == torch.float32]
    assert max(fp32) < 5e-6  # measured ~1e-6: different summation order, nothing more


@pytest.mark.vllm
def test_attention_op_comparison_can_fail(session, cases):
    """A wrong block table on our side is caught at once: one sequence's first block points at
    another sequence's block. (Swapping two of its own blocks would not do for decode: attention
    over a whole context does not depend on the order of its keys.)"""
    i = next(i for i, c in enumerate(cases)
             if c["mode"] == "decode" and c["block_size"] == 32 and c["query"].dtype == torch.float32)
    case = dict(cases[i])
    table = case["block_table"].clone()
    table[0, 0] = table[-1, 0]  # sequence 0 (one token) now reads the last sequence's first block
    case["block_table"] = table
    err = (our_attention(case, "torch") - session.vllm_outputs[i]).abs().max().item()
    assert err > 100 * op_tolerance(session.vllm_outputs[i])


@pytest.mark.vllm
@pytest.mark.parametrize("isa", list(ATTENTION_ISAS))
def test_every_isa_matches_ours(session, cases, by_name, isa):
    """vLLM's kernel `isa`, asked for by name, against paged_attention_torch: every kernel this CPU can
    run, fp32 and bf16 where the kernel takes them, decode and prefill. Kernels for other CPUs skip."""
    missing = isa_missing(isa)
    if missing:
        pytest.skip(f"this CPU ({cpu_kind()}) cannot run {isa!r}: it lacks {', '.join(missing)}")
    picked = [i for i, c in enumerate(by_name) if c["isa"] == isa]
    mine = [by_name[i] for i in picked]
    outputs = [session.vllm_outputs[len(cases) + i] for i in picked]
    ran = [session.isas[len(cases) + i] for i in picked]
    assert ran == [isa] * len(mine)  # the worker ran what was asked for, not its own choice
    dtypes = isa_dtypes(isa)
    assert sorted((str(c["query"].dtype), c["mode"]) for c in mine) == sorted(
        (str(dt), m) for dt in dtypes for m in ISA_MODES)
    results = compare_attention(mine, outputs, ran, backends=("torch",))
    print(f"\n{session.vllm} {session.extension} on {session.cpu_kind}, isa {isa}, block {ISA_BLOCK_SIZE}")
    for r in results:
        print(f"  {r.mode:8s} {str(r.dtype):15s} max |dout| {r.max_abs_err:.2e} (tol {r.tol:.1e})")
    failed = [r for r in results if not r.passed]
    assert not failed, failed
    fp32 = [r.max_abs_err for r in results if r.dtype == torch.float32]
    assert not fp32 or max(fp32) < 5e-6


@pytest.mark.vllm
def test_worker_reports_the_cpu_and_vllm_chooses_by_it(session, cases):
    """The worker's CPU flags agree with ours, it loaded the library import_kernels picks for them,
    and vLLM's auto choice follows _get_attn_isa's rule on this CPU."""
    assert session.cpu["flags"] == cpu_flags()
    assert session.cpu_kind == cpu_kind()
    flags = session.cpu["flags"]
    if session.cpu["arch"] == "x86_64":
        expected = ("_C" if flags["avx512f"] and flags["avx512_bf16"]
                    else "_C_AVX512" if flags["avx512f"] else "_C_AVX2")
        assert session.extension == expected
    amx = "amx" in attention_isas_supported()
    for case, isa in zip(cases, session.isas[:len(cases)]):
        bf16_amx = amx and case["query"].dtype == torch.bfloat16 and case["block_size"] % 32 == 0
        expected_isa = "amx" if bf16_amx else "vec" if case["block_size"] % 32 == 0 else "vec16"
        assert isa == expected_isa, case["mode"]


def test_op_rows_show_the_isa_and_cpu_kind(cases):
    """Rows group by ISA and say how it was chosen and on which CPU; the JSON details carry both."""
    auto, named = attention_case("decode", 32), attention_case("decode", 32, isa="vec16")
    out = our_attention(auto)
    wrong = out + 1.0
    comparisons = compare_attention([auto, named], [out, wrong], ["vec", "vec16"], backends=("torch",))
    rows = op_rows(comparisons, "vLLM x.y (cpu) _C", "avx512_bf16")
    assert [r.check for r in rows] == ["paged attention op, decode fp32, isa vec (auto) "
                                       "on avx512_bf16, blocks 32",
                                       "paged attention op, decode fp32, isa vec16 (by name) "
                                       "on avx512_bf16, blocks 32"]
    assert [r.passed for r in rows] == [True, False]  # a wrong output fails its own row only
    assert rows[1].details["isa"] == "vec16" and rows[1].details["cpu_kind"] == "avx512_bf16"
    assert rows[1].details["requested"] == ["vec16"]
    assert json.loads(json.dumps(rows[0].as_dict()))["details"]["block_sizes"] == [32]


# --- asking for a kernel this CPU lacks: a clear error, never SIGILL --------------------------------
def _lacking() -> str:
    """An ISA this CPU cannot run: amx where there is no AMX, else another architecture's kernel."""
    return next(isa for isa in ("amx", "neon", "vec") if isa_missing(isa))


@pytest.mark.vllm
def test_worker_refuses_an_isa_this_cpu_lacks(tmp_path):
    """The worker itself (not only run_vllm's check in this process) answers a JSON error naming the
    missing flag and exits 1, before vLLM is imported."""
    isa = _lacking()
    request = {"kind": "attention_op", "inputs": str(tmp_path / "a.pt"), "outputs": str(tmp_path / "b.pt"),
               "isa": isa}
    proc = subprocess.run([str(vllm_python()), str(vllm_worker.__file__)], input=json.dumps(request),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr[-2000:]  # SIGILL would be -4
    response = json.loads(proc.stdout)
    assert response["ok"] is False
    assert f"vLLM's {isa!r} attention kernel needs {isa_missing(isa)[0]}" in response["error"]
    assert "BadRequest" in response["error"]


@pytest.mark.vllm
def test_case_asking_for_an_isa_this_cpu_lacks_fails_cleanly(tmp_path):
    """The same for an ISA named inside the inputs file, which only the worker sees."""
    isa = _lacking()
    case = attention_case("decode", 32, torch.bfloat16)
    case["isa"] = isa  # attention_case itself accepts it: it may be written for another machine
    request, _ = attention_op_request([attention_case("decode", 32), case], tmp_path)
    with pytest.raises(VLLMError, match=r"exit status 1\): BadRequest: cases\[1\]\.isa: vLLM's") as info:
        run_vllm(request, timeout=300)
    assert isa_missing(isa)[0] in str(info.value)


def test_an_isa_this_cpu_lacks_fails_before_starting_vllm():
    isa = _lacking()
    with pytest.raises(ValueError, match="bad vLLM request: isa: vLLM's") as info:
        run_vllm({"kind": "attention_op", "inputs": "a.pt", "outputs": "b.pt", "isa": isa},
                 python="/nonexistent/python")
    assert f"needs {isa_missing(isa)[0]}" in str(info.value)


# --- 2. greedy at matched block size ------------------------------------------------------------------
@pytest.mark.vllm
def test_paged_greedy_matches_vllm_block_32(model, prompts, session):
    assert session.generate["request"]["block_size"] == ENGINE_BLOCK_SIZE
    ours = paged_greedy_generate(model, prompts, NEW_TOKENS, block_size=ENGINE_BLOCK_SIZE)
    theirs = session.generate["outputs"][:session.num_prompts]
    assert all(len(o["token_ids"]) == NEW_TOKENS for o in theirs)
    results, worst = compare_greedy_outputs(model, prompts, ours, theirs, TOP_K)
    print(f"\nmatched prefix per prompt {[r.matched for r in results]} of {NEW_TOKENS}; "
          f"max |dlogprob| {worst:.1e}")
    failed = [(i, r.reason) for i, r in enumerate(results) if not r.passed]
    assert not failed, failed
    assert worst < LOGPROB_TOL


# --- 3. prefix caching ------------------------------------------------------------------------------
@pytest.mark.vllm
def test_prefix_cache_hits_match_vllm(session, our_prefix, prefix_batches):
    theirs = [o["num_cached_tokens"] for o in session.generate["outputs"][session.num_prompts:]]
    queries, hits = vllm_prefix_counts(session.generate, slice(1, None))
    print(f"\nper request: ours {our_prefix.num_cached_tokens}, vLLM {theirs}; per batch queries/hits: "
          f"ours {our_prefix.queries}/{our_prefix.hits}, vLLM {queries}/{hits}")
    assert our_prefix.num_cached_tokens == theirs
    assert (our_prefix.queries, our_prefix.hits) == (queries, hits)
    # The workload does what prefix_workload says: a cold first request, hits on the shared system
    # prompt, the block-aligned repeat recomputing its whole last block, no hit for the stranger.
    batch1, batch2 = prefix_batches
    assert theirs[0] == 0 and queries[0] == len(batch1[0])
    aligned = batch2[-2]
    assert len(aligned) % ENGINE_BLOCK_SIZE == 0 and theirs[-2] == len(aligned) - ENGINE_BLOCK_SIZE
    assert theirs[-1] == 0 and min(theirs[1:-1]) > 0
    assert queries[1] == sum(len(p) for p in batch2)


@pytest.mark.vllm
def test_greedy_on_prefix_hits_matches_vllm(model, prefix_batches, session, our_prefix):
    prompts = [p for batch in prefix_batches for p in batch]
    theirs = session.generate["outputs"][session.num_prompts:]
    results, worst = compare_greedy_outputs(model, prompts, our_prefix.outputs, theirs, TOP_K)
    failed = [(i, r.reason) for i, r in enumerate(results) if not r.passed]
    assert not failed, failed
    assert worst < LOGPROB_TOL


# --- no vLLM needed: requests and cases are checked before anything runs ------------------------------
@pytest.mark.parametrize("request_, words", [
    ({"kind": "attention_op", "inputs": "a.pt"}, "outputs must be a file path"),
    ({"kind": "attention_op", "inputs": "a.pt", "outputs": "b.pt", "prompts": [[1]]},
     "unknown request fields"),
    ({"kind": "paged"}, "kind must be one of"),
    ({"kind": "session", "requests": []}, "requests must be a non-empty list"),
    ({"kind": "session", "requests": [{"kind": "session", "requests": []}]}, "sessions do not nest"),
    ({"kind": "session", "requests": [{"model": M, "prompts": [[1]]}, {"model": M, "prompts": [[2]]}]},
     "at most one generate"),
    ({"kind": "session", "requests": [{"model": M, "prompts": [[1]], "max_tokens": 0}]},
     "requests[0]: max_tokens"),
    ({"model": M, "batches": [[[1]], [[2]]], "batch_max_tokens": [4]}, "one entry per batch"),
    ({"model": M, "batches": [[[1]], [[1] * 2000]], "batch_max_tokens": [4, 100]}, "max_model_len"),
])
def test_bad_paged_request_fails_before_starting_vllm(request_, words):
    with pytest.raises(ValueError, match="bad vLLM request") as info:
        run_vllm(request_, python="/nonexistent/python")
    assert words in str(info.value)


AVX2_CPU = {"arch": "x86_64",
            "flags": {"avx2": True, "avx512f": False, "avx512_bf16": False, "amx_tile": False,
                                        "amx_bf16": False, "amx_int8": False}}
AMX_CPU = {"arch": "x86_64", "flags": {f: True for f in vllm_worker.CPU_FLAGS}}
ARM_CPU = {"arch": "aarch64", "flags": {f: False for f in vllm_worker.CPU_FLAGS}}


@pytest.mark.parametrize("cpu, isa, words", [
    (AMX_CPU, "avx512", "isa must be one of ['auto', 'vec', 'vec16', 'amx'"),
    (AMX_CPU, 3, "isa must be one of"),
    (AVX2_CPU, "amx",
     "'amx' attention kernel needs avx512f, avx512_bf16, amx_tile, amx_bf16, which this CPU lacks; "
                      "it can run ['vec', 'vec16']"),
    (AMX_CPU, "neon", "'neon' attention kernel needs aarch64 (this CPU is x86_64)"),
    (ARM_CPU, "amx",
     "needs x86_64 (this CPU is aarch64), which this CPU lacks; it can run ['vec', 'vec16', 'neon']"),
    ({"arch": "x86_64", "flags": {f: False for f in vllm_worker.CPU_FLAGS}}, "vec", "needs avx2"),
])
def test_attention_op_isa_is_checked_against_the_cpu(monkeypatch, cpu, isa, words):
    """The request's isa must name a kernel and one this CPU runs; the message names what is missing."""
    monkeypatch.setattr(vllm_worker, "_cpu", lambda: cpu)
    with pytest.raises(vllm_worker.BadRequest) as info:
        vllm_worker.normalize({"kind": "attention_op", "inputs": "a.pt", "outputs": "b.pt", "isa": isa})
    assert words in str(info.value)


@pytest.mark.parametrize("cpu, isa",
                         [(AVX2_CPU, "vec"), (AVX2_CPU, "vec16"), (AMX_CPU, "amx"), (ARM_CPU, "neon"),
                                      (AVX2_CPU, "auto")])
def test_attention_op_isa_this_cpu_runs_passes(monkeypatch, cpu, isa):
    monkeypatch.setattr(vllm_worker, "_cpu", lambda: cpu)
    req = vllm_worker.normalize({"kind": "attention_op", "inputs": "a.pt", "outputs": "b.pt", "isa": isa})
    assert req["isa"] == isa
    assert vllm_worker.normalize({"kind": "attention_op", "inputs": "a.pt",
                                  "outputs": "b.pt"})["isa"] == "auto"


@pytest.mark.parametrize("isa, block_size, words", [
    ("amx", 32, "the 'amx' kernel takes bfloat16 only, got float32"),
    ("vec", 16, "the 'vec' kernel needs block_size a multiple of 32, got 16"),
    ("vec16", 8, "the 'vec16' kernel needs block_size a multiple of 16, got 8"),
    ("bogus", 32, "cases[0].isa must be one of"),
])
def test_case_isa_must_fit_the_case(monkeypatch, isa, block_size, words):
    """A kernel given per case must take the case's dtype, block size and head size."""
    monkeypatch.setattr(vllm_worker, "_cpu", lambda: AMX_CPU)
    case = attention_case("decode", block_size)
    assert vllm_worker._check_case(case, 0, torch) == "auto"
    case["isa"] = isa
    with pytest.raises(vllm_worker.BadRequest, match=r"cases\[0\]") as info:
        vllm_worker._check_case(case, 0, torch)
    assert words in str(info.value)


def test_case_isa_overrides_the_request_isa(monkeypatch):
    monkeypatch.setattr(vllm_worker, "_cpu", lambda: AMX_CPU)
    bf16 = attention_case("decode", 32, torch.bfloat16)
    assert vllm_worker._check_case(bf16, 0, torch, "amx") == "amx"
    bf16["isa"] = "vec16"
    assert vllm_worker._check_case(bf16, 0, torch, "amx") == "vec16"
    with pytest.raises(vllm_worker.BadRequest, match="takes bfloat16 only"):
        # fp32 under a request-wide amx
        vllm_worker._check_case(attention_case("decode", 32), 0, torch, "amx")


def _fake_vllm(monkeypatch, events: list, auto_isa: str) -> None:
    """Stand-ins for the vLLM modules the worker's attention_op imports, recording each op call, so its
    order of steps can be checked on a CPU without AMX (and without vLLM)."""
    def op(name):
        def call(*args, **kwargs):
            events.append(name)
            if name == "attention":
                kwargs["output"].zero_()
        return call

    platform_ = types.SimpleNamespace(is_cpu=lambda: True,
                                      import_kernels=lambda: events.append("import_kernels"))
    ops = types.SimpleNamespace(cpu_attn_reshape_and_cache=op("reshape"),
                                cpu_attention_with_kv_cache=op("attention"),
                                cpu_attn_get_scheduler_metadata=op("metadata"))
    root = types.ModuleType("vllm")
    root.__version__, root._custom_ops = "fake", ops
    root.envs = types.SimpleNamespace(VLLM_CPU_ATTN_SPLIT_KV=False)
    cpu_attn = types.ModuleType("vllm.v1.attention.backends.cpu_attn")
    cpu_attn._get_attn_isa = lambda dtype, block_size, head_size, kv_cache_dtype: auto_isa
    modules = {"vllm": root, "vllm.platforms": types.SimpleNamespace(current_platform=platform_),
               "vllm.v1": types.ModuleType("vllm.v1"),
               "vllm.v1.attention": types.ModuleType("vllm.v1.attention"),
               "vllm.v1.attention.backends": types.ModuleType("vllm.v1.attention.backends"),
               "vllm.v1.attention.backends.cpu_attn": cpu_attn}
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


@pytest.mark.parametrize("isa", ["auto", "amx"])
def test_amx_tile_permission_is_asked_before_any_op(monkeypatch, tmp_path, isa):
    """The SIGILL fix, checkable without AMX: whether vLLM picks amx (auto) or the request names it, the
    worker asks Linux for AMX tile state (torch.cpu._init_amx) after loading vLLM's kernels and before
    the first op; a vec case in the same request needs no asking."""
    events = []
    _fake_vllm(monkeypatch, events, auto_isa="amx")
    monkeypatch.setattr(vllm_worker, "_cpu", lambda: AMX_CPU)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: events.append("init_amx") or True)
    cases = [attention_case("decode", 32, torch.bfloat16, isa="vec"),
             attention_case("decode", 32, torch.bfloat16)]
    request, _ = attention_op_request(cases, tmp_path)
    response = vllm_worker.run(vllm_worker.normalize({**request, "isa": isa}))
    assert [c["isa"] for c in response["cases"]] == ["vec", "amx"]
    assert [c["requested"] for c in response["cases"]] == ["vec", isa]
    assert events == ["import_kernels", "init_amx"] + ["reshape", "metadata", "attention"] * 2
    assert response["cpu"] == AMX_CPU


def test_amx_refused_by_linux_is_an_error_before_any_op(monkeypatch, tmp_path):
    events = []
    _fake_vllm(monkeypatch, events, auto_isa="amx")
    monkeypatch.setattr(vllm_worker, "_cpu", lambda: AMX_CPU)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False)
    request, _ = attention_op_request([attention_case("decode", 32, torch.bfloat16)], tmp_path)
    with pytest.raises(RuntimeError, match="ARCH_REQ_XCOMP_PERM"):
        vllm_worker.run(vllm_worker.normalize(request))
    assert events == ["import_kernels"]  # no op ran


def test_auto_choice_is_held_to_the_cpu(monkeypatch, tmp_path):
    """Where vLLM would pick amx (torch's cpuid sees AMX) but /proc/cpuinfo lists no amx_tile (a Linux
    without AMX support), the worker refuses instead of running into SIGILL."""
    events = []
    _fake_vllm(monkeypatch, events, auto_isa="amx")
    monkeypatch.setattr(vllm_worker, "_cpu",
                        lambda: {**AVX2_CPU, "flags": {**AMX_CPU["flags"], "amx_tile": False}})
    request, _ = attention_op_request([attention_case("decode", 32, torch.bfloat16)], tmp_path)
    with pytest.raises(vllm_worker.BadRequest,
                       match=r"cases\[0\] \(vLLM's auto choice 'amx'\).*needs amx_tile"):
        vllm_worker.run(vllm_worker.normalize(request))
    assert events == ["import_kernels"]


def test_isa_cases_cover_what_each_kernel_takes():
    cases = isa_cases(["vec", "amx"])
    assert [(c["isa"], str(c["query"].dtype), c["mode"]) for c in cases] == [
        ("vec", "torch.float32", "decode"), ("vec", "torch.float32", "prefill"),
        ("vec", "torch.bfloat16", "decode"), ("vec", "torch.bfloat16", "prefill"),
        ("amx", "torch.bfloat16", "decode"), ("amx", "torch.bfloat16", "prefill")]
    assert all(c["block_size"] == ISA_BLOCK_SIZE for c in cases)
    with pytest.raises(ValueError, match="isa must be 'auto' or one of"):
        attention_case("decode", 32, isa="avx2")


def test_good_session_request_passes_the_checks():
    req = vllm_worker.normalize({"kind": "session", "requests": [
        {"kind": "attention_op", "inputs": "a.pt", "outputs": "b.pt"},
        {"model": "m", "batches": [[[1, 2]], [[3]]], "batch_max_tokens": [4, 2]},
    ]})
    assert [r["kind"] for r in req["requests"]] == ["attention_op", "generate"]
    assert req["requests"][1]["batch_max_tokens"] == [4, 2]


@pytest.mark.parametrize("change, words", [
    (lambda c: c.pop("scale"), "lacks ['scale']"),
    (lambda c: c.update(scale=0.0), "scale must be a positive number"),
    (lambda c: c.update(key=c["key"][:, :2]), "key, value [N, Hkv, D]"),
    (lambda c: c.update(value=c["value"].double(), key=c["key"].double()), "share one of"),
    (lambda c: c["slot_mapping"].__setitem__(0, c["num_blocks"] * c["block_size"]), "slot_mapping"),
    (lambda c: c["block_table"].__setitem__((0, 0), c["num_blocks"]), "outside the pool"),
    (lambda c: c.update(block_table=c["block_table"][:, :1]), "columns"),
    (lambda c: c.update(query_start_loc=c["query_start_loc"][:-1]), "query_start_loc"),
])
def test_bad_attention_case_is_named(change, words):
    """The worker rejects a bad case with a message naming it, before vLLM's C++ op sees it."""
    case = attention_case("decode", 32)
    vllm_worker._check_case(case, 0, torch)  # the good case passes
    change(case)
    with pytest.raises(vllm_worker.BadRequest, match=r"cases\[0\]") as info:
        vllm_worker._check_case(case, 0, torch)
    assert words in str(info.value)


def test_attention_case_writes_every_context_token_once():
    for mode, (seq_lens, query_lens) in MODES.items():
        case = attention_case(mode, 16)
        slots = case["slot_mapping"]
        assert (slots == -1).sum() == 2 and slots[slots >= 0].unique().numel() == sum(seq_lens)
        assert case["query"].shape[0] == sum(query_lens) == int(case["query_start_loc"][-1])
        # our two backends agree with each other on it, to fp32 rounding
        assert (our_attention(case, "torch") - our_attention(case, "triton")).abs().max() < FP32_TOL
