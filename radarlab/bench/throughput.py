"""Offline throughput: the same seeded prompts through the radarlab engine, transformers and vLLM, in one run.

Every system gets the same job: a batch of B random-token prompts (16-128 tokens), 64 new tokens
each, greedy, EOS ignored, all requests submitted at once. Output tokens per second of wall time,
prefill included, is the figure (vLLM's `benchmark_throughput` reports the same quantity).

- radarlab: Engine.generate on a fresh pool sized so memory never limits the batch, with its C++
  operators (radarlab.cpu_ops: the paged decode kernel, fused RMSNorm, SwiGLU gate and RoPE), in its
  default mode: each step replayed from one capture (radarlab.models.replay), radarlab's counterpart
  of vLLM's compiled mode.
- radarlab_eager: the same with enforce_eager=True (the model's forward, module by module): what
  the replay buys, in the same run.
- radarlab_torch: the same engine on torch ops alone (C++ operators off, so eager too): what the C++
  operators buy, measured in the same run.
- transformers: `generate` with static batching, prompts left-padded to the longest (its default
  sdpa attention).
- vllm: the CPU build (or CUDA build) through the validation harness in its default mode, as users
  run it: the model compiled by torch.compile (Inductor; on CUDA also CUDA graphs). One process per
  dtype; LLM.generate is timed inside the worker, so start-up, compilation included, is excluded as
  for the others and reported apart (environment: vllm_init_s, vllm_compilation). Prefix caching is
  off: the batches share prompts, and a hit would skip work the others do.
- vllm_eager: the same with enforce_eager=True (no compilation): what compiling buys vLLM.

Each system runs a short warm-up first, every batch size once (4 new tokens), so that whatever is
built for a shape (vLLM's compiled graphs, oneDNN's kernels for a row count) is built before the
timed runs. A cell is one generation of one to ten
seconds, and a busy moment of a shared machine moves it by ten percent: with --repeats R every
system runs each cell R times (vLLM in its one process) and the fastest counts; the JSON keeps all
(seconds_runs). Greedy outputs are compared with radarlab's as a check that the systems did the
same work (in fp32 they should mostly agree; random-token prompts give flat distributions, so
near-ties flip in bf16).
"""
from __future__ import annotations

import argparse
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from radarlab.bench.report import (
    VLLM_EAGER,
    add_batching_arguments,
    add_sweep_arguments,
    comma_ints,
    comma_names,
    require_sweep,
    vllm_modes,
)
from radarlab.lab.kept_runs import choose_kept_run, results_dir
from radarlab.lab.roofline import TransformerDims, decode_step
from radarlab.lab.workload import random_token_prompts

SYSTEMS = ("radarlab", "radarlab_eager", "radarlab_torch", "transformers", "vllm", "vllm_eager")
# radarlab's systems: (C++ operators on, enforce_eager)
RADARLAB_MODES = {"radarlab": (True, False), "radarlab_eager": (True, True), "radarlab_torch": (False, True)}
DTYPES = ("bfloat16", "float32")

GOAL = ("radarlab >= 1.0x transformers and >= 1.0x vLLM in its default (compiled) mode at every batch size, "
        "in every dtype")


def results_path(kind: str) -> Path:
    """The kept full run for one CPU kind (radarlab.device.cpu_kind): results/throughput-KIND.json.
    One file per kind, since the ratios depend on the instructions the CPU has (bf16 above all)."""
    if not kind or not kind.replace("_", "").isalnum():
        raise ValueError(f"kind must be a CPU kind such as 'avx2' or 'avx512_bf16', got {kind!r}")
    return results_dir() / f"throughput-{kind}.json"


def full_run(kind: str, folder: str | Path | None = None) -> tuple[Path | None, dict | None, str | None]:
    """(path, doc, sentence): the full run notebook 05 shows on a CPU of this kind, this kind's
    results/throughput-KIND.json or another kind's (radarlab.lab.kept_runs.choose_kept_run). The
    sentence, None for this kind's own run, says whose run it is and that only its ratios compare."""
    results_path(kind)  # a bad kind raises here, not as a missing file
    return choose_kept_run("throughput", kind, "full throughput",
                           f"`make bench` writes one for this CPU to bench-results/ (kept as "
                           f"results/throughput-{kind}.json).", folder)


