"""An EAGLE-style draft head: one decoder layer that runs on the target's own features.

The target's last hidden state after its final norm, f_t, is what its LM head reads to predict
token t+1. The head takes f_t and the embedding of token t+1, fuses them with one linear map
(fc: [embed, feature] -> hidden), runs one Llama decoder layer (no input norm) and outputs g_t, an
estimate of f_{t+1}. The target's frozen LM head turns g_t into a guess for token t+2, and g_t is
fed back as the feature for the next draft step. Embedding and LM head are the target's, so the
head owns only fc and one layer: 4.2 M parameters for the course model at its own MLP width, 3.3 M
for the shipped head, whose MLP is narrower (1,024 against 1,536).

This is the layout vLLM's EAGLE-1 Llama head uses (vllm/model_executor/models/llama_eagle.py):
checkpoint keys fc.weight and layers.0.*, a Llama config.json with one hidden layer, no final norm,
embedding and LM head shared with the target when the checkpoint has none.

draft_forward is the head's computation, a DraftHead constructor argument: notebook 09's exercise
plugs a learner's own in there, and every caller (the engine's proposer, the evaluator, training)
runs it through head(...). draft_chain is the drafting loop (catch up on true features, then k steps
on the head's own), shared by the evaluator's contiguous cache (draft_eval) and the engine's paged
one (radarlab.spec_decode.eagle).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from radarlab.models.linear import Linear
from radarlab.models.llama import DecoderLayer, LlamaConfig, rope_inv_freq

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
VOCAB_FILE = "draft_vocab.json"  # not .safetensors: vLLM loads every safetensors file it finds
TRAINED_HEAD = Path(__file__).parent / "weights" / "smollm2-135m-eagle"  # the course model's, trained here


class NoNorm(nn.Module):
    """Where a DecoderLayer's norm is left out: takes what a norm takes (x, and the C++ operators)."""

    def forward(self, x: torch.Tensor, ops=None) -> torch.Tensor:
        return x


def draft_forward(head: "DraftHead", token_embeds: torch.Tensor, features: torch.Tensor,
                  positions: torch.Tensor, kv_cache, meta) -> torch.Tensor:
    """The head's computation (notebook 09's exercise): fc over [embedding of token t+1, f_t], RoPE at
    each token's position, the decoder layer (its input norm is NoNorm) -> the estimate of f_{t+1}."""
    x = head.fc(torch.cat((token_embeds, features), dim=-1))
    cos, sin = head.rope(positions, x.dtype)
    return head.layer(x, cos, sin, kv_cache, meta)


class DraftHead(nn.Module):
    """fc over [token embedding, target feature], then one decoder layer without its input norm.
    draft_forward computes it (a function with draft_forward's signature: a learner's own plugs in
    here, and every caller, the engine's proposer and the training loop, runs it)."""

    def __init__(self, config: LlamaConfig, draft_forward=draft_forward) -> None:
        super().__init__()
        if not callable(draft_forward):
            raise TypeError(f"draft_forward must be a function like radarlab.spec_decode.draft_head."
                            f"draft_forward, got {type(draft_forward).__name__}")
        self.config = config
        self.draft_forward = draft_forward
        h = config.hidden_size
        self.fc = Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(config, 0)
        self.layer.input_layernorm = NoNorm()  # the fused input is not normed (as EAGLE)
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        freqs = positions.to(self.inv_freq.device).float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def forward(self, token_embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                kv_cache, meta) -> torch.Tensor:
        """Packed [T, hidden] embeddings of tokens t+1 and features f_t -> [T, hidden] estimates of
        f_{t+1}."""
        if token_embeds.shape != features.shape or token_embeds.shape[-1] != self.config.hidden_size:
            raise ValueError(f"token_embeds {tuple(token_embeds.shape)} and features {tuple(features.shape)} "
                             f"must both be [T, {self.config.hidden_size}]")
        return self.draft_forward(self, token_embeds, features, positions, kv_cache, meta)

    def flops_per_token(self, vocab_size: int) -> int:
        """Multiply-adds x 2 of one draft step, LM head over vocab_size rows included (attention's
        score/value products are left out: they depend on the context length)."""
        own = sum(p.numel() for p in self.parameters())  # fc and the layer's matrices; norms are noise
        return 2 * (own + vocab_size * self.config.hidden_size)


