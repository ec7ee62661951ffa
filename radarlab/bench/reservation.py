"""Memory benchmark: how much of the reserved KV memory holds live tokens, reservation-based
(contiguous) caches vs the paged cache, and what the engine computes to get there.

Every cache gets the same KV budget (in token positions) and serves the same workload
(radarlab.lab.workload) through radarlab's own Scheduler and block manager: the loop that runs the
engine, stepped without a model. They differ only in what a request reserves. The three
reservation-based caches are the baselines of the vLLM paper's Fig. 2 and 12 (Kwon et al. 2023,
after Orca): a request reserves one contiguous run of positions at admission and keeps it to the end,

- max: max_model_len positions, however short the request ("Orca (Max)");
- pow2: the next power of two above what it will fill, so up to 2x too much ("Orca (Pow2)");
- oracle: exactly prompt + output - 1 positions, as if the output length were known in advance
  ("Orca (Oracle)": impossible in practice, the best any reservation can do);

- paged: blocks of block_size positions, taken only for the tokens each step computes (vLLM v1's
  allocate_slots). Prefix caching is off: the synthetic prompts share no tokens.

A step is what Engine.step does, minus the forward pass: the Scheduler picks up to
max_num_batched_tokens tokens (decodes first, then prompts in chunks; a request is admitted only if
its whole prompt fits), preempting the newest running request when a block is short; then every
request whose tokens are all computed samples its next token (the workload fixes how many it
samples), and finishes at its output length. Every cost is charged: a preempted request returns to
the front of the queue and recomputes its prompt and outputs so far, and those tokens count in
tokens_computed; recomputed_tokens is what was computed beyond the minimum, the prompt + output - 1
positions each request must fill.

Per step we record live tokens (positions holding computed KV of a running request) and reserved
positions. Utilisation is sum(live) / sum(reserved) over all steps: the time average of the fraction
of reserved KV memory that holds live tokens; "at peak" is the same fraction at the first step with
the most live tokens. The rest is waste, split as in the vLLM paper's Fig. 2 into positions reserved
for tokens the request will still compute, and positions it will never fill (for the paged cache,
the slack of its last block). Concurrency is the number of requests holding memory, averaged over all
steps and over the steps where requests were left waiting (what the budget holds).

`python -m radarlab.bench memory --json PATH` runs it; the goal is paged utilisation >= 0.96 (the vLLM
paper, Kwon et al. 2023, reports under 4% waste).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from radarlab.bench.report import add_batching_arguments
from radarlab.engine.request import Request, RequestStatus
from radarlab.engine.scheduler import Scheduler
from radarlab.kvcache.block_pool import NoFreeBlocks
from radarlab.kvcache.kv_cache_manager import AllocStatus, KVCacheBlocks, KVCacheManager
from radarlab.kvcache.sequence import Sequence
from radarlab.lab.workload import WorkloadRequest, WorkloadSpec, length_summary, make_workload
from radarlab.sample.sampling_params import SamplingParams
from radarlab.util import cdiv, require_int, require_power_of_two

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size on CUDA
DEFAULT_BUDGET_TOKENS = 16 * 2048  # 16 rows of the default max_model_len
DEFAULT_MAX_NUM_SEQS = 256  # vLLM's default
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # vLLM's default token budget per step with chunked prefill
PAGED_UTILISATION_GOAL = 0.96
GOAL_SOURCE = "Kwon et al. 2023 (vLLM, SOSP): paged KV cache wastes under 4% of its memory"
COURSE_MODEL_KV = dict(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M, to express the budget in bytes


RESERVATIONS = ("max", "pow2", "oracle")  # the reservation-based caches, most wasteful first


@dataclass(frozen=True)
class Reservation:
    """How a cache reserves KV memory: paged blocks of block_size taken as tokens are computed, or
    (upfront in RESERVATIONS) one run of positions for the request's lifetime, reserved at admission."""
    name: str
    block_size: int
    num_blocks: int
    upfront: str | None = None

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks


