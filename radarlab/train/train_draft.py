"""Train the draft head on cached target features (python -m radarlab.train.train_draft).

Each training row is a chunk of library source with the target's features f_t and greedy tokens y_t
(radarlab.train.draft_data). The head is trained the way it is used, several draft steps deep
("training-time test", as in HASS and EAGLE-3): pass 1 reads the target's true features, pass p > 1
reads the head's own output of pass p - 1 one position back, and attends to what a real draft would
have in its cache at that step: pass-1 keys up to the last verified position, then one key of each
later pass. Every pass is scored on the target's greedy token (cross-entropy over a draft vocabulary
of the most frequent greedy tokens, through the frozen LM head) plus a smooth-L1 pull towards the
target's true next feature. Each pass is one call of the head (its draft_forward), whose attention
(UnrolledAttention) keeps the earlier passes' K/V and applies that mask; train takes the loss as an
argument (notebook 09's exercise writes a two-pass one, ttt_loss's).
"""
from __future__ import annotations

import argparse
import functools
import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from radarlab.attention.metadata import AttentionMetadata
from radarlab.spec_decode.draft_head import DraftHead, draft_config, draft_forward, save_head
from radarlab.util import require_int


def draft_vocabulary(greedy: torch.Tensor, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent greedy tokens, sorted by id: the rows of the LM head the head ranks."""
    require_int("size", size, maximum=vocab_size)
    counts = torch.bincount(greedy.reshape(-1).long(), minlength=vocab_size)
    return counts.topk(size).indices.sort().values


def unroll_mask(length: int, passes: int, device=None) -> torch.Tensor:
    """[passes, length, passes * length] bool: which keys query i of pass p sees. Pass-1 keys at
    positions j <= i - p + 1 (the verified prefix), and from each later pass m <= p only the key at
    i - p + m (the draft's own earlier steps in this chain)."""
    i = torch.arange(length, device=device)[:, None]
    j = torch.arange(length, device=device)[None, :]
    mask = torch.zeros(passes, length, passes * length, dtype=torch.bool, device=device)
    for p in range(1, passes + 1):
        mask[p - 1, :, :length] = j <= i - p + 1
        for m in range(2, p + 1):
            mask[p - 1, :, (m - 1) * length:m * length] = j == i - p + m
    return mask


class UnrolledAttention:
    """The attention backend of the unrolled training forward: the head runs once per pass over B rows
    of L positions (packed [B*L]); the cache (a list) keeps every pass's K/V, and the queries of pass p
    attend to the keys of passes 1..p as mask[p - 1] allows ([passes, L, passes * L], unroll_mask's
    layout)."""

    def __init__(self, mask: torch.Tensor) -> None:
        if mask.dim() != 3 or mask.dtype != torch.bool or mask.shape[2] != mask.shape[0] * mask.shape[1]:
            raise ValueError(f"mask must be bool [passes, L, passes * L], got {mask.dtype} "
                             f"{tuple(mask.shape)}")
        self.mask = mask

    def is_built(self, meta: AttentionMetadata, kv_cache) -> bool:
        return meta.backend is self

    def forward(self, layer, q, k, v, meta: AttentionMetadata, kv_cache: list, scale: float):
        passes, length = self.mask.shape[:2]
        p = len(kv_cache)
        if p >= passes:
            raise ValueError(f"the mask has {passes} passes; this is pass {p + 1}")
        b = meta.num_seqs
        t, h, d = q.shape
        kv_cache.append((k, v))

        def rows(x):  # packed [B*L, heads, D] -> [B, H, L, D], the K/V heads repeated for GQA
            return x.view(b, length, x.shape[1], d).transpose(1, 2).repeat_interleave(h // x.shape[1], dim=1)

        keys = torch.cat([rows(k) for k, _ in kv_cache], 2)
        values = torch.cat([rows(v) for _, v in kv_cache], 2)
        mask = self.mask[p, :, :(p + 1) * length].to(q.device)
        out = F.scaled_dot_product_attention(rows(q), keys, values, attn_mask=mask, scale=scale)
        return out.transpose(1, 2).reshape(t, h, d)


def training_attention(batch: int, length: int, mask: torch.Tensor) -> tuple[list, AttentionMetadata]:
    """(cache, metadata) for the head's passes over `batch` rows of `length` positions: call
    head(embeds, features, positions, cache, meta) once per pass, with the same two; pass p's queries
    see the keys mask[p - 1] allows (UnrolledAttention)."""
    meta = AttentionMetadata.from_lens([length] * batch, [length] * batch, backend=UnrolledAttention(mask))
    return [], meta


def unrolled_forward(head: DraftHead, embeds: torch.Tensor, features: torch.Tensor,
                     passes: int) -> list[torch.Tensor]:
    """embeds, features [B, L, H] (token t+1, target feature f_t) -> one [B, L, H] output per pass.
    Pass p's output at i is the head's estimate of f_{i+1} after p - 1 steps on its own features.
    Each pass is one call of the head (its draft_forward), through UnrolledAttention."""
    b, length, hidden = embeds.shape
    cache, meta = training_attention(b, length, unroll_mask(length, passes, embeds.device))
    positions = torch.arange(length, device=embeds.device).repeat(b)
    outs = []
    feats = features
    for p in range(passes):
        if p:
            feats = torch.cat((features[:, :1], outs[-1][:, :-1]), dim=1)  # own output one step back
        g = head(embeds.reshape(-1, hidden), feats.reshape(-1, hidden), positions, cache, meta)
        outs.append(g.view(b, length, hidden))
    return outs


@torch.no_grad()
def linear_init(embed, data: dict, ridge: float, max_rows: int = 65536) -> torch.Tensor:
    """W [H, 2H] minimising |[e(x_{t+1}), f_t] W^T - f_{t+1}|^2 + ridge |W|^2 over the cached rows
    (at most max_rows positions): the linear predictor the head starts from."""
    tokens, feats = data["tokens"].long(), data["features"].float()
    x = torch.cat((embed(tokens[:, 1:]), feats[:, :-1]), dim=-1).reshape(-1, 2 * feats.shape[-1])[:max_rows]
    y = feats[:, 1:].reshape(-1, feats.shape[-1])[:max_rows]
    gram = x.T @ x
    gram += ridge * gram.diagonal().mean() * torch.eye(gram.shape[0])
    return torch.linalg.solve(gram, x.T @ y).T


def draft_step_loss(g: torch.Tensor, labels: torch.Tensor, target_feat: torch.Tensor, lm_rows: torch.Tensor,
                    reg_weight: float) -> tuple[torch.Tensor, float]:
    """(loss, greedy accuracy) of one draft step's outputs g [B, n, H]: cross-entropy of its guesses
    g @ lm_rows.T (the frozen LM head's rows of the draft vocabulary) against labels [B, n] (rows of
    lm_rows; -100 outside the draft vocabulary, ignored), plus reg_weight x the smooth-L1 distance
    from g to the target's true next features target_feat [B, n, H]."""
    logits = g @ lm_rows.T
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    reg = F.smooth_l1_loss(g, target_feat)
    return ce + reg_weight * reg, float((logits.argmax(-1) == labels).float().mean())


def unrolled_loss(head, embed, lm_rows, batch, vocab_index: torch.Tensor, reg_weight: float, passes: int = 3):
    """(loss, per-pass greedy accuracy). batch: tokens, features, greedy [B, L]. Position i of a row
    reads (f_i, token i+1) and is scored on greedy token i+1 and feature f_{i+1}; pass p is scored
    only where a chain of p steps fits (i >= p - 1), weighted 0.8^(p-1). lm_rows: the LM head's rows
    of the draft vocabulary; vocab_index: target id -> row (-100 outside it)."""
    tokens, feats, greedy = batch["tokens"].long(), batch["features"].float(), batch["greedy"].long()
    with torch.no_grad():
        embeds = embed(tokens[:, 1:])
    outs = unrolled_forward(head, embeds, feats[:, :-1], passes)
    target_feat = feats[:, 1:]
    labels = vocab_index[greedy[:, 1:]]  # -100 where the token is outside the draft vocabulary
    loss, accs = 0.0, []
    for p, g in enumerate(outs):
        step_loss, acc = draft_step_loss(g[:, p:], labels[:, p:], target_feat[:, p:], lm_rows, reg_weight)
        loss = loss + step_loss * (0.8 ** p)
        accs.append(acc)
    return loss, accs


def ttt_loss(head, embed, lm_rows, batch, vocab_index: torch.Tensor, reg_weight: float) -> torch.Tensor:
    """The two-step training-time-test loss alone (unrolled_loss over two passes): notebook 09's
    exercise, and a loss_fn for train."""
    return unrolled_loss(head, embed, lm_rows, batch, vocab_index, reg_weight, passes=2)[0]


def init_head(model, data: dict, intermediate_size: int | None = None, ridge: float = 1e-2, seed: int = 0,
              draft_forward=draft_forward) -> DraftHead:
    """A fresh head that starts as the best linear map [embedding of token t+1, f_t] -> f_{t+1} (least
    squares over the cached rows), its layer's two output projections zeroed so that it passes fc's
    output through unchanged: training then learns what the linear map cannot."""
    torch.manual_seed(seed)
    head = DraftHead(draft_config(model.config, intermediate_size), draft_forward)
    with torch.no_grad():
        head.fc.weight.copy_(linear_init(model.embed_tokens, data, ridge))
        head.layer.self_attn.o_proj.weight.zero_()
        head.layer.mlp.down_proj.weight.zero_()
    return head


def train(data, model, out: Path | None, *, steps: int, batch_rows: int = 8, passes: int = 3,
          vocab_size: int = 8192, lr: float = 1e-3, reg_weight: float = 0.1, seed: int = 0,
          time_limit_s: float | None = None, log=print, log_every: int = 25, hf_config: dict | None = None,
          intermediate_size: int | None = None, vocab: torch.Tensor | None = None,
          reload_every: int = 100, ridge: float = 1e-2, save_every: int = 25, head: DraftHead | None = None,
          loss_fn=None) -> dict:
    """Train a head on the cached rows; checkpoint to `out` (fp16; None: no files) as it goes. Returns a
    summary.

    data: the cached rows (a dict), or a function returning them, called again every reload_every
    steps (training can start while the cache is still growing). vocab: the draft vocabulary, else
    the vocab_size most frequent greedy tokens of the first data. The learning rate follows a cosine
    over the steps, or over time_limit_s if that ends sooner. head: trained in place (default: a fresh
    one, init_head). loss_fn(head, embed, lm_rows, batch, vocab_index, reg_weight) -> loss, or (loss,
    per-pass accuracy): default unrolled_loss over `passes` passes (notebook 09's exercise plugs in
    here)."""
    log = log or (lambda *_: None)
    load = data if callable(data) else (lambda: data)
    data = load()
    if head is None:
        head = init_head(model, data, intermediate_size, ridge, seed)
    cfg = head.config
    loss_fn = loss_fn or functools.partial(unrolled_loss, passes=passes)
    if vocab is None:
        vocab = draft_vocabulary(data["greedy"], vocab_size, cfg.vocab_size)
    vocab_index = torch.full((cfg.vocab_size,), -100, dtype=torch.long)
    vocab_index[vocab] = torch.arange(vocab.numel())
    coverage = float((vocab_index[data["greedy"].long()] >= 0).float().mean())
    lm_rows = model.lm_head.weight.detach()[vocab].float()
    embed = model.embed_tokens
    rows = data["tokens"].shape[0]
    log(f"{rows} rows x {data['tokens'].shape[1]} tokens; draft vocabulary {vocab.numel()} covers "
        f"{coverage:.1%} of greedy tokens")
    opt = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
    warmup = min(50, steps // 10 + 1)
    start = time.perf_counter()

    def progress(s: int) -> float:
        done = s / steps
        if time_limit_s:
            done = max(done, (time.perf_counter() - start) / time_limit_s)
        return min(1.0, done)

    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: min(1.0, (s + 1) / warmup) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * progress(s)))))
    gen = torch.Generator().manual_seed(seed)

    def save(h):
        if out is not None:
            save_head(h, out, hf_config or {}, vocab)

    history = []
    step = 0
    for step in range(1, steps + 1):
        try:
            if step % reload_every == 0:
                data = load()
                if data["tokens"].shape[0] != rows:
                    rows = data["tokens"].shape[0]
                    coverage = float((vocab_index[data["greedy"].long()] >= 0).float().mean())
                    log(f"now {rows} rows; draft vocabulary covers {coverage:.1%} of greedy tokens")
            idx = torch.randint(rows, (batch_rows,), generator=gen)
            batch = {k: v[idx] for k, v in data.items()}
            loss = loss_fn(head, embed, lm_rows, batch, vocab_index, reg_weight)
            loss, accs = loss if isinstance(loss, tuple) else (loss, [])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
        except KeyboardInterrupt:  # Ctrl-C (SIGINT): keep what was learnt so far
            save(head)
            log(f"interrupted at step {step}" + ("; saved" if out is not None else ""))
            step -= 1
            break
        history.append((float(loss.detach()), accs))
        if step % log_every == 0 or step == steps:
            recent = history[-log_every:]
            mean_acc = [sum(a[p] for _, a in recent) / len(recent) for p in range(len(accs))]
            log(f"step {step}/{steps} loss {sum(l for l, _ in recent) / len(recent):.3f} "
                + (f"acc per pass {[round(a, 3) for a in mean_acc]} " if accs else "")
                + f"{time.perf_counter() - start:.0f} s")
        if step % save_every == 0 or step == steps:
            save(head)
        if time_limit_s is not None and time.perf_counter() - start > time_limit_s:
            save(head)
            log(f"time limit reached at step {step}")
            break
    summary = {"steps": step, "rows": rows, "seq_len": int(data["tokens"].shape[1]), "batch_rows": batch_rows,
               "passes": passes, "draft_vocab": int(vocab.numel()), "vocab_coverage": coverage, "lr": lr,
               "reg_weight": reg_weight, "train_seconds": round(time.perf_counter() - start, 1),
               "final_loss": history[-1][0], "first_loss": history[0][0]}
    return summary


