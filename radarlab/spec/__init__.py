"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler, and its theory."""
