"""Checkers of notebook 01 (KV-cache arithmetic): bytes per token and streams that fit."""
from __future__ import annotations

from radarlab.checks.common import call_learner, verdict


def check_kv_bytes_per_token(kv_bytes_per_token) -> bool:
    """Check a learner's kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_value) against the
    calculator in radarlab.kvcache.memory, starting from the article's 80-layer model."""
    import math

    from radarlab.kvcache.memory import kv_values_per_token

    cases = [  # (description, layers, kv_heads, head_dim, bytes_per_value)
        ("the article's model in FP16: 80 layers, 8 KV heads, head dim 128, 2 bytes per value", 80, 8, 128,
         2),
        ("the same model in FP8 (1 byte per value)", 80, 8, 128, 1),
        ("the same model in INT4 without scales (0.5 bytes per value)", 80, 8, 128, 0.5),
        ("the course model in fp32: 30 layers, 3 KV heads, head dim 64, 4 bytes per value", 30, 3, 64, 4),
        ("1 layer, 1 KV head, head dim 1, 2 bytes per value", 1, 1, 1, 2),
    ]
    for description, layers, kv_heads, head_dim, per_value in cases:
        want = kv_values_per_token(layers, kv_heads, head_dim) * per_value
        got, problem = call_learner(lambda: kv_bytes_per_token(layers, kv_heads, head_dim, per_value),
                                    description)
        if problem:
            return verdict("kv_bytes_per_token", problem)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want):
            hints = {want / 2: " (count both K and V: each layer stores a key and a value per KV head)",
                     want / layers: " (sum over all the layers: every layer keeps its own keys and values)",
                     want * 8: " (that is bits: bytes_per_value is already in bytes, do not multiply by 8)"}
            hint = next((h for v, h in hints.items() if isinstance(got, (int, float))
                         and not isinstance(got, bool) and v != want and math.isclose(got, v)), "")
            return verdict("kv_bytes_per_token", f"for {description} it returned {got!r}, expected "
                                                 f"{want:g}{hint}")
    return verdict("kv_bytes_per_token", None)


def check_max_streams(max_streams) -> bool:
    """Check a learner's max_streams(gpu_mem_gb, weights_gb, gb_per_stream): whole streams whose KV
    fits beside the weights, and 0 (not a negative number) when the weights alone overflow the GPU."""
    import math

    from radarlab.kvcache.memory import kv_gb_per_stream, max_concurrent_streams

    fp16 = kv_gb_per_stream(80, 8, 128, 32768, "fp16")
    int4 = kv_gb_per_stream(80, 8, 128, 32768, "int4", 128)
    cases = [  # (description, gpu, weights, per stream)
        (f"48 GB, no weights, {fp16:.4f} GB per stream (the article's FP16 row)", 48.0, 0.0, fp16),
        (f"48 GB, 35 GB of 4-bit 70B weights, {int4:.4f} GB per stream (INT4 with scales)", 48.0, 35.0, int4),
        ("50 GB, 2 GB of weights, exactly 12 GB per stream", 50.0, 2.0, 12.0),
        ("48 GB, 140 GB of fp16 70B weights, 1 GB per stream", 48.0, 140.0, 1.0),
        ("80 GB, 80 GB of weights, 1 GB per stream", 80.0, 80.0, 1.0),
    ]
    for description, gpu, weights, per in cases:
        want = max_concurrent_streams(gpu, weights, per)
        got, problem = call_learner(lambda: max_streams(gpu, weights, per), description)
        if problem:
            return verdict("max_streams", problem)
        if got != want or isinstance(got, bool):
            number = isinstance(got, (int, float)) and not isinstance(got, bool)
            if number and got < 0:
                hint = " (when the weights do not fit, no stream fits: return 0)"
            elif number and weights >= gpu:
                hint = " (the weights alone fill the GPU: no memory is left for KV, so return 0)"
            elif isinstance(got, float) and got != int(got):
                hint = " (a stream needs its whole context: round down to a whole number)"
            elif number and weights > 0 and got == math.floor(gpu / per):
                hint = " (the weights come first: streams share gpu_mem_gb - weights_gb, not the whole GPU)"
            elif number and got > want:
                hint = " (round down: a part of a stream cannot be served)"
            elif number and got == want - 1 and (gpu - weights) / per == want:
                hint = " (a stream that exactly fills the memory left still fits)"
            else:
                hint = ""
            return verdict("max_streams", f"for {description} it returned {got!r}, expected {want}{hint}")
    return verdict("max_streams", None)
