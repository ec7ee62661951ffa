"""The rejection sampler (radarlab.sample.rejection_sampler): greedy and stochastic verification, the shared
probability function, bad input, and a chi-square proof that speculative sampling is lossless, with
the same test shown to catch two biased samplers."""
from __future__ import annotations

import pytest
import torch

from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.kvcache.sequence import Sequence
from radarlab.lab.chi_square import chi_square_power, chi_square_sf, chi_square_test, critical_value
from radarlab.models.paged_runner import paged_step
from radarlab.sample.rejection_sampler import (
    PLACEHOLDER_TOKEN_ID,
    rejection_sample,
    verify_greedy,
    verify_stochastic,
)
from radarlab.sample.sampler import probabilities, sample
from radarlab.sample.sampling_params import SamplingParams
from radarlab.spec_decode.draft_model import truncated_copy

ALPHA = 1e-3  # reject "the sampler draws from p" when the p-value is below this


# --- probabilities: one function for sampling and verification -----------------------------------

def test_probabilities_is_what_sample_draws_from():
    torch.manual_seed(0)
    logits = torch.randn(40)
    params = SamplingParams(temperature=0.7, top_k=10, top_p=0.8, seed=3)
    p = probabilities(logits, params)
    assert float(p.sum()) == pytest.approx(1.0)
    # by hand: the 10 largest logits / T, softmax, keep the smallest head reaching 0.8, renormalise
    values, order = (logits / 0.7).topk(10)
    head = values.softmax(-1)
    n = int((head.cumsum(-1) - head < 0.8).sum())
    expected = torch.zeros(40).scatter(0, order[:n], head[:n] / head[:n].sum())
    torch.testing.assert_close(p, expected)
    gen_a, gen_b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    drawn = [sample(logits[None], [params], [gen_a])[0] for _ in range(50)]
    assert drawn == [int(torch.multinomial(p, 1, generator=gen_b)) for _ in range(50)]
    # rows of a [k, V] block are truncated one by one, exactly as a single row
    block = torch.randn(3, 40)
    torch.testing.assert_close(probabilities(block, params),
                               torch.stack([probabilities(r, params) for r in block]))
    greedy = probabilities(logits, SamplingParams())
    assert greedy.sum() == 1 and greedy[logits.argmax()] == 1


# --- greedy ------------------------------------------------------------------------------------

def one_hot_logits(tokens, vocab=8):
    return torch.stack([torch.nn.functional.one_hot(torch.tensor(t), vocab).float() * 5 for t in tokens])


@pytest.mark.parametrize("target, drafts, emitted", [
    ([1, 2, 3, 4], [1, 2, 3], [1, 2, 3, 4]),  # all accepted, then the bonus token
    ([1, 2, 3, 4], [1, 5, 3], [1, 2]),  # second draft wrong: the target's token replaces it
    ([1, 2, 3, 4], [7, 2, 3], [1]),  # first wrong: one token, as plain decoding
    ([6], [], [6]),  # no drafts: plain decoding
])
def test_greedy_verification(target, drafts, emitted):
    logits = one_hot_logits(target)
    assert verify_greedy(logits, drafts) == emitted
    out = batched([logits], [drafts], [True])
    assert out[0].tolist() == emitted + [PLACEHOLDER_TOKEN_ID] * (len(drafts) + 1 - len(emitted))


def batched(logits, drafts, greedy, params=None, draft_probs=None, generators=None):
    """rejection_sample on requests given as [k+1, V] logits each, the bonus drawn as the engine does."""
    params = params or [SamplingParams(temperature=0.0 if g else 1.0) for g in greedy]
    generators = generators or [None] * len(drafts)
    bonus = torch.tensor(sample(torch.stack([row[-1] for row in logits]), params, generators))[:, None]
    target = torch.cat([probabilities(row[:-1], p) for row, p in zip(logits, params)])
    cu = torch.tensor([len(d) for d in drafts]).cumsum(0)
    return rejection_sample(torch.tensor([t for d in drafts for t in d], dtype=torch.long), cu, draft_probs,
                            target, bonus, greedy, generators)


