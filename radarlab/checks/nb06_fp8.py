"""Checkers of notebook 06 (FP8 KV cache): E4M3 decode and encode, per-token-head scales, and section
4's Triton puzzles: a tile decoded, a tile dequantized, and the FP8 load of the attention kernel, run
inside radarlab's kernel."""
from __future__ import annotations

from radarlab.checks.common import call_learner, kernel_error, verdict


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


# --- section 4: the fused-dequant load, as Triton puzzles ----------------------------------------
_GUARD = -12345.0  # what lies either side of a table or scale the checkers hand a kernel


def _guarded(values):
    """values as a view into a buffer that holds _GUARD on both sides of them (the view keeps it alive)."""
    import torch

    n = values.numel()
    buffer = torch.full((3 * n,), _GUARD, dtype=values.dtype, device=values.device)
    buffer[n: 2 * n] = values.flatten()
    return buffer[n: 2 * n].view(values.shape)


def _same(got, want) -> bool:
    import torch

    return got.shape == want.shape and bool(torch.allclose(got, want, rtol=1e-5, atol=1e-6, equal_nan=True))


def _tile_mistake(got, codes, rows, table) -> str:
    """Which plausible mistake explains a wrong decoded tile: codes [N, DIM] the tile, rows [N, W] the
    buffer it was cut from (the tile's row n is rows[n, :DIM])."""
    import torch

    if _same(got, codes.float()):
        return ("a code is an index into the decode table, not a number: x = tl.load(table_ptr + code) "
                "(code.to(tl.float32) is the byte's integer value)")
    if bool((got == _GUARD).any()):
        return ("codes 0x80 and up were read from before the table: they were taken as negative (an int8). "
                "A code is an unsigned byte 0..255: index with it as loaded, or widened to tl.int32")
    n, dim = codes.shape
    packed = rows.flatten()[: n * dim].view(n, dim)
    if not torch.equal(packed, codes) and _same(got, table[packed.long()]):
        return "row n of the tile starts at codes_ptr + n * stride_n, not n * DIM: the rows are not packed"
    return "out[n, d] is table[codes[n, d]], the code at codes_ptr + n * stride_n + d"


def check_decode_tile(kernel) -> bool:
    """Check a learner's decode_tile_kernel(codes_ptr, table_ptr, out_ptr, stride_n, N, DIM) (one program)
    against a lookup in torch: out [N, DIM] (contiguous fp32) = table[codes], codes the uint8 tile whose
    row n starts at codes_ptr + n * stride_n. The table lies between guard values, so that reading
    before or after it shows."""
    import torch

    from radarlab.device import default_device
    from radarlab.quant import fp8

    name = "decode_tile"
    device = default_device()
    table = _guarded(fp8.decode_table("e4m3").to(device))
    gen = torch.Generator().manual_seed(61)
    wide = torch.randint(0, 256, (4, 32), generator=gen, dtype=torch.uint8)
    cases = [  # (description, the buffer the tile is cut from, the tile's width DIM)
        ("a 16 x 16 tile holding the 256 codes in order (row n: codes 16n to 16n + 15), stride_n = 16",
         torch.arange(256).to(torch.uint8).view(16, 16), 16),
        ("a 4 x 8 tile of random codes cut from a buffer 32 bytes wide (stride_n = 32)", wide, 8),
    ]
    for description, rows, dim in cases:
        codes = rows[:, :dim]
        want = table[codes.long().to(device)].cpu()
        out = torch.full(codes.shape, float("nan"), device=device)
        rows_d = rows.to(device)
        try:
            kernel[(1,)](rows_d, table, out, rows_d.stride(0), N=codes.shape[0], DIM=dim)
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return kernel_error(name, err, description)
        got = out.cpu()
        if not _same(got, want):
            n, d = (int(i) for i in (~torch.isclose(got, want, equal_nan=True)).nonzero()[0])
            return verdict(name, f"for {description}, out[{n}, {d}] (code 0x{int(codes[n, d]):02X}) is "
                                 f"{float(got[n, d])!r}, expected {float(want[n, d])!r}: "
                                 f"{_tile_mistake(got, codes, rows, table.cpu())}")
    return verdict(name, None)


