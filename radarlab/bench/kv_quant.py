"""KV-cache formats measured on the course model: bytes, attention error, perplexity, concurrency.

For each scheme (a kv_cache_dtype of radarlab.quant.formats, plus a scale rule for FP8):

- bytes: KV bytes per token, every scale and zero point counted (kvcache.memory.kv_footprint), and
  the saving against a 16-bit cache; a KIVI residual window is a per-sequence cost, so it is also
  given at the evaluation length (kv_bytes_per_token_at_len);
- attn_err: relative error ||o - o16|| / ||o16|| of the attention output of every layer (mean over
  layers) when one chunk's real q, K, V go through a cache of this format instead of a 16-bit one;
- ppl: perplexity on the fixed corpus (radarlab.corpus: num_chunks chunks of chunk_len tokens, each
  from an empty cache) computed through the real PagedKVCache of this format: every layer writes
  its K/V into the quantized pool and attends over what the pool gives back. ppl_delta_pct is the
  change against an fp32 cache.

FP8 scale rules (the tensor-rule formats take k_scale, v_scale): "1.0" (vLLM 0.32 without checkpoint
scales), "tensor" and "head" (calibrated offline, amax / largest finite, one scale per layer or per
layer and head), "legacy" (older vLLM's amax / 200 for K and amax / 100 for V). Calibration reads
calib_chunks chunks that follow the evaluation chunks, never the chunks scored. fp8_per_token_head
is the dynamic rule (scales stored per token and head).

Concurrency: every format gets the same KV byte budget (budget_requests_16bit requests' worth of
16-bit blocks); the engine gets as many blocks as fit and runs the same long requests. It reports
how many ran at once (most and mean over decode steps), preemptions, and output tokens/s.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from radarlab.attention.backends import attention_forward, get_attn_backend
from radarlab.util import cdiv, require_int

BASELINE = "fp32"  # the perplexity reference: an unquantized fp32 cache
SIXTEEN_BIT = "float16"  # the byte reference
FP8_SCALE_RULES = ("1.0", "tensor", "head", "legacy")


@dataclass(frozen=True)
class Scheme:
    """One row: a kv_cache_dtype and, for FP8 with static scales, how k_scale / v_scale are chosen
    (one of FP8_SCALE_RULES, or a number used for every layer)."""
    name: str
    kv_cache_dtype: str
    scales: str | float | None = None


def default_schemes() -> tuple[Scheme, ...]:
    rows = [Scheme(BASELINE, "fp32"), Scheme("16-bit (fp16)", SIXTEEN_BIT),
            Scheme("16-bit (bf16)", "bfloat16")]
    for fmt in ("fp8_e4m3", "fp8_e5m2"):
        rows += [Scheme(f"{fmt} scale {rule}", fmt, rule) for rule in FP8_SCALE_RULES]
    rows += [Scheme("fp8_e4m3 scale 1.0, round toward zero (vLLM CPU)", "fp8_e4m3_rtz", "1.0"),
             Scheme("fp8_e4m3 dynamic per token and head", "fp8_per_token_head"),
             Scheme("fp8_e4m3 scale 1.0, Hadamard", "fp8_e4m3_hadamard", "1.0"),
             Scheme("fp8_e4m3 per head, Hadamard", "fp8_e4m3_hadamard", "head"),
             Scheme("fp8_e4m3 scale 1.0, Hadamard on K, q and V", "fp8_e4m3_hadamard_vrot", "1.0"),
             Scheme("fp8_e4m3 scale 1.0, sink1", "fp8_e4m3_sink1", "1.0")]
    for dtype in ("int4_g64_sym", "int4_g32_sym", "int4_g64_asym", "int4_g32_asym", "int4_g16_asym_fp8scales",
                  "int4_g64_sym_hadamard", "int4_g64_asym_hadamard", "int4_g32_asym_hadamard",
                  "kivi_g64", "kivi_g32", "kivi_g32_r128", "kivi_g32_fp8scales", "kivi_g32_hadamard",
                  "kivi_g32_fp8scales_int8zeros", "kivi_g32_fp8scales_int8zeros_sink1",
                  "kivi_g32_fp8scales_int8zeros_r128_sink1"):
        rows.append(Scheme(dtype, dtype))
    return tuple(rows)


@dataclass(frozen=True)
class QuantBenchConfig:
    num_chunks: int = 24
    chunk_len: int = 512
    calib_chunks: int = 2
    attn_tokens: int = 512  # tokens of the first chunk whose q, K, V score the attention error
    schemes: tuple[Scheme, ...] = field(default_factory=default_schemes)
    block_size: int = 16
    # concurrency
    concurrency_dtypes: tuple[str, ...] = (SIXTEEN_BIT, "fp8_e4m3", "kivi_g32")
    num_requests: int = 8
    prompt_len: int = 256
    max_tokens: int = 32
    budget_requests_16bit: int = 2  # the byte budget: this many requests' blocks in a 16-bit cache
    max_num_batched_tokens: int = 512
    model: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_chunks", "calib_chunks", "attn_tokens", "block_size", "num_requests", "prompt_len",
                     "max_tokens", "budget_requests_16bit", "max_num_batched_tokens"):
            require_int(name, getattr(self, name))
        require_int("chunk_len", self.chunk_len, minimum=2)
        if self.attn_tokens > self.chunk_len:
            raise ValueError(f"attn_tokens ({self.attn_tokens}) is longer than a chunk ({self.chunk_len})")
        if not self.schemes:
            raise ValueError("schemes is empty")
        if len({s.name for s in self.schemes}) != len(self.schemes):
            raise ValueError(f"schemes have repeated names: {[s.name for s in self.schemes]}")
        for s in self.schemes:
            if isinstance(s.scales, str) and s.scales not in FP8_SCALE_RULES:
                raise ValueError(f"scheme {s.name!r}: scales must be a number or one of {FP8_SCALE_RULES}, "
                                 f"got {s.scales!r}")


QUICK = dict(num_chunks=2, chunk_len=64, calib_chunks=1, attn_tokens=64, num_requests=4, prompt_len=48,
             max_tokens=8, budget_requests_16bit=1)


# --- running the model over the paged cache --------------------------------------------------------
class RecordingBackend:
    """An attention backend that keeps every layer's q, K and V, then runs the cache's own backend."""

    def __init__(self, cache) -> None:
        self.cache, self.inner, self.inputs = cache, get_attn_backend(cache), {}

    def is_built(self, meta, kv_cache) -> bool:
        return meta.backend is self

    def build(self, meta, kv_cache, layer=None):
        return replace(self.inner.build(meta, kv_cache, layer), backend=self)

    def forward(self, layer, q, k, v, meta, kv_cache, scale):
        self.inputs[layer] = (q.clone(), k.clone(), v.clone())
        return self.inner.forward(layer, q, k, v, meta, kv_cache, scale)


def kivi_block_size(kv_cache_dtype: str, block_size: int) -> int:
    """A KIVI key group never straddles two blocks: its blocks hold at least one group."""
    from radarlab.quant.formats import kv_format

    fmt = kv_format(kv_cache_dtype)
    return max(block_size, fmt.group_size) if fmt.kind == "kivi" else block_size


def make_cache(model, scheme: Scheme, num_tokens: int, block_size: int, scales: dict | None = None,
               kivi_quantizer=None):
    """A PagedKVCache of the scheme's format with room for one sequence of num_tokens (a KIVI format:
    with kivi_quantizer's functions, radarlab.quant.kivi.KiviQuantizer, if given)."""
    from radarlab.kvcache.paged_cache import PagedKVCache
    from radarlab.quant.formats import kv_format

    param = next(model.parameters())
    extra = {}
    if scheme.scales is not None:
        if isinstance(scheme.scales, str):
            key = (kv_format(scheme.kv_cache_dtype).fp8, scheme.scales)
            if scales is None or key not in scales:
                raise ValueError(f"scheme {scheme.name!r}: no {scheme.scales!r} scales for {key[0]} given")
            extra["k_scale"], extra["v_scale"] = scales[key]
        else:
            extra["k_scale"] = extra["v_scale"] = float(scheme.scales)
    block_size = kivi_block_size(scheme.kv_cache_dtype, block_size)
    return PagedKVCache.for_model(model.config, cdiv(num_tokens, block_size), block_size, dtype=param.dtype,
                                  device=param.device, kv_cache_dtype=scheme.kv_cache_dtype,
                                  kivi_quantizer=kivi_quantizer, **extra)


