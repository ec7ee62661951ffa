"""The checkers of notebook 09: a reference passes, a stub and plausible mistakes get a plain
counterexample."""
from __future__ import annotations

import pytest
import torch

from radarlab.checks import (
    check_acceptance_counts,
    check_draft_forward,
    check_draft_step_loss,
    check_first_costly_batch,
    check_ttt_loss,
    reference_acceptance_counts,
    reference_first_costly_batch,
)
from radarlab.lab.roofline import decode_step
from radarlab.models.llama import RMSNorm
from radarlab.spec_decode.draft_head import draft_forward
from radarlab.train.train_draft import draft_step_loss, training_attention, ttt_loss

# --- draft_forward -------------------------------------------------------------------------------


def _forward_with(mistake):
    """The head's forward as a learner writes it, with one mistake (None: none)."""

    def forward(head, token_embeds, features, positions, kv_cache, meta):
        pair = (features, token_embeds) if mistake == "swapped" else (token_embeds, features)
        x = head.fc(torch.cat(pair, dim=-1))
        if mistake == "packed positions":
            positions = torch.arange(len(positions))
        if mistake == "unit norm":
            x = RMSNorm(x.shape[-1], 1e-5)(x)
        if mistake == "post-attention norm":
            x = head.layer.post_attention_layernorm(x)
        cos, sin = head.rope(positions, x.dtype)
        out = head.layer(x, cos, sin, kv_cache, meta)
        return out + x if mistake == "residual twice" else out

    return forward


@pytest.mark.parametrize("fn", [draft_forward, _forward_with(None)])
def test_forward_reference_and_hand_written_pass(verdict, fn):
    verdict(check_draft_forward, fn)


@pytest.mark.parametrize("mistake, words", [
    ("swapped", "it is [token embedding, feature], in that order"),
    ("packed positions", "its index in the packed batch"),
    ("residual twice", "head.layer already adds its residual"),
    ("unit norm", "went through an RMS norm before the layer"),
    ("post-attention norm", "went through the post-attention norm"),
])
def test_forward_mistakes_are_described(verdict, mistake, words):
    verdict(check_draft_forward, _forward_with(mistake), words)


# --- draft_step_loss ---------------------------------------------------------------------------------


def _step_loss_with(mistake):
    """One draft step's score as a learner writes it, with one mistake (None: none)."""
    import torch.nn.functional as F

    def step_loss(g, labels, target_feat, lm_rows, reg_weight):
        logits = g @ lm_rows.T
        flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
        if mistake == "probabilities":
            flat = flat.softmax(-1)
        if mistake == "gather":  # log-softmax by hand, -100 indexed
            ce = -flat.log_softmax(-1).gather(1, lab[:, None]).mean()
        else:
            ce = F.cross_entropy(flat, lab, ignore_index=-100)
        reg = {"mse": F.mse_loss(g, target_feat), "sum": F.smooth_l1_loss(g, target_feat, reduction="sum"),
               "none": torch.zeros(())}.get(mistake, F.smooth_l1_loss(g, target_feat))
        loss = reg_weight * ce + reg if mistake == "weight on ce" else ce + reg_weight * reg
        hits = (logits.argmax(-1) == labels).float()
        acc = hits.sum() / (labels != -100).sum() if mistake == "accuracy of kept" else hits.mean()
        if mistake == "detached":
            loss = loss.detach()
        return loss, float(acc)

    return step_loss


@pytest.mark.parametrize("fn", [draft_step_loss, _step_loss_with(None)])
def test_step_loss_reference_and_hand_written_pass(verdict, fn):
    verdict(check_draft_step_loss, fn)


@pytest.mark.parametrize("mistake, words", [
    ("mse", "is the mean squared error"),
    ("none", "the feature term is missing"),
    ("weight on ce", "reg_weight multiplies the cross-entropy"),
    ("sum", "the smooth-L1 is summed"),
    ("probabilities", "taken of probabilities"),
    ("gather", "ignore_index=-100"),
    ("detached", "carries no gradient"),
    ("accuracy of kept", "-100 ones included"),
])
def test_step_loss_mistakes_are_described(verdict, mistake, words):
    verdict(check_draft_step_loss, _step_loss_with(mistake), words)


