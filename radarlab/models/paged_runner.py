"""Run the model on the paged KV cache: one forward step for a set of sequences, and greedy generation.

The block manager (radarlab.kvcache.kv_cache_manager) decides where every token's K/V lives; the pool
(radarlab.kvcache.paged_cache) holds it; this module turns the manager's state into one packed forward
pass. It plays the part of vLLM's model runner (vllm/v1/worker/gpu_model_runner.py), which builds
input ids, positions, slot mapping and block tables from the scheduler's output.

The contract, in vLLM's words: a sequence holds num_tokens token ids with slots reserved (by
allocate or allocate_slots); the first num_computed_tokens of them already have K/V in the pool
(computed earlier, or found in the prefix cache); a step computes the next num_scheduled_tokens of
them, writing their K/V at their slots, and returns the logits after the last one. Copy-on-write
pairs that allocate_slots returned must be copied (PagedKVCache.copy_blocks) before the step runs.
"""
from __future__ import annotations

from typing import Hashable, Sequence as SequenceType

import torch

from radarlab.attention.backends import build_metadata
from radarlab.attention.metadata import AttentionMetadata
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.kvcache.sequence import Sequence
from radarlab.models.generate import check_prompts
from radarlab.models.input_batch import StepInputs, attention_inputs, prepare_inputs, scheduled_token_ids
from radarlab.models.linear import Linear
from radarlab.models.llama import final_features
from radarlab.util import cdiv


def paged_metadata(manager: KVCacheManager, seqs: SequenceType[Sequence],
                   num_computed_tokens: SequenceType[int], num_scheduled_tokens: SequenceType[int],
                   device: str | torch.device | None = None
                   ) -> AttentionMetadata:
    """AttentionMetadata for computing tokens num_computed .. num_computed+num_scheduled-1 of each sequence,
    from the manager's block tables (input_batch.attention_inputs; a step must stay within the slots
    the manager reserved)."""
    if not len(seqs) == len(num_computed_tokens) == len(num_scheduled_tokens):
        raise ValueError(f"seqs, num_computed_tokens and num_scheduled_tokens differ in length: "
                         f"{len(seqs)}, {len(num_computed_tokens)}, {len(num_scheduled_tokens)}")
    block_ids = [manager.get_block_table(s) for s in seqs]  # KeyError for an unknown sequence
    return attention_inputs(block_ids, num_computed_tokens, num_scheduled_tokens, manager.block_size,
                            [manager.num_slots(s) for s in seqs], [s.seq_id for s in seqs], device)


def run_model(model, cache: PagedKVCache, inputs: StepInputs, return_features: bool = False):
    """The forward pass over prepared inputs: logits at inputs.logits_indices, and with
    return_features the normed last hidden states of every scheduled token as well."""
    meta = inputs.attn_metadata
    if return_features:
        features = final_features(model, inputs.input_ids, inputs.positions, cache, meta)
        rows = features[inputs.logits_indices]
        if isinstance(model.lm_head, Linear):  # radarlab's, which takes the C++ operators' GEMV
            return model.lm_head(rows, model.cpu_ops(rows)), features
        return model.lm_head(rows), features
    return model(inputs.input_ids, inputs.positions, cache, meta, logits_indices=inputs.logits_indices)


@torch.inference_mode()
def paged_step(model, cache: PagedKVCache, manager: KVCacheManager, seqs: SequenceType[Sequence],
               num_computed_tokens: SequenceType[int], num_scheduled_tokens: SequenceType[int] | None = None,
               num_logits: SequenceType[int] | None = None, return_features: bool = False,
               spec_token_ids: SequenceType[SequenceType[int]] | None = None):
    """One packed forward pass; returns logits [len(seqs), vocab] after each sequence's last
    scheduled token. num_scheduled_tokens defaults to every token with a slot not yet computed (a
    whole prefill, or the one new token of a decode step). Token ids come from the sequences.

    num_logits[b] > 1 returns the logits after each of sequence b's last num_logits[b] scheduled
    tokens instead (a speculative verify step: the last accepted token and its drafts), all rows of
    sequence 0 first: [sum(num_logits), vocab].

    return_features=True returns (logits, features): features [num scheduled tokens, hidden] are the
    normed last hidden states of every scheduled token, packed (what an EAGLE draft head reads; the
    whole prefill's too, so the head can build its own cache from them). Off by default: no cost.

    spec_token_ids[b]: sequence b's drafts, which follow its tokens (they live beside the sequence,
    never in it); scheduled tokens past the sequence's end are read from them. The engine's
    ModelRunner.execute_model runs the same inputs from the scheduler's output instead."""
    if num_scheduled_tokens is None:
        num_scheduled_tokens = [manager.num_slots(s) - done for s, done in zip(seqs, num_computed_tokens)]
    if not len(seqs) == len(num_computed_tokens) == len(num_scheduled_tokens):
        raise ValueError(f"seqs, num_computed_tokens and num_scheduled_tokens differ in length: "
                         f"{len(seqs)}, {len(num_computed_tokens)}, {len(num_scheduled_tokens)}")
    drafts = [()] * len(seqs) if spec_token_ids is None else spec_token_ids
    block_ids = [manager.get_block_table(s) for s in seqs]  # KeyError for an unknown sequence
    token_ids = [scheduled_token_ids(s, done, n, d)
                 for s, done, n, d in zip(seqs, num_computed_tokens, num_scheduled_tokens, drafts)]
    inputs = prepare_inputs(cache, token_ids, block_ids, num_computed_tokens, num_scheduled_tokens,
                            num_logits, num_slots=[manager.num_slots(s) for s in seqs],
                            seq_ids=[s.seq_id for s in seqs])
    return run_model(model, cache, inputs, return_features)


