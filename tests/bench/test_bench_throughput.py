"""The throughput benchmark: seeded prompts, the ratio and goal arithmetic on hand-made numbers, bad
flags, and one tiny end-to-end run of all three systems (the speed goal itself is a benchmark
figure, not asserted here)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from radarlab.bench.__main__ import main as bench_main
from radarlab.bench.throughput import (
    Measurement,
    ThroughputConfig,
    dtype_notes,
    format_modes,
    format_ratios,
    format_run_header,
    format_table,
    format_vllm_modes,
    goal,
    ratios,
    report,
    results_path,
)
from radarlab.lab.workload import random_token_prompts


def test_prompts_are_seeded_and_in_range():
    a = random_token_prompts(64, 1000, (16, 128), seed=0)
    assert a == random_token_prompts(64, 1000, (16, 128), seed=0) != random_token_prompts(64, 1000, (16, 128),
                                                                                          seed=1)
    assert all(16 <= len(p) <= 128 and all(0 <= t < 1000 for t in p) for p in a)
    assert len({len(p) for p in a}) > 20  # lengths really vary
    assert random_token_prompts(16, 1000, (16, 128), seed=0) == a[:16]  # a smaller batch is a prefix
    assert {len(p) for p in random_token_prompts(300, 10, (3, 5), seed=0)} == {3, 4, 5}


@pytest.mark.parametrize("args, match", [((0, 10), "num_prompts"), ((3, 0), "vocab_size"),
                                         ((3, 10, (0, 4)), "len_range"), ((3, 10, (5, 4)), "len_range")])
def test_bad_prompt_arguments_raise(args, match):
    with pytest.raises(ValueError, match=match):
        random_token_prompts(*args)


def m(system, bs, tps, dtype="float32", outputs=None):
    out = Measurement(system, bs, dtype, output_tokens=int(tps * 2), seconds=2.0,
                      outputs=outputs or [[1, 2]] * bs)
    assert out.tokens_per_s == pytest.approx(tps)
    return out


def test_ratios_and_goal():
    ms = [m("radarlab", 1, 20), m("transformers", 1, 10), m("vllm", 1, 40),
          m("radarlab", 64, 300, outputs=[[1, 2]] * 32 + [[1, 3]] * 32), m("transformers", 64, 200),
          m("vllm", 64, 400)]
    rows = {r["batch_size"]: r for r in ratios(ms)}
    assert rows[1]["radarlab_over_transformers"] == pytest.approx(2.0)
    assert rows[1]["radarlab_over_vllm"] == pytest.approx(0.5)
    assert rows[64]["radarlab_over_vllm"] == pytest.approx(0.75)
    assert rows[64]["outputs_equal_vllm"] == pytest.approx(0.5) and rows[1]["outputs_equal_vllm"] == 1.0
    g = goal(ms)["by_dtype"]["float32"]
    assert g["at_least_transformers"] is True and g["min_ratio_transformers"] == pytest.approx(1.5)
    assert g["at_least_vllm"] is False and g["min_ratio_vllm"] == pytest.approx(0.5)  # batch 1: 20 / 40
    ms[2], ms[-1] = m("vllm", 1, 20), m("vllm", 64, 300)
    assert goal(ms)["by_dtype"]["float32"]["at_least_vllm"] is True  # 1.0x exactly at both sizes
    ms[1] = m("transformers", 1, 21)
    assert goal(ms)["by_dtype"]["float32"]["at_least_transformers"] is False
    assert goal(ms[:1])["by_dtype"]["float32"] == {"min_ratio_transformers": None,
                                                   "at_least_transformers": None,
                                                   "min_ratio_vllm": None, "at_least_vllm": None}


def test_the_goal_is_against_vllm_as_users_run_it():
    """vllm is vLLM's default (compiled) mode; vllm_eager is reported beside it but is not the goal."""
    ms = [m("radarlab", 1, 20), m("vllm", 1, 25), m("vllm_eager", 1, 15)]
    row = ratios(ms)[0]
    assert row["radarlab_over_vllm"] == pytest.approx(0.8)
    assert row["radarlab_over_vllm_eager"] == pytest.approx(4 / 3)
    g = goal(ms)["by_dtype"]["float32"]
    assert g["min_ratio_vllm"] == pytest.approx(0.8) and g["at_least_vllm"] is False
    eager_only = goal([m("radarlab", 1, 20), m("vllm_eager", 1, 15)])["by_dtype"]["float32"]
    assert eager_only["at_least_vllm"] is None


