"""PagedKVCache: the pool, the KV write (torch and Triton), copy-on-write, and the course model on it.

The model tests hand out blocks with a tiny in-test helper (a shuffled list, never freed); the real
allocator and block tables live in radarlab.kvcache.block_pool / block_table and have their own tests.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from radarlab.attention.backends import attention_forward, build_metadata, write_kv
from radarlab.attention.metadata import AttentionMetadata
from radarlab.attention.reference import attention_reference
from radarlab.attention.torch_paged import paged_attention_torch
from radarlab.device import default_device
from radarlab.kvcache.contiguous import ContiguousKVCache
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.models.generate import greedy_generate
from radarlab.util import cdiv

BACKENDS = ["torch", "triton"]
NEW_TOKENS = 12


def small_cache(backend="torch", block_size=4, num_blocks=6, layers=2, kv_heads=2, head_dim=8, device=None):
    return PagedKVCache(layers, num_blocks, kv_heads, head_dim, block_size, device=device or default_device(),
                        backend=backend)


# --- construction ---------------------------------------------------------------------------------
@pytest.mark.parametrize("block_size", [0, 3, 6, 12, -4, 2.0, True])
def test_block_size_must_be_a_power_of_two(block_size):
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(1, 4, 1, 8, block_size)


@pytest.mark.parametrize("block_size", [1, 2, 4, 16, 64])
def test_pool_layout(block_size):
    cache = PagedKVCache(3, 5, 2, 8, block_size)
    assert cache.k.shape == cache.v.shape == (3, 5, block_size, 2, 8)
    assert cache.k[1].shape == (5, block_size, 2, 8) and cache.k[1].is_contiguous()
    assert cache.num_slots == 5 * block_size
    assert cache.nbytes == 2 * 3 * 5 * block_size * 2 * 8 * 4


@pytest.mark.parametrize("field", ["num_layers", "num_blocks", "num_kv_heads", "head_dim"])
def test_sizes_must_be_positive(field):
    kwargs = dict(num_layers=1, num_blocks=4, num_kv_heads=1, head_dim=8)
    kwargs[field] = 0
    with pytest.raises(ValueError, match=field):
        PagedKVCache(**kwargs)


def test_unknown_backend_raises():
    with pytest.raises(ValueError, match="backend"):
        PagedKVCache(1, 4, 1, 8, backend="cuda")


# --- the KV write ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_write_puts_each_token_at_its_slot_and_skips_padding(backend, block_size):
    cache = small_cache(backend, block_size, num_blocks=3)
    cache.k.fill_(7.0)
    cache.v.fill_(7.0)
    gen = torch.Generator().manual_seed(block_size)
    slots = torch.randperm(cache.num_slots, generator=gen)[:5].tolist()
    # padding tokens in between and at the end
    slot_mapping = torch.tensor(slots[:2] + [-1] + slots[2:] + [-1])
    k = torch.randn(len(slot_mapping), 2, 8, generator=gen).to(cache.k.device)
    v = torch.randn(len(slot_mapping), 2, 8, generator=gen).to(cache.k.device)
    write_kv(cache, 1, k, v, slot_mapping)

    expected_k = torch.full_like(cache.k, 7.0)
    expected_v = torch.full_like(cache.v, 7.0)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot >= 0:
            expected_k[1, slot // block_size, slot % block_size] = k[t]
            expected_v[1, slot // block_size, slot % block_size] = v[t]
    assert torch.equal(cache.k, expected_k) and torch.equal(cache.v, expected_v)


def test_triton_write_equals_torch_write_bit_for_bit():
    caches = {b: small_cache(b, block_size=4, num_blocks=5) for b in BACKENDS}
    gen = torch.Generator().manual_seed(0)
    slot_mapping = torch.tensor([3, -1, 17, 0, 19, -1, 8])
    k, v = (torch.randn(7, 2, 8, generator=gen).to(default_device()) for _ in range(2))
    for cache in caches.values():
        write_kv(cache, 0, k, v, slot_mapping)
    assert torch.equal(caches["torch"].k, caches["triton"].k)
    assert torch.equal(caches["torch"].v, caches["triton"].v)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [24, 100, -2])
def test_slot_outside_the_pool_raises_and_writes_nothing(backend, bad):
    cache = small_cache(backend, block_size=4, num_blocks=6)  # slots 0..23
    k = torch.ones(3, 2, 8, device=cache.k.device)
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {bad} is outside the pool"):
        write_kv(cache, 0, k, k, torch.tensor([0, bad, 5]))
    assert not cache.k.any() and not cache.v.any()


def test_write_rejects_wrong_shapes_and_layers():
    cache = small_cache()
    k = torch.ones(3, 2, 8, device=cache.k.device)
    with pytest.raises(ValueError, match="slot_mapping"):
        write_kv(cache, 0, k, k, torch.tensor([0, 1]))
    with pytest.raises(ValueError, match="k and v"):
        write_kv(cache, 0, torch.ones(3, 3, 8), torch.ones(3, 3, 8), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="layer 2"):
        write_kv(cache, 2, k, k, torch.tensor([0, 1, 2]))


# --- copy-on-write --------------------------------------------------------------------------------
def test_copy_blocks_copies_every_layer_at_once():
    cache = small_cache(num_blocks=6)
    cache.k.copy_(torch.randn(cache.k.shape))
    cache.v.copy_(torch.randn(cache.v.shape))
    k0, v0 = cache.k.clone(), cache.v.clone()
    cache.copy_blocks([(1, 4), (2, 1)])  # block 1 is read (for 4) before it is overwritten by 2
    assert torch.equal(cache.k[:, 4], k0[:, 1]) and torch.equal(cache.v[:, 4], v0[:, 1])
    assert torch.equal(cache.k[:, 1], k0[:, 2]) and torch.equal(cache.v[:, 1], v0[:, 2])
    untouched = [0, 2, 3, 5]
    assert torch.equal(cache.k[:, untouched], k0[:, untouched])
    cache.copy_blocks([])


@pytest.mark.parametrize("pairs,match", [([(0, 6)], "dst block 6"), ([(-1, 2)], "src block -1"),
                                         ([(0, 3), (1, 3)], "destination block appears twice")])
def test_copy_blocks_rejects_bad_pairs(pairs, match):
    cache = small_cache(num_blocks=6)
    with pytest.raises(ValueError, match=match):
        cache.copy_blocks(pairs)


# --- attend ---------------------------------------------------------------------------------------
def test_attend_needs_slot_mapping_and_block_tables():
    cache = small_cache()
    meta = AttentionMetadata.from_lens([1], [1], slot_mapping=torch.tensor([0]))
    x = torch.ones(1, 2, 8)
    with pytest.raises(ValueError, match="block_tables"):
        attention_forward(cache, 0, x, x, x, meta, 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_rejects_a_block_table_outside_the_pool_before_writing(backend):
    cache = small_cache(backend, block_size=4, num_blocks=4)
    x = torch.ones(5, 2, 8, device=cache.k.device)
    meta = AttentionMetadata.from_lens([5], [5], slot_mapping=torch.tensor([0, 1, 2, 3, 4]),
                                       block_tables=torch.tensor([[0, 4]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 4 is outside the pool"):
        attention_forward(cache, 0, torch.ones(5, 2, 8, device=cache.k.device), x, x, meta, 1.0)
    assert not cache.k.any()


def test_build_metadata_validates_once_and_stamps_the_pool_geometry():
    """A step's metadata is checked once against the pool (prepare) and frozen; a stamp for another
    pool's geometry does not count, and an unstamped metadata is checked in attend itself."""
    big, small = small_cache(block_size=4, num_blocks=8), small_cache(block_size=4, num_blocks=4)
    meta = AttentionMetadata.from_lens([5], [5], slot_mapping=torch.tensor([0, 1, 2, 3, 20]),
                                       block_tables=torch.tensor([[0, 5]], dtype=torch.int32))
    checked = build_metadata(big, meta)
    assert meta.checked_for is None and checked.checked_for == big.geometry
    assert build_metadata(big, checked) is checked  # stamped for this pool: nothing to do
    with pytest.raises(dataclasses.FrozenInstanceError):
        checked.block_tables = torch.tensor([[0, 7]], dtype=torch.int32)
    x = torch.ones(5, 2, 8)
    attention_forward(big, 0, x, x, x, checked, 1.0)
    with pytest.raises(ValueError, match=r"block_tables\[0, 1\] = 5 is outside the pool"):
        attention_forward(small, 0, x, x, x, checked,
                          1.0)  # stamped for the bigger pool: checked again, and refused
    assert not small.k.any()


