"""FP8 KV cache against vLLM's CPU build: the same greedy run with kv_cache_dtype fp8, fp8_e4m3 and
fp8_e5m2 on both sides, and the bytes each cache takes.

What vLLM 0.32's CPU build does with an FP8 KV cache (read from its cpu_attn backend, and measured
by writing known values through its cpu_attn_reshape_and_cache op and reading the codes back):
- it stores x / k_scale (x / v_scale) as an FP8 code in a uint8 pool, and dequantizes in attention;
- without scales in the checkpoint k_scale = v_scale = 1.0;
- the conversion rounds toward zero (every code equals the round-toward-zero encoding; |code| <= |x|),
  where CUDA's conversion instructions round to nearest even;
- it needs AVX-512 or AMX on x86 and head_dim a multiple of 32; "fp8" means E4M3.

So our side runs the same format, rounding and scale: kv_cache_dtype "<format>_rtz" at scale 1.0
(radarlab.quant.formats). One more teacher-forced pass with round-to-nearest-even shows the rounding
matters: its max |dlogprob| against vLLM is several times the round-toward-zero pass's (the kept run,
results/validate-fp8-KIND.json, which notebook 06 prints). The tokens are compared by vLLM's rule, as
vLLM's own FP8 KV tests compare them. What round toward zero leaves is larger than fp32 rounding alone
(the unquantized rows) and is not explained yet: the C++ kernel that dequantizes (cpu_attn_fp8.hpp)
ships compiled, without its source.
"""
from __future__ import annotations

from radarlab.validate.table import Row

VLLM_FP8_DTYPES = ("fp8", "fp8_e4m3", "fp8_e5m2")
NEW_TOKENS = 32
NUM_PROMPTS = 4


def ours_for(vllm_dtype: str, rounding: str = "rtz") -> str:
    """Our kv_cache_dtype for one of vLLM's: the same FP8 format with vLLM CPU's rounding (or "rne")."""
    from radarlab.quant.formats import kv_format

    if vllm_dtype not in VLLM_FP8_DTYPES:
        raise ValueError(f"vllm_dtype must be one of {VLLM_FP8_DTYPES}, got {vllm_dtype!r}")
    if rounding not in ("rtz", "rne"):
        raise ValueError(f"rounding must be 'rtz' or 'rne', got {rounding!r}")
    name = kv_format(vllm_dtype).name
    return f"{name}_rtz" if rounding == "rtz" else name


def run_vllm_fp8(prompts, vllm_dtype: str, max_new_tokens: int = NEW_TOKENS, k: int = 5,
                 timeout=None) -> dict:
    """vLLM greedy in fp32 with an FP8 KV cache: tokens, top-k logprobs and the cache it allocated."""
    from radarlab.validate.vllm import DEFAULT_TIMEOUT, greedy_request, run_vllm

    ours_for(vllm_dtype)  # ValueError for a dtype that is not vLLM's FP8
    request = greedy_request(prompts, max_new_tokens, k, "float32", kv_cache_dtype=vllm_dtype)
    return run_vllm(request, timeout=timeout or DEFAULT_TIMEOUT)


def bytes_row(model, vllm_dtype: str, response: dict) -> Row:
    """vLLM's allocated cache bytes per token (blocks x bytes per block / tokens) against the calculator."""
    from radarlab.device import cpu_kind
    from radarlab.kvcache.memory import kv_bytes_per_token

    cfg = model.config
    kv = response.get("kv_cache")
    ref = f"vLLM {response['vllm_version']} ({response['device']})"
    check = f"KV cache bytes per token, kv_cache_dtype={vllm_dtype}"
    ours = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, ours_for(vllm_dtype))
    if kv is None:
        return Row(check, ref, "vLLM's cache could not be read", f"= calculator ({ours} B)", False)
    theirs = kv["bytes_per_block"] / kv["block_size"]
    details = {"isa": kv["isa"],
               "cpu_kind": cpu_kind(kv["cpu"]["flags"], kv["cpu"]["arch"]) if kv["cpu"] else None,
               "num_blocks": kv["num_blocks"], "bytes": kv["bytes"], "bytes_per_block": kv["bytes_per_block"],
               "block_size": kv["block_size"], "tensor": kv["tensors"][0] if kv["tensors"] else None}
    return Row(check, ref, f"vLLM {theirs:g} B ({kv['num_blocks']} blocks x {kv['bytes_per_block']} B / "
               f"{kv['block_size']} tokens), calculator {ours} B", "equal", theirs == ours, details)


