"""Where a step's time goes: torch.profiler's self time per op, grouped into parts a learner can act on.

An op's self time excludes the ops it called, so the groups do not double count. What the profiler
does not see (Python: the scheduler, building metadata, module calls) is wall time minus the sum of
all self times. The grouping is by op name, so it is approximate: aten::index and index_select are
mostly the K/V gather (the reference's padded blocks, or the SDPA path's rows) but also pick the
rows for the LM head, and aten::copy_ is mostly the bf16 to fp32 weight conversion on CPUs without
bf16 GEMMs (radarlab.models.linear) but also other casts. SDPA's fused CPU kernel and radarlab's C++
decode kernel (radarlab.cpu_ops, which gathers nothing) count as attention math; the fused norm,
SwiGLU gate and RoPE operators have a group of their own.

`python -m radarlab.bench profile` profiles the engine's decode step on the throughput bench's job
(decode_ready_engine), per dtype and batch size, and writes the groups as JSON.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

from radarlab.util import require_int

GROUPS: dict[str, tuple[str, ...]] = {
    # mkldnn::_linear_pointwise: a linear layer on its pre-packed weight; radarlab::gemv: one of a few
    # rows (radarlab.models.linear)
    "matmuls (linear layers, LM head)": ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise",
                                         "radarlab::gemv"),
    "attention: gather K/V from blocks": ("aten::index", "aten::index_select"),
    "attention: scores, softmax, weighted sum": ("aten::bmm", "aten::_softmax", "aten::masked_fill_",
                                                 "aten::masked_fill",
                                                 "aten::_scaled_dot_product_flash_attention_for_cpu",
                                                 "radarlab::paged_decode"),
    "fused C++ operators (RMSNorm, SwiGLU gate, RoPE)": ("radarlab::rms_norm", "radarlab::silu_and_mul",
                                                         "radarlab::rotary_embedding"),
    "dtype casts and copies": ("aten::copy_", "aten::_to_copy", "aten::clone"),
    "KV write at slot mapping": ("aten::index_put_", "aten::_index_put_impl_", "radarlab::reshape_and_cache"),
}
OTHER_OPS = "other ops (norms, RoPE, SiLU, adds, views)"
UNPROFILED = "outside ops (Python: scheduler, metadata, module calls)"


def op_breakdown(fn: Callable[[], object], repeat: int = 1) -> dict:
    """Run fn `repeat` times under the profiler. Returns {"wall_ms", "groups": {name: ms}} with
    times per call; the groups, OTHER_OPS and UNPROFILED add up to wall_ms."""
    require_int("repeat", repeat)
    prof, wall_ms = _profiled(fn, repeat)
    self_ms: dict[str, float] = {}
    for event in prof.key_averages():
        self_ms[event.key] = self_ms.get(event.key, 0.0) + event.self_cpu_time_total / 1e3 / repeat
    groups = {name: sum(self_ms.pop(op, 0.0) for op in ops) for name, ops in GROUPS.items()}
    groups[OTHER_OPS] = sum(self_ms.values())
    groups[UNPROFILED] = max(wall_ms - sum(groups.values()), 0.0)
    return {"wall_ms": wall_ms, "groups": groups}


# Ops that only make a new view of the same memory: on a GPU they launch nothing.
VIEW_OPS = frozenset({"aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view",
                      "aten::slice",
                      "aten::select", "aten::expand", "aten::as_strided", "aten::unsqueeze", "aten::squeeze",
                      "aten::t", "aten::transpose", "aten::permute", "aten::detach", "aten::alias",
                      "aten::unflatten", "aten::flatten", "aten::split", "aten::chunk", "aten::narrow",
                      "aten::view_as", "aten::empty", "aten::empty_like", "aten::empty_strided",
                      "aten::lift_fresh",
                      "aten::resolve_conj", "aten::resolve_neg", "aten::result_type", "aten::is_nonzero"})


def launching_ops(fn: Callable[[], object]) -> int:
    """How many top-level torch ops one call of fn runs, views left out: on a GPU each launches at least
    one kernel, which is what a CUDA graph would replay in one call."""
    prof, _ = _profiled(fn, 1)
    return sum(1 for e in prof.events() if e.name.startswith("aten::") and e.name not in VIEW_OPS
               and (e.cpu_parent is None or not e.cpu_parent.name.startswith("aten::")))


def _profiled(fn: Callable[[], object], repeat: int):
    """fn run `repeat` times under torch's CPU profiler: (the profiler, wall ms per call)."""
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CPU])
    with _stderr_silenced():  # the profiler's C++ side prints start/stop lines to stderr
        prof.start()
    try:
        t0 = time.perf_counter()
        for _ in range(repeat):
            fn()
        wall_ms = (time.perf_counter() - t0) * 1e3 / repeat
    finally:
        with _stderr_silenced():
            prof.stop()
    return prof, wall_ms


