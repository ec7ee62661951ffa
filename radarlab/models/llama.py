"""Our own Llama-family forward pass in plain torch: RMSNorm, RoPE, GQA attention, SwiGLU, tied embeddings.

Weights come from a Hugging Face model; the computation is ours. The KV cache is an argument: any
object with `attend(layer, q, k, v, meta, scale)` that stores this step's K/V and returns attention
over the sequence's context. The contiguous cache and the paged cache both fit that seam, so the
model never knows how its memory is laid out.

Tokens are packed: input_ids and positions are flat [T] tensors holding every sequence's new tokens
back to back, described by an AttentionMetadata.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as nn_module  # its global hook registries

from radarlab.attention.backends import attention_forward, ensure_built
from radarlab.attention.metadata import AttentionMetadata
from radarlab.cpu_ops import cpu_ops_available, load_cpu_ops
from radarlab.models.linear import Linear, PackedWeight, fused_linear
from radarlab.util import require_int

SUPPORTED_MODEL_TYPES = {"llama"}


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    rope_scaling: tuple | None = None  # llama3-style scaling as sorted (key, value) pairs

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            require_int(name, getattr(self, name))
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, hf) -> "LlamaConfig":
        if getattr(hf, "model_type", None) not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {getattr(hf, 'model_type', None)!r} is not supported; expected one "
                             f"of {sorted(SUPPORTED_MODEL_TYPES)}")
        rope = getattr(hf, "rope_scaling", None) or getattr(hf, "rope_parameters", None)
        rope_type = (rope or {}).get("rope_type", (rope or {}).get("type", "default"))
        theta = getattr(hf, "rope_theta", None) or (rope or {}).get("rope_theta", 10000.0)
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"rope scaling {rope_type!r} is not supported (default and llama3 are)")
        scaling = None
        if rope_type == "llama3":
            scaling = tuple(sorted((k, v) for k, v in rope.items() if isinstance(v, (int, float))))
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=hf.num_attention_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            rope_theta=float(theta),
            max_position_embeddings=hf.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(hf, "attention_bias", False)),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            rope_scaling=scaling,
        )


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in fp32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        """ops: radarlab's C++ operators (Llama.cpu_ops), which do the same in one pass; None: torch."""
        if ops is not None:  # x: [tokens, hidden], the residual stream
            return ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor, ops) -> torch.Tensor:
        """x += delta (in place: the residual stream), then the norm of x; one pass with ops."""
        return ops.add_rms_norm(x, delta, self.weight, self.eps)


def rope_inv_freq(config: LlamaConfig) -> torch.Tensor:
    """Per-pair rotation frequencies theta^(-2i/d), with llama3's long-context rescaling if configured."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
    if config.rope_scaling is None:
        return inv_freq
    s = dict(config.rope_scaling)
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = old_len / low, old_len / high
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    mid = (1 - smooth) * scaled / factor + smooth * scaled
    is_mid = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_mid, mid, scaled)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+d/2}) by the position's angle. x: [T, H, D]; cos, sin: [T, D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        bias = config.attention_bias
        self.q_proj = Linear(config.hidden_size, config.num_heads * config.head_dim, bias=bias)
        self.k_proj = Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.v_proj = Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=bias)
        self.o_proj = Linear(config.num_heads * config.head_dim, config.hidden_size, bias=bias)
        self.qkv_packed = PackedWeight()  # q, k and v stacked, for one GEMM (radarlab.models.linear)
        self.scale = config.head_dim ** -0.5

    def forward(self, x, cos, sin, kv_cache, meta: AttentionMetadata, ops=None) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = fused_linear(x, (self.q_proj, self.k_proj, self.v_proj), self.qkv_packed, ops)
        q, k = q.view(t, self.num_heads, self.head_dim), k.view(t, self.num_kv_heads, self.head_dim)
        if ops is not None and not (self.q_proj._forward_hooks or self.k_proj._forward_hooks):
            ops.rotary_embedding(q, k, cos, sin)  # in place, in the qkv GEMM's output: no hook holds q or k
        else:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        out = attention_forward(kv_cache, self.layer, q, k, v, meta, self.scale)
        return self.o_proj(out.reshape(t, self.num_heads * self.head_dim), ops)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        bias = config.mlp_bias
        self.gate_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.up_proj = Linear(config.hidden_size, config.intermediate_size, bias=bias)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.gate_up_packed = PackedWeight()  # gate and up stacked, for one GEMM

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        gate, up = fused_linear(x, (self.gate_proj, self.up_proj), self.gate_up_packed, ops)
        if ops is None:
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(ops.silu_and_mul(gate, up), ops)


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, kv_cache, meta, ops=None):
        """With ops (radarlab's C++ operators), x, the residual stream, is updated in place: the
        attention's output is added to it in the same pass as the next norm, as vLLM does."""
        if ops is None:
            x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_cache, meta)
            return x + self.mlp(self.post_attention_layernorm(x))
        h = self.self_attn(self.input_layernorm(x, ops), cos, sin, kv_cache, meta, ops)
        return x.add_(self.mlp(self.post_attention_layernorm.add_forward(x, h, ops), ops))


