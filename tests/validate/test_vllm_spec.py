"""Speculative decoding against real vLLM (fp32, greedy): the n-gram proposer (k=5, min 2, max 4) and
draft_model (the course model drafting for itself, k=4) and eagle (the trained head, k=4), on the code-copy
prompt at batch 1 and a mixed batch of four. Output tokens must be identical, and drafts, accepted tokens and
accepted tokens per position equal to vLLM's counters."""
from __future__ import annotations

import pytest

from radarlab.validate import vllm_spec

MAX_TOKENS = 48


@pytest.mark.vllm
def test_spec_rows_match_vllm(model, tokenizer):
    rows = vllm_spec.rows(model, tokenizer, max_tokens=MAX_TOKENS)
    for r in rows:
        print(f"\n{r.check}: {r.measured}")
    assert len(rows) == 12  # 3 methods x 2 prompt sets x (tokens, counters)
    counts = [r for r in rows if "drafts" in r.check]
    assert all(r.details["ours"]["num_drafts"] > 0 for r in counts)  # speculation really ran
    failed = [(r.check, r.measured) for r in rows if not r.passed]
    assert not failed, failed
