"""The KV-cache calculator: how many bytes one token's keys and values take, and how many streams fit.

Every decoder layer keeps, for every token of context, one key and one value vector per KV head. So

    values per token = layers x kv_heads x head_dim x 2 (K and V)
    bytes per token  = values per token x bytes per value

FP16/BF16 store 2 bytes per value and FP8 one. INT4 stores half a byte per value, plus, for each group
of `group_size` values, the fp16 scale and fp16 zero point needed to dequantize it: 4 bytes per group,
i.e. 0.5 + 4/g bytes per value. Articles often quote the bare 0.5; the calculator shows both.
Those numbers are not kept here: every format (kv_cache_dtype) and its costs come from the one table
in radarlab.quant.formats, which the paged cache, the roofline and the notebook widget read too.

Sizes are in decimal gigabytes (1 GB = 10^9 bytes), as the article and GPU spec sheets use.
Everything here is exact integer arithmetic on bytes; rounding happens only when printing.
Run `python -m radarlab.kvcache.memory --help` for the command-line version; `--model` reads the three
numbers from a Hugging Face config (a path, a hub id, or a stored name such as llama-3.1-70b).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from radarlab.kvcache.model_config import load_model_config, stored_config, stored_config_names
from radarlab.quant.formats import DEFAULT_GROUP_SIZE, KV_CACHE_DTYPES, kv_format
from radarlab.util import cdiv, require_int, require_number

GB = 10**9  # decimal gigabyte
GIB = 2**30  # binary gibibyte (what nvidia-smi and torch report)

KV_DTYPES = KV_CACHE_DTYPES  # every base name of the table of formats (radarlab.quant.formats)


def kv_values_per_token(layers: int, kv_heads: int, head_dim: int) -> int:
    """Numbers stored per token of context: one K and one V vector per KV head per layer."""
    return (require_int("layers", layers) * require_int("kv_heads", kv_heads)
            * require_int("head_dim", head_dim) * 2)


def payload_bytes_per_value(kv_dtype: str) -> float:
    """2 for fp16/bf16, 1 for fp8, 0.5 for int4 (metadata not included), from the table of formats."""
    return kv_format(kv_dtype).payload_bytes_per_value()


def int4_overhead_bytes_per_value(group_size: int) -> float:
    """An fp16 scale and an fp16 zero point shared by each group of g values: 4/g bytes per value."""
    return kv_format("int4", require_int("group_size", group_size)).metadata_bytes_per_group / group_size


def int4_bytes_per_value(group_size: int) -> float:
    """What INT4 really costs per value once scales and zero points are counted: 0.5 + 4/g."""
    return payload_bytes_per_value("int4") + int4_overhead_bytes_per_value(group_size)


@dataclass(frozen=True)
class KVFootprint:
    """The calculator's answer for one model shape, format and context length. Bytes are exact ints."""

    layers: int
    kv_heads: int
    head_dim: int
    tokens: int
    kv_dtype: str
    group_size: int | None  # only for formats with groups (int4, kivi)
    payload_bytes_per_token: int
    overhead_bytes_per_token: int  # scales and zero points stored per token; 0 for 16-bit and per-tensor fp8
    residual_bytes_per_stream: int = 0  # kivi: the residual window's 16-bit tokens, beyond their 4-bit cost
    sink_bytes_per_stream: int = 0  # sink<N>: 16-bit copies of the first N tokens, on top of their codes

    @property
    def bytes_per_token(self) -> int:
        return self.payload_bytes_per_token + self.overhead_bytes_per_token

    @property
    def payload_bytes_per_stream(self) -> int:
        return self.payload_bytes_per_token * self.tokens

    @property
    def overhead_bytes_per_stream(self) -> int:
        return (self.overhead_bytes_per_token * self.tokens + self.residual_bytes_per_stream
                + self.sink_bytes_per_stream)

    @property
    def bytes_per_stream(self) -> int:
        return (self.bytes_per_token * self.tokens + self.residual_bytes_per_stream
                + self.sink_bytes_per_stream)

    @property
    def gb_per_stream(self) -> float:
        return self.bytes_per_stream / GB

    @property
    def payload_gb_per_stream(self) -> float:
        return self.payload_bytes_per_stream / GB

    @property
    def overhead_gb_per_stream(self) -> float:
        return self.overhead_bytes_per_stream / GB


