"""Checkers of notebook 08 (speculative decoding): expected tokens per step, stochastic verification,
the n-gram draft, and the engine's batched rejection sampler."""
from __future__ import annotations

from radarlab.checks.common import call_learner, verdict


def check_expected_tokens_per_step(expected_tokens_per_step) -> bool:
    """Check a learner's expected_tokens_per_step(a, k): the mean tokens one verify step emits (the
    accepted drafts plus the target's own token) when each draft is accepted with probability a,
    against radarlab.spec_decode.theory.expected_tokens_per_step."""
    import math

    from radarlab.spec_decode.theory import expected_tokens_per_step as reference

    name = "expected_tokens_per_step"
    cases = [(0.5, 1), (0.8, 4), (0.0, 3), (0.6, 0), (1.0, 5), (0.95, 16), (0.3, 7)]
    for a, k in cases:
        want = reference(a, k)
        description = f"a={a}, k={k}"
        got, problem = call_learner(lambda: expected_tokens_per_step(a, k), description)
        if problem:
            return verdict(name, problem)
        try:
            got = float(got)
        except (TypeError, ValueError):
            return verdict(name, f"for {description} it returned {got!r}; expected a number, {want:.6g}")
        if not math.isclose(got, want, rel_tol=1e-9, abs_tol=1e-12):
            if math.isclose(got, want - 1, rel_tol=1e-9, abs_tol=1e-12):
                hint = " (count the target's own token too: a step emits at least 1 token)"
            elif a < 1 and math.isclose(got, 1 + a * k, rel_tol=1e-9):
                hint = " (draft i counts only if drafts 1..i-1 were accepted too: a^i, not a)"
            elif math.isclose(got, want - a ** k, rel_tol=1e-9, abs_tol=1e-12):
                hint = " (the sum runs to a^k: k + 1 terms, the last for a step that accepts all k drafts)"
            else:
                hint = " (1 + a + a^2 + ... + a^k)"
            return verdict(name, f"for {description} it returned {got:.6g}, expected {want:.6g}{hint}")
    return verdict(name, None)


def _spec_toy_cases():
    """(description, p [k+1, V], q [k, V]) for the rejection-sampler checker: distributions that
    overlap partly, and one where the draft puts mass where the target puts none."""
    import torch

    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.05, 0.30, 0.30, 0.20, 0.10]],
                     dtype=torch.float64)
    q = torch.tensor([[0.10, 0.10, 0.30, 0.30, 0.10, 0.10]], dtype=torch.float64)
    return p, q