def test_step_loss_stub_is_not_written(verdict):
    def stub(*args):
        raise NotImplementedError()

    verdict(check_draft_step_loss, stub, "not written yet")


# --- ttt_loss ------------------------------------------------------------------------------------


def _loss_with(mistake):
    """The two-step training-time-test loss as a learner writes it (notebook 09's solution), with one
    mistake (None: none)."""

    def loss_fn(head, embed, lm_rows, batch, vocab_index, reg_weight):
        tokens, feats, greedy = batch["tokens"].long(), batch["features"].float(), batch["greedy"].long()
        b, length, hidden = feats.shape[0], feats.shape[1] - 1, feats.shape[2]
        with torch.no_grad():
            embeds = embed(tokens[:, 1:]).reshape(-1, hidden)
        f_in, f_next = feats[:, :-1], feats[:, 1:]
        positions = torch.arange(length).repeat(b)

        def step(features, cache, meta):
            return head(embeds, features.reshape(-1, hidden), positions, cache, meta).view(b, length, hidden)

        i, j = torch.arange(length)[:, None], torch.arange(length)[None, :]
        seen_first = j <= i if mistake in ("causal mask", "own pass-1 key") else j <= i - 1
        seen_own = j <= i if mistake in ("causal mask", "earlier pass-2 keys") else j == i
        nothing = torch.zeros(length, length, dtype=torch.bool)  # pass 1 sees no pass-2 keys
        mask = torch.stack((torch.cat((j <= i, nothing), 1), torch.cat((seen_first, seen_own), 1)))
        cache, meta = training_attention(b, length, mask)
        g1 = step(f_in, cache, meta)
        labels = vocab_index[greedy[:, :-1] if mistake == "early labels" else greedy[:, 1:]]
        loss1, _ = draft_step_loss(g1, labels, f_next, lm_rows, reg_weight)
        if mistake == "one pass":
            return loss1
        if mistake == "own cache":
            cache, meta = training_attention(b, length, mask)
        own = {"true features": f_in, "unshifted": g1,
               "detached": torch.cat((f_in[:, :1], g1[:, :-1].detach()), 1)}.get(
            mistake, torch.cat((f_in[:, :1], g1[:, :-1]), 1))
        g2 = step(own, cache, meta)
        start = 0 if mistake == "pass 2 at 0" else 1
        loss2, _ = draft_step_loss(g2[:, start:], labels[:, start:], f_next[:, start:], lm_rows, reg_weight)
        return loss1 + (1.0 if mistake == "equal weights" else 0.8) * loss2

    if mistake == "no grad":
        return lambda *args: torch.no_grad()(_loss_with(None))(*args)
    return loss_fn


@pytest.mark.parametrize("fn", [ttt_loss, _loss_with(None)])
def test_loss_reference_and_hand_written_pass(verdict, fn):
    verdict(check_ttt_loss, fn)


@pytest.mark.parametrize("mistake, words", [
    ("true features", "pass 2 read the target's true features again"),
    ("unshifted", "shift by one"),
    ("causal mask", "pass 2 attends to every earlier key of both passes"),
    ("own pass-1 key", "pass 2 at i sees pass 1's key at i"),
    ("earlier pass-2 keys", "sees the pass-2 keys of earlier positions"),
    ("own cache", "pass 2 ran on a cache of its own"),
    ("one pass", "it called the head 1 time(s)"),
    ("early labels", "the labels are one position early"),
    ("pass 2 at 0", "pass 2 was scored at position 0 too"),
    ("equal weights", "pass 2 counts 0.8 times pass 1"),
    ("detached", "do not .detach() them"),
    ("no grad", "the loss carries no gradient"),
])
def test_loss_mistakes_are_described(verdict, mistake, words):
    verdict(check_ttt_loss, _loss_with(mistake), words)


