"""KIVI in the paged cache: groups quantized as the window passes them, 16-bit tails in between, tails
bounded per sequence, copy-on-write of tails, early quantization when tails run out."""
from __future__ import annotations

import pytest
import torch

from radarlab.attention.backends import attention_forward, build_metadata, write_kv
from radarlab.attention.reference import attention_reference
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.quant import int4, kivi
from radarlab.util import cdiv

from cache_steps import seeded, step_metadata

H, D, BLOCK = 2, 16, 8


def _x(*shape, seed):
    return seeded(*shape, seed=seed, half_exact=True)  # the tails store 16 bits


def _meta(news, totals, tables):
    return step_metadata(news, totals, tables, BLOCK)


def _expected(q, k, v, group, residual):
    kd, vd = kivi.dequantize(kivi.quantize(k, v, group, residual))
    return attention_reference(q, kd, vd, 0.25)


@pytest.mark.parametrize("group, residual", [(4, 0), (4, 8), (8, 6)])
def test_prefill_then_decode_equals_kivi_over_the_whole_sequence(group, residual):
    name = f"kivi_g{group}" + (f"_r{residual}" if residual else "")
    cache = PagedKVCache(1, 8, H, D, block_size=BLOCK, kv_cache_dtype=name)
    T = 30
    q, k, v = _x(T, 4, D, seed=1), _x(T, H, D, seed=2) * 3, _x(T, H, D, seed=3)
    k[:, :, 2] += 20  # an outlier channel
    k = k.half().float()
    table = [6, 1, 3, 0]
    start = 9
    out = attention_forward(cache, 0, q[:start], k[:start], v[:start], _meta([start], [start], [table]), 0.25)
    for t in range(start):  # each query of the prefill sees what it would have seen decoding
        assert torch.allclose(out[t], _expected(q[:t + 1], k[:t + 1], v[:t + 1], group, residual)[-1],
                              atol=1e-4), t
    for n in range(start + 1, T + 1):
        out = attention_forward(cache, 0, q[n - 1:n], k[n - 1:n], v[n - 1:n], _meta([1], [n], [table]), 0.25)
        assert torch.allclose(out, _expected(q[:n], k[:n], v[:n], group, residual)[-1:], atol=1e-4), n
        in_tails = int((cache.kivi.tail_of >= 0).sum())
        assert in_tails == cdiv(n - kivi.quantized_length(n, group, residual), group)  # only the window
    plain = attention_reference(q, k, v, 0.25)[-1:]
    assert float((out - plain).abs().max()) > 1e-3  # and the quantized groups did change the output


@pytest.mark.parametrize("name",
                         ["kivi_g4", "kivi_g4_r4", "kivi_g8_sink1", "kivi_g4_fp8scales_int8zeros_sink1"])
def test_a_prefill_equals_decoding_its_tokens_one_by_one(name):
    """Perplexity measured in one prefill must be the perplexity of generation: every query reads the
    quantized codes of a key group only if the group was complete when that query was the newest token."""
    q, k, v = _x(21, 4, D, seed=7), _x(21, H, D, seed=8) * 2, _x(21, H, D, seed=9)
    k[:, :, 5] += 12
    table = [2, 5, 0]
    whole = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype=name)
    prefill = attention_forward(whole, 0, q, k, v, _meta([21], [21], [table]), 0.25)
    one_by_one = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype=name)
    decoded = torch.cat([attention_forward(one_by_one, 0, q[n - 1:n], k[n - 1:n], v[n - 1:n],
                                           _meta([1], [n], [table]), 0.25)
                         for n in range(1, 22)])
    assert torch.allclose(prefill, decoded, atol=1e-5)
    for a, b in zip(whole.kivi.block_tensors(), one_by_one.kivi.block_tensors()):  # the same codes and scales
        assert torch.equal(a, b)
    plain = attention_reference(q, k, v, 0.25)
    assert float((prefill - plain).abs().max()) > 1e-3  # the codes were read


