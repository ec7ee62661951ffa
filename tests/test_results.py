"""Every file under results/ against a schema of what reads it, and the notebooks' own readers run on it.

The notebooks read kept runs (results/README.md), and some choose the file by this machine's CPU kind
(radarlab.device.cpu_kind): a branch chosen by the CPU ran only on CPUs of that kind, so
results/throughput-avx2.json, which lacked keys notebook 05 reads, failed only on AVX2 machines. Here,
on every machine:

- each file meets its schema: the keys and types that the notebooks, the bench modules' format_*
  functions and radarlab.viz read, written as plain checks; a file no schema covers fails, so a new
  kind of result cannot slip in unchecked;
- the functions the notebooks call run on each file, and on a copy pruned to the keys its schema
  names (so a reader cannot need a key the schema does not check);
- deleting any key the schema requires, or giving it a wrong type, fails with the file and the key;
- each notebook's choice of a kept run (throughput, spec, FP8 validation) runs for every CPU kind there is.
"""
from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest

from radarlab.bench import kv_quant, latency, speculation, throughput
from radarlab.device import cpu_kind, cpu_kinds
from radarlab.lab.kept_runs import choose_kept_run, kept_by_kind, results_dir
from radarlab.models.linear import gemv_rows_for
from radarlab.validate import vllm_fp8

NUM = (int, float)


class SchemaError(AssertionError):
    """A kept file lacks what its readers need; the message names the file and the key."""


def _dotted(path: tuple) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text


