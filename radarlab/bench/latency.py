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
- output throughput: output tokens / (last token time - start of the run);
- concurrency: requests in each step's batch (mean and max over steps; also the time-weighted mean
  over the whole run, idle time counting as 0, which is Little's law's L = throughput x latency);
- preemptions (recompute), and steps.

Percentiles are numpy's default (linear interpolation between order statistics). With 16 requests,
p99 is nearly the maximum: read it as "the unluckiest user".

The same seeded prompts (random token ids, 16-128 long) are served at every rate, and the engine is
rebuilt per rate, so each rate starts from an empty pool and a cold prefix cache.
`python -m radarlab.bench latency --json PATH` runs it.
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from radarlab.bench.workload import random_token_prompts
from radarlab.util import cdiv, require_int, require_number

DEFAULT_RATES = (0.25, 0.5, 1.0, 2.0, 4.0, 8.0)  # requests per second
DEFAULT_NUM_REQUESTS = 16  # the CPU sweep takes about 4 minutes on one uncontended core
FULL_SCALE_RATES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)  # on a GPU the engine serves far more
FULL_SCALE_NUM_REQUESTS = 256
DEFAULT_OUTPUT_LEN = 32
PROMPT_LEN_RANGE = (16, 128)  # inclusive, as in the throughput benchmark
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
    added: float | None = None  # when serve() handed it to the engine (>= arrival: it waits for a step to end)
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


@dataclass(frozen=True)
class StepTiming:
    """When one engine step ran and how big its batch was (from engine.last_scheduled); what each
    request did in a step is radarlab.engine.timeline's StepRecord."""
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
    """{"mean", "p50", "p99", ...} of values (numpy's linear interpolation); None for each if empty."""
    keys = ["mean"] + [f"p{q:g}" for q in qs]
    if len(values) == 0:
        return dict.fromkeys(keys)
    arr = np.asarray(values, dtype=float)
    return dict(zip(keys, [float(arr.mean())] + [float(v) for v in np.percentile(arr, list(qs))]))


def summarize(traces: Sequence[RequestTrace], steps: Sequence[StepTiming] = ()) -> dict:
    """Latency percentiles, throughput, concurrency and preemptions of one served workload.
    Requests that ended with an error are counted and left out of the latencies."""
    ok = [t for t in traces if t.ok]
    out_tokens = sum(len(t.token_times) for t in traces)
    duration = max((t.token_times[-1] for t in traces if t.token_times), default=0.0)
    running = [s.num_running for s in steps]
    busy = sum((s.end - s.start) * s.num_running for s in steps)
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
            "mean": float(np.mean(running)) if running else None,  # over steps
            "max": max(running, default=None),
            "time_weighted": busy / duration if duration > 0 else None,  # over the whole run, idle = 0
        },
        "steps": len(steps),
        "preemptions": sum(s.num_preempted for s in steps),
    }


# --- the sweep -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class LatencyBenchConfig:
    rates: tuple[float, ...] = DEFAULT_RATES
    num_requests: int = DEFAULT_NUM_REQUESTS
    output_len: int = DEFAULT_OUTPUT_LEN
    seed: int = 0
    dtype: str = "float32"
    num_blocks: int | None = None  # None: enough for every request at full length at once
    block_size: int = 16
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    backend: str = "torch"
    threads: int | None = None  # torch.set_num_threads; None leaves torch's default

    def __post_init__(self) -> None:
        if not self.rates:
            raise ValueError("rates is empty")
        for r in self.rates:
            require_number("rates", r, positive=True)  # requests per second
        for name in ("num_requests", "output_len", "block_size", "max_num_seqs", "max_num_batched_tokens"):
            require_int(name, getattr(self, name))
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


