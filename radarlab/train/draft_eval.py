"""Measure a draft where it is used: greedy speculative generation with the target verifying
(python -m radarlab.train.draft_eval --head DIR --json PATH).

Prompts are held-out standard-library files (radarlab.train.draft_data's split). For each k, every
prompt is generated with real speculative decoding, all prompts packed in one batch:

1. the proposer drafts up to k tokens. A method is a chain of sources tried in order, the first with
   a guess drafting: "draft" (the head: catch up on the positions the target verified last step,
   with the target's true features, then k - 1 steps on its own features), "ngram" (prompt lookup),
   "table" (radarlab.train.token_table); e.g. "ngram+draft";
2. the target runs once over [last token, drafts] on its contiguous cache;
3. the longest prefix of drafts equal to the target's greedy tokens is accepted, plus the target's
   own next token (the bonus); rejected positions are overwritten by the next step.

The output must equal plain greedy decoding token for token; the run counts any difference.
The command runs the target for real once (n-gram drafts, k = 6, which yields the greedy
continuations) and replays every table row against those continuations and their prefill features
(speculative_generate's `reference`): the same drafts and counts as with the target verifying (a
test checks this), at the cost of the draft alone.
Reported as vLLM names them: drafts, draft tokens, accepted per position, mean acceptance length,
tokens per verify step (accepted + bonus; every verify step counts, with or without a draft); and
the draft's cost per token against the target's. First-token acceptance is over steps with a draft.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from radarlab.attention.metadata import AttentionMetadata
from radarlab.kvcache.contiguous import ContiguousKVCache
from radarlab.models.llama import final_features
from radarlab.spec_decode.draft_head import DraftHead, draft_chain, load_head
from radarlab.spec_decode.ngram import ngram_draft
from radarlab.train.draft_data import split_files, target_features_batch, token_chunks
from radarlab.train.token_table import TokenTable
from radarlab.util import require_int

NGRAM_MIN, NGRAM_MAX = 2, 4  # prompt_lookup_min and prompt_lookup_max of the n-gram source

SOURCES = ("ngram", "table", "draft")  # prompt lookup, the token table, the draft head
METHODS = ("draft", "ngram", "table", "ngram+draft", "ngram+table")


def parse_method(method: str) -> list[str]:
    """'ngram+draft' -> ['ngram', 'draft']: sources tried in order, the first with a guess drafts."""
    sources = method.split("+")
    if not sources or any(s not in SOURCES for s in sources) or len(set(sources)) != len(sources):
        raise ValueError(f"method must be sources from {SOURCES} joined by '+', each once; got {method!r}")
    return sources


def eval_prompts(tokenizer, num_prompts: int = 16, prompt_len: int = 256) -> list[list[int]]:
    """num_prompts windows of prompt_len tokens from held-out files (the largest ones), each taken a
    third of the way into its file, where code rather than the module docstring is."""
    _, held = split_files()
    encoded = [tokenizer(p.read_text(encoding="utf-8", errors="replace"),
                         add_special_tokens=False)["input_ids"]
               for p in held]
    encoded = sorted((ids for ids in encoded if len(ids) >= 3 * prompt_len), key=len, reverse=True)
    if len(encoded) < num_prompts:
        raise ValueError(f"only {len(encoded)} held-out files have {3 * prompt_len} "
                         f"tokens; asked for {num_prompts}")
    return [ids[len(ids) // 3:len(ids) // 3 + prompt_len] for ids in encoded[:num_prompts]]


def ngram_lookup(tokens: list[int], k: int) -> list[int]:
    """The n-gram source of the evaluator: prompt lookup (radarlab.spec_decode.ngram) with n from 4 down to
    2."""
    return ngram_draft(tokens, NGRAM_MIN, NGRAM_MAX, k)


class HeadDrafter:
    """The draft head over a batch of sequences, with its own one-layer contiguous cache.
    rows: the head's output rows of the LM head (the draft vocabulary, or all of it) and their ids.
    The drafting loop is draft_head.draft_chain, the one the engine's EagleProposer runs: what this
    module measures is what the engine drafts."""

    def __init__(self, head: DraftHead, target, num_seqs: int, max_len: int,
                 vocab: torch.Tensor | None) -> None:
        self.head, self.target = head, target
        self.cache = ContiguousKVCache.for_model(head.config, num_seqs, max_len)
        weight = target.lm_head.weight
        self.vocab = vocab if vocab is not None else torch.arange(weight.shape[0])
        self.rows = weight[self.vocab].contiguous()
        self.done = [0] * num_seqs  # positions of each sequence the cache holds from true features

    def propose(self, seqs: list[int], tokens: list[list[int]], feats: list[torch.Tensor],
                ks: list[int]) -> list[list[int]]:
        """For sequence s: catch up on positions done[s] .. len(feats[s]) - 1 (true features f_i and
        tokens i+1), then draft ks[s] tokens, steps 2.. reading the head's own output (draft_chain)."""
        q_lens = [len(feats[s]) - self.done[s] for s in seqs]
        meta = AttentionMetadata.from_lens(q_lens, [len(feats[s]) for s in seqs],
                                           cache_rows=torch.tensor(seqs))
        f_in = torch.cat([feats[s][self.done[s]:] for s in seqs])
        ids = torch.tensor([t for s in seqs for t in tokens[s][self.done[s] + 1:len(feats[s]) + 1]])
        for s in seqs:
            self.done[s] = len(feats[s])
        lens = [len(feats[s]) for s in seqs]

        def next_step(live: list[int], _tokens: list[int]):
            for i in live:
                lens[i] += 1
            rows = [seqs[i] for i in live]
            return AttentionMetadata.from_lens([1] * len(live), [lens[i] for i in live],
                                               cache_rows=torch.tensor(rows)), live

        return draft_chain(self.head, self.target.embed_tokens, self.rows, self.cache, (ids, f_in, meta), ks,
                           lambda logits, live: self.vocab[logits.argmax(-1)].tolist(), next_step)


