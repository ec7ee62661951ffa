"""Speculative decoding: output tokens/s with and without drafts, radarlab and vLLM, in one run.

Each system decodes the same prompts, fp32, greedy, EOS ignored, max_tokens new tokens each, all
requests submitted at once, prefix caching off, with three methods:
- none: plain decoding;
- ngram: prompt lookup, vLLM's method and names (k = 5, prompt_lookup_min 2, prompt_lookup_max 4);
- draft: the EAGLE-style head trained here (radarlab.spec_decode.draft_head.TRAINED_HEAD, k = 4), method
  "eagle" in both systems. Ours ranks the head's draft vocabulary (4,096 tokens); vLLM's EAGLE-1
  loader does not read it and ranks all 49,152. With --draft-model, vLLM's draft_model method with
  that Llama as the draft instead (the course model itself accepts nearly everything but costs as
  much as the target: an upper bound on acceptance and a lower bound on speed).
Two workloads (radarlab.lab.workload): copy (repeat a standard-library function given in the
prompt, where prompt lookup finds the continuation) and free (chat prompts with nothing to copy).
Batch size B takes the first B prompts of a workload.

A cell is one generate() of max_tokens per request: at batch 1 that is one or two seconds, so a
busy moment of a shared machine moves it by several percent. With --repeats R each cell runs R
times (vLLM: R generate() calls in its one process) and the fastest counts, since noise only ever
adds time; every run's tokens/s is kept in the row.

vLLM runs as users run it, as the system `vllm`: its default mode, the model compiled by torch.compile
(Inductor), after a warm-up of every batch size; and as `vllm_eager` with enforce_eager=True, to see
what compiling buys each method. One process per system and method (its speculative_config is fixed
per engine), timed inside the worker; start-up, compilation included, is excluded and reported apart
(environment: SYSTEM_init_s by method, SYSTEM_compilation). The speedup of a method is its tokens/s
over the same system's "none" at the same workload and batch size: ratios within one run, so a shared,
busy CPU cancels out.
"""
from __future__ import annotations

import argparse
from dataclasses import asdict, dataclass
from pathlib import Path

from radarlab.bench.report import (
    VLLM_EAGER,
    add_sweep_arguments,
    comma_ints,
    comma_names,
    require_sweep,
    vllm_modes,
)
from radarlab.lab.kept_runs import choose_kept_run
from radarlab.validate.vllm_spec import DRAFT_K, NGRAM_CONFIG, SpecRun, run_radarlab_spec, run_vllm_spec

SYSTEMS = ("radarlab", "vllm", "vllm_eager")
METHODS = ("none", "ngram", "draft")
WORKLOADS = ("copy", "free")
GOAL = ("radarlab's n-gram speedup at batch 1 on the copy workload >= vLLM's in its default mode, "
        "in the same run")


@dataclass(frozen=True)
class SpecBenchConfig:
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)
    workloads: tuple[str, ...] = WORKLOADS
    methods: tuple[str, ...] = METHODS
    systems: tuple[str, ...] = SYSTEMS
    max_tokens: int = 128
    num_speculative_tokens: int = NGRAM_CONFIG["num_speculative_tokens"]
    prompt_lookup_min: int = NGRAM_CONFIG["prompt_lookup_min"]
    prompt_lookup_max: int = NGRAM_CONFIG["prompt_lookup_max"]
    draft_k: int = DRAFT_K
    draft_model: str | None = None  # a Llama directory or HF id for draft_model; None: the trained EAGLE head
    seed: int = 0
    repeats: int = 1  # runs per cell; the fastest counts

    def __post_init__(self) -> None:
        require_sweep(self, ("max_tokens", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                             "draft_k", "repeats"), ("prompt_lookup_min", "prompt_lookup_max"),
                      {"workloads": WORKLOADS, "methods": METHODS, "systems": SYSTEMS})

    def speculative_config(self, method: str) -> dict | None:
        """The speculative_config (vLLM's keys) of a method; None for plain decoding."""
        if method == "ngram":
            return {"method": "ngram", "num_speculative_tokens": self.num_speculative_tokens,
                    "prompt_lookup_min": self.prompt_lookup_min, "prompt_lookup_max": self.prompt_lookup_max}
        if method == "draft" and self.draft_model is None:
            from radarlab.spec_decode.draft_head import TRAINED_HEAD

            return {"method": "eagle", "num_speculative_tokens": self.draft_k, "model": str(TRAINED_HEAD)}
        if method == "draft":
            from radarlab.models.loader import resolve_model

            return {"method": "draft_model", "num_speculative_tokens": self.draft_k,
                    "model": str(resolve_model(self.draft_model))}
        return None


