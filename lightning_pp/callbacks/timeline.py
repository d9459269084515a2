"""Timeline: the measured per-rank timeline as a Perfetto/Chrome trace and a PNG Gantt chart."""

from __future__ import annotations

import json
import os
from pathlib import Path

import lightning.pytorch as pl
from typing_extensions import override

from ..schedules import render_gantt
from .analysis import bubble_stats, measured_timeline, split_pipelines, trace_events
from .base import PipelineCallback
from .gather import register_extra, unregister_extra

_LAUNCHES = "dp_launches"


def _launches(trainer: pl.Trainer) -> list[tuple[int, int, int, float]]:
    """This rank's data-parallel gradient collectives of the step: (chunk, bucket, values,
    perf_counter time) of each launch its gradient sync recorded."""
    events = getattr(getattr(trainer.strategy, "grad_sync", None), "events", None) or []
    return [(e.chunk, e.bucket, e.numel, e.time) for e in events]


class PipelineTimeline(PipelineCallback):
    """Every ``every_n_steps`` training batches, writes what every rank did during that step.

    Files (written by global rank 0 into ``dirpath``):

    * ``timeline_step{S}.json``: trace-event JSON (open in https://ui.perfetto.dev or
      ``chrome://tracing``): one track per global rank, one slice per action (``F3``, ``B3`` or
      ``F3.1`` with the chunk), a nested ``wait`` slice for time blocked on receives, and the
      microbatch, chunk, stage, wait and memory numbers as slice arguments; on a second track
      per rank, ``data-parallel``, an instant where each gradient bucket's reduce-scatter (or
      all-reduce) started (``dp reduce c1 b0``: chunk 1, bucket 0);
    * ``timeline_step{S}.png``: Gantt chart of the first pipeline (the schedules' renderer), with
      the measured and expected bubble in the title; also sent to TensorBoard
      (``add_image("pp/timeline", ...)``) when a TensorBoard logger is attached.

    Args:
        every_n_steps: write every n-th training batch (default 50).
        dirpath: output folder; default ``<trainer.log_dir or default_root_dir>/pipeline_timeline``.
        trace / png: which files to write. log_image: send the PNG to TensorBoard.

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8),
                            callbacks=[PipelineTimeline(every_n_steps=100)])

    ``written`` lists the files written so far (on global rank 0).
    """

    def __init__(
        self,
        every_n_steps: int = 50,
        dirpath: str | os.PathLike | None = None,
        trace: bool = True,
        png: bool = True,
        log_image: bool = True,
    ) -> None:
        super().__init__(every_n_steps)
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.trace = trace
        self.png = png
        self.log_image = log_image
        self.written: list[Path] = []
        self._default_dir: Path | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        register_extra(_LAUNCHES, lambda: _launches(trainer))
        # trainer.log_dir is a collective (a broadcast from rank 0): resolve it here, on every
        # rank; _write runs on rank 0 alone and would wait there forever for the others.
        if self.dirpath is None:
            root = trainer.log_dir or trainer.default_root_dir
            self._default_dir = Path(root) / "pipeline_timeline"

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        unregister_extra(_LAUNCHES)

    def _dir(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        if self._default_dir is None:  # used without setup (e.g. called directly)
            self._default_dir = Path(trainer.default_root_dir) / "pipeline_timeline"
        return self._default_dir

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self._due(trainer):
            return
        step = self._gather(trainer)
        if step is None:
            return
        if trainer.is_global_zero:
            self._write(trainer, step)
        # Rank 0 spent time on files; without this the others would start the next step early
        # and that step's measured bubble would include rank 0's writing.
        trainer.strategy.barrier("pipeline_timeline")

    def _write(self, trainer: pl.Trainer, step) -> None:
        out = self._dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        n = self._step(trainer)
        if self.trace:
            path = out / f"timeline_step{n}.json"
            tmp = path.with_suffix(".json.tmp")
            launches = [x.get(_LAUNCHES) for x in step.extras]
            trace = trace_events(step.records, step.offsets, step=n, launches=launches)
            tmp.write_text(json.dumps(trace))
            os.replace(tmp, path)
            self.written.append(path)
        if not self.png:
            return
        line = split_pipelines(step.records, step.records[0].schedule.pp)[0]
        recs = [step.records[i] for i in line]
        offs = [step.offsets[i] for i in line]
        stats = bubble_stats(recs, offs)
        s = recs[0].schedule
        shape = f"pp={s.pp}" + (f" vpp={s.vpp}" if s.vpp > 1 else "") + f" m={s.microbatches}"
        title = (
            f"measured {s.name} {shape}, step {n}: bubble {stats.bubble:.1%} "
            f"(expected {stats.expected_bubble:.1%})"
        )
        path = render_gantt(
            measured_timeline(recs, offs, scale=1e3),
            out / f"timeline_step{n}.png",
            title=title,
            show_chunk=s.vpp > 1,
            time_label="time (ms)",
        )
        self.written.append(path)
        if self.log_image:
            self._send_image(trainer, path, n)

    @staticmethod
    def _send_image(trainer: pl.Trainer, path: Path, step: int) -> None:
        from lightning.pytorch.loggers import TensorBoardLogger

        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                import matplotlib.image as mpimg

                image = mpimg.imread(path)[..., :3]  # RGBA floats in [0, 1] -> RGB
                logger.experiment.add_image("pp/timeline", image, step, dataformats="HWC")
