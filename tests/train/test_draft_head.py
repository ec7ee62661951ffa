"""The EAGLE-style draft head: layout, its training path against its drafting path, training, and
speculative generation with it (lossless), on the tiny random model; the committed weights on the
course model."""
from __future__ import annotations

import json

import pytest
import torch

from radarlab.models.generate import greedy_generate
from radarlab.spec_decode.draft_head import TRAINED_HEAD, DraftHead, draft_config, load_head, save_head
from radarlab.train.draft_data import causal_batch, target_features_batch
from radarlab.train.draft_eval import HeadDrafter, ngram_lookup, speculative_generate
from radarlab.train.token_table import TokenTable
from radarlab.train.train_draft import draft_vocabulary, train, unroll_mask, unrolled_forward

WEIGHTS = TRAINED_HEAD  # committed: a test that needs it fails, never skips, when it is missing


def tiny_hf_config(cfg) -> dict:
    return {"hidden_size": cfg.hidden_size, "vocab_size": cfg.vocab_size,
            "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "model_type": "llama"}


@pytest.fixture(scope="module")
def head(tiny):
    torch.manual_seed(1)
    return DraftHead(draft_config(tiny.config)).eval()


def test_head_owns_one_layer_and_fc(tiny, head):
    h = tiny.config.hidden_size
    assert head.fc.weight.shape == (h, 2 * h)
    assert head.config.num_layers == 1
    names = set(head.state_dict())
    assert "layer.input_layernorm.weight" not in names and "layer.post_attention_layernorm.weight" in names
    with pytest.raises(ValueError, match="token_embeds"):
        head(torch.zeros(3, h), torch.zeros(2, h), torch.arange(3), None, causal_batch(1, 3))


def test_save_load_round_trip_in_vllm_layout(tiny, head, tmp_path):
    vocab = torch.tensor([3, 5, 7])
    save_head(head, tmp_path, tiny_hf_config(tiny.config), vocab, dtype=torch.float32)
    from safetensors.torch import load_file

    keys = set(load_file(str(tmp_path / "model.safetensors")))
    assert "fc.weight" in keys and "layers.0.self_attn.q_proj.weight" in keys
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 1
    loaded, v = load_head(tmp_path, tiny.config)
    assert torch.equal(v, vocab)
    for (n1, p1), (n2, p2) in zip(head.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_load_rejects_another_vocabulary(tiny, head, tmp_path):
    cfg = tiny_hf_config(tiny.config)
    cfg["vocab_size"] = 99
    save_head(head, tmp_path, cfg)
    with pytest.raises(ValueError, match="vocab_size=99"):
        load_head(tmp_path, tiny.config)


def test_unroll_mask_is_what_a_draft_cache_holds():
    m = unroll_mask(5, 3)
    assert torch.equal(m[0, :, :5], torch.ones(5, 5).tril().bool())
    # pass 2 at position 3: verified keys 0..2 and its own key
    assert m[1, 3].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3]
    # pass 3 at position 4: verified 0..2, pass-2 key at 3, own key at 4
    assert m[2, 4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]


def test_training_path_equals_drafting_path(tiny, head):
    """Pass p of the unrolled training forward at position i is exactly the p-th draft a real drafter
    makes after the target verified positions 0..i-p+1."""
    torch.manual_seed(2)
    ids = torch.randint(0, 128, (1, 12))
    feats, _ = target_features_batch(tiny, ids)
    with torch.no_grad():
        outs = unrolled_forward(head, tiny.embed_tokens(ids[:, 1:]), feats[:, :-1], passes=3)
    rows = tiny.lm_head.weight
    for verified in (4, 7):  # features known for positions 0..verified-1
        drafter = HeadDrafter(head, tiny, 1, 32, None)
        tokens = [ids[0, :verified + 1].tolist()]
        drafts = drafter.propose([0], tokens, [feats[0, :verified]], [3])[0]
        for p, d in enumerate(drafts):
            g = outs[p][0, verified - 1 + p]
            assert d == int((g @ rows.T).argmax()), (verified, p)
            if p < 2:  # later steps read the head's own tokens; the unrolled pass reads the text's
                break


def test_draft_vocabulary_takes_the_most_frequent():
    greedy = torch.tensor([5, 5, 5, 2, 2, 9])
    assert draft_vocabulary(greedy, 2, 16).tolist() == [2, 5]
    with pytest.raises(ValueError, match="size"):
        draft_vocabulary(greedy, 17, 16)


def test_training_reduces_loss(tiny, tmp_path):
    torch.manual_seed(3)
    # a learnable signal: text that repeats a short pattern, so the next token follows from the last
    ids = torch.tensor([[(7 * i + r) % 20 for i in range(48)] for r in range(8)])
    feats, greedy = target_features_batch(tiny, ids)
    data = {"tokens": ids.int(), "features": feats.half(), "greedy": greedy.int()}
    summary = train(data, tiny, tmp_path, steps=60, batch_rows=4, passes=2, vocab_size=64, lr=3e-3,
                    log=None, hf_config=tiny_hf_config(tiny.config))
    assert summary["final_loss"] < 0.7 * summary["first_loss"]
    assert (tmp_path / "model.safetensors").exists()


def test_training_takes_a_head_and_a_loss_of_ones_own(tiny):
    """Notebook 09's minute of training: a given head trained in place with a given loss, no files."""
    from radarlab.train.train_draft import ttt_loss

    torch.manual_seed(3)
    ids = torch.tensor([[(7 * i + r) % 20 for i in range(32)] for r in range(8)])
    feats, greedy = target_features_batch(tiny, ids)
    data = {"tokens": ids.int(), "features": feats.half(), "greedy": greedy.int()}
    head = DraftHead(draft_config(tiny.config))
    before = {n: p.detach().clone() for n, p in head.named_parameters()}
    losses = []

    def recorded(*args):
        loss = ttt_loss(*args)
        losses.append(float(loss.detach()))
        return loss

    summary = train(data, tiny, None, steps=30, batch_rows=4, passes=2, vocab_size=64, lr=3e-3, log=None,
                    head=head, loss_fn=recorded)
    assert len(losses) == 30 and summary["final_loss"] < summary["first_loss"]
    assert any(not torch.equal(p, before[n]) for n, p in head.named_parameters())


def test_ngram_lookup_uses_the_leftmost_longest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 2) == [9, 1]
    assert ngram_lookup([4, 5, 6, 7], 3) == []