def test_batched_verification_pads_each_request_and_equals_one_at_a_time():
    torch.manual_seed(0)
    logits = [one_hot_logits([1, 2, 3, 4]), one_hot_logits([6]), one_hot_logits([5, 0, 2])]
    drafts = [[1, 5, 3], [], [5, 0]]
    out = batched(logits, drafts, [True, True, True])
    assert out.tolist() == [[1, 2, -1, -1], [6, -1, -1, -1], [5, 0, 2, -1]]
    # stochastic requests draw from their own generators: batched equals one request at a time
    rows = [torch.randn(4, 30), torch.randn(3, 30)]
    q = [torch.randn(3, 30).softmax(-1), torch.randn(2, 30).softmax(-1)]
    drafts = [[3, 4, 5], [7, 8]]
    params = [SamplingParams(temperature=1.0)] * 2

    def gens():
        return [torch.Generator().manual_seed(3), torch.Generator().manual_seed(4)]
    together = batched(rows, drafts, [False, False], params, torch.cat(q), gens())
    g = gens()
    alone = [batched([rows[i]], [d], [False], params[:1], q[i], [g[i]])[0] for i, d in enumerate(drafts)]
    assert together[0].tolist() == alone[0].tolist() and together[1, :3].tolist() == alone[1].tolist()


def test_batched_bad_shapes_raise():
    with pytest.raises(ValueError, match="bonus_token_ids"):
        rejection_sample(torch.tensor([1]), torch.tensor([1]), None, torch.zeros(1, 4), torch.zeros(2, 1),
                         [True], [None])
    with pytest.raises(ValueError, match="counts 3 drafts: draft_token_ids must be \\[3\\]"):
        rejection_sample(torch.tensor([1, 2]), torch.tensor([1, 3]), None, torch.zeros(2, 4),
                         torch.zeros(2, 1), [True, True], [None, None])


def test_bad_input_raises():
    logits = one_hot_logits([1, 2, 3])
    with pytest.raises(ValueError, match="k \\+ 1 = 3 target rows"):
        verify_greedy(logits[:2], [1, 2])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        verify_greedy(logits, [1, 8])
    with pytest.raises(ValueError, match="draft_probs must be"):
        verify_stochastic(logits.softmax(-1), [1, 2], torch.full((2, 7), 1 / 7))


def test_stochastic_with_equal_p_and_q_accepts_everything():
    p = torch.tensor([[0.5, 0.3, 0.2]] * 4)
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        drafts = torch.multinomial(p[0], 3, replacement=True, generator=gen).tolist()
        out = verify_stochastic(p, drafts, p[:3], gen)
        assert out[:3] == drafts and len(out) == 4


def test_one_hot_draft_is_accepted_with_probability_p_and_never_resampled_on_rejection():
    p = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6]])
    gen = torch.Generator().manual_seed(1)
    outs = [verify_stochastic(p, [0], None, gen) for _ in range(4000)]
    accepted = sum(len(o) == 2 for o in outs)
    assert accepted / 4000 == pytest.approx(0.6, abs=0.03)
    assert all(o[0] != 0 for o in outs if len(o) == 1)  # the rejected draft is excluded from the residual


def test_seeded_verification_is_reproducible():
    torch.manual_seed(0)
    logits, q = torch.randn(4, 30), torch.randn(3, 30).softmax(-1)
    params = SamplingParams(temperature=1.0)
    runs = [[tuple(batched([logits], [[3, 4, 5]], [False], [params], q,
                           [torch.Generator().manual_seed(s)])[0].tolist()) for s in range(20)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) > 1  # the seed matters


# --- losslessness: chi-square ------------------------------------------------------------------

def test_chi_square_helpers_agree_with_known_values():
    assert chi_square_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-6)
    assert chi_square_sf(11.070497693516351, 5) == pytest.approx(0.05, rel=1e-6)
    assert critical_value(5, 0.05) == pytest.approx(11.0705, abs=1e-3)
    assert chi_square_power([0.5, 0.5], [0.5, 0.5], 1000, 0.05) == pytest.approx(0.05, abs=1e-6)
    with pytest.raises(ValueError, match="counts for"):
        chi_square_test([1, 2, 3], [0.5, 0.5])


def draw(sampler, p, q, n, seed, with_q=True):
    """First and second emitted tokens of n verify steps with 2 drafts drawn from q."""
    gen = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(p.shape[1], dtype=torch.long), torch.zeros(p.shape[1], dtype=torch.long)
    for _ in range(n):
        drafts = [int(torch.multinomial(q[i], 1, generator=gen)) for i in range(2)]
        out = sampler(p, drafts, q if with_q else None, gen)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[1]] += 1
    return first, second


def forgets_to_subtract_q(p, drafts, q, gen):
    """Biased: on rejection draws from p itself instead of the residual max(0, p - q)."""
    out = []
    for i, x in enumerate(drafts):
        if torch.rand((), generator=gen) * q[i, x] < p[i, x]:
            out.append(x)
            continue
        return out + [int(torch.multinomial(p[i], 1, generator=gen))]
    return out + [int(torch.multinomial(p[-1], 1, generator=gen))]


