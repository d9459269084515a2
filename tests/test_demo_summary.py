"""The demo's run summary and progress line, unit-tested without processes: the helpers of
:mod:`lightning_pp.callbacks.summary` and :mod:`lightning_pp.callbacks.progress`.

The README's demo itself runs at toy size, end to end, in ``test_cli_fit.py`` (one launch serves
its summary and PNG checks and the two-launcher loss comparison).
"""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from lightning_pp.callbacks.progress import FinalValidation, Throughput, pipeline_bubble
from lightning_pp.callbacks.summary import (
    BUBBLE_EXPECTED_KEY,
    BUBBLE_KEY,
    format_summary,
    window_bubble,
)
from lightning_pp.runtime.records import StepEvent, StepRecord
from lightning_pp.schedules import build_schedule, simulate

# ------------------------------------------------------------------------------ units


def _perfect_records(pp: int, m: int, t0: float = 0.0) -> list[StepRecord]:
    s = build_schedule("1f1b", pp=pp, microbatches=m)
    sim = simulate(s)
    return [
        StepRecord(
            r,
            r,
            s,
            t0=t0,
            t1=t0 + sim.makespan,
            events=[StepEvent(a, t0 + a0, t0 + a1) for a, a0, a1 in sim.timeline[r]],
        )
        for r in range(pp)
    ]


def test_window_bubble_sums_steps_and_pipelines():
    # dp=2: global ranks 0,1 are pp_rank 0 of pipelines 0,1; ranks 2,3 are pp_rank 1
    line = _perfect_records(2, 4)
    recs = [line[0], line[0], line[1], line[1]]
    recs = [
        StepRecord(g, r.pp_rank, r.schedule, r.t0, r.events, t1=r.t1) for g, r in enumerate(recs)
    ]
    windows = [[(1, r), (2, r), (3, r)] for r in recs]
    w = window_bubble(windows, [0.0] * 4)
    assert w.steps == 3 and w.pipelines == 2
    assert w.bubble == pytest.approx(0.25) and w.expected == pytest.approx(0.25)  # (p-1)/m
    assert set(w.rank_compute) == {0, 1, 2, 3}
    assert w.rank_compute[0] == pytest.approx(3 * 12.0)  # 4 x (1 + 2) per step, 3 steps
    # a step missing on one rank is left out, not mismatched
    windows[3] = windows[3][1:]
    assert window_bubble(windows, [0.0] * 4).steps == 2


def test_throughput_is_over_the_window_and_restarts():
    t = Throughput(window=2)
    t.add(0.0, 0)
    assert t.rate() is None
    for i in range(1, 5):
        t.add(float(i), 100 * i)
    assert t.rate() == pytest.approx((300 + 400) / 2)
    t.restart()
    assert t.rate() is None


def test_final_validation_stops_on_the_last_batch_only():
    cb = FinalValidation()

    def trainer(step, epoch=0, max_steps=10, max_epochs=None, batches=100, validation=True):
        return SimpleNamespace(
            enable_validation=validation,
            max_steps=max_steps,
            global_step=step,
            max_epochs=max_epochs,
            current_epoch=epoch,
            num_training_batches=batches,
            should_stop=False,
        )

    for t, batch_idx, stop in (
        (trainer(9), 8, False),
        (trainer(10), 9, True),  # max_steps reached
        (trainer(10, validation=False), 9, False),  # nothing to validate
        (trainer(5, epoch=1, max_steps=-1, max_epochs=2, batches=5), 4, True),  # last epoch
        (trainer(5, epoch=0, max_steps=-1, max_epochs=2, batches=5), 4, False),
    ):
        cb.on_train_batch_end(t, None, None, None, batch_idx)
        assert t.should_stop is stop, (vars(t), batch_idx)


def test_progress_shows_the_pipeline_bubble_next_to_the_simulator():
    assert pipeline_bubble(SimpleNamespace(callback_metrics={})) is None
    metrics = {BUBBLE_KEY: 0.26, BUBBLE_EXPECTED_KEY: 0.25}
    assert pipeline_bubble(SimpleNamespace(callback_metrics=metrics)) == (0.26, 0.25)


def test_format_summary_reads_like_the_demo():
    s = {
        "steps": 300,
        "world_size": 4,
        "fit_seconds": 130.0,
        "train_seconds": 120.0,
        "tokens": 300 * 8192,
        "tokens_per_s": 20480.0,
        "step_seconds": 0.4,
        "train_loss": [(1, 4.7), (300, 1.5)],
        "val_loss": [(100, 2.0), (300, 1.6)],
        "schedule": {
            "name": "1f1b",
            "pp": 2,
            "vpp": 1,
            "microbatches": 4,
            "dp": 2,
            "grid": "rank 0 | F0 F1\nrank 1 | .  F0",
            "ideal_bubble": 0.25,
        },
        "bubble": {
            "measured": 0.27,
            "expected": 0.26,
            "measured_steps": 300,
            "last_window": {"measured": 0.28, "expected": 0.27},
            "ranks": {
                str(r): {"compute_s": 0.3, "comm_wait_s": 0.01, "idle_s": 0.08, "engine_s": 0.39}
                for r in range(4)
            },
            "span_s": 0.38,
            "tail_s": 0.005,
        },
        "memory": [
            {"rank": 0, "pp_rank": 0, "saved_bytes": 2 << 20, "inflight": 2, "inflight_bound": 2}
        ],
        "sample": {"prompt": "def ", "text": "foo():", "caption": "a model"},
    }
    text = format_summary(s)
    assert "300 steps in 2m10s" in text and "pp=2 x dp=2, 1f1b with 4 microbatches" in text
    assert "train 4.700 (step 1) -> 1.500 (step 300); validation 1.600 at step 300" in text
    assert "(final validation)" in text
    assert "measured 27.0% vs simulator 26.0%" in text and "(p-1)/m at t_b = 2 t_f: 25.0%" in text
    assert "2.00 MiB with 2 microbatches in flight; schedule bound 2" in text
    assert "20,480 tokens/s" in text and "step time  400 ms" in text
    assert text.rstrip().endswith("=" * 87) and "def foo():" in text


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))
