"""The KV calculator widget, driven from Python: no browser needed."""
from __future__ import annotations

import pytest

from radarlab.kvcache.model_config import stored_config_names
from radarlab.viz.widgets import kv_calculator, token_options


def test_widget_label_follows_its_controls():
    w = kv_calculator()  # the article's model, 32k tokens, 48 GB, no weights
    assert "327,680 bytes/token" in w.result.value
    assert "10.74 GB per stream" in w.result.value and "4 streams" in w.result.value
    w.controls["kv_dtype"].value = "fp8"
    assert "5.37 GB per stream" in w.result.value and "8 streams" in w.result.value
    w.controls["kv_dtype"].value = "int4"
    assert "2.68 GB payload + 0.17 GB scales/zeros = 2.85 GB per stream" in w.result.value
    w.controls["weights_gb"].value = 140.0
    assert "exceed the GPU" in w.result.value


def test_widget_reports_bad_combinations_in_place():
    w = kv_calculator()
    w.controls["head_dim"].value = 64
    w.controls["kv_dtype"].value = "int4"
    assert w.result.value.startswith("cannot compute: group_size (128) must divide head_dim (64)")
    w.controls["group_size"].value = 32
    assert "bytes/token" in w.result.value


def test_tokens_slider_is_log_scaled():
    """Powers of two from 1 to 131,072: one notch doubles the context, so a drag or an arrow key moves a
    visible step and any power of two can be hit exactly."""
    tokens = kv_calculator().controls["tokens"]
    assert [value for _, value in tokens.options] == [2**k for k in range(18)]
    assert tokens.options[-1] == ("131,072", 131072) and tokens.value == 32768
    assert [v for _, v in token_options(1000)][9:12] == [512, 1000, 1024]  # a value given is kept
    with pytest.raises(ValueError, match="tokens must be a positive int"):
        token_options(0)


def test_tokens_slider_drives_the_output():
    w = kv_calculator()
    w.controls["tokens"].value = 1024
    assert "0.34 GB per stream" in w.result.value  # 327,680 x 1,024 bytes
    w.controls["tokens"].index = w.controls["tokens"].index + 1  # one notch right: twice the context
    assert w.controls["tokens"].value == 2048 and "0.67 GB per stream" in w.result.value


def test_model_dropdown_sets_the_shape_and_the_output():
    w = kv_calculator(gpu_mem_gb=48)
    assert w.model.value == "llama-3.1-70b"  # the default shape is the article's model
    assert [name for _, name in w.model.options][1:] == list(stored_config_names())
    w.model.value = "qwen2.5-7b"
    assert (w.values()["layers"], w.values()["kv_heads"], w.values()["head_dim"]) == (28, 4, 128)
    assert w.result.value.startswith("57,344 bytes/token | 1.88 GB per stream | 25 streams")
    w.model.value = "smollm2-135m"
    assert w.result.value.startswith("23,040 bytes/token")
    w.controls["layers"].value = 10  # no longer SmolLM2's shape
    assert w.model.value == "" and w.result.value.startswith("7,680 bytes/token")


def test_model_argument():
    assert kv_calculator(model="Qwen/Qwen2.5-7B").result.value.startswith("57,344 bytes/token")
    assert kv_calculator(layers=32).model.value == ""  # Llama-3.1-8B and Mistral-7B share (32, 8, 128)
    with pytest.raises(ValueError, match="model must be one of llama-3.1-70b, .*got 'gpt-9'"):
        kv_calculator(model="gpt-9")


def test_streams_are_counted_in_the_room_the_weights_leave():
    w = kv_calculator(gpu_mem_gb=48)
    assert "4 streams fit in 48.00 GB (all of the GPU: no weights counted)" in w.result.value
    w.controls["weights_gb"].value = 40.0
    assert "0 streams fit in the 8.00 GB left after 40.00 GB of weights (GPU 48.00 GB)" in w.result.value
    w.controls["weights_gb"].value = 36.0
    assert "1 stream fits in the 12.00 GB left after 36.00 GB of weights" in w.result.value


def test_widget_offers_every_format_of_the_table():
    from radarlab.quant.formats import KV_CACHE_DTYPES

    w = kv_calculator(model="smollm2-135m", tokens=1)
    assert list(w.controls["kv_dtype"].options) == list(KV_CACHE_DTYPES)
    w.controls["group_size"].value = 32
    w.controls["kv_dtype"].value = "kivi"  # keys per channel over 32 tokens, values per token in groups of 32
    assert w.result.value.startswith("7,200 bytes/token")  # (0.5 + 4/32) x 11,520 values, as int4 g32 asym
