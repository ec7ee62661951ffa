"""The table of KV formats: names, bytes with every overhead counted, bad names."""
from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from radarlab.quant.formats import KV_CACHE_DTYPES, kv_format


@pytest.mark.parametrize("name, canonical, bits", [
    ("auto", "auto", 16.0), ("fp16", "float16", 16.0), ("bfloat16", "bfloat16", 16.0), ("fp32", "fp32", 32.0),
    ("fp8", "fp8_e4m3", 8.0), ("fp8_e4m3", "fp8_e4m3", 8.0), ("fp8_e5m2", "fp8_e5m2", 8.0),
    ("fp8_per_token_head", "fp8_per_token_head", 8.25),  # an fp16 scale per 64 values
    ("int4_g64_sym", "int4_g64_sym", 4.25), ("int4_g64", "int4_g64_asym", 4.5),
    ("int4_g32_asym", "int4_g32_asym", 5.0), ("int4_g32_asym_fp8scales", "int4_g32_asym_fp8scales", 4.5),
    ("kivi_g64", "kivi_g64", 4.5), ("kivi", "kivi_g32", 5.0), ("kivi_r128_g32", "kivi_g32_r128", 5.0),
    ("int4_hadamard_g64_sym", "int4_g64_sym_hadamard", 4.25), ("fp8_rtz", "fp8_e4m3_rtz", 8.0),
])
def test_names_and_bits_per_value_for_head_dim_64(name, canonical, bits):
    fmt = kv_format(name)
    assert fmt.name == canonical
    assert fmt.bits_per_value(64) == bits
    assert kv_format(fmt.name) == fmt  # the canonical name parses back to the same format


def test_bytes_are_exact_and_split_into_payload_and_overhead():
    # K+V: 2x64 B + 2x4 B
    assert kv_format("int4_g128").bytes_per_token_head(128) == (Fraction(128), Fraction(8))
    assert kv_format("fp8").bytes_per_token_head(64) == (Fraction(128), Fraction(0))
    assert kv_format("fp8_per_token_head").bytes_per_token_head(64) == (Fraction(128), Fraction(4))
    assert kv_format("kivi_g32").bytes_per_token_head(64) == (Fraction(64), Fraction(16))
    assert kv_format("auto").bytes_per_token_head(64, torch.float32) == (Fraction(512), Fraction(0))
    fmt = kv_format("fp8_e5m2")
    assert fmt.storage_dtype == torch.uint8 and fmt.fp8 == "e5m2" and fmt.is_quantized


def test_group_size_argument_only_when_the_name_gives_none():
    assert kv_format("int4", 32).group_size == 32
    assert kv_format("int4_g64", 32).group_size == 64
    assert kv_format("int4").group_size == 128  # the article's group


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="must be one of auto, float16, .*fp8_e5m2.*int4, kivi"):
        kv_format("fp4")
    with pytest.raises(ValueError, match="unknown option 'g64' for fp8"):
        kv_format("fp8_g64")
    with pytest.raises(ValueError, match="unknown option 'rtz' for int4"):
        kv_format("int4_rtz")
    with pytest.raises(ValueError, match="option 'gx' must be g<positive int>"):
        kv_format("int4_gx")
    with pytest.raises(ValueError, match="kivi is asymmetric"):
        kv_format("kivi_sym")
    with pytest.raises(ValueError, match="must be a string"):
        kv_format(8)
    assert set(KV_CACHE_DTYPES) >= {"auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int4", "kivi"}


@pytest.mark.parametrize("name, head_dim, message", [
    ("int4_g48", 64, r"group_size \(48\) must divide head_dim \(64\)"),
    ("kivi_g128", 64, r"group_size \(128\) must divide head_dim \(64\)"),
    ("fp8_hadamard", 96, "Hadamard rotation needs head_dim to be a power of two"),
])
def test_group_must_divide_head_dim(name, head_dim, message):
    with pytest.raises(ValueError, match=message):
        kv_format(name).bits_per_value(head_dim)