@contextlib.contextmanager
def _stderr_silenced():
    """Point file descriptor 2 at /dev/null for a moment (C++ writes bypass sys.stderr)."""
    sys.stderr.flush()
    saved = os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(devnull)
        os.close(saved)


def format_breakdown(breakdown: dict) -> str:
    wall = breakdown["wall_ms"]
    width = max(len(name) for name in breakdown["groups"])
    lines = [f"{'per step':<{width}} {wall:9.1f} ms"]
    for name, ms in sorted(breakdown["groups"].items(), key=lambda kv: -kv[1]):
        lines.append(f"{name:<{width}} {ms:9.1f} ms {100 * ms / wall:5.1f}%")
    return "\n".join(lines)


# --- the engine's decode step, profiled: python -m radarlab.bench profile ---------------------------
@dataclass(frozen=True)
class ProfileConfig:
    """Which cells to profile; the job itself (prompt lengths, new tokens, block size, seed) is the
    throughput bench's, ThroughputConfig's defaults."""
    batch_sizes: tuple[int, ...] = (1, 64)
    dtypes: tuple[str, ...] = ("bfloat16", "float32")  # the throughput bench's
    repeat: int = 5  # decode steps profiled per cell; times are per step
    seed: int = 0
    model: str | None = None  # HF id or directory; None is the course model

    def job(self):
        """The throughput bench's job at these batch sizes, dtypes, seed and model."""
        from radarlab.bench.throughput import ThroughputConfig

        return ThroughputConfig(batch_sizes=self.batch_sizes, dtypes=self.dtypes, systems=("radarlab",),
                                seed=self.seed, model=self.model)

    def __post_init__(self) -> None:
        max_tokens = self.job().max_tokens  # checks batch_sizes, dtypes and seed, naming the field
        require_int("repeat", self.repeat)
        if 2 * self.repeat + 1 >= max_tokens:
            raise ValueError(f"repeat must be below (max_tokens - 1) / 2 = {(max_tokens - 1) / 2:g}: one "
                             f"step, then `repeat` profiled and `repeat` timed steps each decode one token "
                             f"of every request (max_tokens {max_tokens}), got {self.repeat}")