def workload_prompts(tokenizer, workload: str, num_prompts: int, seed: int) -> list[list[int]]:
    """Token ids of a workload's first num_prompts prompts; free prompts go through the chat template."""
    from radarlab.lab.workload import copy_prompts, free_prompts

    if workload == "copy":
        return [tokenizer(p)["input_ids"] for p in copy_prompts(num_prompts, seed)]
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                           tokenize=False) for p in free_prompts(num_prompts, seed)]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


def fastest(runs: list[SpecRun]) -> SpecRun:
    """The run that counts among repeats of one cell. Repeats are the same greedy work, so their
    outputs must agree; ValueError if not."""
    if not runs:
        raise ValueError("no runs")
    if any(r.outputs != runs[0].outputs for r in runs):
        raise ValueError("repeats of one cell gave different outputs: greedy decoding "
                         "is not deterministic here")
    return min(runs, key=lambda r: r.seconds)


def result_row(system: str, method: str, workload: str, runs: list[SpecRun]) -> dict:
    """One cell: the fastest run's figures, and every run's tokens/s."""
    run = fastest(runs)
    return {"system": system, "method": method, "workload": workload, "batch_size": len(run.outputs),
            "tokens_per_s": run.tokens_per_s, "acceptance_rate": run.acceptance_rate,
            "mean_accepted": run.mean_accepted, "output_tokens": run.output_tokens, "seconds": run.seconds,
            "repeats": len(runs), "tokens_per_s_runs": [r.tokens_per_s for r in runs], **run.counters()}


def run(config: SpecBenchConfig = SpecBenchConfig(), log=print) -> tuple[list[dict], dict]:
    """Every system, method, workload and batch size; returns result rows, facts about vLLM, and the
    outputs by (system, method, workload, batch size) for the equality check."""
    import torch

    from radarlab.models.llama import Llama

    model, tokenizer = Llama.from_pretrained(None, dtype=torch.float32)
    prompts = {w: workload_prompts(tokenizer, w, max(config.batch_sizes),
                                   config.seed) for w in config.workloads}
    cases = [(w, b) for w in config.workloads for b in config.batch_sizes]
    results, info, outputs = [], {}, {}

    def record(system, method, workload, runs: list[SpecRun]):
        results.append(result_row(system, method, workload, runs))
        r = fastest(runs)
        outputs[(system, method, workload, len(r.outputs))] = r.outputs
        rate = "-" if r.acceptance_rate is None else f"{r.acceptance_rate:.2f}"
        log(f"{system:>8} {method:>5} {workload:>4} batch {len(r.outputs):>3}: {r.tokens_per_s:7.1f} tok/s, "
            f"acceptance {rate}")

    for method in config.methods:
        spec = config.speculative_config(method)
        if "radarlab" in config.systems:
            run_radarlab_spec(model, prompts[cases[0][0]][:2], 4, spec)  # warm-up
            for w, b in cases:
                record("radarlab", method, w,
                       [run_radarlab_spec(model, prompts[w][:b], config.max_tokens, spec)
                                               for _ in range(config.repeats)])
        for system in (s for s in VLLM_EAGER if s in config.systems):
            R = config.repeats
            runs, info[f"{system}_{method}"] = run_vllm_spec(
                [prompts[w][:b] for w, b in cases for _ in range(R)], config.max_tokens, spec,
                enforce_eager=VLLM_EAGER[system])
            for i, (w, _) in enumerate(cases):
                record(system, method, w, runs[i * R:(i + 1) * R])
    return results, {**info, "outputs": outputs}


def speedups(results: list[dict]) -> list[dict]:
    """Each speculative row's tokens/s over the same system's plain decoding at the same workload and
    batch size."""
    plain = {(r["system"], r["workload"],
              r["batch_size"]): r["tokens_per_s"] for r in results if r["method"] == "none"}
    out = []
    for r in results:
        base = plain.get((r["system"], r["workload"], r["batch_size"]))
        if r["method"] != "none" and base:
            out.append({k: r[k] for k in ("system", "method", "workload", "batch_size")}
                       | {"speedup": r["tokens_per_s"] / base})
    return out


def equal_outputs(outputs: dict) -> list[dict]:
    """Per (method, workload, batch size): the fraction of requests whose tokens equal radarlab's
    plain greedy decoding, for each system (speculation must not change greedy output)."""
    rows = []
    for (system, method, workload, b), outs in sorted(outputs.items()):
        ref = outputs.get(("radarlab", "none", workload, b))
        if ref is not None:
            rows.append({"system": system, "method": method, "workload": workload, "batch_size": b,
                         "equal_to_radarlab_plain": sum(x == y for x, y in zip(outs, ref)) / len(ref)})
    return rows


