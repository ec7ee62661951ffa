"""Exercise checkers, one module per notebook (nb03_paged_cache checks notebook 03's exercises).
Each runs a learner's function on cases with known answers and prints one line: a pass, or the first
counterexample in plain words. They return True or False so tests can use them.

Notebooks call them as `radarlab.checks.<checker>(...)`, so every checker is importable from here.
"""
from radarlab.checks.common import call_learner, learner_or_reference, verdict
from radarlab.checks.nb00_rms_norm import check_rms_norm
from radarlab.checks.nb01_kv_arithmetic import check_kv_bytes_per_token, check_max_streams
from radarlab.checks.nb02_contiguous_cache import check_contiguous_attention, check_reservation_utilisation
from radarlab.checks.nb03_paged_cache import (
    check_append_with_cow,
    check_block_pool,
    check_ref_count_allocator,
    check_slot_mapping,
)
from radarlab.checks.nb04_paged_attention import (
    check_online_softmax_update,
    check_paged_decode_kernel,
    check_reshape_and_cache,
    check_store_kv_kernel,
)
from radarlab.checks.nb05_batching import (
    check_latency_metrics,
    check_preemption_rule,
    check_schedule_token_budget,
    check_scheduler,
)
from radarlab.checks.nb06_fp8 import (
    check_decode_e4m3,
    check_decode_tile,
    check_dequant_tile,
    check_encode_e4m3,
    check_fp8_load,
    check_per_token_head_scale,
)
from radarlab.checks.nb07_int4 import (
    check_int4_bytes_per_token,
    check_kivi_key_dequant,
    check_kivi_keys,
    check_kivi_value_dequant,
    check_kivi_values,
    check_pack_nibbles,
    check_quantize_group,
    check_quantized_length,
    reference_int4_bytes_per_token,
    reference_quantize_group,
)
from radarlab.checks.nb08_speculative import (
    check_expected_tokens_per_step,
    check_ngram_draft,
    check_rejection_sample,
    check_verify_stochastic,
)
from radarlab.checks.nb09_draft_models import (
    check_acceptance_counts,
    check_draft_forward,
    check_draft_step_loss,
    check_first_costly_batch,
    check_ttt_loss,
    reference_acceptance_counts,
    reference_first_costly_batch,
)
from radarlab.checks.nb10_capstone import check_parallel_footprint

__all__ = [
    "call_learner",
    "learner_or_reference",
    "verdict",
    "check_rms_norm",
    "check_kv_bytes_per_token",
    "check_max_streams",
    "check_contiguous_attention",
    "check_reservation_utilisation",
    "check_slot_mapping",
    "check_ref_count_allocator",
    "check_append_with_cow",
    "check_block_pool",
    "check_reshape_and_cache",
    "check_store_kv_kernel",
    "check_online_softmax_update",
    "check_paged_decode_kernel",
    "check_schedule_token_budget",
    "check_preemption_rule",
    "check_latency_metrics",
    "check_scheduler",
    "check_decode_e4m3",
    "check_encode_e4m3",
    "check_per_token_head_scale",
    "check_decode_tile",
    "check_dequant_tile",
    "check_fp8_load",
    "check_pack_nibbles",
    "reference_quantize_group",
    "check_quantize_group",
    "reference_int4_bytes_per_token",
    "check_int4_bytes_per_token",
    "check_kivi_keys",
    "check_kivi_values",
    "check_kivi_key_dequant",
    "check_kivi_value_dequant",
    "check_quantized_length",
    "check_expected_tokens_per_step",
    "check_verify_stochastic",
    "check_ngram_draft",
    "check_rejection_sample",
    "reference_acceptance_counts",
    "check_draft_forward",
    "check_draft_step_loss",
    "check_ttt_loss",
    "check_acceptance_counts",
    "reference_first_costly_batch",
    "check_first_costly_batch",
    "check_parallel_footprint",
]
