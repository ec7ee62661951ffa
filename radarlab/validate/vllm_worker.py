"""Run vLLM offline on one JSON request and print one JSON response. Runs in vLLM's own venv.

Why a separate script: vLLM pins its own torch and transformers, so it lives in .venv-vllm and the
course talks to it only through this process (radarlab/validate/vllm.py starts it). It must not
import radarlab, which is not installed there.

    .venv-vllm/bin/python radarlab/validate/vllm_worker.py < request.json > response.json

Three kinds of request, picked by "kind" ("generate" when absent):
- "generate": an LLM engine generates for prompts (fields below);
- "attention_op": vLLM's CPU paged-attention ops on tensors read from a file (further below);
- "session": {"version": 1, "kind": "session", "requests": [request, ...]} runs several requests
  in this one process, in order, so vLLM is imported once (at most one may be "generate": one
  engine per process). Response: {"ok": true, "vllm_version", "device", "request",
  "responses": [one response per request, as if sent alone]}.

Generate request (JSON object; only "model" and "prompts" or "batches" are required):
    version                  1 (the request format; bump when it changes incompatibly)
    kind                     "generate"                                        (default)
    model                    HF model directory (or id)
    prompts                  [[token ids], ...]: one generate() call for all of them
    batches                  [[[token ids], ...], ...]: several generate() calls in order, on one
                             engine, with a metrics snapshot after each (e.g. prefix-cache warm-up)
    dtype                    "float32" | "bfloat16" | "float16" | "auto"      (default "float32")
    max_tokens               new tokens per prompt                             (default 64)
    batch_max_tokens         one max_tokens per batch, overriding max_tokens   (default null)
    logprobs                 top-k logprobs per generated position, 0 for none (default 5)
    prompt_logprobs          top-k logprobs per prompt position, or null       (default null)
    temperature              0 is greedy                                       (default 0.0)
    top_p, top_k             sampling filters                                  (default 1.0, -1)
    seed                     engine seed and per-request sampling seed         (default 0)
    ignore_eos               keep generating past EOS                          (default false)
    kv_cache_dtype           "auto" | "fp8" | "fp8_e4m3" | "fp8_e5m2"          (default "auto")
    block_size               KV block size in tokens, or null for vLLM's       (default null)
    enable_prefix_caching    true/false, or null for vLLM's default            (default null)
    speculative_config       dict passed to LLM(speculative_config=...)        (default null)
                             (the CPU build runs "ngram" and "draft_model"; the counters
                             vllm:spec_decode_* then appear in each batch's metrics)
    max_model_len            context limit; on CPU at most 2048                (default 2048)
    max_num_seqs             scheduler batch limit, or null                    (default null)
    enforce_eager            true: run the model eagerly (starts in seconds); false: vLLM's
                             default mode, the model compiled by torch.compile (Inductor), as
                             users run it (minutes of start-up on a CPU)    (default true)
    kv_cache_memory_bytes    KV cache size                                     (default 1 GiB on CPU)
    gpu_memory_utilization   CUDA only, when kv_cache_memory_bytes is null     (default 0.5)
    llm_kwargs               extra LLM(...) keyword arguments, for what the fields above miss
    sampling_kwargs          extra SamplingParams(...) keyword arguments

Response: {"ok": true, "vllm_version", "device", "request": <the request with defaults filled in>,
"outputs": [{"token_ids": [...], "finish_reason", "logprobs": [{token_id: logprob}, ...] | null,
"prompt_logprobs": [null | {token_id: logprob}, ...] | null, "num_cached_tokens": prompt tokens
served from the prefix cache}, ...] (all batches, in order),
"batches": [{"num_prompts", "generate_s", "metrics"}], "metrics": {...}, "init_s" (engine start-up,
compilation included), "generate_s", "compilation": {"enforce_eager", "mode", "backend",
"cudagraph_mode"} (vLLM's compilation settings as the engine resolved them; the compile time is in
init_s: vLLM's CPU worker does not count it apart),
"kv_cache": {"kv_cache_dtype", "block_size", "num_blocks", "num_layers", "bytes", "bytes_per_block",
"tensors": [{"shape", "dtype"}] (one layer's), "isa", "cpu", "extension"} | null}: the cache vLLM
allocated, read from the worker's own tensors (bytes_per_block counts every layer's K and V), and
on the CPU build the attention kernel its layers run ("isa"); null where it cannot be read.
Token ids in logprob dicts are JSON strings. Metrics are llm.get_metrics() flattened to
name -> number (counters, gauges; summed over labels), list (vectors) or {"count","sum"} (histograms).

Attention-op request: {"version": 1, "kind": "attention_op", "inputs": PATH, "outputs": PATH,
"isa": "auto"}. PATH inputs is a torch.save'd list of cases, each a dict:
    query [T, H, D]  key, value [N, Hkv, D] (float32 | bfloat16 | float16, all one dtype)
    slot_mapping [N] (where key[i], value[i] go; -1 skips)   block_size, num_blocks (ints)
    block_table [B, max_blocks]   seq_lens [B]   query_start_loc [B+1]   scale (float)
    isa (optional str): this case's kernel, overriding the request's "isa"
For each case the worker makes an empty cache of num_blocks blocks in vLLM's CPU layout, writes
key/value with cpu_attn_reshape_and_cache, builds the scheduler metadata as vLLM's
CPUAttentionMetadataBuilder does (causal, no sliding window) and runs cpu_attention_with_kv_cache.
The outputs [T, H, D] are torch.save'd as a list to PATH outputs; the response is {"ok": true,
"vllm_version", "device", "request", "cases": [{"isa", "requested", "shape"}, ...] ("isa" is the
kernel that ran, "requested" what the request or case asked for), "cpu": {"arch", "flags"},
"extension", "run_s"}. "flags" are the x86 flags below as /proc/cpuinfo lists them; "extension" is
the vLLM library current_platform.import_kernels() loaded ("_C", "_C_AVX512", "_C_AVX2"; null when
it cannot be told). The key cache's layout inside a block depends on the ISA (for "vec" each head's
keys are stored transposed, [D, block_size]), which is why cases carry the new K/V rather than a
filled cache. CPU build only.

The ISA ("isa"): "auto" is vLLM's own choice (_get_attn_isa, as the engine makes it), or one of
vLLM's CPU attention kernels, which need (vLLM 0.32, cpu_attn.py and the C++ kernels behind it):
    isa     CPU                                          dtypes              block_size, head_dim
    vec     any; on x86 avx2                             fp32, bf16, fp16    multiples of 32
    vec16   any; on x86 avx2                             fp32, bf16, fp16    multiples of 16
    amx     x86 with avx512f, avx512_bf16, amx_tile,     bf16                multiples of 32
            amx_bf16 (its kernels are built into _C only, the library loaded with AVX512-BF16)
    neon, vxe, vsx, rvv   aarch64, s390x, ppc64le, riscv64 only; their limits are left to vLLM
vLLM's auto choice: vec16 when head_dim is a multiple of 16 but not 32; else amx for bf16 with
block_size % 32 == 0 where torch sees amx_tile; else (on x86) vec when block_size % 32 == 0, vec16
otherwise. An ISA this CPU cannot run, or inputs it does not take, are refused with BadRequest naming
the missing flag or the field, before any vLLM op runs: a kernel built for instructions the CPU lacks
dies with SIGILL, not an error. Before an amx kernel runs, the worker asks Linux for AMX tile state
(see _enable_amx).

On failure: {"ok": false, "error": "..."} on stdout, the traceback on stderr, exit status 1.
vLLM's own logging goes to stderr; stdout carries only the response.
"""
from __future__ import annotations

