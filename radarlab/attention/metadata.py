"""What one forward step needs to know about its sequences, passed explicitly to every layer.

Tokens of all sequences in a step are packed into one flat batch ("varlen"), as vLLM does:
sequence b owns tokens query_start_loc[b]:query_start_loc[b+1], and after this step it holds
seq_lens[b] tokens of context, so its new tokens sit at positions seq_lens[b]-query_len .. seq_lens[b]-1.

The metadata is built once per step, moved to the device once (to), and is frozen: every layer
reads the same object. The attention backend's build (radarlab.attention.backends) validates it
against the pool and returns a copy stamped with the pool's geometry (checked_for), with its own
per-step plan and with itself as `backend`, so the 30 layers of a step do not validate it 30 times,
a metadata never checked for this pool cannot pass as checked, and every layer runs the backend
that built it (vLLM gives each backend a metadata class of its own).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # for the annotation only: sdpa_paged is not imported at run time
    from radarlab.attention.sdpa_paged import PagedSDPAPlan


@dataclass(frozen=True)
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [B+1] int, cumulative query lengths
    seq_lens: torch.Tensor  # [B] int, context length of each sequence after this step
    cache_rows: torch.Tensor | None = None  # [B] contiguous cache: the row each sequence owns
    slot_mapping: torch.Tensor | None = None  # [T] paged cache: where each new token's K/V goes
    block_tables: torch.Tensor | None = None  # [B, max_blocks] paged cache: physical block ids
    checked_for: tuple | None = None  # the pool geometry these were validated against, if any
    plan: "PagedSDPAPlan | None" = None  # the torch backend's per-step plan (radarlab.attention.sdpa_paged)
    # the attention backend whose build() made this (radarlab.attention.backends)
    backend: object | None = None

    def __post_init__(self) -> None:
        if self.query_start_loc.dim() != 1 or self.seq_lens.dim() != 1:
            raise ValueError("query_start_loc and seq_lens must be 1-D")
        if self.query_start_loc.numel() != self.seq_lens.numel() + 1:
            raise ValueError(
                f"query_start_loc has {self.query_start_loc.numel()} entries; expected len(seq_lens)+1 = "
                f"{self.seq_lens.numel() + 1}"
            )
        q_lens = self.query_lens
        if (q_lens < 0).any():
            raise ValueError("query_start_loc must be non-decreasing")
        if (q_lens > self.seq_lens).any():
            raise ValueError("a sequence has more new tokens (query_len) than context (seq_lens)")

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.numel()

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc[-1])

    @property
    def query_lens(self) -> torch.Tensor:
        return self.query_start_loc[1:] - self.query_start_loc[:-1]

    @property
    def positions(self) -> torch.Tensor:
        """Absolute position of every packed token, on the metadata's device, without a Python loop."""
        q_lens = self.query_lens.long()
        starts = self.query_start_loc[:-1].long()
        first_pos = (self.seq_lens.long() - q_lens)
        token = torch.arange(self.num_tokens, device=self.seq_lens.device)
        return token + torch.repeat_interleave(first_pos - starts, q_lens, output_size=self.num_tokens)

    def to(self, device: str | torch.device) -> "AttentionMetadata":
        """The same metadata with every tensor on device (one copy per step, not one per layer)."""
        moved = {f.name: getattr(self, f.name).to(device) for f in fields(self)
                 if isinstance(getattr(self, f.name), torch.Tensor)}
        return replace(self, **moved)

    @staticmethod
    def from_lens(query_lens: list[int], seq_lens: list[int], **extra) -> "AttentionMetadata":
        qsl = torch.zeros(len(query_lens) + 1, dtype=torch.long)
        qsl[1:] = torch.cumsum(torch.tensor(query_lens, dtype=torch.long), 0) if query_lens else qsl[1:]
        return AttentionMetadata(qsl, torch.tensor(seq_lens, dtype=torch.long), **extra)
