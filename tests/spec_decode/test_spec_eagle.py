"""The trained EAGLE-style head as the engine's proposer (method "eagle"): greedy output equals plain
greedy (any batch, chunked prefill, preemption), its drafts equal draft_eval's reference drafter
(tiny model with a head trained here, and the course model with the committed head), stochastic
drafts' q, paged_step's features, and bad configs. The head trained on the tiny model's own greedy
continuations accepts often, so rollback and multi-position catch-up run.
Method "ngram_eagle" (n-gram first, the head elsewhere): greedy output equals plain greedy, the head's
drafts after n-gram steps equal a fresh head's on the whole history, mixed q in one sampled batch,
and bad configs."""
from __future__ import annotations

import random

import pytest
import torch

from radarlab.engine import Engine, SamplingParams
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.kvcache.sequence import Sequence
from radarlab.models.generate import greedy_generate
from radarlab.models.llama import Llama
from radarlab.models.paged_runner import paged_metadata, paged_step
from radarlab.spec_decode.draft_head import TRAINED_HEAD, DraftHead, draft_config, load_head
from radarlab.spec_decode.eagle import EagleProposer
from radarlab.spec_decode.ngram import NgramProposer
from radarlab.spec_decode.ngram_eagle import NgramEagleProposer
from radarlab.train.draft_data import target_features_batch
from radarlab.train.draft_eval import speculative_generate
from radarlab.train.train_draft import train

WEIGHTS = TRAINED_HEAD  # committed: a test that needs it fails, never skips, when it is missing
NEW = 16


@pytest.fixture(scope="module")
def head_dir(tiny, tmp_path_factory):
    """A head trained (80 steps, a 64-token draft vocabulary) on the tiny model's greedy continuations."""
    torch.manual_seed(3)
    prompts = torch.randint(0, 128, (16, 4)).tolist()
    ids = torch.tensor([p + o for p, o in zip(prompts, greedy_generate(tiny, prompts, 44))])
    feats, greedy = target_features_batch(tiny, ids)
    data = {"tokens": ids.int(), "features": feats.half(), "greedy": greedy.int()}
    out = tmp_path_factory.mktemp("eagle_head")
    cfg = tiny.config
    train(data, tiny, out, steps=80, batch_rows=4, passes=2, vocab_size=64, lr=3e-3, log=None,
          hf_config={"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
                     "num_attention_heads": cfg.num_heads,
                     "num_key_value_heads": cfg.num_kv_heads, "model_type": "llama"})
    return out


@pytest.fixture(scope="module")
def workload(tiny):
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (5, 9, 14)]
    return prompts, greedy_generate(tiny, prompts, NEW)


def eagle(model, k=3):
    return {"method": "eagle", "num_speculative_tokens": k, "model": model}


@pytest.mark.parametrize("batch, num_blocks, budget", [
    (1, 128, 512),
    (3, 128, 512),
    (3, 128, 10),  # chunked prefills: features arrive chunk by chunk
    (3, 14, 24),  # preemption: the recompute's features replace the old ones
])
def test_greedy_equals_plain_greedy(tiny, head_dir, workload, batch, num_blocks, budget):
    engine = run_greedy(tiny, eagle(str(head_dir)), workload, batch, num_blocks, budget)
    # whole drafts accepted: multi-position catch-up ran
    assert engine.spec_stats.num_accepted_tokens_per_pos[1] > 0
    if num_blocks == 14:
        assert engine.scheduler.num_preemptions > 0