def contiguous(budget_tokens: int, rule: str = "max") -> Reservation:
    """A reservation-based cache of budget_tokens positions, reserving by `rule` (see RESERVATIONS)."""
    if rule not in RESERVATIONS:
        raise ValueError(f"rule must be one of {RESERVATIONS}, got {rule!r}")
    return Reservation(rule, 1, require_int("budget_tokens", budget_tokens), rule)


def paged(budget_tokens: int, block_size: int) -> Reservation:
    num_blocks = budget_tokens // require_power_of_two("block_size", block_size)
    if num_blocks < 1:
        raise ValueError(f"budget_tokens ({budget_tokens}) holds no block of "
                         f"block_size ({block_size}) positions")
    return Reservation("paged", block_size, num_blocks)


class UpfrontBlockSpaceManager(KVCacheManager):
    """A reservation-based cache as a block manager of one-token blocks: allocate takes every position
    the request may ever fill (reserve(seq) of them) at once, so allocate_slots never needs a block and
    nothing is ever preempted. The scheduler cannot tell it from the paged manager."""

    def __init__(self, num_slots: int, reserve) -> None:
        super().__init__(num_slots, 1, enable_prefix_caching=False)
        self.reserve = reserve

    def can_allocate(self, seq: Sequence, watermark_blocks: int = 0) -> AllocStatus:
        need = self.reserve(seq)
        if need > self.num_blocks:
            return AllocStatus.NEVER
        return AllocStatus.OK if need + watermark_blocks <= self.num_free_blocks else AllocStatus.LATER

    def allocate(self, seq: Sequence, num_new_tokens: int | None = None) -> int:
        if seq.seq_id in self.block_tables:
            raise ValueError(f"sequence {seq.seq_id!r} already has a block table")
        need = self.reserve(seq)
        if need > self.num_free_blocks:
            raise NoFreeBlocks(f"sequence {seq.seq_id!r} reserves {need} positions, "
                               f"{self.num_free_blocks} are free")
        num_new = seq.num_tokens if num_new_tokens is None else require_int("num_new_tokens", num_new_tokens,
                                                                            1,
                                                                            seq.num_tokens)
        self.block_tables[seq.seq_id] = KVCacheBlocks(1, self.block_pool.allocate_many(need), num_new)
        return 0


def _manager(reservation: Reservation, workload: dict, max_model_len: int) -> KVCacheManager:
    if reservation.upfront is None:
        return KVCacheManager(reservation.num_blocks, reservation.block_size, enable_prefix_caching=False)

    def reserve(seq: Sequence) -> int:
        fills = workload[seq.seq_id].max_cached_tokens
        if reservation.upfront == "max":
            return max_model_len
        if reservation.upfront == "pow2":
            return min(1 << (fills - 1).bit_length(), max_model_len)
        return fills  # oracle
    return UpfrontBlockSpaceManager(reservation.num_blocks, reserve)


