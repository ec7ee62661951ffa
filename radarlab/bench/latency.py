"""Latency under load: Poisson arrivals served by the radarlab Engine, swept over request rates.

An online service does not get its requests in one batch: users arrive at random. We model arrivals
as a Poisson process (exponential gaps between requests, as vLLM's benchmarks/benchmark_serving.py does
with --request-rate) and serve them with continuous batching in wall-clock time:

- a request is added to the engine once the clock passes its arrival time;
- the engine steps while anything is unfinished, and sleeps until the next arrival when idle;
- every token is timestamped when the step that sampled it returns.

Per rate we report what a user feels and what the operator pays for:

- TTFT, time to first token: first token time - arrival (queueing + prefill);
- ITL, inter-token latency: the gaps between a request's consecutive tokens, pooled over requests;
- end-to-end latency: last token time - arrival;
- output throughput: output tokens / (end of the run - its start);
- concurrency, time-weighted over the run (idle time counts as 0): requests in the system (arrived,
  not yet finished: queued or running), and requests in the running batch. A per-step mean would
  weigh a 50 ms decode step like a 2 s prefill step, so it is reported only beside them;
- Little's law, computed: L, the time-weighted number in the system, against lambda x W, the arrival
  rate times the mean time in the system, over the same window (the whole run);
- preemptions (recompute), and steps.

max_num_seqs (16 by default) is below the load the high rates offer, so there requests queue: the
engine saturates, not the workload; with 200 requests per rate, p99 is not the maximum.
A second sweep holds one rate near saturation and varies max_num_batched_tokens, the per-step token
budget: a small budget chunks prefills, so the decoders sharing a step wait less (ITL p99) while
new requests wait longer for their first token.

Percentiles are numpy's default (linear interpolation between order statistics).

The same seeded prompts (random token ids, short: 16-64 tokens) are served at every rate, and the
engine is rebuilt per rate, so each rate starts from an empty pool and a cold prefix cache.
`python -m radarlab.bench latency --json PATH` runs it.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from radarlab.bench.report import add_batching_arguments
from radarlab.lab.workload import random_token_prompts
from radarlab.util import cdiv, require_int, require_number

# The CPU sweep, sized on a shared 2-core machine with one torch thread, where the engine completes at
# most about 5 requests/s of this workload (results/latency.json): the top two rates overload it, and
# the budget sweep's rate is just below that. A rate costs 200 / rate seconds or more: about 13 minutes
# in all.
DEFAULT_RATES = (1.0, 2.0, 3.0, 4.0, 6.0, 8.0)  # requests per second
DEFAULT_NUM_REQUESTS = 200  # per rate: p99 of TTFT is then not simply the unluckiest request
DEFAULT_MAX_NUM_SEQS = 16  # below the concurrency the top rates would need: there requests queue
DEFAULT_BUDGETS = (64, 128, 256, 512)  # max_num_batched_tokens values of the budget sweep
DEFAULT_BUDGET_RATE = 4.0  # near saturation on the CPU
FULL_SCALE_RATES = (4.0, 8.0, 16.0, 32.0, 64.0, 128.0)  # on a GPU the engine serves far more
FULL_SCALE_NUM_REQUESTS = 512
FULL_SCALE_BUDGET_RATE = 32.0  # not measured: pick it from a rate sweep with --budget-rate
DEFAULT_OUTPUT_LEN = 16
PROMPT_LEN_RANGE = (16, 64)  # inclusive; short, so that a rate costs minutes, not hours, on a CPU
PERCENTILES = (50, 99)
PERCENTILE_METHOD = "numpy.percentile default: linear interpolation between order statistics"


# --- the workload --------------------------------------------------------------------------------

def poisson_arrivals(num_requests: int, rate: float, seed: int) -> list[float]:
    """Arrival times in seconds from 0 of a Poisson process with `rate` requests per second:
    cumulative sums of exponential gaps with mean 1 / rate. The same seed gives the same gaps
    (scaled by 1 / rate) at every rate, so rates differ only in how densely requests come."""
    require_int("num_requests", num_requests)
    require_number("rate", rate, positive=True)  # requests per second
    gaps = np.random.default_rng(seed).exponential(1.0, size=num_requests) / rate
    return np.cumsum(gaps).tolist()


# --- serving in wall-clock time ------------------------------------------------------------------

@dataclass
class RequestTrace:
    """One request's life, in seconds from the start of serve()."""
    request_id: int
    prompt_len: int
    arrival: float  # when the request arrived (the workload's schedule)
    # when serve() handed it to the engine (>= arrival: it waits for a step to end)
    added: float | None = None
    token_times: list[float] = field(default_factory=list)  # when the step that sampled each token returned
    output_token_ids: list[int] = field(default_factory=list)
    finish: float | None = None
    status: str | None = None  # the engine's RequestStatus value at the end
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.arrival

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2e(self) -> float:
        return self.token_times[-1] - self.arrival

    @property
    def departure(self) -> float | None:
        """When the request left the system: its finish (an error too), else its last token; None if
        neither is known (a hand-made trace)."""
        if self.finish is not None:
            return self.finish
        return self.token_times[-1] if self.token_times else None