def check_dequant_tile(kernel) -> bool:
    """Check a learner's dequant_tile_kernel(codes_ptr, table_ptr, scale_ptr, out_ptr, N, DIM, TOKEN_SCALE)
    (one program, the tile contiguous): out = table[codes] x scale, with one fp32 scale at scale_ptr,
    or (TOKEN_SCALE) row n's own fp16 scale at scale_ptr + n, as fp8_per_token_head stores them."""
    import torch

    from radarlab.device import default_device
    from radarlab.quant import fp8

    name = "dequant_tile"
    device = default_device()
    table = fp8.decode_table("e4m3")
    gen = torch.Generator().manual_seed(62)
    sign = (torch.arange(4) % 2 << 7).to(torch.uint8)  # every other column negative
    codes8 = torch.randint(0, 0x7F, (8, 4), generator=gen, dtype=torch.uint8) | sign  # no NaN among them
    cases = [  # (description, codes [N, DIM], scales, TOKEN_SCALE)
        ("a static scale of 0.25 (one number for the tile), a 4 x 8 tile", codes8.view(4, 8),
         torch.tensor([0.25]), False),
        ("TOKEN_SCALE: row n has its own fp16 scale, scales = [0.5, 2, 0.125, 8, 1, 4, 0.25, 16], an 8 x 4 "
         "tile", codes8, torch.tensor([0.5, 2, 0.125, 8, 1, 4, 0.25, 16], dtype=torch.float16), True),
    ]
    for description, codes, scales, token in cases:
        values = table[codes.long()]
        s = scales.float()[:, None] if token else scales.float()
        want = values * s
        scale_view = _guarded(scales.to(device))
        out = torch.full(codes.shape, float("nan"), device=device)
        try:
            kernel[(1,)](codes.contiguous().to(device), table.to(device), scale_view, out, N=codes.shape[0],
                         DIM=codes.shape[1], TOKEN_SCALE=token)
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return kernel_error(name, err, description)
        got = out.cpu()
        if _same(got, want):
            continue
        if _same(got, values / s):
            hint = "it divided by the scale: the cache stores x / scale, so reading it back multiplies"
        elif _same(got, values):
            hint = "the scale is missing: multiply the decoded tile by it"
        elif token and _same(got, values * s[0]):
            hint = ("every row took scale 0: with TOKEN_SCALE, row n's scale is tl.load(scale_ptr + n), "
                    "broadcast along the row with [:, None]")
        elif token and _same(got, values * scales.float()[None, : codes.shape[1]]):
            hint = ("the scales were spread along the columns (scale_ptr + d): they belong to the rows, one "
                    "per token, so scale_ptr + n, broadcast with [:, None]")
        elif _same(got / s, codes.float()):
            hint = "a code is an index into the decode table, not a number: x = tl.load(table_ptr + code)"
        else:
            hint = "out[n, d] = table[codes[n, d]] x the scale"
        n, d = (int(i) for i in (~torch.isclose(got, want, equal_nan=True)).nonzero()[0])
        return verdict(name, f"for {description}, out[{n}, {d}] is {float(got[n, d]):.6g}, expected "
                             f"{float(want[n, d]):.6g}: {hint}")
    return verdict(name, None)