@dataclass
class SimResult:
    """Per-step series of one simulation (step i is index i-1) and its counters."""

    cache: str
    capacity_tokens: int
    min_tokens: int  # positions the workload must compute at least: prompt + output - 1 per request
    live: list[int] = field(default_factory=list)  # positions holding computed KV of running requests
    reserved: list[int] = field(default_factory=list)  # positions reserved by running requests
    future: list[int] = field(default_factory=list)  # reserved positions their requests will still fill
    never_used: list[int] = field(default_factory=list)  # reserved positions their requests never fill
    running: list[int] = field(default_factory=list)  # requests holding memory
    waiting: list[int] = field(default_factory=list)  # requests queued after scheduling
    computed: list[int] = field(default_factory=list)  # tokens the step computed (prefill, recompute, decode)
    sampled: list[int] = field(default_factory=list)  # tokens the step sampled
    preemptions: int = 0

    @property
    def steps(self) -> int:
        return len(self.live)

    @property
    def tokens_computed(self) -> int:
        return sum(self.computed)

    @property
    def recomputed_tokens(self) -> int:
        """Tokens computed beyond the minimum: the price of preemption by recompute."""
        return self.tokens_computed - self.min_tokens

    @property
    def utilisation_series(self) -> list[float]:
        return [lv / rs if rs else float("nan") for lv, rs in zip(self.live, self.reserved)]

    def summary(self) -> dict:
        total_reserved = sum(self.reserved)
        peak = max(range(self.steps), key=lambda i: self.live[i])  # first step with the most live tokens
        out = {
            "cache": self.cache,
            "capacity_tokens": self.capacity_tokens,
            "steps": self.steps,
            "utilisation": sum(self.live) / total_reserved,
            "utilisation_at_peak": self.live[peak] / self.reserved[peak],
            "peak_step": peak + 1,
            "peak_live_tokens": self.live[peak],
            "waste": {
                "reserved_for_future": sum(self.future) / total_reserved,
                "never_used": sum(self.never_used) / total_reserved,
            },
            "concurrency": {"mean": sum(self.running) / self.steps, "max": max(self.running),
                            # the budget's capacity: only steps where requests were left waiting
                            "mean_while_queued": _mean([n for n, q in zip(self.running, self.waiting) if q])},
            "budget_fill": {
                "reserved": total_reserved / (self.steps * self.capacity_tokens),
                "live": sum(self.live) / (self.steps * self.capacity_tokens),
            },
            "preemptions": self.preemptions,
            "tokens_computed": self.tokens_computed,
            "recomputed_tokens": self.recomputed_tokens,
            "recompute_share": self.recomputed_tokens / self.tokens_computed,
            "tokens_sampled": sum(self.sampled),
        }
        if self.cache == "paged":
            slack = total_reserved - sum(self.live)
            out["last_block_slack"] = {
                "fraction_of_reserved": slack / total_reserved,
                "mean_tokens_per_request": slack / sum(self.running),
            }
        return out


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


def simulate(requests: list[WorkloadRequest], reservation: Reservation, max_model_len: int,
             max_num_seqs: int = DEFAULT_MAX_NUM_SEQS,
             max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
             watermark: float = 0.0) -> SimResult:
    """Serve all requests (arrived at step 0) through the real Scheduler with one cache's reservation
    rule, stepping without a model; see the module docstring."""
    if not requests:
        raise ValueError("requests is empty")
    for r in requests:
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"request {r.request_id} has prompt_len {r.prompt_len} and output_len "
                             f"{r.output_len}; both must be >= 1")
        if r.prompt_len + r.output_len > max_model_len:
            raise ValueError(f"request {r.request_id} needs {r.prompt_len + r.output_len} positions, more "
                             f"than max_model_len={max_model_len}")
        if r.max_cached_tokens > reservation.capacity_tokens:
            raise ValueError(f"request {r.request_id} needs {r.max_cached_tokens} positions; the cache holds "
                             f"{reservation.capacity_tokens}, so it could never run")
    workload = {r.request_id: r for r in requests}
    manager = _manager(reservation, workload, max_model_len)
    if isinstance(manager, UpfrontBlockSpaceManager):
        for r in requests:
            need = manager.reserve(Sequence(r.request_id, [0] * r.prompt_len))
            if need > manager.num_blocks:
                raise ValueError(f"request {r.request_id} reserves {need} positions under the "
                                 f"{reservation.name} rule; "
                                 f"the cache holds {manager.num_blocks}, so it could never run")
    scheduler = Scheduler(manager, max_num_seqs, max_num_batched_tokens, max_model_len, watermark)
    for r in requests:
        scheduler.add_request(Request(r.request_id, [0] * r.prompt_len,
                                      SamplingParams(max_tokens=r.output_len)))
    result = SimResult(reservation.name, reservation.capacity_tokens,
                       sum(r.max_cached_tokens for r in requests))
    while scheduler.has_unfinished_requests():
        out = scheduler.schedule()
        if out.errored:
            raise RuntimeError(f"request {out.errored[0].request_id} could not run: {out.errored[0].error}")
        scheduler.update(out)
        result.preemptions += len(out.preempted)
        _record(result, manager, scheduler, workload, out.total_tokens)
        done = [r for r in out.requests if r.num_computed_tokens == r.num_tokens]
        for request in done:  # what sampling would do; the workload fixes the output length
            request.append_token_ids([0])
            if request.num_output_tokens >= request.params.max_tokens:
                scheduler.finish(request, RequestStatus.FINISHED_LENGTH)
        result.sampled.append(len(done))
    if manager.num_free_blocks != manager.num_blocks:
        raise RuntimeError(f"{manager.num_blocks - manager.num_free_blocks} blocks "
                           f"are still held after the run")
    return result


