"""radarlab.lab.measure: one timer and one read-bandwidth probe for every measurement."""
from __future__ import annotations

import pytest
import torch

from radarlab.lab import measure
from radarlab.lab.measure import (
    MachineBalance,
    cpu_threads,
    measure_decode,
    measure_machine,
    peak_bandwidth_gbps,
    read_bandwidth_gbps,
    time_ms,
)


def test_time_ms_is_the_median_after_warmup(monkeypatch):
    calls = []
    ticks = iter([0.0, 0.001, 1.0, 1.005, 2.0, 2.002])  # three timed calls: 1 ms, 5 ms, 2 ms
    monkeypatch.setattr(measure.time, "perf_counter", lambda: next(ticks))
    assert time_ms(lambda: calls.append(1), "cpu", repeats=3, warmup=2) == pytest.approx(2.0)
    assert len(calls) == 5


@pytest.mark.parametrize("repeats, warmup, match",
                         [(0, 1, "repeats"), (True, 1, "repeats"), (3, -1, "warmup")])
def test_time_ms_rejects_bad_counts(repeats, warmup, match):
    with pytest.raises(ValueError, match=match):
        time_ms(lambda: None, "cpu", repeats=repeats, warmup=warmup)


def test_no_peak_bandwidth_off_cuda():
    assert peak_bandwidth_gbps("cpu") is None


def test_read_bandwidth_is_the_tensors_bytes_over_time_ms(monkeypatch):
    monkeypatch.setattr(measure, "time_ms", lambda fn, device, repeats=5, warmup=1: (fn(), 4.0)[1])
    assert read_bandwidth_gbps("cpu", megabytes=8) == pytest.approx(8 * 2**20 / 4.0 / 1e6)
    assert read_bandwidth_gbps("cpu", megabytes=1, repeats=1) > 0
    with pytest.raises(ValueError, match="megabytes"):
        read_bandwidth_gbps("cpu", megabytes=0)


def test_measure_machine_times_through_time_ms(monkeypatch):
    """The matmul and the read go through the one timer (here a fake: 2 ms a call), nothing else."""
    timed = []

    def fake_time_ms(fn, device, repeats=5, warmup=1):
        timed.append(fn())
        return 2.0

    monkeypatch.setattr(measure, "time_ms", fake_time_ms)
    m = measure_machine("cpu", matmul_n=64, read_mb=4, repeats=2)
    assert [tuple(t.shape) for t in timed] == [(64, 64), ()]  # a @ b, then x.sum()
    assert m.peak_flops == pytest.approx(2 * 64**3 / 2e-3)
    assert m.bandwidth == pytest.approx(4 * 2**20 / 2e-3)
    assert m.ridge == pytest.approx(m.peak_flops / m.bandwidth)


def test_measure_machine_for_real_is_plausible():
    m = measure_machine("cpu", matmul_n=128, read_mb=8, repeats=2, threads=1)
    assert isinstance(m, MachineBalance) and m.peak_flops > 1e6 and m.bandwidth > 1e6


def test_cpu_threads_restores_the_setting():
    before = torch.get_num_threads()
    with cpu_threads(1):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == before
    with pytest.raises(ValueError, match="threads"):
        with cpu_threads(0):
            pass


def _tiny_llama(num_layers=2):
    from radarlab.models.llama import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=num_layers,
                             num_heads=4, num_kv_heads=2, head_dim=8)).eval()


def test_measure_decode_on_a_tiny_model():
    out = measure_decode(_tiny_llama(), [1, 3], context=5, steps=2)
    assert [t.batch for t in out] == [1, 3]
    assert all(t.ms_per_step > 0 and t.ms_per_token == pytest.approx(t.ms_per_step / t.batch) for t in out)


def test_measure_decode_times_verify_steps_too():
    """query_len tokens a sequence, each with its K/V written: a verify step of speculative decoding."""
    out = measure_decode(_tiny_llama(), [2], context=5, steps=2, query_len=4)
    assert out[0].batch == 2 and out[0].ms_per_step > 0


def test_measure_decode_stops_at_its_budget():
    out = measure_decode(_tiny_llama(1), [1, 2, 4], context=3, steps=1, budget_s=0.0)
    assert [t.batch for t in out] == [1]  # the first point is always measured


def test_gbps_is_bytes_per_nanosecond():
    assert measure.gbps(3_000_000, 2.0) == 1.5  # 3 MB in 2 ms = 1.5 GB/s
    assert measure.gbps(4.8e12, 1000.0) == pytest.approx(4800.0)  # an H200's 4.8 TB/s