def kv_footprint(layers: int, kv_heads: int, head_dim: int, tokens: int, kv_dtype: str = "fp16",
                 group_size: int | None = DEFAULT_GROUP_SIZE) -> KVFootprint:
    """Bytes per token and per stream of `tokens` context, read from the table of formats.
    group_size applies to formats with groups whose name gives none ("int4", not "int4_g64")."""
    values = kv_values_per_token(layers, kv_heads, head_dim)
    tokens = require_int("tokens", tokens)
    if group_size is not None:
        require_int("group_size", group_size)
    fmt = kv_format(kv_dtype, group_size)
    payload, overhead = fmt.bytes_per_token_head(head_dim)  # one token, one head, K and V
    heads = values // (2 * head_dim)  # layers x kv_heads
    payload, overhead = payload * heads, overhead * heads
    if payload.denominator != 1 or overhead.denominator != 1:
        raise ValueError(f"{fmt.name} does not store a whole number of bytes per "
                         f"token with head_dim {head_dim}")
    # kivi's newest tokens wait in 16-bit: 2 bytes for each of K's and V's head_dim values, not their
    # 4-bit cost
    residual = min(fmt.residual, tokens)
    extra = residual * (heads * 4 * head_dim - (payload + overhead))
    # the sink's 16-bit copies are kept beside the codes of the same tokens: their full 16-bit cost, once
    sink = fmt.sink_bytes_per_stream(layers, kv_heads, head_dim) if fmt.is_quantized else 0
    return KVFootprint(layers, kv_heads, head_dim, tokens, kv_dtype, fmt.group_size,
                       int(payload), int(overhead),
                       int(extra), sink)


def kv_bytes_per_token(layers: int, kv_heads: int, head_dim: int, kv_dtype: str = "fp16",
                       group_size: int | None = DEFAULT_GROUP_SIZE) -> int:
    """Total bytes one token of context occupies across all layers (int4 metadata included)."""
    return kv_footprint(layers, kv_heads, head_dim, 1, kv_dtype, group_size).bytes_per_token


def kv_gb_per_stream(layers: int, kv_heads: int, head_dim: int, tokens: int, kv_dtype: str = "fp16",
                     group_size: int | None = DEFAULT_GROUP_SIZE) -> float:
    """Decimal GB one stream of `tokens` context holds (int4 metadata included)."""
    return kv_footprint(layers, kv_heads, head_dim, tokens, kv_dtype, group_size).gb_per_stream


def kv_budget_gb(gpu_mem_gb: float, weights_gb: float = 0.0) -> float:
    """Memory left for the KV cache: GPU memory minus the weights (negative when weights do not fit)."""
    return require_number("gpu_mem_gb", gpu_mem_gb,
                          positive=True) - require_number("weights_gb", weights_gb, 0)