def test_two_sequences_copy_on_write_and_bytes():
    cache = PagedKVCache(2, 6, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4_r4")
    k, v, q = _x(11, H, D, seed=4), _x(11, H, D, seed=5), _x(11, 4, D, seed=6)
    prefill = build_metadata(cache, _meta([6], [6], [[2]]))  # once per step: KIVI plans its writes here
    for layer in range(2):
        attention_forward(cache, layer, q[:6], k[:6], v[:6], prefill, 0.25)
    cache.copy_blocks([(2, 4)])  # a fork: block 4 is block 2's copy, tails included
    assert int((cache.kivi.tail_of[4] >= 0).sum()) == int((cache.kivi.tail_of[2] >= 0).sum()) > 0
    assert set(cache.kivi.tail_of[4].tolist()).isdisjoint(set(cache.kivi.tail_of[2].tolist()) - {-1})
    ka, va = torch.cat((k[:6], k[6:7])), torch.cat((v[:6], v[6:7]))
    kb, vb = torch.cat((k[:6], k[7:8])), torch.cat((v[:6], v[7:8]))
    meta = build_metadata(cache, _meta([1, 1], [7, 7], [[2], [4]]))
    for layer in range(2):
        out = attention_forward(cache, layer, q[6:8], torch.cat((k[6:7], k[7:8])),
                                torch.cat((v[6:7], v[7:8])), meta, 0.25)
    assert torch.allclose(out[:1], _expected(torch.cat((q[:6], q[6:7])), ka, va, 4, 4)[-1:], atol=1e-4)
    assert torch.allclose(out[1:], _expected(torch.cat((q[:6], q[7:8])), kb, vb, 4, 4)[-1:], atol=1e-4)
    blocks_only = cache.nbytes - cache.kivi.k_tail.nbytes - cache.kivi.v_tail.nbytes
    assert blocks_only == 6 * PagedKVCache.bytes_per_block(2, H, D, BLOCK, "kivi_g4_r4")


def test_tails_run_out_then_an_untouched_group_is_quantized_early():
    cache = PagedKVCache(1, 6, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4", num_tail_groups=1)
    k, v, q = _x(6, H, D, seed=7), _x(6, H, D, seed=8), _x(6, 4, D, seed=9)
    # partial group: the only tail
    attention_forward(cache, 0, q[:3], k[:3], v[:3], _meta([3], [3], [[1]]), 0.25)
    assert cache.kivi.num_free_tails == 0
    # another sequence needs one
    attention_forward(cache, 0, q[3:6], k[3:6], v[3:6], _meta([3], [3], [[5]]), 0.25)
    assert int(cache.kivi.tail_of[1, 0]) == -1 and int(cache.kivi.tail_of[5, 0]) >= 0
    # sequence 1's three tokens were quantized on their own, not lost: within a 4-bit step of the truth
    k_pool, _ = cache.layer_pools(0)
    early = k_pool[torch.tensor([1])][0, :3]
    assert float((early - k[:3]).abs().max()) < float((k[:3].amax(0) - k[:3].amin(0)).max()) / 15
    # and a later token of sequence 1 joins the group: decoded, merged, quantized again once full
    out = attention_forward(cache, 0, q[:1], k[:1], v[:1], _meta([1], [4], [[1]]), 0.25)
    assert bool(torch.isfinite(out).all())


def test_bad_kivi_settings():
    with pytest.raises(ValueError, match=r"kivi groups of 16 tokens must divide block_size \(8\)"):
        PagedKVCache(1, 4, H, D, block_size=8, kv_cache_dtype="kivi_g16")
    with pytest.raises(ValueError, match="head_dim .*power of two"):
        PagedKVCache(1, 4, H, 24, block_size=8, kv_cache_dtype="kivi_g4", backend="triton")
    cache = PagedKVCache(1, 4, H, D, block_size=8, kv_cache_dtype="kivi_g4")
    with pytest.raises(ValueError, match="written by attention_forward"):
        write_kv(cache, 0, _x(1, H, D, seed=0), _x(1, H, D, seed=0), torch.tensor([0]))


def test_greedy_and_engine_run_kivi():
    from radarlab.engine.llm_engine import Engine
    from radarlab.models.llama import Llama, LlamaConfig
    from radarlab.models.paged_runner import paged_greedy_generate
    from radarlab.sample.sampling_params import SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    model = Llama(cfg).eval()
    out = paged_greedy_generate(model, [list(range(1, 12)), [3, 4]], 6, block_size=4,
                                kv_cache_dtype="kivi_g4_r4")
    assert [len(o) for o in out] == [6, 6]
    engine = Engine(model, 30, block_size=4, kv_cache_dtype="kivi_g4_r4")
    outs = engine.generate([list(range(1, 12)), [3, 4], [5, 6, 7]], SamplingParams(max_tokens=5))
    assert [len(o.output_token_ids) for o in outs] == [5, 5, 5]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["kivi_g4_r4_sink1", "kivi_g4_fp8scales_int8zeros"])
def test_engine_on_the_triton_backend_equals_the_torch_backend(name):
    """The whole engine (prefills, decodes, three requests in a batch) with KIVI read by the Triton
    kernels: the same tokens as the torch path."""
    from radarlab.engine.llm_engine import Engine
    from radarlab.models.llama import Llama, LlamaConfig
    from radarlab.sample.sampling_params import SamplingParams

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    model = Llama(cfg).eval()
    prompts = [list(range(1, 12)), [3, 4], [5, 6, 7, 8, 9]]
    outs = [[o.output_token_ids for o in Engine(model, 30, block_size=4, kv_cache_dtype=name, backend=backend)
             .generate(prompts, SamplingParams(max_tokens=9))] for backend in ("torch", "triton")]
    assert outs[0] == outs[1] and [len(o) for o in outs[0]] == [9, 9, 9]


def test_a_kivi_step_is_planned_once_before_layer_0():
    """Unbuilt metadata at layer 1 would plan the step a second time, after layer 0 wrote by the first
    plan: refused, with the remedy."""
    cache = PagedKVCache(2, 6, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4_r4")
    k, v, q = _x(6, H, D, seed=4), _x(6, H, D, seed=5), _x(6, 4, D, seed=6)
    with pytest.raises(ValueError, match="build the step's metadata once"):
        attention_forward(cache, 1, q, k, v, _meta([6], [6], [[2]]), 0.25)


def _tiny_model():
    from radarlab.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    return Llama(cfg).eval()


def test_the_engine_runs_a_kivi_quantizer_given_as_an_argument():
    """Engine(kivi_quantizer=...) -> PagedKVCache -> KiviStore: radarlab's functions passed in give the
    default's tokens, and they are the ones called."""
    from radarlab.engine.llm_engine import Engine
    from radarlab.sample.sampling_params import SamplingParams

    model, calls = _tiny_model(), []

    def counted(k, g):
        calls.append(k.shape[0])
        return kivi.quantize_key_codes(k, g)

    prompts = [list(range(1, 12)), [3, 4], [5, 6, 7, 8, 9]]
    runs = {}
    for who, quantizer in [("default", None), ("given", kivi.KiviQuantizer(counted, kivi.quantized_length))]:
        engine = Engine(model, 30, block_size=4, kv_cache_dtype="kivi_g4_r4", kivi_quantizer=quantizer)
        runs[who] = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=9))]
    assert runs["given"] == runs["default"] and [len(o) for o in runs["given"]] == [9, 9, 9]
    assert len(calls) > 1 and all(n % 4 == 0 for n in calls)  # the probe, then every group write


