"""Our paged KV cache against vLLM's: the attention op itself, greedy generation, and prefix caching.

Three comparisons, all at a block size vLLM's CPU build accepts:
1. The attention op on identical inputs. vLLM's CPU cache layout is internal (per block and head,
   the keys are stored transposed for its "vec" kernels), so both sides get the same new K/V and
   slot mapping and write them with their own reshape_and_cache; then both attend with the same
   block tables, seq_lens and query_start_loc, and we compare the outputs. Decode, prefill and
   chunked prefill; GQA 9/3 x 64 like the course model; random block tables; lengths 1, below,
   at and past a block. First with the kernel vLLM picks itself ("auto", as its engine does), then
   with every kernel ("ISA": vec, vec16, amx) this CPU can run, asked for by name, since which one
   vLLM picks depends on the CPU (radarlab.lab.machine).
2. The course model on PagedKVCache + KVCacheManager, greedy, against vLLM's engine with the same
   block size, by vLLM's own rule (compare.py).
3. Prefix caching on a shared-prefix workload sent in two batches: per request, the prompt tokens each
   side served from its cache (vLLM's RequestOutput.num_cached_tokens), and the counters behind the
   hit rate (vllm:prefix_cache_queries and vllm:prefix_cache_hits). Both sides hash full blocks,
   cap a hit at len(prompt) - 1 tokens so the last token is computed, and register a request's
   full blocks as soon as it is scheduled (so a later request in the same batch can hit them; each
   batch fits one vLLM step of 4096 tokens, so no prompt is cut into chunks), so the numbers must
   agree exactly.

One vLLM worker process (a "session" request) does the op cases and the engine runs, since importing
vLLM and starting its engine is most of the cost.
"""
from __future__ import annotations

import math
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from radarlab.attention.backends import write_kv
from radarlab.attention.torch_paged import paged_attention_torch
from radarlab.device import cpu_kind
from radarlab.kvcache.block_table import block_table_tensor, compute_slot_mapping
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.lab.machine import ATTENTION_ISAS, attention_isas_supported
from radarlab.util import cdiv
from radarlab.validate.compare import compare_greedy, max_logprob_diff, topk_logprobs
from radarlab.validate.table import Row
from radarlab.validate.vllm import DEFAULT_TIMEOUT, LOGPROB_TOL, run_vllm

# vLLM's CPU engine takes block sizes that are multiples of 32 (CPUAttentionBackend); its op also
# runs 16 (with its "vec16" kernels), so the op is compared at both.
ENGINE_BLOCK_SIZE = 32
OP_BLOCK_SIZES = (16, 32)
OP_DTYPES = (torch.float32, torch.bfloat16)
BACKENDS = ("torch", "triton")
# The ISA sweep: every kernel this CPU runs, at a block size all of them take (vec and amx need
# multiples of 32), on the two modes that differ most.
ISA_BLOCK_SIZE = 32
ISA_MODES = ("decode", "prefill")
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 9, 3, 64  # the course model's attention shape

# (seq_lens, query_lens) per mode. Each sequence's queries are its last query_len tokens.
MODES = {
    "decode": ([1, 15, 32, 33, 70, 129], [1, 1, 1, 1, 1, 1]),
    "prefill": ([1, 17, 32, 45], [1, 17, 32, 45]),
    # a decode row, a whole prompt, and chunks that start mid-block, at a block edge and after one token
    "chunked prefill": ([40, 100, 5, 64, 33], [8, 37, 5, 1, 32]),
}

# How far ours may be from vLLM, as max |ours - vLLM|. fp32: both sum in fp32, in different orders
# (measured ~1e-6). bf16: both read bf16 K/V and compute in fp32, but the last step differs: vLLM's
# CPU kernels turn the fp32 result into bf16 by truncating it (round toward zero; measured: every
# decode output equals the truncated fp32 result), while torch's .to(bfloat16) rounds to nearest.
# The two differ by at most one bf16 step (ulp) of the value. (Triton's CPU interpreter truncates
# too, so our Triton kernels match vLLM's decode bit for bit.) Allowed: one bf16 step at the case's
# largest |output|, 2^-7 relative to it (1.6e-2 for outputs between 2 and 4).
FP32_TOL = 1e-5