def test_each_vllm_system_says_how_it_ran():
    rows = [m("radarlab", 1, 20).row(), m("vllm", 1, 25).row(), m("vllm_eager", 1, 15).row()]
    env = {"vllm_init_s": 151.2, "vllm_eager_init_s": 7.9,
           "vllm_compilation": {"enforce_eager": False, "mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"},
           "vllm_eager_compilation": {"enforce_eager": True, "mode": "NONE", "backend": "inductor"}}
    said = format_vllm_modes({"results": rows, "environment": env})
    assert said == ("; vllm: compiled (mode DYNAMO_TRACE_ONCE, backend inductor), start-up 151 s, not "
                    "counted in tokens/s; vllm_eager: eager (enforce_eager=True), start-up 8 s")
    # a run kept before the anchor: vLLM eager only, and no compilation record
    old_run = {"results": rows[::2], "environment": {}}
    assert format_vllm_modes(old_run) == "; vllm_eager: eager (enforce_eager=True)"
    assert format_vllm_modes({"results": rows[:1], "environment": {}}) == ""


def test_bf16_rows_say_when_their_matmuls_run_in_fp32():
    doc = {"results": [m("radarlab", 1, 20, dtype="bfloat16").row()], "ratios": [],
           "environment": {"cpu_native_bf16": False}}
    assert format_table(doc).splitlines()[0] == ("output tokens/s, bfloat16 (radarlab's "
                                                 "bf16 matmuls of 16+ rows run in fp32: this CPU "
                                                 "has no bf16 instructions)")
    doc["environment"]["cpu_native_bf16"] = True
    assert format_table(doc).splitlines()[0] == "output tokens/s, bfloat16"
    assert dtype_notes(True) == {} and set(dtype_notes(False)) == {"bfloat16"}
    assert "matmuls of 64+ rows" in dtype_notes(False, 64)["bfloat16"]
    intel = dtype_notes(True, 64, 4)  # Intel's fp32 GEMV rule: a note on fp32 rows, whatever the bf16 rule
    assert set(intel) == {"float32"} and "fewer than 4 rows take MKL's GEMV" in intel["float32"]
    assert set(dtype_notes(False, 64, 4)) == {"bfloat16", "float32"}


def test_results_path_is_one_file_per_cpu_kind():
    assert results_path("avx512_bf16").name == "throughput-avx512_bf16.json"
    assert results_path("avx2").parent.name == "results"
    with pytest.raises(ValueError, match="kind"):
        results_path("../x")


@pytest.mark.parametrize("field, value, match", [
    ("batch_sizes", (1, 0), "batch_sizes"),
    ("batch_sizes", (), "batch_sizes is empty"),
    ("dtypes", ("float16",), "dtypes"),
    ("systems", ("radarlab", "radarlab"), "systems"),
    ("max_tokens", 0, "max_tokens"),
    ("min_prompt_len", 200, "above max_prompt_len"),
    ("seed", -1, "seed"),
    ("repeats", 0, "repeats"),
])
def test_bad_config_raises(field, value, match):
    with pytest.raises(ValueError, match=match):
        ThroughputConfig(**{field: value})


def test_report_holds_only_what_this_run_measured():
    """Numbers to compare with come from runs the project made (results/throughput.json records its
    machine), never from constants measured elsewhere."""
    ms = [m("radarlab", 1, 20), m("transformers", 1, 10)]
    doc = report(ThroughputConfig(batch_sizes=(1,), dtypes=("float32",),
                                  systems=("radarlab", "transformers")), ms, {})
    assert set(doc) == {"benchmark", "parameters", "environment", "results", "ratios", "goal"}
    assert doc["results"] == [x.row() for x in ms] and doc["environment"]["torch_threads"] >= 1