import functools
import json
import os
import platform
import re
import sys
import time
import traceback

# This file sits next to radarlab/validate/vllm.py, and Python puts a script's own folder first on
# sys.path, so `import vllm` would find that module instead of the vLLM package. Drop the folder.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

FORMAT_VERSION = 1
DEFAULTS = {
    "version": FORMAT_VERSION,
    "kind": "generate",
    "model": None,
    "prompts": None,
    "batches": None,
    "dtype": "float32",
    "max_tokens": 64,
    "batch_max_tokens": None,
    "logprobs": 5,
    "prompt_logprobs": None,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "seed": 0,
    "ignore_eos": False,
    "kv_cache_dtype": "auto",
    "block_size": None,
    "enable_prefix_caching": None,
    "speculative_config": None,
    "max_model_len": 2048,
    "max_num_seqs": None,
    "enforce_eager": True,
    "kv_cache_memory_bytes": None,
    "gpu_memory_utilization": 0.5,
    "llm_kwargs": {},
    "sampling_kwargs": {},
}
ATTENTION_OP_DEFAULTS = {"version": FORMAT_VERSION, "kind": "attention_op", "inputs": None, "outputs": None,
                         "isa": "auto"}
SESSION_DEFAULTS = {"version": FORMAT_VERSION, "kind": "session", "requests": None}
KINDS = ("generate", "attention_op", "session")
DTYPES = {"float32", "bfloat16", "float16", "auto"}
KV_CACHE_DTYPES = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
CPU_MAX_MODEL_LEN = 2048  # what was seen working with the CPU build
CPU_KV_CACHE_BYTES = 1 << 30

