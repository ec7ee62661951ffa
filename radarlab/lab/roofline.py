"""Why decode is memory-bandwidth bound: the arithmetic intensity of one decode step (a roofline model).

One decode step produces one token for each of B sequences. It must read every weight once (shared by
the whole batch) and, for each sequence, that sequence's whole KV cache (shared by nobody). It does
about 2 FLOPs per weight per token, plus 4 x heads x head_dim FLOPs per context token per layer for
attention. So

    intensity(B) = B * flops_per_token / (weight_bytes + B * kv_bytes_per_sequence)   [FLOP/byte]

Batching raises intensity only while the weights dominate the bytes; once B * KV outweighs them, the
intensity stops at flops_per_token / kv_bytes_per_sequence, whatever the batch. A chip whose
peak FLOP/s divided by bandwidth (its ridge point) is above that is waiting on memory.

This is a first-order model: activations, norms, embeddings rows and the KV write are left out
(each is small next to the weights or the KV read). Measuring a machine's peak and bandwidth, and
timing real decode steps against this model, is radarlab.lab.measure's job.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from radarlab.kvcache.memory import kv_bytes_per_token
from radarlab.util import require_int

_WEIGHT_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2, "fp8": 1, "int8": 1, "int4": 0.5}


@dataclass(frozen=True)
class TransformerDims:
    """The numbers of a Llama-family config that set a decode step's FLOPs and bytes."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            require_int(name, getattr(self, name))
        if self.heads % self.kv_heads:
            raise ValueError(f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})")

    @classmethod
    def from_config(cls, config) -> "TransformerDims":
        """From radarlab's LlamaConfig or a transformers config."""
        if hasattr(config, "num_layers"):  # radarlab.models.llama.LlamaConfig
            return cls(config.num_layers, config.hidden_size, config.intermediate_size, config.num_heads,
                       config.num_kv_heads, config.head_dim, config.vocab_size, config.tie_word_embeddings)
        heads = config.num_attention_heads
        return cls(config.num_hidden_layers, config.hidden_size, config.intermediate_size, heads,
                   getattr(config, "num_key_value_heads", None) or heads,
                   getattr(config, "head_dim", None) or config.hidden_size // heads, config.vocab_size,
                   bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def layer_matmul_params(self) -> int:
        """q, k, v, o projections and the SwiGLU MLP's gate, up and down of one layer."""
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        return attn + 3 * self.hidden * self.intermediate

    @property
    def matmul_params(self) -> int:
        """Weights every decode step multiplies by: all layers plus the LM head."""
        return self.layers * self.layer_matmul_params + self.vocab * self.hidden

    @property
    def params(self) -> int:
        """All parameters (norms included, tied embeddings counted once)."""
        embed = self.vocab * self.hidden * (1 if self.tied_embeddings else 2)
        return self.layers * (self.layer_matmul_params + 2 * self.hidden) + self.hidden + embed


# The article's model: 80 layers, 8 KV heads, head dim 128 is the shape of Llama-2/3 70B
# (hidden 8192, MLP 28672, 64 query heads; vocab 128,256 as in Llama 3). About 70.6 B parameters.
LLAMA_70B = TransformerDims(layers=80, hidden=8192, intermediate=28672, heads=64, kv_heads=8,
                            head_dim=128, vocab=128256)


@dataclass(frozen=True)
class DecodeStep:
    """FLOPs and bytes of one decode step of `batch` sequences, each with `context` tokens of KV."""

    batch: int
    context: int
    flops: float
    weight_bytes: float
    kv_bytes: float

    @property
    def bytes(self) -> float:
        return self.weight_bytes + self.kv_bytes

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved from memory."""
        return self.flops / self.bytes

    def time_bound_s(self, peak_flops: float, bandwidth: float) -> float:
        """Roofline lower bound on the step's time: the slower of computing and reading."""
        return max(self.flops / peak_flops, self.bytes / bandwidth)


def flops_per_token(dims: TransformerDims, context: int) -> float:
    """2 FLOPs per weight (multiply-add) plus attention's QK^T and PV over the context."""
    attention = 4 * dims.layers * dims.heads * dims.head_dim * require_int("context", context)
    return 2 * dims.matmul_params + attention


def decode_step(dims: TransformerDims, batch: int, context: int, weight_dtype: str = "bf16",
                kv_dtype: str = "bf16", group_size: int = 128, query_len: int = 1) -> DecodeStep:
    """Cost of one decode step: weights read once per step, each sequence's KV read once.

    query_len > 1 is a speculative verify step: each sequence runs its last token and query_len - 1
    drafts in one pass, so the FLOPs grow query_len times while the bytes stay those of one step."""
    batch = require_int("batch", batch)
    query_len = require_int("query_len", query_len)
    if weight_dtype not in _WEIGHT_BYTES:
        raise ValueError(f"weight_dtype must be one of {sorted(_WEIGHT_BYTES)}, got {weight_dtype!r}")
    # Any kv_cache_dtype of the table of formats (radarlab.quant.formats), scales and zero points counted.
    per_token_kv = kv_bytes_per_token(dims.layers, dims.kv_heads, dims.head_dim, kv_dtype, group_size)
    return DecodeStep(
        batch=batch,
        context=context,
        flops=batch * query_len * flops_per_token(dims, context),
        weight_bytes=dims.matmul_params * _WEIGHT_BYTES[weight_dtype],
        kv_bytes=batch * context * per_token_kv,
    )


def intensity_limit(dims: TransformerDims, context: int, weight_dtype: str = "bf16",
                    kv_dtype: str = "bf16") -> float:
    """The intensity an infinite batch approaches: FLOPs per token over one sequence's KV bytes."""
    one = decode_step(dims, 1, context, weight_dtype, kv_dtype)
    return one.flops / one.kv_bytes


def ridge_point(peak_flops: float, bandwidth: float) -> float:
    """FLOP/byte at which a chip turns from memory-bound to compute-bound."""
    return peak_flops / bandwidth


# ---------------------------------------------------------------------------------------------------
# Preemption: swap the KV out and back, or drop it and recompute?

def prefill_flops(dims: TransformerDims, context: int) -> float:
    """FLOPs of one prefill over `context` tokens: 2 per layer weight per token, causal attention
    (token t attends to t + 1 positions: QK^T and PV are 4 * layers * heads * head_dim FLOPs per
    pair, about 2 * layers * heads * head_dim * context**2 in all), and the LM head for the last
    token only."""
    context = require_int("context", context)
    layer_weights = dims.matmul_params - dims.vocab * dims.hidden
    pairs = context * (context + 1) / 2
    return (2 * layer_weights * context + 4 * dims.layers * dims.heads * dims.head_dim * pairs
            + 2 * dims.vocab * dims.hidden)


@dataclass(frozen=True)
class PreemptionCost:
    """Seconds to bring back a preempted request of `context` tokens, two ways. Swap copies its KV to
    host memory and back over the link (2 x KV bytes); recompute runs its prefill again."""
    context: int
    kv_bytes: float
    swap_s: float
    recompute_s: float


def preemption_cost(dims: TransformerDims, context: int, link_bytes_per_s: float, flops_per_s: float,
                    kv_dtype: str = "bf16") -> PreemptionCost:
    """Roofline estimates: the copy runs at the link's bandwidth, the prefill at the device's FLOP/s
    (a prefill is compute-bound), with no overlap and no fixed costs."""
    kv = require_int("context", context) * kv_bytes_per_token(dims.layers, dims.kv_heads, dims.head_dim,
                                                              kv_dtype)
    return PreemptionCost(context, kv, 2 * kv / link_bytes_per_s, prefill_flops(dims, context) / flops_per_s)


def swap_recompute_crossover(dims: TransformerDims, link_bytes_per_s: float, flops_per_s: float,
                             kv_dtype: str = "bf16") -> float | None:
    """The context length above which swapping beats recomputing, or None if swapping wins at any length.

    Per token, swap costs a constant 2 * kv_bytes_per_token / link, while recompute costs
    2 * weights / flops plus an attention term that grows with the context. So recompute wins for short
    contexts only if its per-token weight FLOPs are cheaper than the copy; the crossover is where the
    two totals meet (the positive root of a quadratic)."""
    kv = kv_bytes_per_token(dims.layers, dims.kv_heads, dims.head_dim, kv_dtype)
    layer_weights = dims.matmul_params - dims.vocab * dims.hidden
    # recompute(n) - swap(n) = a n^2 + b n + c, from prefill_flops; swap(n) = 2 kv n / link
    a = 2 * dims.layers * dims.heads * dims.head_dim / flops_per_s
    b = ((2 * layer_weights + 2 * dims.layers * dims.heads * dims.head_dim) / flops_per_s
         - 2 * kv / link_bytes_per_s)
    c = 2 * dims.vocab * dims.hidden / flops_per_s
    disc = b * b - 4 * a * c
    if b >= 0 or disc < 0:
        return None  # recompute costs more than the copy at every length
    return (-b + math.sqrt(disc)) / (2 * a)
