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
generator, in a fixed order (one uniform per checked draft, then one draw for the last token), so a
seeded request verifies the same way in any batch.
"""
from __future__ import annotations

from typing import Sequence

import torch

from radarlab.sample.sampler import probabilities
from radarlab.sample.sampling_params import SamplingParams


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
    best = target_logits.argmax(-1).tolist()
    out = []
    for draft, target in zip(draft_token_ids, best):
        out.append(target)
        if draft != target:
            return out
    out.append(best[len(draft_token_ids)])
    return out


def verify_stochastic(target_probs: torch.Tensor, draft_token_ids: Sequence[int],
                      draft_probs: torch.Tensor | None,
                      generator: torch.Generator | None = None) -> list[int]:
    """Tokens emitted by rejection sampling: accepted drafts, then the residual draw or the bonus.

    target_probs [k+1, V] are p; draft_probs [k, V] are q, or None for one-hot q (a draft without
    probabilities: it is accepted with probability p(x), and on rejection x itself is excluded)."""
    vocab = target_probs.shape[-1]
    _check(target_probs.shape[0], draft_token_ids, draft_probs, vocab)
    target_probs = target_probs.float()
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
        return out
    out.append(int(torch.multinomial(target_probs[-1], 1, generator=generator)))
    return out


def rejection_sample(target_logits: torch.Tensor, draft_token_ids: Sequence[int], params: SamplingParams,
                     draft_probs: torch.Tensor | None = None,
                     generator: torch.Generator | None = None) -> list[int]:
    """One request's verify step from raw target logits [k+1, V]: greedy when params are greedy,
    rejection sampling otherwise, with p under the same temperature, top-k and top-p as the draft's q.
    Returns the emitted tokens: between 1 and k + 1 of them."""
    if target_logits.dim() != 2:
        raise ValueError(f"target_logits must be [k + 1, V], got {tuple(target_logits.shape)}")
    target_logits = target_logits.detach().float().cpu()
    if params.greedy:
        return verify_greedy(target_logits, draft_token_ids)
    return verify_stochastic(probabilities(target_logits, params), draft_token_ids,
                             None if draft_probs is None else draft_probs.detach().float().cpu(), generator)
