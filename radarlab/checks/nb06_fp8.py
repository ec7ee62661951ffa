"""Checkers of notebook 06 (FP8 KV cache): E4M3 decode and encode, per-token-head scales."""
from __future__ import annotations

from radarlab.checks.common import call_learner, verdict


def _e4m3_bits(code: int) -> str:
    return f"{code >> 7} {code >> 3 & 15:04b} {code & 7:03b}"


def check_decode_e4m3(decode_e4m3) -> bool:
    """Check a learner's decode_e4m3(code) -> float against radarlab.quant.fp8.decode_code on all 256
    codes of E4M3fn, starting with the ones a learner can work by hand."""
    import math

    from radarlab.quant.fp8 import decode_code

    name = "decode_e4m3"
    first = [0x38, 0x40, 0xB8, 0x3C, 0x08, 0x01, 0x07, 0x00, 0x7E, 0x78, 0x7F, 0xFF]
    for code in first + [c for c in range(256) if c not in first]:
        want = decode_code(code, "e4m3")
        described = f"code 0x{code:02X} (bits {_e4m3_bits(code)})"
        got, problem = call_learner(lambda: decode_e4m3(code), described)
        if problem:
            return verdict(name, problem)
        if isinstance(got, bool) or not isinstance(got, (int, float)):
            return verdict(name, f"for {described} it returned {got!r}; expected a float")
        got = float(got)
        if math.isnan(want) and math.isnan(got) or got == want:
            continue
        sign, exp, man = -1.0 if code >> 7 else 1.0, code >> 3 & 15, code & 7
        if math.isnan(want):
            hint = " (S.1111.111 is E4M3fn's only NaN: there is no infinity)"
        elif exp == 15 and (math.isinf(got) or math.isnan(got)):
            hint = (" (E4M3fn, 'fn' for finite, has no infinity: exponent 15 holds normal numbers up to "
                    "448; only mantissa 111 there is NaN)")
        elif exp == 0 and got == sign * (1 + man / 8) * 2.0 ** -7:
            hint = " (exponent 0 is subnormal: no implicit leading 1, value = (m/8) x 2^(1 - 7))"
        elif exp == 0 and got == sign * man / 8 * 2.0 ** -7:
            hint = " (subnormals use the exponent 1 - bias = -6, the same as exponent field 1)"
        elif got == -want:
            hint = " (bit 7 is the sign)"
        elif want and got in (2 * want, want / 2):
            hint = " (the exponent bias of E4M3 is 7)"
        else:
            hint = " (value = (-1)^s x (1 + m/8) x 2^(e - 7) for e > 0)"
        return verdict(name, f"{described} decoded to {got!r}, expected {want!r}{hint}")
    return verdict(name, None)