def decode_ready_engine(model, batch_size: int, job=None):
    """An engine holding the throughput bench's first `batch_size` prompts (a ThroughputConfig `job`,
    its defaults when None), stepped until every prompt is prefilled, so that its next steps are decode
    steps of the whole batch."""
    from radarlab.bench.throughput import ThroughputConfig
    from radarlab.engine import Engine, SamplingParams
    from radarlab.lab.workload import random_token_prompts

    job = ThroughputConfig() if job is None else job
    require_int("batch_size", batch_size)
    blocks_per_request = -(-(job.max_prompt_len + job.max_tokens) // job.block_size)
    engine = Engine(model, num_blocks=batch_size * blocks_per_request, block_size=job.block_size,
                    max_num_seqs=batch_size, max_num_batched_tokens=job.max_num_batched_tokens)
    lens = (job.min_prompt_len, job.max_prompt_len)
    for prompt in random_token_prompts(batch_size, model.config.vocab_size, lens, seed=job.seed):
        engine.add_request(prompt, SamplingParams(max_tokens=job.max_tokens, ignore_eos=True))
    while engine.last_scheduled is None or any(n > 1 for n in engine.last_scheduled.num_scheduled_tokens):
        engine.step()
    return engine


def run(config: ProfileConfig, log: Callable[[str], None] = print) -> list[dict]:
    """One row per (dtype, batch size): the decode step's wall time and its groups, per step."""
    import torch

    from radarlab.device import default_device
    from radarlab.lab.measure import measure_machine
    from radarlab.models.llama import Llama

    device = default_device()
    bandwidth = measure_machine(device).bandwidth  # in this process, at its thread count
    rows = []
    for dtype in config.dtypes:
        model = Llama.from_pretrained(config.model, dtype=getattr(torch, dtype), device=device)[0]
        for batch_size in config.batch_sizes:
            engine = decode_ready_engine(model, batch_size, config.job())
            engine.step()  # one decode step first: anything built on first use is built outside the profile
            row = {"dtype": dtype, "batch_size": batch_size, **op_breakdown(engine.step, config.repeat)}
            row["unprofiled"] = step_bandwidth(engine, config.repeat, bandwidth)
            log(f"decode step, {dtype}, batch {batch_size}:\n{format_breakdown(row)}\n"
                f"{format_bandwidth(row['unprofiled'])}\n")
            rows.append(row)
    return rows


def step_bandwidth(engine, steps: int, bandwidth: float) -> dict:
    """The next `steps` decode steps timed without the profiler (the fastest counts), and the bytes
    a decode step must read (radarlab.lab.roofline.decode_step: the weights once, each sequence's KV
    at its context now) over that time, as a fraction of the read bandwidth measured in this run:
    how close the step comes to its limit at batch 1, prefill excluded."""
    import torch

    from radarlab.lab.roofline import TransformerDims, decode_step

    times = []
    for _ in range(require_int("steps", steps)):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    reqs = engine.last_scheduled.requests
    context = round(sum(r.num_computed_tokens for r in reqs) / len(reqs))
    dtype = next(engine.model.parameters()).dtype
    precision = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[dtype]
    step = decode_step(TransformerDims.from_config(engine.model.config), len(reqs), context, precision,
                       precision)
    return {"step_ms": 1e3 * min(times), "step_ms_runs": [1e3 * t for t in times], "context": context,
            "bytes_per_step": step.bytes, "read_bandwidth_gb_s": bandwidth / 1e9,
            "bandwidth_fraction": step.bytes / min(times) / bandwidth,
            "replayed": engine.runner.replay is not None}


def format_bandwidth(u: dict) -> str:
    mode = "replayed" if u["replayed"] else "eager"
    return (f"without the profiler: {u['step_ms']:.1f} ms per step ({mode}), "
            f"{u['bytes_per_step'] / 1e6:.0f} MB read at context {u['context']}: "
            f"{u['bytes_per_step'] / u['step_ms'] / 1e6:.1f} GB/s, "
            f"{u['bandwidth_fraction']:.2f} of the {u['read_bandwidth_gb_s']:.1f} GB/s measured in this run")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = ProfileConfig()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    parser.add_argument("--batch-sizes", default=",".join(map(str, c.batch_sizes)), help="(%(default)s)")
    parser.add_argument("--dtypes", default=",".join(c.dtypes), help="(%(default)s)")
    parser.add_argument("--repeat", type=int, default=c.repeat, help="decode steps profiled (%(default)s)")
    parser.add_argument("--seed", type=int, default=c.seed, help="prompt seed (%(default)s)")
    parser.add_argument("--model", default=None, help="HF model id or directory (default: the course model)")


def main(args: argparse.Namespace) -> int:
    import torch

    from radarlab.bench.report import comma_ints, comma_names, write_json
    from radarlab.lab.machine import environment

    config = ProfileConfig(batch_sizes=comma_ints("batch-sizes", args.batch_sizes),
                           dtypes=comma_names(args.dtypes), repeat=args.repeat, seed=args.seed,
                           model=args.model)
    rows = run(config)
    if args.json:
        parameters = {**asdict(config), "job": asdict(config.job())}
        write_json(args.json, {"benchmark": "profile", "parameters": parameters,
                               "environment": {**environment(), "torch_threads": torch.get_num_threads()},
                               "results": rows})
    return 0
