"""Checkers of notebook 02 (the contiguous KV cache): the attention step on it and its reservation waste."""
from __future__ import annotations

from radarlab.checks.common import call_learner, first_tensor_difference, verdict

# The checker's steps: (query_lens, seq_lens) of two sequences living in cache rows 2 and 0 (row 1 is
# another sequence's and must not change): a packed prefill, two decode steps, then a step that
# appends 3 tokens to a sequence that already holds 5 (a chunk of a prefill, or a verify step).
_ROWS = [2, 0]
_STEPS = [([5, 3], [5, 3]), ([1, 1], [6, 4]), ([1, 1], [7, 5]), ([1, 3], [8, 8])]
_HEADS, _KV_HEADS, _HEAD_DIM, _MAX_LEN, _SCALE = 4, 2, 8, 10, 0.3  # 0.3 is not 1/sqrt(8)


def _describe_step(i: int, q_lens, seq_lens) -> str:
    kind = ("a packed prefill" if q_lens == seq_lens else "a decode step" if set(q_lens) == {1}
            else "a step appending several tokens after a cached context")
    seqs = ", ".join(f"sequence {b} (row {r}) {n} new of {s} tokens"
                     for b, (r, n, s) in enumerate(zip(_ROWS, q_lens, seq_lens)))
    return f"step {i + 1}, {kind}: {seqs}"


def _cache_mistake(label, got, want, new_k, new_v, bounds, q_lens, seq_lens) -> str:
    """Plain words for a cache that differs from the reference's after one step: where the new tokens
    went, when that is a plausible place, else the first position that is wrong."""
    import torch

    new_all = new_k if label == "key" else new_v
    for b, (row, n, seq_len) in enumerate(zip(_ROWS, q_lens, seq_lens)):
        new, start = new_all[bounds[b]:bounds[b + 1]], seq_len - n
        right = (f"sequence b's tokens go to row cache_rows[b] at positions seq_len - n .. seq_len - 1, "
                 f"here row {row}, positions {start} .. {seq_len - 1}")
        if label == "value" and torch.equal(got[row, start:seq_len], new_k[bounds[b]:bounds[b + 1]]):
            return f"the value cache holds sequence {b}'s new keys, not its values"
        for where, r, p in [("at the start of the row, positions 0 .. n-1", row, 0),
                            ("one position late (at seq_len - n + 1)", row, start + 1),
                            ("one position early (at seq_len - n - 1)", row, start - 1),
                            ("at positions seq_len .. seq_len + n - 1 (seq_len already counts them)", row,
                             seq_len),
                            (f"in row {b}, the sequence's index, not cache_rows[{b}] = {row}", b, start)]:
            if ((r, p) != (row, start) and 0 <= p and p + n <= got.shape[1]
                    and torch.equal(got[r, p:p + n], new) and not torch.equal(want[r, p:p + n], new)):
                return f"sequence {b}'s new {label}s were written {where}; {right}"
    r, p = (int(i) for i in (got != want).any(-1).any(-1).nonzero()[0])
    owner = _ROWS.index(r) if r in _ROWS else None
    start = None if owner is None else seq_lens[owner] - q_lens[owner]
    should = (f"sequence {owner}'s new token {p - start}'s {label}"
              if owner is not None and start <= p < seq_lens[owner]
              else "what it held before (only the step's new tokens are written, in place)")
    return f"the {label} cache at row {r}, position {p} holds the wrong values; it should hold {should}"


def _attention_mistake(got, q, keys, values, row_k, row_v, k_new, v_new, scale) -> str | None:
    """Which plausible mistake, if any, gives exactly the output `got` for one sequence."""
    import torch

    from radarlab.attention.reference import attention_reference as attend

    group = q.shape[1] // keys.shape[1]
    n = q.shape[0]
    whole_row = "it attends over the whole reserved row; only the first seq_len positions hold this sequence"
    mistakes = [
        ("there is no causal mask: a prefill's query i must not see keys after its own position",
         lambda: attend(q, keys, values, scale, causal=False)),
        ("the causal mask places the queries at positions 0 .. n-1; they are the last n of seq_len, so "
         "query i sees keys 0 .. seq_len - n + i", lambda: attend(q, keys[:n], values[:n], scale)),
        (f"query head h reads KV head h % num_kv_heads; with {group} query heads per KV head it reads "
         f"h // {group} (h // (num_heads // num_kv_heads))",
         lambda: attend(q, keys.repeat(1, group, 1), values.repeat(1, group, 1), scale)),
        ("the softmax scale is missing: multiply q k^T by `scale` before the softmax",
         lambda: attend(q, keys, values, 1.0)),
        ("it uses 1/sqrt(head_dim), not the `scale` argument (the model passes its own)",
         lambda: attend(q, keys, values, q.shape[-1] ** -0.5)),
        (whole_row,
         lambda: attend(q, row_k, row_v, scale, causal=False)),
        (whole_row,
         lambda: attend(q, row_k, row_v, scale)),
        ("it attends over this step's k, v only; the queries read the whole cached context",
         lambda: attend(q, k_new, v_new, scale)),
    ]
    for words, wrong in mistakes:
        if torch.allclose(got.float(), wrong().float(), atol=1e-5, rtol=1e-4):
            return words
    return None