def skips_renormalisation(p, drafts, q, gen):
    """Biased: draws from the residual only with probability equal to its mass (unnormalised), and
    from p otherwise."""
    out = []
    for i, x in enumerate(drafts):
        if torch.rand((), generator=gen) * q[i, x] < p[i, x]:
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        dist = residual + (1 - residual.sum()) * p[i]
        return out + [int(torch.multinomial(dist, 1, generator=gen))]
    return out + [int(torch.multinomial(p[-1], 1, generator=gen))]


def output_law_of_forgets_to_subtract_q(p, q):
    """Exact law of the first token under forgets_to_subtract_q: min(p, q) + (1 - sum min(p, q)) p."""
    accept = torch.minimum(p, q)
    return accept + (1 - accept.sum()) * p


TOY_P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.06, 0.04], [0.05, 0.05, 0.30, 0.30, 0.20, 0.10],
                      [0.2, 0.2, 0.2, 0.2, 0.1, 0.1]], dtype=torch.float64)
TOY_Q = torch.tensor([[0.10, 0.10, 0.30, 0.30, 0.10, 0.10], [0.30, 0.20, 0.20, 0.10, 0.10, 0.10]],
                     dtype=torch.float64)
N_TOY = 6000


def test_the_toy_test_has_power_against_the_biased_law():
    """Sized before it is run: with N_TOY draws the chi-square rejects forgets_to_subtract_q's law at
    ALPHA with near certainty."""
    biased = output_law_of_forgets_to_subtract_q(TOY_P[0], TOY_Q[0])
    assert float((biased - TOY_P[0]).abs().max()) > 0.05
    assert chi_square_power(biased.tolist(), TOY_P[0].tolist(), N_TOY, ALPHA) > 0.99


def test_speculative_sampling_reproduces_p_on_a_toy_distribution():
    for with_q in (True, False):  # a draft with probabilities, and a one-hot (n-gram-like) draft
        first, second = draw(verify_stochastic, TOY_P, TOY_Q, N_TOY, seed=0, with_q=with_q)
        assert chi_square_test(first, TOY_P[0])[1] > ALPHA
        assert chi_square_test(second, TOY_P[1])[1] > ALPHA  # given the first draft was accepted


@pytest.mark.parametrize("biased", [forgets_to_subtract_q, skips_renormalisation])
def test_the_same_test_rejects_biased_samplers(biased):
    first, _ = draw(biased, TOY_P, TOY_Q, N_TOY, seed=0)
    assert chi_square_test(first, TOY_P[0])[1] < 1e-6


def next_token_logits(model, ids):
    manager = KVCacheManager(len(ids) // 16 + 1, 16)
    cache = PagedKVCache.for_model(model.config, manager.num_blocks, 16)
    seq = Sequence(0, ids, 16)
    manager.allocate(seq)
    return paged_step(model, cache, manager, [seq], [0])[0]


def test_speculative_sampling_reproduces_the_course_models_next_token_distribution(model, tokenizer):
    """p: the course model's next-token distribution at a fixed prefix (temperature 1, top-k 200);
    q: the same model's first 28 of 30 layers (an early-exit draft), under the same settings. They
    overlap by about a quarter of their mass, where forgetting the residual shifts the output most.
    Bins: p's 8 most likely tokens and the rest. The samplers run on the union of the two supports
    (tokens outside it have p = q = 0 and can never be drawn), which keeps the test fast."""
    ids = tokenizer("The capital of France is a city called")["input_ids"]
    params = SamplingParams(temperature=1.0, top_k=200)
    p = probabilities(next_token_logits(model, ids), params).double()
    q = probabilities(next_token_logits(truncated_copy(model, 28), ids), params).double()
    support = ((p > 0) | (q > 0)).nonzero().flatten()
    p, q = p[support], q[support]
    top = p.topk(8).indices
    bins = torch.cat([p[top], (1 - p[top].sum()).reshape(1)])
    n = 4000
    biased = output_law_of_forgets_to_subtract_q(p, q)
    biased_bins = torch.cat([biased[top], (1 - biased[top].sum()).reshape(1)])
    assert chi_square_power(biased_bins.tolist(), bins.tolist(), n, ALPHA) > 0.99  # the test can see the bug
    p2, q2 = torch.stack([p, p]), q[None]
    rank = {int(t): i for i, t in enumerate(top)}
    for sampler, lossless in [(verify_stochastic, True), (forgets_to_subtract_q, False)]:
        gen = torch.Generator().manual_seed(0)
        counts = torch.zeros(9, dtype=torch.long)
        for _ in range(n):
            x = int(torch.multinomial(q, 1, generator=gen))
            counts[rank.get(sampler(p2, [x], q2, gen)[0], 8)] += 1
        pvalue = chi_square_test(counts, bins)[1]
        assert (pvalue > ALPHA) if lossless else (pvalue < 1e-6), (sampler.__name__, pvalue)
