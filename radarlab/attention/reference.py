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


def attention_settled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_fresh: torch.Tensor,
                      v_fresh: torch.Tensor, settled: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention for a cache whose positions settle into a lossy form as the sequence grows.

    q [Tq, H, D] are the last Tq of Tk positions; k, v [Tk, Hkv, D] as the cache holds them now, and
    k_fresh, v_fresh the same positions before they settled. Query i reads key j as stored when
    j < settled[i], fresh otherwise: what query i read when it was the newest token (KIVI quantizes a
    key group only once it is complete; radarlab.kvcache.kivi_store)."""
    tq, h, d = q.shape
    tk, hkv, _ = k.shape
    if (k_fresh.shape != k.shape or v.shape != k.shape or v_fresh.shape != k.shape
            or tuple(settled.shape) != (tq,)):
        raise ValueError(f"shape mismatch: q {tuple(q.shape)}, k {tuple(k.shape)}, v "
                         f"{tuple(v.shape)}, k_fresh {tuple(k_fresh.shape)}, v_fresh {tuple(v_fresh.shape)}, "
                         f"settled {tuple(settled.shape)}")
    qg = q.float().view(tq, hkv, h // hkv, d)
    j = torch.arange(tk, device=q.device)[None, :]
    stored = (j < settled.to(q.device)[:, None])[:, None, None, :]  # [Tq, 1, 1, Tk]
    causal = (j <= torch.arange(tq, device=q.device)[:, None] + tk - tq)[:, None, None, :]
    scores = torch.where(stored, torch.einsum("qhgd,khd->qhgk", qg, k.float()),
                         torch.einsum("qhgd,khd->qhgk", qg, k_fresh.float())) * scale
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    out = (torch.einsum("qhgk,khd->qhgd", probs * stored, v.float())
           + torch.einsum("qhgk,khd->qhgd", probs * ~stored, v_fresh.float()))
    return out.reshape(tq, h, d).to(q.dtype)


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
