"""Checkers of notebook 07 (INT4 KV cache): nibble packing, group-wise quantization, bytes per token."""
from __future__ import annotations

from radarlab.checks.common import call_learner, first_tensor_difference, verdict

# pack_nibbles, quantize_group (asymmetric, group-wise) and int4_bytes_per_token.

def check_pack_nibbles(pack_nibbles) -> bool:
    """Check a learner's pack_nibbles(codes) against radarlab.quant.int4.pack: uint8 codes 0..15 with an
    even last axis become bytes, code 2i in the low nibble and code 2i + 1 in the high one."""
    import torch

    from radarlab.quant.int4 import pack

    name = "pack_nibbles"
    gen = torch.Generator().manual_seed(7)
    cases = [  # (description, codes)
        ("codes [1, 2] (one byte: 2 in the high nibble, 1 in the low one)",
         torch.tensor([1, 2], dtype=torch.uint8)),
        ("codes [15, 0]", torch.tensor([15, 0], dtype=torch.uint8)),
        ("codes [0, 15, 8, 8]", torch.tensor([0, 15, 8, 8], dtype=torch.uint8)),
        ("random codes of shape (3, 8, 64) (pack along the last axis only)",
         torch.randint(0, 16, (3, 8, 64), generator=gen, dtype=torch.uint8)),
    ]
    for description, codes in cases:
        want = pack(codes)
        got, problem = call_learner(lambda: pack_nibbles(codes.clone()), description)
        if problem:
            return verdict(name, problem)
        swapped = codes[..., 1::2] | (codes[..., 0::2] << 4)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and torch.equal(got, swapped) \
                and not torch.equal(swapped, want):
            return verdict(name, f"for {description} it returned {got.flatten()[:4].tolist()}, expected "
                                 f"{want.flatten()[:4].tolist()} (code 2i goes in the low nibble, 2i + 1 in "
                                 "the high one)")
        difference = first_tensor_difference(got, want, atol=0, rtol=0)
        if difference:
            layout = "dtype" in difference or "shape" in difference
            hint = " (the result is uint8, one byte per pair of codes)" if layout else ""
            return verdict(name, f"for {description} it returned {difference}{hint}")
    return verdict(name, None)


def reference_quantize_group(x, group_size: int):
    """radarlab's asymmetric INT4 group quantization (radarlab.quant.int4), in the exercise's form:
    (codes uint8 [..., n] unpacked, scales [..., n / g], zeros [..., n / g]) in float32. The scales and
    zeros are the ones the cache stores (fp16), so they differ from exact float32 ones by fp16 rounding."""
    from radarlab.quant.int4 import quantize, unpack

    packed, scales, zeros = quantize(x, group_size, symmetric=False)
    return unpack(packed), scales.float(), zeros.float()


def check_quantize_group(quantize_group) -> bool:
    """Check a learner's quantize_group(x, group_size) -> (codes, scales, zeros): asymmetric INT4 over
    groups of group_size consecutive values along the last axis, zero = the group's minimum, scale =
    (max - min) / 15, codes = round((x - zero) / scale) in 0..15. Accepted when the codes are uint8 in
    0..15, the scales and zeros match those rules (to fp16 precision), and every value comes back
    within half a step: |codes x scale + zero - x| <= scale / 2."""
    import torch

    name = "quantize_group"
    gen = torch.Generator().manual_seed(11)
    outlier = torch.randn(4, 64, generator=gen)
    outlier[:, 7] *= 20  # one large channel, as keys have
    cases = [  # (description, x, group_size)
        ("x = [0, 1, ..., 15], one group of 16 (scale 1, zero 0, codes 0..15)", torch.arange(16.0), 16),
        ("x = [-1, 1, 2, 5], groups of 2", torch.tensor([-1.0, 1.0, 2.0, 5.0]), 2),
        ("a group whose values are all equal: x = [3, 3, 3, 3, -2, 0, 1, 2], groups of 4 (no division by "
         "zero: every 3 must come back as 3)", torch.tensor([3.0, 3.0, 3.0, 3.0, -2.0, 0.0, 1.0, 2.0]), 4),
        ("random x of shape (2, 3, 64), groups of 32", torch.randn(2, 3, 64, generator=gen), 32),
        ("x of shape (4, 64) with one channel 20x larger, groups of 16", outlier, 16),
    ]
    for description, x, g in cases:
        got, problem = call_learner(lambda: quantize_group(x.clone(), g), description)
        if problem:
            return verdict(name, problem)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            return verdict(name, f"for {description} it returned {type(got).__name__}; expected (codes, "
                                 "scales, zeros)")
        codes, scales, zeros = got
        groups = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
        lo, hi = groups.amin(-1), groups.amax(-1)
        for label, t, shape in (("codes", codes, x.shape), ("scales", scales, lo.shape),
                                ("zeros", zeros, lo.shape)):
            if not isinstance(t, torch.Tensor):
                return verdict(name, f"for {description}, {label} is a {type(t).__name__}, not a tensor")
            if tuple(t.shape) != tuple(shape):
                return verdict(name, f"for {description}, {label} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(shape)}"
                                     + (" (one per group)" if label != "codes" else " (one code per value, "
                                                                                    "unpacked)"))
        if codes.dtype != torch.uint8:
            return verdict(name, f"for {description}, codes have dtype {codes.dtype}, expected torch.uint8")
        if int(codes.max()) > 15:
            return verdict(name,
                           f"for {description}, a code is {int(codes.max())}: 4 bits hold 0..15 (clamp)")
        s, z = scales.float(), zeros.float()
        if not bool(torch.isfinite(s).all() & torch.isfinite(z).all()) or bool((s < 0).any()):
            return verdict(name, f"for {description}, the scales {s.flatten()[:4].tolist()} or zeros "
                                 f"{z.flatten()[:4].tolist()} are not finite and >= 0")
        if not torch.allclose(z, lo, rtol=2e-3, atol=1e-6):
            i = int((~torch.isclose(z, lo, rtol=2e-3, atol=1e-6)).flatten().nonzero()[0])
            return verdict(name, f"for {description}, group {i}'s zero point is "
                                 f"{z.flatten()[i].item():.6g}, expected its "
                                 f"minimum {lo.flatten()[i].item():.6g} (asymmetric: code 0 stands for the "
                                 "minimum)")
        spread = hi > lo
        want_s = (hi - lo) / 15
        if not torch.allclose(s[spread], want_s[spread], rtol=2e-3, atol=0):
            i = int((spread & ~torch.isclose(s, want_s, rtol=2e-3, atol=0)).flatten().nonzero()[0])
            ratio = (s.flatten()[i] / want_s.flatten()[i]).item()
            hint = " (16 levels have 15 steps between them)" if abs(ratio - 15 / 16) < 1e-3 else \
                " (scale = (max - min) / 15)"
            return verdict(name, f"for {description}, group {i}'s scale is {s.flatten()[i].item():.6g}, "
                                 f"expected {want_s.flatten()[i].item():.6g}{hint}")
        back = (codes.float().reshape(groups.shape) * s[..., None] + z[..., None]).reshape(x.shape)
        err = (back - x).abs().reshape(groups.shape)
        allowed = s[..., None] / 2 * (1 + 1e-4) + 1e-6
        if bool((err > allowed).any()):
            idx = tuple(int(i) for i in (err > allowed).nonzero()[0])
            flat = tuple(idx[:-2]) + (idx[-2] * g + idx[-1],)
            return verdict(name, f"for {description}, x{list(flat)} = {x[flat].item():.6g} comes back as "
                                 f"{back[flat].item():.6g} (code {int(codes[flat])}), more than half a step "
                                 f"({s[idx[:-1]].item():.4g} / 2) away: round((x - zero) / scale), then "
                                 "clamp to 0..15")
    return verdict(name, None)


