"""Our paged KV cache against real vLLM (radarlab.validate.vllm_paged).

One vLLM worker process serves the whole module: the attention-op cases (vLLM's CPU
cpu_attention_with_kv_cache on the same inputs as ours), then one fp32 engine with block_size=32 and
prefix caching on, generating for the validation prompts and the shared-prefix workload.
"""
from __future__ import annotations

import pytest
import torch

from radarlab.models.paged_runner import paged_greedy_generate
from radarlab.validate import vllm_worker
from radarlab.validate.vllm_paged import (
    BACKENDS, ENGINE_BLOCK_SIZE, FP32_TOL, MODES, attention_case, attention_cases, compare_attention,
    compare_greedy_outputs, op_tolerance, our_attention, our_prefix_run, prefix_workload, run_paged_session,
    vllm_prefix_counts,
)
from radarlab.validate.vllm import LOGPROB_TOL, run_vllm

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
def session(prompts, prefix_batches, cases):
    return run_paged_session(prompts, prefix_batches, cases, NEW_TOKENS, PREFIX_NEW_TOKENS, TOP_K)


@pytest.fixture(scope="module")
def our_prefix(model, prefix_batches):
    return our_prefix_run(model, prefix_batches, PREFIX_NEW_TOKENS, ENGINE_BLOCK_SIZE)


# --- 1. the attention op on identical inputs ----------------------------------------------------------
@pytest.mark.vllm
@pytest.mark.parametrize("backend", BACKENDS)
def test_attention_op_matches_vllm(session, cases, backend):
    results = compare_attention(cases, session.vllm_outputs, session.isas, backends=(backend,))
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
    ({"kind": "attention_op", "inputs": "a.pt", "outputs": "b.pt", "prompts": [[1]]}, "unknown request fields"),
    ({"kind": "paged"}, "kind must be one of"),
    ({"kind": "session", "requests": []}, "requests must be a non-empty list"),
    ({"kind": "session", "requests": [{"kind": "session", "requests": []}]}, "sessions do not nest"),
    ({"kind": "session", "requests": [{"model": M, "prompts": [[1]]}, {"model": M, "prompts": [[2]]}]},
     "at most one generate"),
    ({"kind": "session", "requests": [{"model": M, "prompts": [[1]], "max_tokens": 0}]}, "requests[0]: max_tokens"),
    ({"model": M, "batches": [[[1]], [[2]]], "batch_max_tokens": [4]}, "one entry per batch"),
    ({"model": M, "batches": [[[1]], [[1] * 2000]], "batch_max_tokens": [4, 100]}, "max_model_len"),
])
def test_bad_paged_request_fails_before_starting_vllm(request_, words):
    with pytest.raises(ValueError, match="bad vLLM request") as info:
        run_vllm(request_, python="/nonexistent/python")
    assert words in str(info.value)


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