def op_tolerance(vllm_output: torch.Tensor) -> float:
    """The allowed max |ours - vLLM| for one case (see FP32_TOL above)."""
    if vllm_output.dtype == torch.float32:
        return FP32_TOL
    info = torch.finfo(vllm_output.dtype)
    largest = max(vllm_output.float().abs().max().item(), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(largest))


# --------------------------------------------------------------------------------------------------
# 1. The attention op
# --------------------------------------------------------------------------------------------------
def attention_case(mode: str, block_size: int, dtype: torch.dtype = torch.float32, seed: int = 0,
                   isa: str = "auto") -> dict:
    """Inputs for one batch, in the format vllm_worker's attention_op reads.

    key/value hold every context token of every sequence, written at slot_mapping; two extra rows
    with slot -1 (padding) must be skipped by both writes. Block tables are random blocks of a pool
    with spare blocks, padded with 0 as vLLM pads them. isa: vLLM's kernel for the case ("auto": its
    own choice).
    """
    if mode not in MODES:
        raise ValueError(f"mode must be one of {list(MODES)}, got {mode!r}")
    if isa != "auto" and isa not in ATTENTION_ISAS:
        raise ValueError(f"isa must be 'auto' or one of {list(ATTENTION_ISAS)}, got {isa!r}")
    seq_lens, query_lens = MODES[mode]
    gen = torch.Generator().manual_seed(seed)
    needed = [cdiv(n, block_size) for n in seq_lens]
    num_blocks = 2 * sum(needed)
    order = torch.randperm(num_blocks, generator=gen).tolist()
    tables, start = [], 0
    for n in needed:
        tables.append(order[start:start + n])
        start += n
    block_table = block_table_tensor(tables, pad=0)  # vLLM pads with 0
    req = torch.repeat_interleave(torch.arange(len(seq_lens)), torch.tensor(seq_lens))
    positions = torch.cat([torch.arange(n) for n in seq_lens])
    slots = compute_slot_mapping(block_table, positions, block_size, req)
    slots = torch.cat([slots, torch.tensor([-1, -1])])
    slots = slots[torch.randperm(len(slots), generator=gen)]  # write order must not matter
    num_tokens = sum(query_lens)
    shape_kv = (len(slots), NUM_KV_HEADS, HEAD_DIM)
    query_start_loc = torch.zeros(len(seq_lens) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.cumsum(torch.tensor(query_lens), 0)
    return {
        "mode": mode,
        "query": torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype),
        "key": torch.randn(*shape_kv, generator=gen).to(dtype),
        "value": torch.randn(*shape_kv, generator=gen).to(dtype),
        "slot_mapping": slots,
        "block_table": block_table,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "query_start_loc": query_start_loc,
        "block_size": block_size,
        "num_blocks": num_blocks,
        "scale": HEAD_DIM ** -0.5,
        # only when named: a case without "isa" runs whatever the request asks for (default auto)
        **({} if isa == "auto" else {"isa": isa}),
    }


def attention_cases(block_sizes=OP_BLOCK_SIZES, dtypes=OP_DTYPES, modes=tuple(MODES),
                    seed: int = 0) -> list[dict]:
    return [attention_case(m, bs, dt, seed) for dt in dtypes for bs in block_sizes for m in modes]


def isa_dtypes(isa: str, dtypes=OP_DTYPES) -> list[torch.dtype]:
    """Those of dtypes that vLLM's kernel `isa` takes (amx: bf16 only)."""
    takes = ATTENTION_ISAS[isa].dtypes
    return [dt for dt in dtypes if takes is None or str(dt).removeprefix("torch.") in takes]


def isa_cases(isas: list[str] | None = None, dtypes=OP_DTYPES, modes=ISA_MODES,
              block_size: int = ISA_BLOCK_SIZE,
              seed: int = 0) -> list[dict]:
    """One case per (ISA, dtype it takes, mode), each asking vLLM for that kernel by name. isas: default
    every one this CPU can run (attention_isas_supported())."""
    isas = attention_isas_supported() if isas is None else isas
    return [attention_case(m, block_size, dt, seed, isa) for isa in isas for dt in isa_dtypes(isa, dtypes)
            for m in modes]


