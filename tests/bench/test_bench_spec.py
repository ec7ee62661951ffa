"""The speculative decoding benchmark: its workloads, counter arithmetic, speedups and goal on
hand-made numbers, bad flags, and tiny end-to-end runs (radarlab alone, and with vLLM)."""
from __future__ import annotations

import json

import pytest

from radarlab.bench.__main__ import main as bench_main
from radarlab.bench.report import vllm_modes
from radarlab.bench.speculation import (
    SpecBenchConfig,
    fastest,
    format_table,
    goal,
    result_row,
    speedups,
    vllm_environment,
    workload_prompts,
)
from radarlab.lab.workload import copy_prompts, free_prompts, source_functions
from radarlab.validate.vllm_spec import (
    VLLM_ACCEPTED_PER_POS,
    VLLM_NUM_ACCEPTED,
    VLLM_NUM_DRAFT_TOKENS,
    VLLM_NUM_DRAFTS,
    SpecRun,
    counters_agree,
    spec_counters,
)


def test_copy_and_free_prompts_are_seeded_prefixes():
    a = copy_prompts(8, seed=0)
    assert a == copy_prompts(8, seed=0) != copy_prompts(8, seed=1)
    assert copy_prompts(3, seed=0) == a[:3]
    assert len(set(a)) == 8
    functions = source_functions()
    assert all(any(f in p for f in functions) for p in a)  # each prompt holds a whole function to repeat
    assert free_prompts(5, seed=0) == free_prompts(5, seed=0)[:5] == free_prompts(9, seed=0)[:5]
    assert not any(f[:40] in p for p in free_prompts(20) for f in functions)
    with pytest.raises(ValueError, match="num_prompts"):
        copy_prompts(0)


def test_workload_prompts_tokenize(tokenizer):
    copy = workload_prompts(tokenizer, "copy", 2, 0)
    free = workload_prompts(tokenizer, "free", 2, 0)
    assert all(isinstance(t, int) for p in copy + free for t in p)
    assert tokenizer.decode(free[0]).startswith("<|im_start|>")  # the chat template, once
    assert tokenizer.decode(free[0]).count("<|im_start|>user") == 1


def test_spec_counters_are_snapshot_differences():
    before = {VLLM_NUM_DRAFTS: 3.0, VLLM_NUM_DRAFT_TOKENS: 15.0, VLLM_NUM_ACCEPTED: 7.0,
              VLLM_ACCEPTED_PER_POS: [3.0, 2.0, 1.0, 1.0, 0.0]}
    after = {VLLM_NUM_DRAFTS: 10.0, VLLM_NUM_DRAFT_TOKENS: 50.0, VLLM_NUM_ACCEPTED: 30.0,
             VLLM_ACCEPTED_PER_POS: [9.0, 8.0, 6.0, 4.0, 3.0]}
    assert spec_counters(before, after) == {"num_drafts": 7, "num_draft_tokens": 35,
                                            "num_accepted_tokens": 23,
                                            "num_accepted_tokens_per_pos": [6, 6, 5, 3, 3]}
    assert spec_counters({}, after)["num_accepted_tokens_per_pos"] == [9, 8, 6, 4, 3]
    assert spec_counters({}, {}) == {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                     "num_accepted_tokens_per_pos": []}


def test_spec_run_rates():
    run = SpecRun([[1] * 10, [2] * 10], 4.0, num_drafts=5, num_draft_tokens=20, num_accepted_tokens=8)
    assert (run.output_tokens, run.tokens_per_s) == (20, 5.0)
    assert (run.acceptance_rate, run.mean_accepted) == (0.4, 1.6)
    plain = SpecRun([[1] * 4], 1.0)
    assert plain.acceptance_rate is None and plain.mean_accepted is None


