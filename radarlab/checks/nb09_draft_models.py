"""Checkers of notebook 09 (draft models): the draft head's forward and its two-step training-time-test
loss (the main exercise), acceptance counts from a verify log, the first costly batch."""
from __future__ import annotations

from radarlab.checks.common import call_learner, first_tensor_difference, verdict

# draft_forward and ttt_loss are checked against radarlab's own: draft_head.draft_forward and
# train_draft.ttt_loss (unrolled_loss over two passes).


# --- the draft head: its forward, and the loss it trains on -----------------------------------------

def _tiny_head(draft_forward=None, seed: int = 9):
    """A random one-layer head of a small GQA config (32 wide, 4 query heads on 2 K/V heads), the same
    weights for every seed-sharing call; the global random state is left as it was."""
    import torch

    from radarlab.models.llama import LlamaConfig
    from radarlab.spec_decode.draft_head import DraftHead, draft_forward as reference

    draft_forward = draft_forward or reference

    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=8)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        head = DraftHead(cfg, draft_forward)
        with torch.no_grad():
            head.layer.post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return head


def _forward_cases():
    """(description, steps): each step is (token_embeds, features, positions, metadata) of one call; a
    case's steps share one cache (None: no cache, causal attention within each packed sequence)."""
    import torch

    from radarlab.attention.metadata import AttentionMetadata
    from radarlab.train.draft_data import causal_batch

    gen = torch.Generator().manual_seed(9)

    def rand(t):
        return torch.randn(t, 32, generator=gen)

    rows = torch.tensor([0, 1])
    return [
        ("two sequences of 5 tokens packed, no cache", None,
         [(rand(10), rand(10), torch.arange(5).repeat(2), causal_batch(2, 5))]),
        ("two sequences prefilled with 6 tokens into a cache, then 2 more tokens each (positions 6 and 7)",
         "contiguous",
         [(rand(12), rand(12), torch.arange(6).repeat(2),
           AttentionMetadata.from_lens([6, 6], [6, 6], cache_rows=rows)),
          (rand(4), rand(4), torch.tensor([6, 7, 6, 7]),
           AttentionMetadata.from_lens([2, 2], [8, 8], cache_rows=rows))]),
    ]


def _run_forward(fn, head, cache_kind, steps):
    """fn's outputs over a case's steps, on a fresh cache of the case's kind."""
    import torch

    from radarlab.kvcache.contiguous import ContiguousKVCache

    cache = ContiguousKVCache.for_model(head.config, 2, 16) if cache_kind else None
    with torch.no_grad():
        return [fn(head, e, f, pos, cache, meta) for e, f, pos, meta in steps]


def _forward_mistakes():
    """(what it does, a forward with that mistake): plausible wrong answers, named when they match."""
    import torch

    def layer(head, x, positions, cache, meta):
        cos, sin = head.rope(positions, x.dtype)
        return head.layer(x, cos, sin, cache, meta)

    def fused(head, e, f):
        return head.fc(torch.cat((e, f), dim=-1))

    def unit_rms(x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)

    return [
        ("fc's input was [feature, token embedding]; it is [token embedding, feature], in that order "
         "(the order the head was trained with, and vLLM's EAGLE concatenates)",
         lambda h, e, f, pos, c, m: layer(h, h.fc(torch.cat((f, e), dim=-1)), pos, c, m)),
        ("RoPE rotated each token by its index in the packed batch; rotate it by `positions`, its "
         "place in its own sequence (the new tokens of a cached sequence sit after its context)",
         lambda h, e, f, pos, c, m: layer(h, fused(h, e, f), torch.arange(len(pos)), c, m)),
        ("fc's output was added to the layer's output; head.layer already adds its residual (it returns "
         "x + attention + MLP), so that counts x twice",
         lambda h, e, f, pos, c, m: fused(h, e, f) + layer(h, fused(h, e, f), pos, c, m)),
        ("fc's output went through an RMS norm before the layer; EAGLE's head leaves the fused input "
         "unnormed (the layer's input_layernorm is NoNorm)",
         lambda h, e, f, pos, c, m: layer(h, unit_rms(fused(h, e, f)), pos, c, m)),
        ("fc's output went through the post-attention norm before the layer; EAGLE's head leaves the "
         "fused input unnormed (the layer's input_layernorm is NoNorm)",
         lambda h, e, f, pos, c, m: layer(h, h.layer.post_attention_layernorm(fused(h, e, f)), pos, c, m)),
    ]


