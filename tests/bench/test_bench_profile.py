"""op_breakdown: the groups account for the whole step and the matmuls are found where they are."""
from __future__ import annotations

import pytest
import torch

from radarlab.bench.profile import GROUPS, OTHER_OPS, UNPROFILED, format_breakdown, op_breakdown
from radarlab.models.linear import Linear, onednn_packed_gemm


def test_groups_add_up_to_wall_time_and_find_the_matmuls():
    x, w = torch.randn(256, 256), torch.randn(256, 256)

    def step():
        y = x @ w  # aten::mm
        return torch.softmax(y, -1).sum()

    b = op_breakdown(step, repeat=3)
    groups = b["groups"]
    assert set(groups) == set(GROUPS) | {OTHER_OPS, UNPROFILED}
    assert sum(groups.values()) == pytest.approx(b["wall_ms"], rel=1e-6)
    assert groups["matmuls (linear layers, LM head)"] > 0
    assert groups["KV write at slot mapping"] == 0
    assert groups[OTHER_OPS] > 0  # softmax and sum are not in any group
    text = format_breakdown(b)
    assert text.splitlines()[0].startswith("per step") and "matmuls" in text


@pytest.mark.skipif(not onednn_packed_gemm(), reason="torch built without oneDNN's packed linear")
def test_packed_linear_layers_count_as_matmuls():
    layer = Linear(256, 256)
    x = torch.randn(16, 256)
    with torch.no_grad():
        layer(x)  # packs once, outside the profiled steps
        groups = op_breakdown(lambda: layer(x), repeat=3)["groups"]
    assert groups["matmuls (linear layers, LM head)"] > 0


@pytest.mark.parametrize("repeat", [0, -1, 1.5, True])
def test_bad_repeat_raises(repeat):
    with pytest.raises(ValueError, match="repeat"):
        op_breakdown(lambda: None, repeat=repeat)


def test_launching_ops_counts_ops_that_compute_and_leaves_out_views():
    import torch

    from radarlab.bench.profile import launching_ops

    x = torch.ones(4, 4)
    assert launching_ops(lambda: x.view(16).reshape(2, 8).t()) == 0  # views only
    assert launching_ops(lambda: (x @ x).relu().sum()) == 3  # mm, relu, sum; the mm's own calls not counted


@pytest.mark.parametrize("field, value, match", [
    ("repeat", 0, "repeat"), ("batch_sizes", (), "batch_sizes"), ("dtypes", ("int8",), "dtypes"),
    ("repeat", 32, r"below \(max_tokens - 1\) / 2 = 31.5"), ("seed", -1, "seed")])
def test_a_bad_profile_config_names_its_field(field, value, match):
    from radarlab.bench.profile import ProfileConfig

    with pytest.raises(ValueError, match=match):
        ProfileConfig(**{field: value})


def test_the_profiled_steps_are_decode_steps_of_the_whole_batch(tiny):
    """decode_ready_engine leaves every prompt prefilled: the next step schedules one token per request."""
    from radarlab.bench.profile import decode_ready_engine, op_breakdown
    from radarlab.bench.throughput import ThroughputConfig

    config = ThroughputConfig(max_tokens=8, min_prompt_len=4, max_prompt_len=40, block_size=8)
    engine = decode_ready_engine(tiny, 5, config)
    assert all(n == 1 for n in engine.last_scheduled.num_scheduled_tokens)
    breakdown = op_breakdown(engine.step, repeat=2)
    assert engine.last_scheduled.num_scheduled_tokens == [1] * 5
    assert breakdown["groups"]["matmuls (linear layers, LM head)"] > 0
    with pytest.raises(ValueError, match="batch_size"):
        decode_ready_engine(tiny, 0, config)


def test_the_command_line_writes_each_cell_as_json(tmp_path, capsys):
    """python -m radarlab.bench profile on the course model, one small cell: the JSON has its groups."""
    import json

    from radarlab.bench.__main__ import main

    out = tmp_path / "profile.json"
    assert main(["profile", "--batch-sizes", "2", "--dtypes", "float32", "--repeat", "1",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "profile" and doc["parameters"]["batch_sizes"] == [2]
    (row,) = doc["results"]
    assert (row["dtype"], row["batch_size"]) == ("float32", 2)
    assert sum(row["groups"].values()) == pytest.approx(row["wall_ms"], rel=1e-6)
    u = row["unprofiled"]  # the next step, timed without the profiler, against this run's bandwidth
    assert len(u["step_ms_runs"]) == 1 and u["step_ms"] == pytest.approx(u["step_ms_runs"][0])
    assert u["replayed"] is True and u["context"] > 16 and u["read_bandwidth_gb_s"] > 0
    assert u["bandwidth_fraction"] == pytest.approx(u["bytes_per_step"] / (u["step_ms"] / 1e3)
                                                    / (u["read_bandwidth_gb_s"] * 1e9))
    printed = capsys.readouterr().out
    assert doc["environment"]["cpu_kind"] and "decode step, float32, batch 2" in printed
    assert "without the profiler:" in printed and "ms per step (replayed)" in printed
    with pytest.raises(SystemExit):
        main(["profile", "--dtypes", "float64"])


def test_step_bandwidth_counts_the_weights_and_the_kv_read(tiny):
    """bytes per step = the weights once + each sequence's KV at its context (lab.roofline.decode_step)."""
    from radarlab.bench.profile import decode_ready_engine, step_bandwidth
    from radarlab.bench.throughput import ThroughputConfig
    from radarlab.lab.roofline import TransformerDims, decode_step

    config = ThroughputConfig(max_tokens=8, min_prompt_len=4, max_prompt_len=40, block_size=8)
    engine = decode_ready_engine(tiny, 3, config)
    u = step_bandwidth(engine, 2, bandwidth=1e9)
    assert len(u["step_ms_runs"]) == 2 and u["step_ms"] == min(u["step_ms_runs"])
    contexts = [r.num_computed_tokens for r in engine.last_scheduled.requests]
    assert u["context"] == round(sum(contexts) / 3)
    assert u["bytes_per_step"] == decode_step(TransformerDims.from_config(tiny.config), 3, u["context"],
                                              "fp32", "fp32").bytes
