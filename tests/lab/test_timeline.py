"""Engine timelines (radarlab.lab.timeline) and their plot (radarlab.viz.timeline_plot), on a tiny model."""
from __future__ import annotations

import random

import matplotlib
import pytest

matplotlib.use("Agg")

from radarlab.engine import Engine, SamplingParams  # noqa: E402
from radarlab.lab.timeline import (  # noqa: E402
    DECODE,
    DONE,
    PREFILL,
    RECOMPUTE,
    WAITING,
    latency_metrics,
    max_running,
    output_token_ids,
    record_step,
    run_recorded,
    slot_utilisation,
    state_grid,
    token_steps,
    token_times,
)

VOCAB = 128  # the vocabulary of conftest's tiny model


def prompts(n, lo, hi, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run(tiny, ps, max_tokens, **engine_kw):
    engine = Engine(tiny, block_size=4, **engine_kw)
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        engine.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True), request_id=i)
    return engine, run_recorded(engine)


def test_hand_worked_utilisation_and_states(tiny):
    """Two seats, outputs of 1 and 3 tokens: step 0 prefills both (request 0 is done after its first
    token), steps 1 and 2 decode request 1 alone. 4 of 6 seat-steps worked."""
    engine, records = run(tiny, [[1, 2, 3], [4, 5]], [1, 3], num_blocks=16, max_num_seqs=2)
    assert [r.step for r in records] == [0, 1, 2]
    assert [[(w.request_id, w.kind, w.num_computed_tokens, w.num_tokens, w.sampled) for w in r.scheduled]
            for r in records] == [[(0, PREFILL, 0, 3, True), (1, PREFILL, 0, 2, True)],
                                  [(1, DECODE, 2, 1, True)], [(1, DECODE, 3, 1, True)]]
    assert [r.finished for r in records] == [(0,), (), (1,)]
    assert [r.num_running for r in records] == [2, 1, 1]
    assert slot_utilisation(records, 2) == pytest.approx(4 / 6)
    assert max_running(records) == 2
    assert state_grid(records, [0, 1]) == [[PREFILL, DONE, DONE], [PREFILL, DECODE, DECODE]]
    assert token_steps(records) == {0: [0], 1: [0, 1, 2]}
    assert records[-1].num_used_blocks == 0 and engine.manager.num_free_blocks == 16


def test_queue_waits_for_seats_and_every_token_is_recorded(tiny):
    ps = prompts(7, 1, 12, seed=1)
    max_tokens = [random.Random(2).randint(1, 6) for _ in ps]
    engine, records = run(tiny, ps, max_tokens, num_blocks=64, max_num_seqs=3)
    assert records[0].waiting == (3, 4, 5, 6)
    assert all(len(r.scheduled) <= 3 and r.num_running <= 3 for r in records)
    steps = token_steps(records)
    for i, (p, m) in enumerate(zip(ps, max_tokens)):
        work = [r.work(i) for r in records if r.work(i)]
        assert work[0].kind == PREFILL and work[0].num_computed_tokens == 0 and work[0].num_tokens == len(p)
        assert all(w.kind == DECODE and w.num_tokens == 1 for w in work[1:])
        assert sum(w.num_tokens for w in work) == len(p) + m - 1  # the last token is sampled, never computed
        assert len(steps[i]) == m
        assert sum(i in r.finished for r in records) == 1
    grid = state_grid(records, list(range(len(ps))))
    for row in grid:  # waiting, then work, then done; never back
        first_work = next(s for s, x in enumerate(row) if x != WAITING)
        assert all(x == WAITING for x in row[:first_work])
        assert DONE not in row[:first_work]
        last_work = max(s for s, x in enumerate(row) if x in (PREFILL, DECODE))
        assert all(x == DONE for x in row[last_work + 1:])
    assert len(records) == engine.num_steps
    reference = Engine(tiny, num_blocks=64, block_size=4).generate(
        ps, [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens])
    assert output_token_ids(records) == {i: o.output_token_ids for i, o in enumerate(reference)}