def check_contiguous_attention(contiguous_attention) -> bool:
    """Check a learner's contiguous_attention(q, k, v, k_cache, v_cache, meta, scale), one layer's step on
    the contiguous cache, step by step against radarlab's: two sequences of different lengths in rows
    2 and 0, GQA with 2 query heads per KV head, a prefill, decodes, and 3 tokens after a cached context.
    After each step both caches must be equal (the rest of every row holds stale data that must stay) and
    the outputs close."""
    import torch

    from radarlab.attention.backends.contiguous_attn import contiguous_attention as reference
    from radarlab.attention.metadata import AttentionMetadata

    name = "contiguous_attention"
    gen = torch.Generator().manual_seed(0)
    # what earlier sequences left in the rows: reading past seq_len reads this
    stale = torch.randn(2, 3, _MAX_LEN, _KV_HEADS, _HEAD_DIM, generator=gen)
    mine_k, mine_v = stale[0].clone(), stale[1].clone()
    want_k, want_v = stale[0].clone(), stale[1].clone()
    for i, (q_lens, seq_lens) in enumerate(_STEPS):
        description = _describe_step(i, q_lens, seq_lens)
        t = sum(q_lens)
        q = torch.randn(t, _HEADS, _HEAD_DIM, generator=gen)
        k, v = (torch.randn(t, _KV_HEADS, _HEAD_DIM, generator=gen) for _ in range(2))
        meta = AttentionMetadata.from_lens(q_lens, seq_lens, cache_rows=torch.tensor(_ROWS))
        want = reference(q, k, v, want_k, want_v, meta, _SCALE)
        got, problem = call_learner(
            lambda: contiguous_attention(q.clone(), k.clone(), v.clone(), mine_k, mine_v, meta, _SCALE),
            description)
        if problem:
            return verdict(name, problem)
        bounds = meta.query_start_loc.tolist()
        for label, cache, ref in (("key", mine_k, want_k), ("value", mine_v, want_v)):
            if not torch.equal(cache, ref):
                return verdict(name, f"in {description}, "
                                     f"{_cache_mistake(label, cache, ref, k, v, bounds, q_lens, seq_lens)}")
        problem = first_tensor_difference(got, want, atol=1e-5, rtol=1e-4)
        if problem is None:
            continue
        if tuple(getattr(got, "shape", ())) != tuple(want.shape) or got.dtype != want.dtype:
            return verdict(name, f"in {description}, it returned {problem} ([tokens, heads, head_dim], the "
                                 f"layout of q)")
        for b, (row, n, seq_len) in enumerate(zip(_ROWS, q_lens, seq_lens)):
            lo, hi = bounds[b], bounds[b + 1]
            if first_tensor_difference(got[lo:hi], want[lo:hi], atol=1e-5, rtol=1e-4) is None:
                continue
            words = _attention_mistake(got[lo:hi], q[lo:hi], want_k[row, :seq_len], want_v[row, :seq_len],
                                       want_k[row], want_v[row], k[lo:hi], v[lo:hi], _SCALE)
            detail = first_tensor_difference(got[lo:hi], want[lo:hi], atol=1e-5, rtol=1e-4)
            return verdict(name, f"in {description}, sequence {b}'s output (token, head, dim) was {detail}"
                                 + (f": {words}" if words else ""))
    return verdict(name, None)


def check_reservation_utilisation(reservation_utilisation) -> bool:
    """Check a learner's reservation_utilisation(context_lens, max_model_len, block_size) -> (contiguous,
    paged): the fraction of reserved positions that hold tokens, for a snapshot of running requests."""
    import math

    from radarlab.bench.reservation import snapshot_utilisation

    name = "reservation_utilisation"

    want = snapshot_utilisation

    cases = [  # (description, context_lens, max_model_len, block_size)
        ("context_lens=[3, 5], max_model_len=8, block_size=4", [3, 5], 8, 4),
        ("context_lens=[16], max_model_len=64, block_size=16 (one exactly full block)", [16], 64, 16),
        ("context_lens=[17, 1, 100], max_model_len=2048, block_size=16", [17, 1, 100], 2048, 16),
        ("context_lens=[7, 9], max_model_len=16, block_size=1", [7, 9], 16, 1),
        ("context_lens=[2048], max_model_len=2048, block_size=128", [2048], 2048, 128),
    ]
    for description, lens, max_len, bs in cases:
        expected = want(lens, max_len, bs)
        got, problem = call_learner(lambda: reservation_utilisation(list(lens), max_len, bs), description)
        if problem:
            return verdict(name, problem)
        if (not isinstance(got, (tuple, list)) or len(got) != 2
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in got)):
            return verdict(name, f"for {description} it returned {got!r}, expected two numbers (contiguous, "
                                 "paged)")
        if not math.isclose(got[0], expected[0], rel_tol=1e-9):
            return verdict(name, f"for {description} the contiguous utilisation was {got[0]!r}, expected "
                                 f"{expected[0]!r} (each request reserves max_model_len positions)")
        if not math.isclose(got[1], expected[1], rel_tol=1e-9):
            floor = sum(lens) / max(1, sum(n // bs * bs for n in lens))
            hint = (" (a partly filled block is reserved whole: round each request's blocks up)"
                    if math.isclose(got[1], floor, rel_tol=1e-9) or got[1] > 1 else "")
            return verdict(name, f"for {description} the paged utilisation was {got[1]!r}, expected "
                                 f"{expected[1]!r}{hint}")
    for description, lens, max_len in [("an empty list of requests", [], 8),
                                       ("context_lens=[9] with max_model_len=8 (longer than a row)", [9], 8),
                                       ("context_lens=[0] (a running request holds at least one token)", [0],
                                        8)]:
        try:
            got = reservation_utilisation(list(lens), max_len, 4)
        except NotImplementedError:
            return verdict(name, "the function is not written yet (it raises NotImplementedError)")
        except ValueError:
            continue
        except Exception as err:
            return verdict(name, f"for {description} it raised {type(err).__name__}: {err}; expected "
                                 "ValueError")
        return verdict(name, f"for {description} it returned {got!r}; expected it to raise ValueError")
    return verdict(name, None)
