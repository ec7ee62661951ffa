"""The fixed offline text on which KV-cache formats are scored: CPython's `pydoc_data.topics`.

Perplexity needs held-out text, and the course runs offline. Every CPython ships the help topics
that `help("assert")` prints (the module pydoc_data.topics, ~80 entries of the language reference,
~460k characters), so every learner has the same text without a download. WikiText-2, the usual
choice, comes only from a dataset hub; no installed package carries it, so it is not offered here.
Any other text can be chunked with `chunk_token_ids`.

The chunking is fixed and documented, so that two runs (or two formats) score the same tokens:

1. the text is the topics' bodies in sorted key order, joined by one blank line ("\\n\\n");
2. it is tokenized once, without special tokens (no BOS);
3. chunk i is tokens [i * chunk_len, (i + 1) * chunk_len): consecutive, non-overlapping, from the
   start. Each chunk is scored as its own sequence, from an empty cache.

The topics follow the Python version (3.11's text differs from 3.12's), so a result records it.
"""
from __future__ import annotations

import platform

from radarlab.util import require_int

CORPUS_NAME = "pydoc_data.topics"


def pydoc_topics_text() -> str:
    """The topics' bodies in sorted key order, joined by a blank line."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


def corpus_description() -> dict:
    """What a result records about the corpus: its name and the Python version its text comes from."""
    return {"name": CORPUS_NAME, "python": platform.python_version(), "order": "sorted keys",
            "separator": "\\n\\n", "special_tokens": False}


def chunk_token_ids(token_ids, num_chunks: int, chunk_len: int) -> list[list[int]]:
    """The first num_chunks consecutive, non-overlapping chunks of chunk_len tokens.

    ValueError if the sizes are not positive ints or the text has fewer than num_chunks * chunk_len
    tokens (the chunks never wrap around or overlap).
    """
    require_int("num_chunks", num_chunks)
    require_int("chunk_len", chunk_len, minimum=2)  # perplexity needs one token to predict
    token_ids = list(token_ids)
    needed = num_chunks * chunk_len
    if needed > len(token_ids):
        raise ValueError(f"num_chunks * chunk_len = {num_chunks} * {chunk_len} = "
                         f"{needed} tokens, but the text has only {len(token_ids)}")
    return [token_ids[i * chunk_len:(i + 1) * chunk_len] for i in range(num_chunks)]


def corpus_chunks(tokenizer, num_chunks: int = 24, chunk_len: int = 512) -> list[list[int]]:
    """The evaluation corpus as num_chunks lists of chunk_len token ids (see the module docstring)."""
    require_int("num_chunks", num_chunks)
    require_int("chunk_len", chunk_len, minimum=2)
    ids = tokenizer(pydoc_topics_text(), add_special_tokens=False)["input_ids"]
    return chunk_token_ids(ids, num_chunks, chunk_len)
