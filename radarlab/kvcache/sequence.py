"""A sequence's token ids and the hashes of its full blocks, kept in one place.

vLLM v1 keeps a request's tokens in its Request (all_token_ids) together with the chain hashes of
its full blocks (block_hashes); the KV-cache manager only reads them. We do the same: the engine's
Request extends Sequence, and the block manager, the model runner and the prefix cache read from it.
Tokens change only through append_token_ids and truncate, and both update block_hashes in the same
call, so the two can never disagree, however often speculative decoding appends and rolls back.

Hashes need a block size. A sequence gets one when it is made (the engine knows it) or when a block
manager first takes it; a sequence never serves two block sizes.
"""
from __future__ import annotations

import operator
from collections.abc import Sequence as SequenceABC
from typing import Hashable, Iterable

import torch

from radarlab.kvcache.block_pool import BlockHash, hash_block_tokens
from radarlab.util import require_power_of_two

SeqId = Hashable


def as_token_ids(token_ids: Iterable[int], name: str, allow_empty: bool = False) -> list[int]:
    """A list of non-negative Python ints (numpy ints and integer tensors accepted), or ValueError
    naming the first bad entry."""
    if isinstance(token_ids, torch.Tensor):
        token_ids = token_ids.tolist()
    out = []
    for i, t in enumerate(token_ids):
        try:
            t = operator.index(t)
        except TypeError:
            raise ValueError(f"{name}[{i}] is {t!r}; token ids must be integers") from None
        if t < 0:
            raise ValueError(f"{name}[{i}] is {t}; token ids must be >= 0")
        out.append(t)
    if not out and not allow_empty:
        raise ValueError(f"{name} is empty")
    return out


class TokenView(SequenceABC):
    """A read-only window on a list of token ids: indexing and slicing work, writing does not.

    Handing out the list itself would let a caller append a token behind the owner's back, and the
    block hashes would silently go stale."""

    __slots__ = ("_ids", "_start")

    def __init__(self, ids: list, start: int = 0) -> None:
        self._ids, self._start = ids, start

    def __len__(self) -> int:
        return len(self._ids) - self._start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self._ids[self._start:][index] if self._start else self._ids[index]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"token index {index} is outside the {len(self)} tokens")
        return self._ids[self._start + index]

    def __iter__(self):
        # the list's own iterator: SequenceABC's default indexes one token at a time, in Python, and the
        # engine copies every request's output tokens at each step
        return iter(self._ids[self._start:] if self._start else self._ids)

    def __eq__(self, other) -> bool:
        return list(self) == list(other) if isinstance(other, (SequenceABC, list)) else NotImplemented

    def __repr__(self) -> str:
        return repr(self._ids[self._start:])


class Sequence:
    """Prompt and generated token ids of one sequence, and the chain hash of each full block."""

    def __init__(self, seq_id: SeqId, prompt_token_ids: Iterable[int], block_size: int | None = None) -> None:
        self.seq_id = seq_id
        self._token_ids = as_token_ids(prompt_token_ids, "prompt_token_ids")
        self.num_prompt_tokens = len(self._token_ids)
        self._block_hashes: list[BlockHash] = []
        self.block_size: int | None = None
        if block_size is not None:
            self.bind_block_size(block_size)

    # --- what others read -------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def all_token_ids(self) -> TokenView:
        return TokenView(self._token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self._token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> TokenView:
        return TokenView(self._token_ids, self.num_prompt_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self._token_ids) - self.num_prompt_tokens

    @property
    def block_hashes(self) -> tuple[BlockHash, ...]:
        """Chain hashes of the full blocks, block 0 first (empty until a block size is bound)."""
        return tuple(self._block_hashes)

    # --- the only ways tokens change ------------------------------------------------------------
    def bind_block_size(self, block_size: int) -> None:
        """Fix the block size the hashes are computed for; a second, different one is an error."""
        block_size = require_power_of_two("block_size", block_size)
        if self.block_size is not None and self.block_size != block_size:
            raise ValueError(f"sequence {self.seq_id!r} is hashed in blocks of "
                             f"{self.block_size}, not {block_size}")
        self.block_size = block_size
        self._hash_full_blocks()

    def append_token_ids(self, token_ids: Iterable[int]) -> None:
        """Add generated (or accepted draft) tokens; blocks they fill are hashed now."""
        self._token_ids += as_token_ids(token_ids, "token_ids", allow_empty=True)
        self._hash_full_blocks()

    def truncate(self, num_tokens: int) -> None:
        """Keep the first num_tokens tokens (rejected drafts are dropped); hashes of blocks that are no
        longer full go with them. The prompt always stays."""
        if not self.num_prompt_tokens <= num_tokens <= self.num_tokens:
            raise ValueError(f"sequence {self.seq_id!r} can keep "
                             f"{self.num_prompt_tokens}..{self.num_tokens} tokens "
                             f"(the prompt stays), not {num_tokens}")
        del self._token_ids[num_tokens:]
        if self.block_size is not None:
            del self._block_hashes[num_tokens // self.block_size:]

    def _hash_full_blocks(self) -> None:
        if self.block_size is None:
            return
        bs = self.block_size
        for i in range(len(self._block_hashes), len(self._token_ids) // bs):
            parent = self._block_hashes[-1] if self._block_hashes else None
            self._block_hashes.append(hash_block_tokens(parent, self._token_ids[i * bs:(i + 1) * bs]))

    def __repr__(self) -> str:
        return f"Sequence({self.seq_id!r}, prompt={self.num_prompt_tokens}, output={self.num_output_tokens})"
