"""One step's inputs, built once (radarlab.models.input_batch), the slot formula's tensor home
(radarlab.kvcache.block_table), and the engine's ModelRunner.execute_model, which reads only the
scheduler's output."""
from __future__ import annotations

import pytest
import torch

from radarlab.engine.model_runner import ModelRunner
from radarlab.engine.request import Request
from radarlab.engine.scheduler import Scheduler
from radarlab.kvcache.block_table import block_table_tensor, compute_slot_mapping
from radarlab.kvcache.kv_cache_manager import KVCacheManager
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.kvcache.sequence import Sequence
from radarlab.models.input_batch import SpecDecodeMetadata, logits_indices, prepare_inputs
from radarlab.models.paged_runner import paged_step
from radarlab.sample.sampling_params import SamplingParams


def test_slot_mapping_matches_the_scheduler_side_formula():
    """compute_slot_mapping over the tensor equals KVCacheBlocks.slot, position by position, for
    scattered blocks, both for packed tokens and for [B, T] rows."""
    manager = KVCacheManager(12, 4, enable_prefix_caching=False)
    seqs = [Sequence("a", list(range(10))), Sequence("b", list(range(3))), Sequence("c", list(range(7)))]
    manager.allocate(seqs[1])
    manager.allocate(seqs[0])
    manager.free(seqs[1])  # a hole, so that blocks are not in order
    manager.allocate(seqs[2])
    table = block_table_tensor([manager.get_block_table(s) for s in seqs[::2]])
    assert table.shape == (2, 3) and table[1, 2] == -1  # a has 3 blocks, c 2: c's row is padded
    want = [manager.block_tables[s.seq_id].slot(p) for s in seqs[::2] for p in range(s.num_tokens)]
    req = torch.tensor([0] * 10 + [1] * 7)
    pos = torch.tensor(list(range(10)) + list(range(7)))
    assert compute_slot_mapping(table, pos, 4, req).tolist() == want
    rows = compute_slot_mapping(table[:1], torch.arange(10)[None], 4)
    assert rows.tolist() == [want[:10]]


def test_block_table_tensor_pads_and_cuts():
    t = block_table_tensor([[5, 2, 9], [7]], width=2)
    assert t.dtype == torch.int32 and t.tolist() == [[5, 2], [7, -1]]
    assert block_table_tensor([[3], []], pad=0).tolist() == [[3], [0]]


def test_spec_decode_metadata_rows():
    """Three requests with 2, 0 and 3 drafts: rows 0-2 are the first's (targets 0, 1; bonus 2), row
    3 the second's one sample, rows 4-7 the third's (targets 4-6; bonus 7), as vLLM lays them out."""
    spec = SpecDecodeMetadata.make([[11, 12], [], [21, 22, 23]])
    assert spec.num_draft_tokens == [2, 0, 3]
    assert spec.cu_num_draft_tokens.tolist() == [2, 2, 5]
    assert spec.draft_token_ids.tolist() == [11, 12, 21, 22, 23]
    assert spec.target_logits_indices.tolist() == [0, 1, 4, 5, 6]
    assert spec.bonus_logits_indices.tolist() == [2, 3, 7]
    assert [spec.rows(b) for b in range(3)] == [slice(0, 3), slice(3, 4), slice(4, 8)]


def test_logits_indices():
    qsl = torch.tensor([0, 3, 4, 8])
    assert logits_indices(qsl).tolist() == [2, 3, 7]
    assert logits_indices(qsl, [3, 1, 4]).tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    with pytest.raises(ValueError, match="num_logits must be in 1..1"):
        logits_indices(qsl, [1, 2, 1])
    with pytest.raises(ValueError, match="3 entries for 2 sequences|2 entries for 3"):
        logits_indices(qsl, [1, 1])


def test_prepare_inputs_refuses_bad_steps(tiny):
    cache = PagedKVCache.for_model(tiny.config, 8, 4)
    with pytest.raises(ValueError, match="tokens 2..5 are scheduled but only 4 have slots"):
        prepare_inputs(cache, [[1, 2, 3, 4]], [[0]], [2], [4])
    with pytest.raises(ValueError, match="3 tokens scheduled from position 0, but its tokens and drafts g"):
        prepare_inputs(cache, [[1, 2]], [[0]], [0], [3])
    with pytest.raises(ValueError, match="not both"):
        prepare_inputs(cache, [[1, 2]], [[0]], [0], [2], num_logits=[2], spec_token_ids=[[2]])


def _engine_parts(model, num_blocks=16, block_size=4):
    manager = KVCacheManager(num_blocks, block_size)
    cache = PagedKVCache.for_model(model.config, num_blocks, block_size)
    return Scheduler(manager, max_num_batched_tokens=64, max_model_len=64), cache


def test_execute_model_equals_paged_step_and_reads_no_manager(tiny):
    """A step with two decodes and a verify step with three drafts: execute_model's logits
    equal paged_step's over the same pool state, and its block ids are the scheduler's copies (the
    runner works with the manager gone)."""
    sched_a, cache_a = _engine_parts(tiny)
    sched_b, cache_b = _engine_parts(tiny)
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    prompts = [list(range(1, 12)), [5, 6, 7], [9, 8, 7, 6, 5]]
    for sched, cache in ((sched_a, cache_a), (sched_b, cache_b)):
        for i, p in enumerate(prompts):
            sched.add_request(Request(i, p, greedy, block_size=4))
        out = sched.schedule()  # the prefills
        ModelRunner(tiny, cache).execute_model(out)
        sched.update(out)
        for r in out.requests:
            r.append_token_ids([3])
        sched.requests[1].spec_token_ids = [4, 4, 2]  # drafts for request 1
    out_a = sched_a.schedule()
    assert out_a.num_spec_tokens == [0, 3, 0] and out_a.num_scheduled_tokens == [1, 4, 1]
    assert out_a.block_ids == [sched_a.manager.get_block_table(r) for r in out_a.requests]
    manager_a, sched_a.manager = sched_a.manager, None  # the runner must not need it
    got = ModelRunner(tiny, cache_a).execute_model(out_a, return_features=True)
    sched_a.manager = manager_a
    spec = got.spec_decode_metadata
    assert spec.target_logits_indices.tolist() == [1, 2, 3]
    assert spec.bonus_logits_indices.tolist() == [0, 4, 5]
    assert got.logits.shape == (6, tiny.config.vocab_size) and got.features.shape[0] == 6
    out_b = sched_b.schedule()
    reqs = out_b.requests
    want = paged_step(tiny, cache_b, sched_b.manager, reqs, out_b.num_computed_tokens,
                      out_b.num_scheduled_tokens, [1 + k for k in out_b.num_spec_tokens],
                      spec_token_ids=[r.spec_token_ids for r in reqs])
    torch.testing.assert_close(got.logits, want)
    assert [got.last_row(b) for b in range(3)] == [0, 4, 5]
