"""Exercise checkers. Each runs a learner's function on cases with known answers and prints one line:
a pass, or the first counterexample in plain words. They return True or False so tests can use them.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable


def verdict(exercise: str, counterexample: str | None) -> bool:
    """Print the one-line result of a checker."""
    if counterexample is None:
        print(f"PASS {exercise}")
        return True
    print(f"FAIL {exercise}: {counterexample}")
    return False


def first_counterexample(cases: Iterable[tuple[str, Callable[[], object], object]],
                         close: Callable[[object, object], bool] | None = None) -> str | None:
    """Run (description, thunk, expected) cases; describe the first whose result differs."""
    same = close or (lambda a, b: a == b)
    for description, thunk, expected in cases:
        try:
            got = thunk()
        except NotImplementedError:
            return "the function is not written yet (it raises NotImplementedError)"
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return f"for {description} it raised {type(err).__name__}: {err}"
        if not same(got, expected):
            return f"for {description} it returned {got!r}, expected {expected!r}"
    return None


# --- notebook 00: rms_norm ---------------------------------------------------------------------

def _first_tensor_difference(got, want, atol: float, rtol: float) -> str | None:
    """Describe how a returned tensor differs from the expected one (type, shape, dtype, then values)."""
    import torch

    if not isinstance(got, torch.Tensor):
        return f"a {type(got).__name__}, not a tensor"
    if tuple(got.shape) != tuple(want.shape):
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if got.dtype != want.dtype:
        return f"dtype {got.dtype}, expected {want.dtype} (the input's dtype)"
    g, w = got.detach().float().cpu(), want.float()
    bad = ~torch.isclose(g, w, atol=atol, rtol=rtol)
    if not bad.any():
        return None
    idx = tuple(int(i) for i in bad.nonzero()[0])
    return f"{g[idx].item():.6g} at index {idx}, expected {w[idx].item():.6g}"


def check_rms_norm(rms_norm) -> bool:
    """Check a learner's rms_norm(x, weight, eps) against the course model's RMSNorm.

    The cases start small enough to work by hand, then cover what trips people up: the weight, the
    eps inside the square root, a row of zeros, more than two dimensions, and bf16 inputs (the
    mean must be taken in fp32 and the result returned in the input's dtype)."""
    import torch

    from radarlab.models.llama import RMSNorm

    gen = torch.Generator().manual_seed(0)
    ones4 = torch.ones(4)
    cases = [
        ("x=[[1, 2, 3, 4]], weight all ones, eps=0", torch.tensor([[1.0, 2.0, 3.0, 4.0]]), ones4, 0.0),
        ("x=[[1, 2, 3, 4]], weight=[2, 0.5, 1, -1], eps=0",
         torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([2.0, 0.5, 1.0, -1.0]), 0.0),
        ("x=[[1, 1, 1, 1]], weight all ones, eps=1 (eps goes inside the square root)",
         torch.ones(1, 4), ones4, 1.0),
        ("a row of zeros, eps=1e-6 (the answer is zeros, not NaN)", torch.zeros(2, 4), ones4, 1e-6),
        ("random x of shape (3, 576) and random weight, eps=1e-5",
         torch.randn(3, 576, generator=gen), torch.randn(576, generator=gen), 1e-5),
        ("random x of shape (2, 3, 8) (normalize over the last dimension only), eps=1e-5",
         torch.randn(2, 3, 8, generator=gen), torch.randn(8, generator=gen), 1e-5),
        ("random bfloat16 x of shape (2, 64) times 100 and bfloat16 weight, eps=1e-5",
         (torch.randn(2, 64, generator=gen) * 100).bfloat16(), torch.randn(64, generator=gen).bfloat16(), 1e-5),
    ]
    for description, x, weight, eps in cases:
        ref = RMSNorm(x.shape[-1], eps).to(weight.dtype)
        with torch.no_grad():
            ref.weight.copy_(weight)
            want = ref(x)
        loose = x.dtype == torch.bfloat16
        x_in, w_in = x.clone(), weight.clone()
        try:
            got = rms_norm(x_in, w_in, eps)
        except NotImplementedError:
            return verdict("rms_norm", "the function is not written yet (it raises NotImplementedError)")
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return verdict("rms_norm", f"for {description} it raised {type(err).__name__}: {err}")
        if not (torch.equal(x_in, x) and torch.equal(w_in, weight)):
            return verdict("rms_norm", f"for {description} it changed its input in place; return a new tensor")
        problem = _first_tensor_difference(got, want, atol=1e-2 if loose else 1e-5, rtol=1e-2 if loose else 1e-5)
        if problem:
            return verdict("rms_norm", f"for {description} it returned {problem}")
    return verdict("rms_norm", None)


# --- notebook 01: KV-cache arithmetic -------------------------------------------------------------

def check_kv_bytes_per_token(kv_bytes_per_token) -> bool:
    """Check a learner's kv_bytes_per_token(layers, kv_heads, head_dim, bytes_per_value) against the
    calculator in radarlab.kvcache.memory, starting from the article's 80-layer model."""
    import math

    from radarlab.kvcache.memory import kv_values_per_token

    cases = [  # (description, layers, kv_heads, head_dim, bytes_per_value)
        ("the article's model in FP16: 80 layers, 8 KV heads, head dim 128, 2 bytes per value", 80, 8, 128, 2),
        ("the same model in FP8 (1 byte per value)", 80, 8, 128, 1),
        ("the same model in INT4 without scales (0.5 bytes per value)", 80, 8, 128, 0.5),
        ("the course model in fp32: 30 layers, 3 KV heads, head dim 64, 4 bytes per value", 30, 3, 64, 4),
        ("1 layer, 1 KV head, head dim 1, 2 bytes per value", 1, 1, 1, 2),
    ]
    for description, layers, kv_heads, head_dim, per_value in cases:
        want = kv_values_per_token(layers, kv_heads, head_dim) * per_value
        try:
            got = kv_bytes_per_token(layers, kv_heads, head_dim, per_value)
        except NotImplementedError:
            return verdict("kv_bytes_per_token", "the function is not written yet (it raises NotImplementedError)")
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return verdict("kv_bytes_per_token", f"for {description} it raised {type(err).__name__}: {err}")
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want):
            hint = " (count both K and V: each layer stores a key and a value per KV head)" \
                if isinstance(got, (int, float)) and math.isclose(2 * got, want) else ""
            return verdict("kv_bytes_per_token", f"for {description} it returned {got!r}, expected {want:g}{hint}")
    return verdict("kv_bytes_per_token", None)


def check_max_streams(max_streams) -> bool:
    """Check a learner's max_streams(gpu_mem_gb, weights_gb, gb_per_stream): whole streams whose KV
    fits beside the weights, and 0 (not a negative number) when the weights alone overflow the GPU."""
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
        try:
            got = max_streams(gpu, weights, per)
        except NotImplementedError:
            return verdict("max_streams", "the function is not written yet (it raises NotImplementedError)")
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return verdict("max_streams", f"for {description} it raised {type(err).__name__}: {err}")
        if got != want or isinstance(got, bool):
            if isinstance(got, (int, float)) and got < 0:
                hint = " (when the weights do not fit, no stream fits: return 0)"
            elif isinstance(got, float) and got != int(got):
                hint = " (a stream needs its whole context: round down to a whole number)"
            elif isinstance(got, (int, float)) and got > want:
                hint = " (round down: a part of a stream cannot be served)"
            else:
                hint = ""
            return verdict("max_streams", f"for {description} it returned {got!r}, expected {want}{hint}")
    return verdict("max_streams", None)
