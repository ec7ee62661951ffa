"""The KV calculator widget, driven from Python: no browser needed."""
from __future__ import annotations

from radarlab.viz.widgets import kv_calculator


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