def sequence_nll(model, cache, token_ids) -> tuple[float, int]:
    """(summed negative log-likelihood of tokens 1.., number of tokens predicted), one prefill."""
    import torch
    import torch.nn.functional as F

    from radarlab.models.paged_runner import paged_prefill_logits

    logits = paged_prefill_logits(model, cache, token_ids)
    targets = torch.tensor(token_ids[1:], device=logits.device)
    return float(F.cross_entropy(logits[:-1].float(), targets, reduction="sum")), len(token_ids) - 1


def perplexity(model, scheme: Scheme, chunks, block_size: int, scales: dict | None = None,
               kivi_quantizer=None) -> float:
    """exp(mean NLL) over every predicted token of every chunk, through a cache of the scheme's format."""
    cache = make_cache(model, scheme, max(len(c) for c in chunks), block_size, scales, kivi_quantizer)
    total, count = 0.0, 0
    for chunk in chunks:
        nll, n = sequence_nll(model, cache, chunk)
        total, count = total + nll, count + n
    return math.exp(total / count)


def record_qkv(model, token_ids, block_size: int) -> RecordingBackend:
    """Every layer's q, K, V for one sequence, from an fp32 cache."""
    import torch

    from radarlab.models.paged_runner import paged_prefill_logits

    rec = RecordingBackend(make_cache(model, Scheme(BASELINE, "fp32"), len(token_ids), block_size))
    paged_prefill_logits(model, rec.cache, token_ids, logits_indices=torch.tensor([len(token_ids) - 1]),
                         backend=rec)
    return rec