def test_counters_agree_allows_only_each_requests_last_draft():
    # measured: the code-copy prompt, 256 tokens, n-gram k=5 min 2 max 4, ours vs vLLM 0.32 (fp32)
    ours = SpecRun([[0] * 256], 1.0, 50, 246, 165, [40, 36, 31, 29, 29])
    vllm = SpecRun([[0] * 256], 1.0, 51, 255, 165, [40, 36, 31, 29, 29])
    assert counters_agree(ours, vllm) and counters_agree(ours, ours)
    assert not counters_agree(vllm, ours)  # we never draft more than vLLM
    assert counters_agree(ours, SpecRun([[0] * 256], 1.0, 51, 255, 168, [41, 37, 32, 29, 29]))
    # 2 more at pos 0
    assert not counters_agree(ours, SpecRun([[0] * 256], 1.0, 51, 255, 167, [42, 36, 31, 29, 29]))
    # 3 more drafts
    assert not counters_agree(ours, SpecRun([[0] * 256], 1.0, 53, 255, 165, [40, 36, 31, 29, 29]))
    # sum mismatch
    assert not counters_agree(ours, SpecRun([[0] * 256], 1.0, 51, 255, 166, [40, 36, 31, 29, 29]))
    two = SpecRun([[0] * 8] * 2, 1.0, 4, 10, 5, [3, 2])
    assert counters_agree(two, SpecRun([[0] * 8] * 2, 1.0, 6, 14, 9, [5, 4]))  # one more per request
    # measured: the trained EAGLE head, k=4, 4 prompts x 48 tokens, rarely accepted: over each request's last
    # 4 steps we draft 3, 2, 1, 0 tokens where vLLM drafts 4 each: up to 10 more per request
    eagle = SpecRun([[0] * 48] * 4, 1.0, 151, 584, 33, [28, 4, 1, 0])
    assert counters_agree(eagle, SpecRun([[0] * 48] * 4, 1.0, 155, 620, 35, [30, 4, 1, 0]))
    assert not counters_agree(eagle, SpecRun([[0] * 48] * 4, 1.0, 155, 625, 35, [30, 4, 1, 0]))  # 41 > 4 x 10


def row(system, method, workload, b, tps):
    return {"system": system, "method": method, "workload": workload, "batch_size": b, "tokens_per_s": tps,
            "acceptance_rate": None if method == "none" else 0.5, "mean_accepted": None}


def test_speedups_and_goal():
    rows = [row("radarlab", "none", "copy", 1, 10.0), row("radarlab", "ngram", "copy", 1, 25.0),
            row("vllm", "none", "copy", 1, 20.0), row("vllm", "ngram", "copy", 1, 40.0),
            row("vllm", "ngram", "free", 1, 9.0)]  # no plain free row: no speedup
    ups = speedups(rows)
    assert [(u["system"], u["speedup"]) for u in ups] == [("radarlab", 2.5), ("vllm", 2.0)]
    assert goal(ups) == {"goal": goal(ups)["goal"], "radarlab_speedup": 2.5, "vllm_speedup": 2.0,
                         "vllm_eager_speedup": None, "met": True}
    rows[1]["tokens_per_s"] = 15.0
    assert goal(speedups(rows))["met"] is False
    assert goal(speedups(rows[:2]))["met"] is None  # vLLM not run
    # vLLM eager alone is not the goal's anchor: its speedup is kept, the goal stays unmeasured
    eager = [dict(r, system="vllm_eager") if r["system"] == "vllm" else r for r in rows]
    g = goal(speedups(eager))
    assert g["vllm_eager_speedup"] == 2.0 and g["vllm_speedup"] is None and g["met"] is None
    table = format_table({"results": rows, "speedups": ups})
    assert "2.50x" in table and "radarlab ngram copy" in table