@pytest.fixture(scope="module")
def table():
    torch.manual_seed(6)
    return TokenTable.build(torch.randint(0, 128, (8, 64)), 128, min_count=1)


def test_token_table_backs_off_to_shorter_contexts():
    rows = torch.tensor([[1, 2, 3, 4, 1, 2, 3, 4, 9, 2, 3, 5, 9, 2, 3, 5, 7, 7]])
    t = TokenTable.build(rows, 16, min_count=2)
    assert t.next_token([1, 2, 3]) == 4  # seen twice after 1 2 3
    assert t.next_token([9, 2, 3]) == 5
    assert t.next_token([8, 8, 3]) in (4, 5)  # backs off to "3": 4 and 5 tie twice each
    assert t.next_token([8, 8, 15]) is None  # never seen
    # "2 3 5" was followed by 9 and by 7 once each: ties go to the smaller id
    assert t.propose([9, 2, 3], 2) == [5, 7]
    with pytest.raises(ValueError, match="max_context"):
        TokenTable.build(rows, 16, max_context=4)


@pytest.mark.parametrize("method", ["draft", "ngram", "table", "ngram+draft", "ngram+table"])
def test_speculative_generation_is_lossless(tiny, head, table, method):
    torch.manual_seed(4)
    prompts = [torch.randint(0, 128, (n,)).tolist() + [1, 2, 3, 1, 2] for n in (5, 9, 14)]
    ref = greedy_generate(tiny, prompts, 20)
    r = speculative_generate(tiny, prompts, 20, 3, method, head, table=table)
    assert r["outputs"] == ref
    assert r["num_draft_tokens"] >= r["num_drafts"] > 0
    assert sum(r["num_accepted_tokens_per_pos"]) <= r["num_draft_tokens"]
    # every output token after the first came from a verify step
    assert r["tokens_per_verify_step"] * r["verify_steps"] == pytest.approx(3 * 19)


def test_committed_head_beats_copying_the_last_feature(model, tokenizer):
    """On held-out library code, the trained head predicts the target's next greedy token far more
    often than the untrained guess 'the next feature equals this one'."""
    from radarlab.train.draft_eval import eval_prompts

    head, vocab = load_head(WEIGHTS, model.config)
    ids = torch.tensor(eval_prompts(tokenizer, 2, 128))
    feats, greedy = target_features_batch(model, ids)
    with torch.no_grad():
        g = head(model.embed_tokens(ids[:, 1:].reshape(-1)), feats[:, :-1].reshape(-1, feats.shape[-1]),
                 torch.arange(127).repeat(2), None, causal_batch(2, 127))
    want = greedy[:, 1:].reshape(-1)
    trained = (model.lm_head(g).argmax(-1) == want).float().mean()
    copy = (model.lm_head(feats[:, :-1].reshape(-1, feats.shape[-1])).argmax(-1) == want).float().mean()
    assert trained > 0.3 and trained > copy + 0.2, (float(trained), float(copy))


def test_method_names_are_checked(tiny, head):
    with pytest.raises(ValueError, match="joined by"):
        speculative_generate(tiny, [[1, 2]], 4, 2, "ngram+eagle", head)
    with pytest.raises(ValueError, match="token table"):
        speculative_generate(tiny, [[1, 2]], 4, 2, "table", head)


@pytest.mark.parametrize("method", ["draft", "ngram+draft"])
def test_replay_gives_the_counters_of_the_real_run(tiny, head, method):
    """Verifying against the greedy continuation and its prefill features drafts and accepts exactly
    what the run with the target verifying does."""
    torch.manual_seed(5)
    prompts = [torch.randint(0, 128, (10,)).tolist() + [1, 2, 3, 1, 2] for _ in range(3)]
    real = speculative_generate(tiny, prompts, 16, 3, method, head)
    full = torch.tensor([p + o for p, o in zip(prompts, real["outputs"])])
    feats, _ = target_features_batch(tiny, full)
    replay = speculative_generate(tiny, prompts, 16, 3, method, head, reference=(full.tolist(), list(feats)))
    for key in ("outputs", "num_drafts", "num_draft_tokens", "num_accepted_tokens_per_pos", "verify_steps"):
        assert replay[key] == real[key], key


def test_linear_init_fits_a_linear_target(tiny):
    """If f_{t+1} is exactly a linear function of [e(x_{t+1}), f_t], the initial map recovers it."""
    from radarlab.train.train_draft import linear_init

    torch.manual_seed(7)
    h = tiny.config.hidden_size
    ids = torch.randint(0, 128, (6, 40))
    w = torch.randn(h, 2 * h) / 8
    feats = torch.zeros(6, 40, h)
    feats[:, 0] = torch.randn(6, h)
    with torch.no_grad():
        for t in range(39):
            feats[:, t + 1] = torch.cat((tiny.embed_tokens(ids[:, t + 1]), feats[:, t]), -1) @ w.T
    got = linear_init(tiny.embed_tokens, {"tokens": ids, "features": feats}, ridge=1e-9)
    assert torch.allclose(got, w, atol=1e-3)
