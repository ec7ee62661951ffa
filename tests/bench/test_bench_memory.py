"""The memory benchmark: a deterministic heavy-tailed workload, exact accounting on hand-checked cases,
the JSON document, and bad arguments. The 0.96 goal is a benchmark figure, not asserted here."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from radarlab.bench.__main__ import main as bench_main
from radarlab.bench.reservation import (
    RESERVATIONS,
    MemoryBenchConfig,
    chunked_prompt_blocks,
    contiguous,
    paged,
    report,
    run,
    simulate,
    thrash_sweep,
)
from radarlab.lab.workload import WorkloadRequest as Request, WorkloadSpec, lognormal_lengths, make_workload

SMALL = MemoryBenchConfig(WorkloadSpec(num_requests=64, seed=3, max_model_len=512, prompt_mean=60,
                                       output_mean=90), budget_tokens=4096, block_size=16)


# --- the workload ----------------------------------------------------------------------------------

def test_workload_is_deterministic_for_a_seed():
    spec = WorkloadSpec(num_requests=300, seed=7)
    assert make_workload(spec) == make_workload(spec)
    assert make_workload(spec) != make_workload(WorkloadSpec(num_requests=300, seed=8))


def test_default_workload_has_at_least_200_requests_within_bounds():
    spec = WorkloadSpec()
    reqs = make_workload(spec)
    assert len(reqs) >= 200
    assert [r.request_id for r in reqs] == list(range(len(reqs)))
    for r in reqs:
        assert r.prompt_len >= 1 and r.output_len >= 1
        assert r.prompt_len + r.output_len <= spec.max_model_len
        assert r.max_cached_tokens == r.prompt_len + r.output_len - 1


@pytest.mark.parametrize("max_model_len", [2, 3, 64])
def test_clipping_holds_for_tiny_contexts(max_model_len):
    spec = WorkloadSpec(num_requests=500, seed=1, max_model_len=max_model_len, prompt_sigma=2.0,
                        output_sigma=2.0)
    for r in make_workload(spec):
        assert 1 <= r.prompt_len <= max_model_len - 1
        assert 1 <= r.output_len <= max_model_len - r.prompt_len


def test_lognormal_lengths_have_the_documented_mean_and_a_heavy_tail():
    lengths = lognormal_lengths(np.random.default_rng(0), 200_000, mean=161.0, sigma=1.0)
    assert lengths.min() >= 1 and lengths.dtype == np.int64
    assert abs(lengths.mean() / 161.0 - 1) < 0.02
    p50, p99 = np.percentile(lengths, [50, 99])
    assert abs(p99 / p50 - math.exp(2.326)) / math.exp(2.326) < 0.05  # p99/median = exp(z99 * sigma)


# --- exact accounting on workloads small enough to follow by hand ------------------------------------
# Three requests, max_model_len 8, block 4, a budget of 16 positions: 2 max-length rows or 4 blocks.
# A request fills at most prompt + output - 1 positions (its last token is never fed back).
THREE = [Request(0, 3, 2), Request(1, 5, 3), Request(2, 1, 1)]


def test_max_reservation_accounting_by_hand():
    res = simulate(THREE, contiguous(16, "max"), max_model_len=8)
    # step 1: A(3) B(5) in two rows; C waits. step 2: A 4, B 6; A finishes. step 3: B 7, C admitted with 1.
    assert res.live == [8, 10, 8]
    assert res.reserved == [16, 16, 16]
    assert res.running == [2, 2, 2]
    # A will fill 4, B 7, C 1 of their 8 positions
    assert res.future == [1 + 2, 0 + 1, 0 + 0]
    assert res.never_used == [4 + 1, 4 + 1, 1 + 7]
    s = res.summary()
    assert s["steps"] == 3
    assert s["utilisation"] == 26 / 48
    assert s["utilisation_at_peak"] == 10 / 16 and s["peak_step"] == 2
    assert s["waste"] == {"reserved_for_future": 4 / 48, "never_used": 18 / 48}
    assert res.waiting == [1, 1, 0]  # C waits for a row until A finishes
    assert s["concurrency"] == {"mean": 2, "max": 2, "mean_while_queued": 2}
    assert s["preemptions"] == 0 and "last_block_slack" not in s


def test_paged_accounting_by_hand():
    res = simulate(THREE, paged(16, 4), max_model_len=8)
    # step 1: A 3 tokens (1 block), B 5 (2 blocks), C 1 (1 block); C samples its only token and leaves.
    # step 2: A 4 (1 block), B 6 (2 blocks); A leaves. step 3: B 7 (2 blocks).
    assert res.live == [9, 10, 7]
    assert res.reserved == [16, 12, 8]
    assert res.running == [3, 2, 1]
    s = res.summary()
    assert s["steps"] == 3
    assert s["utilisation"] == 26 / 36
    assert s["utilisation_at_peak"] == 10 / 12 and s["peak_step"] == 2
    # never used: A's last block keeps 0 spare (fills 4), B's 8 positions hold at most 7, C's block 3 spare
    assert res.never_used == [0 + 1 + 3, 0 + 1, 1]
    assert s["last_block_slack"] == {"fraction_of_reserved": 10 / 36, "mean_tokens_per_request": 10 / 6}
    assert res.waiting == [0, 0, 0]
    assert s["concurrency"] == {"mean": 2, "max": 3, "mean_while_queued": None}  # never memory-bound
    assert res.tokens_computed == 3 + 5 + 1 + 1 + 1 + 1 and res.recomputed_tokens == 0


def test_paged_preempts_the_newest_request_and_recomputes_it():
    # Two blocks of 2; A and B (prompt 2, output 3) each fill a block at step 1. At step 2 A needs a
    # second block: B is preempted and returns with prompt + 1 generated token = 3 tokens.
    reqs = [Request(0, 2, 3), Request(1, 2, 3)]
    res = simulate(reqs, paged(4, 2), max_model_len=8)
    assert res.live == [4, 3, 4, 3, 4]
    assert res.reserved == [4, 4, 4, 4, 4]
    assert res.running == [2, 1, 1, 1, 1]
    assert res.waiting == [0, 1, 1, 0, 0]
    # B computed its prompt (2), was preempted, then recomputed prompt + its first output (3) and decoded 1:
    # the engine computes 2 tokens twice, and pays for them
    assert res.preemptions == 1 and res.computed == [4, 1, 1, 3, 1]
    assert res.tokens_computed == 10 and res.recomputed_tokens == 2
    assert res.summary()["concurrency"]["mean_while_queued"] == 1
    assert res.summary()["recompute_share"] == 2 / 10
    rows = simulate(reqs, contiguous(8, "max"), max_model_len=8)  # one row: strictly one after the other
    assert rows.live == [2, 3, 4, 2, 3, 4] and rows.preemptions == 0 and rows.recomputed_tokens == 0


def test_the_token_budget_chunks_prompts_and_is_charged():
    """A 10-token prompt under a 4-token budget takes three prefill steps (4, 4, 2), as the engine's."""
    res = simulate([Request(0, 10, 2)], paged(16, 4), max_model_len=16, max_num_batched_tokens=4)
    assert res.computed == [4, 4, 2, 1] and res.sampled == [0, 0, 1, 1]
    assert res.live == [4, 8, 10, 11] and res.reserved == [4, 8, 12, 12]  # blocks follow the chunks


