"""Greedy generation with our forward pass on a contiguous cache: the reference the engine must match."""
from __future__ import annotations

import torch

from radarlab.attention.backends import build_metadata
from radarlab.attention.metadata import AttentionMetadata
from radarlab.kvcache.contiguous import ContiguousKVCache
from radarlab.util import require_int


def check_prompts(prompts: list[list[int]], max_new_tokens: int, max_len: int) -> None:
    """Reject inputs that cannot run: empty prompts, no new tokens, or more than the model's context."""
    if not prompts:
        raise ValueError("prompts is empty")
    require_int("max_new_tokens", max_new_tokens)
    for i, p in enumerate(prompts):
        if len(p) == 0:
            raise ValueError(f"prompt {i} is empty")
        if len(p) + max_new_tokens > max_len:
            raise ValueError(
                f"prompt {i} has {len(p)} tokens; with max_new_tokens={max_new_tokens} it needs "
                f"{len(p) + max_new_tokens} positions, more than the model's maximum context of {max_len}"
            )


@torch.inference_mode()
def greedy_generate(model, prompts: list[list[int]], max_new_tokens: int,
                    eos_token_id: int | None = None, backend=None) -> list[list[int]]:
    """Generate for all prompts at once (packed prefill, then batched decode). Returns new tokens only;
    a sequence that emits eos_token_id keeps it and stops. `backend` runs every layer's attention
    (default: the contiguous cache's, radarlab.attention.backends.contiguous_attn)."""
    cfg = model.config
    check_prompts(prompts, max_new_tokens, cfg.max_position_embeddings)
    device = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    longest = max(len(p) for p in prompts) + max_new_tokens
    cache = ContiguousKVCache.for_model(cfg, len(prompts), longest, dtype=dtype, device=device)
    outputs: list[list[int]] = [[] for _ in prompts]
    lens = [len(p) for p in prompts]
    active = list(range(len(prompts)))
    step_tokens = [list(p) for p in prompts]
    while active:
        q_lens = [len(step_tokens[i]) for i in active]
        meta = build_metadata(cache, AttentionMetadata.from_lens(q_lens, [lens[i] for i in active],
                                                                 cache_rows=torch.tensor(active)), backend)
        ids = torch.tensor([t for i in active for t in step_tokens[i]], device=device)
        logits = model(ids, meta.positions.to(device), cache, meta,
                       logits_indices=meta.query_start_loc[1:] - 1)
        next_ids = logits.argmax(-1).tolist()
        still = []
        for i, tok in zip(active, next_ids):
            outputs[i].append(tok)
            done = len(outputs[i]) >= max_new_tokens or tok == eos_token_id
            if not done:
                step_tokens[i] = [tok]
                lens[i] += 1
                still.append(i)
        active = still
    return outputs