@pytest.mark.vllm
def test_end_to_end_every_system(tmp_path, capsys):
    path = tmp_path / "throughput.json"
    code = bench_main(["throughput", "--batch-sizes", "1,3", "--dtypes", "float32", "--max-tokens", "4",
                       "--repeats", "2", "--json", str(path)])
    assert code == 0
    doc = json.loads(path.read_text())
    env = doc["environment"]
    assert doc["benchmark"] == "throughput" and env["vllm_vllm_version"] == env["vllm_eager_vllm_version"]
    got = {(r["system"], r["batch_size"]) for r in doc["results"]}
    assert got == {(s, b) for s in ("radarlab", "radarlab_eager", "radarlab_torch", "transformers", "vllm",
                                    "vllm_eager")
                   for b in (1, 3)}
    # vllm is vLLM as users run it, compiled by torch.compile; vllm_eager is not compiled
    assert env["vllm_compilation"]["enforce_eager"] is False and env["vllm_compilation"]["mode"] != "NONE"
    eager = env["vllm_eager_compilation"]
    assert eager["enforce_eager"] is True and eager["mode"] == "NONE"
    assert env["vllm_init_s"] > env["vllm_eager_init_s"]  # the compilation happens at start-up, untimed
    for r in doc["results"]:
        assert set(r) == {"system", "batch_size", "dtype", "output_tokens", "seconds", "tokens_per_s",
                          "seconds_runs"}
        assert r["seconds"] == min(r["seconds_runs"]) and len(r["seconds_runs"]) == 2
        assert r["dtype"] == "float32" and r["output_tokens"] == 4 * r["batch_size"]
        assert r["tokens_per_s"] == pytest.approx(r["output_tokens"] / r["seconds"])
    # the systems did the same work: fp32 greedy continuations agree
    for row in doc["ratios"]:
        assert row["outputs_equal_transformers"] == 1.0 and row["outputs_equal_vllm"] == 1.0
        assert row["outputs_equal_vllm_eager"] == 1.0
        assert row["outputs_equal_radarlab_torch"] == 1.0  # the C++ operators change no token
        assert row["outputs_equal_radarlab_eager"] == 1.0  # nor does the replay
    # each measurement placed on this machine's roofline, measured in the same run
    assert doc["machine_balance"]["read_bandwidth_gb_s"] > 0
    assert doc["machine_balance"]["fp32_gemm_gflop_s"] > 0
    assert {(r["system"], r["batch_size"]) for r in doc["limits"]} == got
    assert all(0 < r["bandwidth_fraction"] and 0 < r["flops_fraction"] for r in doc["limits"])
    table = capsys.readouterr().out
    assert "radarlab / vllm" in table and "radarlab / vllm_eager" in table
    assert "output tokens/s, float32" in table
    assert "vllm: compiled (mode " in format_run_header(path, doc)
    assert "vllm_eager: eager (enforce_eager=True)" in format_run_header(path, doc)
    assert "of this machine's read bandwidth" in table
    note = f" ({env['dtype_notes']['float32']})" if env["fp32_gemv_rows"] else ""  # Intel's fp32 rule
    assert format_table(doc).splitlines()[0] == f"output tokens/s, float32{note}"


