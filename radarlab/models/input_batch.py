"""One step's inputs, built and checked once: token ids, positions, slot mapping, block tables, the
logits rows, and where a verify step's drafts and their rows sit.

vLLM's model runner builds these from the scheduler's output (GPUModelRunner._prepare_inputs,
vllm/v1/worker/gpu_model_runner.py; the drafts' rows are its SpecDecodeMetadata,
vllm/v1/spec_decode/metadata.py). Here prepare_inputs is the one place they are built, for the
engine's ModelRunner.execute_model and for paged_step alike; every layer then reads the same frozen
AttentionMetadata, built by the attention backend once.

The logits rows: a sequence gets num_logits rows, the logits after each of its last num_logits
scheduled tokens (1 for a decode or the end of a prefill; 1 + k for a verify step with k drafts,
since the logits after the last accepted token and after each draft judge the next one).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Hashable, Sequence

import torch

from radarlab.attention.backends import build_metadata
from radarlab.attention.metadata import AttentionMetadata
from radarlab.kvcache.block_table import block_table_tensor, compute_slot_mapping
from radarlab.util import cdiv


@dataclass(frozen=True)
class SpecDecodeMetadata:
    """Where a verify step's drafts sit among the logits rows (vLLM's SpecDecodeMetadata).

    Sequence b has num_draft_tokens[b] drafts and 1 + that many consecutive rows: the rows at
    target_logits_indices[cu_num_draft_tokens[b] - k : cu_num_draft_tokens[b]] judge its k drafts,
    and bonus_logits_indices[b] is its last row (the bonus token after k accepted drafts; the one
    sample of a sequence without drafts)."""
    draft_token_ids: torch.Tensor  # [num drafts], packed in sequence order
    num_draft_tokens: list[int]
    cu_num_draft_tokens: torch.Tensor  # [B] int32, inclusive: drafts of sequences 0..b
    target_logits_indices: torch.Tensor  # [num drafts], rows of the step's logits
    bonus_logits_indices: torch.Tensor  # [B], rows of the step's logits

    def rows(self, b: int) -> slice:
        """Sequence b's rows of the step's logits: its drafts' targets, then its bonus row."""
        last = int(self.bonus_logits_indices[b])
        return slice(last - self.num_draft_tokens[b], last + 1)

    @staticmethod
    def make(draft_token_ids: Sequence[Sequence[int]], device=None) -> "SpecDecodeMetadata":
        """The metadata of a step whose sequence b verifies draft_token_ids[b] (and has 1 + k rows)."""
        counts = [len(d) for d in draft_token_ids]
        cu = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32)
        bonus = cu.long() + torch.arange(len(counts))  # row of b's bonus: all earlier rows, then its drafts
        target = torch.cat([torch.arange(last - k, last) for last, k in zip(bonus.tolist(), counts)])
        drafts = torch.tensor([t for d in draft_token_ids for t in d], dtype=torch.long)
        moved = [t if device is None else t.to(device) for t in (drafts, cu, target, bonus)]
        return SpecDecodeMetadata(moved[0], counts, *moved[1:])


