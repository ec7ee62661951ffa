"""Notebook 06's FP8 code walker: the bits taken apart (checked against torch's float8 dtypes for
every code), the caption, and the widget driven in plain Python (no browser)."""
from __future__ import annotations

import math
import struct

import pytest
import torch

from radarlab.quant import fp8
from radarlab.viz.fp8_codes import FIGURE_DPI, FIGURE_SIZE, all_codes, caption, code_info, fp8_layout
from radarlab.viz.widgets import fp8_code_walker


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("fmt,layout", [("e4m3", (4, 3, 7)), ("e5m2", (5, 2, 15))])
def test_layout_from_finfo(fmt, layout):
    assert fp8_layout(fmt) == layout


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_every_code_rebuilt_from_its_fields_equals_torch(fmt):
    torch_values = torch.arange(256, dtype=torch.uint8).view(fp8.TORCH_DTYPES[fmt]).float().tolist()
    for info, want in zip(all_codes(fmt), torch_values):
        assert info.code == (info.sign << 7) | (info.exponent << info.man_bits) | info.mantissa
        if info.kind == "nan":
            assert math.isnan(want)
            continue
        assert info.value == want
        if info.kind in ("normal", "subnormal"):
            lead = 1 if info.kind == "normal" else 0
            e = info.exponent if info.kind == "normal" else 1
            rebuilt = (-1) ** info.sign * (lead + info.mantissa / 2**info.man_bits) * 2.0 ** (e - info.bias)
            assert rebuilt == want
            assert f"= {want:.6g}" in info.formula


@pytest.mark.parametrize("fmt,kinds", [("e4m3", {"zero": 2, "subnormal": 14, "normal": 238, "nan": 2}),
                                       ("e5m2",
                                        {"zero": 2, "subnormal": 6, "normal": 240, "inf": 2, "nan": 6})])
def test_kinds_are_counted(fmt, kinds):
    counted = {}
    for info in all_codes(fmt):
        counted[info.kind] = counted.get(info.kind, 0) + 1
    assert counted == kinds


def test_known_codes():
    one = code_info(0x38, "e4m3")
    assert (one.bits, one.value, one.next_up, one.step) == ("0 0111 000", 1.0, 1.125, 0.125)
    top = code_info(0x7E, "e4m3")
    assert top.value == 448 and top.is_max and top.step is None and "saturates" in caption(top)
    assert code_info(0xFE, "e4m3").is_max and code_info(0xFE, "e4m3").value == -448
    # no inf in E4M3fn
    assert code_info(0x7F, "e4m3").kind == "nan" and code_info(0x78, "e4m3").kind == "normal"
    assert code_info(0x01, "e4m3").value == 2.0**-9 and code_info(0x01, "e4m3").kind == "subnormal"
    assert code_info(0x00, "e4m3").next_up == 2.0**-9
    assert code_info(0x7B, "e5m2").value == 57344 and code_info(0x7B, "e5m2").is_max
    assert code_info(0x7C, "e5m2").kind == "inf" and code_info(0xFC, "e5m2").value == -math.inf
    assert code_info(0x7D, "e5m2").kind == "nan"
    assert caption(code_info(0x39, "e4m3")).endswith("next code up 1.25, a step of 0.125 (11.1%)")


@pytest.mark.parametrize("bad", [-1, 256, 1.0, True, "0x38"])
def test_bad_code_raises(bad):
    with pytest.raises(ValueError, match="code must be an int from 0 to 255"):
        code_info(bad)


def test_bad_format_raises():
    with pytest.raises(ValueError, match="e4m3, e5m2"):
        code_info(0, "e3m4")
    with pytest.raises(ValueError, match="e4m3, e5m2"):
        fp8_code_walker(0, "fp8")


def test_walker_steps_and_keeps_its_size():
    w = fp8_code_walker(0x38, "e4m3")
    size = _png_size(w.image.value)
    assert size == (int(FIGURE_SIZE[0] * FIGURE_DPI), int(FIGURE_SIZE[1] * FIGURE_DPI))
    assert "0x38 = 0 0111 000 (E4M3fn): normal" in w.caption.value
    w.next_button.click()
    assert w.code.value == 0x39 and "= 1.125" in w.caption.value
    first = w.image.value
    for code, fmt in ((0x7F, "e4m3"), (0x00, "e4m3"), (0x7C, "e5m2"), (0x81, "e5m2")):
        w.format.value, w.code.value = fmt, code
        assert _png_size(w.image.value) == size  # the page does not jump between codes
        assert w.caption.value.startswith(f"0x{code:02X} = ")
    assert w.image.value != first
    w.code.value = 0
    assert w.back_button.disabled and not w.next_button.disabled
    w.back_button.click()
    assert w.code.value == 0
    w.code.value = 255
    assert w.next_button.disabled
    w.format.value = "e4m3"
    assert "NaN" in w.caption.value and w.info.fmt == "e4m3"