def test_every_system_warms_up_on_every_batch_size(monkeypatch):
    """The same untimed warm-up for all: each batch size's prompts once, with 4 new tokens, before any
    timed run (vLLM builds its graphs per shape, oneDNN its kernels per row count)."""
    import types
    from dataclasses import make_dataclass

    from radarlab.bench import throughput
    from radarlab.models import llama, loader

    calls = []

    def timed(system):
        def run(model_or_hf, *args):
            prompts, config = (args[1], args[2]) if system == "transformers" else (args[0], args[1])
            calls.append((system, len(prompts), config.max_tokens))
            return [[1] * config.max_tokens for _ in prompts], 1.0
        return run

    def vllm(prompt_sets, dtype, config, eager):
        calls.append(("vllm", [len(p) for p in throughput.warmup_sets(prompt_sets)]))
        return [([[1] * config.max_tokens] * len(p), 1.0) for p in prompt_sets], {}

    hf = types.SimpleNamespace(config=types.SimpleNamespace(vocab_size=1000))
    tokenizer = types.SimpleNamespace(pad_token_id=0, eos_token_id=0)
    monkeypatch.setattr(loader, "load_hf", lambda model, dtype: (hf, tokenizer))
    monkeypatch.setattr(llama.Llama, "from_hf", staticmethod(lambda hf_model: object()))
    monkeypatch.setattr(throughput, "TransformerDims", types.SimpleNamespace(
        from_config=lambda c: make_dataclass("Dims", [])()))
    monkeypatch.setattr(throughput, "time_radarlab", timed("radarlab"))
    monkeypatch.setattr(throughput, "time_transformers", timed("transformers"))
    monkeypatch.setattr(throughput, "time_vllm", vllm)
    config = ThroughputConfig(batch_sizes=(1, 3), dtypes=("float32",), max_tokens=8, repeats=2,
                              systems=("radarlab", "transformers", "vllm"))
    throughput.run(config, log=lambda line: None)
    for system in ("radarlab", "transformers"):
        mine = [(b, t) for s, b, t in (c for c in calls if c[0] == system)]
        assert mine == [(1, 4), (3, 4)] + [(1, 8)] * 2 + [(3, 8)] * 2, system
    assert ("vllm", [1, 3]) in calls


def test_plot_throughput_draws_one_bar_per_system_and_batch():
    import matplotlib

    matplotlib.use("Agg")
    from radarlab.viz.throughput_plot import plot_throughput

    ms = [m("radarlab", 1, 20), m("transformers", 1, 10), m("radarlab", 16, 300), m("transformers", 16, 90),
          m("radarlab", 16, 50, dtype="bfloat16")]
    fig = plot_throughput({"results": [x.row() for x in ms]})
    f32, bf16 = fig.axes
    assert [t.get_text() for t in f32.get_xticklabels()] == ["1", "16"]
    assert sorted(round(p.get_height()) for p in f32.patches) == [10, 20, 90, 300]
    assert [round(p.get_height()) for p in bf16.patches if p.get_height()] == [50]
    with pytest.raises(ValueError, match="results"):
        plot_throughput({"results": []})


def test_limits_place_a_measurement_on_the_roofline():
    """A step of batch 2 at 10 tok/s takes 0.2 s; its bytes and FLOPs are decode_step's at the mean
    context."""
    from radarlab.bench.throughput import ThroughputConfig, limits
    from radarlab.lab.roofline import TransformerDims, decode_step

    dims = TransformerDims(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10)
    config = ThroughputConfig(batch_sizes=(2,), dtypes=("float32",), systems=("radarlab",), max_tokens=4,
                              min_prompt_len=8, max_prompt_len=12)
    # 10 tok/s: a step of 2 takes 0.2 s
    m = Measurement("radarlab", 2, "float32", output_tokens=20, seconds=2.0)
    (row,) = limits(config, [m], dims, peak_flops=1e6, bandwidth=1e5)
    step = decode_step(dims, 2, 10 + 2, "fp32", "fp32")  # context: mean prompt 10 + half of 4 new tokens
    assert row["context"] == 12 and row["bytes_per_step"] == step.bytes
    assert row["bandwidth_fraction"] == pytest.approx(step.bytes / 0.2 / 1e5)
    assert row["flops_fraction"] == pytest.approx(step.flops / 0.2 / 1e6)


def test_the_torch_only_engine_is_a_system_of_its_own():
    """radarlab_torch (C++ operators off) sits beside radarlab in one run: its ratio is what the
    operators buy, and the report says which operators the radarlab rows ran."""
    ms = [m("radarlab", 1, 30), m("radarlab_torch", 1, 20), m("vllm", 1, 25)]
    (row,) = ratios(ms)
    assert row["radarlab_over_radarlab_torch"] == pytest.approx(1.5)
    assert row["radarlab_over_vllm"] == pytest.approx(1.2)
    doc = report(ThroughputConfig(batch_sizes=(1,), dtypes=("float32",),
                                  systems=("radarlab", "radarlab_torch",
                                                                                   "vllm")), ms, {})
    ops = doc["environment"]["radarlab_cpu_ops"]
    assert ops["built"] is False or ops["operators"] == ["paged_decode", "reshape_and_cache", "rms_norm",
                                                         "silu_and_mul",
                                                      "rotary_embedding"]
    assert "radarlab / radarlab_torch" in format_table(doc)