@torch.inference_mode()
def speculative_generate(target, prompts: list[list[int]], max_new_tokens: int, k: int, method: str,
                         head: DraftHead | None = None, vocab: torch.Tensor | None = None,
                         reference: tuple[list[list[int]], list[torch.Tensor]] | None = None,
                         table: TokenTable | None = None) -> dict:
    """Greedy speculative generation of every prompt in one batch; the outputs and vLLM-style counters.

    reference: (prompt + greedy continuation, the target's features at those positions) per prompt.
    Given it, verification reads the target's answer from it instead of running the target: greedy
    verification is lossless, so the target's token at every verified position is the plain greedy
    one and its feature is the one a prefill of the continuation computes. The drafts, acceptances
    and counters are those of the real run, at the cost of the draft alone."""
    sources = parse_method(method)
    require_int("k", k)
    if "draft" in sources and head is None:
        raise ValueError(f"method {method!r} needs a draft head")
    if "table" in sources and table is None:
        raise ValueError(f"method {method!r} needs a token table")
    n = len(prompts)
    max_len = max(map(len, prompts)) + max_new_tokens + k + 1
    cache = None if reference else ContiguousKVCache.for_model(target.config, n, max_len)
    drafter = HeadDrafter(head, target, n, max_len, vocab) if "draft" in sources else None
    lm = target.lm_head
    # prefill: features of every prompt position; the first new token is the target's own
    if reference:
        ref_tokens, ref_feats = reference
        feats = [ref_feats[i][:len(p)] for i, p in enumerate(prompts)]
        tokens = [list(ref_tokens[i][:len(p) + 1]) for i, p in enumerate(prompts)]
    else:
        meta = AttentionMetadata.from_lens([len(p) for p in prompts], [len(p) for p in prompts],
                                           cache_rows=torch.arange(n))
        f = final_features(target, torch.tensor([t for p in prompts for t in p]), meta.positions, cache, meta)
        bounds = meta.query_start_loc.tolist()
        feats = [f[bounds[i]:bounds[i + 1]] for i in range(n)]
        tokens = [list(p) + [int(lm(feats[i][-1]).argmax())] for i, p in enumerate(prompts)]
    accepted = [0] * k
    drafts = draft_tokens = verify_steps = 0
    used = dict.fromkeys(sources, 0)
    used_accepted = dict.fromkeys(sources, 0)  # drafts per source whose first token was accepted
    draft_time = 0.0
    active = [i for i in range(n) if max_new_tokens > 1]
    while active:
        ks = [min(k, max_new_tokens - (len(tokens[i]) - len(prompts[i])) - 1) for i in active]
        t0 = time.perf_counter()
        proposals: list[list[int]] = [[] for _ in active]
        origin: list[str | None] = [None] * len(active)
        for src in sources:
            want = [0 if p else kk for p, kk in zip(proposals, ks)]
            if src == "draft":  # the head reads every verified position, drafting or not: its cache
                out = drafter.propose(active, tokens, feats, want)  # must stay complete
            else:
                lookup = ngram_lookup if src == "ngram" else table.propose
                out = [lookup(tokens[i], kk) if kk else [] for i, kk in zip(active, want)]
            for j, d in enumerate(out):
                if d and not proposals[j]:
                    proposals[j], origin[j] = d, src
                    used[src] += 1
        draft_time += time.perf_counter() - t0
        # verify: [last token, drafts] for every active sequence, in one packed target forward
        q_lens = [1 + len(p) for p in proposals]
        seq_lens = [len(feats[i]) + q for i, q in zip(active, q_lens)]
        meta = AttentionMetadata.from_lens(q_lens, seq_lens, cache_rows=torch.tensor(active))
        if reference:
            spans = [(len(feats[i]), len(feats[i]) + q) for i, q in zip(active, q_lens)]
            fv = torch.cat([ref_feats[i][lo:hi] for i, (lo, hi) in zip(active, spans)])
            greedy = [t for i, (lo, hi) in zip(active, spans) for t in ref_tokens[i][lo + 1:hi + 1]]
        else:
            ids = torch.tensor([t for i, p in zip(active, proposals) for t in [tokens[i][-1]] + p])
            fv = final_features(target, ids, meta.positions, cache, meta)
            greedy = lm(fv).argmax(-1).tolist()
        verify_steps += len(active)
        bounds = meta.query_start_loc.tolist()
        still = []
        for j, (i, p) in enumerate(zip(active, proposals)):
            lo = bounds[j]
            a = 0
            while a < len(p) and p[a] == greedy[lo + a]:
                a += 1
            if p:
                drafts += 1
                draft_tokens += len(p)
                for pos in range(a):
                    accepted[pos] += 1
                used_accepted[origin[j]] += a > 0
            feats[i] = torch.cat((feats[i], fv[lo:lo + a + 1]))
            tokens[i] += p[:a] + [greedy[lo + a]]
            if len(tokens[i]) - len(prompts[i]) < max_new_tokens:
                still.append(i)
        active = still
    outputs = [t[len(p):len(p) + max_new_tokens] for t, p in zip(tokens, prompts)]
    total_accepted = sum(accepted)
    return {
        "outputs": outputs,
        "num_drafts": drafts,
        "num_draft_tokens": draft_tokens,
        "num_accepted_tokens_per_pos": accepted,
        "verify_steps": verify_steps,
        "first_token_acceptance": accepted[0] / drafts if drafts else 0.0,
        "mean_acceptance_length": 1 + total_accepted / drafts if drafts else 1.0,
        # the first new token comes from the prefill, every later one from a verify step
        "tokens_per_verify_step": (sum(map(len, outputs)) - n) / verify_steps if verify_steps else 0.0,
        "drafts_by_source": used,
        "first_accepted_by_source": used_accepted,
        "draft_seconds": draft_time,
    }


