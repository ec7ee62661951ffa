"""The trained EAGLE-style draft head as the engine's proposer (vLLM's method "eagle").

The head (radarlab.spec_decode.draft_head) reads the target's features, which only the target's forward
pass has. So the engine's model runner returns the features too (return_features=True) and, after
each step, the engine hands the proposer the features of the positions the step computed
(`observe`): a prefill's every position, or a verify step's last token and drafts, of which only the
accepted ones are kept (those below the request's num_tokens - 1 at the next `propose`). The head
then catches up on those positions (its K/V from the TRUE features, so rejected guesses never
linger), then drafts up to k tokens reading its own outputs, all requests in one head forward per
draft position (draft_head.draft_chain, the loop draft_eval measures).

The head's one-layer K/V lives in a paged cache with its own KVCacheManager, kept in line with
each request's tokens by DraftModelProposer's bookkeeping (rejected drafts roll back, accepted ones
are recomputed from true features). Only the features not yet consumed are kept, plus the last
one: the head re-reads it when a request comes back without new positions.

A request whose features have a gap decodes without drafts: a prefix-cache hit (its first observed
position is not 0), the second and later samples of n > 1 (they share the parent's prefill), or
a request dropped when the head's pool was full. Outputs stay exact; only speculation is lost.
"""
from __future__ import annotations

from typing import Hashable, Sequence as SequenceType

import torch

from radarlab.attention.backends import build_metadata
from radarlab.models.paged_runner import paged_metadata
from radarlab.sample.sampler import probabilities
from radarlab.spec_decode.draft_head import DraftHead, draft_chain
from radarlab.spec_decode.draft_model import DraftModelProposer
from radarlab.spec_decode.proposer import Proposal


class EagleProposer(DraftModelProposer):
    """Drafts from `head` on `target`'s features; vocab: the target ids of the head's draft
    vocabulary (the LM head rows it ranks), or None for the whole vocabulary."""

    def __init__(self, head: DraftHead, target, vocab: torch.Tensor | None, num_speculative_tokens: int,
                 num_blocks: int, block_size: int = 16, backend: str = "torch") -> None:
        tc, hc = target.config, head.config
        for name in ("hidden_size", "vocab_size", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(hc, name) != getattr(tc, name):
                raise ValueError(f"the draft head's {name} is {getattr(hc, name)}, the target's "
                                 f"{getattr(tc, name)}: the head was trained for another model")
        if vocab is not None and (vocab.dim() != 1 or not 0 < vocab.numel() <= tc.vocab_size
                                  or int(vocab.min()) < 0 or int(vocab.max()) >= tc.vocab_size):
            raise ValueError(f"the draft vocabulary must be 1-D target token ids in 0..{tc.vocab_size - 1}")
        super().__init__(head, num_speculative_tokens, num_blocks, block_size, tc.vocab_size, backend)
        self.embed = target.embed_tokens
        weight = target.lm_head.weight
        self.vocab = (torch.arange(tc.vocab_size) if vocab is None else vocab).to(weight.device)
        self.rows = weight[self.vocab].contiguous()
        self.vocab_size = tc.vocab_size
        self.features: dict[Hashable, tuple[int, torch.Tensor]] = {}  # (first position, true features)

    def free(self, request_id: Hashable) -> None:
        super().free(request_id)
        self.features.pop(request_id, None)

    def observe(self, request, start: int, features: torch.Tensor) -> None:
        """The target's features at positions start .. start + len(features) - 1 of the request,
        computed by the step that just ran (its drafts' positions too, before verification)."""
        rid = request.request_id
        if start == 0:  # a prefill, or a recompute after preemption
            self.features[rid] = (0, features.clone())
        elif rid in self.features:
            base, kept = self.features[rid]
            if not base <= start <= base + len(kept):
                self.free(rid)  # a gap: this request drafts no more
                return
            self.features[rid] = (base, torch.cat((kept[:start - base], features)))
        else:
            return
        if rid in self.num_computed:  # head K/V from position start on is stale now
            self.num_computed[rid] = min(self.num_computed[rid], start)

    @torch.inference_mode()
    def propose(self, requests: SequenceType, num_tokens: SequenceType[int]) -> list[Proposal]:
        ready, starts = [], []
        for i, (request, k) in enumerate(zip(requests, num_tokens)):
            entry = self.features.get(request.request_id)
            # features must cover every computed position, 0 .. num_tokens - 2; any past it belong
            # to drafts verification rejected
            if k <= 0 or entry is None or entry[0] + len(entry[1]) < request.num_tokens - 1:
                continue
            if not self._sync(request):
                continue
            start = min(self.num_computed[request.request_id], request.num_tokens - 2)
            if start < entry[0]:  # the head lost K/V whose features are gone (its pool ran out)
                self.free(request.request_id)
                continue
            ready.append(i)
            starts.append(start)
        drafts: list[list[int]] = [[] for _ in requests]
        probs: list[list[torch.Tensor]] = [[] for _ in requests]
        if not ready:
            return [Proposal() for _ in requests]
        seqs = [self.seqs[requests[i].request_id] for i in ready]
        ids, feats = [], []
        for i, seq, start in zip(ready, seqs, starts):
            base, kept = self.features[seq.seq_id]
            end = seq.num_tokens - 1
            ids += seq.all_token_ids[start + 1:end + 1]
            feats.append(kept[start - base:end - base])
            self.num_computed[seq.seq_id] = end
            self.features[seq.seq_id] = (end - 1, kept[end - 1 - base:end - base])  # to re-read if need be
        meta = self._meta(seqs, starts, [s.num_tokens - 1 - st for s, st in zip(seqs, starts)])
        live_seqs = {j: s for j, s in enumerate(seqs)}

        def pick(logits: torch.Tensor, live: list[int]) -> list[int]:
            out = []
            greedy = self.vocab[logits.argmax(-1)].tolist()
            for row, j, g in zip(logits, live, greedy):
                request = requests[ready[j]]
                if request.params.greedy:
                    out.append(g)
                    continue
                full = row.new_full((self.vocab_size,), float("-inf"))
                full[self.vocab] = row
                q = probabilities(full, request.params)
                out.append(int(torch.multinomial(q, 1, generator=self._generator(request))))
                probs[ready[j]].append(q)
            return out

        def next_step(live: list[int], tokens: list[int]):
            kept = []
            for j, token in zip(live, tokens):
                if self._extend(live_seqs[j], token):
                    kept.append(j)
            if not kept:
                return None, []
            # the new query is the head's input at position num_tokens - 2 (feature g, token just drafted)
            return self._meta([live_seqs[j] for j in kept], [live_seqs[j].num_tokens - 2 for j in kept],
                              [1] * len(kept)), kept

        result = draft_chain(self.model, self.embed, self.rows, self.cache,
                             (torch.tensor(ids, device=self.rows.device), torch.cat(feats), meta),
                             [num_tokens[i] for i in ready], pick, next_step)
        for j, i in enumerate(ready):
            drafts[i] = result[j]
        return [Proposal(d, torch.stack(p) if p else None) for d, p in zip(drafts, probs)]

    def _meta(self, seqs, num_computed, num_scheduled):
        return build_metadata(self.cache, paged_metadata(self.manager, seqs, num_computed, num_scheduled,
                                                 self.cache.k.device))