def _record(result: SimResult, manager: KVCacheManager, scheduler: Scheduler, workload: dict,
            num_computed: int) -> None:
    live = reserved = future = never = 0
    for request in scheduler.running:
        tokens = request.num_computed_tokens
        res = len(manager.block_tables[request.request_id].block_ids) * manager.block_size  # no copy per step
        will_fill = min(res, workload[request.request_id].max_cached_tokens)
        live, reserved = live + tokens, reserved + res
        future, never = future + will_fill - tokens, never + res - will_fill
    if reserved != (manager.num_blocks - manager.num_free_blocks) * manager.block_size:
        raise RuntimeError(f"per-request reservations sum to {reserved}, the pool has "
                           f"{manager.num_blocks - manager.num_free_blocks} blocks in use")
    result.live.append(live)
    result.reserved.append(reserved)
    result.future.append(future)
    result.never_used.append(never)
    result.running.append(len(scheduler.running))
    result.waiting.append(len(scheduler.waiting))
    result.computed.append(num_computed)


def snapshot_utilisation(context_lens, max_model_len: int, block_size: int) -> tuple[float, float]:
    """(contiguous, paged): the fraction of reserved KV positions that hold tokens, for one snapshot
    of running requests with these context lengths: max_model_len reserved per request, against each
    request's blocks rounded up to whole blocks."""
    if not context_lens:
        raise ValueError("context_lens is empty")
    for n in context_lens:
        if not 1 <= n <= max_model_len:
            raise ValueError(f"a context of {n} tokens is outside 1..{max_model_len}")
    used = sum(context_lens)
    paged = sum(cdiv(n, block_size) * block_size for n in context_lens)
    return used / (len(context_lens) * max_model_len), used / paged


def chunked_prompt_blocks(prompt_len: int, max_num_batched_tokens: int,
                          block_size: int) -> dict[str, list[int]]:
    """What a lone prompt prefilled in chunks holds after each step, in blocks: reserved for the whole
    prompt at admission (vLLM v0's KVCacheManager, and this course's before it followed v1), against
    reserved for the tokens scheduled so far (vLLM v1's allocate_slots, run here by the real Scheduler).
    "written" counts the blocks that hold computed K/V; the rest of what a policy holds sits unwritten.
    """
    prompt_len = require_int("prompt_len", prompt_len)
    manager = KVCacheManager(cdiv(prompt_len, block_size), block_size, enable_prefix_caching=False)
    scheduler = Scheduler(manager, 1, max_num_batched_tokens, max_model_len=prompt_len + 1)
    request = Request(0, [0] * prompt_len, SamplingParams(max_tokens=1))
    scheduler.add_request(request)
    computed, held = [], []
    while request.num_computed_tokens < prompt_len:
        scheduler.update(scheduler.schedule())
        computed.append(request.num_computed_tokens)
        held.append(len(manager.get_block_table(request)))
    return {"computed_tokens": computed, "written": [cdiv(c, block_size) for c in computed],
            "held_scheduled_only": held, "held_whole_prompt": [cdiv(prompt_len, block_size)] * len(computed)}