def test_each_vllm_system_records_its_mode_and_each_methods_start_up():
    compiled = {"enforce_eager": False, "mode": "DYNAMO_TRACE_ONCE", "backend": "inductor"}
    eager = {"enforce_eager": True, "mode": "NONE", "backend": "inductor"}
    facts = {"vllm_version": "0.32.0", "device": "cpu"}
    info = {"vllm_none": {**facts, "init_s": 151.2, "compilation": compiled},
            "vllm_ngram": {**facts, "init_s": 40.4, "compilation": compiled},
            "vllm_eager_none": {**facts, "init_s": 7.9, "compilation": eager}, "outputs": {}}
    env = vllm_environment(info, ("none", "ngram"))
    assert env == {"vllm_vllm_version": "0.32.0", "vllm_device": "cpu", "vllm_compilation": compiled,
                   "vllm_init_s": {"none": 151.2, "ngram": 40.4},
                   "vllm_eager_vllm_version": "0.32.0", "vllm_eager_device": "cpu",
                   "vllm_eager_compilation": eager, "vllm_eager_init_s": {"none": 7.9}}
    rows = [row("vllm", "none", "copy", 1, 20.0), row("vllm_eager", "none", "copy", 1, 15.0)]
    assert vllm_modes({"results": rows, "environment": env}) == [
        "vllm: compiled (mode DYNAMO_TRACE_ONCE, backend inductor), start-up none 151 s, ngram 40 s, "
        "not counted in tokens/s",
        "vllm_eager: eager (enforce_eager=True), start-up none 8 s"]
    # a kept run from before the default mode: eager, whatever its rows are called
    assert vllm_modes({"results": rows[1:], "environment": {"vllm_eager_init_s": 4.1}}) == [
        "vllm_eager: eager (enforce_eager=True), start-up 4 s"]