def calibrate_scales(model, chunks, block_size: int) -> dict:
    """(fp8 format, rule) -> (k_scale, v_scale): per layer [L] or per layer and head [L, H], from K and V
    of the calibration chunks (concatenated along tokens: one batch). The legacy rule's divisors do not
    depend on the format; the calibrated ones map amax to the format's largest finite value."""
    import torch

    from radarlab.quant import fp8

    ks, vs = {}, {}
    for chunk in chunks:
        for layer, (_, k, v) in record_qkv(model, chunk, block_size).inputs.items():
            ks.setdefault(layer, []).append(k)
            vs.setdefault(layer, []).append(v)
    layers = sorted(ks)
    k = [torch.cat(ks[i]) for i in layers]
    v = [torch.cat(vs[i]) for i in layers]
    legacy = [fp8.legacy_vllm_scales(kl, vl) for kl, vl in zip(k, v)]
    out = {}
    for fmt in fp8.TORCH_DTYPES:
        out[fmt, "1.0"] = (1.0, 1.0)
        out[fmt, "legacy"] = (torch.tensor([a for a, _ in legacy]), torch.tensor([b for _, b in legacy]))
        for rule in ("tensor", "head"):
            out[fmt, rule] = (torch.stack([fp8.calibrated_scale(x, fmt, rule) for x in k]),
                              torch.stack([fp8.calibrated_scale(x, fmt, rule) for x in v]))
    return out


def attention_error(model, scheme: Scheme, rec: RecordingBackend, block_size: int, reference: dict,
                    scales: dict | None = None) -> float:
    """Mean over layers of ||o - o_ref|| / ||o_ref|| for the recorded q, K, V; reference holds o_ref."""
    outs = attention_outputs(model, scheme, rec, block_size, scales)
    errs = [float((outs[i] - reference[i]).norm() / reference[i].norm()) for i in reference]
    return sum(errs) / len(errs)


def attention_outputs(model, scheme: Scheme, rec: RecordingBackend, block_size: int,
                      scales: dict | None = None
                      ) -> dict:
    """Each layer's attention output when its recorded q, K, V go through a cache of the scheme's format."""
    from radarlab.models.paged_runner import prefill_metadata

    num_tokens = rec.inputs[0][1].shape[0]
    cache = make_cache(model, scheme, num_tokens, block_size, scales)
    meta = prefill_metadata(cache, [0] * num_tokens)  # the token ids are not read here
    scale = model.config.head_dim ** -0.5
    return {i: attention_forward(cache, i, q, k, v, meta, scale).float() for i,
            (q, k, v) in sorted(rec.inputs.items())}


# --- bytes ------------------------------------------------------------------------------------------
def byte_columns(config_dims, kv_cache_dtype: str, tokens: int) -> dict:
    """bits per value, bytes per token (and at `tokens` context, residual window counted), saving vs
    16-bit."""
    from radarlab.kvcache.memory import kv_footprint
    from radarlab.quant.formats import kv_format

    layers, kv_heads, head_dim = config_dims
    fp = kv_footprint(layers, kv_heads, head_dim, tokens, kv_cache_dtype)
    ref = kv_footprint(layers, kv_heads, head_dim, tokens, SIXTEEN_BIT)
    return {"bits": kv_format(kv_cache_dtype).bits_per_value(head_dim),
            "kv_bytes_per_token": fp.bytes_per_token,
            "saving": 1 - fp.bytes_per_token / ref.bytes_per_token,
            "kv_bytes_per_token_at_len": fp.bytes_per_stream / tokens,
            "saving_at_len": 1 - fp.bytes_per_stream / ref.bytes_per_stream}


