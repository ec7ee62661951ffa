"""Memory benchmark: how much of the reserved KV memory holds live tokens, contiguous vs paged.

Both caches get the same KV budget (in token positions) and serve the same workload
(radarlab.bench.workload) with the same first-come-first-served scheduler. They differ only in what a
request reserves:

- contiguous (radarlab.kvcache.contiguous): a row of max_model_len positions from admission to finish,
  so at most budget // max_model_len requests run at once, however short they are;
- paged: blocks of block_size positions taken as the request grows, through the real BlockSpaceManager
  (radarlab.kvcache.block_table): allocate the prompt, append_slots once per decode step, free at the end.
  Prefix caching is off: the synthetic prompts share no tokens.

One step of the simulation is one forward pass, as in vLLM's scheduler:
1. every running request reserves a slot for the token it feeds in (its last sampled token), oldest
   first; if the pool is short, the newest running request is preempted (its blocks freed, it returns to
   the front of the queue and later recomputes prompt + output so far), vLLM v1's default policy;
2. if nobody was preempted, waiting requests are admitted in arrival order while their context fits
   (a new request reserves its prompt; a preempted one, prompt + tokens generated so far);
3. the accounting is recorded, then every running request samples one token; a request that has
   sampled output_len tokens finishes and frees its memory.
There is no per-step token budget: this measures memory, not compute.

Per step we record live tokens (positions holding KV of a running request) and reserved positions.
Utilisation is sum(live) / sum(reserved) over all steps: the time average of the fraction of reserved
KV memory that holds live tokens; "at peak" is the same fraction at the first step with the most live
tokens. The rest is waste, split as in the vLLM paper's Fig. 2 into positions reserved for tokens the
request will still produce, and positions it will never fill (for the paged cache, the slack of its
last block). Concurrency is the number of requests holding memory, averaged over all steps and over
the steps where requests were left waiting for memory (what the budget holds).

`python -m radarlab.bench memory --json PATH` runs it; the goal is paged utilisation >= 0.96 (the vLLM
paper, Kwon et al. 2023, reports under 4% waste).
"""
from __future__ import annotations

import argparse
from collections import deque
from dataclasses import dataclass, field

from radarlab.bench.workload import Request, WorkloadSpec, length_summary, make_workload
from radarlab.kvcache.block_table import BlockSpaceManager

DEFAULT_BLOCK_SIZE = 16  # vLLM's default block size on CUDA
DEFAULT_BUDGET_TOKENS = 16 * 2048  # 16 contiguous rows of the default max_model_len
PAGED_UTILISATION_GOAL = 0.96
GOAL_SOURCE = "Kwon et al. 2023 (vLLM, SOSP): paged KV cache wastes under 4% of its memory"
COURSE_MODEL_KV = dict(layers=30, kv_heads=3, head_dim=64)  # SmolLM2-135M, to express the budget in bytes


class ContiguousReservations:
    """The contiguous cache's rule: each running request owns a row of max_model_len positions."""

    name = "contiguous"

    def __init__(self, budget_tokens: int, max_model_len: int) -> None:
        self.max_model_len = max_model_len
        self.num_rows = budget_tokens // max_model_len
        if self.num_rows < 1:
            raise ValueError(f"budget_tokens ({budget_tokens}) holds no row of max_model_len ({max_model_len}) positions")
        self._tokens: dict[int, int] = {}

    @property
    def capacity_tokens(self) -> int:
        return self.num_rows * self.max_model_len

    def can_admit(self, num_tokens: int) -> bool:
        return len(self._tokens) < self.num_rows and num_tokens <= self.max_model_len

    def admit(self, seq_id: int, num_tokens: int) -> None:
        if not self.can_admit(num_tokens):
            raise RuntimeError(f"no free row for request {seq_id} ({num_tokens} tokens)")
        self._tokens[seq_id] = num_tokens

    def can_append(self, seq_id: int) -> bool:
        return self._tokens[seq_id] < self.max_model_len

    def append(self, seq_id: int) -> None:
        if not self.can_append(seq_id):
            raise RuntimeError(f"request {seq_id} has filled its row of {self.max_model_len} positions")
        self._tokens[seq_id] += 1

    def free(self, seq_id: int) -> None:
        del self._tokens[seq_id]

    def num_tokens(self, seq_id: int) -> int:
        return self._tokens[seq_id]

    def reserved(self, seq_id: int) -> int:
        return self.max_model_len

    def reserved_total(self) -> int:
        return len(self._tokens) * self.max_model_len