def run_greedy(tiny, config, workload, batch, num_blocks, budget):
    """The first `batch` prompts through the engine: outputs equal plain greedy, some drafts are
    accepted and some rejected, and the head holds nothing afterwards. Returns the engine."""
    prompts, ref = workload
    prompts, ref = prompts[:batch], ref[:batch]
    engine = Engine(tiny, num_blocks=num_blocks, block_size=4, max_num_seqs=batch,
                    max_num_batched_tokens=budget,
                    speculative_config=config)
    outs = engine.generate(prompts, SamplingParams(max_tokens=len(ref[0])))
    assert [o.output_token_ids for o in outs] == ref
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    head = getattr(engine.proposer, "eagle", engine.proposer)  # ngram_eagle's head, or eagle's proposer
    assert not head.seqs and not head.features
    assert head.manager.num_free_blocks == head.manager.num_blocks
    return engine


def test_a_draft_forward_of_ones_own_runs_in_the_engine(tiny, head_dir, workload):
    """The seam of notebook 09's exercise: a head loaded with another draft_forward drafts through it,
    and drafts what the head's own forward drafts."""
    from radarlab.spec_decode.draft_head import draft_forward

    calls = []

    def counted(*args):
        calls.append(1)
        return draft_forward(*args)

    mine, vocab = load_head(head_dir, tiny.config, draft_forward=counted)
    ours = run_greedy(tiny, eagle((mine, vocab)), workload, 3, 128, 512)
    assert calls
    reference = run_greedy(tiny, eagle(str(head_dir)), workload, 3, 128, 512)
    assert ours.spec_stats.num_accepted_tokens_per_pos == reference.spec_stats.num_accepted_tokens_per_pos


def test_a_preempted_request_gives_back_the_heads_blocks(tiny, head_dir, workload):
    """Preemption frees a request's target blocks, and it will be recomputed from its first token:
    its draft copy goes too (vLLM frees both together), so the head's pool never holds a request the
    engine is not running, and the others keep drafting."""
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=14, block_size=4, max_num_seqs=3, max_num_batched_tokens=24,
                    speculative_config=eagle(str(head_dir)))
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=len(ref[0])))
    while engine.has_unfinished_requests():
        engine.step()
        assert set(engine.proposer.seqs) <= {r.request_id for r in engine.scheduler.running}
    assert engine.scheduler.num_preemptions > 0


def test_engine_drafts_equal_the_reference_drafter(tiny, head_dir, workload):
    """Engine(method eagle) and draft_eval's speculative_generate (HeadDrafter on a contiguous cache,
    the target verifying) draft and accept the same, with the head's truncated vocabulary."""
    prompts, ref = workload
    head, vocab = load_head(head_dir, tiny.config)
    assert vocab is not None and vocab.numel() == 64
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=eagle((head, vocab)))
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW))
    r = speculative_generate(tiny, prompts, NEW, 3, "draft", head, vocab)
    assert [o.output_token_ids for o in outs] == r["outputs"] == ref
    s = engine.spec_stats
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens_per_pos) == \
        (r["num_drafts"], r["num_draft_tokens"], r["num_accepted_tokens_per_pos"])


def test_course_model_engine_equals_reference_with_the_committed_head(model, tokenizer):
    from radarlab.train.draft_eval import eval_prompts

    prompts = eval_prompts(tokenizer, 2, 96)
    head, vocab = load_head(WEIGHTS, model.config)
    r = speculative_generate(model, prompts, 24, 4, "draft", head, vocab)
    engine = Engine(model, num_blocks=64, speculative_config=eagle(str(WEIGHTS), 4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=24))
    assert [o.output_token_ids for o in outs] == r["outputs"]
    s = engine.spec_stats
    assert (s.num_drafts, s.num_accepted_tokens_per_pos) == (r["num_drafts"],
                                                             r["num_accepted_tokens_per_pos"])
    assert s.num_accepted_tokens > s.num_drafts // 2  # the trained head is right often