def _close(got, want) -> bool:
    return all(first_tensor_difference(g, w, atol=1e-5, rtol=1e-4) is None for g, w in zip(got, want))


def check_draft_forward(draft_forward) -> bool:
    """Check a learner's draft_forward(head, token_embeds, features, positions, kv_cache, meta): fc over
    [embedding, feature], RoPE at `positions`, the head's decoder layer; on packed sequences without a
    cache and on a cached continuation, as the engine calls it."""
    from radarlab.spec_decode.draft_head import draft_forward as reference

    name = "draft_forward"
    head = _tiny_head()
    for description, cache_kind, steps in _forward_cases():
        want = _run_forward(reference, head, cache_kind, steps)
        got, problem = call_learner(lambda: _run_forward(draft_forward, head, cache_kind, steps), description)
        if problem:
            return verdict(name, problem)
        for step, (g, w) in enumerate(zip(got, want)):
            diff = first_tensor_difference(g, w, atol=1e-5, rtol=1e-4)
            if diff is None:
                continue
            where = f"for {description}" + (f", call {step + 1}" if len(steps) > 1 else "")
            hint = next((what for what, wrong in _forward_mistakes()
                         if _close(got, _run_forward(wrong, head, cache_kind, steps))), None)
            return verdict(name, f"{where}: {hint}" if hint else f"{where}, it returned {diff}")
    return verdict(name, None)


