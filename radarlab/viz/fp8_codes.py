"""The 256 codes of an FP8 format one at a time: their bits, what the bits mean, and where each code
sits on the number line. Notebook 06's code walker (viz.widgets.FP8CodeWalker) draws these; the
values come from radarlab.quant.fp8, the bit layout from torch's finfo of the same format.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from radarlab.quant import fp8

FORMAT_NAMES = {"e4m3": "E4M3fn", "e5m2": "E5M2"}
FIGURE_SIZE = (9.0, 3.0)  # inches; every code is drawn on the same canvas, so the page never jumps
FIGURE_DPI = 100
COLORS = {"normal": "#4477aa", "subnormal": "#66ccee", "zero": "#999999", "nan": "#cc3311", "inf": "#ee7733",
          "current": "#cc3311", "sign": "#bbbbbb", "exponent": "#ccddaa", "mantissa": "#ffeeaa"}


def fp8_layout(fmt: str) -> tuple[int, int, int]:
    """(exponent bits, mantissa bits, bias), read from torch.finfo: eps = 2^-mantissa bits and the
    smallest normal = 2^(1 - bias)."""
    import torch

    if fmt not in fp8.TORCH_DTYPES:
        raise ValueError(f"fmt must be one of {', '.join(fp8.TORCH_DTYPES)}, got {fmt!r}")
    info = torch.finfo(fp8.TORCH_DTYPES[fmt])
    man_bits = round(-math.log2(info.eps))
    return 7 - man_bits, man_bits, 1 - round(math.log2(info.tiny))


@dataclass(frozen=True)
class CodeInfo:
    """One code of one format, taken apart. kind: zero, subnormal, normal, inf or nan."""

    code: int
    fmt: str
    sign: int
    exponent: int
    mantissa: int
    exp_bits: int
    man_bits: int
    bias: int
    kind: str
    value: float
    next_up: float | None  # the next larger finite magnitude; None at the largest finite, inf and NaN

    @property
    def bits(self) -> str:
        """'s eeee mmm', e.g. '0 0111 000' for E4M3's 1.0."""
        return (f"{self.sign} {self.exponent:0{self.exp_bits}b} {self.mantissa:0{self.man_bits}b}")

    @property
    def is_max(self) -> bool:
        """The largest finite magnitude: where values beyond the range saturate."""
        return self.kind == "normal" and self.next_up is None

    @property
    def step(self) -> float | None:
        """The gap to the next larger magnitude: the rounding resolution at this value."""
        return None if self.next_up is None else self.next_up - abs(self.value)

    @property
    def formula(self) -> str:
        """How the bits give the value, in words a learner can check by hand."""
        s = "-" if self.sign else "+"
        m = f"{self.mantissa}/{1 << self.man_bits}"
        if self.kind == "nan":
            rule = "mantissa all ones" if self.fmt == "e4m3" else "mantissa not 0"
            return f"NaN (exponent all ones, {rule})"
        if self.kind == "inf":
            return f"{s}inf (exponent all ones, mantissa 0)"
        if self.kind == "zero":
            return f"{s}0 (exponent and mantissa all zeros)"
        if self.kind == "subnormal":
            return f"{s}(0 + {m}) x 2^(1 - {self.bias}) = {self.value:.6g}"
        return f"{s}(1 + {m}) x 2^({self.exponent} - {self.bias}) = {self.value:.6g}"


def code_info(code: int, fmt: str = "e4m3") -> CodeInfo:
    """Take code (0..255) of fmt apart."""
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code <= 255:
        raise ValueError(f"code must be an int from 0 to 255, got {code!r}")
    exp_bits, man_bits, bias = fp8_layout(fmt)
    value = fp8.decode_code(code, fmt)
    exponent = code >> man_bits & ((1 << exp_bits) - 1)
    if math.isnan(value):
        kind = "nan"
    elif math.isinf(value):
        kind = "inf"
    elif value == 0:
        kind = "zero"
    else:
        kind = "subnormal" if exponent == 0 else "normal"
    up = fp8.decode_code((code & 0x7F) + 1, fmt) if kind not in ("nan",
                                                                 "inf") and code & 0x7F < 0x7F else math.nan
    next_up = up if math.isfinite(up) else None
    return CodeInfo(code, fmt, code >> 7, exponent, code & ((1 << man_bits) - 1), exp_bits, man_bits, bias,
                    kind, value, next_up)


def all_codes(fmt: str = "e4m3") -> list[CodeInfo]:
    return [code_info(c, fmt) for c in range(256)]


def caption(info: CodeInfo) -> str:
    """One line about a code: its bits, kind, value and the step to the next code up."""
    name = FORMAT_NAMES[info.fmt]
    head = f"0x{info.code:02X} = {info.bits} ({name}): {info.kind}, {info.formula}"
    if info.is_max:
        return head + "; the largest finite value: anything beyond it saturates here"
    if info.step is not None and info.kind != "zero":
        return head + (f"; next code up {info.next_up:.6g}, a step of {info.step:.3g} "
                       f"({info.step / abs(info.value):.1%})")
    if info.kind == "zero":
        return head + f"; next code up {info.next_up:.3g}, the smallest subnormal"
    return head