def test_stochastic_drafts_q_is_the_draft_vocabulary_distribution(tiny, head_dir, workload):
    prompts, _ = workload
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=NEW, seed=11)
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=eagle(str(head_dir)))
    seen = []
    propose = engine.proposer.propose

    def recording(requests, num_tokens):
        proposals = propose(requests, num_tokens)
        seen.extend((r.params.greedy, p) for r, p in zip(requests, proposals))
        return proposals

    engine.proposer.propose = recording
    first = engine.generate(prompts, [sampled, SamplingParams(max_tokens=NEW), sampled])
    outside = torch.ones(128, dtype=torch.bool)
    outside[engine.proposer.vocab] = False
    sampled_props = [p for greedy, p in seen if not greedy and p.draft_token_ids]
    assert sampled_props and all(p.draft_probs is None for greedy, p in seen if greedy)
    for p in sampled_props:
        q = p.draft_probs
        assert q.shape == (len(p.draft_token_ids), 128)
        torch.testing.assert_close(q.sum(-1), torch.ones(len(q)))
        assert (q[:, outside] == 0).all()
        assert ((q > 0).sum(-1) <= 20).all()  # top_k truncates q as it truncates p
        assert all(q[i, t] > 0 for i, t in enumerate(p.draft_token_ids))
    engine.proposer.propose = propose
    again = Engine(tiny, num_blocks=128, block_size=4, speculative_config=eagle(str(head_dir)))
    alone = again.generate(prompts[2:], [sampled])
    assert alone[0].output_token_ids == first[2].output_token_ids  # seeded: the same alone and in a batch
    assert first[0].output_token_ids != first[2].output_token_ids


def test_paged_step_returns_the_features_the_lm_head_reads(tiny):
    manager = KVCacheManager(16, 4, enable_prefix_caching=False)
    cache = PagedKVCache.for_model(tiny.config, 16, 4)
    seqs = [Sequence(i, list(range(3 + 4 * i, 10 + 5 * i)), 4) for i in range(2)]
    for s in seqs:
        manager.allocate(s)
    plain = paged_step(tiny, cache, manager, seqs, [0, 0])
    logits, features = paged_step(tiny, cache, manager, seqs, [0, 0], return_features=True)
    assert features.shape == (sum(s.num_tokens for s in seqs), tiny.config.hidden_size)
    torch.testing.assert_close(logits, plain)
    meta = paged_metadata(manager, seqs, [0, 0], [s.num_tokens for s in seqs])
    torch.testing.assert_close(tiny.lm_head(features[meta.query_start_loc[1:] - 1]), plain)
    ref, _ = target_features_batch(tiny, torch.tensor([seqs[0].all_token_ids]))
    torch.testing.assert_close(features[:seqs[0].num_tokens], ref[0])


def test_a_prefix_cache_hit_decodes_without_drafts(tiny, head_dir, workload):
    """Positions found in the prefix cache have no features: that request drafts nothing, exactly."""
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=eagle(str(head_dir)))
    engine.generate(prompts[2:], SamplingParams(max_tokens=NEW))
    drafts = engine.spec_stats.num_drafts
    again = engine.generate(prompts[2:], SamplingParams(max_tokens=NEW))
    assert again[0].output_token_ids == ref[2]
    assert engine.spec_stats.num_drafts == drafts


