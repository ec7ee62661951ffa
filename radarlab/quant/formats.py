"""The table of KV-cache formats: one definition of every `kv_cache_dtype` the course knows.

A format says how one K or V value is stored and what it costs, every overhead counted:

- vLLM's names: `auto` (the model's dtype), `float16`/`bfloat16` (also `fp16`/`bf16`), `fp8` (= `fp8_e4m3`),
  `fp8_e5m2`, and `fp8_per_token_head` (E4M3 with a dynamic scale per token and head, stored beside
  the codes in a block-shaped scale cache; vLLM's Triton backend keeps those scales in float32, we
  keep them in fp16: 8.25 bits per value at head_dim 64 instead of 8.5). `fp32` is ours: an unquantized
  float32 cache, what the course's fp32 runs use.
- ours: `int4` (group-wise along head_dim) and `kivi` (keys per channel in groups along tokens, values
  per token, an optional 16-bit residual window).

Options follow the base name, separated by underscores, in any order:

    g<N>        group size (int4: values of one token and head sharing a scale; kivi: both the tokens
                of one key group and the values of one value group)
    sym, asym   symmetric (a scale per group) or asymmetric (a scale and a zero point per group)
    fp8scales   scales and zero points stored as FP8 E4M3 instead of fp16
    int8zeros   asym only: the zero point is an integer code in int8 (x = (q - z) * scale) instead of a
                float minimum; with fp8scales, 1 + 1 bytes per group (4.5 bits/value at g32)
    r<N>        kivi only: the newest N tokens stay in 16-bit (the residual window)
    rtz         fp8 only: round toward zero (what vLLM's CPU kernels do) instead of to nearest even
    hadamard, orthogonal   rotate K and q along head_dim before quantizing K
    vrot        with a rotation: rotate V too, and the attention output back (o = o' R^T, per head), so
                V's outliers are spread as well; a separate option so the K-only rotation stays measurable
    sink<N>     quantized formats: the first N tokens of every sequence stay in 16-bit, K and V, every layer
                (the attention sink); a per-sequence cost, counted per stream, not per token

So `int4_g64_asym_hadamard` is INT4 in groups of 64 with fp16 scales and zero points, on rotated keys.
`kv_format(name)` parses a name (or passes a KVFormat through) and raises ValueError naming the valid
bases and options. Everything that counts KV bytes (kvcache.memory, lab.roofline, the notebook
widget, the paged cache) reads it here.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from fractions import Fraction

import torch

from radarlab.util import require_int

FP8_FORMATS = ("e4m3", "e5m2")
ROUNDINGS = ("rne", "rtz")
ROTATIONS = ("hadamard", "orthogonal")
SCALE_DTYPES = ("fp16", "fp8")
SCALE_BYTES = {"fp16": 2, "fp8": 1}
DEFAULT_GROUP_SIZE = 128  # the article's INT4 group
KIVI_GROUP_SIZE = 32  # KIVI's paper

# base name -> (kind, payload bits, storage dtype, fp8 format); kind decides the codec.
_BASES = {
    "auto": ("float", None, None, None),
    "float16": ("float", 16, torch.float16, None),
    "fp16": ("float", 16, torch.float16, None),
    "bfloat16": ("float", 16, torch.bfloat16, None),
    "bf16": ("float", 16, torch.bfloat16, None),
    "fp32": ("float", 32, torch.float32, None),
    "fp8": ("fp8", 8, torch.uint8, "e4m3"),
    "fp8_e4m3": ("fp8", 8, torch.uint8, "e4m3"),
    "fp8_e5m2": ("fp8", 8, torch.uint8, "e5m2"),
    "fp8_per_token_head": ("fp8", 8, torch.uint8, "e4m3"),
    "int4": ("int4", 4, torch.uint8, None),
    "kivi": ("kivi", 4, torch.uint8, None),
}
KV_CACHE_DTYPES = tuple(_BASES)
_OPTIONS = "g<N>, sym, asym, fp8scales, int8zeros, r<N>, rtz, hadamard, orthogonal, vrot, sink<N>"


@dataclass(frozen=True)
class KVFormat:
    """One KV-cache format. `bits` is the payload per value (None for auto: the model's dtype).

    fp8: `scale_rule` is "tensor" (k_scale/v_scale passed to the kernels, as vLLM does; per head works
    the same way) or "token_head" (a dynamic scale per token and head, stored in the cache).
    int4/kivi: `group_size`, `symmetric` and `scale_dtype` say what the groups store.
    """

    name: str
    kind: str  # "float" | "fp8" | "int4" | "kivi"
    bits: int | None
    storage_dtype: torch.dtype | None  # None: the model's dtype (auto)
    fp8: str | None = None  # "e4m3" | "e5m2"
    rounding: str = "rne"
    scale_rule: str | None = None  # fp8: "tensor" | "token_head"
    group_size: int | None = None
    symmetric: bool = False
    scale_dtype: str = "fp16"
    residual: int = 0  # kivi: tokens kept in 16-bit
    rotation: str | None = None
    int8_zeros: bool = False  # asym: zero points as int8 codes, not float minima
    rotate_values: bool = False  # vrot: V rotated too, the attention output rotated back
    sink: int = 0  # the first `sink` tokens of every sequence kept in 16-bit

    @property
    def is_quantized(self) -> bool:
        return self.kind != "float"

    @property
    def is_packed(self) -> bool:
        """Two 4-bit values per byte."""
        return self.kind in ("int4", "kivi")

    def resolve(self, model_dtype: torch.dtype) -> "KVFormat":
        """auto made concrete: the model's dtype. Other formats are returned unchanged."""
        if self.name != "auto":
            return self
        for base, (_, bits, dtype, _) in _BASES.items():
            if dtype == model_dtype and bits is not None:
                return replace(self, bits=bits, storage_dtype=dtype)
        raise ValueError(f"auto: no KV format stores {model_dtype}")

    def check_head_dim(self, head_dim: int) -> int:
        """Groups run along head_dim, so they must divide it; a Hadamard rotation needs a power of two."""
        head_dim = require_int("head_dim", head_dim)
        if self.group_size is not None and head_dim % self.group_size:
            raise ValueError(f"group_size ({self.group_size}) must divide head_dim ({head_dim}): groups are "
                             f"taken along each head's {head_dim} values; try one of "
                             f"{[d for d in (16, 32, 64, 128, 256) if head_dim % d == 0]}")
        if self.is_packed and head_dim % 2:
            raise ValueError(f"head_dim ({head_dim}) must be even to pack two 4-bit values per byte")
        if self.rotation == "hadamard" and head_dim & (head_dim - 1):
            raise ValueError(f"a Hadamard rotation needs head_dim to be a power of two, got {head_dim}")
        return head_dim

    @property
    def metadata_bytes_per_group(self) -> int:
        """A scale, plus a zero point when asymmetric: in the scale dtype, or one int8 byte (int8zeros)."""
        if self.symmetric:
            return SCALE_BYTES[self.scale_dtype]
        return SCALE_BYTES[self.scale_dtype] + (1 if self.int8_zeros else SCALE_BYTES[self.scale_dtype])

    def sink_bytes_per_stream(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """The 16-bit copies of a sequence's first `sink` tokens, K and V, all layers: paid once per
        sequence, on top of the same tokens' quantized codes (which the cache also keeps)."""
        return self.sink * num_layers * num_kv_heads * head_dim * 2 * 2

    def bytes_per_token_head(self, head_dim: int,
                             model_dtype: torch.dtype = torch.float16) -> tuple[Fraction, Fraction]:
        """(payload, overhead) bytes one token takes in one head for K and V together, exact.

        Overhead is the scales and zero points: int4, a group of g values along head_dim; kivi keys,
        one scale (and zero) per channel for every g tokens, values as int4; fp8_per_token_head, one
        fp16 scale per token and head for K and one for V. The kivi residual window (its newest
        `residual` tokens in 16-bit) and the sink (sink_bytes_per_stream) are per-sequence costs, counted by
        kvcache.memory.kv_footprint."""
        fmt = self.resolve(model_dtype)
        d = fmt.check_head_dim(head_dim)
        payload = Fraction(2 * d * fmt.bits, 8)
        if fmt.kind == "fp8":
            overhead = Fraction(2 * SCALE_BYTES["fp16"]) if fmt.scale_rule == "token_head" else Fraction(0)
        elif fmt.kind in ("int4", "kivi"):  # kivi keys: d scales per g tokens; values: d / g per token
            overhead = 2 * Fraction(d, fmt.group_size) * fmt.metadata_bytes_per_group
        else:
            overhead = Fraction(0)
        return payload, overhead

    def bits_per_value(self, head_dim: int, model_dtype: torch.dtype = torch.float16) -> float:
        """Payload plus overhead, in bits per stored value (e.g. 4.5 for int4_g64_asym)."""
        payload, overhead = self.bytes_per_token_head(head_dim, model_dtype)
        return float((payload + overhead) * 8 / (2 * head_dim))

    def payload_bytes_per_value(self, model_dtype: torch.dtype = torch.float16) -> float:
        """2 for 16-bit, 1 for fp8, 0.5 for int4: the codes alone, no scales."""
        return self.resolve(model_dtype).bits / 8


def _parse_size(name: str, option: str, letter: str) -> int:
    try:
        return require_int(f"{name}: {letter}<N>", int(option[1:]))
    except ValueError:
        raise ValueError(f"kv_cache_dtype {name!r}: option {option!r} must "
                         f"be {letter}<positive int>") from None


def kv_format(kv_cache_dtype: "str | KVFormat", group_size: int | None = None) -> KVFormat:
    """The KVFormat of a name such as "fp8", "int4_g64_sym" or "kivi_g32_r128_hadamard".

    group_size is used when the name gives none (the memory calculator's --group-size)."""
    if isinstance(kv_cache_dtype, KVFormat):
        return kv_cache_dtype
    if not isinstance(kv_cache_dtype, str):
        raise ValueError(f"kv_cache_dtype must be a string, got {kv_cache_dtype!r}")
    name = kv_cache_dtype.strip().lower()
    base = max((b for b in _BASES if name == b or name.startswith(b + "_")), key=len, default=None)
    if base is None:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} (options: {_OPTIONS}); "
                         f"got {kv_cache_dtype!r}")
    kind, bits, dtype, fp8 = _BASES[base]
    opts = dict(rounding="rne", symmetric=False, scale_dtype="fp16", residual=0, rotation=None,
                int8_zeros=False, rotate_values=False, sink=0)
    group = None
    for option in name[len(base):].split("_")[1:]:
        if option in ("sym", "asym") and kind in ("int4", "kivi"):
            opts["symmetric"] = option == "sym"
        elif option == "fp8scales" and kind in ("int4", "kivi"):
            opts["scale_dtype"] = "fp8"
        elif option == "int8zeros" and kind in ("int4", "kivi"):
            opts["int8_zeros"] = True
        elif option == "vrot":
            opts["rotate_values"] = True
        elif option.startswith("sink") and kind != "float":
            opts["sink"] = _parse_sink(name, option)
        elif option.startswith("g") and kind in ("int4", "kivi"):
            group = _parse_size(name, option, "g")
        elif option.startswith("r") and option != "rtz" and kind == "kivi":
            opts["residual"] = _parse_size(name, option, "r")
        elif option == "rtz" and kind == "fp8":
            opts["rounding"] = "rtz"
        elif option in ROTATIONS:  # on a float cache too: the exact reference of a rotated format
            opts["rotation"] = option
        else:
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: unknown option {option!r} for {base} "
                             f"(bases: {', '.join(KV_CACHE_DTYPES)}; options: {_OPTIONS}; g, sym, asym and "
                             "fp8scales, int8zeros are for int4 and kivi, r for "
                             "kivi, rtz for fp8, rotations, sink for any quantized base, "
                             "rotations and vrot for any)")
    if opts["rotate_values"] and not opts["rotation"]:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: vrot rotates V by the format's rotation; add "
                         f"hadamard or orthogonal")
    if opts["int8_zeros"] and opts["symmetric"]:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: int8zeros needs asym (sym has no zero point)")
    if kind in ("int4", "kivi"):
        if group is None:
            group = require_int("group_size", group_size) if group_size is not None else (
                DEFAULT_GROUP_SIZE if kind == "int4" else KIVI_GROUP_SIZE)
        if opts["symmetric"] and kind == "kivi":
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r}: kivi is "
                             "asymmetric (a zero point per group)")
    if kind == "fp8":
        opts["scale_rule"] = "token_head" if base == "fp8_per_token_head" else "tensor"
    canonical = _canonical(base, kind, group, opts)
    return KVFormat(canonical, kind, bits, dtype, fp8, group_size=group, **opts)


def _canonical(base: str, kind: str, group, opts: dict) -> str:
    """One spelling per format: fp8 -> fp8_e4m3, fp16 -> float16, options in a fixed order."""
    base = {"fp8": "fp8_e4m3", "fp16": "float16", "bf16": "bfloat16"}.get(base, base)
    parts = [base]
    if kind in ("int4", "kivi"):
        parts.append(f"g{group}")
        if kind == "int4":
            parts.append("sym" if opts["symmetric"] else "asym")
        if opts["scale_dtype"] == "fp8":
            parts.append("fp8scales")
        if opts["int8_zeros"]:
            parts.append("int8zeros")
        if opts["residual"]:
            parts.append(f"r{opts['residual']}")
    if opts["rounding"] == "rtz":
        parts.append("rtz")
    if opts["rotation"]:
        parts.append(opts["rotation"])
    if opts["rotate_values"]:
        parts.append("vrot")
    if opts["sink"]:
        parts.append(f"sink{opts['sink']}")
    return "_".join(parts)


def _parse_sink(name: str, option: str) -> int:
    try:
        return require_int(f"{name}: sink<N>", int(option[4:]))
    except ValueError:
        raise ValueError(f"kv_cache_dtype {name!r}: option {option!r} must be sink<positive int>") from None