def check_encode_e4m3(encode_e4m3) -> bool:
    """Check a learner's encode_e4m3(x, rounding) -> uint8 codes against radarlab.quant.fp8.encode:
    round to nearest even ("rne") or toward zero ("rtz"), saturation at +-448, NaN kept as NaN."""
    import math

    import torch

    from radarlab.quant.fp8 import decode, encode

    name = "encode_e4m3"
    nan, inf = float("nan"), float("inf")
    sets = [
        ("exact codes", [1.0, 2.0, -0.5, 448.0, 2.0**-9, 0.0]),
        ("values between codes", [1.1, 1.05, -1.1, 300.0, -0.3, 0.01]),
        ("ties, exactly half-way between two codes",
         [1.0625, 1.1875, -1.0625, 3 * 2.0**-10, 2.0**-10, 432.0]),
        ("values beyond the range", [449.0, 500.0, 1e6, inf, -1e6, -inf]),
        ("NaN", [nan, 1.0]),
        ("values too small for any code but zero", [2.0**-11, 1e-6, -1e-6]),
    ]
    gen = torch.Generator().manual_seed(6)
    randoms = ("random K-like values, shape (4, 3, 64)", torch.randn(4, 3, 64, generator=gen) * 40)
    for rounding in ("rne", "rtz"):
        for description, values in [(d, torch.tensor(v)) for d, v in sets] + [randoms]:
            described = f"{description}, rounding={rounding!r}"
            want = encode(values, "e4m3", rounding)
            got, problem = call_learner(lambda: encode_e4m3(values.clone(), rounding), f"{described}: "
                                                                                       f"x={values}")
            if problem:
                return verdict(name, problem)
            if not isinstance(got, torch.Tensor) or got.dtype != torch.uint8 or got.shape != values.shape:
                kind = f"a {got.dtype} tensor of shape {tuple(got.shape)}" if isinstance(got, torch.Tensor) \
                    else repr(got)
                return verdict(name, f"for {described} it returned {kind}; expected uint8 codes of shape "
                                     f"{tuple(values.shape)}")
            both_nan = torch.isnan(decode(got)) & torch.isnan(decode(want))
            bad = (got != want) & ~both_nan
            if not bad.any():
                continue
            i = tuple(int(j) for j in bad.nonzero()[0])
            x, g, w = float(values[i]), int(got[i]), int(want[i])
            gv, wv = float(decode(got[i].reshape(1))), float(decode(want[i].reshape(1)))
            other = "rtz" if rounding == "rne" else "rne"
            if math.isnan(x):
                hint = " (a NaN stays NaN, code 0x7F, so a broken activation stays visible)"
            elif abs(x) > 448 and math.isnan(gv):
                hint = " (beyond 448 saturate to +-448, codes 0x7E / 0xFE: 0x7F is NaN)"
            elif abs(x) > 448:
                hint = " (beyond 448 saturate to +-448, codes 0x7E / 0xFE)"
            elif rounding == "rtz" and x < 0 and gv < x:
                hint = " (toward zero for negatives too: down in magnitude, not down the number line)"
            elif g == int(encode(values[i].reshape(1), "e4m3", other)):
                hint = (" (that is rounding toward zero, what vLLM's CPU kernels do; rne picks the nearer "
                        "code)"
                        if rounding == "rne" else " (that is rounding to nearest; rtz keeps the code nearer "
                                                  "zero)")
            elif rounding == "rne" and abs(abs(x) - abs(gv)) == abs(abs(x) - abs(wv)):
                hint = " (a tie goes to the even code, the one whose mantissa ends in 0)"
            else:
                hint = ""
            return verdict(name, f"for {described}, x={x!r} gave code 0x{g:02X} ({gv!r}), expected 0x{w:02X} "
                                 f"({wv!r}){hint}")
    return verdict(name, None)


def check_per_token_head_scale(per_token_head_scale) -> bool:
    """Check a learner's per_token_head_scale(x) -> [T, H] against radarlab.quant.fp8.dynamic_scale
    for E4M3: each head vector's amax over head_dim divided by 448, and 1 for an all-zero vector."""
    import torch

    from radarlab.quant.fp8 import dynamic_scale, max_finite

    name = "per_token_head_scale"
    gen = torch.Generator().manual_seed(60)
    zeros = torch.randn(3, 2, 8, generator=gen)
    zeros[1, 0] = 0.0
    cases = [
        ("one token, one head, x=[[[1, -2, 0.5]]]", torch.tensor([[[1.0, -2.0, 0.5]]])),
        ("two tokens, two heads, x[t, h] = [t + h + 1, -(t + h + 1) / 2]",
         torch.tensor([[[1.0, -0.5], [2.0, -1.0]], [[2.0, -1.0], [3.0, -1.5]]])),
        ("x of shape (3, 2, 8) where token 1, head 0 is all zeros", zeros),
        ("random K-like x of shape (5, 3, 64), amax in the hundreds",
         torch.randn(5, 3, 64, generator=gen) * 60),
    ]
    top = max_finite("e4m3")
    for description, x in cases:
        want = dynamic_scale(x, "e4m3")
        got, problem = call_learner(lambda: per_token_head_scale(x.clone()), description)
        if problem:
            return verdict(name, problem)
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != tuple(want.shape):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            hint = " (one scale per token and head: the amax over head_dim, the last axis, only)"
            return verdict(name, f"for {description} it returned shape {shape}, expected "
                                 f"{tuple(want.shape)}{hint}")
        g = got.detach().float()
        if torch.allclose(g, want, rtol=1e-5, atol=0):
            continue
        i = tuple(int(j) for j in (~torch.isclose(g, want, rtol=1e-5, atol=0)).nonzero()[0])
        amax = float(x[i].abs().max())
        if amax == 0:
            hint = " (an all-zero vector gets scale 1: a scale of 0 would make x / scale NaN)"
        elif abs(float(g[i]) - amax) <= 1e-6 * amax:
            hint = f" (divide the amax by the largest E4M3 value, {top:g}, so it lands on the top code)"
        else:
            hint = f" (scale = max |x| over head_dim / {top:g})"
        return verdict(name, f"for {description}, the scale of token {i[0]}, head {i[1]} was "
                             f"{float(g[i]):.6g}, expected {float(want[i]):.6g}{hint}")
    return verdict(name, None)
