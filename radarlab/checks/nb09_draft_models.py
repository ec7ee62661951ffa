"""Checkers of notebook 09 (draft models): acceptance counts from a verify log, the first costly batch."""
from __future__ import annotations

from radarlab.checks.common import call_learner, verdict

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