@dataclass(frozen=True)
class StepTiming:
    """When one engine step ran and how big its batch was (from engine.last_scheduled); what each
    request did in a step is radarlab.lab.timeline's StepRecord."""
    start: float
    end: float
    num_running: int  # requests in the batch (prefill chunks and decodes)
    num_tokens: int  # tokens computed
    num_waiting: int  # requests still queued after the step
    num_preempted: int


def serve(engine, prompts: Sequence[Sequence[int]], arrivals: Sequence[float], params,
          clock: Callable[[], float] = time.perf_counter, sleep: Callable[[float], None] = time.sleep,
          steps: list[StepTiming] | None = None) -> list[RequestTrace]:
    """Serve prompts[i] arriving at arrivals[i] seconds; returns one trace per prompt, in order.

    Requests get ids 0..n-1 in the engine, so the engine must be fresh. If `steps` is a list, one
    StepTiming per engine step is appended to it. clock and sleep are injectable so that tests can
    run on a fake clock."""
    import torch

    if len(prompts) != len(arrivals):
        raise ValueError(f"{len(prompts)} prompts but {len(arrivals)} arrival times")
    if not prompts:
        raise ValueError("prompts is empty")
    if any(b < a for a, b in zip(arrivals, arrivals[1:])) or arrivals[0] < 0:
        raise ValueError("arrivals must be non-negative and sorted")
    if engine.has_unfinished_requests():
        raise ValueError("engine already has unfinished requests; serve() needs a fresh engine")
    traces = [RequestTrace(i, len(p), float(t)) for i, (p, t) in enumerate(zip(prompts, arrivals))]
    start = clock()
    nxt = 0  # the next request to arrive
    with torch.inference_mode():
        while nxt < len(prompts) or engine.has_unfinished_requests():
            now = clock() - start
            while nxt < len(prompts) and arrivals[nxt] <= now:
                engine.add_request(prompts[nxt], params, request_id=nxt)
                traces[nxt].added = now
                nxt += 1
            if not engine.has_unfinished_requests():
                sleep(arrivals[nxt] - now)  # idle until the next arrival
                continue
            t0 = clock() - start
            outputs = engine.step()
            t1 = clock() - start
            sched = engine.last_scheduled
            if steps is not None:
                steps.append(StepTiming(t0, t1, len(sched.requests), sched.total_tokens,
                                        len(engine.scheduler.waiting), len(sched.preempted)))
            for out in outputs:
                trace = traces[out.request_id]
                for token in out.new_token_ids:
                    trace.token_times.append(t1)
                    trace.output_token_ids.append(token)
                if out.finished:
                    trace.finish, trace.status, trace.error = t1, out.status.value, out.error
    return traces


# --- statistics ----------------------------------------------------------------------------------

def percentiles(values: Sequence[float], qs: Sequence[float] = PERCENTILES) -> dict:
    """{"mean", "p50", "p99", "max"} of values (numpy's linear interpolation); None for each if empty.
    The max stays beside p99 so a reader can tell the tail from the single worst case."""
    keys = ["mean"] + [f"p{q:g}" for q in qs] + ["max"]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float)
    return dict(zip(keys, [float(arr.mean())] + [float(v) for v in np.percentile(arr, list(qs))]
                    + [float(arr.max())]))


