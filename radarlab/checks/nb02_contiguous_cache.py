"""Checkers of notebook 02 (the contiguous KV cache): the append and its reservation waste."""
from __future__ import annotations

from radarlab.checks.common import call_learner, first_tensor_difference, verdict


def check_append_to_contiguous_cache(append_to_contiguous_cache) -> bool:
    """Check a learner's append_to_contiguous_cache(k_cache, v_cache, row, seq_len, k, v): the n new
    tokens go to positions seq_len-n .. seq_len-1 of the row, in place, nothing else changes, and the
    whole context's keys and values come back."""
    import torch

    from radarlab.kvcache.contiguous import append_to_row

    name = "append_to_contiguous_cache"
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    def numbered(n, heads, dim, first):  # token i's vectors are all first + i: easy to read in a message
        return torch.arange(first, first + n, dtype=torch.float32)[:, None, None].expand(n,
                                                                                         heads, dim).clone()

    filled = rand(3, 8, 3, 4)  # 3 rows of 8 positions, 3 KV heads, head dim 4, already holding data
    cases = [  # (description, k_cache, v_cache, row, seq_len, k, v)
        ("a prefill of 3 tokens into row 0 of an empty cache of 2 rows x 6 positions (1 KV head, head dim 2)",
         torch.zeros(2, 6, 1, 2), torch.zeros(2, 6, 1, 2), 0, 3, numbered(3, 1, 2, 1), -numbered(3, 1, 2, 1)),
        ("one decode token into row 0, which held 3 tokens (seq_len=4 after the step)",
         torch.cat([numbered(3, 1, 2, 1), torch.zeros(3, 1, 2)])[None].repeat(2, 1, 1, 1),
         torch.zeros(2, 6, 1, 2),
         0, 4, numbered(1, 1, 2, 4), -numbered(1, 1, 2, 4)),
        ("a prefill of 2 tokens into row 1 while row 0 holds another sequence",
         torch.ones(2, 6, 1, 2), torch.ones(2, 6, 1, 2), 1, 2, numbered(2, 1, 2, 10), -numbered(2, 1, 2, 10)),
        ("2 new tokens filling the last positions of row 2 of a full cache (3 KV heads, head dim 4)",
         filled.clone(), -filled.clone(), 2, 8, rand(2, 3, 4), rand(2, 3, 4)),
    ]
    for description, k_cache, v_cache, row, seq_len, k, v in cases:
        start = seq_len - k.shape[0]
        want_k, want_v = k_cache.clone(), v_cache.clone()
        append_to_row(want_k, want_v, row, seq_len, k, v)
        got, problem = call_learner(
            lambda: append_to_contiguous_cache(k_cache, v_cache, row, seq_len, k.clone(), v.clone()),
            description)
        if problem:
            return verdict(name, problem)
        for label, cache, want in (("key", k_cache, want_k), ("value", v_cache, want_v)):
            if not torch.equal(cache, want):
                r, p = (int(i) for i in (cache != want).any(-1).any(-1).nonzero()[0])
                should = (f"the new token {p - start}'s {label}" if r == row and start <= p < seq_len
                          else "what it held before (it should not change)")
                return verdict(name, f"for {description}, the {label} cache at row {r}, position {p} holds "
                                     f"the wrong values; it should hold {should}. Write in place, at "
                                     f"positions seq_len - n .. seq_len - 1 = {start} .. {seq_len - 1}")
        if not isinstance(got, tuple) or len(got) != 2:
            return verdict(name, f"for {description} it returned {type(got).__name__}, expected a tuple "
                                 "(keys, values)")
        for label, g, w in (("keys", got[0], want_k[row, :seq_len]),
                            ("values", got[1], want_v[row, :seq_len])):
            problem = first_tensor_difference(g, w, atol=0.0, rtol=0.0)
            if problem:
                return verdict(name, f"for {description} the returned {label} were {problem} (return the "
                                     f"row's first seq_len positions: the whole context)")
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