def goal(ups: list[dict]) -> dict:
    def at(system):
        return next((u["speedup"] for u in ups if u["system"] == system and u["method"] == "ngram"
                     and u["workload"] == "copy" and u["batch_size"] == 1), None)

    ours, theirs = at("radarlab"), at("vllm")
    return {"goal": GOAL, "radarlab_speedup": ours, "vllm_speedup": theirs,
            "vllm_eager_speedup": at("vllm_eager"),
            "met": None if ours is None or theirs is None else ours >= theirs}


def vllm_environment(info: dict, methods: tuple[str, ...]) -> dict:
    """Each vLLM system's facts for the JSON's environment: version, device and compilation (one per
    system: every method's process runs the same mode), and start-up seconds by method (a compiled
    start-up holds the compilation; each method's engine compiles its own)."""
    env = {}
    for system in VLLM_EAGER:
        ran = [(m, info[f"{system}_{m}"]) for m in methods if f"{system}_{m}" in info]
        if not ran:
            continue
        first = ran[0][1]
        env.update({f"{system}_vllm_version": first["vllm_version"], f"{system}_device": first["device"],
                    f"{system}_compilation": first["compilation"],
                    f"{system}_init_s": {m: facts["init_s"] for m, facts in ran}})
    return env


def report(config: SpecBenchConfig, results: list[dict], info: dict) -> dict:
    import torch

    from radarlab.lab.machine import environment

    env = environment()
    env["torch_threads"] = torch.get_num_threads()
    env.update(vllm_environment(info, config.methods))
    params = asdict(config)
    params["draft"] = (f"draft_model with {config.draft_model} as the draft" if config.draft_model else
                       "eagle: the trained head "
                       "(radarlab.spec_decode.draft_head.TRAINED_HEAD); radarlab ranks its draft "
                       "vocabulary, vLLM the full vocabulary")
    ups = speedups(results)
    return {"benchmark": "spec", "parameters": params, "environment": env, "results": results,
            "speedups": ups, "outputs_equal": equal_outputs(info.get("outputs", {})), "goal": goal(ups)}


def format_table(doc: dict) -> str:
    res = doc["results"]
    sizes = sorted({r["batch_size"] for r in res})
    ups = {(u["system"], u["method"], u["workload"], u["batch_size"]): u["speedup"] for u in doc["speedups"]}
    lines = [f"{'output tokens/s (speedup over none) [acceptance]':<52}" + "".join(f"{'batch ' + str(b):>24}"
                                                                                 for b in sizes)]
    keys = list(dict.fromkeys((r["system"], r["method"], r["workload"]) for r in res))
    for system, method, workload in keys:
        cells = []
        for b in sizes:
            r = next((r for r in res if (r["system"], r["method"], r["workload"], r["batch_size"])
                      == (system, method, workload, b)), None)
            if r is None:
                cells.append(f"{'-':>24}")
                continue
            text = f"{r['tokens_per_s']:.1f}"
            if (system, method, workload, b) in ups:
                text += f" ({ups[(system, method, workload, b)]:.2f}x) [{r['acceptance_rate'] or 0:.2f}]"
            cells.append(f"{text:>24}")
        lines.append(f"{system + ' ' + method + ' ' + workload:<52}" + "".join(cells))
    return "\n".join(lines)


def full_run(kind: str, folder: str | Path | None = None) -> tuple[Path | None, dict | None, str | None]:
    """(path, doc, sentence): the run notebooks 08 and 09 show on a CPU of this kind, this kind's
    results/spec-KIND.json or another kind's (radarlab.lab.kept_runs.choose_kept_run). The sentence,
    None for this kind's own run, says whose run it is and that only its speedups compare."""
    return choose_kept_run("spec", kind, "speculative-decoding",
                           "`python -m radarlab.bench spec --json "
                           f"results/spec-{kind}.json`, on a quiet machine, writes one for this CPU.", folder)


def format_ngram_speedups(path: Path, doc: dict) -> str:
    """Notebook 08's lines: the n-gram's speedup over plain decoding per system, workload and batch size."""
    lines = [f"{path.name}: n-gram speedup over plain decoding, same system, same run "
             f"({doc['environment']['device']})"]
    lines += [f"  {u['system']:8s} {u['workload']:4s} batch {u['batch_size']:3d}: {u['speedup']:.2f}x"
              for u in doc["speedups"] if u["method"] == "ngram"]
    return "\n".join(lines)


