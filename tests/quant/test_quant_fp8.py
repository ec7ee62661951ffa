"""FP8 from bits: all 256 codes against torch's float8 dtypes, both roundings, saturation, NaN, scales."""
from __future__ import annotations

import math

import pytest
import torch

from radarlab.quant import fp8

FORMATS = ["e4m3", "e5m2"]


def _torch_values(fmt):
    return torch.arange(256, dtype=torch.uint8).view(fp8.TORCH_DTYPES[fmt]).float()


@pytest.mark.parametrize("fmt", FORMATS)
def test_decode_table_equals_torch_for_all_256_codes(fmt):
    ours, ref = fp8.decode_table(fmt), _torch_values(fmt)
    assert torch.equal(ours.isnan(), ref.isnan())
    assert torch.equal(ours[~ours.isnan()], ref[~ref.isnan()])
    assert torch.equal(torch.signbit(ours[~ours.isnan()]), torch.signbit(ref[~ref.isnan()]))  # -0.0 at 0x80


def test_format_facts_from_bits():
    assert fp8.max_finite("e4m3") == 448.0 and fp8.max_finite("e5m2") == 57344.0
    t = fp8.decode_table("e4m3")
    assert int(t.isnan().sum()) == 2 and not bool(t.isinf().any())  # fn: no inf, NaN at 0x7F and 0xFF
    t = fp8.decode_table("e5m2")
    assert int(t.isinf().sum()) == 2 and int(t.isnan().sum()) == 6
    assert fp8.decode_code(0x01, "e4m3") == 2.0**-9  # smallest subnormal
    assert fp8.decode_code(0x01, "e5m2") == 2.0**-16


def _probe_values(fmt):
    """Every finite code's value, every midpoint between neighbours (the ties), points a quarter step
    either side, and random values over the whole range (with subnormals), both signs."""
    v = fp8.decode_table(fmt)
    pos = v[:128][torch.isfinite(v[:128])]
    mids = (pos[:-1] + pos[1:]) / 2
    near = torch.cat((pos[:-1] * 0.75 + pos[1:] * 0.25, pos[:-1] * 0.25 + pos[1:] * 0.75))
    g = torch.Generator().manual_seed(0)
    rand = torch.exp(torch.empty(20000).uniform_(-20, math.log(fp8.max_finite(fmt)), generator=g))
    x = torch.cat((pos, mids, near, rand))
    return torch.cat((x, -x))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rne_equals_torch_cast_within_range(fmt):
    x = _probe_values(fmt)
    ref = x.to(fp8.TORCH_DTYPES[fmt]).view(torch.uint8)
    assert torch.equal(fp8.encode(x, fmt, "rne"), ref)


def _rtz_reference(x, fmt):
    """Brute force: the code whose value has the largest magnitude not above |x|, with x's sign."""
    v = fp8.decode_table(fmt)[:128].double()
    finite = torch.isfinite(v)
    a = x.double().abs().clamp(max=fp8.max_finite(fmt))
    ok = (v[None, :] <= a[:, None]) & finite[None, :]
    mag = torch.where(ok, v[None, :], -1.0).argmax(dim=1).to(torch.uint8)
    return mag | (torch.signbit(x).to(torch.uint8) << 7)