def test_loss_labels_as_token_ids_get_a_hint(verdict):
    def ids_as_labels(head, embed, lm_rows, batch, vocab_index, reg_weight):
        return _loss_with(None)(head, embed, lm_rows, batch, torch.arange(len(vocab_index)), reg_weight)

    verdict(check_ttt_loss, ids_as_labels, "map the greedy token ids through vocab_index")


# --- acceptance_counts ---------------------------------------------------------------------------

def counts_by_hand(verify_log, k):
    per_pos = [0] * k
    for _, accepted in verify_log:
        for i in range(accepted):
            per_pos[i] += 1
    steps = len(verify_log)
    return per_pos, (sum(a for _, a in verify_log) + steps) / steps if steps else float("nan")


def _exactly(verify_log, k):  # a histogram of acceptance lengths, not positions
    per_pos = [sum(1 for _, a in verify_log if a == i + 1) for i in range(k)]
    return per_pos, counts_by_hand(verify_log, k)[1]


def _no_bonus(verify_log, k):
    per_pos, _ = counts_by_hand(verify_log, k)
    return per_pos, sum(a for _, a in verify_log) / len(verify_log) if verify_log else float("nan")


def _drafting_steps_only(verify_log, k):
    per_pos, _ = counts_by_hand(verify_log, k)
    drafting = [a for d, a in verify_log if d]
    return per_pos, (sum(drafting) + len(drafting)) / len(drafting) if drafting else float("nan")


@pytest.mark.parametrize("fn", [reference_acceptance_counts, counts_by_hand])
def test_acceptance_reference_and_hand_count_pass(verdict, fn):
    verdict(check_acceptance_counts, fn)


def test_acceptance_reference_values():
    per_pos, tps = reference_acceptance_counts([(4, 4), (4, 0), (4, 2), (0, 0), (3, 1)], 4)
    assert per_pos == [3, 2, 1, 1]
    assert tps == pytest.approx((7 + 5) / 5)


@pytest.mark.parametrize("fn, words", [
    (_exactly, "exactly i + 1"),
    (_no_bonus, "the target's own token"),
    (_drafting_steps_only, "steps without drafts"),
])
def test_acceptance_mistakes_are_described(verdict, fn, words):
    verdict(check_acceptance_counts, fn, words)


# --- first_costly_batch --------------------------------------------------------------------------

def costly_by_formula(dims, k, context, peak, bw, dtype, tolerance):
    for b in range(1, 4097):
        one = decode_step(dims, b, context, dtype, dtype)
        verify_s = max((k + 1) * one.flops / peak, one.bytes / bw)
        if verify_s > tolerance * one.time_bound_s(peak, bw):
            return b
    return None


def _kv_per_token(dims, k, context, peak, bw, dtype, tolerance):  # reads each sequence's KV k + 1 times
    for b in range(1, 4097):
        plain = decode_step(dims, b, context, dtype, dtype).time_bound_s(peak, bw)
        if decode_step(dims, b * (k + 1), context, dtype, dtype).time_bound_s(peak, bw) > tolerance * plain:
            return b
    return None


def _decode_ridge(dims, k, context, peak, bw, dtype, tolerance):  # where plain decode turns compute-bound
    return next((b for b in range(1, 4097) if decode_step(dims, b, context, dtype,
                                                          dtype).intensity >= peak / bw), None)


def _last_cheap_batch(dims, k, context, peak, bw, dtype, tolerance):  # off by one: the batch before it
    first = costly_by_formula(dims, k, context, peak, bw, dtype, tolerance)
    return None if first is None else first - 1


@pytest.mark.parametrize("fn", [reference_first_costly_batch, costly_by_formula])
def test_costly_reference_and_formula_pass(verdict, fn):
    verdict(check_first_costly_batch, fn)


@pytest.mark.parametrize("fn, words", [
    (_kv_per_token, "expected 3"),
    (_decode_ridge, "plain decode step turns compute-bound"),
    (_last_cheap_batch, "it returned 2, expected 3 (batch 2 is the last whose verify step still costs at "
                        "most 1.1 x a decode step: return the first that costs more)"),
])
def test_costly_mistakes_are_described(verdict, fn, words):
    verdict(check_first_costly_batch, fn, words)