def plot_training(doc: dict):
    """A Figure of a kept training log (results/draft-training.json, notebook 09): the loss, and each draft
    step's teacher-forced agreement with the target's greedy token, against the step."""
    import matplotlib.pyplot as plt

    log = doc["log"]
    steps = [r["step"] for r in log]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.6))
    ax1.plot(steps, [r["loss"] for r in log], marker=".")
    ax1.set(xlabel="training step", ylabel="loss (mean over the last steps)", title="Training loss")
    for p in range(len(log[0]["acc_per_pass"])):
        ax2.plot(steps, [r["acc_per_pass"][p] for r in log], marker=".", label=f"draft step {p + 1}")
    ax2.set(xlabel="training step", ylabel="agreement with the target's greedy token",
            title="Teacher-forced agreement on training rows")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig


def format_training_summary(doc: dict) -> str:
    """One sentence on a kept training run: its length, its data, how often each row was seen, its loss."""
    s = doc["summary"]
    return (f"trained for {s['steps']} steps ({s['train_seconds'] / 60:.0f} min) on "
            f"{s['rows']} rows of {s['seq_len']} tokens ({s['rows'] * s['seq_len']:,} tokens, each row seen "
            f"{s['steps'] * s['batch_rows'] / s['rows']:.1f} times), {s['batch_rows']} rows a step, "
            f"{s['passes']} draft steps deep, on {doc['machine']}; loss "
            f"{s['first_loss']:.2f} -> {s['final_loss']:.2f}")