def _ttt_batch(rows: int, length: int, seed: int):
    """(batch of cached rows as draft_data stores them, embedding, LM head rows of the draft vocabulary,
    vocab_index): random, with a third of the greedy tokens outside the draft vocabulary."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    vocab = torch.randperm(96, generator=gen)[:64].sort().values
    vocab_index = torch.full((96,), -100, dtype=torch.long)
    vocab_index[vocab] = torch.arange(64)
    embed = torch.nn.Embedding(96, 32)
    with torch.no_grad():
        embed.weight.copy_(torch.randn(96, 32, generator=gen))
    batch = {"tokens": torch.randint(96, (rows, length + 1), generator=gen).int(),
             "features": torch.randn(rows, length + 1, 32, generator=gen).half(),
             "greedy": torch.randint(96, (rows, length + 1), generator=gen).int()}
    return batch, embed, torch.randn(64, 32, generator=gen) / 4, vocab_index


def _mask_problem(meta, length: int) -> str | None:
    """What is wrong with the attention mask the learner built, or None."""
    import torch

    from radarlab.train.train_draft import UnrolledAttention, unroll_mask

    if not isinstance(getattr(meta, "backend", None), UnrolledAttention):
        return "the head ran with metadata that training_attention(b, length, mask) did not make"
    mask, want = meta.backend.mask, unroll_mask(length, 2)
    if tuple(mask.shape) != tuple(want.shape):
        return f"the mask is {tuple(mask.shape)}; two passes over {length} positions take {tuple(want.shape)}"
    if not torch.equal(mask[0, :, :length], want[0, :, :length]):
        return "pass 1's mask (mask[0], first L columns) should be causal: position i sees pass-1 keys 0..i"
    if torch.equal(mask[1], want[1]):
        return None
    i = torch.arange(length)[:, None]
    j = torch.arange(length)[None, :]
    named = [  # (pass-1 keys, pass-2 keys) that pass 2's queries see, and what is wrong with it
        (j <= i, j <= i, "pass 2 attends to every earlier key of both passes; a real draft's second step "
                         "at i sees the verified prefix (pass-1 keys 0..i-1) and its own key at i, no more"),
        (j <= i, j == i, "pass 2 at i sees pass 1's key at i, computed from the true feature f_i: a draft "
                         "whose first guess at i is not yet verified does not have it (pass-1 keys 0..i-1)"),
        (j <= i - 1, j <= i, "pass 2 at i sees the pass-2 keys of earlier positions: those belong to "
                             "other drafts' second steps; its own chain left it only its key at i"),
    ]
    for first, second, what in named:
        if torch.equal(mask[1], torch.cat((first, second), dim=1)):
            return what
    row = min(3, length - 1)
    seen = mask[1, row].nonzero().flatten().tolist()
    return (f"pass 2's query at position {row} may see pass-1 keys {[k for k in seen if k < length]} and "
            f"pass-2 keys {[k - length for k in seen if k >= length]}; a real draft's second step sees "
            f"pass-1 keys 0..{row - 1} and the pass-2 key at {row}")


def _ttt_problem(calls, got, want, batch, lm_rows, vocab_index, reg_weight) -> str | None:
    """Why the learner's loss differs from the reference (read off what it fed the head), or None."""
    import torch

    from radarlab.train.train_draft import draft_step_loss

    feats = batch["features"].float()
    b, length, hidden = feats.shape[0], feats.shape[1] - 1, feats.shape[2]
    if not isinstance(got, torch.Tensor) or got.numel() != 1:
        return f"it returned {type(got).__name__}: return the loss alone, a one-element tensor"
    if len(calls) != 2:
        return (f"it called the head {len(calls)} time(s): training-time test runs it twice, pass 1 on "
                "the true features and pass 2 on pass 1's outputs (call it as head(...), or step(...))")
    (f1, cache1, meta1, out1), (f2, cache2, meta2, _) = calls
    if cache2 is not cache1:
        return ("pass 2 ran on a cache of its own: both passes take the one (cache, meta) from a single "
                "training_attention call, so that pass 2 attends to pass 1's keys")
    problem = _mask_problem(meta1, length)
    if problem:
        return problem
    f_in, o1, f2 = feats[:, :-1], out1.view(b, length, hidden), f2.view(b, length, hidden)
    if not torch.allclose(f1.view(b, length, hidden), f_in, atol=1e-5):
        return "pass 1 must read the target's true features f_i at position i (features[:, :-1])"
    if not torch.allclose(f2[:, 1:], o1[:, :-1], atol=1e-5):
        if torch.allclose(f2, f_in, atol=1e-5):
            return ("pass 2 read the target's true features again: that trains one step twice; a real "
                    "draft's second step reads the head's own first output (training-time test)")
        if torch.allclose(f2, o1, atol=1e-5):
            return ("pass 2 at position i read pass 1's output at i; a draft's second step at i reads "
                    "its first step's output, made at i - 1: shift by one (position 0 keeps f_0)")
        return "pass 2's feature at position i should be pass 1's output at position i - 1"
    got, want = float(got.detach()), float(want.detach())
    if abs(got - want) <= 1e-4 * max(1.0, abs(want)):
        return None
    o2 = calls[1][3].view(b, length, hidden)
    greedy, f_next = batch["greedy"].long(), feats[:, 1:]
    labels, early = vocab_index[greedy[:, 1:]], vocab_index[greedy[:, :-1]]

    def score(g, lab, feat):
        return float(draft_step_loss(g, lab, feat, lm_rows, reg_weight)[0])

    first = score(o1, labels, f_next)
    second = score(o2[:, 1:], labels[:, 1:], f_next[:, 1:])
    named = [
        (score(o1, early, f_next) + 0.8 * score(o2[:, 1:], early[:, 1:], f_next[:, 1:]),
         "the labels are one position early: position i's output estimates f_{i+1}, which the LM head "
         "reads to predict the target's greedy token at i + 1 (greedy[:, 1:])"),
        (first + 0.8 * score(o2, labels, f_next),
         "pass 2 was scored at position 0 too; a two-step chain first fits at position 1 (pass 1 at 0, "
         "pass 2 at 1), and its position 0 read no output of pass 1"),
        (first + 0.8 * score(o2[:, :-1], labels[:, 1:], f_next[:, 1:]),
         "pass 2's output at i was scored on the token at i + 2; it estimates f_{i+1}, like pass 1's at "
         "i (only the features it read differ): score it on greedy[:, 1:] at i"),
        (first + second, "the two passes were weighted alike; pass 2 counts 0.8 times pass 1"),
        (first, "only pass 1 was scored; the loss is pass 1's plus 0.8 x pass 2's"),
    ]
    hint = next((what for value, what in named if abs(got - value) <= 1e-4 * max(1.0, abs(value))), None)
    return hint or f"the loss is {got:.6g}, expected {want:.6g}"


