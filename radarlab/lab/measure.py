"""Measuring this machine: a timer, read bandwidth, peak FLOP/s, and decode steps of our model.

One timer (time_ms) and one read-bandwidth probe (read_bandwidth_gbps) serve every measurement in
radarlab, the machine's balance for notebook 01's roofline and the kernel timings of notebook 04 alike,
so two figures that put a kernel next to "this machine's bandwidth" were timed the same way.

On CUDA, time_ms is triton.testing.do_bench (L2 flushed before each run, repeated for ~100 ms). On a
CPU it is the median wall time of a few calls; cpu_threads pins torch's thread count around it, since
on a machine shared with other jobs torch's worker threads wait on each other and timings scatter.
"""
from __future__ import annotations

import statistics
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

from radarlab.lab.roofline import ridge_point
from radarlab.util import require_int


@contextmanager
def cpu_threads(n: int | None):
    """Run a block with torch limited to n CPU threads (None: leave as is), then restore.

    On a machine shared with other jobs, torch's worker threads spin waiting for each other and a
    timing can come out ten times too slow; a single thread gives steady numbers there."""
    import torch

    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(require_int("threads", n))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def synchronize(device) -> None:
    """Wait for the GPU's queued work, so a host clock read after it sees the work done (no-op off CUDA)."""
    import torch

    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def time_ms(fn: Callable[[], object], device="cpu", repeats: int = 5, warmup: int = 1) -> float:
    """Median milliseconds of one call of fn.

    On CUDA this is triton.testing.do_bench: it flushes L2 before each run and repeats for ~100 ms,
    so a kernel is timed reading from memory, not from cache. Elsewhere, the median wall time of
    `repeats` calls after `warmup` calls (under Triton's interpreter that measures the interpreter).
    """
    if str(device).startswith("cuda"):
        from triton.testing import do_bench

        return float(do_bench(fn, return_mode="median"))
    repeats = require_int("repeats", repeats)
    for _ in range(require_int("warmup", warmup, minimum=0)):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000.0 * statistics.median(times)


def gbps(nbytes: float, ms: float) -> float:
    """Bandwidth in GB/s (10^9 bytes per second, as spec sheets quote it) of nbytes moved in ms
    milliseconds."""
    return nbytes / ms / 1e6


def peak_bandwidth_gbps(device="cuda") -> float | None:
    """The GPU memory's theoretical peak in GB/s (memory clock x bus width x 2 for double data rate),
    as triton.testing.get_dram_gbps reads it from the driver. None off CUDA or if the driver won't say."""
    import torch

    if not str(device).startswith("cuda") or not torch.cuda.is_available():
        return None
    try:
        from triton.testing import get_dram_gbps

        index = torch.device(device).index
        return float(get_dram_gbps(torch.cuda.current_device() if index is None else index))
    except Exception:  # an old driver or a non-NVIDIA backend: the measured read line still stands
        return None


def read_bandwidth_gbps(device="cuda", megabytes: int = 1024, repeats: int = 5) -> float:
    """Achieved bandwidth of torch summing a large fp32 tensor: what a plain streaming read reaches,
    the practical ceiling next to the theoretical peak."""
    import torch

    x = torch.ones(require_int("megabytes", megabytes) * 2**20 // 4, device=device)
    ms = time_ms(lambda: x.sum(), device, repeats=repeats)
    return gbps(x.nbytes, ms)


@dataclass(frozen=True)
class MachineBalance:
    """This machine's two roofline numbers, measured."""

    peak_flops: float  # fp32 matmul FLOP/s
    bandwidth: float  # read bandwidth, bytes/s

    @property
    def ridge(self) -> float:
        return ridge_point(self.peak_flops, self.bandwidth)


def measure_machine(device: str = "cpu", matmul_n: int = 1024, read_mb: int = 256, repeats: int = 5,
                    threads: int | None = None) -> MachineBalance:
    """fp32 matmul throughput (an n x n by n x n product) and read bandwidth (read_bandwidth_gbps).

    Rough by design (a second or so): enough to place this machine's ridge point on the plot."""
    import torch

    n = require_int("matmul_n", matmul_n)
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    with cpu_threads(threads):
        matmul_ms = time_ms(lambda: a @ b, device, repeats=repeats)
        read_gbps = read_bandwidth_gbps(device, read_mb, repeats=repeats)
    return MachineBalance(2 * n**3 / (matmul_ms / 1e3), read_gbps * 1e9)


@dataclass(frozen=True)
class DecodeTiming:
    batch: int
    context: int
    ms_per_step: float  # median over the timed steps

    @property
    def ms_per_token(self) -> float:
        """Each step yields one token per sequence."""
        return self.ms_per_step / self.batch

    @property
    def tokens_per_s(self) -> float:
        return 1000.0 * self.batch / self.ms_per_step


def measure_decode(model, batch_sizes, context: int = 128, steps: int = 4, warmup: int = 1,
                   seed: int = 0, budget_s: float | None = None,
                   threads: int | None = None, query_len: int = 1) -> list[DecodeTiming]:
    """Time our forward pass on one-token decode steps for each batch size (query_len > 1: verify
    steps, query_len new tokens a sequence, all of them scored, as speculative decoding's).

    The prefill is skipped: each sequence starts with `context` positions of zero K/V already in a
    contiguous cache. The arithmetic and memory traffic of a decode step do not depend on what the
    cache holds, so this times decode alone without paying for B prompts first.

    Each step's inputs differ (the context grows by one), so the steps are timed one by one here
    rather than through time_ms, which repeats one call.

    With budget_s, batch sizes after the one that crosses the budget are skipped (a busy or slow
    machine then returns fewer points instead of running for minutes)."""
    import torch

    from radarlab.attention.metadata import AttentionMetadata
    from radarlab.kvcache.contiguous import ContiguousKVCache

    context = require_int("context", context)
    steps = require_int("steps", steps)
    warmup = require_int("warmup", warmup, minimum=0)
    cfg = model.config
    param = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    with cpu_threads(threads):
        results = []
        started = time.perf_counter()
        for batch in batch_sizes:
            if budget_s is not None and results and time.perf_counter() - started > budget_s:
                break
            batch = require_int("batch", batch)
            cache = ContiguousKVCache.for_model(cfg, batch, context + (warmup + steps) * query_len,
                                                dtype=param.dtype, device=param.device)
            rows = torch.arange(batch)
            times = []
            for s in range(warmup + steps):
                seq_len = context + (s + 1) * query_len
                meta = AttentionMetadata.from_lens([query_len] * batch, [seq_len] * batch, cache_rows=rows)
                ids = torch.randint(cfg.vocab_size, (batch * query_len,), generator=gen).to(param.device)
                positions = meta.positions.to(param.device)
                logits_at = torch.arange(batch * query_len, device=param.device)
                synchronize(param.device)
                t0 = time.perf_counter()
                model(ids, positions, cache, meta, logits_indices=logits_at)
                synchronize(param.device)
                if s >= warmup:
                    times.append(time.perf_counter() - t0)
            results.append(DecodeTiming(batch, context, 1000.0 * statistics.median(times)))
            del cache
    return results