def speedup_curves(doc: dict) -> dict[tuple[str, str, str], list[tuple[int, float]]]:
    """(system, method, workload) -> [(batch size, tokens/s over the same system's plain decoding)],
    from the result rows (notebook 09's table and plot)."""
    tps = {(r["system"], r["method"], r["workload"],
            r["batch_size"]): r["tokens_per_s"] for r in doc["results"]}
    curves: dict = {}
    for (system, method, workload, b), v in tps.items():
        base = tps.get((system, "none", workload, b))
        if method != "none" and base:
            curves.setdefault((system, method, workload), []).append((b, v / base))
    return curves


def format_run_header(path: Path, doc: dict) -> str:
    """Notebook 09's line above the speedups: the CPU, threads, request length and batch sizes of the run."""
    env, par = doc["environment"], doc["parameters"]
    return (f"{path.name}: {env['cpu_model']}, {env['torch_threads']} thread(s), "
            f"{par['max_tokens']} tokens a request, batch sizes {par['batch_sizes']}")


def format_speedup_curves(doc: dict) -> str:
    """Notebook 09's table: each method's speedup by batch size, and its acceptance (accepted draft tokens
    over draft tokens) at the smallest batch."""
    curves = speedup_curves(doc)
    if not curves:
        return "this run has no speculative rows (methods other than none)"
    smallest = min(doc["parameters"]["batch_sizes"])
    acceptance = {(r["system"], r["method"], r["workload"]): r["acceptance_rate"] for r in doc["results"]
                  if r["method"] != "none" and r["batch_size"] == smallest}
    batches = sorted({b for pts in curves.values() for b, _ in pts})
    lines = [f"{'system':<9} {'method':<6} {'workload':<8} " + "  ".join(f"B={b:<4}" for b in batches)]
    for (system, method, workload), pts in sorted(curves.items()):
        pts = dict(pts)
        lines.append(f"{system:<9} {method:<6} {workload:<8} "
                     + "  ".join(f"{pts[b]:5.2f}x" if b in pts else "   -  " for b in batches)
                     + f"   acceptance {acceptance.get((system, method, workload)) or 0:.2f}")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = SpecBenchConfig()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    add_sweep_arguments(parser, c)
    parser.add_argument("--workloads", default=",".join(c.workloads), help="(%(default)s)")
    parser.add_argument("--methods", default=",".join(c.methods), help="(%(default)s)")
    parser.add_argument("--num-speculative-tokens", type=int, default=c.num_speculative_tokens,
                        help="n-gram k (%(default)s)")
    parser.add_argument("--prompt-lookup-min", type=int, default=c.prompt_lookup_min, help="(%(default)s)")
    parser.add_argument("--prompt-lookup-max", type=int, default=c.prompt_lookup_max, help="(%(default)s)")
    parser.add_argument("--draft-k", type=int, default=c.draft_k, help="k of method draft (%(default)s)")
    parser.add_argument("--draft-model", default=None,
                        help="a Llama directory: method draft runs vLLM's draft_model with it, "
                             "not the trained EAGLE head")


def config_from_args(args: argparse.Namespace) -> SpecBenchConfig:
    return SpecBenchConfig(batch_sizes=comma_ints("batch-sizes", args.batch_sizes),
                           workloads=comma_names(args.workloads), methods=comma_names(args.methods),
                           systems=comma_names(args.systems), max_tokens=args.max_tokens,
                           num_speculative_tokens=args.num_speculative_tokens,
                           prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                           draft_k=args.draft_k, draft_model=args.draft_model, seed=args.seed,
                           repeats=args.repeats)


def main(args: argparse.Namespace) -> int:
    from radarlab.bench.report import require_vllm, write_json

    config = config_from_args(args)
    require_vllm(config.systems, "radarlab")
    results, info = run(config)
    doc = report(config, results, info)
    print(format_table(doc))
    for line in vllm_modes(doc):
        print(line)
    g = doc["goal"]
    if g["radarlab_speedup"] is not None:
        theirs = [f"{label} {g[key]:.2f}x" for key, label in (("vllm_speedup", "vLLM default (compiled)"),
                                                               ("vllm_eager_speedup", "vLLM eager"))
                  if g[key] is not None]
        if theirs:
            print(f"n-gram speedup, copy, batch 1: radarlab {g['radarlab_speedup']:.2f}x, "
                  + ", ".join(theirs))
    if args.json:
        write_json(args.json, doc)
    return 0