def blocks_needed(prompts: SequenceType[SequenceType[int]], max_new_tokens: int, block_size: int) -> int:
    """Blocks that hold every prompt and its new tokens with no sharing: a pool that never runs out."""
    return sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)


@torch.inference_mode()
def paged_greedy_generate(model, prompts: list[list[int]], max_new_tokens: int, *,
                          manager: KVCacheManager | None = None, cache: PagedKVCache | None = None,
                          block_size: int = 16, enable_prefix_caching: bool = True, backend: str = "torch",
                          eos_token_id: int | None = None, seq_ids: SequenceType[Hashable] | None = None,
                          free_finished: bool = True, kv_cache_dtype: str = "auto") -> list[list[int]]:
    """greedy_generate on the paged cache: same arguments, same result (new tokens per prompt).

    Each prompt becomes a Sequence; all are allocated first (prefix-cache hits skip their cached
    blocks), prefilled in one packed step, then decoded together, one allocate_slots per token. Pass
    manager and cache to keep them across calls (a later call then hits the blocks this one cached);
    by default both are made to fit, the pool in kv_cache_dtype (a name of radarlab.quant.formats).
    Finished sequences are freed unless free_finished is False. There
    is no scheduler here: a pool too small raises NoFreeBlocks (notebook 05's engine preempts instead).
    """
    cfg = model.config
    check_prompts(prompts, max_new_tokens, cfg.max_position_embeddings)
    if (manager is None) != (cache is None):
        raise ValueError("pass both manager and cache, or neither")
    if manager is None:
        num_blocks = blocks_needed(prompts, max_new_tokens, block_size)
        manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching)
        param = next(model.parameters())
        cache = PagedKVCache.for_model(cfg, num_blocks, block_size, dtype=param.dtype, device=param.device,
                                       backend=backend, kv_cache_dtype=kv_cache_dtype)
    if manager.block_size != cache.block_size or manager.num_blocks != cache.num_blocks:
        raise ValueError(f"manager ({manager.num_blocks} blocks of {manager.block_size}) and cache "
                         f"({cache.num_blocks} blocks of {cache.block_size}) describe different pools")
    seq_ids = list(range(len(prompts))) if seq_ids is None else list(seq_ids)
    if len(seq_ids) != len(prompts) or len(set(seq_ids)) != len(seq_ids):
        raise ValueError(f"seq_ids must be {len(prompts)} distinct ids, one per prompt; got {seq_ids}")

    seqs = [Sequence(s, p, manager.block_size) for s, p in zip(seq_ids, prompts)]
    computed = {s.seq_id: manager.allocate(s) for s in seqs}
    active = seqs
    while active:
        logits = paged_step(model, cache, manager, active, [computed[s.seq_id] for s in active])
        still = []
        for s, tok in zip(active, logits.argmax(-1).tolist()):
            computed[s.seq_id] = s.num_tokens
            s.append_token_ids([tok])
            if s.num_output_tokens < max_new_tokens and tok != eos_token_id:
                cache.copy_blocks(manager.allocate_slots(s, 1))
                still.append(s)
            elif free_finished:
                manager.free(s)
        active = still
    return [list(s.output_token_ids) for s in seqs]


def prefill_metadata(cache: PagedKVCache, token_ids: SequenceType[int], backend=None) -> AttentionMetadata:
    """The metadata of one step that prefills one sequence from an empty pool (a fresh block manager
    over the pool's blocks), built by `backend` (default: the cache's, radarlab.attention.backends)."""
    manager = KVCacheManager(cache.num_blocks, cache.block_size, enable_prefix_caching=False)
    seq = Sequence(0, list(token_ids), cache.block_size)
    manager.allocate(seq)  # NoFreeBlocks when the pool is too small for the sequence
    meta = paged_metadata(manager, [seq], [0], [seq.num_tokens], cache.k.device)
    return build_metadata(cache, meta, backend)


@torch.inference_mode()
def paged_prefill_logits(model, cache: PagedKVCache, token_ids: SequenceType[int],
                         logits_indices: torch.Tensor | None = None, backend=None) -> torch.Tensor:
    """Logits of one sequence prefilled in one step from a pool of its own (teacher forcing: perplexity,
    logprobs): every row, or those in logits_indices. Each layer writes its K/V into the pool, in the
    pool's format, and attends over what the pool gives back, so a quantized cache counts. backend:
    the attention backend every layer runs (default: the cache's), e.g. one that records its inputs."""
    meta = prefill_metadata(cache, token_ids, backend)
    ids = torch.tensor(list(token_ids), device=cache.k.device)
    return model(ids, meta.positions, cache, meta, logits_indices=logits_indices)