def our_attention(case: dict, backend: str = "torch") -> torch.Tensor:
    """Our side of a case: write K/V into an empty PagedKVCache, then paged attention over it."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    q, key = case["query"], case["key"]
    cache = PagedKVCache(1, case["num_blocks"], key.shape[1], key.shape[2],
                         case["block_size"], dtype=key.dtype,
                         backend=backend)
    write_kv(cache, 0, key, case["value"], case["slot_mapping"])
    args = (q, cache.k[0], cache.v[0], case["block_table"], case["seq_lens"],
            case["query_start_loc"], case["scale"])
    if backend == "triton":
        from radarlab.attention.triton_paged import triton_paged_attention

        return triton_paged_attention(*args)
    return paged_attention_torch(*args)


@dataclass(frozen=True)
class OpComparison:
    """max |ours - vLLM| over one case's output."""

    mode: str
    dtype: torch.dtype
    block_size: int
    backend: str
    isa: str  # which of vLLM's CPU kernels ran ("vec", "vec16", "amx", ...)
    max_abs_err: float
    tol: float  # op_tolerance of vLLM's output
    requested: str = "auto"  # what the case asked for: "auto" (vLLM's choice) or the ISA by name

    @property
    def passed(self) -> bool:
        return self.max_abs_err <= self.tol  # NaN fails


def attention_op_request(cases: list[dict], workdir: str | Path) -> tuple[dict, Path]:
    """The worker request for these cases (saved under workdir), and where its outputs will be."""
    workdir = Path(workdir)
    inputs, outputs = workdir / "attention_cases.pt", workdir / "attention_outputs.pt"
    keep = ("query", "key", "value", "slot_mapping", "block_table", "seq_lens", "query_start_loc",
            "block_size", "num_blocks", "scale", "isa")
    torch.save([{k: c[k] for k in keep if k in c} for c in cases], inputs)
    return {"kind": "attention_op", "inputs": str(inputs), "outputs": str(outputs)}, outputs


def compare_attention(cases: list[dict], vllm_outputs: list[torch.Tensor], isas: list[str],
                      backends=BACKENDS) -> list[OpComparison]:
    """Each case through each of our backends, against vLLM's output for it."""
    if not len(cases) == len(vllm_outputs) == len(isas):
        raise ValueError(f"{len(cases)} cases, {len(vllm_outputs)} vLLM outputs, {len(isas)} isas")
    results = []
    for case, theirs, isa in zip(cases, vllm_outputs, isas):
        for backend in backends:
            dtype = case["query"].dtype
            ours = our_attention(case, backend)
            if ours.shape != theirs.shape:
                raise ValueError(f"case {case['mode']!r}: our output is {tuple(ours.shape)}, "
                                 f"vLLM's {tuple(theirs.shape)}")
            err = (ours.float() - theirs.float()).abs().max().item()
            results.append(OpComparison(case["mode"], dtype, case["block_size"], backend, isa, err,
                                        op_tolerance(theirs), case.get("isa", "auto")))
    return results


