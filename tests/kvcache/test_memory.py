"""The KV-cache calculator: the article's VRAM column, INT4's metadata, the CLI and bad inputs."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import given, strategies as st

from radarlab.kvcache import memory
from radarlab.kvcache.memory import (
    GB,
    int4_bytes_per_value,
    int4_overhead_bytes_per_value,
    kv_bytes_per_token,
    kv_footprint,
    kv_report,
    max_concurrent_streams,
    shape_from_hf_config,
)

ARTICLE = dict(layers=80, kv_heads=8, head_dim=128, tokens=32768)


@pytest.mark.parametrize("kv_dtype, shown", [("fp16", "10.74"), ("bf16", "10.74"), ("fp8", "5.37")])
def test_article_vram_column(kv_dtype, shown):
    fp = kv_footprint(**ARTICLE, kv_dtype=kv_dtype)
    assert f"{fp.gb_per_stream:.2f}" == shown
    assert fp.overhead_bytes_per_token == 0


def test_article_int4_payload_and_overhead_shown_apart():
    fp = kv_footprint(**ARTICLE, kv_dtype="int4", group_size=128)
    assert f"{fp.payload_gb_per_stream:.2f}" == "2.68"  # the article's figure: payload only
    assert fp.payload_bytes_per_stream == 80 * 8 * 128 * 2 * 32768 // 2
    # one fp16 scale + one fp16 zero point per 128 values
    assert fp.overhead_bytes_per_stream == 80 * 8 * 128 * 2 * 32768 // 128 * 4
    assert f"{fp.overhead_gb_per_stream:.2f}" == "0.17"
    assert f"{fp.gb_per_stream:.2f}" == "2.85"
    assert fp.bytes_per_stream == fp.payload_bytes_per_stream + fp.overhead_bytes_per_stream


def test_exact_bytes_per_token():
    assert kv_bytes_per_token(80, 8, 128, "fp16") == 327_680
    assert kv_bytes_per_token(80, 8, 128, "fp8") == 163_840
    assert kv_bytes_per_token(80, 8, 128, "int4", 128) == 81_920 + 5_120
    assert kv_bytes_per_token(30, 3, 64, "bf16") == 23_040  # the course model


@pytest.mark.parametrize("g", [16, 32, 64, 128])
def test_int4_costs_half_a_byte_plus_4_over_g(g):
    values = 80 * 8 * 128 * 2
    fp = kv_footprint(80, 8, 128, 1, "int4", g)
    assert fp.bytes_per_token == values * (0.5 + 4 / g)
    assert int4_bytes_per_value(g) == 0.5 + 4 / g
    assert int4_overhead_bytes_per_value(g) == 4 / g


def test_int4_savings_match_environment_notes():
    """62.5% saving at g=16, 68.75% at g=32, 71.9% at g=64, against fp16."""
    fp16 = kv_bytes_per_token(80, 8, 128, "fp16")
    saving = {g: 1 - kv_bytes_per_token(80, 8, 128, "int4", g) / fp16 for g in (16, 32, 64)}
    assert saving[16] == pytest.approx(0.625)
    assert saving[32] == pytest.approx(0.6875)
    assert round(saving[64], 3) == 0.719


@given(layers=st.integers(1, 200), kv_heads=st.integers(1, 64),
       head_dim=st.sampled_from([32, 64, 96, 128, 256]),
       tokens=st.integers(1, 200_000), g=st.sampled_from([16, 32]))
def test_formats_scale_as_their_bytes(layers, kv_heads, head_dim, tokens, g):
    fp16 = kv_footprint(layers, kv_heads, head_dim, tokens, "fp16").bytes_per_stream
    assert fp16 == layers * kv_heads * head_dim * 2 * 2 * tokens
    assert kv_footprint(layers, kv_heads, head_dim, tokens, "fp8").bytes_per_stream * 2 == fp16
    int4 = kv_footprint(layers, kv_heads, head_dim, tokens, "int4", g)
    assert int4.payload_bytes_per_stream * 4 == fp16
    assert int4.overhead_bytes_per_stream * g == 2 * fp16  # 4 bytes per g values vs 2 bytes per value


def test_concurrency_against_48_gb():
    per = {d: kv_footprint(**ARTICLE, kv_dtype=d).gb_per_stream for d in ("fp16", "fp8")}
    int4_payload = kv_footprint(**ARTICLE, kv_dtype="int4").payload_gb_per_stream
    assert max_concurrent_streams(48, 0, per["fp16"]) == 4  # the article's 4 holds, with no weights
    assert max_concurrent_streams(48, 0, per["fp8"]) == 8  # not 10
    assert max_concurrent_streams(48, 0, int4_payload) == 17  # not 22
    assert 10 * per["fp8"] > 48 and 22 * int4_payload > 48
    assert max_concurrent_streams(48, 140, per["fp16"]) == 0  # fp16 70B weights do not fit at all
    assert max_concurrent_streams(48, 35, per["fp16"]) == 1
    assert max_concurrent_streams(48, 0, 12) == 4  # exact division is not lost to float rounding


def test_report_without_gpu_has_no_streams():
    r = kv_report(**ARTICLE)
    assert "max_concurrent_streams" not in r
    assert r["bytes_per_token"] == 327_680 and r["group_size"] is None


@pytest.mark.parametrize("field", ["layers", "kv_heads", "head_dim", "tokens"])
@pytest.mark.parametrize("bad", [0, -8])
def test_nonpositive_sizes_name_the_field(field, bad):
    args = dict(ARTICLE, **{field: bad})
    with pytest.raises(ValueError, match=field):
        kv_footprint(**args)


def test_non_integer_size_rejected():
    with pytest.raises(ValueError, match="head_dim"):
        kv_footprint(80, 8, 127.5, 10)


@pytest.mark.parametrize("g", [0, -128])
def test_bad_group_size(g):
    with pytest.raises(ValueError, match="group_size"):
        kv_footprint(**ARTICLE, kv_dtype="int4", group_size=g)


def test_group_size_must_divide_head_dim():
    with pytest.raises(ValueError, match=r"group_size \(48\) must divide head_dim \(128\)"):
        kv_footprint(**ARTICLE, kv_dtype="int4", group_size=48)
    with pytest.raises(ValueError, match="must divide head_dim"):
        kv_footprint(30, 3, 64, 10, "int4", 128)  # the course model's heads are only 64 wide


def test_unknown_dtype():
    with pytest.raises(ValueError,
                       match="kv_cache_dtype must be one of auto, float16, .*fp8_e5m2.*int4, kivi"):
        kv_footprint(**ARTICLE, kv_dtype="fp4")


@pytest.mark.parametrize("gpu, weights, field",
                         [(0, 0, "gpu_mem_gb"), (-48, 0, "gpu_mem_gb"), (48, -1, "weights_gb")])
def test_bad_memory_names_the_field(gpu, weights, field):
    with pytest.raises(ValueError, match=field):
        max_concurrent_streams(gpu, weights, 1.0)


def test_shape_from_hf_config_reads_the_fields():
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8, hidden_size=8192,
                      head_dim=128)
    assert shape_from_hf_config(cfg) == memory.KVModelShape(80, 8, 128)
    # config.json as a dict; no head_dim and no GQA: derived from hidden_size / heads
    assert shape_from_hf_config({"num_hidden_layers": 12, "num_attention_heads": 12, "hidden_size": 768}) == \
        memory.KVModelShape(12, 12, 64)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        shape_from_hf_config({"num_attention_heads": 12})


def test_shape_from_course_model_config():
    from transformers import AutoConfig

    from radarlab.models.loader import course_model_dir

    try:
        path = course_model_dir(convert=False)
    except Exception as err:  # the converted model is made by `make model`
        pytest.skip(str(err))
    shape = shape_from_hf_config(AutoConfig.from_pretrained(path))
    assert shape == memory.KVModelShape(30, 3, 64)


def _cli(*args, capsys=None):
    """Run the CLI in-process (fast); returns (exit code, stdout, stderr)."""
    try:
        code = memory.main(list(args))
    except SystemExit as exc:  # argparse errors exit 2
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_as_a_module_prints_json():
    """The real entry point, once, in a subprocess: `python -m radarlab.kvcache.memory`."""
    run = subprocess.run([sys.executable, "-m", "radarlab.kvcache.memory", "--kv-dtype", "fp8", "--json"],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert f"{json.loads(run.stdout)['gb_per_stream']:.2f}" == "5.37"


def test_cli_json_reproduces_the_article(capsys):
    for dtype, key, shown in [("fp16", "gb_per_stream", "10.74"), ("fp8", "gb_per_stream", "5.37"),
                              ("int4", "payload_gb_per_stream", "2.68")]:
        code, stdout, stderr = _cli("--layers", "80", "--kv-heads", "8", "--head-dim", "128", "--tokens",
                                    "32768",
                                    "--kv-dtype", dtype, "--gpu-mem-gb", "48", "--weights-gb", "0", "--json",
                                    capsys=capsys)
        assert code == 0, stderr
        out = json.loads(stdout)
        assert f"{out[key]:.2f}" == shown
    assert out["overhead_bytes_per_stream"] == 167_772_160
    assert out["bytes_per_stream"] == out["payload_bytes_per_stream"] + out["overhead_bytes_per_stream"]
    assert out["max_concurrent_streams"] == 16
    assert out["gb_per_stream"] == out["bytes_per_stream"] / GB


def test_cli_text_shows_int4_overhead_separately(capsys):
    code, stdout, _ = _cli("--kv-dtype", "int4", "--group-size", "128", "--gpu-mem-gb", "48", capsys=capsys)
    assert code == 0
    assert "2.68 GB payload + 0.17 GB scales/zero points = 2.85 GB" in stdout
    assert "max concurrent streams: 16" in stdout


def test_cli_weights_that_do_not_fit(capsys):
    code, stdout, _ = _cli("--gpu-mem-gb", "48", "--weights-gb", "140", capsys=capsys)
    assert code == 0
    assert "do not fit" in stdout


@pytest.mark.parametrize("args, flag", [(["--head-dim", "0"], "--head-dim"), (["--layers", "-1"], "--layers"),
                                        (["--kv-dtype", "int4", "--group-size", "96"], "--group-size"),
                                        (["--gpu-mem-gb", "48", "--weights-gb", "-2"], "--weights-gb")])
def test_cli_bad_input_names_the_flag(args, flag, capsys):
    code, _, stderr = _cli(*args, capsys=capsys)
    assert code == 2
    assert flag in stderr and "Traceback" not in stderr


def test_every_format_of_the_table_is_counted_with_its_overhead():
    """The calculator reads radarlab.quant.formats: fp8 per token and head pays an fp16 scale per head
    vector, kivi's residual window pays 16 bits for its newest tokens."""
    values = 30 * 3 * 64 * 2
    assert kv_bytes_per_token(30, 3, 64, "fp8_per_token_head") == values + 30 * 3 * 2 * 2
    assert kv_bytes_per_token(30, 3, 64, "int4_g64_sym") == values // 2 + 30 * 3 * 2 * 2
    assert kv_bytes_per_token(30, 3, 64, "fp32") == values * 4
    plain = kv_footprint(30, 3, 64, 1000, "kivi_g32")
    window = kv_footprint(30, 3, 64, 1000, "kivi_g32_r128")
    assert window.bytes_per_token == plain.bytes_per_token
    assert (window.bytes_per_stream - plain.bytes_per_stream
            == 128 * (30 * 3 * 64 * 2 * 2 - plain.bytes_per_token))
    short = kv_footprint(30, 3, 64, 10, "kivi_g32_r128")  # a stream shorter than the window is all 16-bit
    assert short.bytes_per_stream == 10 * 30 * 3 * 64 * 2 * 2