class PagedReservations:
    """The paged cache: a BlockSpaceManager over budget_tokens // block_size blocks."""

    name = "paged"

    def __init__(self, budget_tokens: int, block_size: int) -> None:
        self.block_size = block_size
        num_blocks = budget_tokens // block_size if block_size > 0 else 0
        if num_blocks < 1:
            raise ValueError(f"budget_tokens ({budget_tokens}) holds no block of block_size ({block_size}) positions")
        self.manager = BlockSpaceManager(num_blocks, block_size, enable_prefix_caching=False)

    @property
    def capacity_tokens(self) -> int:
        return self.manager.num_blocks * self.block_size

    # Token ids do not matter with prefix caching off; zeros stand in for them.
    def can_admit(self, num_tokens: int) -> bool:
        return bool(self.manager.can_allocate([0] * num_tokens))

    def admit(self, seq_id: int, num_tokens: int) -> None:
        self.manager.allocate(seq_id, [0] * num_tokens)

    def can_append(self, seq_id: int) -> bool:
        return self.manager.can_append_slots(seq_id, 1)

    def append(self, seq_id: int) -> None:
        self.manager.append_slots(seq_id, [0])

    def free(self, seq_id: int) -> None:
        self.manager.free(seq_id)

    def num_tokens(self, seq_id: int) -> int:
        return self.manager.num_tokens(seq_id)

    def reserved(self, seq_id: int) -> int:
        return len(self.manager.get_block_table(seq_id)) * self.block_size

    def reserved_total(self) -> int:
        return (self.manager.num_blocks - self.manager.num_free_blocks) * self.block_size


@dataclass
class SimResult:
    """Per-step series of one simulation (step i is index i-1) and its counters."""

    cache: str
    capacity_tokens: int
    live: list[int] = field(default_factory=list)  # positions holding KV of running requests
    reserved: list[int] = field(default_factory=list)  # positions reserved by running requests
    future: list[int] = field(default_factory=list)  # reserved positions their requests will still fill
    never_used: list[int] = field(default_factory=list)  # reserved positions their requests never fill
    running: list[int] = field(default_factory=list)  # requests holding memory
    waiting: list[int] = field(default_factory=list)  # requests queued for memory after admission
    preemptions: int = 0
    recomputed_tokens: int = 0  # tokens prefilled again after a preemption

    @property
    def steps(self) -> int:
        return len(self.live)

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
                            # the budget's capacity: only steps where requests were left waiting for memory
                            "mean_while_queued": _mean([n for n, q in zip(self.running, self.waiting) if q])},
            "budget_fill": {
                "reserved": total_reserved / (self.steps * self.capacity_tokens),
                "live": sum(self.live) / (self.steps * self.capacity_tokens),
            },
            "preemptions": self.preemptions,
            "recomputed_tokens": self.recomputed_tokens,
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


@dataclass
class _Running:
    request: Request
    generated: int = 0  # tokens sampled so far


def simulate(requests: list[Request], cache) -> SimResult:
    """Serve all requests (arrived at step 0) with one cache's reservation rule; see the module docstring."""
    if not requests:
        raise ValueError("requests is empty")
    for r in requests:
        if r.prompt_len < 1 or r.output_len < 1:
            raise ValueError(f"request {r.request_id} has prompt_len {r.prompt_len} and output_len {r.output_len}; both must be >= 1")
        if r.prompt_len + r.output_len - 1 > cache.capacity_tokens:
            raise ValueError(f"request {r.request_id} needs {r.max_cached_tokens} positions; the cache holds "
                             f"{cache.capacity_tokens}, so it could never run")
    result = SimResult(cache.name, cache.capacity_tokens)
    waiting: deque[_Running] = deque(_Running(r) for r in requests)
    running: list[_Running] = []  # in admission order: the last is preempted first
    while waiting or running:
        # 1. a slot for each running request's next input token, oldest first; preempt the newest if short
        preempted = False
        i = 0
        while i < len(running):
            seq = running[i]
            while not cache.can_append(seq.request.request_id):
                victim = running.pop()
                cache.free(victim.request.request_id)
                waiting.appendleft(victim)
                result.preemptions += 1
                preempted = True
                if victim is seq:
                    break
            else:
                cache.append(seq.request.request_id)
                i += 1
        # 2. admit waiting requests in order while they fit (none in a step that preempted, as vLLM)
        while not preempted and waiting:
            seq = waiting[0]
            context = seq.request.prompt_len + seq.generated
            if not cache.can_admit(context):
                break
            waiting.popleft()
            cache.admit(seq.request.request_id, context)
            if seq.generated:
                result.recomputed_tokens += context
            running.append(seq)
        if not running:
            raise RuntimeError(f"no request could run; request {waiting[0].request.request_id} does not fit the cache")
        # 3. account, then sample one token per running request
        _record(result, cache, running, len(waiting))
        still = []
        for seq in running:
            seq.generated += 1
            if seq.generated == seq.request.output_len:
                cache.free(seq.request.request_id)
            else:
                still.append(seq)
        running = still
    return result