def _step_loss_mistakes(g, labels, target_feat, lm_rows, reg_weight):
    """(what is wrong, the loss it gives) for plausible wrong scores of one draft step."""
    import torch.nn.functional as F

    logits = g @ lm_rows.T
    flat, lab = logits.reshape(-1, logits.shape[-1]), labels.reshape(-1)
    ce = F.cross_entropy(flat, lab, ignore_index=-100)
    reg = F.smooth_l1_loss(g, target_feat)
    return [
        ("the feature term is the mean squared error; the pull towards f_{t+1} is smooth-L1 "
         "(F.smooth_l1_loss), which an outlier feature cannot dominate",
         ce + reg_weight * F.mse_loss(g, target_feat)),
        ("the feature term is missing: reg_weight x smooth-L1 from g to the true next features",
         ce),
        ("reg_weight multiplies the cross-entropy; it weights the feature term: ce + reg_weight x smooth-L1",
         reg_weight * ce + reg),
        ("the smooth-L1 is summed; take its mean over every value (the default reduction), so that the "
         "weight does not grow with the batch and the hidden size", ce + reg_weight * F.smooth_l1_loss(
             g, target_feat, reduction="sum")),
        ("the cross-entropy was taken of probabilities: F.cross_entropy takes the logits g @ lm_rows.T and "
         "applies log-softmax itself",
         F.cross_entropy(flat.softmax(-1), lab, ignore_index=-100) + reg_weight * reg),
        ("the labels outside the draft vocabulary (-100) were counted; they carry no row to score and are "
         "left out of the mean (ignore_index=-100)",
         F.cross_entropy(flat, lab.clamp(min=0)) + reg_weight * reg),
    ]