def _position(info: CodeInfo, lo: float, hi: float) -> float:
    """x on the drawn line: log2 |value| for finite non-zero codes; zero left of the smallest
    subnormal, NaN and inf right of the largest finite value (they have no place on a log axis)."""
    if info.kind == "zero":
        return lo - 1.5
    if info.kind in ("nan", "inf"):
        return hi + (1.5 if info.kind == "inf" else 3.0)
    return math.log2(abs(info.value))


def draw_code(fig, info: CodeInfo) -> None:
    """Draw the bit fields of info's code (top) and every non-negative code of its format on a log2
    number line with this one marked (bottom) on fig, a matplotlib Figure of FIGURE_SIZE."""
    codes = all_codes(info.fmt)
    finite = [c for c in codes[:128] if c.kind in ("normal", "subnormal")]
    lo, hi = math.log2(finite[0].value), math.log2(finite[-1].value)

    bits_ax = fig.add_axes((0.02, 0.62, 0.96, 0.34))
    bits_ax.set_xlim(0, 8 * 1.1 + 14)
    bits_ax.set_ylim(0, 1)
    bits_ax.axis("off")
    fields = ["sign"] + ["exponent"] * info.exp_bits + ["mantissa"] * info.man_bits
    for i, (field, bit) in enumerate(zip(fields, f"{info.code:08b}")):
        bits_ax.add_patch(_box(i * 1.1, 0.3, 1.0, 0.6, COLORS[field]))
        bits_ax.text(i * 1.1 + 0.5, 0.6, bit, ha="center", va="center", fontsize=14, family="monospace")
    for field, first, count in (("sign", 0, 1), ("exponent", 1, info.exp_bits),
                                ("mantissa", 1 + info.exp_bits,
                                                                                    info.man_bits)):
        bits_ax.text((first + count / 2) * 1.1 - 0.05, 0.12, field, ha="center", va="center", fontsize=9)
    bits_ax.text(8 * 1.1 + 0.5, 0.75, f"0x{info.code:02X}  {FORMAT_NAMES[info.fmt]}", fontsize=12,
                 va="center", weight="bold")
    bits_ax.text(8 * 1.1 + 0.5, 0.35, info.formula, fontsize=10, va="center")

    line = fig.add_axes((0.04, 0.2, 0.92, 0.26))
    for c in finite:
        line.plot([math.log2(c.value)] * 2, [0, 1], color=COLORS[c.kind], lw=1)
    special = {}  # zero, inf, NaN: drawn beyond the breaks, labelled as ticks
    for c in (codes[0], *(c for c in codes[:128] if c.kind in ("nan", "inf"))):
        x = _position(c, lo, hi)
        line.plot([x] * 2, [0, 1], color=COLORS[c.kind], lw=2)
        special[x] = {"zero": "0", "nan": "NaN", "inf": "inf"}[c.kind]
    for x in (lo - 0.75, hi + 0.75):  # the breaks: zero, NaN and inf are not on the log axis
        line.text(x, 0.5, "//", ha="center", va="center", fontsize=10, color="#555555")
    x = _position(info, lo, hi)
    line.plot([x], [1.25], marker="v", markersize=11, color=COLORS["current"], clip_on=False)
    side = "right" if x > (lo + hi) / 2 else "left"
    if info.kind == "nan":
        label = "NaN"
    elif info.sign:
        label = f"x = {info.value:.6g} (negative: drawn at |x|)"
    else:
        label = f"x = {info.value:.6g}"
    line.text(x + (-0.4 if side == "right" else 0.4), 1.3, label, ha=side, va="bottom", fontsize=10,
              color=COLORS["current"])
    line.set_xlim(lo - 2.2, hi + 3.8)
    line.set_ylim(0, 1)
    ticks = [e for e in range(math.ceil(lo), math.floor(hi) + 1) if e % (2 if hi - lo < 20 else 4) == 0]
    line.set_xticks(ticks + list(special), [f"$2^{{{e}}}$" for e in ticks] + list(special.values()),
                    fontsize=9)
    line.set_yticks([])
    for side_name in ("left", "right", "top"):
        line.spines[side_name].set_visible(False)
    line.set_xlabel("magnitude (log2 scale): subnormals light blue, normals dark blue", fontsize=9)


def _box(x, y, w, h, color):
    from matplotlib.patches import Rectangle

    return Rectangle((x, y), w, h, facecolor=color, edgecolor="#333333")


def code_figure(info: CodeInfo):
    """A matplotlib Figure (not pyplot: nothing shows twice) of FIGURE_SIZE with draw_code on it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=FIGURE_SIZE, dpi=FIGURE_DPI)
    draw_code(fig, info)
    return fig
