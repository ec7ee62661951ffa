"""A replayed forward step for the CPU: the model's layers resolved once into the calls a step makes,
then run each step without the module machinery around them.

Why. A batch-1 decode step of the course model runs about 330 operator calls (11 per layer); around
them, eager PyTorch code spends time that is not arithmetic: nn.Module calls, hook checks, the packed
weights' fingerprints (radarlab.models.linear), the attention backend's dispatch and shape checks,
30 layers over. On a GPU vLLM removes such overhead with CUDA graphs (radarlab.engine.cudagraph);
on a CPU its default mode compiles the model with torch.compile. Compiling does not pay for
radarlab: Inductor cannot lower oneDNN's packed-weight linear (it has to stay an opaque call), and
each compiled region's call cost more than the C++ operator it would replace. So this does what a
CUDA graph does, by hand: capture resolves every weight to its packed oneDNN copy, every layer to
its slice of the pool and every operator to its handle; a replay calls the same operators in the
same order, so its logits are bit-identical to Llama.forward's (tests/models/test_replay.py).

What it covers: a Llama on a CPU with radarlab's C++ operators, over a 16/32-bit paged pool on the
torch backend (CpuBackend, or TorchSDPABackend where the pool's C++ write is off). Anything else
(quantized or rotated formats, Triton, a backend of one's own) runs Llama.forward; replay_refusal
says why. A matmul's path depends on its rows (radarlab's GEMV up to four, then oneDNN's packed GEMM,
or fp32 math for bf16 on a CPU without bf16 instructions from enough rows): each path is captured and
each step's rows pick one, by the eager model's rule (models/linear.py).

When it captures again. The capture holds the weights as they were. Each step compares every
parameter's storage and version counter with the capture's and captures again when one changed
(load_state_dict, in-place edits under no_grad); a write through `.data` is not seen, as in
Linear's packed copy. A hook anywhere in the model, or a global one, must see each call: while one is
registered, steps run Llama.forward. The Engine replays by default wherever this covers the
configuration (Engine(enforce_eager=True) turns it off, vLLM's name for the same switch): the work is
the eager model's, less its overhead, so no CPU kind is slower for it.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.modules import module as nn_module  # its global hook registries

from radarlab.attention.backends import BACKENDS, backend_of, ensure_built
from radarlab.cpu_ops import cpu_ops_available, load_cpu_ops
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.models.input_batch import StepInputs
from radarlab.models.linear import (
    GEMV_MAX_ROWS,
    Linear,
    PackedWeight,
    gemv_runs,
    packed_path,
    path_switch_rows,
    upcasts,
)
from radarlab.models.llama import Llama, check_inputs

REPLAYED_BACKENDS = (BACKENDS["cpu"], BACKENDS["torch_sdpa"])


def replay_refusal(model, cache, attn_backend=None) -> str | None:
    """Why a replayed step cannot run this configuration, or None when it can."""
    if type(model) is not Llama:
        return f"the model is a {type(model).__name__}, not radarlab's Llama"
    param = next(model.parameters())
    if param.device.type != "cpu":
        return f"the model is on {param.device}, not the CPU"
    if model.use_cpu_ops is False:
        return "the model's C++ operators are off (Llama.use_cpu_ops=False)"
    if not cpu_ops_available(param.device, warn=False):
        return "radarlab's C++ operators cannot be built here"
    if not isinstance(cache, PagedKVCache):
        return f"the cache is a {type(cache).__name__}, not a PagedKVCache"
    if attn_backend is not None:
        return f"the attention backend is one of one's own ({type(attn_backend).__name__})"
    if cache.kv_format.is_quantized or cache.rotation is not None:
        return f"kv_cache_dtype {cache.kv_format.name!r} is quantized or rotated"
    if cache.backend != "torch":
        return f"the cache's backend is {cache.backend!r}, not 'torch'"
    if cache.dtype != param.dtype:
        return f"the pool holds {cache.dtype}, the model computes in {param.dtype}"
    return None


def _gemm(layers: tuple[Linear, ...], packed: PackedWeight | None) -> Callable:
    """x -> each layer's output (one tensor for one layer): one packed GEMM on the stacked weights,
    as fused_linear runs it."""
    packed = layers[0].packed if packed is None else packed
    weight, bias = packed.get([m.weight for m in layers], [m.bias for m in layers])
    gemm = torch.ops.mkldnn._linear_pointwise
    if len(layers) == 1:
        return lambda x: gemm(x, weight, bias, "none", [], "")
    sizes = [m.out_features for m in layers]
    return lambda x: gemm(x, weight, bias, "none", [], "").split(sizes, dim=-1)


def _forwards(layers: tuple[Linear, ...]) -> Callable:
    """x -> each layer's output through Linear.forward, which picks its path per call."""
    forwards = tuple(layer.forward for layer in layers)
    if len(forwards) == 1:
        return forwards[0]
    return lambda x: tuple(f(x) for f in forwards)


def _plain(layers: tuple[Linear, ...]) -> Callable:
    """x -> each layer's output through F.linear on its own weight, as Linear.forward runs it where
    it neither packs nor upcasts."""
    weights = tuple((m.weight, m.bias) for m in layers)
    if len(weights) == 1:
        (w, b), = weights
        return lambda x: F.linear(x, w, b)
    return lambda x: tuple(F.linear(x, w, b) for w, b in weights)


def _gemv(layers: tuple[Linear, ...], ops) -> Callable:
    """x -> each layer's output through radarlab's GEMV on the weights side by side, as fused_linear
    and Linear.forward run it at a few rows."""
    weights = [m.weight for m in layers]
    bias = None if layers[0].bias is None else torch.cat([m.bias for m in layers])
    gemv = ops.gemv
    if len(layers) == 1:
        return lambda x: gemv(x, weights, bias)
    sizes = [m.out_features for m in layers]
    return lambda x: gemv(x, weights, bias).split(sizes, dim=-1)


