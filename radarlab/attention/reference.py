"""Attention as plain math, written for clarity. Every faster path is tested against this."""
from __future__ import annotations

import torch


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool = True
) -> torch.Tensor:
    """softmax(q k^T * scale) v for one sequence, with grouped-query heads.

    q: [Tq, H, D]; k, v: [Tk, Hkv, D] with H a multiple of Hkv. Query head h reads KV head
    h // (H // Hkv). With causal=True the queries are the last Tq of the Tk positions, so query i
    sees keys 0 .. Tk - Tq + i. Softmax runs in fp32 whatever the input dtype.
    """
    tq, h, d = q.shape
    tk, hkv, dk = k.shape
    if d != dk or v.shape != k.shape:
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if h % hkv:
        raise ValueError(f"num query heads {h} is not a multiple of num kv heads {hkv}")
    if causal and tq > tk:
        raise ValueError(f"causal attention with more queries ({tq}) than keys ({tk})")
    group = h // hkv
    k = k.repeat_interleave(group, dim=1)  # [Tk, H, D]
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        offset = tk - tq
        visible = torch.arange(tk)[None, :] <= (torch.arange(tq)[:, None] + offset)
        scores = scores.masked_fill(~visible.to(scores.device), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def online_softmax_update(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, scores: torch.Tensor,
                          values: torch.Tensor):
    """Fold one block of scores [G, N] and values [N, D] into the running state of G query heads:
    m [G] the largest score so far, l [G] the sum of exp(score - m), acc [G, D] the sum of
    exp(score - m) * value. acc / l after the last block is softmax attention: what a paged kernel
    computes one block at a time, without ever holding all the scores (FlashAttention's rescaling)."""
    m_new = torch.maximum(m, scores.max(dim=1).values)
    alpha = torch.exp(m - m_new)  # rescales what was summed under the old maximum
    p = torch.exp(scores - m_new[:, None])
    return m_new, l * alpha + p.sum(dim=1), acc * alpha[:, None] + p @ values