def run_rate(model, prompts, rate: float, config: LatencyBenchConfig, num_blocks: int,
             clock=time.perf_counter, sleep=time.sleep) -> dict:
    """Serve the prompts at one request rate on a fresh engine; the summary dict plus the rate."""
    from radarlab.engine import Engine, SamplingParams

    engine = Engine(model, num_blocks=num_blocks, block_size=config.block_size, max_num_seqs=config.max_num_seqs,
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


def run(config: LatencyBenchConfig, model=None, progress: Callable[[str], None] | None = None) -> list[dict]:
    """The sweep: per rate, the summary of serving the same prompts (see the module docstring)."""
    import torch

    if config.threads is not None:
        torch.set_num_threads(config.threads)
    if model is None:
        from radarlab.models.llama import Llama

        model, _ = Llama.from_pretrained(None, dtype=getattr(torch, config.dtype))
    prompts = random_token_prompts(config.num_requests, model.config.vocab_size, PROMPT_LEN_RANGE, config.seed)
    num_blocks = config.blocks_for(prompts)
    warm_up(model, config)
    results = []
    for rate in config.rates:
        results.append(run_rate(model, prompts, rate, config, num_blocks))
        if progress is not None:
            progress(format_row(results[-1]))
    return results


def report(config: LatencyBenchConfig, results: list[dict], num_blocks: int | None = None) -> dict:
    """The JSON document."""
    import torch

    from radarlab.hardware.machine import environment

    params = {
        "rates_req_s": list(config.rates),
        "num_requests": config.num_requests,
        "output_len": config.output_len,
        "prompt_len_range": list(PROMPT_LEN_RANGE),
        "prompts": "random token ids, lengths uniform in prompt_len_range (inclusive), the same at every rate",
        "arrivals": "Poisson: exponential gaps with mean 1/rate, seeded (same gaps scaled by 1/rate at each rate)",
        "ignore_eos": True,
        "seed": config.seed,
        "model": "SmolLM2-135M (course model)",
        "dtype": config.dtype,
        "num_blocks": num_blocks if num_blocks is not None else config.num_blocks,
        "block_size": config.block_size,
        "max_num_seqs": config.max_num_seqs,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "backend": config.backend,
        "torch_threads": torch.get_num_threads(),
        "percentiles": PERCENTILE_METHOD,
        "ttft": "first token time - arrival time", "itl": "gaps between consecutive tokens, pooled over requests",
        "concurrency": "requests in each step's batch: mean and max over steps; time_weighted over the run",
    }
    return {"benchmark": "latency", "parameters": params, "environment": environment(), "results": results}


HEADER = (f"{'rate':>6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'tok/s':>7} "
          f"{'conc mean':>9} {'conc max':>8} {'preempt':>7} {'E2E p50':>8}")


def format_row(r: dict) -> str:
    def fmt(v, spec=".2f", unit=1.0):
        return "-" if v is None else format(v * unit, spec)

    conc = r["concurrency"]
    return (f"{r['rate']:>6g} {fmt(r['ttft_s']['p50']):>8}s {fmt(r['ttft_s']['p99']):>8}s "
            f"{fmt(r['itl_s']['p50'], '.0f', 1e3):>6}ms {fmt(r['itl_s']['p99'], '.0f', 1e3):>6}ms "
            f"{fmt(r['output_throughput_tok_s'], '.1f'):>7} {fmt(conc['mean'], '.1f'):>9} "
            f"{fmt(conc['max'], 'd', 1):>8} {r['preemptions']:>7} {fmt(r['e2e_s']['p50']):>7}s")


def format_table(results: list[dict]) -> str:
    return "\n".join([HEADER] + [format_row(r) for r in results])


# --- command line --------------------------------------------------------------------------------

def default_scale() -> tuple[tuple[float, ...], int]:
    """(rates, num_requests): the CPU sweep, or a bigger one when radarlab.device.full_scale()."""
    from radarlab.device import full_scale

    return (FULL_SCALE_RATES, FULL_SCALE_NUM_REQUESTS) if full_scale() else (DEFAULT_RATES, DEFAULT_NUM_REQUESTS)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = LatencyBenchConfig()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    cpu_rates, gpu_rates = (",".join(f"{r:g}" for r in rates) for rates in (DEFAULT_RATES, FULL_SCALE_RATES))
    parser.add_argument("--rates", type=str, default=None,
                        help=f"comma-separated request rates in req/s (CPU: {cpu_rates}; full scale: {gpu_rates})")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"requests per rate (CPU: {DEFAULT_NUM_REQUESTS}; full scale: {FULL_SCALE_NUM_REQUESTS})")
    parser.add_argument("--output-len", type=int, default=c.output_len,
                        help="new tokens per request, EOS ignored (%(default)s)")
    parser.add_argument("--seed", type=int, default=c.seed, help="prompts and arrivals seed (%(default)s)")
    parser.add_argument("--dtype", default=c.dtype,
                        help="model and KV dtype: float32 (the fast path on CPU, default), bfloat16, float16")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV pool blocks (default: every request at full length at once: memory is not the limit)")
    parser.add_argument("--block-size", type=int, default=c.block_size, help="tokens per KV block (%(default)s)")
    parser.add_argument("--max-num-seqs", type=int, default=c.max_num_seqs, help="most requests per step (%(default)s)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=c.max_num_batched_tokens,
                        help="token budget per step (%(default)s)")
    parser.add_argument("--backend", default=c.backend, help="paged attention: torch or triton (%(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")


def config_from_args(args: argparse.Namespace) -> LatencyBenchConfig:
    """Raises ValueError naming the bad field (python -m radarlab.bench names its flag)."""
    default_rates, default_n = default_scale()
    rates = default_rates
    if args.rates is not None:
        try:
            rates = tuple(float(x) for x in args.rates.split(",") if x.strip())
        except ValueError:
            raise ValueError(f"--rates: expected comma-separated numbers, got {args.rates!r}") from None
    return LatencyBenchConfig(
        rates=rates, num_requests=default_n if args.num_requests is None else args.num_requests,
        output_len=args.output_len, seed=args.seed, dtype=args.dtype, num_blocks=args.num_blocks,
        block_size=args.block_size, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, backend=args.backend, threads=args.threads)


def main(args: argparse.Namespace) -> int:
    import torch

    from radarlab.bench.report import write_json
    from radarlab.models.llama import Llama

    config = config_from_args(args)
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    model, _ = Llama.from_pretrained(None, dtype=getattr(torch, config.dtype))
    prompts = random_token_prompts(config.num_requests, model.config.vocab_size, PROMPT_LEN_RANGE, config.seed)
    print(HEADER, flush=True)
    results = run(config, model, progress=lambda row: print(row, flush=True))
    doc = report(config, results, config.blocks_for(prompts))
    if args.json:
        write_json(args.json, doc)
    return 0