def format_run_header(path: Path, doc: dict) -> str:
    """The line above a kept run's table: the machine and versions it ran with."""
    env = doc["environment"]
    vllm = env.get("vllm_vllm_version") or env.get("vllm_eager_vllm_version") or "not run"
    return (f"full run ({path.name}): {env['cpu_model']}, kind {env['cpu_kind']}, "
            f"radarlab {env['radarlab']}, torch {env['torch']} with {env['torch_threads']} threads "
            f"({env['cpu_capability']}, native bf16: {env['cpu_native_bf16']}), vLLM {vllm}"
            f"{format_vllm_modes(doc)}")


def format_vllm_modes(doc: dict) -> str:
    """How each vLLM system of a run ran (radarlab.bench.report.vllm_modes), for the run's header line."""
    parts = vllm_modes(doc)
    return "; " + "; ".join(parts) if parts else ""


def format_ratios(path: Path, doc: dict) -> str:
    """One line per (dtype, batch size) of a kept run: radarlab over the other systems (notebook 05's
    summary)."""
    lines = []
    for row in doc["ratios"]:
        parts = [f"radarlab / {label} {row[key]:.2f}x" for key, label in
                 (("radarlab_over_transformers", "transformers"),
                  ("radarlab_over_vllm", "vLLM (default, compiled)"),
                  ("radarlab_over_vllm_eager", "vLLM eager")) if key in row]
        own = [f"{label} {row[key]:.2f}x" for key, label in
               (("radarlab_over_radarlab_eager", "replayed / eager"),
                ("radarlab_over_radarlab_torch", "C++ operators on / off")) if key in row]
        lines.append(f"throughput ({path.name}), {row['dtype']} batch {row['batch_size']}: "
                     + ", ".join(parts + own))
    return "\n".join(lines)


def format_modes(doc: dict) -> str:
    """Both engines' eager and default modes from one run, per dtype and batch size: what each one's
    default (radarlab: replayed steps; vLLM: compiled) buys over its own eager mode, and the two
    like-for-like comparisons. Cells that lack one of the four systems are left out."""
    tps = {(r["system"], r["dtype"], r["batch_size"]): r["tokens_per_s"] for r in doc["results"]}
    lines = []
    for row in doc["ratios"]:
        d, b = row["dtype"], row["batch_size"]
        rl, rl_eager, vl, vl_eager = (tps.get((s, d, b)) for s in ("radarlab", "radarlab_eager", "vllm",
                                                                  "vllm_eager"))
        if None in (rl, rl_eager, vl, vl_eager):
            continue
        lines.append(f"{d} batch {b}: replaying buys radarlab {rl / rl_eager:.2f}x, compiling buys vLLM "
                     f"{vl / vl_eager:.2f}x; radarlab / vLLM eager against eager {rl_eager / vl_eager:.2f}x, "
                     f"default against default {rl / vl:.2f}x")
    return "\n".join(lines)


def dtype_notes(native_bf16: bool | None, upcast_rows: int = 16, gemv_rows: int = 0) -> dict[str, str]:
    """The dtype tricks a reader must know to read a row, by dtype (radarlab.models.linear): on a CPU
    without bf16 instructions, radarlab's bf16 matmuls of upcast_rows+ rows run in fp32 (16 on AVX2,
    64 on AVX-512F; files kept before the bench recorded it are AVX2 runs); on an Intel CPU, its fp32
    matmuls of fewer than gemv_rows rows take MKL's GEMV instead of the packed GEMM where the C++
    operators are off (with them, 1-4 rows take radarlab's GEMV; files kept before 2026-12-08 say
    only the first)."""
    notes = {}
    if native_bf16 is False:
        notes["bfloat16"] = (f"radarlab's bf16 matmuls of {upcast_rows}+ rows run in fp32: this CPU has no "
                             "bf16 instructions")
    if gemv_rows > 0:
        notes["float32"] = (f"without the C++ operators, radarlab's fp32 matmuls of fewer than {gemv_rows} "
                            "rows take MKL's GEMV (F.linear), not the packed GEMM: this CPU is Intel's; "
                            "with them, matmuls of 1-4 rows take radarlab's GEMV")
    return notes


