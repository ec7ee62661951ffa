"""The checker of notebook 10: radarlab's parallel_footprint passes, the stub fails in plain words, and each
plausible mistake of splitting a model over GPUs is rejected with the field it gets wrong."""
from __future__ import annotations

import pytest

from radarlab.checks import check_parallel_footprint
from radarlab.kvcache import memory
from radarlab.util import cdiv


def footprint(shape, tokens, kv_dtype, tp, pp, weight_bytes, gpu_bytes, util=0.9, embedding_bytes=0,
              mistake=None):
    heads = shape.kv_heads // tp if mistake == "no replication" else max(1, shape.kv_heads // tp)
    if mistake == "no replication":
        heads = max(heads, 0)
    layers = shape.layers // pp if mistake == "smallest stage" else cdiv(shape.layers, pp)
    if mistake == "tp splits layers":
        heads, layers = shape.kv_heads, cdiv(shape.layers, tp * pp)
    kv = memory.kv_footprint(layers, max(heads, 1), shape.head_dim, tokens, kv_dtype).bytes_per_stream
    body = weight_bytes - embedding_bytes
    ends = embedding_bytes if pp == 1 else embedding_bytes / 2
    weights = int((body * layers / shape.layers + ends) / tp)
    if mistake == "weights on every GPU":
        weights = weight_bytes
    if mistake == "weights not counted":
        weights = 0
    usable = gpu_bytes if mistake == "whole GPU" else int(gpu_bytes * util)
    budget = usable - weights
    streams = max(budget, 0) // kv
    if mistake == "streams per GPU added up":
        streams *= tp * pp
    if mistake == "negative streams":
        streams = budget // kv
    return memory.ParallelFootprint(tp, pp, heads, layers, kv, weights, budget, streams)


def test_reference_passes(capsys):
    assert check_parallel_footprint(memory.parallel_footprint)
    assert capsys.readouterr().out.strip() == "PASS parallel_footprint"


def test_learner_version_passes():
    assert check_parallel_footprint(footprint)


def test_stub_fails_in_plain_words(capsys):
    def stub(*args):
        raise NotImplementedError

    assert not check_parallel_footprint(stub)
    assert "not written yet" in capsys.readouterr().out


@pytest.mark.parametrize("mistake, field", [
    ("no replication", "kv_heads_per_gpu"),
    ("smallest stage", "layers_per_gpu"),
    ("tp splits layers", "kv_heads_per_gpu"),
    ("weights on every GPU", "weight_bytes_per_gpu"),
    ("weights not counted", "weight_bytes_per_gpu"),
    ("whole GPU", "kv_budget_bytes_per_gpu"),
    ("streams per GPU added up", "streams"),
    ("negative streams", "streams"),
])
def test_plausible_mistakes_are_named(mistake, field, capsys):
    def wrong(*args):
        return footprint(*args, mistake=mistake)

    assert not check_parallel_footprint(wrong)
    out = capsys.readouterr().out
    assert out.startswith("FAIL parallel_footprint") and f" {field} is " in out, out


def test_wrong_type_is_named(capsys):
    assert not check_parallel_footprint(lambda *a: 3)
    assert "not a ParallelFootprint" in capsys.readouterr().out