# vLLM's CPU attention kernels and what each needs (the table in the docstring). radarlab keeps the
# same rules in radarlab/lab/machine.py, but this script runs in vLLM's environment and cannot
# import radarlab; tests/lab/test_machine.py checks that the two copies agree.
_ALL_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_ISAS = {
    "vec": {"arch": None, "x86_flags": ("avx2",), "dtypes": _ALL_DTYPES, "block_multiple": 32,
            "head_multiple": 32},
    "vec16": {"arch": None, "x86_flags": ("avx2",), "dtypes": _ALL_DTYPES, "block_multiple": 16,
              "head_multiple": 16},
    "amx": {"arch": "x86_64", "x86_flags": ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16"),
            "dtypes": ("bfloat16",), "block_multiple": 32, "head_multiple": 32},
    "neon": {"arch": "aarch64", "x86_flags": (), "dtypes": None, "block_multiple": None,
             "head_multiple": None},
    "vxe": {"arch": "s390x", "x86_flags": (), "dtypes": None, "block_multiple": None, "head_multiple": None},
    "vsx": {"arch": "ppc64le", "x86_flags": (), "dtypes": None, "block_multiple": None,
            "head_multiple": None},
    "rvv": {"arch": "riscv64", "x86_flags": (), "dtypes": None, "block_multiple": None,
            "head_multiple": None},
}
ISA_CHOICES = ("auto", *ATTENTION_ISAS)
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16", "amx_int8")


class BadRequest(ValueError):
    """The request is malformed; the message names the field."""


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_prompts(prompts, where: str) -> None:
    if not isinstance(prompts, list) or not prompts:
        raise BadRequest(f"{where} must be a non-empty list of token-id lists")
    for i, p in enumerate(prompts):
        if not isinstance(p, list) or not p:
            raise BadRequest(f"{where}[{i}] must be a non-empty list of token ids")
        if not all(_is_int(t) and t >= 0 for t in p):
            raise BadRequest(f"{where}[{i}] must hold non-negative integer token ids")


def normalize(request) -> dict:
    """Fill in defaults and reject anything malformed, before paying for vLLM's start-up."""
    if not isinstance(request, dict):
        raise BadRequest(f"the request must be a JSON object, got {type(request).__name__}")
    kind = request.get("kind", "generate")
    if kind not in KINDS:
        raise BadRequest(f"kind must be one of {list(KINDS)}, got {kind!r}")
    if kind == "attention_op":
        return _normalize_attention_op(request)
    if kind == "session":
        return _normalize_session(request)
    return _normalize_generate(request)


def _check_fields(request: dict, defaults: dict) -> dict:
    unknown = sorted(set(request) - set(defaults))
    if unknown:
        raise BadRequest(f"unknown request fields {unknown}; known: {sorted(defaults)}")
    req = {**defaults, **request}
    if req["version"] != FORMAT_VERSION:
        raise BadRequest(f"version must be {FORMAT_VERSION}, got {req['version']!r}")
    return req


def _normalize_attention_op(request: dict) -> dict:
    req = _check_fields(request, ATTENTION_OP_DEFAULTS)
    for name in ("inputs", "outputs"):
        if not isinstance(req[name], str) or not req[name]:
            raise BadRequest(f"{name} must be a file path (a non-empty string), got {req[name]!r}")
    _check_isa(req["isa"], "isa")
    return req


# --- the CPU: a minimal copy of radarlab.lab.machine's reader (radarlab is not importable here) ---
def _parse_cpu_flags(text: str) -> dict:
    """CPU_FLAGS -> bool from /proc/cpuinfo text: the first "flags" (x86) or "Features" line."""
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip().lower() in ("flags", "features"):
            words = set(value.split())
            return {f: f in words for f in CPU_FLAGS}
    return {f: False for f in CPU_FLAGS}


@functools.lru_cache(maxsize=1)
def _cpu() -> dict:
    """{"arch", "flags"} of this machine: /proc/cpuinfo, else torch's capability map (macOS)."""
    arch = platform.machine().lower()
    arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    try:
        with open("/proc/cpuinfo", errors="replace") as f:
            flags = _parse_cpu_flags(f.read())
    except OSError:
        import torch

        caps = torch._C._cpu._get_cpu_capability()
        flags = {f: bool(caps.get("avx512_f" if f == "avx512f" else f, False)) for f in CPU_FLAGS}
    return {"arch": arch, "flags": flags}


def isa_missing(isa: str, flags: dict, arch: str) -> list:
    """What a CPU with these flags and architecture lacks for attention kernel `isa` (empty: nothing)."""
    rule = ATTENTION_ISAS[isa]
    if rule["arch"] is not None and rule["arch"] != arch:
        return [f"{rule['arch']} (this CPU is {arch})"]
    if arch != "x86_64":
        return []
    return [f for f in rule["x86_flags"] if not flags.get(f, False)]