def test_oracle_and_pow2_reserve_what_their_rule_says():
    """One request, prompt 3 + output 3 (fills 5 positions), max_model_len 16: max holds 16, pow2 8,
    oracle 5, from the first step to the last."""
    for rule, held in (("max", 16), ("pow2", 8), ("oracle", 5)):
        res = simulate([Request(0, 3, 3)], contiguous(32, rule), max_model_len=16)
        assert res.reserved == [held] * 3 and res.live == [3, 4, 5]
        assert res.never_used == [held - 5] * 3 and res.future == [2, 1, 0]


def test_the_paper_ordering_holds_on_the_workload():
    """Max < Pow2 < Oracle < paged in utilisation and in concurrency (the vLLM paper's Fig. 2 ordering);
    only the paged cache, which admits before it knows how long a request runs, preempts and recomputes."""
    results = run(SMALL)
    s = {name: res.summary() for name, res in results.items()}
    order = ["max", "pow2", "oracle", "paged"]
    assert list(s) == order
    assert [s[n]["utilisation"] for n in order] == sorted(s[n]["utilisation"] for n in order)
    assert [s[n]["concurrency"]["mean"] for n in order] == sorted(s[n]["concurrency"]["mean"] for n in order)
    assert s["max"]["concurrency"]["max"] == SMALL.budget_tokens // SMALL.workload.max_model_len
    assert s["oracle"]["waste"]["never_used"] == 0
    assert all(s[n]["preemptions"] == 0 and s[n]["recomputed_tokens"] == 0 for n in RESERVATIONS)
    assert s["paged"]["last_block_slack"]["mean_tokens_per_request"] <= SMALL.block_size - 1
    requests = make_workload(SMALL.workload)
    for summary in s.values():  # live + reserved-for-future + never-used is all of the reserved memory
        assert math.isclose(summary["utilisation"] + summary["waste"]["reserved_for_future"]
                            + summary["waste"]["never_used"], 1)
        # every output token is sampled once, whatever was recomputed
        assert summary["tokens_sampled"] == sum(r.output_len for r in requests)
        assert (summary["tokens_computed"] - summary["recomputed_tokens"]
                == sum(r.max_cached_tokens for r in requests))


# --- JSON and the command line ---------------------------------------------------------------------

def _small_argv(tmp_path, *extra):
    w = SMALL.workload
    return ["memory", "--num-requests", str(w.num_requests), "--seed", str(w.seed), "--max-model-len",
            str(w.max_model_len), "--prompt-mean", str(w.prompt_mean), "--output-mean", str(w.output_mean),
            "--budget-tokens", str(SMALL.budget_tokens), "--json", str(tmp_path / "out" / "mem.json"), *extra]


