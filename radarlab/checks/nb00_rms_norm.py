"""Checkers of notebook 00 (welcome): rms_norm, the warm-up exercise."""
from __future__ import annotations

from radarlab.checks.common import call_learner, first_tensor_difference, verdict


def check_rms_norm(rms_norm) -> bool:
    """Check a learner's rms_norm(x, weight, eps) against the course model's RMSNorm.

    The cases start small enough to work by hand, then cover what trips people up: the weight, the
    eps inside the square root, a row of zeros, more than two dimensions, bf16 inputs (the result
    is returned in the input's dtype) and fp16 inputs whose squares overflow fp16 (the mean must be
    taken in fp32)."""
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
         (torch.randn(2, 64, generator=gen) * 100).bfloat16(),
         torch.randn(64, generator=gen).bfloat16(), 1e-5),
        ("random float16 x of shape (2, 64) times 300 and float16 weight, eps=1e-5 (the squares overflow "
         "float16, whose largest value is 65504: square and average in fp32)",
         (torch.randn(2, 64, generator=gen) * 300).half(), torch.randn(64, generator=gen).half(), 1e-5),
    ]
    for description, x, weight, eps in cases:
        ref = RMSNorm(x.shape[-1], eps).to(weight.dtype)
        with torch.no_grad():
            ref.weight.copy_(weight)
            want = ref(x)
        loose = x.dtype in (torch.bfloat16, torch.float16)
        x_in, w_in = x.clone(), weight.clone()
        got, problem = call_learner(lambda: rms_norm(x_in, w_in, eps), description)
        if problem:
            return verdict("rms_norm", problem)
        if not (torch.equal(x_in, x) and torch.equal(w_in, weight)):
            return verdict("rms_norm",
                           f"for {description} it changed its input in place; return a new tensor")
        problem = first_tensor_difference(got, want, atol=1e-2 if loose else 1e-5,
                                           rtol=1e-2 if loose else 1e-5)
        if problem:
            return verdict("rms_norm", f"for {description} it returned {problem}")
    return verdict("rms_norm", None)
