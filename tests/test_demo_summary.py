"""The README's demo at toy size: it ends with a final validation, a summary, a loss curve and a
timeline PNG, and its redirected output is plain lines (no carriage-return frames).

Not a timing test: the run is tiny; only files and lines are checked. The helpers in
:mod:`lightning_pp.callbacks.summary` and :mod:`lightning_pp.callbacks.progress` are unit-tested
without processes.
"""

from __future__ import annotations

import json
import re
import struct
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from test_cli_fit import CLI, DEMO, run_all

from lightning_pp.callbacks.progress import FinalValidation, Throughput, pipeline_bubble
from lightning_pp.callbacks.summary import (
    BUBBLE_EXPECTED_KEY,
    BUBBLE_KEY,
    format_summary,
    window_bubble,
)
from lightning_pp.runtime.records import StepEvent, StepRecord
from lightning_pp.schedules import build_schedule, simulate

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from a well-formed PNG's IHDR chunk; fails on anything else."""
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR", f"{path}: no IHDR chunk first"
    assert data[-8:-4] == b"IEND", f"{path}: truncated (no IEND chunk)"
    return struct.unpack(">II", data[16:24])


# ------------------------------------------------------------------------------ end to end

TOY = [
    "model.init_args.n_embd=32",
    "model.init_args.n_layer=2",
    "model.init_args.n_head=2",
    "data.init_args.batch_size=8",
    "data.init_args.block_size=32",
    "data.init_args.max_chars=200000",
    "trainer.max_steps=9",
    "trainer.log_every_n_steps=3",
    "trainer.val_check_interval=4",  # validations at 4 and 8; the final one must add step 9
    "trainer.limit_val_batches=2",
    "sample.max_new_tokens=30",
]


@pytest.mark.timeout(600)
def test_demo_at_toy_size_ends_with_validation_summary_and_pngs(tmp_path):
    root = tmp_path / "run"
    log = tmp_path / "log.txt"
    overrides = [f"trainer.default_root_dir={root}", f"logger.init_args.save_dir={root}"]
    cmd = [*CLI, "fit", DEMO, *TOY, *overrides]
    assert run_all([cmd], timeout=400, logs=[log]) == [0], log.read_text()[-4000:]
    out = log.read_text()

    # Redirected output: plain lines, at most one progress line per logging interval (3 steps)
    assert "\r" not in out, "carriage-return progress frames in a redirected log"
    # (the summary's own "step time ..." line is not a progress line)
    progress = [line for line in out.splitlines() if re.match(r"step \d+/\d+ ", line)]
    assert [line.split()[1] for line in progress] == ["3/9", "6/9", "9/9"], progress
    assert "pipeline bubble" in progress[-1] and "tok/s" in progress[-1]

    # The last step is validated, although val_check_interval does not land on it
    validations = [line for line in out.splitlines() if line.startswith("validation at step")]
    assert [line.split()[3].rstrip(":") for line in validations] == ["4", "8", "9"], validations

    # The summary: printed, and written next to the logs
    assert "lightning-pp: run summary" in out
    jsons = list(root.rglob("summary.json"))
    assert len(jsons) == 1, jsons
    summary = json.loads(jsons[0].read_text())
    assert jsons[0].parent == root / "csv" / "version_0"  # the CSV logger's directory
    assert summary["steps"] == 9
    assert [s for s, _ in summary["train_loss"]] == list(range(1, 10))
    assert summary["val_loss"][-1][0] == 9
    assert summary["tokens"] == 9 * 8 * 32 * 2  # steps x batch x block x dp
    assert summary["schedule"]["name"] == "1f1b" and summary["schedule"]["pp"] == 2
    assert summary["schedule"]["grid"].startswith("rank 0 | F0 F1")
    bubble = summary["bubble"]
    assert bubble["measured_steps"] == 9 and bubble["measured"] > 0 and bubble["expected"] > 0
    assert set(bubble["ranks"]) == {"0", "1", "2", "3"}
    assert all(v["compute_s"] > 0 for v in bubble["ranks"].values())
    memory = {m["rank"]: m for m in summary["memory"]}
    assert set(memory) == {0, 1, 2, 3}
    for m in memory.values():
        assert m["saved_bytes"] > 0
        assert m["inflight"] == m["inflight_bound"] == 2 - m["pp_rank"]  # 1F1B: p - r
    assert summary["sample"]["text"] and "after 9 steps" in summary["sample"]["caption"]
    txt = Path(summary["summary_txt"]).read_text()
    assert "bubble     measured" in txt and "schedule   1f1b" in txt and "sample" in txt

    # Both pictures, well-formed and not trivial
    for key, path in (("loss", summary["loss_curve"]), ("timeline", summary["timeline"]["png"])):
        path = Path(path)
        assert path.is_file(), f"{key}: {path}"
        width, height = png_size(path)
        assert width >= 400 and height >= 200, (key, width, height)
        assert path.stat().st_size > 10_000, f"{key} PNG of {path.stat().st_size} bytes"
    assert str(summary["loss_curve"]) in out and str(summary["timeline"]["png"]) in out


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