def test_bad_eagle_config_raises(tiny, head_dir, tmp_path):
    def make(config):
        return Engine(tiny, num_blocks=16, block_size=4, speculative_config=config)

    with pytest.raises(ValueError, match="method 'eagle' needs a model"):
        make({"method": "eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match=r"unknown speculative_config keys \['draft_vocab'\]"):
        make({**eagle(str(head_dir)), "draft_vocab": None})
    with pytest.raises(ValueError, match=r"prompt_lookup_max belongs to methods \['ngram', 'ngram_eagle'\], "
                                         r"not 'eagle'"):
        make({**eagle(str(head_dir)), "prompt_lookup_max": 3})
    with pytest.raises(ValueError, match="needs a draft head .* got Llama"):
        make(eagle(tiny))
    wide = DraftHead(draft_config(type(tiny.config)(**{**tiny.config.__dict__, "hidden_size": 32})))
    with pytest.raises(ValueError, match="draft head's hidden_size is 32, the target's 64"):
        make(eagle(wide))
    other = Llama(type(tiny.config)(**{**tiny.config.__dict__, "vocab_size": 100}))
    with pytest.raises(ValueError, match="draft head vocab_size=128 does not match the target's 100"):
        Engine(other, num_blocks=16, block_size=4, speculative_config=eagle(str(head_dir)))
    head = DraftHead(draft_config(tiny.config))
    with pytest.raises(ValueError, match="draft vocabulary must be 1-D target token ids"):
        make(eagle((head, torch.tensor([3, 200]))))
    with pytest.raises(ValueError, match="num_speculative_tokens must be"):
        EagleProposer(head, tiny, None, -1, 16, 4)


# --- method "ngram_eagle" (radarlab.spec_decode.ngram_eagle): the n-gram's drafts, else the head's ---

@pytest.fixture(scope="module")
def lookup_workload(tiny):
    """Longer prompts, so that 1-gram lookups match now and then: the sources alternate within a
    request, the head sometimes drafting again after several n-gram steps."""
    rng = random.Random(5)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (24, 30, 40)]
    return prompts, greedy_generate(tiny, prompts, 24)


def ngram_eagle(model, k=3):
    return {"method": "ngram_eagle", "num_speculative_tokens": k, "prompt_lookup_min": 1,
            "prompt_lookup_max": 3,
            "model": model}


def record_sources(proposer):
    """Per request, the source of each proposal: 'n' n-gram, 'e' the head, '-' none. The head's
    proposals are recorded with the request they were made for."""
    history, head_calls = {}, []
    ngram_propose, eagle_propose = proposer.ngram.propose, proposer.eagle.propose

    def ngram(requests, num_tokens):
        proposals = ngram_propose(requests, num_tokens)
        for r, p in zip(requests, proposals):
            history.setdefault(r.request_id, []).append("n" if p.draft_token_ids else "-")
        return proposals

    def eagle(requests, num_tokens):
        proposals = eagle_propose(requests, num_tokens)
        for r, k, p in zip(requests, num_tokens, proposals):
            history[r.request_id][-1] = "e" if p.draft_token_ids else "-"
            head_calls.append((r, k, p))
        return proposals

    proposer.ngram.propose, proposer.eagle.propose = ngram, eagle
    return history, head_calls


@pytest.mark.parametrize("batch, num_blocks, budget", [
    (1, 128, 512),
    (3, 128, 512),
    (3, 24, 48),  # preemption: the recompute's features replace the old ones
])
def test_ngram_eagle_greedy_equals_plain_greedy(tiny, head_dir, lookup_workload, batch, num_blocks, budget):
    engine = run_greedy(tiny, ngram_eagle(str(head_dir)), lookup_workload, batch, num_blocks, budget)
    by_source = engine.proposer.num_drafts_by_source
    assert by_source["ngram"] > 0 and by_source["eagle"] > 0
    # preemption drops some unverified
    assert by_source["ngram"] + by_source["eagle"] >= engine.spec_stats.num_drafts
    if num_blocks == 24:
        assert engine.scheduler.num_preemptions > 0


def test_ngram_eagle_head_drafts_as_if_it_had_drafted_every_step(tiny, head_dir, lookup_workload):
    """After steps the n-gram drafted, the head catches up on every position it skipped: its first
    draft's q equals that of a fresh EagleProposer given the whole history's features at once
    (sampled requests, so that q is there to compare: it shows more than an argmax would)."""
    prompts, _ = lookup_workload
    head, vocab = load_head(head_dir, tiny.config)
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=ngram_eagle((head, vocab)))
    history, head_calls = record_sources(engine.proposer)
    snapshots = []
    eagle_propose = engine.proposer.eagle.propose

    # the requests change after the call: copy what a fresh proposer reads
    def snapshot(requests, num_tokens):
        for r in requests:  # skipped: the n-gram steps since the head last drafted for r
            before = "".join(history[r.request_id][:-1])
            snapshots.append((list(r.all_token_ids), len(before) - len(before.rstrip("n"))))
        return eagle_propose(requests, num_tokens)

    engine.proposer.eagle.propose = snapshot
    engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=24, seed=7))
    assert max(skipped for _, skipped in snapshots) >= 2
    assert len(head_calls) == len(snapshots) == engine.proposer.num_drafts_by_source["eagle"]
    for (r, _, proposal), (tokens, _) in zip(head_calls, snapshots):
        fresh = EagleProposer(head, tiny, vocab, 1, 128, 4)
        feats, _ = target_features_batch(tiny, torch.tensor([tokens]))
        request = type(r)(r.request_id, tokens, r.params, block_size=4)
        fresh.observe(request, 0, feats[0, :-1])
        torch.testing.assert_close(proposal.draft_probs[0], fresh.propose([request], [1])[0].draft_probs[0])