@pytest.mark.parametrize("fmt", FORMATS)
def test_rtz_equals_brute_force_reference(fmt):
    x = _probe_values(fmt)[::7]
    codes = fp8.encode(x, fmt, "rtz")
    assert torch.equal(codes, _rtz_reference(x, fmt))
    back = fp8.decode(codes, fmt)
    assert bool((back.abs() <= x.abs()).all())  # never away from zero
    rne = fp8.decode(fp8.encode(x, fmt, "rne"), fmt)
    assert bool((rne.abs() > back.abs()).any())  # and the two modes really differ somewhere


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rounding", ["rne", "rtz"])
def test_beyond_range_saturates_and_nan_stays_nan(fmt, rounding):
    m = fp8.max_finite(fmt)
    x = torch.tensor([m * 1.5, -m * 4, float("inf"), float("-inf"), 1e30, float("nan")])
    back = fp8.decode(fp8.encode(x, fmt, rounding), fmt)
    assert back[:5].tolist() == [m, -m, m, -m, m]
    assert bool(torch.isnan(back[5]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_finite_code_round_trips(fmt):
    codes = torch.arange(256, dtype=torch.uint8)
    values = fp8.decode(codes, fmt)
    keep = torch.isfinite(values)
    for rounding in ("rne", "rtz"):
        assert torch.equal(fp8.encode(values[keep], fmt, rounding), codes[keep])


def test_bad_format_and_rounding():
    with pytest.raises(ValueError, match="fp8 format must be one of e4m3, e5m2"):
        fp8.encode(torch.ones(2), "e3m4")
    with pytest.raises(ValueError, match="rounding must be one of rne, rtz"):
        fp8.encode(torch.ones(2), "e4m3", "up")
    with pytest.raises(ValueError, match="codes must be uint8"):
        fp8.decode(torch.ones(2), "e4m3")


# ----------------------------------------------------------------------------- scales

def _kv(t=5, h=3, d=8, seed=0):
    return torch.randn(t, h, d, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_with_each_scale_rule_round_trips_within_half_a_step(fmt):
    x = _kv()
    rel = 2.0 ** -(4 if fmt == "e4m3" else 3)  # half a mantissa step (3 or 2 bits), relative
    for scale in (fp8.calibrated_scale(x, fmt), fp8.calibrated_scale(x, fmt, "head"),
                  fp8.dynamic_scale(x, fmt)):
        back = fp8.dequantize(fp8.quantize(x, scale, fmt), scale, fmt)
        assert bool(((back - x).abs() <= rel * x.abs() + 1e-6).all())
    # per token and head, every vector reaches the top of the range
    scale = fp8.dynamic_scale(x, fmt)
    assert torch.allclose((x.abs().amax(2) / scale), torch.full((5, 3), fp8.max_finite(fmt)))


def test_calibrated_and_legacy_scale_values():
    k, v = _kv(seed=1), _kv(seed=2) * 10
    assert float(fp8.calibrated_scale(k)) == pytest.approx(float(k.abs().max()) / 448)
    assert fp8.calibrated_scale(k, rule="head").shape == (3,)
    ks, vs = fp8.legacy_vllm_scales(k, v)
    assert ks == pytest.approx(float(k.abs().max()) / 200) and vs == pytest.approx(float(v.abs().max()) / 100)
    assert float(fp8.calibrated_scale(torch.zeros(2, 3, 4))) == 1.0  # an all-zero tensor keeps scale 1


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan"), float("inf")])
def test_zero_negative_nan_scale_raises(bad):
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        fp8.quantize(_kv(), bad)
    with pytest.raises(ValueError, match="scale must be finite and > 0"):
        fp8.quantize(_kv(), torch.tensor([1.0, bad, 1.0]), rule="head")


def test_scale_shape_must_fit_its_rule():
    x = _kv(t=5, h=3)
    for wrong in (torch.ones(5), torch.ones(3, 1), torch.ones(1, 3), torch.ones(5, 3, 1), torch.ones(1)):
        with pytest.raises(ValueError, match="fits no rule"):
            fp8.quantize(x, wrong)
    with pytest.raises(ValueError, match=r"per-head scale must have shape \(3,\)"):
        fp8.quantize(x, torch.ones(5, 3), rule="head")
    with pytest.raises(ValueError, match=r"per-token-and-head scale must have shape \(5, 3\)"):
        fp8.quantize(x, 1.0, rule="token_head")
    with pytest.raises(ValueError, match="floating-point"):
        fp8.quantize(x, torch.ones(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="calibrated scales are per tensor or per head"):
        fp8.calibrated_scale(x, rule="token_head")


def test_nan_input_stays_detectable_after_scaling():
    x = _kv()
    x[2, 1, 3] = float("nan")
    back = fp8.dequantize(fp8.quantize(x, 2.0), 2.0)
    assert bool(back[2, 1, 3].isnan()) and int(back.isnan().sum()) == 1