def test_cli_takes_any_format_name(capsys):
    code, stdout, _ = _cli("--model", "smollm2-135m", "--kv-dtype", "int4_g32_sym", "--tokens", "1",
                           capsys=capsys)
    assert code == 0 and "bytes per token:  5,760 payload + 720 scales/zero points = 6,480" in stdout
    code, _, stderr = _cli("--kv-dtype", "fp4", capsys=capsys)
    assert code == 2 and "--kv-dtype must be one of auto" in stderr


# --- past one machine: weights, and one GPU's share under tensor and pipeline parallelism ----------

def test_llama_parameters_of_published_configs():
    from radarlab.kvcache.memory import llama_parameters
    from radarlab.kvcache.model_config import stored_config

    # Meta's model cards: 70.6 B and 8.03 B; SmolLM2-135M ties its embedding (134.5 M)
    assert llama_parameters(stored_config("llama-3.1-70b")) == 70_553_706_496
    assert round(llama_parameters(stored_config("llama-3.1-8b")) / 1e9, 2) == 8.03
    assert round(llama_parameters(stored_config("smollm2-135m")) / 1e6, 1) == 134.5
    with pytest.raises(ValueError, match="intermediate_size"):
        llama_parameters({"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 8,
                          "vocab_size": 4})


def test_parallel_footprint_follows_vllms_split():
    from radarlab.kvcache.memory import KVModelShape, kv_footprint, parallel_footprint

    shape = KVModelShape(80, 8, 128)
    one = kv_footprint(80, 8, 128, 32768, "fp16").bytes_per_stream
    assert one == 10_737_418_240  # the article's 10.74 GB
    for tp in (1, 2, 4, 8):
        f = parallel_footprint(shape, 32768, "fp16", tp, 1, 0, 80 * 10**9, 1.0)
        assert f.kv_heads_per_gpu == 8 // tp and f.kv_bytes_per_stream_per_gpu == one // tp
        assert f.streams == 80 * 10**9 // (one // tp)
    wide = parallel_footprint(shape, 32768, "fp16", 16, 1, 0, 80 * 10**9)
    assert wide.kv_heads_per_gpu == 1 and wide.kv_bytes_per_stream_per_gpu == one // 8  # replicated heads
    staged = parallel_footprint(shape, 32768, "fp16", 1, 3, 0, 80 * 10**9)
    assert staged.layers_per_gpu == 27  # 27 + 27 + 26: the largest stage counts
    full = parallel_footprint(shape, 32768, "fp16", 1, 1, 141 * 10**9, 80 * 10**9)
    assert full.kv_budget_bytes_per_gpu < 0 and full.streams == 0
    split = parallel_footprint(shape, 32768, "fp16", 4, 2, 8 * 10**9, 80 * 10**9, 0.9, 2 * 10**9)
    assert split.weight_bytes_per_gpu == int((6 * 10**9 / 2 + 10**9) / 4)
    assert split.streams_per_gpu == split.streams / 8


@pytest.mark.parametrize("kwargs, message", [
    ({"tp": 3}, "tp=3 must divide the 8 KV heads"),
    ({"pp": 81}, "pp=81 exceeds"),
    ({"tp": 0}, "tp"),
    ({"gpu_memory_utilization": 1.5}, "fraction"),
    ({"weight_bytes": -1}, "weight_bytes"),
])
def test_parallel_footprint_rejects_bad_splits(kwargs, message):
    from radarlab.kvcache.memory import KVModelShape, parallel_footprint

    args = {"tp": 2, "pp": 1, "weight_bytes": 0, "gpu_memory_utilization": 0.9} | kwargs
    with pytest.raises(ValueError, match=message):
        parallel_footprint(KVModelShape(80, 8, 128), 32768, "fp16", args["tp"], args["pp"],
                           args["weight_bytes"], 80 * 10**9, args["gpu_memory_utilization"])
