"""Arithmetic intensity of decode: the roofline model, by hand-worked numbers."""
from __future__ import annotations

import pytest
import torch

from radarlab.lab.roofline import (
    LLAMA_70B,
    TransformerDims,
    decode_step,
    intensity_limit,
    preemption_cost,
    prefill_flops,
    ridge_point,
    swap_recompute_crossover,
)


def test_llama_70b_shape_has_70b_parameters():
    assert 70e9 < LLAMA_70B.params < 71e9


def test_course_model_dims_match_the_hf_parameter_count():
    from transformers import LlamaConfig

    cfg = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                      num_attention_heads=9, num_key_value_heads=3, head_dim=64, tie_word_embeddings=True)
    dims = TransformerDims.from_config(cfg)
    with torch.device("meta"):
        from transformers import LlamaForCausalLM

        n = sum(p.numel() for p in LlamaForCausalLM(cfg).parameters())
    assert dims.params == n == 134_515_008


def test_intensity_grows_with_batch_then_stops_at_the_kv_limit():
    short = [decode_step(LLAMA_70B, b, 1024).intensity for b in (1, 2, 4, 8, 16)]
    assert all(b > a for a, b in zip(short, short[1:]))
    # batch 1: about 1 FLOP per byte (2 FLOPs per weight, 2 bytes per bf16 weight)
    assert decode_step(LLAMA_70B, 1, 1).intensity == pytest.approx(1.0, rel=0.01)
    # at 32k context the KV read bounds the intensity near ~21 FLOP/byte, whatever the batch
    limit = intensity_limit(LLAMA_70B, 32768)
    assert 15 < limit < 30
    assert decode_step(LLAMA_70B, 100_000, 32768).intensity == pytest.approx(limit, rel=0.01)
    assert limit < ridge_point(989e12, 3.35e12)  # an H100's ridge point (~295): still memory-bound


def test_weights_read_once_kv_read_per_sequence():
    one, eight = decode_step(LLAMA_70B, 1, 4096), decode_step(LLAMA_70B, 8, 4096)
    assert eight.weight_bytes == one.weight_bytes
    assert eight.kv_bytes == 8 * one.kv_bytes
    assert one.kv_bytes == 4096 * 327_680 // 2 * 2  # bf16 KV: 327,680 bytes per token
    assert decode_step(LLAMA_70B, 1, 4096, kv_dtype="fp8").kv_bytes * 2 == one.kv_bytes


def test_bad_batch_names_the_field():
    with pytest.raises(ValueError, match="batch"):
        decode_step(LLAMA_70B, 0, 10)
    with pytest.raises(ValueError, match="context"):
        decode_step(LLAMA_70B, 1, -1)


# --- preemption: swap or recompute ------------------------------------------------------------------
TINY = TransformerDims(layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10)


def test_prefill_flops_by_hand():
    # layer weights: 2 * (8*4*(2*2 + 2*1) + 3*8*16) = 2 * (192 + 384) = 1152; LM head 80
    # 3 tokens: 2*1152*3 + 4*2*2*4*(1+2+3) + 2*80 = 6912 + 384 + 160
    assert prefill_flops(TINY, 3) == 6912 + 384 + 160


def test_preemption_cost_and_crossover_agree():
    link, flops = 1e9, 1e12
    cross = swap_recompute_crossover(TINY, link, flops)
    assert cross is not None
    below, above = preemption_cost(TINY, int(cross * 0.9), link,
                                   flops), preemption_cost(TINY, int(cross * 1.1) + 1, link, flops)
    assert below.recompute_s < below.swap_s and above.swap_s < above.recompute_s
    # KV of TINY in bf16: 2 layers * 1 head * 4 dims * 2 (K and V) * 2 bytes = 32 bytes a token, copied out
    # and back
    assert preemption_cost(TINY, 100, link, flops).swap_s == pytest.approx(2 * 100 * 32 / link)


def test_a_slow_device_never_recomputes_and_a_fast_one_recomputes_short_contexts():
    assert swap_recompute_crossover(TINY, link_bytes_per_s=1e12, flops_per_s=1e6) is None
    cost = preemption_cost(TINY, 10, 1e12, 1e6)
    assert cost.swap_s < cost.recompute_s


def test_verify_step_multiplies_flops_not_bytes():
    """A verify step of k + 1 tokens per sequence: k + 1 times the FLOPs of a decode step, the same bytes."""
    one = decode_step(LLAMA_70B, 8, 1024)
    verify = decode_step(LLAMA_70B, 8, 1024, query_len=5)
    assert verify.flops == pytest.approx(5 * one.flops)
    assert (verify.weight_bytes, verify.kv_bytes) == (one.weight_bytes, one.kv_bytes)
    with pytest.raises(ValueError, match="query_len"):
        decode_step(LLAMA_70B, 8, 1024, query_len=0)