def _check_isa(isa, where: str) -> None:
    """BadRequest unless isa is "auto" or a kernel this CPU can run; the message names what is missing."""
    if not isinstance(isa, str) or isa not in ISA_CHOICES:
        raise BadRequest(f"{where} must be one of {list(ISA_CHOICES)}, got {isa!r}")
    if isa == "auto":
        return
    cpu = _cpu()
    missing = isa_missing(isa, cpu["flags"], cpu["arch"])
    if missing:
        can = [i for i in ATTENTION_ISAS if not isa_missing(i, cpu["flags"], cpu["arch"])]
        sigill = " Running it would die with SIGILL (illegal instruction)." if cpu["arch"] == "x86_64" else ""
        raise BadRequest(f"{where}: vLLM's {isa!r} attention kernel needs "
                         f"{', '.join(missing)}, which this CPU lacks; it can run {can}.{sigill}")


def _check_isa_fits(isa: str, dtype: str, block_size: int, head_dim: int, where: str) -> None:
    """BadRequest unless kernel `isa` takes this dtype, block size and head size (None in the table:
    left to vLLM)."""
    rule = ATTENTION_ISAS[isa]
    if rule["dtypes"] is not None and dtype not in rule["dtypes"]:
        raise BadRequest(f"{where}: the {isa!r} kernel takes {', '.join(rule['dtypes'])} only, got {dtype}")
    for name, value, multiple in (("block_size", block_size, rule["block_multiple"]),
                                  ("head_dim", head_dim, rule["head_multiple"])):
        if multiple is not None and value % multiple:
            raise BadRequest(f"{where}: the {isa!r} kernel needs {name} a multiple "
                             f"of {multiple}, got {value}")


def _normalize_session(request: dict) -> dict:
    req = _check_fields(request, SESSION_DEFAULTS)
    subs = req["requests"]
    if not isinstance(subs, list) or not subs:
        raise BadRequest("requests must be a non-empty list of requests")
    out = []
    for i, sub in enumerate(subs):
        if isinstance(sub, dict) and sub.get("kind") == "session":
            raise BadRequest(f"requests[{i}] is a session; sessions do not nest")
        try:
            out.append(normalize(sub))
        except BadRequest as exc:
            raise BadRequest(f"requests[{i}]: {exc}") from None
    if sum(r["kind"] == "generate" for r in out) > 1:
        raise BadRequest("a session may hold at most one generate request (one engine per process)")
    return {**req, "requests": out}


