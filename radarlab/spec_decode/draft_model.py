"""Drafts from a smaller causal LM with the target's tokenizer (vLLM's draft_model method).

The draft keeps its own paged KV cache: its own KVCacheManager and PagedKVCache, holding a copy
(a Sequence) of each request's tokens. Each call first brings that copy in line with the request:
rejected drafts are rolled back (KVCacheManager.rollback_slots frees their blocks), accepted drafts
keep the K/V the draft computed while proposing them, and new tokens are appended. Then the draft
runs k single-token steps for all requests together (the first step also catches up on whatever
the draft has not computed: the whole prompt the first time, the target's token afterwards).

Greedy requests take the draft's argmax; sampled requests draw from the draft's q (the request's
temperature, top-k and top-p, through radarlab.sample.sampler.probabilities) with a generator of
the proposer's own per request, seeded from the request's seed, so runs are reproducible.

When the draft's pool is full, a request gets fewer drafts (or none) instead of waiting.

truncated_copy makes the simplest draft: the target's own first layers (an early exit), sharing
its weights. It is cheap to build and useful for tests; a trained draft does far better.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence as SequenceType

import torch
from torch import nn

from radarlab.kvcache.block_pool import NoFreeBlocks
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.kvcache.sequence import Sequence
from radarlab.models.paged_runner import paged_step
from radarlab.sample.sampler import probabilities
from radarlab.spec_decode.proposer import Proposal
from radarlab.util import require_int

_DRAFT_SEED_OFFSET = 0x9E3779B97F4A7C15  # keeps the draft's random stream apart from the request's own


def truncated_copy(model, num_layers: int):
    """A draft made of the model's first num_layers decoder layers, then its final norm and LM head
    (an early exit). Shares the model's weights: nothing is copied."""
    num_layers = require_int("num_layers", num_layers, 1, model.config.num_layers)
    config = dataclasses.replace(model.config, num_layers=num_layers)
    with torch.device("meta"):
        draft = type(model)(config)
    draft.embed_tokens, draft.norm, draft.lm_head = model.embed_tokens, model.norm, model.lm_head
    draft.layers = nn.ModuleList(model.layers[:num_layers])
    draft.inv_freq = model.inv_freq
    return draft.eval()


class DraftModelProposer:
    """Drafts from `model` (our Llama, or anything with the same forward signature and .config).

    vocab_size is the target's: a draft with another vocabulary cannot propose the target's tokens,
    so it is refused here. Same vocabulary size is what can be checked from the weights; same
    tokenizer is the caller's promise (vLLM checks no more)."""

    def __init__(self, model, num_speculative_tokens: int, num_blocks: int, block_size: int = 16,
                 vocab_size: int | None = None, backend: str = "torch") -> None:
        cfg = model.config
        if vocab_size is not None and cfg.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary has {cfg.vocab_size} tokens, the target's "
                             f"{vocab_size}: a draft_model must share the target's tokenizer")
        self.model = model
        self.num_speculative_tokens = require_int("num_speculative_tokens", num_speculative_tokens, 0)
        self.manager = KVCacheManager(num_blocks, block_size, enable_prefix_caching=False)
        param = next(model.parameters())
        self.cache = PagedKVCache.for_model(cfg, num_blocks, block_size, dtype=param.dtype,
                                            device=param.device,
                                            backend=backend)
        self.seqs: dict[Hashable, Sequence] = {}
        self.num_computed: dict[Hashable, int] = {}
        self.generators: dict[Hashable, torch.Generator] = {}

    def free(self, request_id: Hashable) -> None:
        if request_id in self.seqs:
            self.manager.free(self.seqs.pop(request_id))
            del self.num_computed[request_id]
        self.generators.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: SequenceType, num_tokens: SequenceType[int]) -> list[Proposal]:
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        active = [i for i, (r, k) in enumerate(zip(requests, num_tokens)) if k > 0 and self._sync(r)]
        while active:
            seqs = [self.seqs[requests[i].request_id] for i in active]
            logits = paged_step(self.model, self.cache, self.manager, seqs,
                                [self.num_computed[s.seq_id] for s in seqs])
            still = []
            for i, seq, row in zip(active, seqs, logits):
                request = requests[i]
                self.num_computed[seq.seq_id] = seq.num_tokens
                q = probabilities(row, request.params)
                token = int(q.argmax()) if request.params.greedy else \
                    int(torch.multinomial(q, 1, generator=self._generator(request)))
                drafts[i].append(token)
                probs[i].append(q)
                if len(drafts[i]) < num_tokens[i] and self._extend(seq, token):
                    still.append(i)
            active = still
        return [Proposal(d, torch.stack(p) if d else None) for d, p in zip(drafts, probs)]

    def _extend(self, seq, token: int) -> bool:
        """Append a drafted token to the draft's copy with a slot for it; False (and the token taken
        back) when the draft's pool is full: that request stops drafting this step."""
        seq.append_token_ids([token])
        try:
            self.cache.copy_blocks(self.manager.allocate_slots(seq, 1))
        except NoFreeBlocks:
            seq.truncate(seq.num_tokens - 1)
            return False
        return True

    def _sync(self, request) -> bool:
        """Make the draft's copy of the request hold exactly its tokens, with slots for all of them.
        False (and no copy kept) when the draft's pool cannot hold them."""
        tokens = request.all_token_ids
        seq = self.seqs.get(request.request_id)
        if seq is not None:
            mine = seq.all_token_ids
            common = 0
            limit = min(len(mine), len(tokens))
            while common < limit and mine[common] == tokens[common]:
                common += 1
            if common < seq.num_prompt_tokens:  # not the same prompt: start over
                self.free(request.request_id)
                seq = None
            else:
                seq.truncate(common)  # its rejected drafts go, and their slots
                self.manager.rollback_slots(seq, min(common, self.manager.num_slots(seq)))
                seq.append_token_ids(tokens[common:])
                self.num_computed[seq.seq_id] = min(self.num_computed[seq.seq_id], common, seq.num_tokens - 1)
        if seq is None:
            seq = Sequence(request.request_id, tokens, self.manager.block_size)
            try:
                self.manager.allocate(seq)
            except (NoFreeBlocks, ValueError):  # short now, or longer than the whole draft pool
                return False
            self.seqs[seq.seq_id] = seq
            self.num_computed[seq.seq_id] = 0
            return True
        try:
            self.cache.copy_blocks(self.manager.allocate_slots(seq,
                                                               seq.num_tokens - self.manager.num_slots(seq)))
        except NoFreeBlocks:
            self.free(request.request_id)
            return False
        return True

    def _generator(self, request) -> torch.Generator:
        gen = self.generators.get(request.request_id)
        if gen is None:
            gen = torch.Generator()
            seed = request.params.seed
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed((seed + _DRAFT_SEED_OFFSET) % 2 ** 64)
            self.generators[request.request_id] = gen
        return gen
