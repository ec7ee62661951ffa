"""Checker of notebook 10 (capstone): one GPU's share of a tensor- and pipeline-parallel deployment."""
from __future__ import annotations

from dataclasses import astuple

from radarlab.checks.common import call_learner, verdict

FIELDS = ("kv_heads_per_gpu", "layers_per_gpu", "kv_bytes_per_stream_per_gpu", "weight_bytes_per_gpu",
          "kv_budget_bytes_per_gpu", "streams")

# What a plausible wrong answer gets wrong, said in plain words, by the field where it first shows.
HINTS = {
    "kv_heads_per_gpu": "tensor parallelism splits the KV heads, kv_heads // tp, and never below one: with "
                        "more GPUs than KV heads, vLLM replicates a head on several GPUs",
    "layers_per_gpu": "pipeline parallelism splits the layers, and the largest stage counts: "
                      "cdiv(layers, pp)",
    "kv_bytes_per_stream_per_gpu": "one GPU's KV of a stream: its layers x its KV heads, at the "
                                   "stream's tokens",
    "weight_bytes_per_gpu": "the weights split across tp x pp GPUs; the embedding and LM head sit on "
                            "the first and last stage, split by tp",
    "kv_budget_bytes_per_gpu": "usable memory is gpu_bytes x gpu_memory_utilization, minus this GPU's "
                               "weights",
    "streams": "every GPU holds its share of every stream: the streams of the deployment are one GPU's "
               "budget over one GPU's share of a stream (0 when the weights do not fit)",
}


def check_parallel_footprint(parallel_footprint) -> bool:
    """Check a learner's parallel_footprint(shape, tokens, kv_dtype, tp, pp, weight_bytes, gpu_bytes,
    gpu_memory_utilization, embedding_bytes) against radarlab.kvcache.memory.parallel_footprint, on the
    article's 70B model (its stored config), where heads replicate and stages are uneven."""
    from radarlab.kvcache import memory
    from radarlab.kvcache.model_config import stored_config

    config = stored_config("llama-3.1-70b")
    shape, tokens, gpu = memory.shape_from_hf_config(config), 32768, 80 * 10**9
    weights = 2 * memory.llama_parameters(config)  # 16-bit
    embedding = 2 * 2 * config["vocab_size"] * config["hidden_size"]  # embedding and LM head, 16-bit
    cases = [  # (description, kv_dtype, tp, pp, utilization), all on GPUs of 80 GB at 32,768 tokens
        ("the 70B model on 4 GPUs of 80 GB, tp=4, FP16, 32,768 tokens", "fp16", 4, 1, 0.9),
        ("the 70B model on 8 GPUs of 80 GB, tp=8, FP8", "fp8", 8, 1, 0.9),
        ("the 70B model on 16 GPUs of 80 GB, tp=16 (more GPUs than its 8 KV heads)", "fp16", 16, 1, 0.9),
        ("the 70B model on 2 x 3 GPUs of 80 GB, tp=2, pp=3 (80 layers in 3 stages)", "fp16", 2, 3, 0.9),
        ("the 70B model on one 80 GB GPU (the weights do not fit)", "fp16", 1, 1, 0.9),
        ("the 70B model on 8 GPUs of 80 GB, tp=8, utilization 0.5", "fp16", 8, 1, 0.5),
    ]
    for description, kv_dtype, tp, pp, util in cases:
        args = (shape, tokens, kv_dtype, tp, pp, weights, gpu, util, embedding)
        want = memory.parallel_footprint(*args)
        got, problem = call_learner(lambda: parallel_footprint(*args), description)
        if problem:
            return verdict("parallel_footprint", problem)
        if not isinstance(got, memory.ParallelFootprint):
            kind = type(got).__name__
            return verdict("parallel_footprint",
                           f"for {description} it returned a {kind}, not a ParallelFootprint")
        for name in FIELDS:
            g, w = getattr(got, name), getattr(want, name)
            if g != w:
                return verdict("parallel_footprint", f"for {description} {name} is {g:,}, expected {w:,}: "
                                                     f"{HINTS[name]}")
        if astuple(got)[:2] != (tp, pp):
            return verdict("parallel_footprint", f"for {description} it records tp, pp = {astuple(got)[:2]}, "
                                                 f"expected {(tp, pp)}")
    return verdict("parallel_footprint", None)