def _check_intervals(intervals: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    out = []
    for i, (enter, leave) in enumerate(intervals):
        require_number(f"intervals[{i}] enter", enter)
        require_number(f"intervals[{i}] leave", leave)
        if leave < enter:
            raise ValueError(f"intervals[{i}] leaves before it enters: {(enter, leave)!r}")
        out.append((float(enter), float(leave)))
    return out


def _check_window(window: tuple[float, float]) -> tuple[float, float]:
    if len(window) != 2:
        raise ValueError(f"window must be (start, end), got {window!r}")
    t0, t1 = (require_number("window", t) for t in window)
    if not t1 > t0:
        raise ValueError(f"window must end after it starts, got {window!r}")
    return t0, t1


def time_weighted_count(intervals: Sequence[tuple[float, float]], window: tuple[float, float]) -> float:
    """The mean over `window` (start, end) of how many [enter, leave) intervals cover each instant:
    the time integral of the count, divided by the window's length. With requests' stays in the system
    as the intervals, this is Little's L; a mean over steps would weigh a short step like a long one."""
    t0, t1 = _check_window(window)
    covered = sum(max(0.0, min(leave, t1) - max(enter, t0)) for enter, leave in _check_intervals(intervals))
    return covered / (t1 - t0)


def max_count(intervals: Sequence[tuple[float, float]]) -> int:
    """The most [enter, leave) intervals covering one instant (0 if none). Half-open: one that leaves
    at t and one that enters at t never overlap."""
    checked = _check_intervals(intervals)
    events = sorted([(leave, -1) for _, leave in checked] + [(enter, +1) for enter, _ in checked])  # -1 first
    count = best = 0
    for _, delta in events:
        count += delta
        best = max(best, count)
    return best


def stays(traces: Sequence[RequestTrace]) -> list[tuple[float, float]]:
    """(arrival, departure) of every request whose departure is known: its time in the system."""
    return [(t.arrival, t.departure) for t in traces if t.departure is not None]


def littles_law(traces: Sequence[RequestTrace], window: tuple[float, float] | None = None) -> dict:
    """Little's law, L = lambda x W, computed rather than asserted, over one window:
    L, the time-weighted number of requests in the system (arrived, not departed) over the window;
    lambda, the requests that arrived in the window, per second; W, their mean time in the system
    (arrival to departure, even past the window's end).

    The default window runs from 0 (serve()'s start, before the first arrival) to the last departure:
    the system starts and ends empty, both sides are then the same sum of stays over the same length,
    and a ratio off 1 means a request was lost or double-counted. A window cut through a busy period
    leaves out the parts of stays outside it from L but not from W, so the ratio drifts from 1 by
    the edge effects divided by the window's length. Requests with no known departure are left out."""
    spans = stays(traces)
    if window is None:
        if not spans:
            raise ValueError("traces: no request has a known departure; give a window")
        window = (0.0, max(leave for _, leave in spans))
    t0, t1 = _check_window(window)
    inside = [(enter, leave) for enter, leave in spans if t0 <= enter < t1]
    L = time_weighted_count(spans, (t0, t1))
    lam = len(inside) / (t1 - t0)
    W = float(np.mean([leave - enter for enter, leave in inside])) if inside else None
    lam_w = lam * W if W is not None else None
    return {"window_s": [t0, t1], "L": L, "lambda_req_s": lam, "W_s": W, "lambda_x_W": lam_w,
            "L_over_lambda_x_W": L / lam_w if lam_w else None}


def summarize(traces: Sequence[RequestTrace], steps: Sequence[StepTiming] = ()) -> dict:
    """Latency percentiles, throughput, time-weighted concurrency, Little's law and preemptions of one
    served workload, over the run from serve()'s start to the last departure. Requests that ended with
    an error are counted and left out of the latencies (not out of the system's occupancy)."""
    ok = [t for t in traces if t.ok]
    out_tokens = sum(len(t.token_times) for t in traces)
    spans = stays(traces)
    duration = max((leave for _, leave in spans), default=0.0)
    running = [s.num_running for s in steps]
    busy = sum((s.end - s.start) * s.num_running for s in steps)  # integral of the batch size over time
    in_system = time_weighted_count(spans, (0.0, duration)) if duration > 0 else None
    running_tw = busy / duration if duration > 0 else None
    return {
        "num_requests": len(traces),
        "completed": len(ok),
        "errored": sum(t.error is not None for t in traces),
        "output_tokens": out_tokens,
        "duration_s": duration,
        "output_throughput_tok_s": out_tokens / duration if duration > 0 else None,
        "request_throughput_req_s": len(ok) / duration if duration > 0 else None,
        "ttft_s": percentiles([t.ttft for t in ok]),
        "itl_s": percentiles([g for t in ok for g in t.itls]),
        "e2e_s": percentiles([t.e2e for t in ok]),
        "concurrency": {
            "in_system_time_weighted": in_system,  # arrived, not yet finished: queued or running
            "running_time_weighted": running_tw,  # in the step's batch; idle time counts as 0
            "waiting_time_weighted": in_system - running_tw if duration > 0 else None,
            "in_system_max": max_count(spans),
            "running_max": max(running, default=None),
            "running_step_mean": float(np.mean(running)) if running else None,  # each step weighs the same
        },
        "littles_law": littles_law(traces, (0.0, duration)) if duration > 0 else None,
        "steps": len(steps),
        "preemptions": sum(s.num_preempted for s in steps),
    }


# --- the sweeps ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LatencyBenchConfig:
    rates: tuple[float, ...] = DEFAULT_RATES
    num_requests: int = DEFAULT_NUM_REQUESTS
    output_len: int = DEFAULT_OUTPUT_LEN
    prompt_len_range: tuple[int, int] = PROMPT_LEN_RANGE  # inclusive
    seed: int = 0
    dtype: str = "float32"
    num_blocks: int | None = None  # None: enough for every request at full length at once
    block_size: int = 16
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = 512  # the token budget of the rate sweep
    budgets: tuple[int, ...] = DEFAULT_BUDGETS  # max_num_batched_tokens of the budget sweep; () skips it
    budget_rate: float = DEFAULT_BUDGET_RATE  # the one request rate of the budget sweep
    backend: str = "torch"
    threads: int | None = None  # torch.set_num_threads; None leaves torch's default

    def __post_init__(self) -> None:
        if not self.rates:
            raise ValueError("rates is empty")
        for r in self.rates:
            require_number("rates", r, positive=True)  # requests per second
        for name in ("num_requests", "output_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            require_int(name, getattr(self, name))
        for b in self.budgets:
            require_int("budgets", b)
        require_number("budget_rate", self.budget_rate, positive=True)
        if len(self.prompt_len_range) != 2:
            raise ValueError(f"prompt_len_range must be (shortest, longest), got {self.prompt_len_range!r}")
        lo = require_int("prompt_len_range", self.prompt_len_range[0])
        require_int("prompt_len_range", self.prompt_len_range[1], minimum=lo)
        require_int("seed", self.seed, minimum=0)
        for name in ("num_blocks", "threads"):
            if getattr(self, name) is not None:
                require_int(name, getattr(self, name))
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.backend not in ("torch", "triton"):
            raise ValueError(f"backend must be 'torch' or 'triton', got {self.backend!r}")

    def blocks_for(self, prompts: Sequence[Sequence[int]]) -> int:
        """The pool: num_blocks, or by default every request's prompt + output at once, so memory never
        limits the batch and latency reflects compute and queueing."""
        if self.num_blocks is not None:
            return self.num_blocks
        return sum(cdiv(len(p) + self.output_len, self.block_size) for p in prompts)

    def prompts(self, vocab_size: int) -> list[list[int]]:
        """The seeded prompts every rate and budget serves."""
        return random_token_prompts(self.num_requests, vocab_size, self.prompt_len_range, self.seed)


def run_rate(model, prompts, rate: float, config: LatencyBenchConfig, num_blocks: int,
             clock=time.perf_counter, sleep=time.sleep) -> dict:
    """Serve the prompts at one request rate on a fresh engine; the summary dict plus the rate."""
    from radarlab.engine import Engine, SamplingParams

    engine = Engine(model, num_blocks=num_blocks, block_size=config.block_size,
                    max_num_seqs=config.max_num_seqs,
                    max_num_batched_tokens=config.max_num_batched_tokens, backend=config.backend)
    params = SamplingParams(max_tokens=config.output_len, ignore_eos=True)
    arrivals = poisson_arrivals(len(prompts), rate, config.seed)
    steps: list[StepTiming] = []
    traces = serve(engine, prompts, arrivals, params, clock=clock, sleep=sleep, steps=steps)
    if engine.scheduler.num_preemptions != sum(s.num_preempted for s in steps):
        raise RuntimeError("step records lost a preemption")
    return {"rate": rate, **summarize(traces, steps)}


def warm_up(model, config: LatencyBenchConfig) -> None:
    """One tiny request first, so one-time costs (allocator, kernel selection) land on no rate."""
    from radarlab.engine import Engine, SamplingParams

    engine = Engine(model, num_blocks=8, block_size=config.block_size, backend=config.backend)
    engine.generate([list(range(1, 33))], SamplingParams(max_tokens=4, ignore_eos=True))


def load_model(config: LatencyBenchConfig):
    """The course model in config.dtype, after applying config.threads."""
    import torch

    from radarlab.models.llama import Llama

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    model, _ = Llama.from_pretrained(None, dtype=getattr(torch, config.dtype))
    return model


def run(config: LatencyBenchConfig, model=None, progress: Callable[[str], None] | None = None,
        clock=time.perf_counter, sleep=time.sleep) -> list[dict]:
    """The rate sweep: per rate, the summary of serving the same prompts (see the module docstring)."""
    model = load_model(config) if model is None else model
    prompts = config.prompts(model.config.vocab_size)
    warm_up(model, config)
    results = []
    for rate in config.rates:
        results.append(run_rate(model, prompts, rate, config, config.blocks_for(prompts), clock, sleep))
        if progress is not None:
            progress(format_row(results[-1]))
    return results


def run_budget_sweep(config: LatencyBenchConfig, model=None, progress: Callable[[str], None] | None = None,
                     clock=time.perf_counter, sleep=time.sleep) -> list[dict]:
    """The budget sweep: the same prompts at config.budget_rate, once per max_num_batched_tokens in
    config.budgets. A prefill that does not fit the budget is chunked over steps, so a small budget
    keeps every step, and so every decoder's next token, short (ITL), and delays first tokens (TTFT)."""
    from dataclasses import replace

    model = load_model(config) if model is None else model
    prompts = config.prompts(model.config.vocab_size)
    warm_up(model, config)
    results = []
    for budget in config.budgets:
        c = replace(config, max_num_batched_tokens=budget)
        results.append({"max_num_batched_tokens": budget,
                        **run_rate(model, prompts, config.budget_rate, c, c.blocks_for(prompts), clock,
                                   sleep)})
        if progress is not None:
            progress(format_row(results[-1], key="max_num_batched_tokens"))
    return results


def report(config: LatencyBenchConfig, results: list[dict], budget_sweep: list[dict] | None = None,
           num_blocks: int | None = None, load_average: dict | None = None) -> dict:
    """The JSON document. load_average: os.getloadavg() at the start and end of the run, since on a
    shared machine other work competes for the cores and every timing here depends on it."""
    import os

    import torch

    from radarlab.lab.machine import environment

    params = {
        "rates_req_s": list(config.rates),
        "num_requests": config.num_requests,
        "output_len": config.output_len,
        "prompt_len_range": list(config.prompt_len_range),
        "prompts": "random token ids, lengths uniform in prompt_len_range "
                   "(inclusive), the same at every rate",
        "arrivals": "Poisson: exponential gaps with mean 1/rate, seeded (same gaps "
                    "scaled by 1/rate at each rate)",
        "ignore_eos": True,
        "seed": config.seed,
        "model": "SmolLM2-135M (course model)",
        "dtype": config.dtype,
        "num_blocks": num_blocks if num_blocks is not None else config.num_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "budget_sweep_rate_req_s": config.budget_rate,
        "budget_sweep_max_num_batched_tokens": list(config.budgets),
        "backend": config.backend,
        "torch_threads": torch.get_num_threads(),
        "percentiles": PERCENTILE_METHOD,
        "ttft": "first token time - arrival time",
        "itl": "gaps between consecutive tokens, pooled over requests",
        "concurrency": "time-weighted over the run, 0 to the last departure (idle counts "
                       "as 0): in_system = arrived and not finished, running = in the step's batch, "
                       "waiting = the difference; running_step_mean weighs every step the same",
        "littles_law": "over the same window: L = time-weighted in_system; lambda = arrivals / window; "
                       "W = mean arrival-to-departure time of those arrivals",
    }
    env = {**environment(), "cpu_count": os.cpu_count()}
    if load_average is not None:
        env["load_average"] = load_average
    doc = {"benchmark": "latency", "parameters": params, "environment": env, "results": results}
    if budget_sweep is not None:
        doc["budget_sweep"] = budget_sweep
    return doc


COLUMNS = (f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>6} "
           f"{'L sys':>6} {'L run':>6} {'lam*W':>6} {'L/lamW':>6} {'preempt':>7}")
KEY_LABELS = {"rate": "rate", "max_num_batched_tokens": "budget"}


def header(key: str = "rate") -> str:
    return f"{KEY_LABELS[key]:>6} {COLUMNS}"


def format_row(r: dict, key: str = "rate") -> str:
    """One row: latencies, throughput, time-weighted concurrency in the system (L sys) and in the
    batch (L run), lambda x W and the Little's law ratio."""
    def fmt(v, spec=".2f", unit=1.0):
        return "-" if v is None else format(v * unit, spec)

    conc, law = r["concurrency"], r["littles_law"] or {}
    return (f"{r[key]:>6g} {fmt(r['ttft_s']['p50']):>8}s {fmt(r['ttft_s']['p99']):>8}s "
            f"{fmt(r['itl_s']['p50'], '.0f', 1e3):>6}ms {fmt(r['itl_s']['p99'], '.0f', 1e3):>6}ms "
            f"{fmt(r['output_throughput_tok_s'], '.1f'):>6} {fmt(conc['in_system_time_weighted'], '.1f'):>6} "
            f"{fmt(conc['running_time_weighted'], '.1f'):>6} {fmt(law.get('lambda_x_W'), '.1f'):>6} "
            f"{fmt(law.get('L_over_lambda_x_W'), '.3f'):>6} {r['preemptions']:>7}")


def format_table(results: list[dict], key: str = "rate") -> str:
    """The rate sweep's table, or with key="max_num_batched_tokens" the budget sweep's."""
    return "\n".join([header(key)] + [format_row(r, key) for r in results])


def format_full_run(doc: dict) -> str:
    """A kept sweep (results/latency.json) as notebook 05 shows it: the workload, the machine and its
    load while the sweep ran (every timing depends on it), then both tables."""
    params, env = doc["parameters"], doc["environment"]
    load = env["load_average"]
    return "\n".join([
        f"full sweep: {params['num_requests']} requests per rate, prompts of "
        f"{params['prompt_len_range'][0]} to {params['prompt_len_range'][1]} tokens, {params['output_len']} "
        f"new tokens each, {params['dtype']}, max_num_seqs {params['max_num_seqs']}, max_num_batched_tokens "
        f"{params['max_num_batched_tokens']}",
        f"machine: {env['device']} ({env['device_name']}, {env['platform']}), {env['cpu_count']} cores "
        f"shared with other work, {params['torch_threads']} torch thread(s); 1-minute load average "
        f"{load['start'][0]:.1f} at the start, {load['end'][0]:.1f} at the end, "
        f"{load['wall_s'] / 60:.0f} min",
        format_table(doc["results"]),
        f"\ntoken budget sweep at {params['budget_sweep_rate_req_s']:g} requests/s:",
        format_table(doc["budget_sweep"], key="max_num_batched_tokens"),
    ])


# --- command line --------------------------------------------------------------------------------

def default_scale() -> tuple[tuple[float, ...], int, float]:
    """(rates, num_requests, budget_rate): the CPU sweep, or a bigger one when
    radarlab.device.full_scale()."""
    from radarlab.device import full_scale

    if full_scale():
        return FULL_SCALE_RATES, FULL_SCALE_NUM_REQUESTS, FULL_SCALE_BUDGET_RATE
    return DEFAULT_RATES, DEFAULT_NUM_REQUESTS, DEFAULT_BUDGET_RATE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = LatencyBenchConfig()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    cpu_rates, gpu_rates = (",".join(f"{r:g}" for r in rates) for rates in (DEFAULT_RATES, FULL_SCALE_RATES))
    parser.add_argument("--rates", type=str, default=None,
                        help="comma-separated request rates in req/s (CPU: "
                             f"{cpu_rates}; full scale: {gpu_rates})")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests per rate (CPU: {DEFAULT_NUM_REQUESTS}; full scale: "
                             f"{FULL_SCALE_NUM_REQUESTS})")
    parser.add_argument("--output-len", type=int, default=c.output_len,
                        help="new tokens per request, EOS ignored (%(default)s)")
    parser.add_argument("--seed", type=int, default=c.seed, help="prompts and arrivals seed (%(default)s)")
    parser.add_argument("--dtype", default=c.dtype,
                        help="model and KV dtype: float32 (the fast path on CPU, default), bfloat16, float16")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool blocks (default: every request at full length at "
                             "once: memory is not the limit)")
    add_batching_arguments(parser, c)
    parser.add_argument("--budgets", type=str, default=",".join(map(str, DEFAULT_BUDGETS)),
                        help="comma-separated max_num_batched_tokens of the budget sweep, in place of "
                             "--max-num-batched-tokens there, or 'none' to skip it (%(default)s)")
    parser.add_argument("--budget-rate", type=float, default=None,
                        help=f"request rate of the budget sweep (CPU: {DEFAULT_BUDGET_RATE:g}; "
                             f"full scale: {FULL_SCALE_BUDGET_RATE:g})")
    parser.add_argument("--backend", default=c.backend, help="paged attention: torch or triton (%(default)s)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch.set_num_threads (default: torch's choice)")


def _parse_list(flag: str, text: str, kind: type) -> tuple:
    try:
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated {kind.__name__}s, got {text!r}") from None


def config_from_args(args: argparse.Namespace) -> LatencyBenchConfig:
    """Raises ValueError naming the bad field (python -m radarlab.bench names its flag)."""
    default_rates, default_n, default_budget_rate = default_scale()
    rates = default_rates if args.rates is None else _parse_list("--rates", args.rates, float)
    budgets = () if args.budgets.strip().lower() == "none" else _parse_list("--budgets", args.budgets, int)
    return LatencyBenchConfig(
        rates=rates, num_requests=default_n if args.num_requests is None else args.num_requests,
        output_len=args.output_len, seed=args.seed, dtype=args.dtype, num_blocks=args.num_blocks,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, budgets=budgets,
        budget_rate=default_budget_rate if args.budget_rate is None else args.budget_rate,
        backend=args.backend, threads=args.threads)


def main(args: argparse.Namespace) -> int:
    import os

    from radarlab.bench.report import write_json

    config = config_from_args(args)
    load_start = list(os.getloadavg())
    t0 = time.perf_counter()
    model = load_model(config)
    print(header(), flush=True)
    results = run(config, model, progress=lambda row: print(row, flush=True))
    budget_sweep = None
    if config.budgets:
        print(f"\nbudget sweep at {config.budget_rate:g} requests/s\n{header('max_num_batched_tokens')}",
              flush=True)
        budget_sweep = run_budget_sweep(config, model, progress=lambda row: print(row, flush=True))
    load = {"start": load_start, "end": list(os.getloadavg()), "wall_s": time.perf_counter() - t0,
            "note": "os.getloadavg(): 1, 5 and 15-minute load averages; above cpu_count, other work "
                    "competed for the cores"}
    doc = report(config, results, budget_sweep, config.blocks_for(config.prompts(model.config.vocab_size)),
                 load)
    if args.json:
        write_json(args.json, doc)
    return 0
