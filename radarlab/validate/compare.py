"""vLLM's own rule for "these two greedy runs agree", and our side's top-k logprobs to apply it.

Two correct implementations need not produce identical tokens: a different reduction order can flip
a near-tie between the top two candidates, and after that the continuations legitimately part ways.
So vLLM's tests (check_logprobs_close) accept two runs when their tokens are equal up to the first
divergence and, at that position, each side's token is among the other side's top-k logprobs,
i.e. the two disagree only where the model itself was unsure. Nothing after the divergence is
compared, because the contexts differ from there on.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from radarlab.attention.metadata import AttentionMetadata
from radarlab.kvcache.contiguous import ContiguousKVCache
from radarlab.util import cdiv, is_int, require_int


@dataclass(frozen=True)
class Comparison:
    """Outcome of comparing two token sequences by vLLM's rule."""

    matched: int  # length of the common prefix of tokens
    diverged_at: int | None  # first index where the tokens differ, or None
    passed: bool
    reason: str  # one plain sentence: why it passed or failed
    len_a: int
    len_b: int

    @property
    def identical(self) -> bool:
        return self.diverged_at is None and self.len_a == self.len_b


def _check_tokens(tokens, name: str) -> list[int]:
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.tolist()
    if not isinstance(tokens, Sequence) or isinstance(tokens, (str, bytes)):
        raise TypeError(f"{name} must be a sequence of token ids, got {type(tokens).__name__}")
    out = []
    for i, t in enumerate(tokens):
        if not is_int(t) or t < 0:
            raise ValueError(f"{name}[{i}] must be a non-negative integer token id, got {t!r}")
        out.append(t)
    return out


def _check_logprobs(logprobs, n: int, name: str) -> Sequence:
    if not isinstance(logprobs, Sequence) or isinstance(logprobs, (str, bytes)):
        raise TypeError(f"{name} must be a list with one {{token_id: logprob}} dict per generated token")
    if len(logprobs) < n:
        raise ValueError(f"{name} has {len(logprobs)} positions but {n} tokens need comparing")
    return logprobs


def _top(entry, k: int | None, name: str, pos: int) -> set[int]:
    """Token ids of one position's logprob dict, limited to its k most likely if k is given."""
    if not isinstance(entry, Mapping) or not entry:
        raise ValueError(f"{name}[{pos}] must be a non-empty {{token_id: logprob}} dict, got {entry!r}")
    items = [(int(t), float(lp)) for t, lp in entry.items()]
    if k is not None:
        items = sorted(items, key=lambda kv: kv[1], reverse=True)[:k]
    return {t for t, _ in items}


def compare_greedy(tokens_a, logprobs_a, tokens_b, logprobs_b, k: int | None = None,
                   names: tuple[str, str] = ("a", "b")) -> Comparison:
    """vLLM's check_logprobs_close rule for one prompt.

    tokens_*: generated token ids. logprobs_*: per generated position a {token_id: logprob} dict of
    that side's most likely tokens. k limits each dict to its k most likely entries (vLLM may add the
    sampled token as a (k+1)-th); None uses every entry given. As in vLLM, when one sequence is a
    prefix of the other (e.g. one stopped at EOS), the shared part decides.
    """
    if k is not None:
        require_int("k", k)
    a, b = _check_tokens(tokens_a, "tokens_a"), _check_tokens(tokens_b, "tokens_b")
    n = min(len(a), len(b))
    matched = next((i for i in range(n) if a[i] != b[i]), n)
    if matched == n:
        _check_logprobs(logprobs_a, 0, "logprobs_a")  # type checks only; nothing to look up
        _check_logprobs(logprobs_b, 0, "logprobs_b")
        if len(a) == len(b):
            reason = f"all {n} tokens identical"
        else:
            reason = (f"identical over the shared {n} tokens ({names[0]} has {len(a)}, "
                      f"{names[1]} has {len(b)})")
        return Comparison(matched, None, True, reason, len(a), len(b))
    lp_a = _check_logprobs(logprobs_a, matched + 1, "logprobs_a")
    lp_b = _check_logprobs(logprobs_b, matched + 1, "logprobs_b")
    top_a = _top(lp_a[matched], k, "logprobs_a", matched)
    top_b = _top(lp_b[matched], k, "logprobs_b", matched)
    ta, tb = a[matched], b[matched]
    kk = f"top-{k}" if k else "top"
    missing = []
    if ta not in top_b:
        missing.append(f"{names[0]}'s token {ta} is not in {names[1]}'s {kk} logprobs")
    if tb not in top_a:
        missing.append(f"{names[1]}'s token {tb} is not in {names[0]}'s {kk} logprobs")
    if missing:
        reason = f"tokens differ at position {matched} and " + "; ".join(missing)
        return Comparison(matched, matched, False, reason, len(a), len(b))
    reason = (f"tokens equal up to position {matched}; there {ta} vs {tb}, each in the other's {kk} "
              f"logprobs (a near-tie)")
    return Comparison(matched, matched, True, reason, len(a), len(b))