def test_torch_backend_plans_once_per_step_and_attends_with_sdpa(monkeypatch):
    """build_metadata builds the SDPA plan with the stamp; attention_forward reuses it in every layer and
    never calls the reference; a stamped metadata without a plan (a Triton pool's) gets one."""
    import radarlab.attention.backends.sdpa_attn as pc

    cache = small_cache(block_size=4, num_blocks=8)
    meta = AttentionMetadata.from_lens([1, 1], [5, 2], slot_mapping=torch.tensor([4, 8]),
                                       block_tables=torch.tensor([[0, 1], [2, -1]], dtype=torch.int32))
    checked = build_metadata(cache, meta)
    assert checked.plan.context == 5 and checked.plan.num_tokens == 2
    plans = []
    monkeypatch.setattr(pc, "plan_paged_sdpa", lambda *a: plans.append(a))  # no new plan may be made
    q = torch.randn(2, 4, 8)
    for layer in range(cache.num_layers):
        out = attention_forward(cache, layer, q, q[:, :2], q[:, :2], checked, 0.5)
        ref = paged_attention_torch(q, cache.k[layer], cache.v[layer], checked.block_tables, checked.seq_lens,
                                    checked.query_start_loc, 0.5)
        assert (out - ref).abs().max() < 1e-6
    assert plans == []
    monkeypatch.undo()
    assert build_metadata(cache, dataclasses.replace(checked, plan=None)).plan is not None