# --- concurrency --------------------------------------------------------------------------------
def concurrency_row(model, kv_cache_dtype: str, budget_bytes: int, prompts, config: QuantBenchConfig) -> dict:
    """The engine on a pool of budget_bytes of this format, running every prompt to max_tokens."""
    from radarlab.engine import Engine, SamplingParams
    from radarlab.kvcache.paged_cache import PagedKVCache

    cfg = model.config
    dtype = next(model.parameters()).dtype
    block_size = kivi_block_size(kv_cache_dtype, config.block_size)
    per_block = PagedKVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, block_size,
                                             kv_cache_dtype, dtype)
    engine = Engine(model, None, block_size, max_num_seqs=len(prompts),
                    max_num_batched_tokens=config.max_num_batched_tokens, enable_prefix_caching=False,
                    kv_cache_dtype=kv_cache_dtype, kv_cache_bytes=budget_bytes)
    num_blocks = engine.manager.num_blocks
    params = SamplingParams(max_tokens=config.max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    running, tokens = [], 0
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        outputs = engine.step()
        tokens += sum(len(o.new_token_ids) for o in outputs)
        sched = engine.last_scheduled
        if sched is not None and sched.requests:
            running.append(len(sched.requests))
    seconds = time.perf_counter() - t0
    return {"kv_cache_dtype": kv_cache_dtype, "budget_bytes": budget_bytes, "bytes_per_block": per_block,
            "num_blocks": num_blocks, "block_size": block_size, "token_capacity": num_blocks * block_size,
            "max_running": max(running, default=0), "mean_running": sum(running) / max(len(running), 1),
            "preemptions": engine.scheduler.num_preemptions, "steps": engine.num_steps,
            "output_tokens": tokens, "seconds": seconds, "output_tokens_per_s": tokens / seconds}


def concurrency(model, tokenizer_chunks, config: QuantBenchConfig, log=print) -> list[dict]:
    """Same requests (corpus text), same byte budget, one row per format in config.concurrency_dtypes."""
    from radarlab.kvcache.paged_cache import PagedKVCache

    cfg = model.config
    dtype = next(model.parameters()).dtype
    per_block_16 = PagedKVCache.bytes_per_block(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                                                config.block_size, SIXTEEN_BIT, dtype)
    blocks_per_request = cdiv(config.prompt_len + config.max_tokens, config.block_size)
    budget = config.budget_requests_16bit * blocks_per_request * per_block_16
    rows = []
    for kv_cache_dtype in config.concurrency_dtypes:
        row = concurrency_row(model, kv_cache_dtype, budget, tokenizer_chunks, config)
        log(f"  concurrency {kv_cache_dtype}: {row['num_blocks']} blocks, at most "
            f"{row['max_running']} running, {row['output_tokens_per_s']:.1f} tok/s")
        rows.append(row)
    return rows


# --- the benchmark ------------------------------------------------------------------------------
def run(config: QuantBenchConfig = QuantBenchConfig(), log=print, model=None, tokenizer=None) -> dict:
    """Every scheme and the concurrency rows. model and tokenizer default to config.model in fp32."""
    import torch

    from radarlab.corpus import corpus_chunks, corpus_description
    from radarlab.models.llama import Llama

    if (model is None) != (tokenizer is None):
        raise ValueError("pass both model and tokenizer, or neither")
    if model is None:
        model, tokenizer = Llama.from_pretrained(config.model, dtype=torch.float32)
    cfg = model.config
    dims = (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)
    total = config.num_chunks + config.calib_chunks
    chunks = corpus_chunks(tokenizer, total, config.chunk_len)
    evaluation, calibration = chunks[:config.num_chunks], chunks[config.num_chunks:]
    log(f"corpus: {config.num_chunks} x {config.chunk_len} tokens scored, "
        f"{config.calib_chunks} for calibration")
    scales = calibrate_scales(model, calibration, config.block_size)
    rec = record_qkv(model, evaluation[0][:config.attn_tokens], config.block_size)
    reference = attention_outputs(model, Scheme(SIXTEEN_BIT, SIXTEEN_BIT), rec, config.block_size)

    rows, base_ppl = [], None
    schemes = sorted(config.schemes, key=lambda s: s.kv_cache_dtype != BASELINE)  # the baseline first
    for scheme in schemes:
        t0 = time.perf_counter()
        ppl = perplexity(model, scheme, evaluation, config.block_size, scales)
        if scheme.kv_cache_dtype == BASELINE and base_ppl is None:
            base_ppl = ppl
        row = {"name": scheme.name, "kv_cache_dtype": scheme.kv_cache_dtype,
               "scales": None if scheme.scales is None else str(scheme.scales),
               **byte_columns(dims, scheme.kv_cache_dtype, config.chunk_len),
               "ppl": ppl, "ppl_delta_pct": None if base_ppl is None else 100 * (ppl / base_ppl - 1),
               "attn_err": attention_error(model, scheme, rec, config.block_size, reference, scales),
               "seconds": time.perf_counter() - t0}
        log(f"  {row['name']}: {row['bits']:.3g} bits, saving {row['saving']:.1%}, ppl {ppl:.4f} "
            f"({_pct(row['ppl_delta_pct'])}), attn err {row['attn_err']:.2e}")
        rows.append(row)
    prompts = [c[:config.prompt_len] for c in corpus_chunks(tokenizer, config.num_requests,
                                                            max(config.prompt_len, 2))]
    conc = concurrency(model, prompts, config, log) if config.concurrency_dtypes else []
    return {"config": _config_json(config), "changed_from_default": _changes(config),
            "corpus": corpus_description(), "baseline_ppl": base_ppl,
            "schemes": rows, "concurrency": conc}


def _pct(x) -> str:
    return "no fp32 baseline" if x is None else f"{x:+.2f}%"


def _changes(config: QuantBenchConfig) -> dict:
    """The parameters a run changed from the full benchmark's (a reduced run says so in its JSON)."""
    default, now = _config_json(QuantBenchConfig()), _config_json(config)
    out = {k: v for k, v in now.items() if k != "schemes" and v != default[k]}
    if now["schemes"] != default["schemes"]:
        out["schemes"] = f"{len(config.schemes)} of the {len(default['schemes'])} default schemes"
    return out


def _config_json(config: QuantBenchConfig) -> dict:
    d = asdict(config)
    d["schemes"] = [asdict(s) for s in config.schemes]
    return d


def format_table(doc: dict) -> str:
    lines = [f"{'scheme':<52} {'bits':>6} {'B/token':>8} {'saving':>7} {'ppl':>9} "
             f"{'change':>9} {'attn err':>9}"]
    for r in doc["schemes"]:
        lines.append(f"{r['name']:<52} {r['bits']:>6.3g} {r['kv_bytes_per_token']:>8} {r['saving']:>7.1%} "
                     f"{r['ppl']:>9.4f} {_pct(r['ppl_delta_pct']):>9} {r['attn_err']:>9.2e}")
    if doc["concurrency"]:
        lines += ["",
                  f"{'format':<24} {'blocks':>7} {'max running':>12} {'mean':>6} {'preempt':>8} {'tok/s':>8}"]
        for c in doc["concurrency"]:
            lines.append(f"{c['kv_cache_dtype']:<24} {c['num_blocks']:>7} {c['max_running']:>12} "
                         f"{c['mean_running']:>6.2f} {c['preemptions']:>8} {c['output_tokens_per_s']:>8.1f}")
    return "\n".join(lines)


def fp8_rows(doc: dict) -> list[dict]:
    """The schemes notebook 06 is about: fp32, the 16-bit caches and every FP8 variant."""
    return [r for r in doc["schemes"] if r["kv_cache_dtype"].startswith(("fp8", "float", "bfloat", "fp32"))]


def format_fp8_full_run(path: Path, doc: dict) -> str:
    """A kept run (results/quant.json) as notebook 06 shows it: where it ran, its FP8 rows and its
    concurrency rows."""
    env, conf = doc["environment"], doc["config"]
    lines = [f"{path.name}: {conf['num_chunks']} chunks x {conf['chunk_len']} tokens of "
             f"{doc['corpus']['name']}; machine: {env['device']} ({env['device_name']}, {env['cpu_model']})",
             f"{'scheme':<52}{'bits':>6}{'saving':>8}{'perplexity':>12}{'change':>9}{'attn err':>10}"]
    for r in fp8_rows(doc):
        change = "-" if r["ppl_delta_pct"] is None else f"{r['ppl_delta_pct']:+.2f}%"
        saving = "-" if r["kv_cache_dtype"] == "fp32" else f"{r['saving']:.0%}"
        lines.append(f"{r['name']:<52}{r['bits']:>6.3g}{saving:>8}{r['ppl']:>12.4f}{change:>9}{r['attn_err']:>10.2e}")
    for r in fp8_rows(doc):
        if r["kv_cache_dtype"] == "fp8_per_token_head":  # its scales are the bits past 8
            lines.append(f"  ({r['name']}: {r['bits']:.3g} bits with radarlab's fp16 scales; vLLM's fp32 "
                         f"scales would make it {8 + 2 * (r['bits'] - 8):.3g})")
    for c in doc["concurrency"]:
        lines.append(f"concurrency {c['kv_cache_dtype']:<12} {c['num_blocks']:>5} blocks, "
                     f"at most {c['max_running']} running, {c['mean_running']:.2f} on average, "
                     f"{c['output_tokens_per_s']:.1f} tokens/s")
    return "\n".join(lines)


def format_kept_source(path: Path, doc: dict) -> str:
    """Notebook 07's line naming a kept run: the file, its size and the machine."""
    env = doc["environment"]
    return (f"{path.parent.name}/{path.name}: {doc['config']['num_chunks']} x "
            f"{doc['config']['chunk_len']} tokens on {env['device']} ({env['cpu_model']})")


def format_pareto_rows(rows: list[dict]) -> str:
    """Notebook 07's table of perplexity against bytes, for a kept run's schemes or its live ones."""
    lines = [f"{'scheme':<46} {'bits':>5} {'bytes/token':>12} {'saving':>7} {'ppl':>8} {'change':>8}"]
    for r in rows:
        lines.append(f"{r['name']:<46} {r['bits']:>5.3g} {r['kv_bytes_per_token_at_len']:>12.0f} "
                     f"{r['saving_at_len']:>7.1%} {r['ppl']:>8.3f} {r['ppl_delta_pct']:>+7.2f}%")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = QuantBenchConfig()
    parser.add_argument("--json", metavar="PATH", help="write parameters, environment and results as JSON")
    parser.add_argument("--quick", action="store_true",
                        help="a small run (2 x 64 tokens, short requests) for tests")
    parser.add_argument("--num-chunks", type=int, default=None, help=f"chunks scored ({c.num_chunks})")
    parser.add_argument("--chunk-len", type=int, default=None, help=f"tokens per chunk ({c.chunk_len})")
    parser.add_argument("--schemes", default=None,
                        help="comma-separated kv_cache_dtype names to keep (default: every scheme)")
    parser.add_argument("--concurrency-dtypes", default=None,
                        help="formats for the concurrency rows "
                             f"({','.join(c.concurrency_dtypes)}); '' for none")
    parser.add_argument("--num-requests", type=int, default=None,
                        help=f"concurrency requests ({c.num_requests})")
    parser.add_argument("--model", default=None, help="HF model id or directory (default: the course model)")


def config_from_args(args: argparse.Namespace) -> QuantBenchConfig:
    config = QuantBenchConfig(**QUICK) if args.quick else QuantBenchConfig()
    changes = {name: getattr(args, name) for name in ("num_chunks", "chunk_len", "num_requests", "model")
               if getattr(args, name) is not None}
    if args.chunk_len is not None and args.chunk_len < config.attn_tokens:
        changes["attn_tokens"] = args.chunk_len
    if args.schemes is not None:
        keep = {x.strip() for x in args.schemes.split(",") if x.strip()} | {BASELINE}
        unknown = keep - {s.kv_cache_dtype for s in config.schemes}
        if unknown:
            raise ValueError(f"schemes: {sorted(unknown)} are not among "
                             f"{sorted({s.kv_cache_dtype for s in config.schemes})}")
        changes["schemes"] = tuple(s for s in config.schemes if s.kv_cache_dtype in keep)
    if args.concurrency_dtypes is not None:
        changes["concurrency_dtypes"] = tuple(x.strip() for x in args.concurrency_dtypes.split(",")
                                              if x.strip())
    return replace(config, **changes)


def main(args: argparse.Namespace) -> int:
    from radarlab.bench.report import write_json
    from radarlab.lab.machine import environment

    config = config_from_args(args)
    doc = run(config)
    doc["environment"] = environment()
    print(format_table(doc))
    if args.json:
        write_json(args.json, doc)
    return 0
