"""A draft with no weights: the most frequent next token after each context of 1 to 3 tokens,
counted over a training text (the Python standard library's source, as for the draft head).

It drafts by looking up the longest context it has seen (backing off to shorter ones) and chaining
its own guesses. A draft step is a dictionary lookup: next to the target's 270 MFLOP per token its
cost is nil. Prompt lookup (n-gram) copies the sequence's own past; this table carries what code in
general tends to say next (`self.`, `return`, closing brackets), so the two fill each other's gaps.
"""
from __future__ import annotations

import numpy as np
import torch

from radarlab.util import require_int


class TokenTable:
    """context (tuple of 1..max_context token ids) -> the token that most often followed it."""

    def __init__(self, tables: dict[int, dict[tuple, int]], max_context: int) -> None:
        self.tables = tables
        self.max_context = max_context

    @classmethod
    def build(cls, rows: torch.Tensor, vocab_size: int, max_context: int = 3,
              min_count: int = 2) -> "TokenTable":
        """Count over rows [N, L] of token ids (n-grams do not cross rows); contexts seen fewer than
        min_count times are dropped (their guesses are noise)."""
        require_int("max_context", max_context, maximum=3)  # 4 ids of < 2^16 each fit one uint64 key
        if vocab_size >= 1 << 16:
            raise ValueError(f"vocab_size {vocab_size} does not fit the 16-bit packing of the keys")
        ids = rows.long().numpy().astype(np.uint64)
        tables = {}
        for n in range(1, max_context + 1):
            # key = context ids and the next id, 16 bits each; sorting the keys groups each context
            key = np.zeros(ids[:, n:].shape, dtype=np.uint64)
            for j in range(n + 1):
                key = (key << np.uint64(16)) | ids[:, j:ids.shape[1] - n + j]
            keys, counts = np.unique(key.ravel(), return_counts=True)
            ctx, nxt = keys >> np.uint64(16), keys & np.uint64(0xFFFF)
            # per context: the most frequent next id (ties: the smaller id), and the context's total
            order = np.lexsort((nxt, -counts.astype(np.int64), ctx))
            ctx, nxt, counts = ctx[order], nxt[order], counts[order]
            first = np.ones(len(ctx), dtype=bool)
            first[1:] = ctx[1:] != ctx[:-1]
            totals = np.add.reduceat(counts, np.flatnonzero(first))
            keep = totals >= min_count
            tables[n] = dict(zip(ctx[first][keep].tolist(), nxt[first][keep].tolist()))
        return cls(tables, max_context)

    def next_token(self, tokens: list[int]) -> int | None:
        """The guess after `tokens`, from the longest known context, or None."""
        for n in range(min(self.max_context, len(tokens)), 0, -1):
            key = 0
            for t in tokens[len(tokens) - n:]:
                key = (key << 16) | t
            guess = self.tables[n].get(key)
            if guess is not None:
                return guess
        return None

    def propose(self, tokens: list[int], k: int) -> list[int]:
        """Up to k tokens, each guessed after the sequence extended by the previous guesses."""
        seq = list(tokens[-self.max_context:])
        out = []
        for _ in range(k):
            guess = self.next_token(seq)
            if guess is None:
                break
            out.append(guess)
            seq = seq[1:] + [guess]
        return out