def test_chunked_prefill_is_recorded_chunk_by_chunk(tiny):
    """A 30-token prompt beside two decoders, budget 8: chunks of 6, sampled only after the last."""
    engine = Engine(tiny, num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    for i in range(2):
        engine.add_request([1 + i, 2, 3], SamplingParams(max_tokens=12, ignore_eos=True), request_id=f"d{i}")
    records = [record_step(engine, 0)[1]]
    engine.add_request(list(range(30)), SamplingParams(max_tokens=2, ignore_eos=True), request_id="long")
    records += run_recorded(engine, first_step=1)
    chunks = [(r.work("long").num_tokens, r.work("long").sampled) for r in records[1:] if r.work("long")
              and r.work("long").kind == PREFILL]
    assert chunks == [(6, False)] * 4 + [(6, True)]
    assert all(r.num_tokens <= 8 for r in records)
    assert all(r.work("d0").kind == DECODE for r in records[1:7])  # the decoders never stall


def test_preemption_is_recorded_and_recomputed(tiny):
    ps = prompts(8, 3, 9, seed=3)
    _, roomy = run(tiny, ps, [10] * 8, num_blocks=64, max_num_seqs=8)
    engine, records = run(tiny, ps, [10] * 8, num_blocks=10, max_num_seqs=8, enable_prefix_caching=False)
    preempted = [rid for r in records for rid in r.preempted]
    assert len(preempted) == engine.scheduler.num_preemptions > 0
    for rec in records:
        for rid in rec.preempted:
            assert rec.work(rid) is None or rec.work(rid).kind == RECOMPUTE
            later = next(r.work(rid) for r in records[rec.step:] if r.work(rid))
            assert later.kind == RECOMPUTE and later.num_computed_tokens == 0
            assert later.num_tokens > len(ps[rid])  # the prompt and the outputs so far
    assert output_token_ids(records) == output_token_ids(roomy)  # recompute changes no token
    assert all(len(v) == 10 for v in token_steps(records).values())
    assert max_running(records) > max(r.num_running for r in records[-3:])
    assert all(r.num_used_blocks <= 10 for r in records)


def test_forked_samples_are_recorded(tiny):
    """n = 2: the second sample appears in the step that finished the prompt, with its first token."""
    engine = Engine(tiny, num_blocks=32, block_size=4, max_num_seqs=4)
    params = SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=7, ignore_eos=True)
    engine.add_request([3, 1, 4, 1, 5], params, request_id="r")
    records = run_recorded(engine)
    first = records[0]
    assert [(w.request_id, w.kind, w.num_tokens) for w in first.scheduled] == [("r", PREFILL, 5),
                                                                               (("r", 1), PREFILL, 0)]
    assert all(w.sampled for w in first.scheduled)
    tokens = output_token_ids(records)
    reference = Engine(tiny, num_blocks=32, block_size=4, max_num_seqs=4).generate([[3, 1, 4, 1, 5]],
                                                                                   params)[0]
    assert [tokens["r"], tokens[("r", 1)]] == reference.completions


def test_first_step_continues_a_timeline(tiny):
    engine = Engine(tiny, num_blocks=32, block_size=4, max_num_seqs=2)
    records = []
    for group in ([0, 1], [2]):
        for i in group:
            engine.add_request([i + 1, 7], SamplingParams(max_tokens=2, ignore_eos=True), request_id=i)
        records += run_recorded(engine, first_step=len(records))
    assert [r.step for r in records] == list(range(len(records))) and len(records) == 4
    assert state_grid(records, [0, 1, 2])[2] == [WAITING, WAITING, PREFILL, DECODE]


def test_token_times_and_latency(tiny):
    _, records = run(tiny, prompts(3, 2, 5), [1, 3, 2], num_blocks=32, max_num_seqs=2)
    times = token_times(records)
    for rid, steps in token_steps(records).items():
        assert len(times[rid]) == len(steps)
        assert times[rid] == sorted(times[rid]) and times[rid][0] > 0
    assert times[2][-1] == pytest.approx(sum(r.seconds for r in records))
    metrics = latency_metrics([0.0] * 3, [times[i] for i in range(3)])
    assert metrics[0] == (times[0][0], None)
    assert metrics[1][1] == pytest.approx((times[1][2] - times[1][0]) / 2)


def test_latency_metrics_by_hand_and_bad_input():
    assert latency_metrics([0.0, 1.0], [[0.5, 0.7, 1.3], [1.25]]) == [(0.5, pytest.approx(0.4)), (0.25, None)]
    with pytest.raises(ValueError, match="2 arrival times for 1"):
        latency_metrics([0.0, 1.0], [[0.5]])
    with pytest.raises(ValueError, match="request 0 has no tokens"):
        latency_metrics([0.0], [[]])


def test_utilisation_bad_input():
    with pytest.raises(ValueError, match="records is empty"):
        slot_utilisation([], 4)


def test_draw_timeline(tiny):
    import matplotlib.pyplot as plt

    from radarlab.viz.timeline_plot import draw_timeline

    ps = prompts(6, 3, 9, seed=3)
    engine, records = run(tiny, ps, [8] * 6, num_blocks=8, max_num_seqs=6, enable_prefix_caching=False)
    fig, ax = plt.subplots()
    draw_timeline(ax, records, list(range(6)), annotate=True, title="t")
    image = ax.get_images()[0].get_array()
    assert image.shape == (6, len(records))
    assert len([ln for ln in ax.lines if ln.get_marker() == "x"]) == engine.scheduler.num_preemptions > 0
    chunks = sum(w.kind in (PREFILL, RECOMPUTE) for r in records for w in r.scheduled)
    assert len(ax.texts) == chunks
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "preempted" in labels and "recompute after preemption" in labels
    with pytest.raises(ValueError, match="records is empty"):
        draw_timeline(ax, [], [0])
    plt.close(fig)
