"""Checkers of notebook 07 (INT4 KV cache): nibble packing, group-wise quantization, bytes per token, and
the main exercise: KIVI's codec, the functions a KIVI cache takes (keys per channel, values per token,
both read back, and quantized_length)."""
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


def _call_quantizer(fn, x, g: int, description: str):
    """A learner's quantizer on a copy of x: ((codes, scales, zeros), None), or (None, the problem)."""
    got, problem = call_learner(lambda: fn(x.clone(), g), description)
    if problem is None and (not isinstance(got, (tuple, list)) or len(got) != 3):
        problem = f"for {description} it returned {type(got).__name__}; expected (codes, scales, zeros)"
    return got, problem


def _group_problem(description: str, x, g: int, codes, scales, zeros) -> str | None:
    """What is wrong with asymmetric INT4 codes, scales and zeros of x [..., n] in groups of g along the
    last axis (shapes already checked), in plain words: dtype and range of the codes, zero = minimum,
    scale = (max - min) / 15 to fp16 precision, every value back within half a step. None: right."""
    import torch

    groups = x.reshape(*x.shape[:-1], x.shape[-1] // g, g)
    lo, hi = groups.amin(-1), groups.amax(-1)
    if codes.dtype != torch.uint8:
        return f"for {description}, codes have dtype {codes.dtype}, expected torch.uint8"
    if int(codes.max()) > 15:
        return f"for {description}, a code is {int(codes.max())}: 4 bits hold 0..15 (clamp)"
    s, z = scales.float(), zeros.float()
    if not bool(torch.isfinite(s).all() & torch.isfinite(z).all()) or bool((s < 0).any()):
        return (f"for {description}, the scales {s.flatten()[:4].tolist()} or zeros "
                f"{z.flatten()[:4].tolist()} are not finite and >= 0")
    if not torch.allclose(z, lo, rtol=2e-3, atol=1e-6):
        i = int((~torch.isclose(z, lo, rtol=2e-3, atol=1e-6)).flatten().nonzero()[0])
        return (f"for {description}, group {i}'s zero point is "
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
        return (f"for {description}, group {i}'s scale is {s.flatten()[i].item():.6g}, "
                f"expected {want_s.flatten()[i].item():.6g}{hint}")
    back = (codes.float().reshape(groups.shape) * s[..., None] + z[..., None]).reshape(x.shape)
    err = (back - x).abs().reshape(groups.shape)
    allowed = s[..., None] / 2 * (1 + 1e-4) + 1e-6
    if bool((err > allowed).any()):
        idx = tuple(int(i) for i in (err > allowed).nonzero()[0])
        flat = tuple(idx[:-2]) + (idx[-2] * g + idx[-1],)
        return (f"for {description}, x{list(flat)} = {x[flat].item():.6g} comes back as "
                f"{back[flat].item():.6g} (code {int(codes[flat])}), more than half a step "
                f"({s[idx[:-1]].item():.4g} / 2) away: round((x - zero) / scale), then "
                "clamp to 0..15")
    return None


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
        got, problem = _call_quantizer(quantize_group, x, g, description)
        if problem:
            return verdict(name, problem)
        codes, scales, zeros = got
        meta = (*x.shape[:-1], x.shape[-1] // g)  # one scale and zero point per group
        for label, t, shape in (("codes", codes, x.shape), ("scales", scales, meta), ("zeros", zeros, meta)):
            if not isinstance(t, torch.Tensor):
                return verdict(name, f"for {description}, {label} is a {type(t).__name__}, not a tensor")
            if tuple(t.shape) != tuple(shape):
                return verdict(name, f"for {description}, {label} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(shape)}"
                                     + (" (one per group)" if label != "codes" else " (one code per value, "
                                                                                    "unpacked)"))
        problem = _group_problem(description, x, g, codes, scales, zeros)
        if problem:
            return verdict(name, problem)
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


# --- the main exercise: KIVI's keys per channel, and how many tokens are quantized -----------------

def check_kivi_keys(quantize_keys_per_channel) -> bool:
    """Check a learner's quantize_keys_per_channel(k, group_size) -> (codes, scales, zeros), the key
    quantizer a KIVI cache takes (radarlab.quant.kivi.KiviQuantizer): keys [T, H, D], one asymmetric
    INT4 group per (group of g tokens, head, channel). Zeros and scales as the cache stores them, fp16:
    zero = the group's minimum, scale = (max - zero) / 15 with the stored zero, codes uint8 [T, H, D]
    (unpacked) computed with the stored numbers, every value back within half a step."""
    import torch

    from radarlab.quant.kivi import quantize_key_codes

    name = "kivi_keys"
    gen = torch.Generator().manual_seed(13)
    ramp = torch.tensor([[0.0, 100.0, -2.0, 1.0], [5.0, 100.0, 0.0, 2.0], [10.0, 100.0, 2.0, 3.0],
                         [15.0, 101.5, 4.0, 4.0]])[:, None]  # [4 tokens, 1 head, 4 channels]
    outlier = torch.randn(64, 3, 64, generator=gen)
    outlier[:, :, 7] *= 20  # an outlier channel, as the course model's keys have
    constant = torch.randn(8, 2, 16, generator=gen)
    constant[:, 1, 3] = 2.5
    cases = [  # (description, k, group_size)
        ("k of shape (4, 1, 4), one group of 4 tokens: channel 0 = [0, 5, 10, 15] (zero 0, scale 1), "
         "channel 1 = [100, 100, 100, 101.5], channel 2 = [-2, 0, 2, 4], channel 3 = [1, 2, 3, 4]", ramp, 4),
        ("random keys of shape (64, 3, 64) with channel 7 20x larger, groups of 32 tokens", outlier, 32),
        ("random keys of shape (32, 2, 16), groups of 8 tokens", torch.randn(32, 2, 16, generator=gen), 8),
        ("keys of shape (8, 2, 16), groups of 4 tokens, head 1's channel 3 always 2.5 (no division by "
         "zero: it must come back as 2.5)", constant, 4),
    ]
    for description, k, g in cases:
        got, problem = call_learner(lambda: quantize_keys_per_channel(k.clone(), g), description)
        if problem:
            return verdict(name, problem)
        problem = _key_layout_problem(got, k, g)
        if problem:
            return verdict(name, f"for {description}, {problem}")
        codes, scales, zeros = got
        _, want_s, want_z = quantize_key_codes(k, g)
        t, h, d = k.shape
        groups = k.reshape(t // g, g, h, d)
        s, z = scales.float(), zeros.float()
        bad = ~torch.isclose(z, want_z.float(), rtol=1e-3, atol=1e-6)
        if bool(bad.any()):
            j, hh, c = (int(i) for i in bad.nonzero()[0])
            symmetric = bool((z == 0).all()) or torch.allclose(z, -8 * s, rtol=1e-3)
            hint = (" (asymmetric: the zero point is the group's minimum and code 0 stands for it; a "
                    "symmetric grid has no zero point and wastes levels on a lopsided channel)" if symmetric
                    else " (keys are grouped per channel along tokens: reduce over the g tokens of a "
                    "group, not over head_dim)")
            return verdict(name, f"for {description}, the zero point of token group {j}, head {hh}, "
                                 f"channel {c} is {z[j, hh, c].item():.6g}, expected "
                                 f"{groups[:, :, hh, c].amin(1)[j].item():.6g}, the minimum of channel {c} "
                                 f"over tokens {j * g}..{j * g + g - 1}{hint}")
        bad = ~torch.isclose(s, want_s.float(), rtol=2e-3, atol=1e-7)
        if bool(bad.any()):
            j, hh, c = (int(i) for i in bad.nonzero()[0])
            ratio = s[j, hh, c].item() / want_s[j, hh, c].item()
            hint = (" (16 levels have 15 steps between them)" if abs(ratio - 15 / 16) < 1e-2 else
                    " (scale = (max - zero) / 15 over the group's g tokens, at least 2**-24 so that it is "
                    "not 0 in fp16)")
            return verdict(name, f"for {description}, the scale of token group {j}, head {hh}, channel {c} "
                                 f"is {s[j, hh, c].item():.6g}, expected {want_s[j, hh, c].item():.6g}{hint}")
        back = codes.float().reshape(groups.shape) * s[:, None] + z[:, None]
        far = (back - groups).abs() > s[:, None] / 2 * (1 + 1e-3) + 1e-6
        if bool(far.any()):
            j, i, hh, c = (int(x) for x in far.nonzero()[0])
            return verdict(name, f"for {description}, token {j * g + i}, head {hh}, channel {c} = "
                                 f"{groups[j, i, hh, c].item():.6g} comes back as "
                                 f"{back[j, i, hh, c].item():.6g} (code {int(codes[j * g + i, hh, c])}), "
                                 "more than half a step away: round((x - zero) / scale) with the stored "
                                 "fp16 zero and scale, then clamp to 0..15")
    return verdict(name, None)


def _key_layout_problem(got, k, g) -> str | None:
    """What is wrong with the types, shapes and dtypes of (codes, scales, zeros), in plain words."""
    import torch

    if not isinstance(got, (tuple, list)) or len(got) != 3:
        return f"it returned {type(got).__name__}; expected (codes, scales, zeros)"
    t, h, d = k.shape
    per_token = (t, h, d // g) if d % g == 0 else None
    shapes = ((t, h, d), (t // g, h, d), (t // g, h, d))
    for label, x, shape in zip(("codes", "scales", "zeros"), got, shapes):
        if not isinstance(x, torch.Tensor):
            hint = " (asymmetric INT4 stores a zero point per group)" if label == "zeros" else ""
            return f"{label} is a {type(x).__name__}, not a tensor{hint}"
        if tuple(x.shape) != shape:
            hint = (" (one code per key value, unpacked)" if label == "codes" else
                    " (that is one per token and group of g channels, along head_dim: KIVI's keys take "
                    "one per channel, per group of g tokens)" if tuple(x.shape) == per_token else
                    " (one per group of g tokens, head and channel)")
            return f"{label} has shape {tuple(x.shape)}, expected {shape}{hint}"
    codes, scales, zeros = got
    if codes.dtype != torch.uint8:
        return f"codes have dtype {codes.dtype}, expected torch.uint8"
    if int(codes.max()) > 15:
        return f"a code is {int(codes.max())}: 4 bits hold 0..15 (clamp)"
    for label, x in (("scales", scales), ("zeros", zeros)):
        if x.dtype != torch.float16:
            return (f"{label} have dtype {x.dtype}; the cache stores them in torch.float16: round them to "
                    "fp16 first, then compute the codes with the stored numbers")
    return None


def _kivi_tensors(seed: int):
    """Keys or values as the checkers give them: [T, H, D] with an outlier channel, and a constant one."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    outlier = torch.randn(64, 3, 64, generator=gen)
    outlier[:, :, 7] *= 20
    constant = torch.randn(8, 2, 16, generator=gen)
    constant[:, 1, 4:8] = 2.5  # head 1's second group of 4 channels, every token
    return [("random x of shape (64, 3, 64) with channel 7 20x larger, groups of 32", outlier, 32),
            ("random x of shape (32, 2, 16), groups of 8", torch.randn(32, 2, 16, generator=gen), 8),
            ("x of shape (8, 2, 16), groups of 4, head 1's channels 4..7 always 2.5 (no division by zero: "
             "they must come back as 2.5)", constant, 4)]


def check_kivi_values(quantize_values_per_token) -> bool:
    """Check a learner's quantize_values_per_token(v, group_size) -> (codes, scales, zeros): values
    [T, H, D], one asymmetric INT4 group per (token, head, group of g channels along head_dim), zeros
    and scales stored in fp16 [T, H, D/g], codes uint8 [T, H, D] computed with the stored numbers."""
    import torch

    name = "kivi_values"
    hand = torch.tensor([[0.0, 1.0, 2.0, 15.0, -1.0, 1.0, 3.0, 5.0], [4.0, 4.5, 5.0, 8.0, 0.0, 0.0, 0.0, 1.0],
                         [-3.0, 0.0, 3.0, 6.0, 2.0, 2.0, 2.0, 2.0],
                         [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]])[:, None]
    cases = [("v of shape (4, 1, 8), groups of 4 channels; token 0 is [0, 1, 2, 15 | -1, 1, 3, 5] (zero 0 "
              "and scale 1, then zero -1)", hand, 4)] + _kivi_tensors(17)
    for description, v, g in cases:
        got, problem = _call_quantizer(quantize_values_per_token, v, g, description)
        if problem:
            return verdict(name, problem)
        t, h, d = v.shape
        shapes = ((t, h, d), (t, h, d // g), (t, h, d // g))
        for label, x, shape in zip(("codes", "scales", "zeros"), got, shapes):
            if not isinstance(x, torch.Tensor):
                return verdict(name, f"for {description}, {label} is a {type(x).__name__}, not a tensor")
            if tuple(x.shape) != shape:
                hint = (" (one code per value, unpacked)" if label == "codes" else
                        " (that is the keys' layout, one per channel over g tokens: values take one per "
                        "token, head and group of g channels along head_dim)"
                        if tuple(x.shape) == (t // g, h, d) else
                        " (one per token, head and group of g channels)")
                return verdict(name, f"for {description}, {label} has shape {tuple(x.shape)}, expected "
                                     f"{shape}{hint}")
            if label != "codes" and x.dtype != torch.float16:
                return verdict(name, f"for {description}, {label} have dtype {x.dtype}; the cache stores "
                                     "them in torch.float16: round them to fp16 first, then compute the "
                                     "codes with the stored numbers")
        problem = _group_problem(description, v, g, *got)
        if problem:
            return verdict(name, problem)
    return verdict(name, None)


def _dequant_mistakes(keys: bool, codes, scales, zeros, g):
    """(what is wrong, the values it gives) for plausible wrong dequantizers."""
    c, s, z = codes.float(), scales.float(), zeros.float()
    if keys:  # scales [T/g, H, D]: token t takes group t // g's
        spread = lambda m: m.repeat_interleave(g, dim=0)
        tiled = lambda m: m.repeat(g, 1, 1)
        axis = "tokens"
    else:  # scales [T, H, D/g]: channel c takes group c // g's
        spread = lambda m: m.repeat_interleave(g, dim=-1)
        tiled = lambda m: m.repeat(1, 1, g)
        axis = "channels"
    return [
        ("it computed (code - zero) x scale; the zero point here is the group's minimum, a value, so "
         "x = code x scale + zero", (c - spread(z)) * spread(s)),
        ("the zero point was left out: x = code x scale + zero", c * spread(s)),
        ("it subtracted 8 from the codes, the symmetric grid's centre; this grid is asymmetric: x = code x "
         "scale + zero", (c - 8) * spread(s)),
        (f"the groups' scales and zeros were tiled along {axis} (repeat), so position i read group i mod "
         f"n's; each group's g {axis} take its own (repeat_interleave, or a reshape that puts the g "
         f"{axis} of a group on their own axis)", c * tiled(s) + tiled(z)),
        ("the scales and zeros were swapped: x = code x scale + zero", c * spread(z) + spread(s)),
    ]


def _check_dequant(name: str, fn, keys: bool) -> bool:
    """The two dequantizers' checker: radarlab's codes, scales and zeros in, radarlab's values out."""
    import torch

    from radarlab.quant import kivi

    for description, x, g in _kivi_tensors(19 if keys else 23):
        quantize, dequantize = ((kivi.quantize_key_codes, kivi.dequantize_key_codes) if keys else
                                (kivi.quantize_value_codes, kivi.dequantize_value_codes))
        codes, scales, zeros = quantize(x, g)
        want = dequantize(codes, scales, zeros, g)
        described = description.replace("random x", "the codes of random " + ("keys" if keys else "values"))
        got, problem = call_learner(lambda: fn(codes.clone(), scales.clone(), zeros.clone(), g), described)
        if problem:
            return verdict(name, problem)
        difference = first_tensor_difference(got, want, atol=1e-5, rtol=1e-5)
        if difference is None:
            continue
        if "dtype" in difference:
            return verdict(name, f"for {described} it returned {difference}: return float32 values (the "
                                 "codes are uint8 and the scales fp16: .float() both)")
        hint = next((what for what, wrong in _dequant_mistakes(keys, codes, scales, zeros, g)
                     if isinstance(got, torch.Tensor) and got.shape == wrong.shape
                     and torch.allclose(got.float(), wrong, atol=1e-5, rtol=1e-5)), None)
        return verdict(name, f"for {described}: " + (hint or f"it returned {difference}"))
    return verdict(name, None)


def check_kivi_key_dequant(dequantize_keys_per_channel) -> bool:
    """Check a learner's dequantize_keys_per_channel(codes [T, H, D], scales [T/g, H, D], zeros, g) ->
    float32 [T, H, D]: code x scale + zero, each token with its token group's scale and zero."""
    return _check_dequant("kivi_key_dequant", dequantize_keys_per_channel, keys=True)


def check_kivi_value_dequant(dequantize_values_per_token) -> bool:
    """Check a learner's dequantize_values_per_token(codes [T, H, D], scales [T, H, D/g], zeros, g) ->
    float32 [T, H, D]: code x scale + zero, each channel with its channel group's scale and zero."""
    return _check_dequant("kivi_value_dequant", dequantize_values_per_token, keys=False)


def check_quantized_length(quantized_length) -> bool:
    """Check a learner's quantized_length(num_tokens, group_size, residual): how many of a sequence's
    tokens a KIVI cache holds quantized, whole groups only, leaving at least `residual` newest tokens in
    16-bit (radarlab's rule: radarlab.quant.kivi.quantized_length)."""
    from radarlab.quant.kivi import quantized_length as reference
    from radarlab.util import cdiv, is_int

    name = "quantized_length"
    cases = [(0, 32, 0), (31, 32, 0), (32, 32, 0), (100, 32, 0), (20, 32, 128), (159, 32, 128),
             (160, 32, 128), (161, 32, 128), (1000, 32, 128), (200, 64, 64), (255, 16, 40)]
    for t, g, r in cases:
        description = f"num_tokens={t}, group_size={g}, residual={r}"
        want = reference(t, g, r)
        got, problem = call_learner(lambda: quantized_length(t, g, r), description)
        if problem:
            return verdict(name, problem)
        if not is_int(got):
            return verdict(name, f"for {description} it returned {got!r} ({type(got).__name__}); expected "
                                 f"the int {want}")
        if got == want:
            continue
        hints = [(got < 0, " (fewer tokens than the window: nothing is quantized, never a negative count)"),
                 (got == t // g * g, f" (leave the newest {r} tokens, the residual window, in 16-bit)"),
                 (got == max(0, cdiv(t - r, g) * g),
                  " (only whole groups: a partial group waits in 16-bit, so round down)"),
                 (got % g == 0 and abs(got - want) == g,
                  " (off by one group at a boundary: a group is quantized as soon as it is complete and "
                  "the window's tokens follow it)"),
                 (got % g != 0, " (a key group is quantized whole: the count is a multiple of group_size)")]
        hint = next((h for match, h in hints if match), "")
        return verdict(name, f"for {description} it returned {got}, expected {want}{hint}")
    return verdict(name, None)
