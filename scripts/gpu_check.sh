#!/usr/bin/env bash
# The paged-attention kernels on a CUDA machine: run from the repository root after `make setup`.
#
#   bash scripts/gpu_check.sh
#
# 1. The kernel and paged-cache tests, compiled (TRITON_INTERPRET unset, so radarlab leaves Triton
#    in its compiled mode): the same tests that run under the interpreter on CPU, now on the GPU,
#    quantized kernels included (fp8, int4, int8 zero points, KIVI with its tails and settled-prefix
#    rule, sinks: tests/attention/test_quant_triton.py against the torch backend).
# 2. `python -m radarlab.lab.kernel_bench` (check_kernels): the store-KV, decode, split-KV decode
#    and prefill kernels against their torch counterparts at course-model heads (9 query heads over 3
#    KV heads, head_dim 64, block size 16), in bf16 and fp32, then timed with triton.testing.do_bench
#    (L2 flushed before every run); decode also shows the bandwidth it achieves on the bytes it must
#    move, and split-KV its speedup over the unsplit decode kernel ("vs decode", e.g. at 4 x 16384
#    tokens). Exits 1 if a kernel disagrees with its reference.
#
# Environment: PYTHON (default .venv/bin/python), PYTEST_ARGS (extra pytest arguments),
# BENCH_ARGS (extra arguments for step 2, e.g. --shapes 8x512 --dtypes float32 --partition-size 256), SKIP_TESTS=1 (step 2 only).
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
    "$PY" -m pytest -q -p no:cacheprovider tests/attention/test_paged_attention.py tests/kvcache/test_paged_cache.py \
        tests/attention/test_quant_triton.py ${PYTEST_ARGS:-}
fi

echo "== 2. Triton kernels vs their torch references, timed =="
# shellcheck disable=SC2086
"$PY" -m radarlab.lab.kernel_bench ${BENCH_ARGS:-}