class Llama(nn.Module):
    """Parameter names follow transformers' LlamaForCausalLM so its state dict loads directly."""

    def __init__(self, config: LlamaConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
        self.use_cpu_ops: bool | None = None  # None: radarlab's C++ operators wherever they can be built

    def cpu_ops(self, x: torch.Tensor):
        """radarlab's C++ operators (radarlab.cpu_ops: RMSNorm, SwiGLU's gate and RoPE fused, each in
        one pass; vLLM's CPU backend fuses the same three) for a forward pass on x, or None for the
        torch code. They run only on a CPU and only without autograd. They update the residual stream
        in place, so a forward hook on the embedding or on a layer (which could hold it) turns them
        off, and Attention rotates q and k in place only where q_proj and k_proj have no hook.
        use_cpu_ops=False turns them off, True insists (and raises where they cannot be built)."""
        if self.use_cpu_ops is False or x.device.type != "cpu" or torch.is_grad_enabled() or self._hooked():
            return None
        if self.use_cpu_ops is None and not cpu_ops_available(x.device):
            return None
        return load_cpu_ops()

    def _hooked(self) -> bool:
        """Does a forward hook see the residual stream: a global one, or one on the embedding or a layer."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in (self.embed_tokens, *self.layers))

    @classmethod
    def from_hf(cls, hf_model) -> "Llama":
        """Copy the weights of a transformers LlamaForCausalLM (same dtype and device)."""
        config = LlamaConfig.from_hf(hf_model.config)
        ref = next(hf_model.parameters())
        with torch.device("meta"):
            model = cls(config)
        state = {name.removeprefix("model."): t for name, t in hf_model.state_dict().items()}
        if config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        model = model.to_empty(device=ref.device)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError("weights do not match the Llama layout: missing "
                             f"{missing}, unexpected {unexpected}")
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.inv_freq = rope_inv_freq(config).to(ref.device)
        return model.to(ref.dtype).eval()

    @classmethod
    def from_pretrained(cls, name_or_path=None, dtype=torch.float32, device="cpu"):
        """(our model, tokenizer) for any Llama-family HF id or directory; None means the course model."""
        from radarlab.models.loader import load_hf

        hf, tok = load_hf(name_or_path, dtype=dtype, device=device)
        return cls.from_hf(hf), tok

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache,
        meta: AttentionMetadata,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits [T, vocab] for packed tokens, or only for the rows in logits_indices."""
        check_inputs(self.config, input_ids, positions, meta)
        meta = ensure_built(kv_cache, meta)  # validated and planned once, not in each of the layers
        x = self.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        ops = self.cpu_ops(x)
        for layer in self.layers:
            x = layer(x, cos, sin, kv_cache, meta, ops)
        x = self.norm(x, ops)
        if logits_indices is not None:
            x = x[logits_indices]
        return self.lm_head(x, ops)


def check_inputs(config: LlamaConfig, input_ids: torch.Tensor, positions: torch.Tensor,
                 meta: AttentionMetadata) -> None:
    """A forward pass's packed inputs: matching 1-D ids and positions, as many as the metadata
    describes, no position past the model's context. ValueError naming what is wrong."""
    if input_ids.dim() != 1 or positions.shape != input_ids.shape:
        raise ValueError("input_ids and positions must be matching 1-D tensors, got "
                         f"{tuple(input_ids.shape)} and {tuple(positions.shape)}")
    if input_ids.numel() != meta.num_tokens:
        raise ValueError(f"{input_ids.numel()} tokens but the metadata describes {meta.num_tokens}")
    if input_ids.numel() and int(positions.max()) >= config.max_position_embeddings:
        raise ValueError(f"position {int(positions.max())} is past the model's maximum context "
                         f"({config.max_position_embeddings} tokens)")


def final_features(model: Llama, input_ids, positions, kv_cache, meta) -> torch.Tensor:
    """The normed last hidden states [T, hidden] of packed tokens: what the LM head reads, and what an
    EAGLE-style draft head (radarlab.spec_decode.draft_head) reads as the target's features."""
    meta = ensure_built(kv_cache, meta)
    x = model.embed_tokens(input_ids)
    cos, sin = model.rope(positions, x.dtype)
    ops = model.cpu_ops(x)
    for layer in model.layers:
        x = layer(x, cos, sin, kv_cache, meta, ops)
    return model.norm(x, ops)