# --------------------------------------------------------------------------------------------------
# 2 and 3. The engine: greedy at matched block size, and the shared-prefix workload
# --------------------------------------------------------------------------------------------------
def prefix_workload(tokenizer, block_size: int = ENGINE_BLOCK_SIZE) -> list[list[list[int]]]:
    """Two batches of token ids sharing a long system prompt, as vLLM's prefix-caching tests send them.

    Batch 1 warms the cache with one request. Batch 2 holds: the other questions (they hit the system
    prompt's full blocks), the first request again (hits every full block of it), the system prompt
    cut to a whole number of blocks (all cached, yet its last block is recomputed, since the block
    holding the last prompt token is never taken from the cache), and an unrelated short prompt.
    """
    from radarlab.validate.prompts import PREFIX_QUESTIONS, PREFIX_SYSTEM_PROMPT

    ids = [tokenizer(PREFIX_SYSTEM_PROMPT + q)["input_ids"] for q in PREFIX_QUESTIONS]
    system = tokenizer(PREFIX_SYSTEM_PROMPT)["input_ids"]
    aligned = ids[0][:len(system) // block_size * block_size]
    if not aligned:
        raise ValueError(f"the system prompt ({len(system)} tokens) is shorter than one block of "
                         f"{block_size}")
    unrelated = tokenizer("The capital of France is")["input_ids"]
    return [[ids[0]], [*ids[1:], ids[0], aligned, unrelated]]


class _RecordingBlockSpaceManager(KVCacheManager):
    """A KVCacheManager that remembers what allocate returned (the prompt tokens found in the
    prefix cache) per sequence, to set beside vLLM's per-request num_cached_tokens."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.num_cached_tokens: dict = {}

    def allocate(self, seq, num_new_tokens=None) -> int:
        num = super().allocate(seq, num_new_tokens)
        self.num_cached_tokens[seq.seq_id] = num
        return num


@dataclass
class PrefixRun:
    """Our side of the workload: tokens, per-request cache hits and per-batch counters."""

    outputs: list[list[int]]  # new tokens per request, all batches in order
    num_cached_tokens: list[int]  # per request
    queries: list[int]  # per batch: prompt tokens looked up
    hits: list[int]  # per batch: of those, served from the cache


def our_prefix_run(model, batches: list[list[list[int]]], max_new_tokens: int,
                   block_size: int = ENGINE_BLOCK_SIZE, backend: str = "torch") -> PrefixRun:
    """The batches in order through our model on one paged cache with prefix caching on.

    The pool is big enough that nothing is evicted; so is vLLM's (1 GiB is ~700 fp32 blocks of 32 for
    this model, and the workload uses a few dozen)."""
    from radarlab.models.paged_runner import blocks_needed, paged_greedy_generate

    prompts = [p for batch in batches for p in batch]
    num_blocks = blocks_needed(prompts, max_new_tokens, block_size)
    manager = _RecordingBlockSpaceManager(num_blocks, block_size, enable_prefix_caching=True)
    param = next(model.parameters())
    cache = PagedKVCache.for_model(model.config, num_blocks, block_size, dtype=param.dtype,
                                   device=param.device,
                                   backend=backend)
    outputs, queries, hits, seq_ids = [], [], [], []
    stats = manager.prefix_cache_stats
    for b, batch in enumerate(batches):
        ids = [(b, i) for i in range(len(batch))]
        before = (stats.queries, stats.hits)
        outputs += paged_greedy_generate(model, batch, max_new_tokens, manager=manager,
                                         cache=cache, seq_ids=ids)
        queries.append(stats.queries - before[0])
        hits.append(stats.hits - before[1])
        seq_ids += ids
    return PrefixRun(outputs, [manager.num_cached_tokens[s] for s in seq_ids], queries, hits)


def vllm_prefix_counts(response: dict, batches: slice) -> tuple[list[int], list[int]]:
    """Per batch, vllm:prefix_cache_queries and vllm:prefix_cache_hits added by that batch (the
    worker snapshots the cumulative counters after each generate() call)."""
    snaps = response["batches"]
    queries, hits = [], []
    for b in range(len(snaps))[batches]:
        prev = snaps[b - 1]["metrics"] if b else {}
        cur = snaps[b]["metrics"]
        for name, out in (("vllm:prefix_cache_queries", queries), ("vllm:prefix_cache_hits", hits)):
            if name not in cur:
                raise KeyError(f"vLLM reported no {name}; metrics: {sorted(cur)}")
            out.append(int(cur[name] - prev.get(name, 0)))
    return queries, hits


@dataclass
class PagedSession:
    """Everything vLLM returned for the paged rows, from one worker process."""

    cases: list[dict]
    vllm_outputs: list[torch.Tensor]  # one per case
    isas: list[str]  # one per case
    generate: dict  # the generate response: validation prompts, then the prefix batches
    num_prompts: int  # how many of generate's outputs are the validation prompts
    vllm: str  # "vLLM 0.32.0 (cpu)"
    cpu: dict  # where the op ran, as the worker read it: {"arch", "flags"}
    extension: str | None  # vLLM's library the worker loaded: "_C", "_C_AVX512" or "_C_AVX2"

    @property
    def cpu_kind(self) -> str:
        """The CPU's kind: "avx2", "avx512", "avx512_bf16" or "avx512_bf16_amx" (radarlab.device.cpu_kind)."""
        return cpu_kind(self.cpu["flags"], self.cpu["arch"])


