"""Verify a request's draft tokens against the target model: greedy, or by rejection sampling.

A verify step runs the target once over the last accepted token and the k drafts, which gives k + 1
rows of logits: row i is the target's distribution p_i for the token after draft i - 1. Each draft
x_i was proposed from the draft's distribution q_i (one-hot for a proposer without probabilities,
such as n-gram lookup). Walking the drafts in order (Leviathan et al. 2023, Chen et al. 2023):

- accept x_i with probability min(1, p_i(x_i) / q_i(x_i));
- at the first rejection, draw the replacement from the residual max(0, p_i - q_i), renormalised,
  and stop;
- if all k are accepted, draw a bonus token from p_k.

Every emitted token is then distributed exactly as p: the accepted part contributes min(p, q) and
the residual the remaining p - min(p, q). Greedy verification is the temperature-0 case: accept
while the draft equals the target's argmax, then emit the argmax.

p and q both come from radarlab.sample.sampler.probabilities with the request's SamplingParams, so
temperature, top-k and top-p truncate them identically. Random numbers come from the request's own
generator, in a fixed order, so a seeded request verifies the same way in any batch: verify_stochastic
draws one uniform per checked draft, then one token (residual or bonus); in the engine the bonus is
drawn first (by the ordinary sampler, as in vLLM), then the uniforms and the residual draw.

The engine verifies a whole step at once through rejection_sample, vLLM's batched interface
(vllm/v1/sample/rejection_sampler.py): every request's drafts packed in one tensor, the bonus tokens
sampled beforehand by the ordinary sampler, the output padded with PLACEHOLDER_TOKEN_ID. Anything
with that signature can be passed as Engine(rejection_sampler=...).
"""
from __future__ import annotations

from typing import Sequence

import torch


def _check(num_rows: int, draft_token_ids: Sequence[int], draft_probs: torch.Tensor | None,
           vocab: int) -> None:
    k = len(draft_token_ids)
    if num_rows != k + 1:
        raise ValueError(f"verification needs k + 1 = {k + 1} target rows for {k} "
                         f"draft tokens, got {num_rows}")
    for i, t in enumerate(draft_token_ids):
        if not 0 <= t < vocab:
            raise ValueError(f"draft_token_ids[{i}] is {t}, outside the vocabulary (0..{vocab - 1})")
    if draft_probs is not None and tuple(draft_probs.shape) != (k, vocab):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {vocab}], got {tuple(draft_probs.shape)}")


def verify_greedy(target_logits: torch.Tensor, draft_token_ids: Sequence[int]) -> list[int]:
    """Tokens emitted by a greedy verify step: the accepted drafts (those equal to the target's
    argmax, in order) and then the target's own argmax at the first mismatch, or the bonus token."""
    _check(target_logits.shape[0], draft_token_ids, None, target_logits.shape[-1])
    out, rejected = _accept_greedy(target_logits, draft_token_ids)
    if not rejected:
        out.append(int(target_logits[-1].argmax()))
    return out


def _accept_greedy(target: torch.Tensor, draft_token_ids: Sequence[int]) -> tuple[list[int], bool]:
    """Greedy acceptance over rows 0 .. k-1 of target (logits or probabilities): the drafts while
    they equal the argmax, then the argmax at the first mismatch. Returns (tokens, rejected)."""
    best = target[:len(draft_token_ids)].argmax(-1).tolist()
    out = []
    for draft, token in zip(draft_token_ids, best):
        out.append(token)
        if draft != token:
            return out, True
    return out, False


def verify_stochastic(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                      draft_probs: torch.Tensor | None,
                      generator: torch.Generator | None = None) -> list[int]:
    """Tokens emitted by rejection sampling: accepted drafts, then the residual draw or the bonus.

    target_probs [k+1, V] are p; draft_probs [k, V] are q, or None for one-hot q (a draft without
    probabilities: it is accepted with probability p(x), and on rejection x itself is excluded)."""
    _check(target_probs.shape[0], draft_token_ids, draft_probs, target_probs.shape[-1])
    target_probs = target_probs.float()
    out, rejected = _accept_or_resample(target_probs, draft_token_ids, draft_probs, generator)
    if not rejected:  # every draft accepted: the bonus, from the last row
        out.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return out