@torch.inference_mode()
def draft_cost(target, head: DraftHead, vocab_rows: int, context: int = 384, reps: int = 10) -> dict:
    """The draft's cost per token against the target's, three ways: FLOPs (weights' multiply-adds,
    LM head included), bytes of weights read per decode step at batch 1 (fp16), and the measured time
    of one batch-1 decode step of each (ours, contiguous cache, median of reps)."""
    cfg = target.config
    target_params = sum(p.numel() for p in target.parameters())  # tied embedding: counted once, as LM head
    head_params = sum(p.numel() for p in head.parameters())
    flops = {"target": 2 * target_params, "draft": head.flops_per_token(vocab_rows)}
    bytes_ = {"target": 2 * target_params, "draft": 2 * (head_params + vocab_rows * cfg.hidden_size)}

    def timed(fn) -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return sorted(times)[len(times) // 2]

    tcache = ContiguousKVCache.for_model(cfg, 1, context + 1)
    dcache = ContiguousKVCache.for_model(head.config, 1, context + 1)
    meta = AttentionMetadata.from_lens([1], [context + 1], cache_rows=torch.tensor([0]))
    tok = torch.tensor([1])
    rows = target.lm_head.weight[:vocab_rows].contiguous()
    feat = torch.randn(1, cfg.hidden_size)
    t_target = timed(lambda: target.lm_head(final_features(target, tok, meta.positions, tcache,
                                                           meta)).argmax(-1))
    t_draft = timed(lambda: (head(target.embed_tokens(tok), feat, meta.positions, dcache,
                                  meta) @ rows.T).argmax(-1))
    return {"flops_per_token": flops, "weight_bytes_per_token": bytes_,
            "seconds_per_token": {"target": t_target, "draft": t_draft},
            "ratio_flops": flops["draft"] / flops["target"],
            "ratio_bytes": bytes_["draft"] / bytes_["target"],
            "ratio_time": t_draft / t_target, "draft_vocab_rows": vocab_rows, "context": context}


def target_reference(target, prompts: list[list[int]], max_new_tokens: int, path: str | None = None):
    """(reference for speculative_generate's replay, the real n-gram run's counters, tie flips).

    The continuations come from a real speculative run (n-gram drafts at k = 6, the target
    verifying), then one prefill of prompt + continuation gives the features at every position.
    tie_flips counts positions where that prefill's greedy token differs from the continuation
    (batched fp32 arithmetic rounding a near-tie the other way): the replay's premise is that it is 0.
    Cached in `path` if given: the target is the expensive part."""
    if path and Path(path).exists():
        saved = torch.load(path)
        if saved["prompts"] == prompts and saved["max_new_tokens"] == max_new_tokens:
            return (saved["tokens"], list(saved["features"])), saved["real"], saved["tie_flips"]
    t0 = time.perf_counter()
    real = speculative_generate(target, prompts, max_new_tokens, 6, "ngram")
    real.update(method="ngram", k=6, mode="target verifies", seconds=time.perf_counter() - t0)
    full = torch.tensor([p + o for p, o in zip(prompts, real.pop("outputs"))])
    feats, greedy = target_features_batch(target, full)
    tie_flips = int((greedy[:, len(prompts[0]) - 1:-1] != full[:, len(prompts[0]):]).sum())
    print(f"real n-gram run k=6: first {real['first_token_acceptance']:.3f} per-verify "
          f"{real['tokens_per_verify_step']:.2f} ({real['seconds']:.0f} s); prefill "
          f"disagrees on {tie_flips} tokens", flush=True)
    if path:
        torch.save({"prompts": prompts, "max_new_tokens": max_new_tokens, "tokens": full.tolist(),
                    "features": feats, "real": real, "tie_flips": tie_flips}, path)
    return (full.tolist(), list(feats)), real, tie_flips


def vllm_comparison(target, prompts, reference, head_dir, head, k: int, max_new_tokens: int) -> dict:
    """The same head in vLLM (method "eagle", which ranks the full vocabulary) against our replay with
    the full vocabulary, on the same prompts: outputs, drafts and accepted counts per position."""
    from radarlab.validate.vllm import run_vllm

    resp = run_vllm({"prompts": prompts, "max_tokens": max_new_tokens, "logprobs": 0, "ignore_eos": True,
                     "speculative_config": {"method": "eagle", "model": str(Path(head_dir).resolve()),
                                            "num_speculative_tokens": k}})
    ref = ([t for t in reference[0][:len(prompts)]], reference[1][:len(prompts)])
    ours = speculative_generate(target, prompts, max_new_tokens, k, "draft", head, None, ref)
    spec = {name: v for name, v in resp["metrics"].items() if "spec_decode" in name}
    outs = [o["token_ids"] for o in resp["outputs"]]
    row = {"k": k, "prompts": len(prompts), "vllm_metrics": spec, "vllm_generate_s": resp["generate_s"],
           "vllm_outputs_equal_ours": sum(o == r[len(p):] for o, r, p in zip(outs, ref[0], prompts)),
           "ours": {key: ours[key] for key in ("num_drafts", "num_draft_tokens",
                                               "num_accepted_tokens_per_pos",
                                               "first_token_acceptance", "tokens_per_verify_step")}}
    print(f"vLLM eagle k={k}: {spec}; outputs equal ours {row['vllm_outputs_equal_ours']}/{len(prompts)}; "
          f"ours {row['ours']}", flush=True)
    return row


def replay_rows(doc: dict) -> dict[tuple[str, int], dict]:
    """(method, k) -> the replayed row of a kept evaluation (results/draft_eval.json)."""
    return {(r["method"], r["k"]): r for r in doc["results"] if r.get("mode") == "replay"}


def format_replay_table(doc: dict, methods) -> str:
    """Notebook 09's table of a kept evaluation: per method and k, the first draft token's acceptance
    and the tokens each verify step emits, beside the theory for one acceptance rate a (the method's
    k = 1 run); then the draft's cost ratio."""
    from radarlab.spec_decode import theory

    rows = replay_rows(doc)
    ks = sorted({k for _, k in rows})
    a_of = {m: rows[m, 1]["first_token_acceptance"] for m in methods if (m, 1) in rows}
    lines = [f"{doc['prompts']} held-out prompts x {doc['max_new_tokens']} tokens; "
             f"outputs that differ from plain greedy: {sum(r['mismatched_outputs'] for r in rows.values())}",
             f"{'method':<12} {'k':>2} {'first accepted':>15} {'tokens/verify':>14} {'theory':>7}"]
    for m in methods:
        for k in ks:
            if (m, k) in rows:
                r = rows[m, k]
                lines.append(f"{m:<12} {k:>2} {r['first_token_acceptance']:>15.3f} "
                             f"{r['tokens_per_verify_step']:>14.2f} "
                             f"{theory.expected_tokens_per_step(a_of[m], k):>7.2f}")
    cost = doc["cost"]
    lines.append(f"draft cost ratio c: FLOPs {cost['ratio_flops']:.3f}, weight bytes "
                 f"{cost['ratio_bytes']:.3f}")
    return "\n".join(lines)


def format_vllm_comparison(doc: dict) -> str:
    """Notebook 09's lines on the head in vLLM (results/draft_vllm_eagle.json): outputs, accepted drafts
    per position and draft tokens, vLLM's beside ours."""
    v, ours = doc["vllm"], doc["ours"]
    metrics = v["metrics"]
    return "\n".join([
        doc["what"],
        f"outputs equal ours: {sum(v['outputs_equal_ours'])}/{len(v['outputs_equal_ours'])}",
        "accepted per position: vLLM "
        f"{[int(x) for x in metrics['vllm:spec_decode_num_accepted_tokens_per_pos']]}, ours "
        f"{ours['num_accepted_tokens_per_pos']}; draft tokens vLLM "
        f"{int(metrics['vllm:spec_decode_num_draft_tokens'])}, ours "
        f"{ours['num_draft_tokens']} ({doc['note']})",
    ])


def main(argv=None) -> None:
    from radarlab.lab.machine import environment
    from radarlab.models.llama import Llama

    ap = argparse.ArgumentParser(description="Greedy speculative generation with the draft "
                                             "head on held-out prompts")
    ap.add_argument("--head", default=None, help="directory written by radarlab.train.train_draft")
    ap.add_argument("--json", required=True, help="where to write the results")
    ap.add_argument("--ks", default="1,2,3,4,5,6")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--reference", default=None, help="file caching the target's continuations and features")
    ap.add_argument("--vllm", type=int, default=0, metavar="N",
                    help="also run vLLM's EAGLE method with this head on the first N prompts and compare")
    ap.add_argument("--vllm-k", type=int, default=4)
    ap.add_argument("--full-vocab", action="store_true",
                    help="rank all 49,152 tokens, not the draft vocabulary")
    args = ap.parse_args(argv)
    target, tokenizer = Llama.from_pretrained()
    head, vocab = load_head(args.head, target.config) if args.head else (None, None)
    if args.full_vocab:
        vocab = None
    prompts = eval_prompts(tokenizer, args.prompts, args.prompt_len)
    table = None
    if any("table" in parse_method(m) for m in args.methods.split(",")):
        table = TokenTable.build(token_chunks(tokenizer, split_files()[0], 256), target.config.vocab_size)
    reference, real, tie_flips = target_reference(target, prompts, args.max_new_tokens, args.reference)
    results = [real]
    for method in args.methods.split(","):
        for k in map(int, args.ks.split(",")):
            t0 = time.perf_counter()
            r = speculative_generate(target, prompts, args.max_new_tokens, k, method, head, vocab, reference,
                                     table)
            r["seconds"] = time.perf_counter() - t0
            r["mismatched_outputs"] = sum(o != ref[len(p):] for o, ref,
                                          p in zip(r.pop("outputs"), reference[0], prompts))
            r.update(method=method, k=k, mode="replay")
            results.append(r)
            print(f"{method:9s} k={k} first {r['first_token_acceptance']:.3f} per-verify "
                  f"{r['tokens_per_verify_step']:.2f} accepted/pos {r['num_accepted_tokens_per_pos']} "
                  f"drafts {r['num_drafts']} by source {r['drafts_by_source']} {r['seconds']:.0f} s",
                  flush=True)
    rows = vocab.numel() if vocab is not None else target.config.vocab_size
    cost = draft_cost(target, head, rows) if head is not None else None
    if cost:
        print(f"draft cost per token: flops {cost['ratio_flops']:.3f}, bytes {cost['ratio_bytes']:.3f}, "
              f"time {cost['ratio_time']:.3f}")
    vllm_rows = vllm_comparison(target, prompts[:args.vllm], reference, args.head, head, args.vllm_k,
                                args.max_new_tokens) if args.vllm and head is not None else None
    out = {"machine": environment(), "vllm": vllm_rows, "head": str(args.head), "prompts": args.prompts,
           "prompt_len": args.prompt_len,
           "max_new_tokens": args.max_new_tokens, "draft_vocab_rows": rows, "prefill_tie_flips": tie_flips,
           "results": results, "cost": cost}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