def test_ngram_eagle_mixes_one_hot_and_head_q_in_a_sampled_batch(tiny, head_dir, lookup_workload):
    prompts, ref = lookup_workload
    sampled = SamplingParams(temperature=0.8, top_k=20, max_tokens=24, seed=11)
    engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=ngram_eagle(str(head_dir)))
    calls = []
    propose = engine.proposer.propose

    def recording(requests, num_tokens):
        proposals = propose(requests, num_tokens)
        calls.append([(r.params.greedy, p) for r, p in zip(requests, proposals) if p.draft_token_ids])
        return proposals

    engine.proposer.propose = recording
    first = engine.generate(prompts, [sampled, SamplingParams(max_tokens=24), sampled])
    assert first[1].output_token_ids == ref[1]
    kinds = [{p.draft_probs is None for greedy, p in call if not greedy} for call in calls]
    assert {True, False} in kinds  # one step verified an n-gram draft (one-hot q) beside a head draft with q
    for call in calls:
        for greedy, p in call:
            if p.draft_probs is not None:
                assert not greedy and p.draft_probs.shape == (len(p.draft_token_ids), 128)
    alone = Engine(tiny, num_blocks=128, block_size=4, speculative_config=ngram_eagle(str(head_dir)))
    assert alone.generate(prompts[2:], [sampled])[0].output_token_ids == first[2].output_token_ids


def test_bad_ngram_eagle_config_raises(tiny, head_dir):
    def make(config):
        return Engine(tiny, num_blocks=16, block_size=4, speculative_config=config)

    with pytest.raises(ValueError, match="method 'ngram_eagle' needs a model"):
        make({"method": "ngram_eagle", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="method 'ngram_eagle' needs a draft head .* got Llama"):
        make(ngram_eagle(tiny))
    with pytest.raises(ValueError, match="prompt_lookup_min=3 must be <= prompt_lookup_max=2"):
        make({**ngram_eagle(str(head_dir), k=0), "prompt_lookup_min": 3, "prompt_lookup_max": 2})
    with pytest.raises(ValueError, match=r"method must be one of \[.*'ngram_eagle'\], got 'ngram\+eagle'"):
        make({**ngram_eagle(str(head_dir)), "method": "ngram+eagle"})
    with pytest.raises(ValueError, match=r"unknown speculative_config keys \['draft_vocab'\]"):
        make({**ngram_eagle(str(head_dir)), "draft_vocab": None})
    assert make(ngram_eagle(str(head_dir), k=0)).proposer is None  # k = 0: plain decoding
    head, vocab = load_head(head_dir, tiny.config)
    with pytest.raises(ValueError, match="n-gram proposer drafts 2 tokens, the EAGLE proposer 3"):
        NgramEagleProposer(NgramProposer(2, 1, 3), EagleProposer(head, tiny, vocab, 3, 16, 4))