def _normalize_generate(request: dict) -> dict:
    req = _check_fields(request, DEFAULTS)
    if not isinstance(req["model"], str) or not req["model"]:
        raise BadRequest("model must be a model directory or id (a non-empty string)")
    if (req["prompts"] is None) == (req["batches"] is None):
        raise BadRequest("give exactly one of prompts (one batch) or batches (several, in order)")
    if req["prompts"] is not None:
        _check_prompts(req["prompts"], "prompts")
    else:
        if not isinstance(req["batches"], list) or not req["batches"]:
            raise BadRequest("batches must be a non-empty list of prompt lists")
        for b, batch in enumerate(req["batches"]):
            _check_prompts(batch, f"batches[{b}]")
    if req["dtype"] not in DTYPES:
        raise BadRequest(f"dtype must be one of {sorted(DTYPES)}, got {req['dtype']!r}")
    if req["kv_cache_dtype"] not in KV_CACHE_DTYPES:
        raise BadRequest(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got "
                         f"{req['kv_cache_dtype']!r}")
    for name in ("max_tokens", "max_model_len"):
        if not _is_int(req[name]) or req[name] <= 0:
            raise BadRequest(f"{name} must be a positive integer, got {req[name]!r}")
    for name in ("block_size", "max_num_seqs", "kv_cache_memory_bytes"):
        if req[name] is not None and (not _is_int(req[name]) or req[name] <= 0):
            raise BadRequest(f"{name} must be a positive integer or null, got {req[name]!r}")
    if not _is_int(req["logprobs"]) or req["logprobs"] < 0:
        raise BadRequest(f"logprobs must be a non-negative integer, got {req['logprobs']!r}")
    if req["prompt_logprobs"] is not None and (not _is_int(req["prompt_logprobs"])
                                               or req["prompt_logprobs"] < 0):
        raise BadRequest("prompt_logprobs must be a non-negative integer or null, got "
                         f"{req['prompt_logprobs']!r}")
    if not isinstance(req["temperature"], (int, float)) or isinstance(req["temperature"],
                                                                      bool) or req["temperature"] < 0:
        raise BadRequest(f"temperature must be a number >= 0, got {req['temperature']!r}")
    if not _is_int(req["seed"]):
        raise BadRequest(f"seed must be an integer, got {req['seed']!r}")
    for name in ("ignore_eos", "enforce_eager"):
        if not isinstance(req[name], bool):
            raise BadRequest(f"{name} must be true or false, got {req[name]!r}")
    if req["enable_prefix_caching"] is not None and not isinstance(req["enable_prefix_caching"], bool):
        raise BadRequest("enable_prefix_caching must be true, false or null, got "
                         f"{req['enable_prefix_caching']!r}")
    if req["speculative_config"] is not None and not isinstance(req["speculative_config"], dict):
        raise BadRequest("speculative_config must be an object (dict) or null")
    for name in ("llm_kwargs", "sampling_kwargs"):
        if not isinstance(req[name], dict):
            raise BadRequest(f"{name} must be an object (dict)")
    util = req["gpu_memory_utilization"]
    if not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise BadRequest(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    per_batch = req["batch_max_tokens"]
    if per_batch is not None:
        if not isinstance(per_batch, list) or len(per_batch) != len(_batches(req)):
            raise BadRequest("batch_max_tokens must be a list with one entry per "
                             f"batch ({len(_batches(req))}), got {per_batch!r}")
        if not all(_is_int(n) and n > 0 for n in per_batch):
            raise BadRequest(f"batch_max_tokens must hold positive integers, got {per_batch!r}")
    for b, batch in enumerate(_batches(req)):
        max_tokens = req["max_tokens"] if per_batch is None else per_batch[b]
        longest = max(len(p) for p in batch)
        if longest + max_tokens > req["max_model_len"]:
            raise BadRequest(
                f"the longest prompt has {longest} tokens; with max_tokens={max_tokens} it needs "
                f"{longest + max_tokens} positions, more than max_model_len={req['max_model_len']}"
            )
    return req


def _batches(req: dict) -> list:
    return [req["prompts"]] if req["prompts"] is not None else req["batches"]


def _logprob_dicts(positions) -> list | None:
    """vLLM's per-position {token_id: Logprob} (or its flat container) as [{str(id): float}]."""
    if positions is None:
        return None
    out = []
    for pos in positions:
        if pos is None:  # the first prompt position has no logprob
            out.append(None)
            continue
        out.append({str(int(tok)): float(getattr(lp, "logprob", lp)) for tok, lp in pos.items()})
    return out


def _metrics(llm) -> dict:
    """llm.get_metrics() flattened; counters summed over their labels (one engine here)."""
    try:
        metrics = llm.get_metrics()
    except Exception as exc:  # noqa: BLE001 - metrics are optional extras, never fatal
        print(f"[vllm_worker] get_metrics() failed: {exc!r}", file=sys.stderr)
        return {}
    flat: dict = {}
    for m in metrics:
        name = m.name
        if hasattr(m, "values"):  # Vector, e.g. accepted tokens per speculative position
            vals = [float(v) for v in m.values]
            prev = flat.get(name)
            flat[name] = vals if prev is None else [a + b for a, b in zip(prev, vals)]
        elif hasattr(m, "buckets") or hasattr(m, "count"):  # Histogram
            prev = flat.get(name) or {"count": 0.0, "sum": 0.0}
            flat[name] = {"count": prev["count"] + float(m.count), "sum": prev["sum"] + float(m.sum)}
        elif hasattr(m, "value"):  # Counter, Gauge
            flat[name] = flat.get(name, 0.0) + float(m.value)
    return flat


def run(req: dict) -> dict:
    """Run one normalized request of any kind."""
    # vLLM configures its logger at import time, and to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    if req["kind"] == "session":
        import vllm
        from vllm.platforms import current_platform

        responses = [run(sub) for sub in req["requests"]]
        return {"ok": True, "vllm_version": vllm.__version__, "device": _device_name(current_platform),
                "request": req, "responses": responses}
    if req["kind"] == "attention_op":
        return _run_attention_op(req)
    return _run_generate(req)


def _device_name(platform) -> str:
    return "cpu" if platform.is_cpu() else platform.device_name


def _run_generate(req: dict) -> dict:
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    # vLLM reads its environment variables lazily, so settings made after the import still count.
    cuda = not current_platform.is_cpu()
    if not cuda:
        # One process: the engine core runs in this one, so stdout redirection and errors stay here.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if req["max_model_len"] > CPU_MAX_MODEL_LEN:
            raise BadRequest(f"max_model_len {req['max_model_len']} is above {CPU_MAX_MODEL_LEN}, "
                             f"the most the CPU build is run with here")

    llm_kwargs = dict(
        model=req["model"],
        dtype=req["dtype"],
        enforce_eager=req["enforce_eager"],
        max_model_len=req["max_model_len"],
        seed=req["seed"],
        kv_cache_dtype=req["kv_cache_dtype"],
        disable_log_stats=False,  # get_metrics() is empty without it
    )
    if req["kv_cache_memory_bytes"] is not None:
        llm_kwargs["kv_cache_memory_bytes"] = req["kv_cache_memory_bytes"]
    elif not cuda:
        llm_kwargs["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    else:
        llm_kwargs["gpu_memory_utilization"] = req["gpu_memory_utilization"]
    for name in ("block_size", "enable_prefix_caching", "speculative_config", "max_num_seqs"):
        if req[name] is not None:
            llm_kwargs[name] = req[name]
    llm_kwargs.update(req["llm_kwargs"])

    t0 = time.perf_counter()
    llm = LLM(**llm_kwargs)
    init_s = time.perf_counter() - t0

    def sampling_params(max_tokens: int):
        return SamplingParams(
            temperature=req["temperature"],
            top_p=req["top_p"],
            top_k=req["top_k"],
            max_tokens=max_tokens,
            logprobs=req["logprobs"] or None,
            prompt_logprobs=req["prompt_logprobs"],
            seed=req["seed"],
            ignore_eos=req["ignore_eos"],
            **req["sampling_kwargs"],
        )

    outputs, batches, total = [], [], 0.0
    for b, prompts in enumerate(_batches(req)):
        max_tokens = req["max_tokens"] if req["batch_max_tokens"] is None else req["batch_max_tokens"][b]
        params = sampling_params(max_tokens)
        t0 = time.perf_counter()
        results = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        dt = time.perf_counter() - t0
        total += dt
        for r in results:
            c = r.outputs[0]
            outputs.append({
                "token_ids": [int(t) for t in c.token_ids],
                "finish_reason": c.finish_reason,
                "logprobs": _logprob_dicts(c.logprobs) if req["logprobs"] else None,
                "prompt_logprobs": _logprob_dicts(r.prompt_logprobs),
                "num_cached_tokens": r.num_cached_tokens,
            })
        batches.append({"num_prompts": len(prompts), "generate_s": dt, "metrics": _metrics(llm)})
    return {
        "ok": True,
        "vllm_version": vllm.__version__,
        "device": current_platform.device_name if cuda else "cpu",
        "request": req,
        "kv_cache": _kv_cache_info(llm, cuda),
        "outputs": outputs,
        "batches": batches,
        "metrics": batches[-1]["metrics"],
        "init_s": init_s,
        "generate_s": total,
        "compilation": _compilation(llm, req["enforce_eager"]),
    }


def _enum_name(value) -> str | None:
    return None if value is None else getattr(value, "name", str(value))


def _compilation(llm, enforce_eager: bool) -> dict:
    """How vLLM ran the model: its compilation settings after the engine resolved them (with
    enforce_eager the mode is NONE)."""
    config = llm.llm_engine.vllm_config.compilation_config
    return {"enforce_eager": enforce_eager, "mode": _enum_name(config.mode),
            "backend": config.backend or None,
            "cudagraph_mode": _enum_name(getattr(config, "cudagraph_mode", None))}


def _kv_cache_tensors(worker) -> list:
    """[(shape, dtype, nbytes)] of every KV cache tensor one worker allocated (one per layer)."""
    return [(list(c.shape), str(c.dtype).removeprefix("torch."), int(c.nbytes))
            for c in worker.model_runner.kv_caches]


def _kv_cache_info(llm, cuda: bool) -> dict | None:
    """The KV cache vLLM allocated: blocks, bytes, layout, and on the CPU the attention kernel (ISA)
    its layers were given for this dtype and block size. None (with a note on stderr) where the
    engine's internals cannot be reached, e.g. with the engine core in another process."""
    cache = llm.llm_engine.vllm_config.cache_config
    try:
        core = llm.llm_engine.engine_core
        core = getattr(core, "engine_core", core)  # in-process client -> the engine core itself
        tensors = core.model_executor.collective_rpc(_kv_cache_tensors)[0]
    except Exception as exc:  # noqa: BLE001 - extra information, never fatal
        print(f"[vllm_worker] could not read the KV cache tensors: {exc!r}", file=sys.stderr)
        return None
    info = {
        "kv_cache_dtype": cache.cache_dtype,
        "block_size": cache.block_size,
        "num_blocks": cache.num_gpu_blocks,
        "num_layers": len(tensors),
        "bytes": sum(n for _, _, n in tensors),
        "bytes_per_block": sum(n for _, _, n in tensors) // cache.num_gpu_blocks,
        "tensors": [{"shape": shape, "dtype": dtype} for shape, dtype, _ in tensors[:1]],
        "isa": None, "cpu": None, "extension": None,
    }
    if not cuda:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        model = llm.llm_engine.vllm_config.model_config
        info["isa"] = _get_attn_isa(model.dtype, cache.block_size, model.get_head_size(), cache.cache_dtype)
        info["cpu"], info["extension"] = _cpu(), _loaded_extension()
    return info


_CASE_TENSORS = ("query", "key", "value", "slot_mapping", "block_table", "seq_lens", "query_start_loc")


def _check_case(case, i: int, torch, isa: str = "auto") -> str:
    """BadRequest naming the field, before any C++ op sees (and maybe crashes on) a bad tensor or a
    kernel this CPU cannot run. Returns the case's ISA: its own "isa", else the request's `isa`."""
    where = f"cases[{i}]"
    if not isinstance(case, dict):
        raise BadRequest(f"{where} must be a dict, got {type(case).__name__}")
    missing = [n for n in _CASE_TENSORS + ("block_size", "num_blocks", "scale") if n not in case]
    if missing:
        raise BadRequest(f"{where} lacks {missing}")
    for n in _CASE_TENSORS:
        if not isinstance(case[n], torch.Tensor):
            raise BadRequest(f"{where}.{n} must be a tensor, got {type(case[n]).__name__}")
    q, k, v = case["query"], case["key"], case["value"]
    if (q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2]
            or q.shape[1] % k.shape[1]):
        raise BadRequest(f"{where}: query must be [T, H, D] and key, value [N, Hkv, D] "
                         f"with H a multiple of Hkv; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise BadRequest(f"{where}: query, key and value must share one of float32, bfloat16, float16; got "
                         f"{q.dtype}, {k.dtype}, {v.dtype}")
    for n in ("block_size", "num_blocks"):
        if not _is_int(case[n]) or case[n] <= 0:
            raise BadRequest(f"{where}.{n} must be a positive integer, got {case[n]!r}")
    if not isinstance(case["scale"], (int, float)) or isinstance(case["scale"],
                                                                 bool) or not case["scale"] > 0:
        raise BadRequest(f"{where}.scale must be a positive number, got {case['scale']!r}")
    num_slots = case["block_size"] * case["num_blocks"]
    slots, table, seq_lens, starts = (case[n] for n in ("slot_mapping", "block_table", "seq_lens",
                                                        "query_start_loc"))
    if slots.shape != (k.shape[0],) or bool(((slots < -1) | (slots >= num_slots)).any()):
        raise BadRequest(f"{where}.slot_mapping must hold {k.shape[0]} slots in -1..{num_slots - 1}")
    num_seqs = seq_lens.numel()
    if seq_lens.dim() != 1 or starts.shape != (num_seqs + 1,) or int(starts[-1]) != q.shape[0]:
        raise BadRequest(f"{where}: query_start_loc must be [len(seq_lens)+1] ending at T={q.shape[0]}")
    if table.dim() != 2 or table.shape[0] != num_seqs:
        raise BadRequest(f"{where}.block_table must be [len(seq_lens), max_blocks], got {tuple(table.shape)}")
    needed = -(-seq_lens.long() // case["block_size"])
    if num_seqs and int(needed.max()) > table.shape[1]:
        raise BadRequest(f"{where}.block_table has {table.shape[1]} columns; a sequence "
                         f"needs {int(needed.max())}")
    used = torch.arange(table.shape[1])[None, :] < needed[:, None]
    if bool((used & ((table < 0) | (table >= case["num_blocks"]))).any()):
        raise BadRequest(f"{where}.block_table points outside the pool of {case['num_blocks']} blocks")
    if "isa" in case:
        isa = case["isa"]
        _check_isa(isa, f"{where}.isa")
    if isa != "auto":
        _check_isa_fits(isa, str(q.dtype).removeprefix("torch."), case["block_size"], q.shape[2], where)
    return isa


def _loaded_extension() -> str | None:
    """Which of vLLM's CPU libraries this process loaded: "_C", "_C_AVX512" or "_C_AVX2" (Linux's
    /proc/self/maps; None elsewhere). import_kernels() cannot say: the AVX2 and AVX-512 libraries load
    under the module name _C, so their import raises after loading and never reaches sys.modules."""
    try:
        with open("/proc/self/maps") as f:
            maps = f.read()
    except OSError:
        return None
    found = re.findall(r"/vllm/(_C(?:_AVX512|_AVX2)?)\.[^/\s]*\.so$", maps, flags=re.MULTILINE)
    return found[0] if found else None


def _enable_amx(torch) -> None:
    """Ask Linux for AMX tile state before an amx kernel runs (asking again is harmless).

    Linux (5.16+) gives a process the AMX tile registers only after it asks, with
    arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA); the first tile instruction of a process that
    has not asked dies with SIGILL. torch.cpu._init_amx() makes that request. vLLM's engine gets it
    as a side effect (oneDNN asks before its own AMX matmuls, and linear layers run before attention),
    and vLLM's own CPU attention kernel tests and benchmarks call _init_amx() before their first
    kernel call; the ops called alone here must ask too.
    """
    if not torch.cpu._is_amx_tile_supported():
        raise BadRequest("the 'amx' attention kernel needs AMX tiles, and torch sees no amx_tile on this CPU")
    if not torch.cpu._init_amx():
        raise RuntimeError("Linux refused this process AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM, via "
                           "torch.cpu._init_amx()); a kernel older than 5.16 cannot grant it. Ask for isa "
                           "'vec' or 'vec16' instead of 'amx'.")


def _run_attention_op(req: dict) -> dict:
    """vLLM's CPU paged attention on given inputs, the way CPUAttentionBackendImpl calls it."""
    import torch

    # Every case is checked, kernels included, before vLLM is imported: a bad one fails in seconds,
    # and nothing reaches an op that could die on it.
    cases = torch.load(req["inputs"], weights_only=True)
    if not isinstance(cases, list) or not cases:
        raise BadRequest(f"inputs must hold a non-empty list of cases, got {type(cases).__name__}")
    requested = [_check_case(case, i, torch, req["isa"]) for i, case in enumerate(cases)]

    import vllm
    from vllm import envs
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        raise BadRequest("attention_op calls vLLM's CPU attention ops (cpu_attn_reshape_and_cache, "
                         "cpu_attention_with_kv_cache), which only the CPU build has")
    # Loads whichever of _C (AVX-512 with bf16), _C_AVX512 or _C_AVX2 this CPU can run, as the engine
    # does. A bare `import vllm._C` dies with SIGILL (illegal instruction) on a CPU without AVX-512.
    current_platform.import_kernels()
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    # Choose each case's kernel; vLLM's auto choice is held to the same rules as an explicit one.
    isas = []
    for i, (case, isa) in enumerate(zip(cases, requested)):
        q = case["query"]
        if isa == "auto":
            isa = _get_attn_isa(q.dtype, case["block_size"], q.shape[2], "auto")
            where = f"cases[{i}] (vLLM's auto choice {isa!r})"
            _check_isa(isa, where)
            _check_isa_fits(isa, str(q.dtype).removeprefix("torch."), case["block_size"], q.shape[2], where)
        if isa == "amx":
            _enable_amx(torch)
        isas.append(isa)

    t0 = time.perf_counter()
    outputs, info = [], []
    for case, isa, asked in zip(cases, isas, requested):
        q = case["query"].contiguous()
        num_heads, head_dim, dtype = q.shape[1], q.shape[2], q.dtype
        num_kv_heads, block_size, num_blocks = case["key"].shape[1], case["block_size"], case["num_blocks"]
        # The engine's cache: [num_blocks, num_kv_heads, block_size, 2 * head_dim], split as in forward().
        kv_cache = torch.zeros(num_blocks, num_kv_heads, block_size, 2 * head_dim, dtype=dtype)
        key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size,
                                               head_dim).chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(case["key"].contiguous(), case["value"].contiguous(), key_cache,
                                       value_cache, case["slot_mapping"].to(torch.int64), isa)
        seq_lens = case["seq_lens"].to(torch.int32)
        starts = case["query_start_loc"].to(torch.int32)
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=seq_lens.numel(), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            seq_lens=seq_lens, dtype=dtype, query_start_loc=starts, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        )
        out = torch.empty_like(q)
        ops.cpu_attention_with_kv_cache(
            query=q, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=starts,
            seq_lens=seq_lens, scale=float(case["scale"]), causal=True, alibi_slopes=None, sliding_window=-1,
            block_table=case["block_table"].to(torch.int32), softcap=0.0, scheduler_metadata=metadata,
            s_aux=None,
        )
        outputs.append(out)
        info.append({"isa": isa, "requested": asked, "shape": list(out.shape)})
    run_s = time.perf_counter() - t0
    torch.save(outputs, req["outputs"])
    return {"ok": True, "vllm_version": vllm.__version__, "device": _device_name(current_platform),
            "request": req, "cases": info, "cpu": _cpu(), "extension": _loaded_extension(), "run_s": run_s}


def main() -> int:
    # Keep the real stdout for the response and point fd 1 at stderr, so that anything vLLM, torch or
    # a C library prints lands in stderr and stdout stays one clean JSON document.
    response_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    try:
        req = normalize(json.load(sys.stdin))
        response, status = run(req), 0
    except Exception as exc:  # noqa: BLE001 - every failure becomes a JSON error plus a traceback
        traceback.print_exc(file=sys.stderr)
        response, status = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}, 1
    sys.stderr.flush()
    with os.fdopen(response_fd, "w") as out:
        json.dump(response, out)
        out.write("\n")
    return status


if __name__ == "__main__":
    sys.exit(main())