def max_concurrent_streams(gpu_mem_gb: float, weights_gb: float, gb_per_stream: float) -> int:
    """Whole streams whose full context fits beside the weights. 0 when the weights alone do not fit.

    An upper bound: a real server also needs activations, CUDA graphs and fragmentation headroom
    (vLLM keeps 1 - gpu_memory_utilization of the GPU free, 10% by default)."""
    per = require_number("gb_per_stream", gb_per_stream, positive=True)
    left = kv_budget_gb(gpu_mem_gb, weights_gb)
    if left <= 0:
        return 0
    # Compare in bytes so that 48 GB / 12 GB is exactly 4, not 3.9999.
    return int(round(left * GB) // round(per * GB))


@dataclass(frozen=True)
class KVModelShape:
    """The three numbers of a model config that size its KV cache."""

    layers: int
    kv_heads: int
    head_dim: int


def shape_from_hf_config(config) -> KVModelShape:
    """Read num_hidden_layers, num_key_value_heads and head_dim from a transformers config (or a
    config.json dict). Older configs have no head_dim (it is hidden_size / num_attention_heads) and
    models without GQA have no num_key_value_heads (every head keeps its own K and V)."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    text = get("text_config")  # multimodal configs nest the language model's numbers
    if text is not None and get("num_hidden_layers") is None:
        return shape_from_hf_config(text)
    layers = get("num_hidden_layers")
    if layers is None:
        raise ValueError("config has no num_hidden_layers; is it a decoder-only language model config?")
    heads = get("num_attention_heads")
    kv_heads = get("num_key_value_heads") or heads
    if kv_heads is None:
        raise ValueError("config has neither num_key_value_heads nor num_attention_heads")
    head_dim = get("head_dim")
    if not head_dim:
        hidden = get("hidden_size")
        if hidden is None or not heads:
            raise ValueError("config has no head_dim, and no hidden_size / num_attention_heads to derive it")
        if hidden % heads:
            raise ValueError(f"hidden_size ({hidden}) is not divisible by num_attention_heads ({heads})")
        head_dim = hidden // heads
    if heads and heads % kv_heads:
        raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                         f"num_key_value_heads ({kv_heads})")
    return KVModelShape(require_int("num_hidden_layers", layers),
                        require_int("num_key_value_heads", kv_heads),
                        require_int("head_dim", head_dim))


def shape_from_model(model: str, local_files_only: bool = False) -> tuple[str, KVModelShape]:
    """A name for the report and the KV shape of `model`: a directory with config.json, a config.json
    file, a stored name (llama-3.1-70b, ...) or a hub id. Errors start with "model" and name it."""
    found = load_model_config(model, local_files_only)
    try:
        return found.name, shape_from_hf_config(found.config)
    except ValueError as err:
        raise ValueError(f"model {model!r}: {err}") from None


def stored_shapes() -> dict[str, KVModelShape]:
    """{short name: KV shape} of every stored config (what the widget's model dropdown offers)."""
    return {name: shape_from_hf_config(stored_config(name)) for name in stored_config_names()}


def kv_report(layers: int, kv_heads: int, head_dim: int, tokens: int, kv_dtype: str = "fp16",
              group_size: int | None = DEFAULT_GROUP_SIZE, gpu_mem_gb: float | None = None,
              weights_gb: float = 0.0, model: str | None = None) -> dict:
    """Everything the CLI prints, as plain numbers (what --json writes). `model` only names the shape."""
    fp = kv_footprint(layers, kv_heads, head_dim, tokens, kv_dtype, group_size)
    out = {"model": model} if model else {}
    out.update(asdict(fp))
    out.update(
        values_per_token=kv_values_per_token(layers, kv_heads, head_dim),
        bytes_per_token=fp.bytes_per_token,
        payload_bytes_per_stream=fp.payload_bytes_per_stream,
        overhead_bytes_per_stream=fp.overhead_bytes_per_stream,
        bytes_per_stream=fp.bytes_per_stream,
        payload_gb_per_stream=fp.payload_gb_per_stream,
        overhead_gb_per_stream=fp.overhead_gb_per_stream,
        gb_per_stream=fp.gb_per_stream,
    )
    if gpu_mem_gb is not None:
        budget = kv_budget_gb(gpu_mem_gb, weights_gb)
        out.update(
            gpu_mem_gb=float(gpu_mem_gb),
            weights_gb=float(weights_gb),
            kv_budget_gb=budget,
            weights_fit=budget > 0,
            max_concurrent_streams=max_concurrent_streams(gpu_mem_gb, weights_gb, fp.gb_per_stream),
        )
    return out


def format_report(r: dict) -> str:
    """The human-readable version of kv_report's dict."""
    fmt = r["kv_dtype"] + (f" (group {r['group_size']})" if r["group_size"] else "")
    lines = [f"model: {r['model']}"] if r.get("model") else []
    lines += [f"KV cache: {r['layers']} layers x {r['kv_heads']} KV heads x head dim "
              f"{r['head_dim']} x 2 (K and V), {fmt}"]
    if r["overhead_bytes_per_token"]:
        lines.append(f"  bytes per token:  {r['payload_bytes_per_token']:,} payload + "
                     f"{r['overhead_bytes_per_token']:,} scales/zero points = {r['bytes_per_token']:,}")
        lines.append(f"  per stream ({r['tokens']:,} tokens): {r['payload_gb_per_stream']:.2f} GB payload + "
                     f"{r['overhead_gb_per_stream']:.2f} GB scales/zero points = {r['gb_per_stream']:.2f} GB")
    else:
        lines.append(f"  bytes per token:  {r['bytes_per_token']:,}")
        lines.append(f"  per stream ({r['tokens']:,} tokens): {r['gb_per_stream']:.2f} GB")
    if "max_concurrent_streams" in r:
        lines.append(f"  KV budget: {r['gpu_mem_gb']:.2f} GB GPU - {r['weights_gb']:.2f} GB weights = "
                     f"{r['kv_budget_gb']:.2f} GB")
        if not r["weights_fit"]:
            lines.append("  the weights alone do not fit: 0 streams")
        else:
            lines.append(f"  max concurrent streams: {r['max_concurrent_streams']}")
    return "\n".join(lines)


def summary_line(r: dict) -> str:
    """One line for the widget's label."""
    if r["overhead_bytes_per_token"]:
        size = (f"{r['payload_gb_per_stream']:.2f} GB payload + {r['overhead_gb_per_stream']:.2f} GB "
                f"scales/zeros = {r['gb_per_stream']:.2f} GB per stream")
    else:
        size = f"{r['gb_per_stream']:.2f} GB per stream"
    text = f"{r['bytes_per_token']:,} bytes/token | {size}"
    if "max_concurrent_streams" in r:
        n = r["max_concurrent_streams"]
        fit = f"{n} stream{'s' * (n != 1)} fit{'s' * (n == 1)} in"
        if r["weights_fit"] and r["weights_gb"]:  # the room is what the weights leave, not the GPU
            text += (f" | {fit} the {r['kv_budget_gb']:.2f} GB left after {r['weights_gb']:.2f} GB of "
                     f"weights (GPU {r['gpu_mem_gb']:.2f} GB)")
        elif r["weights_fit"]:
            text += f" | {fit} {r['kv_budget_gb']:.2f} GB (all of the GPU: no weights counted)"
        else:
            text += f" | weights ({r['weights_gb']:.2f} GB) exceed the GPU ({r['gpu_mem_gb']:.2f} GB)"
    return text


def llama_parameters(config) -> int:
    """Weights of a Llama-family model from its config (embedding, attention, gated MLP, norms, and the
    LM head unless tied): what a GPU must hold before any KV block."""
    get = config.get if isinstance(config, dict) else (lambda k, d=None: getattr(config, k, d))
    hidden, inter, vocab = get("hidden_size"), get("intermediate_size"), get("vocab_size")
    if None in (hidden, inter, vocab):
        raise ValueError("config needs hidden_size, intermediate_size and vocab_size to count weights")
    shape = shape_from_hf_config(config)
    q = get("num_attention_heads") * shape.head_dim
    kv = shape.kv_heads * shape.head_dim
    layer = hidden * (2 * q + 2 * kv) + 3 * hidden * inter + 2 * hidden  # q, o, k, v; gate, up, down; norms
    embed = vocab * hidden
    return shape.layers * layer + hidden + embed * (1 if get("tie_word_embeddings", False) else 2)


@dataclass(frozen=True)
class ParallelFootprint:
    """One GPU of a tensor- (tp) and pipeline-parallel (pp) deployment, the busiest one. Every GPU holds
    its share of every stream's blocks, so streams counts the deployment's streams, not one GPU's."""

    tp: int
    pp: int
    kv_heads_per_gpu: int
    layers_per_gpu: int
    kv_bytes_per_stream_per_gpu: int
    weight_bytes_per_gpu: int
    kv_budget_bytes_per_gpu: int  # usable memory minus weights; negative when the weights do not fit
    streams: int

    @property
    def streams_per_gpu(self) -> float:
        return self.streams / (self.tp * self.pp)


def parallel_footprint(shape: KVModelShape, tokens: int, kv_dtype: str, tp: int, pp: int, weight_bytes: int,
                       gpu_bytes: int, gpu_memory_utilization: float = 0.9,
                       embedding_bytes: int = 0) -> ParallelFootprint:
    """vLLM's split: tensor parallelism gives each GPU kv_heads // tp KV heads of every layer (at least
    one: replicated when tp exceeds them, ModelConfig.get_num_kv_heads), pipeline parallelism each GPU
    a stage of about layers / pp layers (the largest stage counts: vllm.distributed.utils.get_pp_indices).
    Weights split the same way; the embedding and LM head (embedding_bytes of weight_bytes) sit on the
    first and last stage, split by tp. Every GPU keeps the same number of blocks (the smallest any rank
    affords, vllm/v1/core/kv_cache_utils.py), so the busiest GPU decides how many streams fit."""
    tp, pp = require_int("tp", tp), require_int("pp", pp)
    if shape.kv_heads % tp and tp % shape.kv_heads:
        raise ValueError(f"tp={tp} must divide the {shape.kv_heads} KV heads or be a multiple of them")
    if pp > shape.layers:
        raise ValueError(f"pp={pp} exceeds the model's {shape.layers} layers")
    require_number("gpu_memory_utilization", gpu_memory_utilization, positive=True)
    if gpu_memory_utilization > 1:
        raise ValueError(f"gpu_memory_utilization is a fraction of the GPU, got {gpu_memory_utilization}")
    heads, layers = max(1, shape.kv_heads // tp), cdiv(shape.layers, pp)
    kv = kv_footprint(layers, heads, shape.head_dim, tokens, kv_dtype).bytes_per_stream
    body = require_int("weight_bytes", weight_bytes, 0) - require_int("embedding_bytes", embedding_bytes, 0)
    ends = embedding_bytes if pp == 1 else embedding_bytes / 2  # embedding on stage 0, LM head on the last
    weights = int((body * layers / shape.layers + ends) / tp)
    budget = int(require_int("gpu_bytes", gpu_bytes) * gpu_memory_utilization) - weights
    return ParallelFootprint(tp, pp, heads, layers, kv, weights, budget, max(budget, 0) // kv)


_FLAGS = {name: "--" + name.replace("_", "-") for name in
          ("model", "layers", "kv_heads", "head_dim", "tokens", "kv_dtype", "group_size",
           "gpu_mem_gb", "weights_gb")}


_SHAPE_DEFAULTS = {"layers": 80, "kv_heads": 8, "head_dim": 128}  # the article's model


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m radarlab.kvcache.memory",
        description="KV-cache size per token and per stream, and how many streams fit on a GPU. "
                    "Defaults: the article's 80-layer GQA model at 32,768 tokens.",
    )
    p.add_argument("--model", default=None, metavar="ID_OR_PATH",
                   help="read layers, KV heads and head dim from a Hugging Face config: a directory "
                        "containing config.json, a config.json file, a hub id (needs network), or a "
                        "stored name: " + ", ".join(stored_config_names()))
    for name, default in _SHAPE_DEFAULTS.items():
        p.add_argument(_FLAGS[name], type=int, default=None, help=f"default {default}; not with --model")
    p.add_argument("--tokens", type=int, default=32768, help="context length of one stream")
    p.add_argument("--kv-dtype", default="fp16", metavar="KV_CACHE_DTYPE",
                   help="a kv_cache_dtype: " + ", ".join(KV_DTYPES) + " (options such as int4_g64_sym or "
                        "kivi_g32_r128: see radarlab.quant.formats)")
    p.add_argument("--group-size", type=int, default=DEFAULT_GROUP_SIZE,
                   help="int4/kivi without g<N> in the name: values sharing one scale (and zero "
                        "point); must divide head dim")
    p.add_argument("--gpu-mem-gb", type=float, default=None, help="GPU memory in decimal "
                                                                  "GB (e.g. 48 for two 4090s)")
    p.add_argument("--weights-gb", type=float, default=0.0, help="memory the model weights take, GB")
    p.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    given = {name: getattr(args, name) for name in _SHAPE_DEFAULTS if getattr(args, name) is not None}
    if args.model is not None and given:
        parser.error(f"--model sets --layers, --kv-heads and --head-dim from the config; give --model or "
                     f"those flags, not both (got {', '.join(_FLAGS[name] for name in given)})")
    try:
        if args.model is not None:
            name, shape = shape_from_model(args.model)
        else:
            name, shape = None, KVModelShape(**{**_SHAPE_DEFAULTS, **given})
        report = kv_report(shape.layers, shape.kv_heads, shape.head_dim, args.tokens, args.kv_dtype,
                           args.group_size, args.gpu_mem_gb, args.weights_gb, model=name)
    except ValueError as err:
        field, _, rest = str(err).partition(" ")
        if field == "kv_cache_dtype":
            field = "kv_dtype"
        if field in _FLAGS:  # name the flag the user typed, not the Python parameter
            field = _FLAGS[field]
        parser.error(f"{field} {rest}")  # exits with status 2 and the message
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