def check_draft_step_loss(draft_step_loss) -> bool:
    """Check a learner's draft_step_loss(g, labels, target_feat, lm_rows, reg_weight) -> (loss, accuracy):
    cross-entropy of g @ lm_rows.T against labels (-100 ignored) plus reg_weight x smooth-L1 from g to
    target_feat, and the greedy accuracy; its value and gradient against radarlab's."""
    import torch

    from radarlab.train.train_draft import draft_step_loss as reference

    name = "draft_step_loss"
    gen = torch.Generator().manual_seed(21)
    cases = []
    for rows, n, reg_weight in ((2, 5, 0.1), (3, 4, 0.5), (1, 6, 0.0)):
        g = torch.randn(rows, n, 32, generator=gen)
        target = g + torch.randn(rows, n, 32, generator=gen) * 2  # some distances past smooth-L1's knee
        lm_rows = torch.randn(64, 32, generator=gen) / 4
        labels = torch.randint(64, (rows, n), generator=gen)
        labels[0, 1] = -100  # outside the draft vocabulary
        labels[-1, 0] = int((g[-1, 0] @ lm_rows.T).argmax())  # one greedy hit, for the accuracy
        cases.append((f"g of shape {(rows, n, 32)}, 64 draft rows, one label -100, reg_weight {reg_weight}",
                      g, labels, target, lm_rows, reg_weight))
    for description, g, labels, target, lm_rows, reg_weight in cases:
        want_loss, want_acc = reference(g, labels, target, lm_rows, reg_weight)
        mine = g.clone().requires_grad_(True)
        got, problem = call_learner(
            lambda: draft_step_loss(mine, labels.clone(), target, lm_rows, reg_weight), description)
        if problem:
            hint = (" (labels of -100 have no row: F.cross_entropy(..., ignore_index=-100) leaves them out)"
                    if "out of bounds" in problem or "index" in problem else "")
            return verdict(name, problem + hint)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            return verdict(name, f"for {description} it returned {type(got).__name__}; expected (loss, "
                                 "accuracy)")
        loss, acc = got
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            return verdict(name, f"for {description}, the loss is a {type(loss).__name__}: a one-element "
                                 "tensor")
        if abs(float(loss.detach()) - float(want_loss)) > 1e-5 * max(1.0, abs(float(want_loss))):
            value = float(loss.detach())
            hint = next((what for what, wrong in _step_loss_mistakes(g, labels, target, lm_rows, reg_weight)
                         if abs(value - float(wrong)) <= 1e-5 * max(1.0, abs(float(wrong)))), None)
            return verdict(name, f"for {description}: " + (hint or f"the loss is {value:.6g}, expected "
                                                                     f"{float(want_loss):.6g}"))
        if not loss.requires_grad:
            return verdict(name, f"for {description}, the loss carries no gradient (detached, or under "
                                 "torch.no_grad): training could not move the head")
        grad, = torch.autograd.grad(loss, mine)
        check = g.clone().requires_grad_(True)
        want_grad, = torch.autograd.grad(reference(check, labels, target, lm_rows, reg_weight)[0], check)
        if not torch.allclose(grad, want_grad, atol=1e-6, rtol=1e-4):
            return verdict(name, f"for {description}, the loss is right but its gradient in g is not")
        one_number = isinstance(acc, torch.Tensor) and acc.numel() == 1
        if one_number or isinstance(acc, int) and not isinstance(acc, bool):
            acc = float(acc)
        if not isinstance(acc, float) or abs(acc - want_acc) > 1e-6:
            hits = int(((g @ lm_rows.T).argmax(-1) == labels).sum())
            kept = int((labels != -100).sum())
            hint = (" (divide by every position, -100 ones included, as radarlab's training log does)"
                    if isinstance(acc, float) and kept and abs(acc - hits / kept) < 1e-6 else
                    " (the share of positions whose argmax over g @ lm_rows.T is the label)")
            return verdict(name, f"for {description}, the accuracy is {acc!r}, expected {want_acc:.6g}{hint}")
    return verdict(name, None)


def check_ttt_loss(ttt_loss) -> bool:
    """Check a learner's ttt_loss(head, embed, lm_rows, batch, vocab_index, reg_weight): two passes of
    the head (true features, then its own outputs one position back) under a real draft's attention
    mask, each scored on the target's greedy token over the draft vocabulary plus the feature loss,
    pass 2 weighted 0.8; its value and its gradient against radarlab's."""
    from radarlab.spec_decode.draft_head import draft_forward
    from radarlab.train.train_draft import ttt_loss as reference

    name = "ttt_loss"
    for rows, length, reg_weight, seed in ((3, 10, 0.1, 1), (2, 7, 0.5, 2)):
        description = f"{rows} rows of {length + 1} cached tokens, reg_weight {reg_weight}"
        batch, embed, lm_rows, vocab_index = _ttt_batch(rows, length, seed)
        calls = []

        def recording(head, token_embeds, features, positions, kv_cache, meta):
            out = draft_forward(head, token_embeds, features, positions, kv_cache, meta)
            calls.append((features.detach().clone(), kv_cache, meta, out.detach().clone()))
            return out

        head, mine = _tiny_head(), _tiny_head(recording)
        want = reference(head, embed, lm_rows, batch, vocab_index, reg_weight)
        got, problem = call_learner(lambda: ttt_loss(mine, embed, lm_rows, batch, vocab_index, reg_weight),
                                    description)
        if problem:
            hint = (" (labels are rows of lm_rows: map the greedy token ids through vocab_index)"
                    if "out of bounds" in problem else "")
            return verdict(name, problem + hint)
        problem = (_ttt_problem(calls, got, want, batch, lm_rows, vocab_index, reg_weight)
                   or _gradient_problem(got, want, mine, head))
        if problem:
            return verdict(name, f"for {description}: {problem}")
    return verdict(name, None)


