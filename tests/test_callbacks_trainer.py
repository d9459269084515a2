"""The three pipeline callbacks in one real Trainer run with PipelineStrategy (4 gloo ranks).

The run is one case of the shared 4-rank Trainer world (:mod:`worlds`; a timeout kills it).
Rank 0 writes what it saw; the test checks the logged keys (CSV logger), the TensorBoard image,
the trace and the PNG. (Lightning's own launcher has its tests in test_strategy.py,
test_lightning_hooks.py and test_cli_fit.py.) Also runnable as a script:
``python tests/test_callbacks_trainer.py --out DIR``.
"""

from __future__ import annotations

import argparse
import csv
import json
from pathlib import Path
from statistics import median

import pytest
from worlds import world

# Timing: the measured bubble is compared with the simulator's within 2 points. Runs after every
# background job (conftest.py).
pytestmark = pytest.mark.timing


PP, M, MB_SIZE, WIDTH, STEPS = 4, 8, 2, 16, 6
T_F, T_B = 0.060, 0.120  # per stage, seconds: 8 layers, 2 per rank


def main(out: Path) -> None:
    import lightning as L
    import torch
    import torch.nn.functional as F
    from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_pp import PipelineLayers, PipelineMixin, PipelineStrategy
    from lightning_pp.callbacks import (
        ActivationMemoryMonitor,
        PipelineBubbleMonitor,
        PipelineTimeline,
    )
    from lightning_pp.models.virtual_device import sleep_layers

    torch.set_num_threads(1)

    class SleepNet(PipelineMixin, L.LightningModule):
        def configure_model(self) -> None:
            if getattr(self, "layers", None) is None:
                self.layers = PipelineLayers(sleep_layers(8, WIDTH, T_F / 2, T_B / 2), seed=0)

        def pipeline_input(self, batch):
            return batch[0]

        def pipeline_loss(self, output, batch):
            return F.mse_loss(output, batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.01)

    g = torch.Generator().manual_seed(0)
    n = M * MB_SIZE * STEPS
    data = TensorDataset(torch.randn(n, WIDTH, generator=g), torch.randn(n, WIDTH, generator=g))
    bubble = PipelineBubbleMonitor(every_n_steps=1, prog_bar=True)
    memory = ActivationMemoryMonitor(every_n_steps=1)
    timeline = PipelineTimeline(every_n_steps=2, dirpath=out / "timeline")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=PP,
        strategy=PipelineStrategy(pp=PP, microbatches=M),
        max_steps=STEPS,
        logger=[CSVLogger(out, name="csv"), TensorBoardLogger(out, name="tb")],
        log_every_n_steps=1,
        callbacks=[bubble, memory, timeline],
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer.fit(SleepNet(), DataLoader(data, batch_size=M * MB_SIZE))
    if trainer.is_global_zero:
        result = {
            "callback_metrics": sorted(trainer.callback_metrics),
            "bubble": [[s.bubble, s.expected_bubble] for s in bubble.last_stats],
            "memory": [vars(s) for s in memory.last_stats],
            "written": [str(p) for p in timeline.written],
        }
        (out / "result.json").write_text(json.dumps(result))


def _rank(rank: int, size: int, out: str) -> None:
    main(Path(out))


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("callbacks_trainer")
    world("trainer", PP).run(_rank, str(out), timeout=240)
    return out


def test_bubble_keys_logged_and_close_to_expectation(run: Path) -> None:
    rows = list(csv.DictReader(open(next((run / "csv").rglob("metrics.csv")))))
    keys = set(rows[0])
    want = {"pp/bubble_fraction", "pp/bubble_expected", "pp/step_time_s", "pp/comm_wait_s"}
    want |= {f"pp/rank{r}/{k}" for r in range(PP) for k in ("idle_fraction", "compute_s")}
    want |= {f"pp/rank{r}/{k}" for r in range(PP) for k in ("saved_bytes", "inflight_bound")}
    assert want <= keys
    bubble_rows = [r for r in rows if r.get("pp/bubble_fraction")]
    assert len(bubble_rows) == STEPS  # every_n_steps=1
    result = json.loads((run / "result.json").read_text())
    assert "pp/bubble_fraction" in result["callback_metrics"]
    # Steps after the first (gloo connects pairs lazily on first use); their median, since a
    # stall from outside moves one step by several points (tests/test_callbacks_pipeline.py).
    gaps = []
    for row in bubble_rows[1:]:
        measured, expected = float(row["pp/bubble_fraction"]), float(row["pp/bubble_expected"])
        print(f"trainer step {row['step']}: gap {100 * (measured - expected):+.2f} points")
        gaps.append(abs(measured - expected))
    assert median(gaps) < 0.02, gaps


def test_memory_follows_inflight_bound(run: Path) -> None:
    result = json.loads((run / "result.json").read_text())
    stats = result["memory"]
    assert [s["inflight_bound"] for s in stats] == [4, 3, 2, 1]  # 1F1B: p - r
    assert [s["inflight"] for s in stats] == [4, 3, 2, 1]
    assert all(s["saved_bytes"] > 0 for s in stats)  # measure_memory was switched on


def test_timeline_files_and_tensorboard_image(run: Path) -> None:
    written = [Path(p) for p in json.loads((run / "result.json").read_text())["written"]]
    traces = [p for p in written if p.suffix == ".json"]
    pngs = [p for p in written if p.suffix == ".png"]
    assert len(traces) == len(pngs) == STEPS // 2
    trace = json.loads(traces[0].read_text())
    pids = {e["pid"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert pids == set(range(PP))
    assert pngs[0].read_bytes()[:4] == b"\x89PNG"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(next((run / "tb").rglob("events.out.tfevents.*")).parent))
    acc.Reload()
    assert "pp/timeline" in acc.Tags()["images"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    main(parser.parse_args().out)