def test_the_ratios_say_what_the_replay_buys():
    """radarlab (replayed steps) over radarlab_eager, from the same run, in notebook 05's summary line."""
    ms = [m("radarlab", 1, 30), m("radarlab_eager", 1, 24), m("radarlab_torch", 1, 20), m("vllm", 1, 25)]
    doc = report(ThroughputConfig(batch_sizes=(1,), dtypes=("float32",),
                                  systems=("radarlab", "radarlab_eager", "radarlab_torch", "vllm")), ms, {})
    assert doc["ratios"][0]["radarlab_over_radarlab_eager"] == pytest.approx(1.25)
    line = format_ratios(Path("throughput-x.json"), doc)
    assert line.endswith("radarlab / vLLM (default, compiled) 1.20x, replayed / eager 1.25x, "
                         "C++ operators on / off 1.50x")


@pytest.mark.slow
def test_both_radarlab_systems_give_the_same_tokens(tiny):
    """The engine with and without its C++ operators, and with and without the replay, on the
    benchmark's own prompts (fp32, greedy)."""
    from radarlab.bench.throughput import time_radarlab
    from radarlab.lab.workload import random_token_prompts

    config = ThroughputConfig(batch_sizes=(5,), max_tokens=8, min_prompt_len=4, max_prompt_len=40)
    prompts = random_token_prompts(5, tiny.config.vocab_size, (4, 40), 0)
    fused, _ = time_radarlab(tiny, prompts, config)
    plain, _ = time_radarlab(tiny, prompts, config, cpu_ops=False)
    eager, _ = time_radarlab(tiny, prompts, config, enforce_eager=True)
    assert fused == plain == eager and all(len(o) == 8 for o in fused)
    assert tiny.use_cpu_ops is None  # restored


def test_a_vllm_run_without_vllm_is_refused_naming_the_way_out(monkeypatch):
    import radarlab.validate.vllm as vllm_env
    from radarlab.bench.report import require_vllm

    monkeypatch.setattr(vllm_env, "vllm_python", lambda: None)
    with pytest.raises(ValueError, match="no vLLM environment.*--systems radarlab,transformers"):
        require_vllm(("radarlab", "vllm"), "radarlab,transformers")
    require_vllm(("radarlab",), "radarlab")  # no vllm asked for: nothing to check


def test_the_table_shows_what_compiling_buys_vllm():
    """vllm (compiled) over vllm_eager per batch size, from the same run; a size one mode lacks is a dash."""
    ms = [m("radarlab", 1, 30), m("vllm", 1, 25), m("vllm_eager", 1, 20), m("radarlab", 16, 300),
          m("vllm", 16, 330)]
    doc = report(ThroughputConfig(batch_sizes=(1, 16), dtypes=("float32",),
                                  systems=("radarlab", "vllm", "vllm_eager")), ms, {})
    line = next(x for x in format_table(doc).splitlines() if x.strip().startswith("vllm / vllm_eager"))
    assert line.split()[3:] == ["1.25x", "-"]
    eager_only = report(ThroughputConfig(batch_sizes=(1,), dtypes=("float32",),
                                         systems=("radarlab", "vllm_eager")), [ms[0], ms[2]], {})
    assert "vllm / vllm_eager" not in format_table(eager_only)


def test_the_modes_line_sets_each_engine_beside_its_own_eager_mode():
    ms = [m("radarlab", 1, 30), m("radarlab_eager", 1, 24), m("vllm", 1, 25), m("vllm_eager", 1, 16),
          m("radarlab", 16, 300), m("vllm", 16, 330)]
    doc = report(ThroughputConfig(batch_sizes=(1, 16), dtypes=("float32",),
                                  systems=("radarlab", "radarlab_eager", "vllm", "vllm_eager")), ms, {})
    assert format_modes(doc) == ("float32 batch 1: replaying buys radarlab 1.25x, compiling buys vLLM 1.56x; "
                                 "radarlab / vLLM eager against eager 1.50x, default against default 1.20x")