def _path(layers: tuple[Linear, ...], packed: PackedWeight | None, rows: int, ops) -> Callable:
    """The layers' matmul at this many rows, as the eager model runs it with radarlab's C++ operators
    (fused_linear, Linear.forward)."""
    x = torch.empty(rows, layers[0].in_features, dtype=layers[0].weight.dtype)
    if gemv_runs(x, layers):
        return _gemv(layers, ops)
    if packed_path(x, layers, check_hooks=False):
        return _gemm(layers, packed)
    if any(upcasts(x, m.weight) for m in layers):
        return _forwards(layers)
    return _plain(layers)


def _linear(layers: tuple[Linear, ...], packed: PackedWeight | None, ops) -> Callable:
    """The layers' matmul as the eager model runs it. The rows choose the path: radarlab's GEMV up to
    GEMV_MAX_ROWS, then, where the rows choose again (bf16 on a CPU without bf16 instructions), the
    path below and from path_switch_rows. Each path is captured and each step's rows pick one."""
    few = _path(layers, packed, 1, ops)
    switch = path_switch_rows(layers[0].weight)
    if switch is None or switch <= GEMV_MAX_ROWS + 1:
        more = _path(layers, packed, GEMV_MAX_ROWS + 1, ops)
        return lambda x: few(x) if x.shape[0] <= GEMV_MAX_ROWS else more(x)
    small, large = _path(layers, packed, switch - 1, ops), _path(layers, packed, switch, ops)
    return lambda x: few(x) if x.shape[0] <= GEMV_MAX_ROWS else small(x) if x.shape[0] < switch else large(x)


class ReplayedModel:
    """A Llama's step on one pool, captured (see the module docstring). Call it as run_model is called:
    replay(inputs, return_features)."""

    def __init__(self, model: Llama, cache: PagedKVCache) -> None:
        refusal = replay_refusal(model, cache)
        if refusal is not None:
            raise ValueError(f"a replayed step cannot run this configuration: {refusal}")
        self.model, self.cache = model, cache
        self.modules = list(model.modules())
        self.params = list(model.parameters())
        self.captures = 0
        self.capture()

    def _weights_key(self) -> tuple:
        return tuple((p.data_ptr(), p._version) for p in self.params)

    @torch.inference_mode()
    def capture(self) -> None:
        """Resolve every weight, pool slice and operator of a step, now."""
        m, cfg = self.model, self.model.config
        self.ops = ops = load_cpu_ops()
        self.key = self._weights_key()
        self.layers = []
        for i, layer in enumerate(m.layers):
            a, mlp = layer.self_attn, layer.mlp
            qkv = _linear((a.q_proj, a.k_proj, a.v_proj), a.qkv_packed, ops)
            self.layers.append((layer.input_layernorm.weight, qkv, self.cache.k[i], self.cache.v[i],
                                _linear((a.o_proj,), None, ops),
                                layer.post_attention_layernorm.weight,
                                _linear((mlp.gate_proj, mlp.up_proj), mlp.gate_up_packed, ops),
                                _linear((mlp.down_proj,), None, ops)))
        self.lm_head = _linear((m.lm_head,), None, ops)
        self.embed, self.norm = m.embed_tokens.weight, m.norm.weight
        self.shape = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps, cfg.head_dim ** -0.5)
        self.captures += 1

    def hooked(self) -> bool:
        """Is a forward hook registered anywhere in the model, or globally? Then it must see each call."""
        if nn_module._global_forward_hooks or nn_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.modules)

    def ready(self) -> bool:
        """Can the next step replay? Captures again first if a weight changed since the capture."""
        if self.model.use_cpu_ops is False or self.hooked():
            return False
        if self._weights_key() != self.key:
            self.capture()
        return True

    @torch.inference_mode()
    def __call__(self, inputs: StepInputs, return_features: bool = False):
        """Logits at inputs.logits_indices (and with return_features the normed last hidden states of
        every token), as paged_runner.run_model returns them."""
        meta = inputs.attn_metadata
        check_inputs(self.model.config, inputs.input_ids, inputs.positions, meta)
        meta = ensure_built(self.cache, meta)
        backend = backend_of(self.cache, meta)
        if backend not in REPLAYED_BACKENDS:
            raise ValueError(f"this step's metadata was built by {type(backend).__name__}; a replayed step "
                             f"runs {' or '.join(type(b).__name__ for b in REPLAYED_BACKENDS)}")
        ops = self.ops
        nq, nk, d, eps, scale = self.shape
        x = F.embedding(inputs.input_ids, self.embed)
        cos, sin = self.model.rope(inputs.positions, x.dtype)
        t = x.shape[0]
        for ln1, qkv, k_pool, v_pool, o_proj, ln2, gate_up, down in self.layers:
            q, k, v = qkv(ops.rms_norm(x, ln1, eps))
            q, k, v = q.view(t, nq, d), k.view(t, nk, d), v.view(t, nk, d)
            ops.rotary_embedding(q, k, cos, sin)
            out = backend.attend_pools(k_pool, v_pool, q, k, v, meta, scale)
            h = ops.add_rms_norm(x, o_proj(out.reshape(t, nq * d)), ln2, eps)
            x.add_(down(ops.silu_and_mul(*gate_up(h))))
        x = ops.rms_norm(x, self.norm, eps)
        if return_features:
            return self.lm_head(x[inputs.logits_indices]), x
        return self.lm_head(x[inputs.logits_indices])