def _is(value, types) -> bool:
    """isinstance, except that a bool is no number (JSON true is not 1)."""
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _names(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


class Reader:
    """Walks one document as its readers do. A missing key or a wrong type raises SchemaError naming
    the file and the path; every key read is recorded, for the mutation and pruning tests."""

    def __init__(self, name: str):
        self.name = name
        self.read: list[tuple[tuple, object, bool]] = []  # (path, types, optional)

    def fail(self, path: tuple, what: str):
        where = f"{_dotted(path)} " if path else ""
        raise SchemaError(f"results/{self.name}: {where}{what}")

    def check(self, ok: bool, path: tuple, what: str) -> None:
        if not ok:
            self.fail(path, what)

    def get(self, obj, path: tuple, key: str, types, optional: bool = False):
        """obj[key] (obj found at path), of one of types; None for an optional key that is absent."""
        if not isinstance(obj, dict):
            self.fail(path, f"must be an object, is {type(obj).__name__}")
        if key not in obj:
            if optional:
                return None
            self.fail(path, f"has no key {key!r}")
        value = obj[key]
        if not _is(value, types):
            self.fail(path + (key,), f"must be {_names(types)}, is {type(value).__name__} ({value!r:.60})")
        self.read.append((path + (key,), types, optional))
        return value

    def rows(self, obj, path: tuple, key: str, optional: bool = False) -> list[tuple[tuple, dict]]:
        """(path, row) for each object of the non-empty list obj[key]."""
        items = self.get(obj, path, key, list, optional)
        if items is None:
            return []
        self.check(bool(items), path + (key,), "is empty")
        for i, item in enumerate(items):
            self.check(isinstance(item, dict), path + (key, i),
                       f"must be an object, is {type(item).__name__}")
        return [(path + (key, i), item) for i, item in enumerate(items)]

    def values(self, obj, path: tuple, key: str, types, length: int | None = None) -> list:
        """The list obj[key], each element of one of types (and `length` of them, if given)."""
        items = self.get(obj, path, key, list)
        self.check(length is None or len(items) == length, path + (key,),
                   f"must hold {length} values, holds {len(items)}")
        for i, x in enumerate(items):
            self.check(_is(x, types), path + (key, i), f"must be {_names(types)}, is {type(x).__name__}")
        return items

    def one_of(self, obj, path: tuple, key: str, allowed) -> str:
        value = self.get(obj, path, key, str)
        self.check(value in allowed, path + (key,), f"is {value!r}, not one of {list(allowed)}")
        return value


# --- the schemas, one per kind of result ---------------------------------------------------------
def check_environment(r: Reader, env: dict, path: tuple, kind: str | None = None) -> None:
    """radarlab.lab.machine.environment()'s keys the readers print; a file named for a CPU kind
    must have run on that kind."""
    for key in ("radarlab", "torch", "platform", "device", "device_name", "cpu_model"):
        r.get(env, path, key, str)
    ran_on = r.one_of(env, path, "cpu_kind", cpu_kinds())
    r.check(kind is None or ran_on == kind, path + ("cpu_kind",),
            f"is {ran_on!r}, but the file is named for CPU kind {kind!r}")


def check_throughput(r: Reader, doc: dict, kind: str) -> None:
    """results/throughput-KIND.json: notebook 05 (format_run_header, format_table, format_ratios,
    radarlab.viz.throughput_plot). A full run: every system at every dtype and batch size."""
    r.check(r.get(doc, (), "benchmark", str) == "throughput", ("benchmark",), "must be 'throughput'")
    env = r.get(doc, (), "environment", dict)
    check_environment(r, env, ("environment",), kind)
    r.get(env, ("environment",), "torch_threads", int)
    r.get(env, ("environment",), "cpu_capability", str)
    r.get(env, ("environment",), "cpu_native_bf16", bool)
    r.get(env, ("environment",), "dtype_notes", dict, optional=True)
    rows = r.get(env, ("environment",), "fp32_gemv_rows", int, optional=True)
    if rows is not None:  # runs since the fp32 rule by vendor (radarlab.models.linear) record both
        vendor = r.get(env, ("environment",), "cpu_vendor", str)
        r.check(rows == gemv_rows_for(vendor), ("environment", "fp32_gemv_rows"),
                f"is {rows}, but the rule gives {gemv_rows_for(vendor)} on a {vendor} CPU")
    systems = r.get(r.get(doc, (), "parameters", dict), ("parameters",), "systems", list)
    unknown = sorted(set(systems) - set(throughput.SYSTEMS))
    r.check(not unknown, ("parameters", "systems"), f"names unknown systems {unknown}")
    r.check("radarlab" in systems and any(s in systems for s in throughput.VLLM_EAGER),
            ("parameters", "systems"), "a full run has radarlab and vLLM (default or eager mode) at least")
    for system, eager in throughput.VLLM_EAGER.items():
        if system in systems:  # format_run_header and format_vllm_modes read these
            where = ("environment",)
            r.get(env, where, f"{system}_vllm_version", str)
            r.get(env, where, f"{system}_init_s", NUM)
            comp = r.get(env, where, f"{system}_compilation", dict)
            r.check(comp.get("enforce_eager") is eager, (*where, f"{system}_compilation"),
                    f"must say enforce_eager {eager}: that is what {system} means")
    cells = set()
    for p, row in r.rows(doc, (), "results"):
        system = r.one_of(row, p, "system", tuple(systems))
        dtype = r.one_of(row, p, "dtype", throughput.DTYPES)
        cells.add((system, dtype, r.get(row, p, "batch_size", int)))
        r.get(row, p, "tokens_per_s", NUM)
    grid = {(s, d, b) for s in systems for _, d, b in cells}
    r.check(cells == grid, ("results",),
            f"lacks {sorted(grid - cells)}: a full run has every system it names at every "
                                         f"dtype and batch size")
    ratio_cells = set()
    for p, row in r.rows(doc, (), "ratios"):
        ratio_cells.add((r.get(row, p, "dtype", str), r.get(row, p, "batch_size", int)))
        for other in systems:
            if other != "radarlab":
                r.get(row, p, f"radarlab_over_{other}", NUM)
    r.check(ratio_cells == {(d, b) for _, d, b in cells}, ("ratios",),
            "must have one row per dtype and batch size")
    for p, row in r.rows(doc, (), "limits", optional=True):
        for key in ("system", "dtype"):
            r.get(row, p, key, str, optional=True)
        r.get(row, p, "batch_size", int, optional=True)
        for key in ("achieved_gb_s", "bandwidth_fraction", "achieved_gflop_s", "flops_fraction"):
            r.get(row, p, key, NUM, optional=True)


def check_spec(r: Reader, doc: dict, kind: str, goal_run: bool = False) -> None:
    """results/spec-KIND.json (notebooks 08 and 09: format_ngram_speedups, format_run_header,
    speedup_curves, format_speedup_curves) and results/ngram-goal-*-KIND.json (bench spec's table and
    its batch-1 n-gram goal, read by no notebook)."""
    r.check(r.get(doc, (), "benchmark", str) == "spec", ("benchmark",), "must be 'spec'")
    par = r.get(doc, (), "parameters", dict)
    sizes = r.values(par, ("parameters",), "batch_sizes", int)
    r.check(bool(sizes), ("parameters", "batch_sizes"), "is empty")
    r.get(par, ("parameters",), "max_tokens", int)
    env = r.get(doc, (), "environment", dict)
    check_environment(r, env, ("environment",), kind)
    r.get(env, ("environment",), "torch_threads", int)
    systems = r.get(par, ("parameters",), "systems", list)
    unknown = sorted(set(systems) - set(speculation.SYSTEMS))
    r.check(not unknown, ("parameters", "systems"), f"names unknown systems {unknown}")
    migrated = r.get(doc, (), "migrated", str, optional=True)
    for system, eager in speculation.VLLM_EAGER.items():
        if system in systems:  # bench.report.vllm_modes reads these
            where = ("environment",)
            r.get(env, where, f"{system}_vllm_version", str)
            r.get(env, where, f"{system}_init_s", (*NUM, dict))
            # runs kept before the bench ran vLLM's default mode recorded no compilation (and say so)
            comp = r.get(env, where, f"{system}_compilation", dict, optional=migrated is not None)
            r.check(comp is None or comp.get("enforce_eager") is eager, (*where, f"{system}_compilation"),
                    f"must say enforce_eager {eager}: that is what {system} means")
    for p, row in r.rows(doc, (), "results"):
        r.one_of(row, p, "system", tuple(systems))
        r.one_of(row, p, "method", speculation.METHODS)
        r.one_of(row, p, "workload", speculation.WORKLOADS)
        b = r.get(row, p, "batch_size", int)
        r.check(b in sizes, p + ("batch_size",), f"is {b}, not among parameters.batch_sizes {sizes}")
        r.get(row, p, "tokens_per_s", NUM)
        r.get(row, p, "acceptance_rate", (*NUM, type(None)))
    for p, row in r.rows(doc, (), "speedups"):
        for key in ("system", "method", "workload"):
            r.get(row, p, key, str)
        r.get(row, p, "batch_size", int)
        r.get(row, p, "speedup", NUM)
    goal = r.get(doc, (), "goal", dict)
    maybe = (*NUM, type(None))
    r.get(goal, ("goal",), "radarlab_speedup", NUM if goal_run else maybe)
    theirs = [r.get(goal, ("goal",), key, maybe) for key in ("vllm_speedup", "vllm_eager_speedup")]
    r.check(not goal_run or any(x is not None for x in theirs), ("goal",),
            "a goal run has vLLM's speedup in its default or its eager mode")
    met = r.get(goal, ("goal",), "met", (bool, type(None)))
    r.check(met is not None or theirs[0] is None or not goal_run, ("goal", "met"),
            "must be true or false where vLLM's default mode ran")


def check_validate_fp8(r: Reader, doc: dict, kind: str) -> None:
    """results/validate-fp8-KIND.json (`python -m radarlab.validate --sections fp8 --json ...`): notebook
    06 (vllm_fp8.format_kept_rows, rounding_by_dtype). Each of vLLM's FP8 dtypes has its bytes, greedy
    and rounding rows."""
    sections = r.values(doc, (), "sections", str)
    r.check(sections == ["fp8"], ("sections",), f"is {sections}, must be ['fp8']: the FP8 rows alone")
    r.get(doc, (), "passed", bool)
    check_environment(r, r.get(doc, (), "machine", dict), ("machine",), kind)
    seen = {}
    for p, row in r.rows(doc, (), "rows"):
        check = r.get(row, p, "check", str)
        for key in ("reference", "measured", "criterion"):
            r.get(row, p, key, str)
        r.get(row, p, "passed", bool)
        details = r.get(row, p, "details", dict)
        if check.startswith("rounding, kv_cache_dtype="):
            dtype = check.split("kv_cache_dtype=")[1].split(":")[0]
            seen.setdefault(dtype, set()).add("rounding")
            for key in ("max_dlogprob_rtz", "max_dlogprob_rne"):
                r.get(details, p + ("details",), key, NUM)
        elif check.startswith(("greedy, kv_cache_dtype=", "KV cache bytes")):
            dtype = check.split("kv_cache_dtype=")[1].split()[0] if "kv_cache_dtype=" in check else None
            seen.setdefault(dtype, set()).add(check.split(",")[0].split()[0])
    for dtype in vllm_fp8.VLLM_FP8_DTYPES:
        r.check(seen.get(dtype) == {"rounding", "greedy", "KV"}, ("rows",),
                f"must hold the bytes, greedy and rounding rows of kv_cache_dtype={dtype}, has "
                f"{sorted(seen.get(dtype, ()))}")


def check_latency(r: Reader, doc: dict) -> None:
    """results/latency.json: notebook 05 (latency.format_full_run, format_table, plot_latency_sweep,
    and its cells on the lowest and highest rate and the budget sweep)."""
    r.check(r.get(doc, (), "benchmark", str) == "latency", ("benchmark",), "must be 'latency'")
    par = r.get(doc, (), "parameters", dict)
    for key in ("num_requests", "output_len", "max_num_seqs", "max_num_batched_tokens", "torch_threads"):
        r.get(par, ("parameters",), key, int)
    r.values(par, ("parameters",), "prompt_len_range", int, length=2)
    r.get(par, ("parameters",), "dtype", str)
    r.get(par, ("parameters",), "budget_sweep_rate_req_s", NUM)
    env = r.get(doc, (), "environment", dict)
    check_environment(r, env, ("environment",))
    r.get(env, ("environment",), "cpu_count", int)
    load = r.get(env, ("environment",), "load_average", dict)
    for key in ("start", "end"):
        r.check(bool(r.values(load, ("environment", "load_average"), key, NUM)),
                ("environment", "load_average", key), "is empty")
    r.get(load, ("environment", "load_average"), "wall_s", NUM)
    for key in ("results", "budget_sweep"):
        for p, row in r.rows(doc, (), key):
            r.get(row, p, "rate", NUM)
            if key == "budget_sweep":
                r.get(row, p, "max_num_batched_tokens", int)
            for q in ("ttft_s", "itl_s"):
                stats = r.get(row, p, q, dict)
                for stat in ("p50", "p99", "max"):
                    r.get(stats, p + (q,), stat, NUM)
            for k in ("output_throughput_tok_s", "request_throughput_req_s"):
                r.get(row, p, k, NUM)
            r.get(row, p, "preemptions", int)
            conc = r.get(row, p, "concurrency", dict)
            for k in ("in_system_time_weighted", "running_time_weighted", "running_step_mean"):
                r.get(conc, p + ("concurrency",), k, NUM)
            for k in ("in_system_max", "running_max"):
                r.get(conc, p + ("concurrency",), k, int)
            law = r.get(row, p, "littles_law", dict)
            for k in ("lambda_x_W", "L_over_lambda_x_W"):
                r.get(law, p + ("littles_law",), k, NUM)


def check_quant(r: Reader, doc: dict) -> None:
    """results/quant.json: notebooks 06 (format_fp8_full_run, fp8_rows) and 07 (format_kept_source,
    format_pareto_rows, its Pareto plot by format family) and bench quant's format_table."""
    from radarlab.quant.formats import kv_format

    conf = r.get(doc, (), "config", dict)
    for key in ("num_chunks", "chunk_len"):
        r.get(conf, ("config",), key, int)
    r.get(r.get(doc, (), "corpus", dict), ("corpus",), "name", str)
    check_environment(r, r.get(doc, (), "environment", dict), ("environment",))
    dtypes = []
    for p, row in r.rows(doc, (), "schemes"):
        r.get(row, p, "name", str)
        dtype = r.get(row, p, "kv_cache_dtype", str)
        try:
            family = kv_format(dtype).kind
        except ValueError as err:
            r.fail(p + ("kv_cache_dtype",), f"is no KV format radarlab.quant.formats knows: {err}")
        r.check(family in ("float", "fp8", "int4", "kivi"), p + ("kv_cache_dtype",),
                f"is of family {family!r}, which notebook 07's plot has no colour for")
        dtypes.append(dtype)
        for key in ("bits", "saving", "kv_bytes_per_token_at_len", "saving_at_len", "ppl", "ppl_delta_pct",
                    "attn_err"):
            r.get(row, p, key, NUM)
        r.get(row, p, "kv_bytes_per_token", int)
    r.check("fp32" in dtypes, ("schemes",), "has no fp32 row: the perplexity reference")
    for p, row in r.rows(doc, (), "concurrency"):
        r.get(row, p, "kv_cache_dtype", str)
        for key in ("num_blocks", "max_running", "preemptions"):
            r.get(row, p, key, int)
        for key in ("mean_running", "output_tokens_per_s"):
            r.get(row, p, key, NUM)


def notebook_09_methods() -> tuple[str, ...]:
    """The proposers notebook 09's section 2 compares (its METHODS)."""
    return ("draft", "ngram", "ngram+draft")


def check_draft_eval(r: Reader, doc: dict) -> None:
    """results/draft_eval.json: notebook 09 (draft_eval.format_replay_table; its plot reads each method's
    row at the largest k, its summary the rows at k = 1 and 4)."""
    check_environment(r, r.get(doc, (), "machine", dict), ("machine",))
    for key in ("prompts", "max_new_tokens"):
        r.get(doc, (), key, int)
    replay = set()
    for p, row in r.rows(doc, (), "results"):
        method, k = r.get(row, p, "method", str), r.get(row, p, "k", int)
        if r.get(row, p, "mode", str) == "replay":
            replay.add((method, k))
            for key in ("first_token_acceptance", "tokens_per_verify_step"):
                r.get(row, p, key, NUM)
            for key in ("mismatched_outputs", "num_drafts"):
                r.get(row, p, key, int)
            r.values(row, p, "num_accepted_tokens_per_pos", int, length=k)
    r.check(bool(replay), ("results",), "has no row with mode 'replay'")
    k_max = max(k for _, k in replay)
    for method in notebook_09_methods():
        for k in sorted({1, 4, k_max}):
            r.check((method, k) in replay, ("results",),
                    f"has no replay row for method {method!r} at k = {k}")
    cost = r.get(doc, (), "cost", dict)
    for key in ("ratio_flops", "ratio_bytes", "ratio_time"):
        r.get(cost, ("cost",), key, NUM)
    per_token = r.get(cost, ("cost",), "seconds_per_token", dict)
    for key in ("draft", "target"):
        r.get(per_token, ("cost", "seconds_per_token"), key, NUM)


def check_draft_training(r: Reader, doc: dict) -> None:
    """results/draft-training.json: notebook 09 (train_draft.plot_training, format_training_summary)."""
    r.get(doc, (), "machine", str)
    check_environment(r, r.get(doc, (), "environment", dict), ("environment",))
    summary = r.get(doc, (), "summary", dict)
    for key in ("steps", "rows", "seq_len", "batch_rows", "passes"):
        r.get(summary, ("summary",), key, int)
    for key in ("train_seconds", "first_loss", "final_loss"):
        r.get(summary, ("summary",), key, NUM)
    passes = None
    for p, row in r.rows(doc, (), "log"):
        r.get(row, p, "step", int)
        r.get(row, p, "loss", NUM)
        acc = r.values(row, p, "acc_per_pass", NUM, length=passes)
        passes = len(acc) if passes is None else passes


def check_vllm_eagle(r: Reader, doc: dict) -> None:
    """results/draft_vllm_eagle.json: notebook 09 (draft_eval.format_vllm_comparison)."""
    for key in ("what", "note"):
        r.get(doc, (), key, str)
    v = r.get(doc, (), "vllm", dict)
    r.values(v, ("vllm",), "outputs_equal_ours", bool)
    metrics = r.get(v, ("vllm",), "metrics", dict)
    r.values(metrics, ("vllm", "metrics"), "vllm:spec_decode_num_accepted_tokens_per_pos", NUM)
    r.get(metrics, ("vllm", "metrics"), "vllm:spec_decode_num_draft_tokens", NUM)
    ours = r.get(doc, (), "ours", dict)
    r.values(ours, ("ours",), "num_accepted_tokens_per_pos", int)
    r.get(ours, ("ours",), "num_draft_tokens", int)


def check_readme(r: Reader, text: str, folder: Path) -> None:
    """results/README.md must say what every other file there is."""
    for path in sorted(folder.iterdir()):
        r.check(path.name == "README.md" or f"`{path.name}`" in text, (), f"does not describe {path.name}")


def schema_for(name: str):
    """The check of one results/ file, by name: a function of (Reader, doc). SchemaError for a name no
    schema covers."""
    kinds = "|".join(cpu_kinds())
    if m := re.fullmatch(rf"throughput-({kinds})\.json", name):
        return lambda r, doc: check_throughput(r, doc, m[1])
    if m := re.fullmatch(rf"spec-({kinds})\.json", name):
        return lambda r, doc: check_spec(r, doc, m[1])
    if m := re.fullmatch(rf"ngram-goal(?:-\d+)?-({kinds})\.json", name):
        return lambda r, doc: check_spec(r, doc, m[1], goal_run=True)
    if m := re.fullmatch(rf"validate-fp8-({kinds})\.json", name):
        return lambda r, doc: check_validate_fp8(r, doc, m[1])
    fixed = {"latency.json": check_latency, "quant.json": check_quant, "draft_eval.json": check_draft_eval,
             "draft-training.json": check_draft_training, "draft_vllm_eagle.json": check_vllm_eagle,
             "README.md": lambda r, text: check_readme(r, text, results_dir())}
    if name in fixed:
        return fixed[name]
    raise SchemaError(f"results/{name} has no schema: add one to tests/test_results.py (the keys its readers "
                      f"need), or name it as a kept kind of result is named")


def load(name: str, folder: Path | None = None):
    path = (folder or results_dir()) / name
    return path.read_text() if name.endswith(".md") else json.loads(path.read_text())


def check_file(name: str, doc) -> Reader:
    reader = Reader(name)
    schema_for(name)(reader, doc)
    return reader


# --- the notebooks' readers ----------------------------------------------------------------------
def run_readers(name: str, path: Path, doc: dict) -> list[str]:
    """Call on doc what the notebooks (and the bench's own command line) call on this kind of file, and
    draw its figures (closed again); return the texts they print."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from radarlab.train import draft_eval, train_draft
    from radarlab.viz.latency_plot import plot_latency_sweep
    from radarlab.viz.throughput_plot import plot_throughput

    figures = []
    if name.startswith("throughput-"):
        texts = [throughput.format_run_header(path, doc), throughput.format_table(doc),
                 throughput.format_ratios(path, doc)]
        figures.append(plot_throughput(doc))
    elif name.startswith(("spec-", "ngram-goal")):
        texts = [speculation.format_ngram_speedups(path, doc), speculation.format_run_header(path, doc),
                 speculation.format_speedup_curves(doc), speculation.format_table(doc)]
    elif name.startswith("validate-fp8-"):
        texts = [vllm_fp8.format_kept_rows(path, doc), str(vllm_fp8.rounding_by_dtype(doc))]
    elif name == "latency.json":
        texts = [latency.format_full_run(doc)]
        figures.append(plot_latency_sweep(doc["results"], doc["budget_sweep"],
                                          max_num_seqs=doc["parameters"]["max_num_seqs"]))
    elif name == "quant.json":
        texts = [kv_quant.format_fp8_full_run(path, doc), kv_quant.format_kept_source(path, doc),
                 kv_quant.format_pareto_rows(doc["schemes"]), kv_quant.format_table(doc)]
    elif name == "draft_eval.json":
        texts = [draft_eval.format_replay_table(doc, notebook_09_methods())]
    elif name == "draft-training.json":
        texts = [train_draft.format_training_summary(doc)]
        figures.append(train_draft.plot_training(doc))
    elif name == "draft_vllm_eagle.json":
        texts = [draft_eval.format_vllm_comparison(doc)]
    else:
        raise AssertionError(f"no readers listed here for results/{name}: add what its notebook calls")
    try:
        for fig in figures:
            assert fig.axes and all(ax.has_data() for ax in fig.axes), f"{name}: a figure with an empty panel"
    finally:
        for fig in figures:
            plt.close(fig)
    return texts


def prune(doc, kept: set[tuple]):
    """doc with only the keys a schema read (list indices as "*"): what a reader may rely on."""
    def walk(obj, path):
        if isinstance(obj, dict):
            return {k: walk(v, path + (k,)) for k, v in obj.items() if path + (k,) in kept}
        if isinstance(obj, list):
            return [walk(x, path + ("*",)) for x in obj]
        return obj

    return walk(doc, ())


def generic(path: tuple) -> tuple:
    return tuple("*" if isinstance(p, int) else p for p in path)


def kept_files() -> list[str]:
    return sorted(p.name for p in results_dir().iterdir())


def kept_json() -> list[str]:
    return [n for n in kept_files() if n.endswith(".json")]


# --- every file: its schema, its readers ---------------------------------------------------------
@pytest.mark.parametrize("name", kept_files())
def test_every_file_has_a_schema_and_meets_it(name):
    assert (results_dir() / name).is_file(), f"results/{name} is not a file: results/ holds kept runs only"
    reader = check_file(name, load(name))
    assert name == "README.md" or reader.read, f"results/{name}: its schema read nothing"


@pytest.mark.parametrize("name", kept_json())
def test_the_notebooks_readers_run_on_every_kept_file(name):
    path, doc = results_dir() / name, load(name)
    texts = run_readers(name, path, doc)
    assert all(texts), f"{name}: a reader printed nothing"
    assert not any("None" in t for t in texts), f"{name}: a value printed as None: {texts}"


@pytest.mark.parametrize("name", kept_json())
def test_the_readers_need_no_key_the_schema_does_not_check(name):
    """The readers run on a copy holding only the keys the schema read: any other key they need is one
    a file could lack without this test noticing."""
    doc = load(name)
    kept = {generic(p[:i]) for p, _, _ in check_file(name, doc).read for i in range(1, len(p) + 1)}
    try:
        run_readers(name, results_dir() / name, prune(doc, kept))
    except (KeyError, TypeError, IndexError) as err:
        pytest.fail(f"results/{name}: a reader needs what its schema does not check "
                    f"({type(err).__name__}: {err}); add it to the schema in tests/test_results.py")


def wrong_value(types):
    """A JSON value of none of types."""
    return next(v for v in ("x", 0, 1.5, True, None, [], {}) if not _is(v, types))


def at(doc, path):
    for part in path[:-1]:
        doc = doc[part]
    return doc


@pytest.mark.parametrize("name", kept_json())
def test_each_required_key_missing_or_mistyped_fails_naming_file_and_key(name):
    """Every key the schema requires (in the first list row that has it): deleted, then of a wrong type,
    in a copy; the check must fail with the file and the key in its message."""
    doc = load(name)
    required = {}  # generic path -> (the first path read there, its types)
    for path, types, optional in check_file(name, doc).read:
        if not optional:
            required.setdefault(generic(path), (path, types))
    assert len(required) >= 5, f"{name}: the schema requires only {sorted(required)}"
    for path, types in required.values():
        for mutate in ("delete", "retype"):
            bad = copy.deepcopy(doc)
            if mutate == "delete":
                del at(bad, path)[path[-1]]
                expect = (f"{_dotted(path[:-1])} has no key {path[-1]!r}" if len(path) > 1
                          else f"no key {path[-1]!r}")
            else:
                at(bad, path)[path[-1]] = wrong_value(types)
                expect = f"{_dotted(path)} must be"
            with pytest.raises(SchemaError) as err:
                check_file(name, bad)
            assert f"results/{name}: " in str(err.value) and expect in str(err.value), (mutate, path,
                                                                                        str(err.value))


def test_a_file_no_schema_covers_fails():
    for name in ("throughput.json", "throughput-pentium.json", "spec-draft-avx2.json", "new_result.json",
                 "notes.txt"):
        with pytest.raises(SchemaError, match=re.escape(f"results/{name} has no schema")):
            schema_for(name)


def test_the_retired_avx2_run_fails_its_schema():
    """results/throughput-avx2.json predated the C++ operators: its environment had no cpu_model (notebook
    05 raised KeyError on AVX2 machines) and no radarlab_torch system. The schema names both."""
    doc = load(kept_by_kind("throughput")["avx512_bf16"].name)
    old = copy.deepcopy(doc)
    old["environment"] = {k: v for k, v in doc["environment"].items() if not k.startswith("cpu_")} | {
        "cpu_capability": "AVX2", "cpu_native_bf16": False}
    with pytest.raises(SchemaError,
                       match=r"results/throughput-avx2.json: environment has no key 'cpu_model'"):
        check_file("throughput-avx2.json", old)
    old = copy.deepcopy(doc)
    old["results"] = [r for r in doc["results"] if r["system"] != "radarlab_torch"]
    with pytest.raises(SchemaError, match=r"results lacks \[\('radarlab_torch'"):
        check_file("throughput-avx512_bf16.json", old)


def test_a_throughput_run_must_record_the_fp32_rule_its_vendor_gives():
    doc = load(kept_by_kind("throughput")["avx512_bf16_amx"].name)
    assert doc["environment"]["cpu_vendor"] == "GenuineIntel" and doc["environment"]["fp32_gemv_rows"] == 4
    wrong = copy.deepcopy(doc)
    wrong["environment"]["fp32_gemv_rows"] = 0
    with pytest.raises(SchemaError, match="fp32_gemv_rows is 0, but the rule gives 4 on a GenuineIntel CPU"):
        check_file("throughput-avx512_bf16_amx.json", wrong)
    del wrong["environment"]["cpu_vendor"]
    with pytest.raises(SchemaError, match="environment has no key 'cpu_vendor'"):
        check_file("throughput-avx512_bf16_amx.json", wrong)


def test_a_file_named_for_another_cpu_kind_fails():
    path = kept_by_kind("spec")["avx512_bf16"]
    with pytest.raises(SchemaError,
                       match="environment.cpu_kind is 'avx512_bf16', but the file is "
                             "named for CPU kind 'avx2'"):
        check_file("spec-avx2.json", load(path.name))


def test_the_readme_must_describe_every_file():
    text = load("README.md")
    check_readme(Reader("README.md"), text, results_dir())
    with pytest.raises(SchemaError, match=r"results/README.md: does not describe latency.json"):
        check_readme(Reader("README.md"), text.replace("`latency.json`", "the latency sweep"), results_dir())


# --- the choice of a kept run, on every kind of CPU ----------------------------------------------
@pytest.mark.parametrize("kind", cpu_kinds())
@pytest.mark.parametrize("prefix, module", [("throughput", throughput), ("spec", speculation),
                                            ("validate-fp8", vllm_fp8)], ids=["05", "08_09", "06"])
def test_the_notebooks_choice_of_a_kept_run_on_every_cpu_kind(kind, prefix, module, monkeypatch):
    """What notebooks 05 (throughput), 06 (FP8 validation), 08 and 09 (spec) show on a CPU of this kind:
    the same call, with this machine made that kind, then the readers on the run chosen."""
    monkeypatch.setenv("RADARLAB_CPU_KIND", kind)
    assert cpu_kind() == kind
    path, doc, note = module.full_run(cpu_kind())
    kept = kept_by_kind(prefix)
    assert kept, f"results/ keeps no {prefix}-KIND.json at all"
    if kind in kept:
        assert note is None and path == kept[kind]
    else:
        shown = next(iter(kept))  # the first kept kind in cpu_kinds() order, whatever this machine is
        assert path == kept[shown]
        assert f"This CPU is of kind {kind!r}" in note and f"from a CPU of kind {shown!r}" in note
        assert "Only its ratios compare with this machine" in note and f"{prefix}-{kind}.json" in note
    check_file(path.name, doc)
    run_readers(path.name, path, doc)


def test_choose_kept_run_prefers_this_kind_then_the_first_kept_kind(tmp_path):
    def keep(name, kind):
        (tmp_path / name).write_text(json.dumps({"kind": kind}))

    path, doc, note = choose_kept_run("spec", "avx2", "speculative-decoding", "Run it.", tmp_path)
    assert (path, doc) == (None, None)
    assert note == ("This CPU is of kind 'avx2', and results/ keeps no "
                    "speculative-decoding run from any kind of CPU. Run it.")
    keep("spec-aarch64.json", "aarch64")
    keep("spec-avx512.json", "avx512")
    keep("spec-draft-avx2.json", "not a kind")  # PREFIX-KIND.json only
    path, doc, note = choose_kept_run("spec", "avx2", "speculative-decoding", "Run it.", tmp_path)
    # x86 kinds come first in cpu_kinds()
    assert path.name == "spec-avx512.json" and doc == {"kind": "avx512"}
    assert "the run shown, spec-avx512.json, is from a CPU of kind 'avx512'" in note
    assert note.endswith("Run it.")
    keep("spec-avx2.json", "avx2")
    assert choose_kept_run("spec", "avx2", "x", "y", tmp_path) == (tmp_path / "spec-avx2.json",
                                                                   {"kind": "avx2"}, None)
    assert list(kept_by_kind("spec", tmp_path)) == ["avx2", "avx512", "aarch64"]


def test_full_run_refuses_a_kind_that_is_no_file_name():
    with pytest.raises(ValueError, match="kind"):
        throughput.full_run("../avx2")
