"""Arithmetic intensity of decode: the roofline model, by hand-worked numbers."""
from __future__ import annotations

import pytest
import torch

from radarlab.hardware.roofline import LLAMA_70B, TransformerDims, decode_step, intensity_limit, ridge_point


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
