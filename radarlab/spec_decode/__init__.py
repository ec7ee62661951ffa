"""Speculative decoding's proposers (n-gram, draft model, EAGLE head), vLLM's speculative_config
keys, the acceptance metrics and the theory (vllm/v1/spec_decode/). Verification itself is the
rejection sampler in radarlab.sample; training and evaluating the draft head are in radarlab.lab.
"""