@torch.inference_mode()
def draft_chain(head: DraftHead, embed, rows: torch.Tensor, cache, catch_up, ks, pick,
                next_step) -> list[list[int]]:
    """The EAGLE drafting loop, for any cache: one head forward per draft position, batched.

    catch_up = (token ids, features, meta): for each sequence, the positions i whose head K/V is not
    yet from the target's true features, packed: token i+1, feature f_i; the head's output at each
    sequence's last position is its first guess. ks[s]: drafts wanted from sequence s. Then, while
    any sequence wants more, pick(logits [live, len(rows)], live) turns the head's guesses into
    target token ids, and next_step(live, tokens) gives (metadata of one new query per sequence for
    the token it just drafted, the sequences that got one: a paged cache may run out of slots); the
    head reads each sequence's own last output as the next feature. Returns the drafts per sequence."""
    ids, features, meta = catch_up
    g = head(embed(ids), features, meta.positions, cache, meta)[meta.query_start_loc[1:] - 1]
    drafts: list[list[int]] = [[] for _ in ks]
    live = [s for s, k in enumerate(ks) if k > 0]
    g = g[live]
    while live:
        for s, token in zip(live, pick(g @ rows.T, live)):
            drafts[s].append(int(token))
        wanting = [s for s in live if len(drafts[s]) < ks[s]]
        if not wanting:
            break
        meta, kept = next_step(wanting, [drafts[s][-1] for s in wanting])
        if not kept:
            break
        g = g[[live.index(s) for s in kept]]
        g = head(embed(torch.tensor([drafts[s][-1] for s in kept], device=g.device)), g, meta.positions,
                 cache, meta)
        live = kept
    return drafts


def draft_config(target: LlamaConfig, intermediate_size: int | None = None) -> LlamaConfig:
    """The head's config: the target's, with one layer (and, if given, a narrower MLP)."""
    fields = asdict(target)
    fields["num_layers"] = 1
    if intermediate_size is not None:
        fields["intermediate_size"] = intermediate_size
    return LlamaConfig(**fields)


def save_head(head: DraftHead, directory: str | Path, target_hf_config: dict,
              draft_vocab: torch.Tensor | None = None, dtype=torch.float16) -> Path:
    """Write the head in vLLM's EAGLE layout: model.safetensors (fc.weight, layers.0.*) and a one-layer
    Llama config.json. The draft vocabulary (token ids the head was trained to rank) goes alongside."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {}
    for name, t in head.state_dict().items():
        key = name.replace("layer.", "layers.0.", 1) if name.startswith("layer.") else name
        state[key] = t.detach().to(dtype).contiguous()
    save_file(state, str(directory / WEIGHTS_FILE))
    cfg = dict(target_hf_config)
    cfg.update(num_hidden_layers=1, intermediate_size=head.config.intermediate_size,
               architectures=["LlamaForCausalLM"], torch_dtype=str(dtype).removeprefix("torch."),
               dtype=str(dtype).removeprefix("torch."))
    (directory / CONFIG_FILE).write_text(json.dumps(cfg, indent=1, sort_keys=True) + "\n")
    if draft_vocab is not None:
        (directory / VOCAB_FILE).write_text(json.dumps(draft_vocab.tolist()) + "\n")
    return directory


def load_head(directory: str | Path, target: LlamaConfig, dtype=torch.float32,
              draft_forward=draft_forward) -> tuple[DraftHead, torch.Tensor | None]:
    """(head, draft vocabulary or None) from a directory save_head wrote; the target's config must match.
    draft_forward: the head's computation (DraftHead's)."""
    from safetensors.torch import load_file

    directory = Path(directory)
    cfg = json.loads((directory / CONFIG_FILE).read_text())
    for key, ours in (("hidden_size", target.hidden_size), ("vocab_size", target.vocab_size),
                      ("num_attention_heads", target.num_heads),
                      ("num_key_value_heads", target.num_kv_heads)):
        if cfg.get(key) != ours:
            raise ValueError(f"draft head {key}={cfg.get(key)} does not match the target's {ours}")
    head = DraftHead(draft_config(target, cfg.get("intermediate_size")), draft_forward)
    state = {k.replace("layers.0.", "layer.", 1): v.to(dtype) for k,
             v in load_file(str(directory / WEIGHTS_FILE)).items()}
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"draft head weights do not match: missing {missing}, unexpected {unexpected}")
    vocab_path = directory / VOCAB_FILE
    vocab = torch.tensor(json.loads(vocab_path.read_text()),
                         dtype=torch.long) if vocab_path.exists() else None
    return head.to(dtype).eval(), vocab