@dataclass(frozen=True)
class ThroughputConfig:
    batch_sizes: tuple[int, ...] = (1, 16, 64)
    dtypes: tuple[str, ...] = DTYPES
    systems: tuple[str, ...] = SYSTEMS
    max_tokens: int = 64
    min_prompt_len: int = 16
    max_prompt_len: int = 128
    seed: int = 0
    model: str | None = None  # HF id or directory; None is the course model
    block_size: int = 16
    max_num_batched_tokens: int = 2048  # radarlab's per-step token budget (chunked prefill)
    repeats: int = 1  # runs per cell, every system alike; the fastest counts

    def __post_init__(self) -> None:
        require_sweep(self, ("max_tokens", "min_prompt_len", "max_prompt_len", "block_size",
                             "max_num_batched_tokens", "repeats"), ("min_prompt_len", "max_prompt_len"),
                      {"dtypes": DTYPES, "systems": SYSTEMS})


@dataclass
class Measurement:
    system: str
    batch_size: int
    dtype: str
    output_tokens: int
    seconds: float
    tokens_per_s: float = field(init=False)
    outputs: list[list[int]] = field(default_factory=list, repr=False)
    seconds_runs: list[float] = field(default_factory=list)  # every repeat; seconds is the fastest

    def __post_init__(self) -> None:
        self.tokens_per_s = self.output_tokens / self.seconds if self.seconds > 0 else float("inf")
        self.seconds_runs = self.seconds_runs or [self.seconds]

    def row(self) -> dict:
        d = asdict(self)
        d.pop("outputs")
        return d


def _count(outputs: list[list[int]], expected: int, system: str) -> int:
    """Every request must have produced exactly max_tokens tokens, or the comparison is unfair."""
    short = [i for i, o in enumerate(outputs) if len(o) != expected]
    if short:
        raise RuntimeError(f"{system}: request {short[0]} produced {len(outputs[short[0]])} "
                           f"tokens, expected {expected}")
    return sum(len(o) for o in outputs)


# --- the three systems --------------------------------------------------------------------------
def time_radarlab(model, prompts: list[list[int]], config: ThroughputConfig, cpu_ops: bool = True,
                  enforce_eager: bool = False) -> tuple[list[list[int]], float]:
    """cpu_ops=False: torch ops only (radarlab_torch); True: the C++ operators wherever they build.
    enforce_eager=True: the model's forward every step, no replay (radarlab_eager)."""
    from radarlab.engine import Engine, SamplingParams
    from radarlab.models.paged_runner import blocks_needed

    num_blocks = blocks_needed(prompts, config.max_tokens, config.block_size)
    engine = Engine(model, num_blocks, config.block_size, max_num_seqs=len(prompts),
                    max_num_batched_tokens=config.max_num_batched_tokens, cpu_ops=None if cpu_ops else False,
                    enforce_eager=enforce_eager)
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    before, model.use_cpu_ops = model.use_cpu_ops, (None if cpu_ops else False)
    try:
        t0 = time.perf_counter()
        outputs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
    finally:
        model.use_cpu_ops = before
    return [o.output_token_ids for o in outputs], seconds