@pytest.mark.parametrize("backend", BACKENDS)
def test_attend_over_two_steps_equals_the_math(backend):
    """A 6-token prefill then a decode step, 4 query heads over 2 kv heads, blocks 3 and 0 of 4."""
    device = default_device()
    cache = small_cache(backend, block_size=4, num_blocks=4)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(7, n, 8, generator=gen).to(device) for n in (4, 2, 2))
    table = torch.tensor([[3, 0]], dtype=torch.int32)
    slots = torch.tensor([12, 13, 14, 15, 0, 1, 2])
    prefill = AttentionMetadata.from_lens([6], [6], slot_mapping=slots[:6], block_tables=table)
    out1 = attention_forward(cache, 1, q[:6], k[:6], v[:6], prefill, 0.3)
    decode = AttentionMetadata.from_lens([1], [7], slot_mapping=slots[6:], block_tables=table)
    out2 = attention_forward(cache, 1, q[6:], k[6:], v[6:], decode, 0.3)
    expected = attention_reference(q, k, v, 0.3)
    assert (torch.cat([out1, out2]) - expected).abs().max() < 1e-5
    assert not cache.k[0].any()  # other layers untouched


# --- the course model on the paged cache ----------------------------------------------------------
class ShuffledBlocks:
    """Test-only block source: hands out every block once, in a fixed shuffled order, never frees."""

    def __init__(self, num_blocks: int, seed: int = 0) -> None:
        self.order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()

    def take(self) -> int:
        return self.order.pop()


