"""Run vLLM offline on one JSON request and print one JSON response. Runs in vLLM's own venv.

Why a separate script: vLLM pins its own torch and transformers, so it lives in .venv-vllm and the
course talks to it only through this process (radarlab/validate/vllm.py starts it). It must not
import radarlab, which is not installed there.

    .venv-vllm/bin/python radarlab/validate/vllm_worker.py < request.json > response.json

Request (JSON object; only "model" and "prompts" or "batches" are required):
    version                  1 (the request format; bump when it changes incompatibly)
    model                    HF model directory (or id)
    prompts                  [[token ids], ...]: one generate() call for all of them
    batches                  [[[token ids], ...], ...]: several generate() calls in order, on one
                             engine, with a metrics snapshot after each (e.g. prefix-cache warm-up)
    dtype                    "float32" | "bfloat16" | "float16" | "auto"      (default "float32")
    max_tokens               new tokens per prompt                             (default 64)
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
    max_model_len            context limit; on CPU at most 2048                (default 2048)
    max_num_seqs             scheduler batch limit, or null                    (default null)
    kv_cache_memory_bytes    KV cache size                                     (default 1 GiB on CPU)
    gpu_memory_utilization   CUDA only, when kv_cache_memory_bytes is null     (default 0.5)
    llm_kwargs               extra LLM(...) keyword arguments, for what the fields above miss
    sampling_kwargs          extra SamplingParams(...) keyword arguments

Response: {"ok": true, "vllm_version", "device", "request": <the request with defaults filled in>,
"outputs": [{"token_ids": [...], "finish_reason", "logprobs": [{token_id: logprob}, ...] | null,
"prompt_logprobs": [null | {token_id: logprob}, ...] | null}, ...] (all batches, in order),
"batches": [{"num_prompts", "generate_s", "metrics"}], "metrics": {...}, "init_s", "generate_s"}.
Token ids in logprob dicts are JSON strings. Metrics are llm.get_metrics() flattened to
name -> number (counters, gauges; summed over labels), list (vectors) or {"count","sum"} (histograms).
On failure: {"ok": false, "error": "..."} on stdout, the traceback on stderr, exit status 1.
vLLM's own logging goes to stderr; stdout carries only the response.
"""
from __future__ import annotations

import json
import os
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
    "model": None,
    "prompts": None,
    "batches": None,
    "dtype": "float32",
    "max_tokens": 64,
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
    "kv_cache_memory_bytes": None,
    "gpu_memory_utilization": 0.5,
    "llm_kwargs": {},
    "sampling_kwargs": {},
}
DTYPES = {"float32", "bfloat16", "float16", "auto"}
KV_CACHE_DTYPES = {"auto", "fp8", "fp8_e4m3", "fp8_e5m2"}
CPU_MAX_MODEL_LEN = 2048  # what was seen working with the CPU build
CPU_KV_CACHE_BYTES = 1 << 30


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
    unknown = sorted(set(request) - set(DEFAULTS))
    if unknown:
        raise BadRequest(f"unknown request fields {unknown}; known: {sorted(DEFAULTS)}")
    req = {**DEFAULTS, **request}
    if req["version"] != FORMAT_VERSION:
        raise BadRequest(f"version must be {FORMAT_VERSION}, got {req['version']!r}")
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
        raise BadRequest(f"kv_cache_dtype must be one of {sorted(KV_CACHE_DTYPES)}, got {req['kv_cache_dtype']!r}")
    for name in ("max_tokens", "max_model_len"):
        if not _is_int(req[name]) or req[name] <= 0:
            raise BadRequest(f"{name} must be a positive integer, got {req[name]!r}")
    for name in ("block_size", "max_num_seqs", "kv_cache_memory_bytes"):
        if req[name] is not None and (not _is_int(req[name]) or req[name] <= 0):
            raise BadRequest(f"{name} must be a positive integer or null, got {req[name]!r}")
    if not _is_int(req["logprobs"]) or req["logprobs"] < 0:
        raise BadRequest(f"logprobs must be a non-negative integer, got {req['logprobs']!r}")
    if req["prompt_logprobs"] is not None and (not _is_int(req["prompt_logprobs"]) or req["prompt_logprobs"] < 0):
        raise BadRequest(f"prompt_logprobs must be a non-negative integer or null, got {req['prompt_logprobs']!r}")
    if not isinstance(req["temperature"], (int, float)) or isinstance(req["temperature"], bool) or req["temperature"] < 0:
        raise BadRequest(f"temperature must be a number >= 0, got {req['temperature']!r}")
    if not _is_int(req["seed"]):
        raise BadRequest(f"seed must be an integer, got {req['seed']!r}")
    for name in ("ignore_eos",):
        if not isinstance(req[name], bool):
            raise BadRequest(f"{name} must be true or false, got {req[name]!r}")
    if req["enable_prefix_caching"] is not None and not isinstance(req["enable_prefix_caching"], bool):
        raise BadRequest(f"enable_prefix_caching must be true, false or null, got {req['enable_prefix_caching']!r}")
    if req["speculative_config"] is not None and not isinstance(req["speculative_config"], dict):
        raise BadRequest("speculative_config must be an object (dict) or null")
    for name in ("llm_kwargs", "sampling_kwargs"):
        if not isinstance(req[name], dict):
            raise BadRequest(f"{name} must be an object (dict)")
    util = req["gpu_memory_utilization"]
    if not isinstance(util, (int, float)) or not 0 < util <= 1:
        raise BadRequest(f"gpu_memory_utilization must be in (0, 1], got {util!r}")
    longest = max(len(p) for batch in _batches(req) for p in batch)
    if longest + req["max_tokens"] > req["max_model_len"]:
        raise BadRequest(
            f"the longest prompt has {longest} tokens; with max_tokens={req['max_tokens']} it needs "
            f"{longest + req['max_tokens']} positions, more than max_model_len={req['max_model_len']}"
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
    # vLLM configures its logger at import time, and to stdout unless told otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
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
        enforce_eager=True,
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

    params = SamplingParams(
        temperature=req["temperature"],
        top_p=req["top_p"],
        top_k=req["top_k"],
        max_tokens=req["max_tokens"],
        logprobs=req["logprobs"] or None,
        prompt_logprobs=req["prompt_logprobs"],
        seed=req["seed"],
        ignore_eos=req["ignore_eos"],
        **req["sampling_kwargs"],
    )
    outputs, batches, total = [], [], 0.0
    for prompts in _batches(req):
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
            })
        batches.append({"num_prompts": len(prompts), "generate_s": dt, "metrics": _metrics(llm)})
    return {
        "ok": True,
        "vllm_version": vllm.__version__,
        "device": current_platform.device_name if cuda else "cpu",
        "request": req,
        "outputs": outputs,
        "batches": batches,
        "metrics": batches[-1]["metrics"],
        "init_s": init_s,
        "generate_s": total,
    }


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
