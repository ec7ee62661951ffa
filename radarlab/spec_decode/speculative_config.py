"""Engine(speculative_config={...}): vLLM's keys, checked, turned into a proposer.

    {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "draft_model", "num_speculative_tokens": 4, "model": draft}   # a model, or a path / HF id
    {"method": "eagle", "num_speculative_tokens": 4, "model": head_dir}     # radarlab.spec_decode.eagle
    {"method": "ngram_eagle", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
     "prompt_lookup_max": 4, "model": head_dir}                             # radarlab.spec_decode.ngram_eagle

For "eagle", model is a directory save_head wrote (its draft vocabulary comes along), a DraftHead
(ranking the whole vocabulary), or a (DraftHead, draft vocabulary) pair.

"ngram_eagle" is radarlab's own method, not vLLM's: the n-gram's drafts where it finds a match, the
EAGLE head's elsewhere. It takes both methods' keys: prompt_lookup_* as "ngram" (the same
defaults), model as "eagle".

As in vLLM, "method" may be left out: with a "model" it is draft_model, without one ngram. Unlike
vLLM, num_speculative_tokens = 0 is allowed and means plain decoding (no proposer).
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

from radarlab.spec_decode.draft_head import DraftHead, load_head
from radarlab.spec_decode.draft_model import DraftModelProposer
from radarlab.spec_decode.eagle import EagleProposer
from radarlab.spec_decode.ngram import NgramProposer
from radarlab.spec_decode.ngram_eagle import NgramEagleProposer
from radarlab.util import require_int

SPECULATIVE_CONFIG_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                           "model")
METHODS = ("ngram", "draft_model", "eagle", "ngram_eagle")
LOOKUP_METHODS = ("ngram", "ngram_eagle")  # the methods that take prompt_lookup_min and prompt_lookup_max


def make_proposer(speculative_config: Mapping, target_model, num_blocks: int, block_size: int,
                  max_model_len: int, backend: str = "torch"):
    """The proposer a speculative_config asks for, or None for k = 0. ValueError names what is wrong."""
    if not isinstance(speculative_config, Mapping):
        raise ValueError(f"speculative_config must be a dict, got {type(speculative_config).__name__}")
    unknown = sorted(set(speculative_config) - set(SPECULATIVE_CONFIG_KEYS))
    if unknown:
        raise ValueError(f"unknown speculative_config keys {unknown}; valid keys: "
                         f"{list(SPECULATIVE_CONFIG_KEYS)}")
    cfg = dict(speculative_config)
    draft = cfg.get("model")
    method = cfg.get("method") or ("draft_model" if draft is not None else "ngram")
    if method not in METHODS:
        raise ValueError(f"speculative_config method must be one of {list(METHODS)}, got {method!r}")
    if "num_speculative_tokens" not in cfg:
        raise ValueError("speculative_config needs num_speculative_tokens (0 means plain decoding)")
    k = require_int("num_speculative_tokens", cfg["num_speculative_tokens"], 0)
    ngram = None
    if method in LOOKUP_METHODS:  # built even for k = 0, so that bad prompt_lookup_* raise either way
        ngram = NgramProposer(k, cfg.get("prompt_lookup_min"), cfg.get("prompt_lookup_max"), max_model_len)
    else:
        for key in ("prompt_lookup_min", "prompt_lookup_max"):
            if cfg.get(key) is not None:
                raise ValueError(f"speculative_config: {key} belongs to methods "
                                 f"{list(LOOKUP_METHODS)}, not {method!r}")
    if method == "ngram":
        if draft is not None:
            raise ValueError("speculative_config: method 'ngram' takes no model")
        return ngram if k else None
    if draft is None:
        raise ValueError(f"speculative_config: method {method!r} needs a model (a model object, or a path)")
    if not k:
        return None
    if method in ("eagle", "ngram_eagle"):
        head = _eagle_proposer(draft, target_model, k, num_blocks, block_size, backend, method)
        return head if method == "eagle" else NgramEagleProposer(ngram, head)
    if isinstance(draft, str):
        from radarlab.models.llama import Llama
        param = next(target_model.parameters())
        draft, _ = Llama.from_pretrained(draft, dtype=param.dtype, device=param.device)
    return DraftModelProposer(draft, k, num_blocks, block_size, target_model.config.vocab_size, backend)


def _eagle_proposer(draft, target_model, k: int, num_blocks: int, block_size: int, backend: str, method: str):
    vocab = None
    if isinstance(draft, (str, Path)):
        draft, vocab = load_head(draft, target_model.config, dtype=next(target_model.parameters()).dtype)
    elif isinstance(draft, tuple) and len(draft) == 2:
        draft, vocab = draft
    if not isinstance(draft, DraftHead):
        raise ValueError(f"speculative_config: method {method!r} needs a draft head (a "
                         "directory, a DraftHead or a (DraftHead, vocabulary) pair), "
                         f"got {type(draft).__name__}")
    return EagleProposer(draft, target_model, vocab, k, num_blocks, block_size, backend)