def run_paged_session(prompts: list[list[int]], prefix_batches: list[list[list[int]]], cases: list[dict],
                      max_new_tokens: int = 64, prefix_new_tokens: int = 16, k: int = 5,
                      block_size: int = ENGINE_BLOCK_SIZE, timeout: float = DEFAULT_TIMEOUT) -> PagedSession:
    """One vLLM process: the attention-op cases, then one fp32 engine with this block size and prefix
    caching on, generating greedily (EOS ignored) for the prompts and then each prefix batch."""
    generate = {
        "batches": [[list(map(int, p)) for p in batch] for batch in [prompts, *prefix_batches]],
        "batch_max_tokens": [max_new_tokens] + [prefix_new_tokens] * len(prefix_batches),
        "max_tokens": max_new_tokens, "logprobs": k, "dtype": "float32", "temperature": 0.0,
        "ignore_eos": True, "block_size": block_size, "enable_prefix_caching": True,
    }
    with tempfile.TemporaryDirectory(prefix="radarlab-vllm-") as workdir:
        op_request, outputs_path = attention_op_request(cases, workdir)
        response = run_vllm({"kind": "session", "requests": [op_request, generate]}, timeout=timeout)
        vllm_outputs = torch.load(outputs_path, weights_only=True)
    op_response, gen_response = response["responses"]
    return PagedSession(cases, vllm_outputs, [c["isa"] for c in op_response["cases"]],
                        gen_response, len(prompts),
                        f"vLLM {response['vllm_version']} ({response['device']})", op_response["cpu"],
                        op_response["extension"])


def compare_greedy_outputs(model, prompts, ours, theirs, k: int = 5, kv_cache_dtype: str | None = None):
    """vLLM's rule per prompt, plus max |dlogprob| where the contexts still match. Our logprobs come
    through a paged cache of kv_cache_dtype when given (see topk_logprobs)."""
    results, worst = [], 0.0
    for prompt, mine, out in zip(prompts, ours, theirs, strict=True):
        our_lp = topk_logprobs(model, prompt, mine, k, kv_cache_dtype)
        r = compare_greedy(mine, our_lp, out["token_ids"], out["logprobs"], k=k, names=("ours", "vLLM"))
        results.append(r)
        worst = max(worst, max_logprob_diff(our_lp, out["logprobs"], r.matched))
    return results, worst


# --------------------------------------------------------------------------------------------------
# The validation rows
# --------------------------------------------------------------------------------------------------
def _fmt_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.").replace("float32", "fp32").replace("bfloat16", "bf16")


def op_rows(comparisons: list[OpComparison], ref: str, kind: str = "") -> list[Row]:
    """One row per (dtype, mode, ISA): the worst case over block sizes, per backend. kind: the CPU kind
    the ops ran on (cpu_kind()), shown beside the ISA since it decides which ISAs exist."""
    rows = []
    keys = dict.fromkeys((c.dtype, c.mode, c.isa) for c in comparisons)
    on = f" on {kind}" if kind else ""
    for dtype, mode, isa in keys:
        group = [c for c in comparisons if (c.dtype, c.mode, c.isa) == (dtype, mode, isa)]
        sizes = list(dict.fromkeys(c.block_size for c in group))
        requested = list(dict.fromkeys(c.requested for c in group))
        backends = dict.fromkeys(c.backend for c in group)
        worst = {b: max(c.max_abs_err for c in group if c.backend == b) for b in backends}
        measured = ", ".join(f"{b} {e:.1e}" for b, e in worst.items())
        if dtype == torch.float32:
            criterion = f"<= {FP32_TOL:g}"
        else:
            criterion = f"<= 1 {_fmt_dtype(dtype)} step at max |out| ({min(c.tol for c in group):.1e})"
        asked = "by name" if requested == [isa] else "auto" if requested == ["auto"] else "auto and by name"
        rows.append(Row(f"paged attention op, {mode} {_fmt_dtype(dtype)}, isa {isa} ({asked}){on}, "
                        f"blocks {'/'.join(map(str, sizes))}",
                        f"{ref} cpu_attention_with_kv_cache", f"max |dout| {measured}",
                        criterion, all(c.passed for c in group),
                        {"isa": isa, "requested": requested, "cpu_kind": kind or None, "mode": mode,
                         "dtype": _fmt_dtype(dtype), "block_sizes": sizes, "max_abs_err": worst}))
    return rows


