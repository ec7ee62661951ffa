"""The evaluation corpus: fixed text, fixed chunks, sizes checked."""
from __future__ import annotations

import pytest

from radarlab.corpus import chunk_token_ids, corpus_chunks, corpus_description, pydoc_topics_text


def test_text_is_the_topics_in_sorted_key_order():
    from pydoc_data.topics import topics

    text = pydoc_topics_text()
    first, last = sorted(topics)[0], sorted(topics)[-1]
    assert text.startswith(topics[first]) and text.endswith(topics[last])
    assert len(text) == sum(len(t) for t in topics.values()) + 2 * (len(topics) - 1)


def test_chunks_are_consecutive_and_sized():
    ids = list(range(100))
    chunks = chunk_token_ids(ids, 3, 30)
    assert chunks == [ids[0:30], ids[30:60], ids[60:90]]


@pytest.mark.parametrize("num_chunks, chunk_len, words", [
    (0, 10, "num_chunks"), (2, 1, "chunk_len"), (2.0, 10, "num_chunks"), (True, 10, "num_chunks"),
    (5, 30, "only 100"),
])
def test_bad_sizes_raise(num_chunks, chunk_len, words):
    with pytest.raises(ValueError, match=words):
        chunk_token_ids(range(100), num_chunks, chunk_len)


def test_course_corpus_is_deterministic(tokenizer):
    a = corpus_chunks(tokenizer, 3, 64)
    b = corpus_chunks(tokenizer, 3, 64)
    assert a == b and [len(c) for c in a] == [64, 64, 64]
    ids = tokenizer(pydoc_topics_text(), add_special_tokens=False)["input_ids"]
    assert a[1] == ids[64:128]
    assert len(ids) >= 24 * 512  # the benchmark's default size fits
    assert corpus_description()["name"] == "pydoc_data.topics"
