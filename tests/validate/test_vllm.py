"""Our forward pass against real vLLM (its own environment, driven by subprocess).

vLLM starts once per session: all eight prompts go to the worker in one request. The acceptance
rule is vLLM's own (check_logprobs_close): tokens equal until the first divergence, and there each
side's token is among the other's top-5 logprobs.
"""
from __future__ import annotations

import pytest

from radarlab.models.generate import greedy_generate
from radarlab.validate.compare import max_logprob_diff
from radarlab.validate.vllm import (
    LOGPROB_TOL,
    VLLMError,
    VLLMUnavailable,
    compare_with_vllm,
    greedy_request,
    run_vllm,
)

NEW_TOKENS = 64
TOP_K = 5


@pytest.fixture(scope="session")
def vllm_greedy(prompts):
    """vLLM's fp32 greedy continuations with top-5 logprobs, EOS ignored (one worker run)."""
    return run_vllm(greedy_request(prompts, NEW_TOKENS, TOP_K, "float32"))


@pytest.fixture(scope="session")
def our_greedy(model, prompts):
    return greedy_generate(model, prompts, NEW_TOKENS, eos_token_id=None)


@pytest.fixture(scope="session")
def comparison(model, prompts, vllm_greedy, our_greedy):
    """Per prompt vLLM's rule applied once, plus our teacher-forced top-5 logprobs."""
    return compare_with_vllm(model, prompts, vllm_greedy, our_greedy, k=TOP_K, with_logprobs=True)


@pytest.mark.vllm
def test_greedy_matches_vllm_fp32(prompts, vllm_greedy, comparison):
    assert vllm_greedy["request"]["dtype"] == "float32"
    assert all(len(o["token_ids"]) == NEW_TOKENS for o in vllm_greedy["outputs"])
    assert all(len(o["logprobs"]) == NEW_TOKENS for o in vllm_greedy["outputs"])
    results, _ = comparison
    print(f"\nvLLM {vllm_greedy['vllm_version']} ({vllm_greedy['device']}), init "
          f"{vllm_greedy['init_s']:.1f} s, generate {vllm_greedy['generate_s']:.1f} s; "
          f"matched prefix per prompt {[r.matched for r in results]} of {NEW_TOKENS}")
    for i, r in enumerate(results):
        if not r.identical:
            print(f"  prompt {i}: {r.reason}")
    failed = [(i, r.reason) for i, r in enumerate(results) if not r.passed]
    assert not failed, failed


@pytest.mark.vllm
def test_logprobs_close_to_vllm_fp32(vllm_greedy, comparison):
    """Where both runs saw the same context, the fp32 logprobs themselves agree closely."""
    results, ours = comparison
    worst = max(max_logprob_diff(mine, v["logprobs"], r.matched)
                for mine, v, r in zip(ours, vllm_greedy["outputs"], results))
    print(f"\nmax |our logprob - vLLM logprob| over matched positions: {worst:.2e}")
    assert worst < LOGPROB_TOL


@pytest.mark.vllm
def test_metrics_come_back(vllm_greedy, prompts):
    m = vllm_greedy["metrics"]
    assert m["vllm:generation_tokens"] == NEW_TOKENS * len(prompts)
    assert m["vllm:prompt_tokens"] == sum(len(p) for p in prompts)


@pytest.mark.vllm
def test_worker_failure_is_a_clear_error(tmp_path):
    """A directory with no model in it: vLLM fails, and the error carries its stderr tail."""
    with pytest.raises(VLLMError) as info:
        run_vllm({"model": str(tmp_path), "prompts": [[1, 2, 3]], "max_tokens": 2}, timeout=600)
    msg = str(info.value)
    assert "vLLM worker failed (exit status 1)" in msg
    assert "Invalid repository ID or local directory" in msg  # vLLM's own words reach the caller
    assert "worker stderr (tail)" in msg and "Traceback" in msg


@pytest.mark.parametrize("request_, words", [
    ({"prompts": []}, "prompts"),
    ({"prompts": [[1, -2]]}, "prompts[0]"),
    ({"prompts": [[1]], "max_tokens": 0}, "max_tokens"),
    ({"prompts": [[1]], "dtype": "float64"}, "dtype"),
    ({"prompts": [[1]], "kv_cache_dtype": "int3"}, "kv_cache_dtype"),
    ({"prompts": [[1]], "batches": [[[1]]]}, "exactly one of prompts"),
    ({"prompts": [[1]], "colour": "blue"}, "unknown request fields"),
    ({"prompts": [[1] * 2000], "max_tokens": 64}, "max_model_len"),
    ({"prompts": [[1]], "enforce_eager": "yes"}, "enforce_eager must be true or false"),
])
def test_bad_request_fails_before_starting_vllm(request_, words):
    """Checked in this process, so it needs no vLLM environment and costs no start-up."""
    with pytest.raises(ValueError, match="bad vLLM request") as info:
        run_vllm({"model": "/nowhere", **request_}, python="/nonexistent/python")
    assert words in str(info.value)


def test_missing_environment_says_how_to_install():
    with pytest.raises(VLLMUnavailable, match="make vllm"):
        run_vllm({"model": "/nowhere", "prompts": [[1]]}, python="/nonexistent/python")