def rows(model, prompts: list[list[int]], prefix_batches: list[list[list[int]]], max_new_tokens: int = 64,
         prefix_new_tokens: int = 16, k: int = 5, block_size: int = ENGINE_BLOCK_SIZE,
         timeout: float = DEFAULT_TIMEOUT) -> list[Row]:
    """Validation rows for the paged cache against vLLM (one worker process for all of them)."""
    from radarlab.engine import Engine, SamplingParams
    from radarlab.models.paged_runner import blocks_needed, paged_greedy_generate

    cases = attention_cases() + isa_cases()
    session = run_paged_session(prompts, prefix_batches, cases, max_new_tokens,
                                prefix_new_tokens, k, block_size,
                                timeout)
    ref = session.vllm
    out = op_rows(compare_attention(cases, session.vllm_outputs, session.isas), f"{ref} {session.extension}",
                  session.cpu_kind)

    theirs = session.generate["outputs"]

    def greedy_row(name: str, ours: list[list[int]]) -> Row:
        results, dlp = compare_greedy_outputs(model, prompts, ours, theirs[:session.num_prompts], k)
        matched = sorted(r.matched for r in results)
        return Row(f"{name}, {len(prompts)} prompts x {max_new_tokens}", f"{ref} block_size={block_size}",
                   f"{sum(r.identical for r in results)}/{len(prompts)} identical, matched "
                   f"{matched[0]}-{matched[-1]}, max |dlogprob| {dlp:.1e}",
                   f"vLLM rule (top-{k}); |dlogprob| < {LOGPROB_TOL:g}",
                   all(r.passed for r in results) and dlp < LOGPROB_TOL)

    out.append(greedy_row(f"paged greedy fp32, block {block_size}",
                          paged_greedy_generate(model, prompts, max_new_tokens, block_size=block_size)))
    # The same prompts through the engine: 3 seats and a 64-token budget, so requests queue, prompts
    # are prefilled in chunks beside other requests' decodes, and seats are handed over mid-run.
    engine = Engine(model, blocks_needed(prompts, max_new_tokens, block_size), block_size, max_num_seqs=3,
                    max_num_batched_tokens=64)
    served = engine.generate(prompts, SamplingParams(max_tokens=max_new_tokens))
    out.append(greedy_row("engine greedy fp32, 3 seats, 64-token budget",
                          [o.output_token_ids for o in served]))

    run = our_prefix_run(model, prefix_batches, prefix_new_tokens, block_size)
    v_queries, v_hits = vllm_prefix_counts(session.generate, slice(1, None))
    v_cached = [o["num_cached_tokens"] for o in theirs[session.num_prompts:]]
    ours_rate = sum(run.hits) / sum(run.queries)
    theirs_rate = sum(v_hits) / max(sum(v_queries), 1)
    out.append(Row(f"prefix cache hits, shared prefix, 2 batches, block {block_size}",
                   f"{ref} prefix caching",
                   f"hit rate ours {sum(run.hits)}/{sum(run.queries)} = {ours_rate:.3f}, vLLM {sum(v_hits)}/"
                   f"{sum(v_queries)} = {theirs_rate:.3f}; per request {run.num_cached_tokens}",
                   "queries, hits, per-request cached tokens equal",
                   (run.queries, run.hits, run.num_cached_tokens) == (v_queries, v_hits, v_cached)))
    prefix_prompts = [p for batch in prefix_batches for p in batch]
    results, dlp = compare_greedy_outputs(model, prefix_prompts, run.outputs, theirs[session.num_prompts:], k)
    out.append(Row(f"greedy on prefix-cache hits, {len(prefix_prompts)} prompts x {prefix_new_tokens}",
                   f"{ref} prefix caching",
                   f"{sum(r.identical for r in results)}/{len(results)} identical, max |dlogprob| {dlp:.1e}",
                   f"vLLM rule (top-{k}); |dlogprob| < {LOGPROB_TOL:g}",
                   all(r.passed for r in results) and dlp < LOGPROB_TOL))
    return out
