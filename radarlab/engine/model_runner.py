"""The model runner: one SchedulerOutput in, one forward pass, the logits rows out.

It plays vLLM's GPUModelRunner (vllm/v1/worker/gpu_model_runner.py): execute_model reads only the
scheduler's output (the requests' tokens and drafts, num_computed_tokens, num_scheduled_tokens and
block ids; never the block manager), copies the copy-on-write blocks, builds the step's inputs once
(radarlab.models.input_batch.prepare_inputs: ids, positions, slot mapping, block tables, logits
rows and, for a verify step, SpecDecodeMetadata), and runs the model on the pool: a replay of the
step captured once (radarlab.models.replay) where the configuration allows, as vLLM replays a CUDA
graph or runs its compiled model, else the model's forward.

vLLM samples inside execute_model too; here the engine samples from the returned logits, so that
the notebooks can show the rows a verify step produces.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from radarlab.engine.scheduler import SchedulerOutput
from radarlab.kvcache.paged_cache import PagedKVCache
from radarlab.models.input_batch import SpecDecodeMetadata, prepare_inputs, scheduled_token_ids
from radarlab.models.paged_runner import run_model
from radarlab.models.replay import ReplayedModel, replay_refusal


@dataclass
class ModelRunnerOutput:
    """logits [rows, vocab]: one row per request (its last scheduled token), or, when the step
    verifies drafts, 1 + k rows per request, located by spec_decode_metadata. features [T, hidden]:
    every scheduled token's normed last hidden state, packed (only when asked for)."""
    logits: torch.Tensor
    spec_decode_metadata: SpecDecodeMetadata | None = None
    features: torch.Tensor | None = None

    def last_row(self, b: int) -> int:
        """The row after request b's last scheduled token: what a request without drafts samples."""
        spec = self.spec_decode_metadata
        return b if spec is None else int(spec.bonus_logits_indices[b])


class ModelRunner:
    def __init__(self, model, cache: PagedKVCache, attn_backend=None, enforce_eager: bool = False) -> None:
        """attn_backend: the attention backend every layer runs (None: the one the cache's configuration
        picks, radarlab.attention.backends.get_attn_backend); one's own plugs in here.
        enforce_eager=False replays each step (radarlab.models.replay) where the configuration allows
        (replay_refusal says why not, in self.eager_reason); True always runs the model's forward."""
        self.model = model
        self.cache = cache
        self.attn_backend = attn_backend
        self.eager_reason = ("enforce_eager=True" if enforce_eager
                             else replay_refusal(model, cache, attn_backend))
        self.replay = None if self.eager_reason else ReplayedModel(model, cache)

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput, return_features: bool = False) -> ModelRunnerOutput:
        """Run the step the scheduler planned. The drafts verified are each request's spec_token_ids,
        as many as the scheduler kept (num_spec_tokens)."""
        self.cache.copy_blocks(sched.copy_pairs)  # before this step writes into the copies
        drafts = [r.spec_token_ids[:k] for r, k in zip(sched.requests, sched.num_spec_tokens)]
        token_ids = [scheduled_token_ids(r, done, n, d) for r, done, n, d
                     in zip(sched.requests, sched.num_computed_tokens, sched.num_scheduled_tokens, drafts)]
        inputs = prepare_inputs(self.cache, token_ids, sched.block_ids, sched.num_computed_tokens,
                                sched.num_scheduled_tokens, spec_token_ids=drafts,
                                seq_ids=[r.request_id for r in sched.requests], backend=self.attn_backend)
        if self.replay is not None and self.replay.ready():
            out = self.replay(inputs, return_features)
        else:
            out = run_model(self.model, self.cache, inputs, return_features)
        logits, features = out if return_features else (out, None)
        return ModelRunnerOutput(logits, inputs.spec_decode_metadata, features)