def thrash_sweep(requests: list[WorkloadRequest], reservation: Reservation, max_model_len: int,
                 max_num_seqs_values, watermarks, max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
                 ) -> list[dict]:
    """Preemptions, recompute share, steps and concurrency for each (max_num_seqs, watermark): the two
    knobs vLLM offers against thrashing, where admitted requests evict each other and recompute."""
    rows = []
    for max_num_seqs in max_num_seqs_values:
        for watermark in watermarks:
            s = simulate(requests, reservation, max_model_len, max_num_seqs, max_num_batched_tokens,
                         watermark).summary()
            rows.append({"max_num_seqs": max_num_seqs, "watermark": watermark,
                         "preemptions": s["preemptions"],
                         "recompute_share": s["recompute_share"], "tokens_computed": s["tokens_computed"],
                         "steps": s["steps"], "concurrency_mean": s["concurrency"]["mean"],
                         "utilisation": s["utilisation"]})
    return rows


@dataclass(frozen=True)
class MemoryBenchConfig:
    workload: WorkloadSpec = WorkloadSpec()
    budget_tokens: int = DEFAULT_BUDGET_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS

    def __post_init__(self) -> None:
        for name in ("budget_tokens", "max_num_seqs", "max_num_batched_tokens"):
            require_int(name, getattr(self, name))
        require_power_of_two("block_size", self.block_size)
        if self.budget_tokens % self.block_size:
            raise ValueError(f"budget_tokens ({self.budget_tokens}) must be a multiple of block_size "
                             f"({self.block_size}) so both caches get the same memory")
        if self.budget_tokens < self.workload.max_model_len:
            raise ValueError(f"budget_tokens ({self.budget_tokens}) must hold at least one request of "
                             f"max_model_len ({self.workload.max_model_len}) positions (vLLM "
                             f"refuses to start otherwise)")

    @property
    def reservations(self) -> list[Reservation]:
        return [contiguous(self.budget_tokens, rule) for rule in RESERVATIONS] + [paged(self.budget_tokens,
                                                                                         self.block_size)]


def run(config: MemoryBenchConfig = MemoryBenchConfig()) -> dict[str, SimResult]:
    """Simulate the workload on every cache; returns {"max", "pow2", "oracle", "paged": SimResult}."""
    requests = make_workload(config.workload)
    return {r.name: simulate(requests, r, config.workload.max_model_len, config.max_num_seqs,
                             config.max_num_batched_tokens) for r in config.reservations}


def report(config: MemoryBenchConfig, results: dict[str, SimResult]) -> dict:
    """The JSON document: parameters, workload statistics, environment, results and the goal."""
    from radarlab.kvcache.memory import kv_bytes_per_token
    from radarlab.lab.machine import environment

    requests = make_workload(config.workload)
    per_token = kv_bytes_per_token(**COURSE_MODEL_KV, kv_dtype="bf16")
    paged = results["paged"].summary()
    return {
        "benchmark": "memory",
        "parameters": {
            "workload": config.workload.as_dict(),
            "distribution": "log-normal prompt and output lengths (mean before clipping, shape sigma), "
                            "clipped so that prompt + output <= max_model_len; all requests arrive at step 0",
            "budget_tokens": config.budget_tokens,
            "budget_bytes_course_model_bf16": config.budget_tokens * per_token,
            "block_size": config.block_size,
            "max_num_seqs": config.max_num_seqs,
            "max_num_batched_tokens": config.max_num_batched_tokens,
            "scheduler": "radarlab.engine.Scheduler without a model: FCFS, chunked prefill within the token "
                         "budget, admission only if the whole prompt fits, blocks for the scheduled tokens "
                         "only; preempt the newest running request when the pool is short (recompute); no "
                         "admissions in a step that preempted",
        },
        "workload": {
            "prompt_len": length_summary([r.prompt_len for r in requests]),
            "output_len": length_summary([r.output_len for r in requests]),
            "total_output_tokens": sum(r.output_len for r in requests),
        },
        "environment": environment(),
        "results": {name: res.summary() for name, res in results.items()},
        "goal": {
            "paged_utilisation_min": PAGED_UTILISATION_GOAL,
            "source": GOAL_SOURCE,
            "paged_utilisation": paged["utilisation"],
            "met": paged["utilisation"] >= PAGED_UTILISATION_GOAL,
        },
    }


