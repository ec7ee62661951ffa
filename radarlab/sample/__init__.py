"""Logits to tokens: SamplingParams, the sampler (greedy, temperature, top-k, top-p) and the
rejection sampler that verifies speculative drafts (vllm/v1/sample/)."""