def max_logprob_diff(logprobs_a, logprobs_b, positions: int) -> float:
    """Largest |logprob_a - logprob_b| over tokens present in both dicts, at the first `positions`
    positions: how close two implementations' numbers are where their contexts are still the same."""
    worst = 0.0
    for pos in range(positions):
        a = {int(t): float(v) for t, v in logprobs_a[pos].items()}
        b = {int(t): float(v) for t, v in logprobs_b[pos].items()}
        for t in a.keys() & b.keys():
            worst = max(worst, abs(a[t] - b[t]))
    return worst


@torch.inference_mode()
def topk_logprobs(model, prompt_ids, continuation_ids, k: int, kv_cache_dtype: str | None = None,
                  block_size: int = 16) -> list[dict[int, float]]:
    """Our top-k logprobs at each continuation position, by one teacher-forced forward.

    Entry i is the distribution that predicts continuation_ids[i] given the prompt and
    continuation_ids[:i], as vLLM reports it for its own generated tokens. One prefill of
    prompt + continuation[:-1] gives them all (causal attention), instead of a decode loop.
    With kv_cache_dtype the forward runs over a paged cache of that format (e.g. FP8), which every
    layer writes and then reads back, as a decode loop over that cache would; else a contiguous one.
    """
    cfg = model.config
    prompt = _check_tokens(prompt_ids, "prompt_ids")
    cont = _check_tokens(continuation_ids, "continuation_ids")
    if not prompt:
        raise ValueError("prompt_ids is empty; the first continuation token needs a context")
    require_int("k", k, 1, cfg.vocab_size)
    bad = [t for t in prompt + cont if t >= cfg.vocab_size]
    if bad:
        raise ValueError(f"token id {bad[0]} is outside the vocabulary (size {cfg.vocab_size})")
    if not cont:
        return []
    ids = prompt + cont[:-1]
    n = len(ids)
    if n > cfg.max_position_embeddings:
        raise ValueError(f"prompt + continuation need {n} positions, more than the model's maximum "
                         f"context of {cfg.max_position_embeddings}")
    param = next(model.parameters())
    rows = torch.arange(len(prompt) - 1, n, device=param.device)
    if kv_cache_dtype is not None:
        from radarlab.kvcache.paged_cache import PagedKVCache
        from radarlab.models.paged_runner import paged_prefill_logits

        cache = PagedKVCache.for_model(cfg, cdiv(n, block_size), block_size, dtype=param.dtype,
                                       device=param.device, kv_cache_dtype=kv_cache_dtype)
        logits = paged_prefill_logits(model, cache, ids, logits_indices=rows)
    else:
        cache = ContiguousKVCache.for_model(cfg, 1, n, dtype=param.dtype, device=param.device)
        meta = AttentionMetadata.from_lens([n], [n], cache_rows=torch.tensor([0]))
        logits = model(torch.tensor(ids, device=param.device), meta.positions.to(param.device), cache, meta,
                       logits_indices=rows)
    logp = torch.log_softmax(logits.float(), dim=-1)
    values, indices = logp.topk(k, dim=-1)
    return [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