def format_table(doc: dict) -> str:
    """The short table the command prints."""
    res = doc["results"]
    names = list(res)
    rows = [
        ("utilisation (time-averaged)", lambda s: f"{s['utilisation']:.4f}"),
        ("utilisation at peak load", lambda s: f"{s['utilisation_at_peak']:.4f}"),
        ("waste: reserved for future tokens", lambda s: f"{s['waste']['reserved_for_future']:.4f}"),
        ("waste: never used", lambda s: f"{s['waste']['never_used']:.4f}"),
        ("concurrent requests (mean)", lambda s: f"{s['concurrency']['mean']:.1f}"),
        ("  while requests wait for memory", lambda s: _fmt(s['concurrency']['mean_while_queued'], ".1f")),
        ("concurrent requests (max)", lambda s: f"{s['concurrency']['max']}"),
        ("steps to drain the workload", lambda s: f"{s['steps']}"),
        ("tokens computed", lambda s: f"{s['tokens_computed']:,}"),
        ("  of which recomputed", lambda s: f"{s['recompute_share']:.1%}"),
        ("preemptions", lambda s: f"{s['preemptions']}"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'':<{width}}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{fmt(res[n]):>12}" for n in names) for label, fmt in rows]
    if "paged" in res:
        slack = res["paged"]["last_block_slack"]
        lines.append(f"paged last-block slack: {slack['fraction_of_reserved']:.4f} of reserved, "
                     f"{slack['mean_tokens_per_request']:.2f} tokens per request (block "
                     f"{doc['parameters']['block_size']})")
    goal = doc["goal"]
    lines.append(f"paged utilisation {goal['paged_utilisation']:.4f}; the vLLM paper reports under 4% waste "
                 f"(>= {goal['paged_utilisation_min']})")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    spec = WorkloadSpec()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    parser.add_argument("--num-requests", type=int, default=spec.num_requests, help="requests in the "
                                                                                    "workload (%(default)s)")
    parser.add_argument("--seed", type=int, default=spec.seed, help="workload seed (%(default)s)")
    parser.add_argument("--max-model-len", type=int, default=spec.max_model_len,
                        help="longest request, prompt + output; what a max reservation takes (%(default)s)")
    parser.add_argument("--prompt-mean", type=float, default=spec.prompt_mean, help="log-normal "
                                                                                    "mean (%(default)s)")
    parser.add_argument("--prompt-sigma", type=float, default=spec.prompt_sigma, help="log-normal "
                                                                                      "shape (%(default)s)")
    parser.add_argument("--output-mean", type=float, default=spec.output_mean, help="log-normal "
                                                                                    "mean (%(default)s)")
    parser.add_argument("--output-sigma", type=float, default=spec.output_sigma, help="log-normal "
                                                                                      "shape (%(default)s)")
    parser.add_argument("--budget-tokens", type=int, default=DEFAULT_BUDGET_TOKENS,
                        help="KV positions both caches share (%(default)s)")
    add_batching_arguments(parser, MemoryBenchConfig())


def config_from_args(args: argparse.Namespace) -> MemoryBenchConfig:
    """Raises ValueError naming the bad parameter and its flag."""
    try:
        spec = WorkloadSpec(args.num_requests, args.seed, args.max_model_len,
                            args.prompt_mean, args.prompt_sigma,
                            args.output_mean, args.output_sigma)
        return MemoryBenchConfig(spec, args.budget_tokens, args.block_size, args.max_num_seqs,
                                 args.max_num_batched_tokens)
    except ValueError as err:
        field_name = str(err).split(" ", 1)[0]
        raise ValueError(f"--{field_name.replace('_', '-')}: {err}") from None


def main(args: argparse.Namespace) -> int:
    from radarlab.bench.report import write_json

    config = config_from_args(args)
    doc = report(config, run(config))
    print(format_table(doc))
    if args.json:
        write_json(args.json, doc)
    return 0