@dataclass(frozen=True)
class StepInputs:
    """What one forward pass reads: packed input_ids and positions [T], the built attention metadata,
    and logits_indices [R], the packed tokens whose logits the step returns."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    spec_decode_metadata: SpecDecodeMetadata | None = None


def scheduled_token_ids(seq, num_computed: int, num_scheduled: int, spec_token_ids: Sequence[int] = ()
                        ) -> list[int]:
    """The token ids a step computes for a sequence: positions num_computed.. of its tokens, then its
    drafts (which live beside the sequence, never in it) for the positions past its end. Fewer than
    num_scheduled when the sequence and its drafts run out (prepare_inputs refuses that)."""
    end = num_computed + num_scheduled
    return list(seq.all_token_ids[num_computed:end]) + list(spec_token_ids[:max(0, end - seq.num_tokens)])


def attention_inputs(block_ids: Sequence[Sequence[int]], num_computed_tokens: Sequence[int],
                     num_scheduled_tokens: Sequence[int], block_size: int,
                     num_slots: Sequence[int] | None = None, seq_ids: Sequence[Hashable] | None = None,
                     device: str | torch.device | None = None) -> AttentionMetadata:
    """AttentionMetadata (not yet built by a backend) for computing tokens num_computed ..
    num_computed + num_scheduled - 1 of each sequence, whose blocks are block_ids[b]; checked here.

    seq_lens (the context each query attends to) is num_computed + num_scheduled: the step reads and
    writes no position past that. num_slots[b]: the positions that have slots reserved for sequence b
    (default: all its blocks hold); a step must not write past them (a shared block past them belongs
    to another sequence too)."""
    seq_ids = list(range(len(block_ids))) if seq_ids is None else seq_ids
    if not len(block_ids) == len(num_computed_tokens) == len(num_scheduled_tokens) == len(seq_ids):
        raise ValueError(f"block_ids, num_computed_tokens and num_scheduled_tokens differ in length: "
                         f"{len(block_ids)}, {len(num_computed_tokens)}, {len(num_scheduled_tokens)}")
    if not block_ids:
        raise ValueError("seqs is empty: a step needs at least one sequence")
    num_slots = [len(ids) * block_size for ids in block_ids] if num_slots is None else num_slots
    for s, done, n, total in zip(seq_ids, num_computed_tokens, num_scheduled_tokens, num_slots):
        if n < 1:
            raise ValueError(f"sequence {s!r}: num_scheduled_tokens must be >= 1, got {n}")
        if done < 0 or done + n > total:
            raise ValueError(f"sequence {s!r}: tokens {done}..{done + n - 1} are scheduled but only {total} "
                             f"have slots (num_computed_tokens={done}, num_scheduled_tokens={n})")
    seq_lens = [done + n for done, n in zip(num_computed_tokens, num_scheduled_tokens)]
    block_tables = block_table_tensor(block_ids, max(cdiv(length, block_size) for length in seq_lens))
    meta = AttentionMetadata.from_lens(list(num_scheduled_tokens), seq_lens, block_tables=block_tables)
    req_indices = torch.repeat_interleave(torch.arange(len(seq_lens)), meta.query_lens)
    slot_mapping = compute_slot_mapping(block_tables, meta.positions, block_size, req_indices)
    meta = replace(meta, slot_mapping=slot_mapping)
    return meta if device is None else meta.to(device)


def logits_indices(query_start_loc: torch.Tensor, num_logits: Sequence[int] | None = None) -> torch.Tensor:
    """Packed indices of each sequence's last num_logits[b] tokens (default: its last one)."""
    last = query_start_loc[1:] - 1
    if num_logits is None:
        return last
    query_lens = (query_start_loc[1:] - query_start_loc[:-1]).tolist()
    if len(num_logits) != len(query_lens):
        raise ValueError(f"num_logits has {len(num_logits)} entries for {len(query_lens)} sequences")
    for b, (m, n) in enumerate(zip(num_logits, query_lens)):
        if not 1 <= m <= n:
            raise ValueError(f"sequence {b}: num_logits must be in 1..{n} (its scheduled tokens), got {m}")
    counts = torch.tensor(list(num_logits), device=last.device)
    ends = torch.repeat_interleave(last, counts)
    offsets = torch.cat([torch.arange(m - 1, -1, -1, device=last.device) for m in num_logits])
    return ends - offsets


def prepare_inputs(cache, token_ids: Sequence[Sequence[int]], block_ids: Sequence[Sequence[int]],
                   num_computed_tokens: Sequence[int], num_scheduled_tokens: Sequence[int],
                   num_logits: Sequence[int] | None = None,
                   spec_token_ids: Sequence[Sequence[int]] | None = None,
                   num_slots: Sequence[int] | None = None, seq_ids: Sequence[Hashable] | None = None,
                   backend=None) -> StepInputs:
    """Everything one forward pass over `cache` reads, built once and moved to its device once.

    token_ids[b] are the step's tokens of sequence b (scheduled_token_ids). spec_token_ids[b] are
    the drafts among them (a verify step): then sequence b gets 1 + len(drafts) logits rows and the
    inputs carry SpecDecodeMetadata; otherwise num_logits[b] rows (default 1)."""
    device = cache.k.device
    meta = attention_inputs(block_ids, num_computed_tokens, num_scheduled_tokens, cache.block_size, num_slots,
                            seq_ids, device)
    seq_ids = list(range(len(block_ids))) if seq_ids is None else seq_ids
    for s, ids, done, n in zip(seq_ids, token_ids, num_computed_tokens, num_scheduled_tokens):
        if len(ids) != n:
            raise ValueError(f"sequence {s!r}: {n} tokens scheduled from position {done}, but its tokens and "
                             f"drafts give {len(ids)}")
    spec = None
    if spec_token_ids is not None and any(len(d) for d in spec_token_ids):
        if num_logits is not None:
            raise ValueError("give num_logits or spec_token_ids, not both: a verify step has 1 + k rows")
        spec = SpecDecodeMetadata.make(spec_token_ids, device)
        num_logits = [1 + k for k in spec.num_draft_tokens]
    rows = logits_indices(meta.query_start_loc, num_logits)
    ids = torch.tensor([t for seq in token_ids for t in seq], device=device)
    return StepInputs(ids, meta.positions, build_metadata(cache, meta, backend), rows, spec)