def time_transformers(hf_model, pad_token_id: int, prompts: list[list[int]], config: ThroughputConfig
                      ) -> tuple[list[list[int]], float]:
    """Static batching: left-pad to the longest prompt, one generate call for the batch."""
    import torch
    from transformers import GenerationConfig

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p):] = torch.tensor(p)
        attention_mask[i, width - len(p):] = 1
    gen = GenerationConfig(max_new_tokens=config.max_tokens, min_new_tokens=config.max_tokens,
                           do_sample=False, pad_token_id=pad_token_id, eos_token_id=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = hf_model.generate(input_ids=input_ids, attention_mask=attention_mask, generation_config=gen)
        seconds = time.perf_counter() - t0
    return out[:, width:].tolist(), seconds


def vllm_request(batches: list[list[list[int]]], dtype: str, config: ThroughputConfig, enforce_eager: bool,
                 batch_max_tokens: list[int] | None = None) -> dict:
    """One worker request: one generate() call per batch, in order, on one engine."""
    request = {"kind": "generate", "batches": batches, "dtype": dtype, "max_tokens": config.max_tokens,
               "logprobs": 0, "temperature": 0.0, "ignore_eos": True, "enable_prefix_caching": False,
               "max_num_seqs": max(config.batch_sizes), "enforce_eager": enforce_eager,
               "batch_max_tokens": batch_max_tokens}
    if config.model is not None:
        request["model"] = config.model
    return request


def time_vllm(prompt_sets: list[list[list[int]]], dtype: str, config: ThroughputConfig, enforce_eager: bool
              ) -> tuple[list[tuple[list[list[int]], float]], dict]:
    """[(outputs, seconds) per prompt set], plus what the worker said about itself. Every distinct
    batch runs once first as a short warm-up, untimed."""
    from radarlab.validate.vllm import run_vllm

    warmup = warmup_sets(prompt_sets)
    tokens = [_warmup(config).max_tokens] * len(warmup) + [config.max_tokens] * len(prompt_sets)
    response = run_vllm(vllm_request(warmup + prompt_sets, dtype, config, enforce_eager, tokens))
    outputs = [o["token_ids"] for o in response["outputs"]]
    results, start = [], sum(len(p) for p in warmup)
    for prompts, batch in zip(prompt_sets, response["batches"][len(warmup):]):
        results.append((outputs[start:start + len(prompts)], batch["generate_s"]))
        start += len(prompts)
    return results, {"vllm_version": response["vllm_version"], "device": response["device"],
                     "init_s": response["init_s"], "compilation": response["compilation"]}


# --- the benchmark ------------------------------------------------------------------------------
def run(config: ThroughputConfig = ThroughputConfig(), log=print) -> tuple[list[Measurement], dict]:
    """All systems, dtypes and batch sizes; returns the measurements and facts about the systems."""
    import torch

    from radarlab.models.llama import Llama
    from radarlab.models.loader import load_hf

    measurements: list[Measurement] = []
    info: dict = {}
    for dtype_name in config.dtypes:
        dtype = getattr(torch, dtype_name)
        hf_model, tokenizer = load_hf(config.model, dtype=dtype)
        info["dims"] = asdict(TransformerDims.from_config(hf_model.config))
        vocab = hf_model.config.vocab_size
        prompt_sets = [random_token_prompts(b, vocab, (config.min_prompt_len, config.max_prompt_len),
                                            config.seed)
                       for b in config.batch_sizes]  # batch size B gets the first B prompts

        def record(system, prompts, runs):
            """runs: (outputs, seconds) of each repeat; the fastest counts, and all must agree."""
            outputs = runs[0][0]
            if any(o != outputs for o, _ in runs):
                raise RuntimeError(f"{system}: repeats of batch {len(prompts)} gave different greedy outputs")
            seconds = [s for _, s in runs]
            m = Measurement(system, len(prompts), dtype_name, _count(outputs, config.max_tokens, system),
                            min(seconds), outputs, seconds)
            measurements.append(m)
            log(f"{system:>12} {dtype_name:>8} batch {m.batch_size:>3}: {m.output_tokens:>5} tokens in "
                f"{m.seconds:7.2f} s = {m.tokens_per_s:7.1f} tok/s")

        for system, mode in RADARLAB_MODES.items():
            if system in config.systems:
                model = Llama.from_hf(hf_model)
                for prompts in warmup_sets(prompt_sets):
                    time_radarlab(model, prompts, _warmup(config), *mode)
                for prompts in prompt_sets:
                    record(system, prompts, [time_radarlab(model, prompts, config, *mode)
                                             for _ in range(config.repeats)])
                del model
        if "transformers" in config.systems:
            pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
            for prompts in warmup_sets(prompt_sets):
                time_transformers(hf_model, pad, prompts, _warmup(config))
            for prompts in prompt_sets:
                record("transformers", prompts, [time_transformers(hf_model, pad, prompts, config)
                                                 for _ in range(config.repeats)])
        del hf_model
        for system, eager in VLLM_EAGER.items():
            if system in config.systems:  # one process per system and dtype, every repeat in it
                results, info[system] = time_vllm(prompt_sets * config.repeats, dtype_name, config, eager)
                for i, prompts in enumerate(prompt_sets):
                    record(system, prompts, results[i::len(prompt_sets)])
    return measurements, info


def warmup_sets(prompt_sets: list[list[list[int]]]) -> list[list[list[int]]]:
    """One prompt set per distinct batch size: every system warms up on each (a short generation,
    untimed), so that whatever is built per shape (vLLM's compiled graphs, oneDNN's kernels for a
    row count) is built before the timed runs, for all systems alike."""
    return list({len(p): p for p in prompt_sets}.values())


def _warmup(config: ThroughputConfig) -> ThroughputConfig:
    from dataclasses import replace

    return replace(config, max_tokens=min(4, config.max_tokens))


def ratios(measurements: list[Measurement]) -> list[dict]:
    """radarlab's throughput over each other system's, and the fraction of requests whose greedy
    output equals radarlab's, per (dtype, batch size)."""
    by_key = {(m.system, m.dtype, m.batch_size): m for m in measurements}
    rows = []
    for m in measurements:
        if m.system != "radarlab":
            continue
        row = {"dtype": m.dtype, "batch_size": m.batch_size}
        for other in SYSTEMS[1:]:
            o = by_key.get((other, m.dtype, m.batch_size))
            if o is not None:
                row[f"radarlab_over_{other}"] = m.tokens_per_s / o.tokens_per_s
                same = sum(a == b for a, b in zip(m.outputs, o.outputs))
                row[f"outputs_equal_{other}"] = same / len(m.outputs)
        rows.append(row)
    return rows


def goal(measurements: list[Measurement]) -> dict:
    """Per dtype: radarlab's smallest ratio over transformers and over vLLM across the batch sizes
    measured, and whether each is at least 1.0. None where a system was not run."""
    out = {}
    for dtype in sorted({m.dtype for m in measurements}):
        rs = [r for r in ratios(measurements) if r["dtype"] == dtype]
        out[dtype] = {}
        for other in ("transformers", "vllm"):  # radarlab_torch is radarlab itself: not a goal
            vals = [r.get(f"radarlab_over_{other}") for r in rs]
            worst = None if not vals or None in vals else min(vals)
            out[dtype][f"min_ratio_{other}"] = worst
            out[dtype][f"at_least_{other}"] = None if worst is None else worst >= 1.0
    return {"goal": GOAL, "by_dtype": out}


def limits(config: ThroughputConfig, measurements: list[Measurement], dims: TransformerDims,
           peak_flops: float, bandwidth: float) -> list[dict]:
    """How close each measurement comes to this machine's roofline (notebook 01).

    A decode step of batch B reads the weights once and every sequence's KV (lab.roofline); its
    time is taken as B / tokens_per_s, at the mean context of the decode phase (the mean prompt length,
    (min + max) / 2 for these uniform lengths, plus half the new tokens). The wall time includes the
    prefill, so both fractions are lower bounds. bandwidth_fraction compares bytes per step over step
    time with the measured read bandwidth (the limit at batch 1); flops_fraction compares FLOPs per step
    over step time with the measured fp32 GEMM FLOP/s (the limit at large batch)."""
    context = (config.min_prompt_len + config.max_prompt_len) // 2 + config.max_tokens // 2
    rows = []
    for m in measurements:
        precision = "fp32" if m.dtype == "float32" else "bf16"
        step = decode_step(dims, m.batch_size, context, precision, precision)
        step_s = m.batch_size / m.tokens_per_s
        rows.append({"system": m.system, "dtype": m.dtype, "batch_size": m.batch_size, "context": context,
                     "bytes_per_step": step.bytes, "flops_per_step": step.flops,
                     "achieved_gb_s": step.bytes / step_s / 1e9,
                     "bandwidth_fraction": step.bytes / step_s / bandwidth,
                     "achieved_gflop_s": step.flops / step_s / 1e9,
                     "flops_fraction": step.flops / step_s / peak_flops})
    return rows


def report(config: ThroughputConfig, measurements: list[Measurement], info: dict, balance=None) -> dict:
    """The JSON document; with balance (lab.measure.MachineBalance, measured in the same run) and
    the model's dims in info, also each measurement's place on this machine's roofline."""
    import torch

    from radarlab.lab.machine import environment
    from radarlab.models.linear import cpu_has_native_half, mkl_gemv_rows, upcast_min_rows

    env = environment()
    env["torch_threads"] = torch.get_num_threads()
    env["cpu_capability"] = torch.backends.cpu.get_cpu_capability()
    env["cpu_native_bf16"] = cpu_has_native_half()
    env["fp32_gemv_rows"] = mkl_gemv_rows()
    env["dtype_notes"] = dtype_notes(env["cpu_native_bf16"], upcast_min_rows(), env["fp32_gemv_rows"])
    env["radarlab_cpu_ops"] = cpu_ops_status()
    for system in VLLM_EAGER:
        env.update({f"{system}_{k}": v for k, v in info.get(system, {}).items()})
    params = asdict(config)
    params["workload"] = ("random token ids, lengths uniform in [min_prompt_len, max_prompt_len], greedy, "
                          "EOS ignored, all requests submitted at once; batch size "
                          "B uses the first B prompts")
    doc = {
        "benchmark": "throughput",
        "parameters": params,
        "environment": env,
        "results": [m.row() for m in measurements],
        "ratios": ratios(measurements),
        "goal": goal(measurements),
    }
    if balance is not None and "dims" in info:
        doc["machine_balance"] = {"read_bandwidth_gb_s": balance.bandwidth / 1e9,
                                  "fp32_gemm_gflop_s": balance.peak_flops / 1e9}
        doc["limits"] = limits(config, measurements, TransformerDims(**info["dims"]), balance.peak_flops,
                               balance.bandwidth)
    return doc


def cpu_ops_status() -> dict:
    """Which of radarlab's C++ operators the radarlab rows ran: built (for which -march) or why not."""
    import os

    from radarlab.cpu_ops import CpuOpsUnavailable, load_cpu_ops

    try:
        load_cpu_ops()
    except CpuOpsUnavailable as err:
        return {"built": False, "reason": str(err)}
    return {"built": True, "march": os.environ.get("RADARLAB_CPU_MARCH", "native"),
            "operators": ["paged_decode", "reshape_and_cache", "rms_norm", "silu_and_mul",
                          "rotary_embedding"]}


def format_table(doc: dict) -> str:
    res = doc["results"]
    dtypes = list(dict.fromkeys(r["dtype"] for r in res))
    sizes = sorted({r["batch_size"] for r in res})
    systems = [s for s in SYSTEMS if any(r["system"] == s for r in res)]
    env = doc.get("environment", {})
    notes = env.get("dtype_notes", dtype_notes(env.get("cpu_native_bf16")))
    lines = []
    for dtype in dtypes:
        trick = f" ({notes[dtype]})" if dtype in notes else ""
        lines.append(f"output tokens/s, {dtype}{trick}")
        lines.append(f"{'batch size':>22}" + "".join(f"{b:>9}" for b in sizes))
        for s in systems:
            vals = {r["batch_size"]: r["tokens_per_s"] for r in res
                    if r["system"] == s and r["dtype"] == dtype}
            lines.append(f"{s:>22}" + "".join(f"{vals[b]:>9.1f}" if b in vals else f"{'-':>9}"
                                              for b in sizes))
        for other in systems[1:]:
            key = f"radarlab_over_{other}"
            vals = {r["batch_size"]: r[key] for r in doc["ratios"] if r["dtype"] == dtype and key in r}
            lines.append(f"{'radarlab / ' + other:>22}"
                         + "".join(f"{vals[b]:>8.2f}x" if b in vals else f"{'-':>9}" for b in sizes))
        if "vllm" in systems and "vllm_eager" in systems:  # what compiling buys vLLM, in the same run
            tps = {(r["system"], r["batch_size"]): r["tokens_per_s"] for r in res if r["dtype"] == dtype}
            lines.append(f"{'vllm / vllm_eager':>22}" + "".join(
                f"{tps['vllm', b] / tps['vllm_eager', b]:>8.2f}x"
                if ("vllm", b) in tps and ("vllm_eager", b) in tps else f"{'-':>9}" for b in sizes))
        for row in doc.get("limits", []):
            if row["system"] == "radarlab" and row["dtype"] == dtype and row["batch_size"] in (sizes[0],
                                                                                               sizes[-1]):
                lines.append(f"radarlab batch {row['batch_size']}: {row['achieved_gb_s']:.1f} GB/s read "
                             f"({row['bandwidth_fraction']:.0%} of this machine's read bandwidth), "
                             f"{row['achieved_gflop_s']:.1f} GFLOP/s "
                             f"({row['flops_fraction']:.0%} of its fp32 GEMM)")
        lines.append("")
    return "\n".join(lines).rstrip()


def format_goal(doc: dict) -> str:
    """The project's goal per dtype, for the maintainers' command line (notebooks leave it out)."""
    return "\n".join(f"goal, {dtype}: >= 1.0x transformers everywhere: "
                     f"{_yes(g.get('at_least_transformers'))}; >= 1.0x vLLM everywhere: "
                     f"{_yes(g.get('at_least_vllm'))}"
                     for dtype, g in doc["goal"]["by_dtype"].items())


def _yes(value) -> str:
    return "not measured" if value is None else ("met" if value else "NOT met")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = ThroughputConfig()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    add_sweep_arguments(parser, c)
    parser.add_argument("--dtypes", default=",".join(c.dtypes), help="(%(default)s)")
    parser.add_argument("--min-prompt-len", type=int, default=c.min_prompt_len, help="(%(default)s)")
    parser.add_argument("--max-prompt-len", type=int, default=c.max_prompt_len, help="(%(default)s)")
    parser.add_argument("--model", default=None, help="HF model id or directory (default: the course model)")
    add_batching_arguments(parser, c)  # radarlab's; transformers and vLLM batch their own way


def config_from_args(args: argparse.Namespace) -> ThroughputConfig:
    """Raises ValueError naming the bad field (python -m radarlab.bench names its flag)."""
    return ThroughputConfig(batch_sizes=comma_ints("batch-sizes", args.batch_sizes),
                            dtypes=comma_names(args.dtypes), systems=comma_names(args.systems),
                            max_tokens=args.max_tokens,
                            min_prompt_len=args.min_prompt_len, max_prompt_len=args.max_prompt_len,
                            seed=args.seed, model=args.model, block_size=args.block_size,
                            max_num_batched_tokens=args.max_num_batched_tokens, repeats=args.repeats)


def main(args: argparse.Namespace) -> int:
    from radarlab.bench.report import require_vllm, write_json

    config = config_from_args(args)
    require_vllm(config.systems, "radarlab,transformers")
    import os

    load_start, t0 = list(os.getloadavg()), time.perf_counter()
    measurements, info = run(config)
    import torch

    from radarlab.lab.measure import measure_machine

    doc = report(config, measurements, info, measure_machine(threads=torch.get_num_threads()))
    # On shared cores other work competes with each system in turn: the ratios of one run are the figure.
    doc["environment"]["load_average"] = {"start": load_start, "end": list(os.getloadavg()),
                                          "wall_s": time.perf_counter() - t0}
    env = doc["environment"]
    print(f"{env['cpu_model']} ({env['cpu_kind']}), {env['torch_threads']} torch threads, load average "
          f"{load_start[0]:.1f} at the start, {env['load_average']['end'][0]:.1f} at the end")
    print(format_table(doc))
    print(format_goal(doc))
    if args.json:
        write_json(args.json, doc)
    return 0
