#!/usr/bin/env bash
# The paged-attention kernels on a CUDA machine: run from the repository root after `make setup`.
#
#   bash scripts/gpu_check.sh
#
# 1. The kernel and paged-cache tests, compiled (TRITON_INTERPRET unset, so radarlab leaves Triton
#    in its compiled mode): the same tests that run under the interpreter on CPU, now on the GPU.
# 2. The Triton decode kernel timed against the batched torch gather path (paged_decode_torch) at
#    course-model heads (9 query heads over 3 KV heads, head_dim 64, block size 16), with the
#    bandwidth each achieves on the bytes decode must read (K and V of every context token, plus q
#    and the output). L2 is flushed before every timed run (triton.testing.do_bench).
#
# Environment: PYTHON (default .venv/bin/python), PYTEST_ARGS (extra pytest arguments),
# SKIP_TESTS=1 (timings only).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

PY="${PYTHON:-.venv/bin/python}"
if [ ! -x "$PY" ]; then
    echo "gpu_check: $PY not found; run 'make setup' first" >&2
    exit 1
fi
unset TRITON_INTERPRET
"$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else "gpu_check: torch sees no CUDA device")'
"$PY" -c 'import radarlab.device as d; i = d.device_info(); print(f"gpu_check: {i.name}, triton {i.triton_mode}")'

if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== 1. paged KV tests, compiled =="
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider tests/test_paged_attention.py tests/test_paged_cache.py ${PYTEST_ARGS:-}
fi

echo "== 2. decode: Triton kernel vs torch gather =="
"$PY" - <<'EOF'
import radarlab  # noqa: F401  (first, as everywhere: it decides interpreted vs compiled Triton)
import torch
import triton
from triton.testing import do_bench

from radarlab.attention.torch_paged import paged_decode_torch
from radarlab.attention.triton_paged import triton_paged_decode

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16  # the course model (SmolLM2-135M)
SHAPES = [(8, 512), (32, 2048), (32, 8192), (128, 2048)]  # (batch, context tokens per sequence)
TILES = (16, 32, 64)


def case(batch, context, dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    per_seq = triton.cdiv(context, BLOCK_SIZE)
    num_blocks = batch * per_seq
    shape = (num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    v_cache = torch.randn(shape, generator=gen, device="cuda").to(dtype)
    order = torch.randperm(num_blocks, generator=gen, device="cuda")  # scattered blocks
    block_tables = order.view(batch, per_seq).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int64, device="cuda")
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen, device="cuda").to(dtype)
    return q, k_cache, v_cache, block_tables, seq_lens


def decode_bytes(q, k_cache, block_tables, seq_lens):
    kv = 2 * int(seq_lens.sum()) * KV_HEADS * HEAD_DIM * k_cache.element_size()
    return kv + 2 * q.numel() * q.element_size() + block_tables.numel() * block_tables.element_size()


print(f"{'dtype':>8} {'batch':>5} {'context':>7} {'MB read':>8} {'triton ms':>9} {'tile':>4} "
      f"{'torch ms':>9} {'speedup':>7} {'triton GB/s':>11} {'torch GB/s':>10} {'max err':>8}")
for dtype in (torch.bfloat16, torch.float32):
    for batch, context in SHAPES:
        q, k_cache, v_cache, block_tables, seq_lens = case(batch, context, dtype)
        scale = HEAD_DIM ** -0.5
        expected = paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale)
        out = triton_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale)  # checked call
        err = (out.float() - expected.float()).abs().max().item()
        best_ms, best_tile = float("inf"), None
        for tile in TILES:
            ms = do_bench(lambda: triton_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                      out=out, tile_n=tile, check=False), return_mode="median")
            if ms < best_ms:
                best_ms, best_tile = ms, tile
        torch_ms = do_bench(lambda: paged_decode_torch(q, k_cache, v_cache, block_tables, seq_lens, scale,
                                                       check=False), return_mode="median")
        nbytes = decode_bytes(q, k_cache, block_tables, seq_lens)
        name = str(dtype).removeprefix("torch.")
        print(f"{name:>8} {batch:>5} {context:>7} {nbytes / 1e6:>8.1f} {best_ms:>9.4f} {best_tile:>4} "
              f"{torch_ms:>9.4f} {torch_ms / best_ms:>6.1f}x {nbytes / best_ms / 1e6:>11.0f} "
              f"{nbytes / torch_ms / 1e6:>10.0f} {err:>8.1e}")
        del q, k_cache, v_cache, expected, out
        torch.cuda.empty_cache()
print("GB/s counts the bytes decode must read (K and V of every context token, q, the block tables) "
      "and the output written, divided by the median time.")
EOF
