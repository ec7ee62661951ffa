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