def _gradient_problem(got, want, mine, head) -> str | None:
    import torch

    if not got.requires_grad:
        return ("the loss carries no gradient (computed under torch.no_grad, or detached): training "
                "could not move the head")
    got.backward()
    want.backward()
    for (n, p), q in zip(mine.named_parameters(), head.parameters()):
        if p.grad is None or not torch.allclose(p.grad, q.grad, atol=1e-6, rtol=1e-4):
            return (f"the loss is right but its gradient in {n} is not: pass 2 trains through pass 1's "
                    "outputs (do not .detach() them), as a real draft's errors compound through both steps")
    return None


# --- acceptance_counts and first_costly_batch ------------------------------------------------------

# acceptance_counts (accepted drafts per position from a verify log) and first_costly_batch (the batch
# at which a verify step stops costing about one decode step, on the roofline).

def reference_acceptance_counts(verify_log, k: int) -> tuple[list[int], float]:
    """(accepted per position, tokens per verify step) from (drafted, accepted) pairs, one per verify
    step of one request, counted by the engine's own counters (radarlab.spec_decode.metrics)."""
    from radarlab.spec_decode.metrics import SpecDecodingStats

    stats = SpecDecodingStats(k)
    steps = emitted = 0
    for drafted, accepted in verify_log:
        if drafted:
            stats.observe_draft(drafted, accepted)
        steps += 1
        emitted += accepted + 1  # the accepted drafts and the target's own token
    return stats.num_accepted_tokens_per_pos, emitted / steps if steps else float("nan")


def _verify_logs():
    import random

    rng = random.Random(9)
    hand = [(4, 4), (4, 0), (4, 2), (0, 0), (3, 1), (4, 3)]
    drafted = [rng.choice([0, 2, 5, 6, 6, 6]) for _ in range(300)]
    real_like = [(d, min(d, int(rng.expovariate(0.45)))) for d in drafted]
    return [("six verify steps with k = 4 (one without drafts, one with 3 drafts): "
             "[(4, 4), (4, 0), (4, 2), (0, 0), (3, 1), (4, 3)]", hand, 4),
            ("300 random verify steps with k = 6", real_like, 6),
            ("an empty log with k = 3", [], 3)]


def check_acceptance_counts(acceptance_counts) -> bool:
    """Check a learner's acceptance_counts(verify_log, k) -> (accepted_per_pos, tokens_per_verify_step):
    accepted_per_pos[i] counts the steps whose draft i was accepted (all drafts before it were too);
    tokens per verify step counts the accepted drafts plus the target's own token, over every step."""
    import math

    name = "acceptance_counts"
    for description, log, k in _verify_logs():
        want_pos, want_tps = reference_acceptance_counts(log, k)
        got, problem = call_learner(lambda: acceptance_counts(list(log), k), description)
        if problem:
            return verdict(name, problem)
        if not (isinstance(got, tuple) and len(got) == 2):
            return verdict(name, f"for {description} it returned {got!r}, expected a pair "
                                 "(accepted_per_pos, tokens_per_verify_step)")
        pos, tps = got
        pos = list(pos) if not isinstance(pos, (str, bytes)) and hasattr(pos, "__iter__") else pos
        if pos != want_pos:
            exact = [sum(1 for _, a in log if a == i + 1) for i in range(k)]
            hint = (" (that counts the steps that accepted exactly i + 1 drafts; position i counts every "
                    "step that accepted at least i + 1)") if pos == exact else ""
            return verdict(name, f"for {description}, accepted_per_pos is {pos!r}, expected {want_pos}{hint}")
        if not isinstance(tps, (int, float)) or isinstance(tps, bool) or not (
                math.isclose(tps, want_tps, rel_tol=1e-9) or (math.isnan(want_tps) and math.isnan(tps))):
            steps, accepted = len(log), sum(a for _, a in log)
            drafting = sum(1 for d, _ in log if d)
            hints = {}
            if steps:
                hints[accepted / steps] = " (add the target's own token: every verify step emits one more)"
            if drafting:
                hints[(accepted + drafting) / drafting] = (" (steps without drafts are verify steps too, of "
                                                           "one token)")
            hint = next((h for v,
                         h in hints.items() if isinstance(tps, (int, float)) and math.isclose(tps, v)), "")
            if math.isnan(want_tps):
                hint = " (no steps: return float('nan'))"
            return verdict(name, f"for {description}, tokens per verify step is {tps!r}, expected "
                                 f"{want_tps:.4g}{hint}")
    return verdict(name, None)