def main(argv=None) -> None:
    from radarlab.models.llama import Llama
    from radarlab.models.loader import resolve_model
    from radarlab.train.draft_data import load_shards

    ap = argparse.ArgumentParser(description="Train the EAGLE-style draft head on cached target features")
    ap.add_argument("--features", required=True,
                    help="directory of shard_*.pt (python -m radarlab.train.draft_data)")
    ap.add_argument("--out", required=True, help="directory for the head (vLLM EAGLE layout)")
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--batch-rows", type=int, default=8)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-shards", type=int, default=None)
    ap.add_argument("--time-limit", type=float, default=None, help="seconds")
    ap.add_argument("--intermediate-size", type=int, default=None,
                    help="the head's MLP width (default: the target's)")
    ap.add_argument("--log-every", type=int, default=25)
    args = ap.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model, tokenizer = Llama.from_pretrained()
    for p in model.parameters():
        p.requires_grad_(False)
    from radarlab.train.draft_data import split_files, token_chunks

    # the draft vocabulary: the most frequent tokens of the whole training text (the greedy tokens
    # follow them closely, and the text is cheap to count while the feature cache is still growing)
    corpus = token_chunks(tokenizer, split_files()[0], 256)
    vocab = draft_vocabulary(corpus, args.vocab, model.config.vocab_size)
    hf_config = json.loads((Path(resolve_model(None)) / "config.json").read_text())
    summary = train(lambda: load_shards(args.features, args.max_shards), model, Path(args.out),
                    steps=args.steps, batch_rows=args.batch_rows, passes=args.passes,
                    vocab_size=args.vocab, lr=args.lr, time_limit_s=args.time_limit, hf_config=hf_config,
                    log_every=args.log_every, intermediate_size=args.intermediate_size, vocab=vocab)
    (Path(args.out) / "training.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