def check_verify_stochastic(verify_stochastic) -> bool:
    """Check a learner's verify_stochastic(target_probs, draft_token_ids, draft_probs, generator) ->
    emitted tokens: accept draft x with probability min(1, p(x)/q(x)), on the first rejection draw
    from max(0, p - q) renormalised and stop, and draw a bonus token from the last row if all drafts
    were accepted. Deterministic cases first, then chi-square tests of the laws (seeded, at the 1e-3
    level): with one draft, the first emitted token against p (6000 steps; a sampler that resamples
    from p instead of the residual is caught with probability above 0.99:
    radarlab.lab.chi_square.chi_square_power); with two drafts and three distinct rows, the second
    token (where the first draft was accepted) against p_1 and the bonus against p_2, which catch a
    sampler that reads row 0 at every position or draws the bonus from the wrong row."""
    import torch

    from radarlab.lab.chi_square import chi_square_test

    name = "verify_stochastic"

    def run(p, drafts, q, seed, description):
        gen = torch.Generator().manual_seed(seed)
        got, problem = call_learner(lambda: verify_stochastic(p.clone(), list(drafts),
                                                              None if q is None else q.clone(), gen),
                                                              description)
        if problem:
            return None, problem
        try:
            tokens = [int(t) for t in got]
        except (TypeError, ValueError):
            return None, f"for {description} it returned {got!r}; expected a list of token ids"
        if not 1 <= len(tokens) <= len(drafts) + 1:
            return None, (f"for {description} it returned {tokens}: a verify step with {len(drafts)} drafts "
                          f"emits between 1 and {len(drafts) + 1} tokens")
        return tokens, None

    same = torch.tensor([[0.5, 0.3, 0.2]] * 3, dtype=torch.float64)
    tokens, problem = run(same, [0, 2], same[:2], 0, "p = q at every position, drafts [0, 2]")
    if problem:
        return verdict(name, problem)
    if tokens[:2] != [0, 2] or len(tokens) != 3:
        return verdict(name, f"for p = q at every position and drafts [0, 2] it returned {tokens}; when p = "
                             "q every draft is accepted (min(1, p/q) = 1), then a bonus token is drawn: [0, "
                             "2, ?]")
    target = torch.tensor([[0.0, 0.7, 0.3], [0.2, 0.3, 0.5]], dtype=torch.float64)
    draft = torch.tensor([[0.6, 0.2, 0.2]], dtype=torch.float64)
    for seed in range(20):
        tokens, problem = run(target, [0], draft, seed, "p = [0, 0.7, 0.3], q = [0.6, 0.2, 0.2], draft 0")
        if problem:
            return verdict(name, problem)
        if len(tokens) != 1 or tokens[0] not in (1, 2):
            return verdict(name, "for p = [0, 0.7, 0.3], q = [0.6, 0.2, 0.2] and draft 0 it returned "
                                 f"{tokens}; p(0) = 0, so the draft is always rejected and one token is "
                                 f"drawn from the residual max(0, p - q) = [0, 0.5, 0.1], renormalised: 1 or "
                                 f"2, never 0")
    # one-hot q (a draft without probabilities): accepted with probability p(x); never x on rejection
    one_hot_target = torch.tensor([[0.0, 1.0, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    tokens, problem = run(one_hot_target, [1], None, 0, "p = [0, 1, 0], draft 1 without probabilities")
    if problem:
        return verdict(name, problem)
    if tokens[0] != 1 or len(tokens) != 2:
        return verdict(name, "for p = [0, 1, 0] and draft 1 without probabilities (q one-hot on 1) it "
                             f"returned {tokens}; p(1)/q(1) = 1, so the draft is accepted and a bonus token "
                             f"follows")
    # the law of the first emitted token must be p
    p, q = _spec_toy_cases()
    n = 6000
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(p.shape[1], dtype=torch.long)
    for i in range(n):
        x = int(torch.multinomial(q[0], 1, generator=gen))
        tokens, problem = run(p, [x], q, i, f"p = {p[0].tolist()}, q = {q[0].tolist()}, draft {x}")
        if problem:
            return verdict(name, problem)
        counts[tokens[0]] += 1
    _, pvalue = chi_square_test(counts, p[0])
    if pvalue < 1e-3:
        freq = [round(float(c) / n, 3) for c in counts]
        return verdict(name, f"over {n} verify steps with p = {p[0].tolist()} and drafts drawn from q = "
                             f"{q[0].tolist()}, the first emitted token had frequencies {freq}, not p "
                             f"(chi-square p-value {pvalue:.1e}); on rejection, draw from max(0, p - q) "
                             "renormalised")
    # two drafts, every row different: position i is judged with p[i] and q[i], the bonus comes from p[2]
    p, q = _two_draft_case()
    later = [torch.zeros(p.shape[1], dtype=torch.long) for _ in range(2)]  # second tokens, bonus tokens
    for i in range(n):
        drafts = [int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)]
        tokens, problem = run(p, drafts, q, n + i, f"two drafts {drafts} with p and q of distinct rows")
        if problem:
            return verdict(name, problem)
        for j, token in enumerate(tokens[1:]):
            later[j][token] += 1
    for j, (what, hint) in enumerate([("second emitted token (after an accepted first draft)",
                                       "position 1 is judged with row 1 of p and of q, not row 0"),
                                      ("bonus token (after both drafts were accepted)",
                                       "the bonus is drawn from the last row of p, row k = 2")]):
        _, pvalue = chi_square_test(later[j], p[j + 1])
        if pvalue < 1e-3:
            total = int(later[j].sum())
            freq = [round(float(c) / max(total, 1), 3) for c in later[j]]
            return verdict(name, f"over {n} verify steps with two drafts and rows p_0, p_1, p_2 all "
                                 f"different, the {what} had frequencies {freq} in {total} steps, not "
                                 f"p_{j + 1} = {p[j + 1].tolist()} (chi-square p-value {pvalue:.1e}): {hint}")
    return verdict(name, None)


def _two_draft_case():
    """p [3, V] and q [2, V] with every row different, for the k = 2 stage of the checker."""
    import torch

    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
                      [0.30, 0.05, 0.30, 0.05, 0.20, 0.10]], dtype=torch.float64)
    q = torch.tensor([[0.30, 0.30, 0.20, 0.10, 0.05, 0.05], [0.10, 0.10, 0.10, 0.20, 0.20, 0.30]],
                     dtype=torch.float64)
    return p, q