def greedy_rows(model, prompts, vllm_dtype: str, response: dict, ours: list[list[int]],
                k: int = 5) -> list[Row]:
    """Our greedy tokens (FP8 cache, vLLM CPU's rounding, scale 1.0) against vLLM's by vLLM's rule, with
    max |dlogprob| where the contexts match; and the same logprobs with round-to-nearest-even."""
    from radarlab.validate.vllm_paged import compare_greedy_outputs

    kv = response.get("kv_cache") or {}
    ref = f"vLLM {response['vllm_version']} ({response['device']}, isa {kv.get('isa')})"
    theirs = response["outputs"]
    results, dlp = compare_greedy_outputs(model, prompts, ours, theirs, k, ours_for(vllm_dtype, "rtz"))
    _, dlp_rne = compare_greedy_outputs(model, prompts, ours, theirs, k, ours_for(vllm_dtype, "rne"))
    matched = sorted(r.matched for r in results)
    n = len(theirs[0]["token_ids"])
    details = {"isa": kv.get("isa"), "ours": ours_for(vllm_dtype), "k_scale": 1.0, "v_scale": 1.0,
               "max_dlogprob_rtz": dlp, "max_dlogprob_rne": dlp_rne}
    return [
        Row(f"greedy, kv_cache_dtype={vllm_dtype} (ours {ours_for(vllm_dtype)}, scale 1.0), "
            f"{len(prompts)} prompts x {n}",
            ref,
            f"{sum(r.identical for r in results)}/{len(prompts)} identical, matched "
            f"{matched[0]}-{matched[-1]}, max |dlogprob| {dlp:.1e}",
            f"vLLM rule (top-{k}), as vLLM's own FP8 KV tests compare",
            all(r.passed for r in results), details),
        Row(f"rounding, kv_cache_dtype={vllm_dtype}: round toward zero vs to nearest even", ref,
            f"max |dlogprob| rtz {dlp:.1e}, rne {dlp_rne:.1e}", "rtz closer (vLLM's CPU rounding)",
            dlp < dlp_rne, details),
    ]


def rows(model, prompts, max_new_tokens: int = NEW_TOKENS, k: int = 5, block_size: int = 16,
         dtypes=VLLM_FP8_DTYPES, timeout=None) -> list[Row]:
    """For each of vLLM's FP8 KV dtypes: one vLLM run, the bytes row and the greedy and rounding rows."""
    from radarlab.models.paged_runner import paged_greedy_generate
    from radarlab.validate.vllm import VLLMError

    prompts = prompts[:NUM_PROMPTS]
    out = []
    for vllm_dtype in dtypes:
        try:
            response = run_vllm_fp8(prompts, vllm_dtype, max_new_tokens, k, timeout)
        except VLLMError as exc:  # e.g. a CPU without AVX-512: vLLM says why, and the row records it
            out.append(Row(f"kv_cache_dtype={vllm_dtype}", "vLLM",
                           f"vLLM refused: {str(exc).splitlines()[0]}", "runs", False))
            continue
        ours = paged_greedy_generate(model, prompts, max_new_tokens, block_size=block_size,
                                     kv_cache_dtype=ours_for(vllm_dtype))
        out += [bytes_row(model, vllm_dtype, response)] + greedy_rows(model, prompts, vllm_dtype, response,
                                                                      ours, k)
    return out


# --- the kept run notebook 06 shows: results/validate-fp8-KIND.json ------------------------------
KEPT_PREFIX = "validate-fp8"


def full_run(kind: str, folder=None) -> tuple:
    """(path, doc, sentence): the kept FP8 rows (`python -m radarlab.validate --sections fp8 --json ...`)
    notebook 06 shows on a CPU of this kind, or another kind's with a sentence saying so. vLLM's CPU
    build runs an FP8 cache only with AVX-512 or AMX, so other kinds always show another kind's."""
    from radarlab.device import cpu_kinds
    from radarlab.lab.kept_runs import choose_kept_run

    if kind not in cpu_kinds():
        raise ValueError(f"kind must be one of {cpu_kinds()}, got {kind!r}")
    name = f"results/{KEPT_PREFIX}-{kind}.json"
    how = (f"`python -m radarlab.validate --sections fp8 --json {name}` writes one on this CPU."
           if kind.startswith("avx512") else
           f"vLLM's CPU build runs an FP8 KV cache only with AVX-512 or AMX, so no {name} can be made here.")
    return choose_kept_run(KEPT_PREFIX, kind, "FP8 validation", how, folder)


def rounding_by_dtype(doc: dict) -> dict[str, tuple[float, float]]:
    """{vLLM dtype: (max |dlogprob| with round toward zero, with round to nearest even)} from a kept
    run's rounding rows: the same vLLM outputs scored against our cache under each rounding."""
    out = {}
    for row in doc["rows"]:
        if row["check"].startswith("rounding, kv_cache_dtype="):
            dtype = row["check"].split("kv_cache_dtype=")[1].split(":")[0]
            out[dtype] = (row["details"]["max_dlogprob_rtz"], row["details"]["max_dlogprob_rne"])
    return out


def format_kept_rows(path, doc: dict) -> str:
    """A kept FP8 validation as notebook 06 prints it: the machine, then each row's check, measured
    figure and result."""
    m = doc["machine"]
    rows = [r for r in doc["rows"] if "kv_cache_dtype=" in r["check"]]
    refs = sorted({r["reference"] for r in rows})
    width = max(len(r["check"]) for r in rows)
    lines = [f"{path.name}: {m['cpu_model']} (kind {m['cpu_kind']}), torch {m['torch']}; " + "; ".join(refs)]
    lines += [f"  {r['check']:<{width}}  {r['measured']}  {'pass' if r['passed'] else 'FAIL'}" for r in rows]
    return "\n".join(lines)