def _fp8_batch(lens, news, block_size, heads, kv_heads, dim, rule, k_scale, v_scale, seed, device):
    """A small batch over a paged FP8 pool written by radarlab's write (reshape_and_cache), every byte no
    token owns a NaN code (0x7F) and every per-token scale no token owns NaN. Block 0 is never in a
    table: the kernel reads a row that is not ok at block 0, so such a row, if kept, is NaN. A per-tensor
    scale (rule "tensor") lies in front of NaNs, so that reading past it (static_ptr + kv_head) shows."""
    import torch

    from radarlab.attention.backends import write_kv
    from radarlab.attention.metadata import AttentionMetadata
    from radarlab.kvcache.paged_cache import PagedKVCache

    gen = torch.Generator().manual_seed(seed)
    counts = [-(-n // block_size) for n in lens]
    num_blocks = 1 + sum(counts) + 2
    fmt = "fp8_per_token_head" if rule == "token" else "fp8_e4m3"
    scales = {} if rule == "token" else {"k_scale": k_scale, "v_scale": v_scale}
    cache = PagedKVCache(1, num_blocks, kv_heads, dim, block_size=block_size, kv_cache_dtype=fmt,
                         device=device, **scales)
    for t in (cache.k, cache.v):
        t.fill_(0x7F)
    for t in (cache.k_scales, cache.v_scales):
        if t is not None:
            t.fill_(float("nan"))
    order = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    tables, slots = [], []
    for n, c in zip(lens, counts):
        blocks, order = order[:c], order[c:]
        tables.append(blocks + [-1] * (max(counts) - c))
        slots += [blocks[p // block_size] * block_size + p % block_size for p in range(n)]
    k = torch.randn(len(slots), kv_heads, dim, generator=gen) * 3
    v = torch.randn(len(slots), kv_heads, dim, generator=gen) * 3
    write_kv(cache, 0, k.to(device), v.to(device), torch.tensor(slots, device=device))
    k_pool, v_pool = cache.layer_pools(0)
    keep = []
    if rule == "tensor":
        for pool in (k_pool, v_pool):
            behind = torch.full((kv_heads,), float("nan"), device=device)
            behind[0] = pool.scale
            pool.scale = behind[0]  # the launcher passes this very storage (a float32 0-d view) as static_ptr
            keep.append(behind)
    meta = AttentionMetadata.from_lens(news, lens)
    return dict(q=torch.randn(sum(news), heads, dim, generator=gen).to(device), k_pool=k_pool, v_pool=v_pool,
                block_tables=torch.tensor(tables, device=device), seq_lens=meta.seq_lens.to(device),
                query_start_loc=meta.query_start_loc.to(device), scale=dim**-0.5, rule=rule, behind=keep)


def _position_scales(pool, rule, behind=None):
    """The scale of every stored value as the load should apply it, broadcastable to [N, B, H, D]: the
    token's own, the head's, or the tensor's (behind: the NaN-backed buffer of a per-tensor scale)."""
    if rule == "token":
        return pool.scales.float()
    if behind is not None:
        return behind.float()[None, None, :, None]
    s = pool.scale.float()
    return s[None, None, :, None] if s.dim() else s


def _fp8_load_mistake(b, got) -> str:
    """Which plausible mistake explains a wrong output: each is attention (torch) over K and V loaded
    that way, compared with what the kernel returned."""
    import torch

    from radarlab.attention.torch_paged import paged_attention_torch
    from radarlab.quant import fp8

    rule = b["rule"]
    table = fp8.decode_table("e4m3").to(got.device)
    if rule == "token":
        missing = ("TOKEN_SCALE is on, and the token's own scale was not applied: multiply by the scale at "
                   "scales_ptr + block * stride_mb + row * stride_ms + kv_head * stride_mh")
        head0 = "every KV head took KV head 0's token scale: add kv_head * stride_mh to the scale's address"
    else:
        missing = "the scale is missing: multiply by the head's scale, static_ptr[kv_head * static_h]"
        head0 = "every KV head took head 0's scale: read static_ptr + kv_head * static_h"

    def value(c):
        return table[c.long()]

    mistakes = [  # (what it says, how that load turns codes and scales into values, the scale it reads)
        ("a code is an index into the decode table, not a number: x = tl.load(table_ptr + code), where "
         "code.to(tl.float32) is the byte's integer value", lambda c, s: c.float() * s, "right"),
        ("the codes were read as int8 numbers; a code is an index into the decode table: "
         "x = tl.load(table_ptr + code)", lambda c, s: c.view(torch.int8).float() * s, "right"),
        ("it divided by the scale: the cache stores x / scale, so the load multiplies",
         lambda c, s: value(c) / s, "right"),
        (missing, lambda c, s: value(c), "right"),
        ("every KV head read KV head 0's codes: add kv_head * stride_ph to the codes' address",
         lambda c, s: value(c[:, :, :1].expand_as(c)) * s, "right"),
    ]
    if rule == "tensor":
        mistakes.append(("this scale is one number for all heads (static_h = 0): read static_ptr + kv_head * "
                         "static_h; static_ptr + kv_head runs past it", lambda c, s: value(c) * s, "behind"))
    else:
        mistakes.append((head0, lambda c, s: value(c) * s[:, :, :1], "right"))
    args = (b["block_tables"], b["seq_lens"], b["query_start_loc"], b["scale"])
    for message, load, which in mistakes:
        pools = [load(pool.payload, _position_scales(pool, rule, behind if which == "behind" else None))
                 for pool, behind in zip((b["k_pool"], b["v_pool"]), b["behind"] or (None, None))]
        want = paged_attention_torch(b["q"], *pools, *args, check=False)
        if torch.allclose(got, want, atol=1e-4, rtol=1e-4, equal_nan=True):
            return message
    if got.isnan().any():
        return ("NaN came out: a row that is not ok (a position past the context) was loaded and kept. "
                "Load the codes with mask=ok[:, None], other=0 (the token scale with mask=ok) and return "
                "tl.where(ok[:, None], x, 0.0): here the block such a row names holds NaN codes")
    return ("position (block, row) of kv_head, element d, is at ptr + block * stride_pb + row * stride_ps + "
            "kv_head * stride_ph + d * stride_pd")


def check_fp8_load(fp8_load) -> bool:
    """Check a learner's FP8 tile load (the signature of triton_quant._load_fp8) inside radarlab's
    quantized attention kernel, triton_quant_paged_attention(..., fp8_load=fp8_load), against
    paged_attention_torch over the same pools: per-tensor, per-head and per-token-head scales, GQA,
    scrambled block tables, last blocks partly filled, prefill chunks and decodes. A wrong output is
    matched against plausible mistakes, each computed in torch."""
    import torch

    from radarlab.attention.torch_paged import paged_attention_torch
    from radarlab.attention.triton_quant import triton_quant_paged_attention
    from radarlab.device import default_device

    name = "fp8_load"
    device = default_device()
    cases = [  # (description, seq_lens, new tokens, block size, heads, KV heads, head_dim, scale rule, k, v)
        ("one sequence decoding at context 6 (blocks of 4, the second one partly filled), one scale per "
         "tensor (k_scale 0.5, v_scale 0.25: static_h = 0), 2 query heads over 2 KV heads, head_dim 16",
         [6], [1], 4, 2, 2, 16, "tensor", 0.5, 0.25),
        ("per-head scales (k_scale [0.25, 2], v_scale [0.5, 0.125]), GQA 4 query heads over 2 KV heads, "
         "contexts 9 and 5 with 3 and 1 new tokens, scrambled block tables",
         [9, 5], [3, 1], 4, 4, 2, 16, "head", torch.tensor([[0.25, 2.0]]), torch.tensor([[0.5, 0.125]])),
        ("fp8_per_token_head: every token and KV head its own scale, contexts 7 and 12 with 1 and 4 new "
         "tokens, 2 KV heads", [7, 12], [1, 4], 4, 2, 2, 16, "token", None, None),
        ("the engine's setting: scale 1.0 per tensor, the course model's 9 query heads over 3 KV heads, "
         "head_dim 64, contexts 18 and 3 decoding, blocks of 16", [18, 3], [1, 1], 16, 9, 3, 64, "tensor",
         1.0, 1.0),
    ]
    for i, (description, lens, news, bs, heads, kv_heads, dim, rule, k_scale, v_scale) in enumerate(cases):
        b = _fp8_batch(lens, news, bs, heads, kv_heads, dim, rule, k_scale, v_scale, 63 + i, device)
        args = (b["q"], b["k_pool"], b["v_pool"], b["block_tables"], b["seq_lens"], b["query_start_loc"],
                b["scale"])
        want = paged_attention_torch(*args, check=False)
        try:
            got = triton_quant_paged_attention(*args, fp8_load=fp8_load)
        except Exception as err:  # a learner's bug should read as a counterexample, not a traceback
            return kernel_error(name, err, description, what="function")
        bad = ~torch.isclose(got, want, atol=1e-4, rtol=1e-4)
        if bad.any():
            token, head = (int(x) for x in bad.any(-1).nonzero()[0])
            wrong = sorted({int(h) // (heads // kv_heads) for h in bad.any(-1).nonzero()[:, 1]})
            return verdict(name, f"for {description}: new token {token}, query head {head} is wrong (wrong "
                                 f"heads read KV heads {wrong}); {_fp8_load_mistake(b, got)}")
    return verdict(name, None)