def _record(result: SimResult, cache, running: list[_Running], num_waiting: int) -> None:
    live = reserved = future = never = 0
    for seq in running:
        seq_id = seq.request.request_id
        tokens, res = cache.num_tokens(seq_id), cache.reserved(seq_id)
        if tokens != seq.request.prompt_len + seq.generated:
            raise RuntimeError(f"request {seq_id} holds {tokens} tokens, expected {seq.request.prompt_len + seq.generated}")
        will_fill = min(res, seq.request.max_cached_tokens)
        live, reserved = live + tokens, reserved + res
        future, never = future + will_fill - tokens, never + res - will_fill
    if reserved != cache.reserved_total():
        raise RuntimeError(f"per-request reservations sum to {reserved}, the cache has {cache.reserved_total()} in use")
    result.live.append(live)
    result.reserved.append(reserved)
    result.future.append(future)
    result.never_used.append(never)
    result.running.append(len(running))
    result.waiting.append(num_waiting)


@dataclass(frozen=True)
class MemoryBenchConfig:
    workload: WorkloadSpec = WorkloadSpec()
    budget_tokens: int = DEFAULT_BUDGET_TOKENS
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        for name in ("budget_tokens", "block_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.budget_tokens % self.block_size:
            raise ValueError(f"budget_tokens ({self.budget_tokens}) must be a multiple of block_size ({self.block_size}) "
                             "so both caches get the same memory")
        if self.budget_tokens < self.workload.max_model_len:
            raise ValueError(f"budget_tokens ({self.budget_tokens}) must hold at least one request of max_model_len "
                             f"({self.workload.max_model_len}) positions (vLLM refuses to start otherwise)")


def run(config: MemoryBenchConfig = MemoryBenchConfig()) -> dict[str, SimResult]:
    """Simulate the workload on both caches; returns {"contiguous": SimResult, "paged": SimResult}."""
    requests = make_workload(config.workload)
    caches = [ContiguousReservations(config.budget_tokens, config.workload.max_model_len),
              PagedReservations(config.budget_tokens, config.block_size)]
    return {cache.name: simulate(requests, cache) for cache in caches}


def report(config: MemoryBenchConfig, results: dict[str, SimResult]) -> dict:
    """The JSON document: parameters, workload statistics, environment, results and the goal."""
    from radarlab.hardware.machine import environment
    from radarlab.kvcache.memory import kv_bytes_per_token

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
            "scheduler": "FCFS; preempt the newest running request when the pool is short (recompute); "
                         "no admissions in a step that preempted",
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
        ("preemptions", lambda s: f"{s['preemptions']}"),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{'':<{width}}" + "".join(f"{n:>12}" for n in names)]
    lines += [f"{label:<{width}}" + "".join(f"{fmt(res[n]):>12}" for n in names) for label, fmt in rows]
    if "paged" in res:
        slack = res["paged"]["last_block_slack"]
        lines.append(f"paged last-block slack: {slack['fraction_of_reserved']:.4f} of reserved, "
                     f"{slack['mean_tokens_per_request']:.2f} tokens per request (block {doc['parameters']['block_size']})")
    goal = doc["goal"]
    lines.append(f"goal: paged utilisation >= {goal['paged_utilisation_min']} ({goal['source']}): "
                 f"{'met' if goal['met'] else 'NOT met'} ({goal['paged_utilisation']:.4f})")
    return "\n".join(lines)


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    spec = WorkloadSpec()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    parser.add_argument("--num-requests", type=int, default=spec.num_requests, help="requests in the workload (%(default)s)")
    parser.add_argument("--seed", type=int, default=spec.seed, help="workload seed (%(default)s)")
    parser.add_argument("--max-model-len", type=int, default=spec.max_model_len,
                        help="longest request, prompt + output; the contiguous row size (%(default)s)")
    parser.add_argument("--prompt-mean", type=float, default=spec.prompt_mean, help="log-normal mean (%(default)s)")
    parser.add_argument("--prompt-sigma", type=float, default=spec.prompt_sigma, help="log-normal shape (%(default)s)")
    parser.add_argument("--output-mean", type=float, default=spec.output_mean, help="log-normal mean (%(default)s)")
    parser.add_argument("--output-sigma", type=float, default=spec.output_sigma, help="log-normal shape (%(default)s)")
    parser.add_argument("--budget-tokens", type=int, default=DEFAULT_BUDGET_TOKENS,
                        help="KV positions both caches share (%(default)s)")
    parser.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="paged block size (%(default)s)")


def config_from_args(args: argparse.Namespace) -> MemoryBenchConfig:
    """Raises ValueError naming the bad parameter and its flag."""
    try:
        spec = WorkloadSpec(args.num_requests, args.seed, args.max_model_len, args.prompt_mean, args.prompt_sigma,
                            args.output_mean, args.output_sigma)
        return MemoryBenchConfig(spec, args.budget_tokens, args.block_size)
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