def reference_int4_bytes_per_token(layers, kv_heads, head_dim, group_size, symmetric, scale_bytes) -> int:
    """The exercise's answer from the calculator (radarlab.kvcache.memory, reading the table of formats)."""
    from radarlab.kvcache.memory import kv_bytes_per_token
    from radarlab.quant.formats import SCALE_BYTES

    scale_dtype = {b: name for name, b in SCALE_BYTES.items()}.get(scale_bytes)
    if scale_dtype is None:
        raise ValueError(f"scale_bytes must be one of {sorted(SCALE_BYTES.values())} (fp8 or fp16), got "
                         f"{scale_bytes!r}")
    name = (f"int4_g{group_size}_{'sym' if symmetric else 'asym'}"
            + ("_fp8scales" if scale_dtype == "fp8" else ""))
    return kv_bytes_per_token(layers, kv_heads, head_dim, name)


def check_int4_bytes_per_token(int4_bytes_per_token) -> bool:
    """Check a learner's int4_bytes_per_token(layers, kv_heads, head_dim, group_size, symmetric,
    scale_bytes) against the calculator (radarlab.kvcache.memory, reading radarlab.quant.formats): K and
    V of every layer and KV head, half a byte per value, plus per group a scale and, asymmetric, a zero
    point of scale_bytes bytes each."""
    import math

    from radarlab.kvcache.memory import kv_values_per_token

    name = "int4_bytes_per_token"
    cases = [  # (description, layers, kv_heads, head_dim, group, symmetric, scale_bytes)
        ("the article's model (80 layers, 8 KV heads, head dim 128), group 128, asymmetric, fp16 scales and "
         "zeros",
         80, 8, 128, 128, False, 2),
        ("the article's model, group 128, symmetric, fp16 scales", 80, 8, 128, 128, True, 2),
        ("the course model (30 layers, 3 KV heads, head dim 64), group 64, asymmetric, fp16", 30,
         3, 64, 64, False, 2),
        ("the course model, group 32, asymmetric, fp8 scales and zeros (1 byte each)", 30,
         3, 64, 32, False, 1),
        ("the course model, group 16, symmetric, fp16", 30, 3, 64, 16, True, 2),
    ]
    for description, layers, heads, d, g, sym, sb in cases:
        want = reference_int4_bytes_per_token(layers, heads, d, g, sym, sb)
        got, problem = call_learner(lambda: int4_bytes_per_token(layers, heads, d, g, sym, sb), description)
        if problem:
            return verdict(name, problem)
        if isinstance(got, bool) or not isinstance(got, (int, float)) or not math.isclose(got, want):
            values = kv_values_per_token(layers, heads, d)
            groups = values // g
            hints = {values / 2: " (that is the 4-bit codes alone: add the scales and zero points of every "
                                 "group)",
                     want / 2: " (count both K and V)",
                     values / 2 + groups * sb: " (an asymmetric group stores a zero point beside its scale)",
                     values / 2 + 2 * groups * sb: " (a symmetric group stores only a scale, no zero point)"}
            hint = next((h for v,
                         h in hints.items() if isinstance(got, (int, float)) and math.isclose(got, v)), "")
            return verdict(name, f"for {description} it returned {got!r}, expected {want}{hint}")
    return verdict(name, None)