def test_cli_writes_json_with_parameters_environment_and_results(tmp_path, capsys):
    assert bench_main(_small_argv(tmp_path)) == 0
    printed = capsys.readouterr().out
    assert "utilisation (time-averaged)" in printed and "oracle" in printed and "paged" in printed
    doc = json.loads((tmp_path / "out" / "mem.json").read_text())
    assert doc["benchmark"] == "memory"
    assert set(doc) >= {"parameters", "workload", "environment", "results", "goal"}
    assert doc["parameters"]["workload"] == SMALL.workload.as_dict()
    assert doc["parameters"]["block_size"] == 16 and doc["parameters"]["budget_tokens"] == 4096
    assert {"python", "torch", "device"} <= set(doc["environment"])
    for name in ("max", "pow2", "oracle", "paged"):
        r = doc["results"][name]
        assert {"utilisation", "utilisation_at_peak", "waste", "concurrency", "steps",
                "preemptions"} <= set(r)
    assert doc["goal"]["paged_utilisation_min"] == 0.96
    assert doc["goal"]["met"] == (doc["results"]["paged"]["utilisation"] >= 0.96)
    assert doc == json.loads(json.dumps(report(SMALL, run(SMALL)) | {"environment": doc["environment"]}))


@pytest.mark.parametrize("flag, value, field", [
    ("--num-requests", "0", "num_requests"),
    ("--max-model-len", "1", "max_model_len"),
    ("--prompt-sigma", "0", "prompt_sigma"),
    ("--output-mean", "-5", "output_mean"),
    ("--block-size", "12", "block_size"),
    ("--budget-tokens", "4100", "budget_tokens"),  # not a multiple of the block size
    ("--budget-tokens", "256", "budget_tokens"),  # smaller than one max_model_len request
])
def test_cli_bad_arguments_exit_with_a_message_naming_the_field(tmp_path, capsys, flag, value, field):
    with pytest.raises(SystemExit) as err:
        bench_main(_small_argv(tmp_path, flag, value))
    assert err.value.code == 2
    assert field in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_needs_a_subcommand(capsys):
    with pytest.raises(SystemExit):
        bench_main([])
    with pytest.raises(SystemExit):
        bench_main(["speculative"])  # not written yet, so not offered


@pytest.mark.parametrize("kwargs", [dict(num_requests=0), dict(seed=-1), dict(num_requests=2.5),
                                    dict(prompt_mean=float("nan")), dict(output_sigma=True)])
def test_bad_workload_spec_raises(kwargs):
    with pytest.raises(ValueError, match=next(iter(kwargs))):
        WorkloadSpec(**kwargs)


def test_simulate_rejects_requests_that_cannot_run():
    with pytest.raises(ValueError, match="requests is empty"):
        simulate([], paged(16, 4), max_model_len=32)
    with pytest.raises(ValueError, match="could never run"):
        simulate([Request(0, 10, 10)], paged(16, 4), max_model_len=32)
    with pytest.raises(ValueError, match="more than max_model_len=8"):
        simulate([Request(0, 5, 5)], paged(16, 4), max_model_len=8)
    with pytest.raises(ValueError, match="output_len"):
        simulate([Request(0, 3, 0)], contiguous(16), max_model_len=8)
    with pytest.raises(ValueError, match="reserves 32 positions under the max rule"):
        simulate([Request(0, 3, 3)], contiguous(16), max_model_len=32)
    with pytest.raises(ValueError, match="rule must be one of"):
        contiguous(64, "min")


def test_chunked_prompt_blocks_follow_the_chunks():
    """A 100-token prompt, 32 tokens a step, blocks of 16: the Scheduler holds 2, 4, 6, 7 blocks after
    its four chunks, and every held block but the partial last one is written; reserving the whole
    prompt holds 7 from the first step."""
    got = chunked_prompt_blocks(100, 32, 16)
    assert got["computed_tokens"] == [32, 64, 96, 100]
    assert got["held_scheduled_only"] == [2, 4, 6, 7] == got["written"]
    assert got["held_whole_prompt"] == [7, 7, 7, 7]
    with pytest.raises(ValueError, match="prompt_len must be a positive int"):
        chunked_prompt_blocks(0, 32, 16)


def test_thrash_falls_with_fewer_seats_and_a_watermark():
    """More seats than the pool can carry admit requests that are later preempted; a watermark or
    fewer seats trades that recomputation away."""
    requests = make_workload(SMALL.workload)
    cache = paged(SMALL.budget_tokens, SMALL.block_size)
    rows = {(r["max_num_seqs"], r["watermark"]): r
            for r in thrash_sweep(requests, cache, SMALL.workload.max_model_len, (4, 256), (0.0, 0.2))}
    eager = rows[(256, 0.0)]
    assert eager["preemptions"] > 0 and eager["recompute_share"] > 0
    assert rows[(256, 0.2)]["recompute_share"] < eager["recompute_share"]
    assert rows[(4, 0.0)]["preemptions"] == 0 and rows[(4, 0.0)]["recompute_share"] == 0
    for r in rows.values():  # the same work is done whatever is recomputed
        assert r["tokens_computed"] * (1 - r["recompute_share"]) == pytest.approx(
            sum(q.max_cached_tokens for q in requests))
