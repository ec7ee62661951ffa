"""The replayed step (radarlab.models.replay): the same logits as Llama.forward, bit for bit, on every
kind of step (chunked prefill, decode, speculative verify, features), on both matmul paths a CPU kind
picks; captured again when a weight changes; out of the way of hooks; refused, with the reason, for
the configurations it does not cover."""
from __future__ import annotations

import copy

import pytest
import torch

from radarlab.engine import Engine, SamplingParams
from radarlab.engine.model_runner import ModelRunner
from radarlab.models import linear
from radarlab.models.paged_runner import run_model
from radarlab.models.replay import ReplayedModel, replay_refusal

from cpu_ops_build import built_or_fail, needs_compiler

pytestmark = needs_compiler
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.fixture(autouse=True)
def cpu_ops():
    return built_or_fail()


class Compared:
    """Each replayed step also runs Llama.forward on the same inputs first; records both results."""

    def __init__(self, runner: ModelRunner) -> None:
        self.replay, self.steps = runner.replay, []
        runner.replay = self

    def ready(self) -> bool:
        return self.replay.ready()

    def __call__(self, inputs, return_features=False):
        eager = run_model(self.replay.model, self.replay.cache, inputs, return_features)
        got = self.replay(inputs, return_features)
        self.steps.append((inputs, eager, got))
        return got


def _prompts(n: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    base = [torch.randint(0, vocab, (8,), generator=g).tolist() for _ in range(n)]
    return [(b * 5)[:10 + 9 * i] for i, b in enumerate(base)]  # repeats, so that n-gram drafts exist


def _same(a, b) -> bool:
    if isinstance(a, tuple):
        return all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


@pytest.mark.parametrize("cpu", ["this CPU", "avx512", "avx2", "GenuineIntel", "AuthenticAMD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", [None, NGRAM])
def test_replay_equals_forward_bit_for_bit(tiny, dtype, cpu, spec, monkeypatch):
    """Prefill in chunks beside decodes, then decode (with n-gram verify steps), then one request
    alone: every step's logits equal the eager forward's exactly. bf16 as each CPU kind runs it:
    "avx2" (no oneDNN bf16 GEMM: F.linear, upcast from 16 rows), "avx512" (no bf16 instructions:
    packed bf16 below 64 rows, the path chosen per call); fp32 as each vendor runs it: "GenuineIntel"
    (F.linear below 4 rows, packed from 4), "AuthenticAMD" (packed); "this CPU" whatever this machine
    has."""
    if cpu in ("GenuineIntel", "AuthenticAMD"):
        monkeypatch.setattr(linear, "mkl_gemv_rows", lambda: linear.gemv_rows_for(cpu))
    elif cpu != "this CPU":
        if cpu == "avx512" and not linear.onednn_bf16():
            pytest.skip("oneDNN has no bf16 GEMM on this CPU to run the AVX-512 path with")
        monkeypatch.setattr(linear, "cpu_has_native_half", lambda: False)
        monkeypatch.setattr(linear, "onednn_bf16", lambda: cpu == "avx512")
    model = copy.deepcopy(tiny).to(dtype)
    engine = Engine(model, num_blocks=64, block_size=8, max_num_seqs=4, max_num_batched_tokens=24,
                    speculative_config=spec)
    assert engine.runner.eager_reason is None  # the default replays on every CPU kind
    compared = Compared(engine.runner)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    out = engine.generate(_prompts(4, model.config.vocab_size), params)
    assert all(len(o.output_token_ids) == 12 for o in out)
    kinds = {("prefill" if int(i.logits_indices.numel()) < int(i.input_ids.numel()) else "decode")
             for i, *_ in compared.steps}
    assert kinds == {"prefill", "decode"}
    if spec is not None:
        assert any(i.spec_decode_metadata is not None for i, *_ in compared.steps)
    alone = engine.generate(_prompts(1, model.config.vocab_size), SamplingParams(max_tokens=4,
                                                                                 ignore_eos=True))
    rows = [int(i.input_ids.numel()) for i, *_ in compared.steps]
    assert min(rows) == 1 and max(rows) >= 16  # both sides of every rule's switch
    for inputs, eager, got in compared.steps:
        assert got.dtype == dtype and _same(eager, got)
    assert len(alone[0].output_token_ids) == 4
    eager_engine = Engine(copy.deepcopy(tiny).to(dtype), num_blocks=64, block_size=8, max_num_seqs=4,
                          max_num_batched_tokens=24, speculative_config=spec, enforce_eager=True)
    assert eager_engine.runner.replay is None and eager_engine.runner.eager_reason == "enforce_eager=True"
    again = eager_engine.generate(_prompts(4, model.config.vocab_size),
                                  SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.output_token_ids for o in again] == [o.output_token_ids for o in out]


def test_features_equal_forward(tiny):
    """return_features (what an EAGLE head reads): the same features and logits as run_model's."""
    engine = Engine(copy.deepcopy(tiny), num_blocks=32, block_size=8)
    compared = Compared(engine.runner)
    engine.add_request(_prompts(1, 128)[0], SamplingParams(max_tokens=2, ignore_eos=True))
    sched = engine.scheduler.schedule()
    engine.runner.execute_model(sched, return_features=True)
    inputs, (eager_logits, eager_features), (logits, features) = compared.steps[0]
    assert features.shape == (inputs.input_ids.numel(), 64)
    assert torch.equal(eager_features, features) and torch.equal(eager_logits, logits)


def test_a_changed_weight_is_captured_again(tiny):
    model = copy.deepcopy(tiny)
    engine = Engine(model, num_blocks=32, block_size=8)
    replay = engine.runner.replay
    assert replay.captures == 1 and replay.ready() and replay.captures == 1
    with torch.no_grad():
        model.layers[1].mlp.down_proj.weight.mul_(0.5)  # in place: its version counter moves
    compared = Compared(engine.runner)
    engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3))
    assert replay.captures == 2
    assert all(_same(eager, got) for _, eager, got in compared.steps)
    model.load_state_dict(tiny.state_dict())  # new values again
    engine.generate([[1, 2, 3, 4, 6]], SamplingParams(max_tokens=3))
    assert replay.captures == 3 and all(_same(eager, got) for _, eager, got in compared.steps)


