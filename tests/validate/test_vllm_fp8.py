"""The FP8 KV cache against vLLM's CPU build: the same format, rounding (toward zero) and scale (1.0)
give the same tokens and logprobs, and the cache bytes match the calculator's."""
from __future__ import annotations

import pytest

from radarlab.validate.vllm_fp8 import VLLM_FP8_DTYPES, ours_for, rows

NEW_TOKENS = 16


@pytest.fixture(scope="module")
def fp8_rows(model, prompts):
    """One vLLM run per FP8 dtype (three processes), rows keyed by (dtype, kind). vLLM 0.32's CPU
    backend takes an FP8 KV cache only with AVX-512 or AMX: an AVX2-only CPU skips, naming the flag."""
    from radarlab.device import cpu_flags, cpu_kind

    flags = cpu_flags()
    if not (flags.get("avx512f") or flags.get("amx_tile")):
        pytest.skip(f"this CPU ({cpu_kind()}) lacks avx512f and amx_tile: vLLM's CPU FP8 KV cache needs one")
    table = rows(model, prompts, max_new_tokens=NEW_TOKENS)
    out = {}
    for r in table:
        dtype = r.check.split("kv_cache_dtype=")[1].split()[0].rstrip(":")
        kind = "bytes" if r.check.startswith("KV cache bytes") else r.check.split(",")[0]
        out[dtype, kind] = r
    return table, out


def test_ours_for_maps_vllm_names():
    assert ours_for("fp8") == ours_for("fp8_e4m3") == "fp8_e4m3_rtz"
    assert ours_for("fp8_e5m2", "rne") == "fp8_e5m2"
    with pytest.raises(ValueError, match="vllm_dtype"):
        ours_for("int4")
    with pytest.raises(ValueError, match="rounding"):
        ours_for("fp8", "stochastic")


@pytest.mark.vllm
def test_every_fp8_row_passes(fp8_rows):
    table, _ = fp8_rows
    assert len(table) == 3 * len(VLLM_FP8_DTYPES)
    failed = [(r.check, r.measured) for r in table if not r.passed]
    assert not failed, failed


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", VLLM_FP8_DTYPES)
def test_cache_bytes_are_one_byte_per_value(fp8_rows, dtype):
    row = fp8_rows[1][dtype, "bytes"]
    d = row.details
    assert d["bytes_per_block"] == d["block_size"] * 30 * 3 * 64 * 2  # layers x kv heads x dim x (K, V)
    assert d["tensor"]["dtype"] == "uint8" and d["bytes"] == d["num_blocks"] * d["bytes_per_block"]
    assert d["isa"] in ("vec", "vec16", "amx") and d["cpu_kind"]


@pytest.mark.vllm
@pytest.mark.parametrize("dtype", VLLM_FP8_DTYPES)
def test_rounding_toward_zero_matches_better(fp8_rows, dtype):
    row = fp8_rows[1][dtype, "greedy"]
    assert row.details["max_dlogprob_rtz"] < row.details["max_dlogprob_rne"]