def reference_first_costly_batch(dims, k: int, context: int, peak_flops: float, bandwidth: float,
                                 dtype: str = "bf16", tolerance: float = 1.1, largest: int = 4096):
    """The smallest batch at which a verify step (k + 1 tokens per sequence) takes more than tolerance
    times a decode step of the same batch on the roofline, or None up to `largest`."""
    from radarlab.lab.roofline import decode_step

    for batch in range(1, largest + 1):
        plain = decode_step(dims, batch, context, dtype, dtype).time_bound_s(peak_flops, bandwidth)
        verify = decode_step(dims, batch, context, dtype, dtype,
                             query_len=k + 1).time_bound_s(peak_flops, bandwidth)
        if verify > tolerance * plain:
            return batch
    return None


def check_first_costly_batch(first_costly_batch) -> bool:
    """Check a learner's first_costly_batch(dims, k, context, peak_flops, bandwidth, dtype, tolerance):
    the smallest batch whose verify step (each sequence's KV read once, k + 1 tokens of FLOPs) costs
    more than tolerance x a decode step of the same batch, on the roofline; None up to batch 4096."""
    from radarlab.lab.roofline import LLAMA_70B, TransformerDims, decode_step

    name = "first_costly_batch"
    course = TransformerDims(layers=30, hidden=576, intermediate=1536, heads=9, kv_heads=3, head_dim=64,
                             vocab=49152, tied_embeddings=True)
    cases = [  # (description, dims, k, context, peak FLOP/s, bandwidth B/s, dtype, tolerance)
        ("the course model in fp32, k = 4, context 256, on a CPU of 100 GFLOP/s and 20 GB/s",
         course, 4, 256, 100e9, 20e9, "fp32", 1.1),
        ("the 70B model in bf16, k = 3, context 1024, on an H100 (989 TFLOP/s, 3350 GB/s)",
         LLAMA_70B, 3, 1024, 989e12, 3350e9, "bf16", 1.1),
        ("the 70B model in bf16, k = 3, context 32768, on an H100", LLAMA_70B, 3, 32768, 989e12,
         3350e9, "bf16", 1.1),
        ("the course model in bf16, k = 6, context 128, on an RTX 4090 (165 TFLOP/s, 1008 GB/s), tolerance "
         "1.5",
         course, 6, 128, 165e12, 1008e9, "bf16", 1.5),
    ]
    for description, dims, k, context, peak, bw, dtype, tol in cases:
        want = reference_first_costly_batch(dims, k, context, peak, bw, dtype, tol)
        got, problem = call_learner(lambda: first_costly_batch(dims, k, context, peak, bw, dtype, tol),
                                    description)
        if problem:
            return verdict(name, problem)
        if got != want or isinstance(got, bool):
            ridge = peak / bw
            plain_bound = next((b for b in range(1, 4097) if decode_step(dims, b, context, dtype,
                                                                         dtype).intensity >= ridge), None)
            hint = ""
            if got == plain_bound:
                hint = (" (that is where a plain decode step turns compute-bound; a verify step does k + 1 "
                        "tokens of work per byte and turns sooner)")
            elif want is not None and got == want - 1:
                hint = (f" (batch {got} is the last whose verify step still costs at most {tol:g} x a decode "
                        "step: return the first that costs more)")
            return verdict(name, f"for {description} it returned {got!r}, expected {want!r}{hint}")
    return verdict(name, None)
