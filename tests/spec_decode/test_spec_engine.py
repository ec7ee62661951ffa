"""Speculative decoding in the engine: greedy output equals plain greedy (n-gram and draft-model
drafts, any batch, chunked prefill, preemption), proposals cut at max_tokens and max_model_len,
stop tokens inside accepted drafts, seeded sampling, metrics, the timeline's verify steps, and bad
speculative_config input."""
from __future__ import annotations

import random

import pytest
import torch

from radarlab.engine import Engine, RequestStatus, SamplingParams
from radarlab.lab.timeline import DECODE, PREFILL, VERIFY, output_token_ids, run_recorded
from radarlab.models.generate import greedy_generate
from radarlab.models.llama import Llama
from radarlab.sample.rejection_sampler import PLACEHOLDER_TOKEN_ID, rejection_sample
from radarlab.spec_decode.draft_model import truncated_copy

NEW = 12
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


def repetitive_prompts(n, seed=0):
    """Prompts that repeat a random segment (so n-gram lookup has something to find), then a tail."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        segment = [rng.randrange(128) for _ in range(rng.randint(2, 6))]
        out.append(segment * rng.randint(1, 4) + [rng.randrange(128) for _ in range(rng.randint(1, 12))])
    return out


@pytest.fixture(scope="module")
def workload(tiny):
    prompts = repetitive_prompts(6)
    return prompts, greedy_generate(tiny, prompts, NEW)


def draft_config(model, k=3):
    return {"method": "draft_model", "num_speculative_tokens": k, "model": model}


@pytest.mark.parametrize("batch, num_blocks, budget, k", [
    (1, 128, 512, 4),  # one at a time
    (3, 128, 10, 1),  # chunked prefills
    (6, 128, 12, 4),  # chunked prefills, and drafts cut by the token budget
    (6, 18, 24, 4),  # preemption
])
def test_ngram_greedy_equals_plain_greedy(tiny, workload, batch, num_blocks, budget, k):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=num_blocks, block_size=4, max_num_seqs=batch,
                    max_num_batched_tokens=budget, speculative_config={**NGRAM, "num_speculative_tokens": k})
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.output_token_ids for o in outs] == ref
    assert all(o.status is RequestStatus.FINISHED_LENGTH for o in outs)
    assert engine.manager.num_free_blocks == num_blocks  # rejected drafts' blocks came back too
    stats = engine.spec_stats
    assert stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.num_output_tokens == NEW * len(prompts)
    if num_blocks == 18:
        assert engine.scheduler.num_preemptions > 0


@pytest.mark.parametrize("layers, num_blocks, budget", [
    (1, 128, 512),  # an early exit: partly right
    (2, 18, 16),  # the target itself (always right), with chunked prefills and preemption
])
def test_draft_model_greedy_equals_plain_greedy(tiny, workload, layers, num_blocks, budget):
    prompts, ref = workload
    draft = truncated_copy(tiny, layers)
    engine = Engine(tiny, num_blocks=num_blocks, block_size=4, max_num_seqs=6, max_num_batched_tokens=budget,
                    speculative_config=draft_config(draft))
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW))
    assert [o.output_token_ids for o in outs] == ref
    stats = engine.spec_stats
    assert stats.num_drafts > 0
    if layers == tiny.config.num_layers:  # the target drafting for itself: every draft is accepted
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    else:
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    proposer = engine.proposer
    assert not proposer.seqs and proposer.manager.num_free_blocks == proposer.manager.num_blocks


def test_one_batch_mixes_verify_decode_and_chunked_prefill(tiny, workload):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=128, block_size=4, max_num_seqs=6, max_num_batched_tokens=20,
                    speculative_config=draft_config(truncated_copy(tiny, 1)))
    max_tokens = [NEW - 2 * i for i in range(len(prompts))]  # drafts are cut at different lengths
    for p, m in zip(prompts, max_tokens):
        engine.add_request(p, SamplingParams(max_tokens=m))
    records = run_recorded(engine)
    kinds = [{w.kind for w in r.scheduled} for r in records]
    assert any({VERIFY, PREFILL} <= k for k in kinds)
    assert any({VERIFY, DECODE} <= k for k in kinds)  # a request without drafts, next to one with
    spec_counts = [{w.num_tokens - 1 for w in r.scheduled if w.kind == VERIFY} for r in records]
    assert any(len(c) > 1 for c in spec_counts)  # different numbers of drafts in one step
    assert any(len(w.tokens) > 1 for r in records for w in r.scheduled)  # a step emitted several tokens
    got = output_token_ids(records)
    assert [got[i] for i in range(len(prompts))] == [r[:m] for r, m in zip(ref, max_tokens)]


def test_proposals_are_cut_at_max_tokens(tiny, workload):
    prompts, ref = workload
    engine = Engine(tiny, num_blocks=64, block_size=4, speculative_config=draft_config(tiny, k=4))
    outs = engine.generate(prompts[:1], SamplingParams(max_tokens=7))
    assert outs[0].output_token_ids == ref[0][:7]
    # 1 token from the prefill, then 4 drafts + 1 (6), then none may be drafted: 7 - 6 - 1 = 0
    assert engine.spec_stats.num_draft_tokens == 4 and engine.spec_stats.num_drafts == 1
    assert engine.num_steps == 3


def test_proposals_are_cut_at_max_model_len(tiny, workload):
    prompts, ref = workload
    prompt = prompts[0]
    limit = len(prompt) + 6
    plain = Engine(tiny, num_blocks=64, block_size=4,
                   max_model_len=limit).generate([prompt], SamplingParams(max_tokens=50))
    engine = Engine(tiny, num_blocks=64, block_size=4, max_model_len=limit,
                    speculative_config=draft_config(tiny, k=4))
    outs = engine.generate([prompt], SamplingParams(max_tokens=50))
    assert outs[0].output_token_ids == plain[0].output_token_ids == ref[0][:6]
    assert outs[0].status is RequestStatus.FINISHED_LENGTH
    assert engine.spec_stats.num_draft_tokens == 4  # 1 + (4 + 1): one more draft would pass max_model_len


@pytest.mark.parametrize("how", ["eos", "stop_token_ids"])
def test_stop_token_inside_accepted_drafts_ends_the_output_there(tiny, workload, how):
    prompts, ref = workload
    i, j = next((i, j) for i, out in enumerate(ref) for j in range(2, NEW - 2) if out[j] not in out[:j])
    stop = ref[i][j]
    engine = Engine(tiny, num_blocks=64, block_size=4, eos_token_id=stop if how == "eos" else None,
                    speculative_config=draft_config(tiny, k=NEW))  # every draft is accepted
    params = SamplingParams(max_tokens=NEW, stop_token_ids=(stop,) if how == "stop_token_ids" else ())
    outs = engine.generate([prompts[i]], params)
    assert outs[0].output_token_ids == ref[i][:j + 1]
    assert outs[0].status is RequestStatus.FINISHED_STOPPED
    assert engine.spec_stats.num_accepted_tokens > j  # the stop token was inside the accepted drafts
    assert engine.spec_stats.num_output_tokens == j + 1
    assert engine.manager.num_free_blocks == 64


def test_zero_speculative_tokens_is_plain_decoding(tiny, workload):
    prompts, ref = workload
    for config in ({**NGRAM, "num_speculative_tokens": 0}, draft_config(tiny, k=0)):
        engine = Engine(tiny, num_blocks=64, block_size=4, speculative_config=config)
        assert engine.proposer is None and engine.spec_stats is None
        assert [o.output_token_ids for o in engine.generate(prompts[:3],
                                                            SamplingParams(max_tokens=NEW))] == ref[:3]


@pytest.mark.parametrize("config", [NGRAM, "draft"])
def test_seeded_sampling_is_the_same_alone_and_in_a_batch(tiny, workload, config):
    prompts, _ = workload
    config = draft_config(truncated_copy(tiny, 1)) if config == "draft" else NGRAM
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=NEW, seed=11)

    def run(batch):
        engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=config)
        return engine.generate(batch, [params] * len(batch)), engine

    alone, _ = run(prompts[:1])
    together, engine = run(prompts[:4])
    assert together[0].output_token_ids == alone[0].output_token_ids
    assert engine.spec_stats.num_drafts > 0
    assert len({tuple(o.output_token_ids) for o in together}) == 4


def test_metrics_follow_vllms_definitions(tiny, workload):
    prompts, _ = workload
    engine = Engine(tiny, num_blocks=128, block_size=4,
                    speculative_config=draft_config(truncated_copy(tiny, 1), 4))
    outs = engine.generate(prompts, SamplingParams(max_tokens=NEW))
    s = engine.spec_stats
    assert s.num_draft_tokens == sum(s.num_draft_tokens_per_pos)
    assert s.num_accepted_tokens == sum(s.num_accepted_tokens_per_pos)
    # accepted in order
    assert s.num_accepted_tokens_per_pos == sorted(s.num_accepted_tokens_per_pos, reverse=True)
    assert s.mean_acceptance_length == pytest.approx(1 + s.num_accepted_tokens / s.num_drafts)
    assert s.acceptance_rate == pytest.approx(s.num_accepted_tokens / s.num_draft_tokens)
    assert s.num_forwards == engine.num_steps
    assert s.tokens_per_forward == pytest.approx(sum(len(o.output_token_ids) for o in outs)
                                                 / engine.num_steps)


def test_bad_speculative_config_raises(tiny):
    def make(config):
        return Engine(tiny, num_blocks=16, block_size=4, speculative_config=config)

    with pytest.raises(ValueError,
                       match=r"unknown speculative_config keys \['num_spec_tokens'\]; valid keys: "
                                         r"\['method', 'num_speculative_tokens', 'prompt_lookup_min'"):
        make({"method": "ngram", "num_spec_tokens": 3})
    with pytest.raises(ValueError, match="method must be one of"):
        make({"method": "medusa", "num_speculative_tokens": 3})
    with pytest.raises(ValueError, match="needs num_speculative_tokens"):
        make({"method": "ngram"})
    with pytest.raises(ValueError, match="num_speculative_tokens must be a non-negative int"):
        make({"method": "ngram", "num_speculative_tokens": -2})
    with pytest.raises(ValueError, match="needs a model"):
        make({"method": "draft_model", "num_speculative_tokens": 3})
    with pytest.raises(ValueError,
                       match=r"prompt_lookup_min belongs to methods \['ngram', "
                             r"'ngram_eagle'\], not 'draft_model'"):
        make({**draft_config(tiny), "prompt_lookup_min": 2})
    with pytest.raises(ValueError, match="must be a dict"):
        make([("method", "ngram")])
    other = Llama(type(tiny.config)(**{**tiny.config.__dict__, "vocab_size": 100}))
    with pytest.raises(ValueError, match="draft model's vocabulary has 100 tokens, the target's 128"):
        make(draft_config(other))


def test_course_model_greedy_speculation_equals_plain_greedy(model, prompts):
    """fp32, the course model: n-gram under preemption, and an 8-layer early-exit draft."""
    batch = prompts[:2]
    plain = Engine(model, num_blocks=64).generate(batch, SamplingParams(max_tokens=8))
    ref = [o.output_token_ids for o in plain]
    for config, num_blocks in [({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1,
                                 "prompt_lookup_max": 2}, 6),
                               (draft_config(truncated_copy(model, 8)), 64)]:
        engine = Engine(model, num_blocks=num_blocks, block_size=4, speculative_config=config)
        assert [o.output_token_ids for o in engine.generate(batch, SamplingParams(max_tokens=8))] == ref
        assert engine.spec_stats.num_drafts > 0
        if num_blocks == 6:
            assert engine.scheduler.num_preemptions > 0


# --- the rejection sampler is a seam: Engine(rejection_sampler=...) ------------------------------------
def reject_everything(draft_token_ids, cu_num_draft_tokens, draft_probs, target_probs, bonus_token_ids,
                      is_greedy, generators):
    """A sampler that accepts no draft: each request emits the target's argmax at its first draft's row."""
    out = torch.full((len(cu_num_draft_tokens), 2), PLACEHOLDER_TOKEN_ID, dtype=torch.long)
    starts = [0] + cu_num_draft_tokens[:-1].tolist()
    out[:, 0] = target_probs[starts].argmax(-1)
    return out


def test_a_sampler_of_ones_own_plugs_in_and_runs_every_verify_step(tiny, workload):
    prompts, ref = workload
    calls = []

    def counting(*args):
        calls.append(len(args[1]))
        return rejection_sample(*args)

    engine = Engine(tiny, num_blocks=128, block_size=4, max_num_seqs=6, speculative_config=NGRAM,
                    rejection_sampler=counting)
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=NEW))] == ref
    assert calls and sum(calls) == engine.spec_stats.num_drafts  # one call a step, all drafting requests
    # accepting nothing is still lossless for greedy decoding: every token is the target's own
    engine = Engine(tiny, num_blocks=128, block_size=4, max_num_seqs=6, speculative_config=NGRAM,
                    rejection_sampler=reject_everything)
    assert [o.output_token_ids for o in engine.generate(prompts, SamplingParams(max_tokens=NEW))] == ref
    assert engine.spec_stats.num_accepted_tokens == 0 and engine.spec_stats.num_drafts > 0


def test_a_sampler_that_returns_tokens_not_drafted_is_refused(tiny):

    def invents(draft_token_ids, cu_num_draft_tokens, *rest):
        out = rejection_sample(draft_token_ids, cu_num_draft_tokens, *rest)
        out[:, 0] = (draft_token_ids[0] + 1) % 128  # "accepts" a token that was never drafted
        out[:, 1] = 5
        return out

    engine = Engine(tiny, num_blocks=128, block_size=4, speculative_config=NGRAM, rejection_sampler=invents)
    with pytest.raises(ValueError, match="the rejection sampler returned .* expected the accepted drafts"):
        engine.generate([[1, 2, 3, 1, 2, 3, 1, 2]], SamplingParams(max_tokens=NEW))