def _accept_or_resample(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                        draft_probs: torch.Tensor | None,
                        generator: torch.Generator | None) -> tuple[list[int], bool]:
    """The drafts in order: accepted ones, then at the first rejection a draw from the residual, and
    stop. Rows 0 .. k-1 of target_probs are read. Returns (tokens, whether a draft was rejected)."""
    vocab = target_probs.shape[-1]
    out = []
    for i, x in enumerate(draft_token_ids):
        p = target_probs[i]
        if draft_probs is None:
            q = torch.zeros(vocab).scatter_(0, torch.tensor([x]), 1.0)
        else:
            q = draft_probs[i].float()
        u = torch.rand((), generator=generator)
        if q[x] > 0 and u * q[x] < p[x]:  # u < min(1, p/q) without dividing
            out.append(x)
            continue
        residual = (p - q).clamp_min(0)
        total = residual.sum()
        # p <= q everywhere only if p == q (both sum to 1), and then x is always accepted: rounding
        # can still land here, with a residual of ~0; p itself is the right distribution then.
        dist = residual / total if total > 0 else p
        out.append(int(torch.multinomial(dist, 1, generator=generator)))
        return out, True
    return out, False


PLACEHOLDER_TOKEN_ID = -1  # fills a request's output row past its emitted tokens, as in vLLM


def rejection_sample(draft_token_ids: torch.Tensor, cu_num_draft_tokens: torch.Tensor,
                     draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                     bonus_token_ids: torch.Tensor, is_greedy: Sequence[bool],
                     generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Verify B requests' drafts at once, with vLLM's interface and output.

    draft_token_ids [N]: the drafts of requests 0 .. B-1, packed; cu_num_draft_tokens [B]: inclusive
    cumulative draft counts (request b's are draft_token_ids[cu[b-1]:cu[b]]); draft_probs [N, V], q,
    or None (drafts without probabilities: one-hot q); target_probs [N, V], p at each draft's position;
    bonus_token_ids [B, 1], each request's token after all its drafts, sampled beforehand from its last
    row; is_greedy [B] (greedy requests accept while the draft is p's argmax and use no random
    numbers); generators [B], each request's own (or None).
    Returns [B, max_k + 1] int64: request b's emitted tokens (accepted drafts, then a residual draw or
    its bonus token), then PLACEHOLDER_TOKEN_ID."""
    ends = [int(c) for c in cu_num_draft_tokens]
    num = len(ends)
    if not (bonus_token_ids.shape == (num, 1) and len(is_greedy) == len(generators) == num):
        raise ValueError(f"{num} requests (cu_num_draft_tokens) need bonus_token_ids [B, 1], is_greedy and "
                         f"generators of B = {num}; got {tuple(bonus_token_ids.shape)}, {len(is_greedy)}, "
                         f"{len(generators)}")
    total = ends[-1] if ends else 0
    if draft_token_ids.shape != (total,) or target_probs.shape[0] != total:
        raise ValueError(f"cu_num_draft_tokens counts {total} drafts: draft_token_ids must be [{total}] and "
                         f"target_probs [{total}, V]; got {tuple(draft_token_ids.shape)}, "
                         f"{tuple(target_probs.shape)}")
    starts = [0] + ends[:-1]
    max_k = max([e - s for s, e in zip(starts, ends)], default=0)
    out = torch.full((num, max_k + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    target_probs = target_probs.detach().float().cpu()
    draft_probs = None if draft_probs is None else draft_probs.detach().float().cpu()
    for b, (lo, hi) in enumerate(zip(starts, ends)):
        drafts = draft_token_ids[lo:hi].tolist()
        p, q = target_probs[lo:hi], None if draft_probs is None else draft_probs[lo:hi]
        _check(hi - lo + 1, drafts, q, target_probs.shape[-1])  # vocabulary and q's shape
        if is_greedy[b]:
            tokens, rejected = _accept_greedy(p, drafts)
        else:
            tokens, rejected = _accept_or_resample(p, drafts, q, generators[b])
        if not rejected:
            tokens.append(int(bonus_token_ids[b, 0]))
        out[b, :len(tokens)] = torch.tensor(tokens, dtype=torch.long)
    return out
