"""bench quant: the JSON's shape, and numbers that must hold whatever the machine (small sizes)."""
from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest

from radarlab.bench.kv_quant import QUICK, QuantBenchConfig, Scheme, run

SCHEMES = (Scheme("fp32", "fp32"), Scheme("16-bit", "float16"), Scheme("fp8 e4m3", "fp8_e4m3", "1.0"),
           Scheme("fp8 e4m3 per head", "fp8_e4m3", "head"),
           Scheme("broken: every value saturates", "fp8_e4m3", 1e-4), Scheme("int4", "int4_g32_asym"))


@pytest.fixture(scope="module")
def doc(model, tokenizer):
    config = replace(QuantBenchConfig(**QUICK), schemes=SCHEMES, concurrency_dtypes=("float16", "fp8_e4m3"))
    return run(config, log=lambda *a: None, model=model, tokenizer=tokenizer)


def test_every_scheme_has_every_field(doc):
    assert [r["name"] for r in doc["schemes"]] == [s.name for s in SCHEMES]
    for r in doc["schemes"]:
        assert {"name", "kv_cache_dtype", "bits", "kv_bytes_per_token", "saving", "ppl", "ppl_delta_pct",
                "attn_err"} <= set(r)
        assert math.isfinite(r["ppl"]) and r["ppl"] > 1
    json.dumps(doc)  # all of it is JSON


def test_bytes(doc):
    rows = {r["name"]: r for r in doc["schemes"]}
    sixteen = rows["16-bit"]["kv_bytes_per_token"]
    assert sixteen == 30 * 3 * 64 * 2 * 2  # layers x kv heads x head dim x (K, V) x 2 bytes
    assert rows["fp8 e4m3"]["kv_bytes_per_token"] * 2 == sixteen and rows["fp8 e4m3"]["saving"] == 0.5
    assert rows["fp8 e4m3"]["bits"] == 8
    # int4 g32 asym: 4 bits + an fp16 scale and zero point per 32 values = 5 bits
    assert rows["int4"]["bits"] == 5 and rows["int4"]["saving"] == pytest.approx(1 - 5 / 16)


def test_quality_orders_the_schemes(doc):
    rows = {r["name"]: r for r in doc["schemes"]}
    assert rows["fp32"]["ppl_delta_pct"] == 0 and rows["fp32"]["attn_err"] < 1e-3
    assert abs(rows["16-bit"]["ppl_delta_pct"]) < 0.2
    assert rows["16-bit"]["attn_err"] < 1e-3 < rows["fp8 e4m3"]["attn_err"] < 0.1
    broken, good = rows["broken: every value saturates"], rows["fp8 e4m3"]
    assert broken["attn_err"] > 5 * good["attn_err"] and broken["ppl"] > 1.5 * good["ppl"]


def test_concurrency_on_one_budget(doc):
    sixteen, fp8 = doc["concurrency"]
    assert sixteen["budget_bytes"] == fp8["budget_bytes"]
    assert fp8["num_blocks"] == 2 * sixteen["num_blocks"]
    assert fp8["max_running"] > sixteen["max_running"] >= 1
    n = QUICK["num_requests"] * QUICK["max_tokens"]
    assert sixteen["output_tokens"] == fp8["output_tokens"] == n


@pytest.mark.slow
def test_command_line_writes_json(tmp_path):
    from radarlab.bench.__main__ import main

    path = tmp_path / "quant.json"
    assert main(["quant", "--quick", "--schemes", "fp8_e4m3_rtz", "--concurrency-dtypes", "", "--json",
                 str(path)]) == 0
    doc = json.loads(path.read_text())
    assert [r["kv_cache_dtype"] for r in doc["schemes"]] == ["fp32", "fp8_e4m3_rtz"]
    assert doc["concurrency"] == [] and "cpu" in json.dumps(doc["environment"]).lower()


def test_bad_config_raises():
    with pytest.raises(ValueError, match="attn_tokens"):
        QuantBenchConfig(chunk_len=64, attn_tokens=128)
    with pytest.raises(ValueError, match="scales"):
        QuantBenchConfig(schemes=(Scheme("x", "fp8_e4m3", "per-channel"),))


def test_perplexity_runs_a_given_kivi_quantizer(tiny):
    """perplexity(..., kivi_quantizer=...) scores the functions given: a quantized_length that never
    quantizes keeps every token in the 16-bit tails, the perplexity of a float16 cache."""
    import torch

    from radarlab.bench.kv_quant import perplexity
    from radarlab.quant.kivi import KiviQuantizer

    gens = [torch.Generator().manual_seed(s) for s in (1, 2)]
    chunks = [torch.randint(0, 128, (40,), generator=g).tolist() for g in gens]
    with torch.no_grad():
        fp16 = perplexity(tiny, Scheme("16-bit", "float16"), chunks, 16)
        kivi = perplexity(tiny, Scheme("kivi", "kivi_g8"), chunks, 16)
        never = perplexity(tiny, Scheme("kivi", "kivi_g8"), chunks, 16,
                           kivi_quantizer=KiviQuantizer(quantized_length=lambda n, g, r: 0))
    assert math.isclose(never, fp16, rel_tol=1e-5) and not math.isclose(kivi, fp16, rel_tol=1e-5)