def test_a_hook_sees_every_call(tiny):
    """While a hook is registered the steps run Llama.forward, so the hook is called once per step."""
    model = copy.deepcopy(tiny)
    engine = Engine(model, num_blocks=32, block_size=8)
    calls = []
    handle = model.layers[0].self_attn.q_proj.register_forward_hook(lambda m, a, out: calls.append(out.shape))
    try:
        assert not engine.runner.replay.ready()
        engine.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    finally:
        handle.remove()
    assert len(calls) == 4 and calls[0] == (5, 64)
    assert engine.runner.replay.ready()
    model.use_cpu_ops = False
    assert not engine.runner.replay.ready()


@pytest.mark.parametrize("kwargs, reason", [
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8_e4m3' is quantized"),
    ({"kv_cache_dtype": "int4_g16"}, "is quantized or rotated"),
    ({"kv_cache_dtype": "fp8_hadamard"}, "is quantized or rotated"),
    ({"backend": "triton"}, "backend is 'triton'"),
    ({"enforce_eager": True}, "enforce_eager=True"),
])
def test_configurations_it_does_not_cover_run_eagerly(tiny, kwargs, reason):
    engine = Engine(copy.deepcopy(tiny), num_blocks=32, block_size=16, **kwargs)
    assert engine.runner.replay is None and reason in engine.runner.eager_reason


def test_refusals_name_the_reason(tiny):
    from radarlab.attention.backends import BACKENDS
    from radarlab.kvcache.paged_cache import PagedKVCache

    model = copy.deepcopy(tiny)
    cache = PagedKVCache.for_model(model.config, 8, 8)
    assert replay_refusal(model, cache) is None
    assert "one of one's own" in replay_refusal(model, cache, attn_backend=BACKENDS["torch_sdpa"])
    assert "not radarlab's Llama" in replay_refusal(torch.nn.Linear(2, 2), cache)
    half = PagedKVCache.for_model(model.config, 8, 8, dtype=torch.bfloat16)
    assert "the pool holds torch.bfloat16" in replay_refusal(model, half)
    model.use_cpu_ops = False
    with pytest.raises(ValueError, match="cannot run this configuration: the model's C.. operators are off"):
        ReplayedModel(model, cache)
    fp8 = PagedKVCache.for_model(tiny.config, 8, 8, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="quantized or rotated"):
        ReplayedModel(tiny, fp8)
