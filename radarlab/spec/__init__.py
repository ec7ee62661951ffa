"""Speculative decoding: proposers (n-gram, draft model), the rejection sampler, and its theory.

The engine takes it through Engine(..., speculative_config={...}) (speculative_config.py). A new
kind of draft plugs in through the interface in proposer.py.
"""