@pytest.mark.parametrize("kwargs, match", [
    ({"batch_sizes": ()}, "batch_sizes"), ({"batch_sizes": (0,)}, "batch_sizes"),
    ({"methods": ("ngram", "eagle")}, "methods"), ({"workloads": ("copy", "copy")}, "workloads"),
    ({"systems": ()}, "systems"), ({"max_tokens": 0}, "max_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 4}, "prompt_lookup_min"), ({"repeats": 0}, "repeats"),
])
def test_bad_config_raises(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SpecBenchConfig(**kwargs)


def test_the_fastest_of_repeated_runs_counts():
    runs = [SpecRun([[1, 2]], 2.0, num_drafts=1), SpecRun([[1, 2]], 0.5, num_drafts=2),
            SpecRun([[1, 2]], 1.0)]
    row = result_row("radarlab", "ngram", "copy", runs)
    assert row["tokens_per_s"] == 4.0 and row["num_drafts"] == 2 and row["repeats"] == 3
    assert row["tokens_per_s_runs"] == [1.0, 4.0, 2.0]
    with pytest.raises(ValueError, match="different outputs"):
        fastest([SpecRun([[1, 2]], 1.0), SpecRun([[1, 3]], 0.5)])


def _check_doc(doc: dict, systems: set, batch_sizes: list[int]) -> None:
    results = doc["results"]
    keys = {"system", "method", "workload", "batch_size", "tokens_per_s", "acceptance_rate", "mean_accepted"}
    assert all(keys <= set(r) for r in results)
    assert {r["system"] for r in results} == systems
    assert len(results) == len(systems) * 2 * 2 * len(batch_sizes)
    assert doc["environment"]["cpu_kind"]
    for r in results:
        assert r["tokens_per_s"] > 0
        assert r["output_tokens"] == r["batch_size"] * doc["parameters"]["max_tokens"]
        if r["method"] == "none":
            assert r["acceptance_rate"] is None and r["mean_accepted"] is None and r["num_drafts"] == 0
    for system in systems:
        rate = {r["workload"]: r["acceptance_rate"] or 0.0 for r in results
                if r["system"] == system and r["method"] == "ngram" and r["batch_size"] == batch_sizes[0]}
        assert rate["copy"] > rate["free"], (system, rate)
        assert rate["copy"] > 0.5
    # speculation is lossless: greedy outputs equal plain decoding's (fp32, same engine)
    assert all(e["equal_to_radarlab_plain"] == 1.0 for e in doc["outputs_equal"] if e["system"] == "radarlab")


@pytest.mark.slow
def test_tiny_run_radarlab(tmp_path):
    path = tmp_path / "spec.json"
    assert bench_main(["spec", "--systems", "radarlab", "--methods", "none,ngram", "--batch-sizes", "1,2",
                       "--max-tokens", "12", "--json", str(path)]) == 0
    _check_doc(json.loads(path.read_text()), {"radarlab"}, [1, 2])


@pytest.mark.slow  # loads the course model for the prompts
def test_each_vllm_system_runs_in_its_own_mode(monkeypatch):
    """`vllm` is vLLM's default (compiled) mode, `vllm_eager` enforce_eager=True: one process per
    system and method, each asked for its mode (the compiled run itself is the benchmark's: its
    start-up, minutes on a small CPU, stays out of make test)."""
    import radarlab.bench.speculation as spec

    calls = []

    def fake_vllm_spec(prompt_sets, max_tokens, speculative_config, enforce_eager):
        calls.append((speculative_config is None, enforce_eager))
        comp = {"enforce_eager": enforce_eager, "mode": "NONE" if enforce_eager else "DYNAMO_TRACE_ONCE"}
        runs = [SpecRun([[7] * max_tokens for _ in p], 0.5) for p in prompt_sets]
        return runs, {"vllm_version": "0.32.0", "device": "cpu", "init_s": 1.0, "compilation": comp}

    monkeypatch.setattr(spec, "run_vllm_spec", fake_vllm_spec)
    config = SpecBenchConfig(batch_sizes=(1, 2), workloads=("copy",), methods=("none", "ngram"),
                             systems=("vllm", "vllm_eager"), max_tokens=3, repeats=2)
    results, info = spec.run(config, log=lambda *_: None)
    assert calls == [(True, False), (True, True), (False, False), (False, True)]
    assert {(r["system"], r["method"], r["batch_size"], r["repeats"]) for r in results} == {
        (s, m, b, 2) for s in ("vllm", "vllm_eager") for m in ("none", "ngram") for b in (1, 2)}
    env = vllm_environment(info, config.methods)
    assert env["vllm_compilation"]["enforce_eager"] is False
    assert env["vllm_eager_compilation"]["enforce_eager"] is True


@pytest.mark.vllm
def test_tiny_run_with_vllm(tmp_path):
    path = tmp_path / "spec.json"
    assert bench_main(["spec", "--systems", "radarlab,vllm_eager", "--methods", "none,ngram",
                       "--batch-sizes", "1", "--max-tokens", "12", "--json", str(path)]) == 0
    doc = json.loads(path.read_text())
    _check_doc(doc, {"radarlab", "vllm_eager"}, [1])
    assert doc["goal"]["radarlab_speedup"] is not None and doc["goal"]["vllm_eager_speedup"] is not None
    assert doc["environment"]["vllm_eager_compilation"]["enforce_eager"] is True
    assert set(doc["environment"]["vllm_eager_init_s"]) == {"none", "ngram"}
    # n-gram drafts are a function of the tokens: where outputs agree, so do the counters
    by = {(r["system"], r["method"], r["workload"]): r for r in doc["results"]}
    for w in ("copy", "free"):
        same = [e for e in doc["outputs_equal"] if e["system"] == "vllm_eager" and e["method"] == "ngram"
                and e["workload"] == w]
        if same and same[0]["equal_to_radarlab_plain"] == 1.0:
            ours, theirs = (SpecRun([[0]] * r["batch_size"], 1.0,
                                    **{k: r[k] for k in SpecRun([], 1.0).counters()})
                            for r in (by[("radarlab", "ngram", w)], by[("vllm_eager", "ngram", w)]))
            assert counters_agree(ours, theirs), (ours.counters(), theirs.counters())


def test_draft_method_is_the_trained_eagle_head_unless_a_draft_model_is_given(tmp_path):
    from radarlab.spec_decode.draft_head import TRAINED_HEAD

    (tmp_path / "config.json").write_text("{}")
    assert SpecBenchConfig(draft_k=3).speculative_config("draft") == \
        {"method": "eagle", "num_speculative_tokens": 3, "model": str(TRAINED_HEAD)}
    config = SpecBenchConfig(draft_model=str(tmp_path)).speculative_config("draft")
    assert config["method"] == "draft_model" and config["model"] == str(tmp_path)