def check_ngram_draft(ngram_draft) -> bool:
    """Check a learner's ngram_draft(token_ids, prompt_lookup_min, prompt_lookup_max, k) -> draft
    tokens against radarlab.spec_decode.ngram.ngram_draft (vLLM's prompt-lookup rule): the longest suffix
    n-gram (n from max down to min) that occurs earlier, its first (leftmost) occurrence, and the up
    to k tokens that followed it."""
    import random

    from radarlab.spec_decode.ngram import ngram_draft as reference

    name = "ngram_draft"
    rng = random.Random(8)
    cases = [  # (description, tokens, min, max, k)
        ("tokens=[1, 2, 3, 4, 1, 2], min=2, max=3, k=2 (the 2-gram [1, 2] occurred at the start)",
         [1, 2, 3, 4, 1, 2], 2, 3, 2),
        ("tokens=[2, 8, 1, 2, 9, 1, 2], min=1, max=3, k=3 (the longest match wins: [1, 2], not [2])",
         [2, 8, 1, 2, 9, 1, 2], 1, 3, 3),
        ("tokens=[1, 2, 8, 1, 2, 9, 1, 2], min=2, max=2, k=1 (two earlier occurrences: the first one is "
         "used)",
         [1, 2, 8, 1, 2, 9, 1, 2], 2, 2, 1),
        ("tokens=[3, 4, 5, 3, 4], min=2, max=4, k=5 (fewer tokens follow the match than k)",
         [3, 4, 5, 3, 4], 2, 4, 5),
        ("tokens=[1, 2, 3, 4, 5], min=1, max=3, k=3 (no repeat: no draft)", [1, 2, 3, 4, 5], 1, 3, 3),
        ("tokens=[7, 7, 7, 7], min=1, max=2, k=3 (overlapping matches)", [7, 7, 7, 7], 1, 2, 3),
        ("tokens=[1, 7, 7, 7], min=2, max=2, k=3 (the earlier [7, 7] at positions 1-2 overlaps the suffix "
         "at 2-3: it still counts, and token 3 follows it)", [1, 7, 7, 7], 2, 2, 3),
        ("tokens=[1, 2, 3, 9, 2, 3, 1, 2, 3], min=2, max=3, k=2 (the 3-gram [1, 2, 3] beats the later "
         "2-gram)",
         [1, 2, 3, 9, 2, 3, 1, 2, 3], 2, 3, 2),
        ("tokens=[4], min=1, max=2, k=2 (a single token)", [4], 1, 2, 2),
    ]
    for i in range(6):
        tokens = [rng.randint(0, 4) for _ in range(rng.randint(6, 30))]
        lo = rng.randint(1, 3)
        hi = lo + rng.randint(0, 2)
        k = rng.randint(1, 5)
        cases.append((f"random case {i + 1}: tokens={tokens}, min={lo}, max={hi}, k={k}", tokens, lo, hi, k))
    for description, tokens, lo, hi, k in cases:
        want = reference(tokens, lo, hi, k)
        got, problem = call_learner(lambda: ngram_draft(list(tokens), lo, hi, k), description)
        if problem:
            return verdict(name, problem)
        try:
            got = [int(t) for t in got]
        except (TypeError, ValueError):
            return verdict(name, f"for {description} it returned {got!r}; expected a list of token ids, "
                                 f"{want}")
        if got != want:
            return verdict(name, f"for {description} it returned {got}, expected {want}")
    return verdict(name, None)


