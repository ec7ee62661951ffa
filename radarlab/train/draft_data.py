"""Training data for the draft head: the target's features and greedy tokens, computed once.

The corpus is the Python standard library's own source (every machine with Python has it, offline).
Files are split into training and held-out sets by a hash of their path, so the split is the same on
every machine. One prefill pass of the target over fixed-length chunks stores, per token, the
normed last hidden state f_t (fp16) and the target's greedy next token argmax(lm_head(f_t)).
Training then never runs the 30-layer target again.
"""
from __future__ import annotations

import hashlib
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from radarlab.attention.metadata import AttentionMetadata
from radarlab.models.llama import final_features
from radarlab.util import require_int

HELD_OUT_PERCENT = 5


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """Every .py file of the standard library (no tests, no site-packages), sorted."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idle_test", "__pycache__")
    return sorted(p for p in root.rglob("*.py")
                  if not any(part in skip for part in p.relative_to(root).parts))


def is_held_out(path: Path, root: Path) -> bool:
    """A stable split: a file is held out when the hash of its relative path falls in the first 5%."""
    digest = hashlib.sha256(str(path.relative_to(root)).encode()).digest()
    return int.from_bytes(digest[:4], "little") % 100 < HELD_OUT_PERCENT


def split_files(root: str | Path | None = None) -> tuple[list[Path], list[Path]]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    held = [p for p in files if is_held_out(p, root)]
    return [p for p in files if not is_held_out(p, root)], held


def token_chunks(tokenizer, files: list[Path], seq_len: int) -> torch.Tensor:
    """The files' tokens back to back (each file starts a new chunk), cut into [N, seq_len] rows."""
    require_int("seq_len", seq_len, minimum=2)
    rows = []
    for path in files:
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"),
                        add_special_tokens=False)["input_ids"]
        rows += [ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len)]
    return torch.tensor(rows, dtype=torch.long).reshape(-1, seq_len)


class CausalBatch:
    """An attention backend for one prefill of B equal-length sequences packed as [B*L]: causal SDPA,
    nothing cached (kv_cache is None)."""

    def is_built(self, meta: AttentionMetadata, kv_cache) -> bool:
        return meta.backend is self

    def forward(self, layer, q, k, v, meta: AttentionMetadata, kv_cache, scale: float) -> torch.Tensor:
        b = meta.num_seqs
        t, h, d = q.shape
        hkv = k.shape[1]
        q, k, v = (x.view(b, t // b, x.shape[1], d).transpose(1, 2) for x in (q, k, v))
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        return out.transpose(1, 2).reshape(t, h, d)


def causal_batch(batch: int, length: int) -> AttentionMetadata:
    """The metadata of one prefill of `batch` sequences of `length` tokens, attended by CausalBatch."""
    return AttentionMetadata.from_lens([length] * batch, [length] * batch, backend=CausalBatch())


@torch.inference_mode()
def target_features_batch(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, L] -> (features [B, L, hidden], greedy next tokens [B, L]) of the target."""
    b, length = ids.shape
    positions = torch.arange(length).repeat(b)
    f = final_features(model, ids.reshape(-1), positions, None, causal_batch(b, length))
    greedy = model.lm_head(f).argmax(-1)
    return f.view(b, length, -1), greedy.view(b, length)


def features_of(model, chunks: torch.Tensor, batch: int = 4) -> dict[str, torch.Tensor]:
    """One target pass over the chunks [N, L]: tokens, fp16 features and greedy labels, as a shard holds."""
    feats, greedy = [], []
    for i in range(0, chunks.shape[0], batch):
        f, g = target_features_batch(model, chunks[i:i + batch])
        feats.append(f.half())
        greedy.append(g.int())
    return {"tokens": chunks.int(), "features": torch.cat(feats), "greedy": torch.cat(greedy)}


def cache_features(model, chunks: torch.Tensor, out: str | Path, batch: int = 4) -> Path:
    """Run the target over the chunks once; save tokens, fp16 features and greedy labels to `out`."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(features_of(model, chunks, batch), out)
    return out


def small_feature_set(model, tokenizer, rows: int, seq_len: int, seed: int = 0, batch: int = 8) -> dict:
    """A small cached feature set in memory (notebook 09's minute of training): one chunk of seq_len
    tokens from each of `rows` training files drawn with `seed`, and the target's features over them.
    One chunk per file keeps the few rows as varied as the library is."""
    train, _ = split_files()
    gen = torch.Generator().manual_seed(seed)
    chunks = []
    for i in torch.randperm(len(train), generator=gen).tolist():
        file_chunks = token_chunks(tokenizer, [train[i]], seq_len)
        if len(file_chunks):
            chunks.append(file_chunks[int(torch.randint(len(file_chunks), (1,), generator=gen))])
        if len(chunks) == rows:
            break
    return features_of(model, torch.stack(chunks), batch)


def cache_shards(model, tokenizer, out_dir: str | Path, seq_len: int = 256, shard_chunks: int = 32,
                 max_shards: int = 1000, seed: int = 0, log=print) -> list[Path]:
    """Cache the training files' features in shards of shard_chunks x seq_len tokens, in a seeded
    random order of chunks (so any prefix of shards covers the whole library). Shards already on disk
    are kept: an interrupted run resumes where it stopped."""
    train, _ = split_files()
    chunks = token_chunks(tokenizer, train, seq_len)
    order = torch.randperm(chunks.shape[0], generator=torch.Generator().manual_seed(seed))
    chunks = chunks[order]
    out_dir = Path(out_dir)
    paths = []
    start = time.perf_counter()
    n = min(max_shards, chunks.shape[0] // shard_chunks)
    for s in range(n):
        path = out_dir / f"shard_{s:05d}.pt"
        if not path.exists():
            tmp = cache_features(model, chunks[s * shard_chunks:(s + 1) * shard_chunks],
                                 path.with_suffix(".tmp"))
            tmp.rename(path)
            if log:
                log(f"shard {s + 1}/{n}: {shard_chunks * seq_len} tokens, "
                    f"{time.perf_counter() - start:.0f} s so far")
        paths.append(path)
    return paths


def load_shards(out_dir: str | Path, limit: int | None = None) -> dict[str, torch.Tensor]:
    """Concatenate the cached shards (the first `limit` of them, if given)."""
    paths = sorted(Path(out_dir).glob("shard_*.pt"))[:limit]
    if not paths:
        raise FileNotFoundError(f"no shard_*.pt in {out_dir}: run python -m radarlab.train.draft_data first")
    parts = [torch.load(p) for p in paths]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


def main(argv=None) -> None:
    import argparse

    from radarlab.models.llama import Llama

    ap = argparse.ArgumentParser(description="Cache the target's features and greedy tokens over the stdlib")
    ap.add_argument("--out", required=True, help="directory for shard_*.pt")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--shard-chunks", type=int, default=32)
    ap.add_argument("--max-shards", type=int, default=1000)
    args = ap.parse_args(argv)
    model, tokenizer = Llama.from_pretrained()
    cache_shards(model, tokenizer, args.out, args.seq_len, args.shard_chunks, args.max_shards)


if __name__ == "__main__":
    main()
