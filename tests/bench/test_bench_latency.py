"""The latency benchmark: seeded Poisson arrivals, serve() on a fake clock (exact TTFT / ITL by hand,
tokens equal to the greedy reference), time-weighted concurrency and Little's law on hand-made traces,
the budget sweep on a clock that charges per token, percentiles against numpy, bad input, and the CLI
end to end. Latency numbers themselves are benchmark output, not asserted here."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from radarlab.bench.latency import (
    LatencyBenchConfig,
    RequestTrace,
    StepTiming,
    format_table,
    littles_law,
    max_count,
    percentiles,
    poisson_arrivals,
    run_budget_sweep,
    serve,
    summarize,
    time_weighted_count,
)
from radarlab.engine import Engine, SamplingParams
from radarlab.lab.workload import random_token_prompts
from radarlab.models.generate import greedy_generate
from radarlab.models.llama import Llama, LlamaConfig

VOCAB = 128
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    """A 2-layer random-weight Llama (as in test_engine.py): fast, logits far from ties."""
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, max_position_embeddings=256)
    torch.manual_seed(0)
    return Llama(cfg).eval()


class FakeClock:
    """Time stands still except when an engine step runs (a fixed cost) or serve() sleeps."""

    def __init__(self, step_cost: float) -> None:
        self.t = 0.0
        self.step_cost = step_cost
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        assert seconds > 0, "serve() slept for a non-positive time"
        self.sleeps.append(seconds)
        self.t += seconds

    def wrap(self, engine: Engine) -> Engine:
        real_step = engine.step

        def step():
            self.t += self.step_cost
            return real_step()

        engine.step = step
        return engine


def fake_serve(model, prompts, arrivals, max_tokens, step_cost=0.5, **engine_kw):
    fake = FakeClock(step_cost)
    engine = fake.wrap(Engine(model, **{"num_blocks": 64, "block_size": 4, **engine_kw}))
    steps: list[StepTiming] = []
    traces = serve(engine, prompts, arrivals, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   clock=fake.clock, sleep=fake.sleep, steps=steps)
    return traces, steps, fake, engine


# --- arrivals and prompts ----------------------------------------------------------------------------

def test_arrivals_are_deterministic_sorted_and_scale_with_rate():
    a = poisson_arrivals(200, 2.0, seed=3)
    assert a == poisson_arrivals(200, 2.0, seed=3)
    assert a != poisson_arrivals(200, 2.0, seed=4)
    assert len(a) == 200 and a[0] > 0 and all(x < y for x, y in zip(a, a[1:]))
    # the same seed gives the same gaps, scaled by 1/rate
    assert np.allclose(poisson_arrivals(200, 8.0, seed=3), np.asarray(a) / 4, rtol=1e-12)


def test_arrival_gaps_have_mean_one_over_rate():
    gaps = np.diff([0.0] + poisson_arrivals(100_000, 4.0, seed=0))
    assert abs(gaps.mean() - 0.25) < 0.01  # exponential: sd 0.25 / sqrt(1e5) = 0.0008
    assert abs(gaps.std() - 0.25) < 0.01


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), float("inf"), True])
def test_arrivals_need_a_positive_rate(rate):
    with pytest.raises(ValueError, match="rate"):
        poisson_arrivals(5, rate, seed=0)


@pytest.mark.parametrize("n", [0, -3, 2.5])
def test_arrivals_need_a_positive_request_count(n):
    with pytest.raises(ValueError, match="num_requests"):
        poisson_arrivals(n, 1.0, seed=0)


# --- serve() on a fake clock: every timestamp by hand ------------------------------------------------

def test_serve_exact_timestamps_two_overlapping_requests(tiny):
    """A arrives at 0, B at 0.75; each step costs 0.5 s; 3 tokens each, prefill fits in one step.
    step 1 [0, 0.5]: A prefill -> A1 @0.5. step 2 [0.5, 1.0]: A decode -> A2 @1.0 (B arrived mid-step).
    step 3 [1.0, 1.5]: A decode + B prefill -> A3, B1 @1.5. steps 4, 5: B2 @2.0, B3 @2.5."""
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12]]
    traces, steps, fake, _ = fake_serve(tiny, prompts, [0.0, 0.75], max_tokens=3)
    a, b = traces
    assert a.token_times == [0.5, 1.0, 1.5] and b.token_times == [1.5, 2.0, 2.5]
    assert (a.added, b.added) == (0.0, 1.0)  # B waits for the running step to end
    assert (a.ttft, b.ttft) == (0.5, 0.75)
    assert a.itls == b.itls == [0.5, 0.5]
    assert (a.e2e, b.e2e) == (1.5, 1.75)
    assert [s.num_running for s in steps] == [1, 1, 2, 1, 1]
    assert [s.num_tokens for s in steps] == [5, 1, 1 + 3, 1, 1]
    assert [(s.start, s.end) for s in steps] == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0), (2.0, 2.5)]
    assert fake.sleeps == []
    assert a.status == b.status == "finished_length" and a.ok and b.ok

    s = summarize(traces, steps)
    assert s["ttft_s"] == {"mean": 0.625, "p50": 0.625, "p99": pytest.approx(0.5 + 0.99 * 0.25, abs=1e-15),
                           "max": 0.75}
    assert s["itl_s"] == {"mean": 0.5, "p50": 0.5, "p99": 0.5, "max": 0.5}
    assert s["e2e_s"]["p50"] == 1.625
    assert s["output_tokens"] == 6 and s["duration_s"] == 2.5 and s["output_throughput_tok_s"] == 6 / 2.5
    # in the system: A [0, 1.5], B [0.75, 2.5] -> (1.5 + 1.75) / 2.5; in the batch: 6 request-steps of 0.5 s;
    # B waits from 0.75 to 1.0 (the step it arrived in) -> 0.25 / 2.5
    assert s["concurrency"] == {"in_system_time_weighted": pytest.approx(1.3), "running_time_weighted": 1.2,
                                "waiting_time_weighted": pytest.approx(0.1), "in_system_max": 2,
                                "running_max": 2, "running_step_mean": 6 / 5}
    law = s["littles_law"]  # lambda = 2 / 2.5, W = (1.5 + 1.75) / 2
    assert law["window_s"] == [0.0, 2.5] and law["lambda_req_s"] == 0.8 and law["W_s"] == 1.625
    assert law["L"] == pytest.approx(1.3) and law["lambda_x_W"] == pytest.approx(1.3)
    assert law["L_over_lambda_x_W"] == pytest.approx(1.0, abs=1e-12)
    assert s["steps"] == 5 and s["preemptions"] == 0 and s["completed"] == 2 and s["errored"] == 0


def test_serve_sleeps_until_the_next_arrival_when_idle(tiny):
    """Nothing to do until A arrives at 0.25; A is done at 1.75; the engine idles until B arrives at 5.0."""
    traces, steps, fake, _ = fake_serve(tiny, [[1, 2, 3], [4, 5, 6, 7]], [0.25, 5.0], max_tokens=3)
    assert fake.sleeps == [0.25, 3.25]  # before A, then between A's last token (at 1.75) and B
    a, b = traces
    assert a.token_times == [0.75, 1.25, 1.75] and b.token_times == [5.5, 6.0, 6.5]
    assert a.ttft == b.ttft == 0.5
    c = summarize(traces, steps)["concurrency"]
    assert c["running_max"] == c["in_system_max"] == 1
    # busy 1.5 s of 6.5 with one request; the idle gaps before A and between A and B count as 0
    assert c["in_system_time_weighted"] == pytest.approx(3.0 / 6.5)
    assert c["running_time_weighted"] == 3.0 / 6.5
    assert c["running_step_mean"] == 1.0  # the per-step mean cannot see the idle time


def test_serve_ttft_counts_every_prefill_chunk(tiny):
    """With a budget of 8 tokens per step a 20-token prompt needs 3 steps before its first token."""
    traces, steps, _, _ = fake_serve(tiny, [list(range(20))], [0.0], max_tokens=2, max_num_batched_tokens=8)
    assert [s.num_tokens for s in steps] == [8, 8, 4, 1]
    assert traces[0].ttft == 1.5 and traces[0].itls == [0.5]


def test_serve_delivers_every_token_equal_to_greedy_under_preemption(tiny):
    prompts = random_token_prompts(10, VOCAB, (4, 30), seed=4)
    arrivals = poisson_arrivals(10, 8.0, seed=4)  # with 0.5 s steps, everyone queues
    traces, steps, _, engine = fake_serve(tiny, prompts, arrivals, max_tokens=8, num_blocks=20,
                                          max_num_seqs=6, max_num_batched_tokens=24)
    assert [t.output_token_ids for t in traces] == greedy_generate(tiny, prompts, 8)
    assert all(len(t.token_times) == 8 and t.status == "finished_length" for t in traces)
    assert all(t.added >= t.arrival and t.token_times[0] > t.added for t in traces)
    s = summarize(traces, steps)
    assert s["preemptions"] == engine.scheduler.num_preemptions > 0  # the small pool really preempted
    assert s["output_tokens"] == 80 and s["completed"] == 10
    assert s["concurrency"]["running_max"] <= 6 < s["concurrency"]["in_system_max"]  # the rest queued
    assert s["littles_law"]["L_over_lambda_x_W"] == pytest.approx(1.0, abs=1e-12)
    assert engine.manager.num_free_blocks == 20


def test_serve_records_a_request_that_cannot_run(tiny):
    traces, steps, _, _ = fake_serve(tiny, [[1, 2, 3], list(range(40))], [0.0, 0.0], max_tokens=2,
                                     num_blocks=4)
    assert traces[0].ok and traces[0].output_token_ids == greedy_generate(tiny, [[1, 2, 3]], 2)[0]
    # the pool holds 16 tokens, so the engine's max_model_len is 16
    assert not traces[1].ok and traces[1].status == "finished_error" and "max_model_len=16" in traces[1].error
    s = summarize(traces, steps)
    assert (s["completed"], s["errored"], s["output_tokens"]) == (1, 1, 2)


def test_serve_rejects_bad_input(tiny):
    engine = Engine(tiny, num_blocks=16, block_size=4)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="arrival"):
        serve(engine, [[1, 2]], [0.0, 1.0], params)
    with pytest.raises(ValueError, match="sorted"):
        serve(engine, [[1, 2], [3]], [1.0, 0.5], params)
    with pytest.raises(ValueError, match="empty"):
        serve(engine, [], [], params)


# --- percentiles ---------------------------------------------------------------------------------------

def test_percentiles_match_numpy_linear_interpolation():
    data = np.random.default_rng(0).lognormal(size=37).tolist()
    got = percentiles(data, (50, 90, 99))
    assert got == {"mean": pytest.approx(np.mean(data), rel=1e-15), "p50": np.percentile(data, 50),
                   "p90": np.percentile(data, 90), "p99": np.percentile(data, 99),
                   "max": max(data)}
    assert percentiles([1.0, 2.0, 3.0, 4.0]) == {"mean": 2.5, "p50": 2.5, "p99": pytest.approx(3.97),
                                                 "max": 4.0}
    assert percentiles([]) == {"mean": None, "p50": None, "p99": None, "max": None}


def test_summarize_on_hand_made_traces():
    traces = [RequestTrace(0, 4, 0.0, 0.0, [1.0, 1.5, 3.0]), RequestTrace(1, 4, 1.0, 1.0, [3.0, 3.25]),
              RequestTrace(2, 4, 2.0, 2.0, error="too long")]
    s = summarize(traces)
    assert s["ttft_s"]["p50"] == 1.5 and s["itl_s"] == percentiles([0.5, 1.5, 0.25])
    assert s["e2e_s"]["p50"] == np.percentile([3.0, 2.25], 50)
    assert (s["completed"], s["errored"], s["output_tokens"], s["duration_s"]) == (2, 1, 5, 3.25)
    # stays: [0, 3.0] and [1.0, 3.25]; the errored request has no known departure
    assert s["concurrency"]["in_system_time_weighted"] == pytest.approx(5.25 / 3.25)
    assert s["concurrency"]["running_time_weighted"] == 0.0 and s["concurrency"]["running_max"] is None
    assert s["littles_law"]["L_over_lambda_x_W"] == pytest.approx(1.0) and s["steps"] == 0


# --- time-weighted concurrency and Little's law on a synthetic trace ------------------------------------

STAYS = [(0.0, 4.0), (1.0, 3.0), (2.0, 6.0)]  # (arrival, departure) of three requests


def trace_of(stays):
    return [RequestTrace(i, 4, a, finish=d) for i, (a, d) in enumerate(stays)]


def test_time_weighted_count_by_hand():
    assert time_weighted_count(STAYS, (0.0, 6.0)) == 10 / 6  # stays of 4 + 2 + 4 seconds
    assert time_weighted_count(STAYS, (1.0, 4.0)) == 7 / 3  # 3 + 2 + 2 seconds inside [1, 4]
    assert time_weighted_count(STAYS, (6.0, 8.0)) == 0.0
    assert max_count(STAYS) == 3 and max_count([]) == 0
    assert max_count([(0.0, 1.0), (1.0, 2.0)]) == 1  # [enter, leave): a handover is no overlap


def test_littles_law_holds_over_a_window_that_starts_and_ends_empty():
    law = littles_law(trace_of(STAYS))  # default window: 0 to the last departure
    assert law["window_s"] == [0.0, 6.0]
    assert law["L"] == 10 / 6 and law["lambda_req_s"] == 0.5 and law["W_s"] == 10 / 3
    assert law["lambda_x_W"] == pytest.approx(10 / 6) and law["L_over_lambda_x_W"] == pytest.approx(1.0)


def test_littles_law_drifts_over_a_window_cut_through_a_busy_period():
    """Window [1, 4]: L = 7/3; arrivals 1 and 2 -> lambda = 2/3, W = (2 + 4) / 2 = 3: lambda x W = 2."""
    law = littles_law(trace_of(STAYS), (1.0, 4.0))
    assert law["L"] == pytest.approx(7 / 3) and law["lambda_req_s"] == pytest.approx(2 / 3)
    assert law["W_s"] == 3.0
    assert law["lambda_x_W"] == pytest.approx(2.0) and law["L_over_lambda_x_W"] == pytest.approx(7 / 6)
    empty = littles_law(trace_of(STAYS), (10.0, 11.0))
    assert empty["L"] == 0.0 and empty["W_s"] is None and empty["L_over_lambda_x_W"] is None


@pytest.mark.parametrize("call, match", [
    (lambda: time_weighted_count(STAYS, (2.0, 2.0)), "window"),
    (lambda: time_weighted_count(STAYS, (0.0, float("nan"))), "window"),
    (lambda: time_weighted_count([(3.0, 1.0)], (0.0, 5.0)), "intervals"),
    (lambda: littles_law([RequestTrace(0, 4, 0.0)]), "traces"),
    (lambda: littles_law(trace_of(STAYS), (0.0,)), "window"),
])
def test_concurrency_rejects_bad_input(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# --- the budget sweep on a clock that charges per token ---------------------------------------------

def test_budget_sweep_chunked_prefill_bounds_the_decoders_gaps(tiny):
    """Each forward pass costs 0.1 s + 0.01 s per token. With a budget of 8 no step exceeds 8 tokens, and
    the decoders run every step (running requests are scheduled first), so no gap exceeds 0.18 s. With a
    budget of 64 a whole 30-40-token prompt joins the step of the decoders: some gap is >= 0.1 + 0.31."""
    fake = FakeClock(step_cost=0.0)
    hook = tiny.register_forward_pre_hook(lambda _,
                                          args: setattr(fake, "t", fake.t + 0.1 + 0.01 * args[0].numel()))
    try:
        config = LatencyBenchConfig(num_requests=8, output_len=4, prompt_len_range=(30, 40), max_num_seqs=4,
                                    budgets=(8, 64), budget_rate=50.0, seed=1)
        rows = run_budget_sweep(config, model=tiny, clock=fake.clock, sleep=fake.sleep)
    finally:
        hook.remove()
    small, large = rows
    assert [r["max_num_batched_tokens"] for r in rows] == [8, 64] and {r["rate"] for r in rows} == {50.0}
    assert all(r["completed"] == 8 and r["output_tokens"] == 32 for r in rows)
    assert small["itl_s"]["max"] <= 0.18 + 1e-9 < 0.41 <= large["itl_s"]["max"]
    assert small["ttft_s"]["p50"] > large["ttft_s"]["p50"]  # chunks delay the first token
    assert all(r["littles_law"]["L_over_lambda_x_W"] == pytest.approx(1.0, abs=1e-12) for r in rows)
    assert "budget" in format_table(rows, key="max_num_batched_tokens").splitlines()[0]


# --- configuration and the command line ---------------------------------------------------------------

@pytest.mark.parametrize("field, value", [("num_requests", 0), ("output_len", 0), ("output_len", -2),
                                          ("rates", (1.0, 0.0)), ("rates", ()), ("max_num_seqs", 0),
                                          ("num_blocks", 0), ("dtype", "int8"), ("backend", "cuda"),
                                          ("budgets", (64, 0)), ("budgets", (64.0,)), ("budget_rate", 0.0),
                                          ("prompt_len_range", (8, 4)), ("prompt_len_range", (0, 4)),
                                          ("prompt_len_range", (4,))])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        LatencyBenchConfig(**{field: value})


def test_default_pool_holds_every_request_at_full_length():
    prompts = [[0] * 16, [0] * 17, [0] * 100]
    assert LatencyBenchConfig(output_len=16, block_size=16).blocks_for(prompts) == 2 + 3 + 8
    assert LatencyBenchConfig(num_blocks=5).blocks_for(prompts) == 5


@pytest.mark.slow
def test_cli_end_to_end_on_the_course_model(tmp_path):
    """A subprocess (torch thread settings stay out of this process): 3 requests, 2 tokens each, at one
    rate and with two budgets."""
    out = tmp_path / "latency.json"
    env = {**os.environ, "RADARLAB_FULL": "0"}
    proc = subprocess.run([sys.executable, "-m", "radarlab.bench", "latency", "--rates", "4",
                           "--num-requests", "3",
                           "--output-len", "2", "--threads", "1", "--budgets", "32,512", "--budget-rate", "8",
                           "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "TTFT p50" in proc.stdout
    doc = json.loads(out.read_text())
    assert set(doc) == {"benchmark", "parameters", "environment", "results", "budget_sweep"}
    assert doc["benchmark"] == "latency" and doc["parameters"]["rates_req_s"] == [4.0]
    assert doc["parameters"]["torch_threads"] == 1 and doc["parameters"]["budget_sweep_rate_req_s"] == 8.0
    load = doc["environment"]["load_average"]
    assert len(load["start"]) == len(load["end"]) == 3 and load["wall_s"] > 0
    (r,) = doc["results"]
    assert r["rate"] == 4.0 and r["completed"] == 3 and r["output_tokens"] == 6 and r["preemptions"] == 0
    for key in ("ttft_s", "itl_s", "e2e_s"):
        assert set(r[key]) == {"mean", "p50", "p99",
                               "max"} and all(math.isfinite(v) and v > 0 for v in r[key].values())
    assert r["ttft_s"]["p50"] <= r["ttft_s"]["p99"] <= r["e2e_s"]["p99"]
    c = r["concurrency"]
    assert 0 < c["running_time_weighted"] <= c["in_system_time_weighted"] <= c["in_system_max"] <= 3
    assert r["littles_law"]["L_over_lambda_x_W"] == pytest.approx(1.0, abs=1e-9)
    assert r["output_throughput_tok_s"] == pytest.approx(6 / r["duration_s"])
    assert [b["max_num_batched_tokens"] for b in doc["budget_sweep"]] == [32, 512]
    assert all(b["rate"] == 8.0 and b["completed"] == 3 for b in doc["budget_sweep"])


def test_plot_latency_sweep_draws_the_panels():
    import matplotlib

    matplotlib.use("Agg")
    from radarlab.viz.latency_plot import plot_latency_sweep

    def row(rate, c, **extra):
        return {"rate": rate, "ttft_s": {"p50": 1.0 * rate, "p99": 2.0 * rate},
                "itl_s": {"p50": 0.1, "p99": None},
                "concurrency": {"in_system_time_weighted": 2 * c, "running_time_weighted": c},
                "littles_law": {"lambda_x_W": 2 * c + 0.5}, **extra}

    fig = plot_latency_sweep([row(2.0, 3.0), row(0.5, 1.0)])
    ttft, itl, conc = fig.axes
    assert list(ttft.lines[0].get_xdata()) == [0.5, 2.0] and list(ttft.lines[1].get_ydata()) == [1.0, 4.0]
    assert list(itl.lines[0].get_ydata()) == [100.0, 100.0]  # milliseconds
    assert [list(line.get_ydata()) for line in conc.lines] == [[2.0, 6.0], [2.5, 6.5], [1.0, 3.0]]

    budgets = [row(2.0, 1.0, max_num_batched_tokens=b) for b in (256, 64)]
    budgets[0]["itl_s"] = {"p50": 0.2, "p99": 0.5}
    fig = plot_latency_sweep([row(2.0, 3.0)], budgets, max_num_seqs=16)
    *_, conc, budget = fig.axes
    assert list(conc.lines[-1].get_ydata()) == [16, 16]  # the max_num_seqs line
    assert list(budget.lines[0].get_xdata()) == [64, 256] and list(budget.lines[1].get_ydata())[1] == 500.0
    with pytest.raises(ValueError, match="results"):
        plot_latency_sweep([])