def check_rejection_sample(rejection_sample) -> bool:
    """Check a learner's batched rejection sampler, vLLM's interface (radarlab.sample.rejection_sampler.
    rejection_sample is the reference): rejection_sample(draft_token_ids [N], cu_num_draft_tokens [B],
    draft_probs [N, V] or None, target_probs [N, V], bonus_token_ids [B, 1], is_greedy [B], generators
    [B]) -> [B, max_k + 1] tokens padded with -1. A greedy batch with known answers first (request b's
    rows found through cu_num_draft_tokens, the bonus taken from bonus_token_ids, -1 padding), then
    chi-square tests on a stochastic batch of many requests: the first emitted token against p_0, the
    second (after an accepted first draft) against p_1, the bonus against the law it was drawn from."""
    import torch

    from radarlab.lab.chi_square import chi_square_test

    name = "rejection_sample"

    def run(drafts, target, draft_probs, bonus, greedy, generators, description):
        counts = torch.tensor([len(d) for d in drafts])
        flat = torch.tensor([t for d in drafts for t in d], dtype=torch.long)
        got, problem = call_learner(lambda: rejection_sample(
            flat, counts.cumsum(0), None if draft_probs is None else draft_probs.clone(), target.clone(),
            torch.tensor(bonus, dtype=torch.long)[:, None], list(greedy), generators), description)
        if problem:
            return None, problem
        width = max(len(d) for d in drafts) + 1
        if not isinstance(got, torch.Tensor) or tuple(got.shape) != (len(drafts), width):
            shape = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            return None, (f"for {description} it returned {shape}; expected a tensor of shape "
                          f"[{len(drafts)}, {width}] (B requests, the most drafts + 1), padded with -1")
        return got.long().tolist(), None

    def one_hot(tokens, vocab=8):
        return torch.nn.functional.one_hot(torch.tensor(tokens), vocab).double()

    # greedy: p one-hot on the target's choice at each draft position; bonus ids given apart
    drafts = [[1, 5, 3], [], [5, 0], [4]]
    target = one_hot([1, 2, 3, 5, 0, 4])  # rows: request 0's three, request 2's two, request 3's one
    bonus = [7, 6, 2, 3]
    want = [[1, 2, -1, -1], [6, -1, -1, -1], [5, 0, 2, -1], [4, 3, -1, -1]]
    description = ("a greedy batch with drafts [[1, 5, 3], [], [5, 0], [4]], the target's argmax at the "
                   "draft positions [1, 2, 3 | 5, 0 | 4] and bonus tokens [7, 6, 2, 3]")
    got, problem = run(drafts, target, None, bonus, [True] * 4, [None] * 4, description)
    if problem:
        return verdict(name, problem)
    if got != want:
        bad = next(b for b in range(4) if got[b] != want[b])
        return verdict(name, f"for {description} request {bad} got {got[bad]}, expected {want[bad]} "
                             f"({_greedy_hint(got[bad], want[bad], drafts[bad], bad)})")
    # stochastic: many requests of two drafts, every row different, each with its own generator
    p = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.10, 0.15, 0.20, 0.20, 0.30]],
                     dtype=torch.float64)
    bonus_law = torch.tensor([0.30, 0.05, 0.30, 0.05, 0.20, 0.10], dtype=torch.float64)
    q = torch.tensor([[0.30, 0.30, 0.20, 0.10, 0.05, 0.05], [0.10, 0.10, 0.10, 0.20, 0.20, 0.30]],
                     dtype=torch.float64)
    n = 4000
    gen = torch.Generator().manual_seed(0)
    drafts = [[int(torch.multinomial(q[j], 1, generator=gen)) for j in range(2)] for _ in range(n)]
    bonus = torch.multinomial(bonus_law, n, replacement=True, generator=gen).tolist()
    description = f"{n} stochastic requests of 2 drafts with p, q and the bonus law all different"

    def generators():
        return [torch.Generator().manual_seed(1000 + i) for i in range(n)]
    got, problem = run(drafts, p.repeat(n, 1), q.repeat(n, 1), bonus, [False] * n, generators(), description)
    if problem:
        return verdict(name, problem)
    again, _ = run(drafts, p.repeat(n, 1), q.repeat(n, 1), bonus, [False] * n, generators(), description)
    if again != got:
        return verdict(name, f"for {description}, run twice with the same seeded generators, it gave "
                             "different tokens: draw every random number from generators[b], the "
                             "request's own")
    laws = [(0, p[0], "first emitted token", "on rejection, draw from max(0, p - q) renormalised"),
            (1, p[1], "second emitted token (after an accepted first draft)",
             "position 1 is judged with row 1 of p and of q (request b's rows start at "
             "cu_num_draft_tokens[b - 1])"),
            (2, bonus_law, "third emitted token (after both drafts were accepted)",
             "after all drafts are accepted, emit bonus_token_ids[b]")]
    for pos, law, what, hint in laws:
        counts = torch.zeros(len(law), dtype=torch.long)
        for row in got:
            if len(row) > pos and row[pos] != -1:
                counts[row[pos]] += 1
        _, pvalue = chi_square_test(counts, law)
        if pvalue < 1e-3:
            total = int(counts.sum())
            freq = [round(float(c) / max(total, 1), 3) for c in counts]
            expected = [round(float(x), 3) for x in law]
            return verdict(name, f"for {description} the {what} had frequencies {freq} over {total} "
                                 f"requests, not {expected} (chi-square p-value {pvalue:.1e}): {hint}")
    return verdict(name, None)


def _greedy_hint(got: list[int], want: list[int], drafts: list[int], b: int) -> str:
    """What a wrong row of the greedy case most likely got wrong."""
    tokens = [t for t in got if t != -1]
    if tokens == [t for t in want if t != -1]:
        return "the tokens are right: pad the rest of the row with -1"
    if not drafts:
        return "a request without drafts emits its bonus token alone"
    accepted_all = want[len(drafts)] != -1
    if accepted_all and tokens[:len(drafts)] == drafts:
        return ("after all its drafts are accepted a request emits bonus_token_ids[b], for which "
                "target_probs has no row")
    if tokens == want[:len(tokens)]:
        return "at the first mismatch emit the target's own token (the argmax), then stop"
    return (f"request {b}'s rows are target_probs[cu_num_draft_tokens[{b - 1}]:cu_num_draft_tokens[{b}]]: "
            "cu_num_draft_tokens counts the drafts of requests 0 .. b" if b else
            "draft i is judged with the request's row i: accept drafts while they equal that row's argmax, "
            "then emit the argmax and stop")