def paged_greedy(model, prompts, max_new_tokens, block_size=16, backend="torch"):
    """Greedy generation like greedy_generate, but every step goes through a PagedKVCache: packed
    prefill of all prompts, then batched decode, with block tables grown one block at a time."""
    device = next(model.parameters()).device
    num_blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    cache = PagedKVCache.for_model(model.config, num_blocks, block_size, device=device, backend=backend)
    blocks = ShuffledBlocks(num_blocks)
    tables = [[] for _ in prompts]
    lens = [0] * len(prompts)
    step_tokens = [list(p) for p in prompts]
    outputs = [[] for _ in prompts]
    active = list(range(len(prompts)))
    while active:
        slots = []
        for i in active:
            for pos in range(lens[i], lens[i] + len(step_tokens[i])):
                if pos // block_size == len(tables[i]):
                    tables[i].append(blocks.take())
                slots.append(tables[i][pos // block_size] * block_size + pos % block_size)
            lens[i] += len(step_tokens[i])
        block_tables = torch.full((len(active), max(len(tables[i]) for i in active)), -1, dtype=torch.int32)
        for row, i in enumerate(active):
            block_tables[row, : len(tables[i])] = torch.tensor(tables[i], dtype=torch.int32)
        meta = AttentionMetadata.from_lens([len(step_tokens[i]) for i in active], [lens[i] for i in active],
                                           slot_mapping=torch.tensor(slots), block_tables=block_tables)
        ids = torch.tensor([t for i in active for t in step_tokens[i]], device=device)
        last = (meta.query_start_loc[1:] - 1).to(device)
        logits = model(ids, meta.positions.to(device), cache, meta, logits_indices=last)
        for i, tok in zip(active, logits.argmax(-1).tolist()):
            outputs[i].append(tok)
            step_tokens[i] = [tok]
        active = [i for i in active if len(outputs[i]) < max_new_tokens]
    return outputs


@pytest.fixture(scope="module")
def contiguous_tokens(model, prompts):
    """The contiguous path's greedy tokens (itself tested equal to transformers in test_llama)."""
    return greedy_generate(model, prompts[:4], NEW_TOKENS)


@pytest.fixture(scope="module")
def paged_batched_tokens(model, prompts):
    return paged_greedy(model, prompts[:4], NEW_TOKENS, block_size=16)


def test_model_on_paged_cache_equals_contiguous(paged_batched_tokens, contiguous_tokens):
    assert paged_batched_tokens == contiguous_tokens


def test_batched_decode_of_different_lengths_equals_one_at_a_time(model, prompts, paged_batched_tokens):
    """Four prompts of different lengths decoded together, against each alone (and block size 4 vs 16)."""
    assert len({len(p) for p in prompts[:4]}) > 1
    alone = [paged_greedy(model, [p], NEW_TOKENS, block_size=4)[0] for p in prompts[:4]]
    assert alone == paged_batched_tokens


@pytest.mark.slow
def test_model_on_triton_paged_cache_equals_contiguous(model, prompts, contiguous_tokens):
    """One 5-token prompt, 8 new tokens, block size 4: the store kernel, the prefill kernel over two
    blocks, then the decode kernel as the context crosses into a third block. (Interpreted on CPU:
    a few seconds per token.)"""
    device = default_device()
    on_device = model if device == "cpu" else copy.deepcopy(model).to(device)
    # the reference runs on the same device: CPU and GPU matmuls round differently
    expected = [contiguous_tokens[0][:8]] if device == "cpu" else greedy_generate(on_device, prompts[:1], 8)
    assert len(prompts[0]) % 4
    assert paged_greedy(on_device, prompts[:1], 8, block_size=4, backend="triton") == expected


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill_on_paged_cache_equals_contiguous(model, backend):
    """9 tokens, then 4 more that read the first 9 from the pool, against the same two chunks on
    the contiguous cache (itself checked against a single prefill in test_llama).

    Both backends differ from the contiguous cache's einsum by fp32 rounding: the torch backend runs
    torch's fused SDPA (sdpa_paged.py), the Triton kernels their own tiles (~1e-6 per layer,
    measured); thirty layers grow that to ~1e-4 in the logits (7.6e-5 measured for SDPA), hence the
    bound. Greedy tokens stay identical (tests above).
    """
    device = default_device() if backend == "triton" else "cpu"
    on_device = model if device == "cpu" else copy.deepcopy(model).to(device)
    ids = torch.randint(0, model.config.vocab_size, (13,),
                        generator=torch.Generator().manual_seed(1)).to(device)
    chunks = [(0, 9), (9, 13)]

    contiguous = ContiguousKVCache.for_model(model.config, 1, 13, device=device)
    paged = PagedKVCache.for_model(model.config, 5, block_size=4, device=device, backend=backend)
    table = torch.tensor([[4, 1, 3, 0]], dtype=torch.int32)  # block 2 stays unused
    slots = torch.tensor([int(table[0, p // 4]) * 4 + p % 4 for p in range(13)])
    expected, logits = [], []
    for lo, hi in chunks:
        m = AttentionMetadata.from_lens([hi - lo], [hi], cache_rows=torch.tensor([0]))
        expected.append(on_device(ids[lo:hi], m.positions.to(device), contiguous, m))
        m = AttentionMetadata.from_lens([hi - lo], [hi], slot_mapping=slots[lo:hi], block_tables=table)
        logits.append(on_device(ids[lo:hi], m.positions.to(device), paged, m))
    error = (torch.cat(logits) - torch.cat(expected)).abs().max().item()
    assert error < 5e-4, error