def test_the_engine_writes_and_reads_through_every_given_function():
    """All five functions given (radarlab's, counted): the default's tokens, and each one called, the
    dequantizers by attention's reads."""
    from radarlab.engine.llm_engine import Engine
    from radarlab.sample.sampling_params import SamplingParams

    model, calls = _tiny_model(), []

    def counted(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call

    codec = kivi.KiviQuantizer().resolved()
    given = kivi.KiviQuantizer(**{name: counted(name, getattr(codec, name)) for name in (
        "quantize_keys", "quantized_length", "quantize_values", "dequantize_keys", "dequantize_values")})
    prompts = [list(range(1, 12)), [3, 4], [5, 6, 7, 8, 9]]
    runs = {}
    for who, quantizer in [("default", None), ("given", given)]:
        engine = Engine(model, 30, block_size=4, kv_cache_dtype="kivi_g4_r4", kivi_quantizer=quantizer)
        runs[who] = [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=9))]
    assert runs["given"] == runs["default"]
    counts = {name: calls.count(name) for name in set(calls)}
    assert len(counts) == 5 and min(counts.values()) > 1, counts  # more than the probe's one call each


def test_a_codec_of_ones_own_round_trips_through_the_cache():
    """Values stored as 15 - code and read back the same way: other bytes in the cache, the same
    attention as radarlab's codec; reading them with radarlab's dequantizer is wrong."""
    q, k, v = _x(11, 4, D, seed=1), _x(11, H, D, seed=2), _x(11, H, D, seed=3)

    def flipped(v, g):
        codes, scales, zeros = int4.quantize_codes(v, g, symmetric=False)
        return 15 - codes, scales, zeros

    def unflip(codes, scales, zeros, g):
        return int4.dequantize_codes(15 - codes, scales, zeros, g)

    quantizers = {"radarlab": None,
                  "flipped": kivi.KiviQuantizer(quantize_values=flipped, dequantize_values=unflip),
                  "half read": kivi.KiviQuantizer(quantize_values=flipped)}
    caches = {who: PagedKVCache(1, 4, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4", kivi_quantizer=quant)
              for who, quant in quantizers.items()}
    outs = {who: attention_forward(c, 0, q, k, v, _meta([11], [11], [[0, 1]]), 0.25)
            for who, c in caches.items()}
    assert not torch.equal(caches["flipped"].kivi.v, caches["radarlab"].kivi.v)
    assert torch.equal(outs["flipped"], outs["radarlab"])
    assert not torch.allclose(outs["half read"], outs["radarlab"], atol=1e-3)


def test_a_given_quantized_length_decides_what_is_quantized():
    never = kivi.KiviQuantizer(quantized_length=lambda n, g, r: 0)  # every group stays in a 16-bit tail
    q, k, v = _x(11, 4, D, seed=1), _x(11, H, D, seed=2), _x(11, H, D, seed=3)
    caches = {who: PagedKVCache(1, 4, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4", kivi_quantizer=quant)
              for who, quant in (("radarlab", None), ("never", never))}
    outs = {who: attention_forward(c, 0, q, k, v, _meta([11], [11], [[0, 1]]), 0.25)
            for who, c in caches.items()}
    assert int((caches["radarlab"].kivi.tail_of >= 0).sum()) == 1  # only the partial group
    assert int((caches["never"].kivi.tail_of >= 0).sum()) == 3
    assert torch.allclose(outs["never"], attention_reference(q, k, v, 0.25), atol=1e-5)  # all 16-bit
    assert not torch.allclose(outs["radarlab"], outs["never"], atol=1e-4)


def _per_token(k, g):  # groups of g along head_dim, a scale per token: not the cache's layout
    codes, scales, zeros = int4.quantize_codes(k, g, symmetric=False)
    return codes, scales, zeros


def _fp32_scales(k, g):
    codes, scales, zeros = kivi.quantize_key_codes(k, g)
    return codes, scales.float(), zeros


@pytest.mark.parametrize("quantizer, words", [
    (kivi.KiviQuantizer(_per_token), r"scales must be torch.float16 of shape \(2, 2, 16\).* \(8, 2, 4\)"),
    (kivi.KiviQuantizer(_fp32_scales), r"scales must be torch.float16 .*got torch.float32 of shape"),
    (kivi.KiviQuantizer(lambda k, g: kivi.quantize_keys(k, g)),  # packed: half the codes' width
     r"codes must be torch.uint8 of shape \(8, 2, 16\).*got torch.uint8 of shape \(8, 2, 8\)"),
    (kivi.KiviQuantizer(quantized_length=lambda n, g, r: n), r"quantized_length\(1, 4, 0\) returned 1"),
    (kivi.KiviQuantizer(quantize_values=kivi.quantize_key_codes),  # per channel: the keys' layout
     r"quantize_values\(x \[8, 2, 16\], 4\): scales must be torch.float16 of shape \(8, 2, 4\)"
     r".*\(2, 2, 16\)"),
    (kivi.KiviQuantizer(dequantize_keys=lambda c, s, z, g: c.float()[:, :, ::2]),
     r"dequantize_keys\(codes, scales, zeros, 4\) must return floats of shape \(8, 2, 16\), got "
     r"torch.float32 of shape \(8, 2, 8\)"),
    (kivi.KiviQuantizer(dequantize_values=lambda c, s, z, g: c.float() / 0),
     r"dequantize_values returned values that are not finite"),
])
def test_a_bad_kivi_quantizer_is_refused_when_the_cache_is_built(quantizer, words):
    with pytest.raises(ValueError, match=words):
        PagedKVCache(1, 4, H, D, block_size=BLOCK, kv_cache_dtype="kivi_g4", kivi_quantizer=quantizer)


def test_a_kivi_quantizer_needs_a_kivi_format_on_the_torch_backend():
    for dtype, backend in (("int4_g8_asym", "torch"), ("kivi_g4", "triton")):
        with pytest.raises(ValueError, match="needs a kivi kv_cache_dtype and the torch backend"):
            PagedKVCache(1, 4, H, D, block_size=BLOCK, kv_cache_dtype=dtype, backend=backend,
                         kivi_quantizer=kivi.KiviQuantizer())
