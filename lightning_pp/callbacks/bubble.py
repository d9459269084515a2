"""Bubble time: how long each rank computed, waited, idled, against the simulator's prediction."""

from __future__ import annotations

import lightning.pytorch as pl

from .analysis import BubbleStats, bubble_stats, split_pipelines
from .base import PipelineCallback


class PipelineBubbleMonitor(PipelineCallback):
    """Logs the measured pipeline bubble and the bubble the schedule should have.

    After a measured training step every rank's step record is gathered (one all-gather); the
    bubble is ``sum(idle) / sum(compute)`` over a pipeline's ranks, the simulator's
    ``bubble_ratio`` definition, and ``pp/bubble_expected`` is :func:`simulate` of the same
    schedule fed with the *measured* per-(rank, chunk) forward/backward times. See
    :mod:`lightning_pp.callbacks.analysis` for the exact definitions and the clock alignment.

    Logged keys (seconds, ratios; pipeline values averaged over data-parallel replicas):
    ``pp/bubble_fraction``, ``pp/bubble_expected``, ``pp/step_time_s``,
    ``pp/step_time_expected_s``, ``pp/comm_wait_s`` (mean per rank), ``pp/start_skew_s``,
    ``pp/step_tail_s``, ``pp/p2p_latency_s``, ``pp/recv_overhead_s``, and per
    global rank ``pp/rank{r}/compute_s``, ``pp/rank{r}/comm_wait_s``, ``pp/rank{r}/idle_fraction``.

    Args:
        every_n_steps: measure every n-th batch (default: the Trainer's ``log_every_n_steps``).
        prog_bar: show ``pp/bubble_fraction`` and ``pp/bubble_expected`` in the progress bar.
        per_rank: also log the per-rank keys.

    Example::

        trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=4, microbatches=8),
                            callbacks=[PipelineBubbleMonitor(prog_bar=True)])

    ``last_stats`` holds the latest :class:`BubbleStats` per pipeline, on every rank.
    """

    def __init__(
        self, every_n_steps: int | None = None, prog_bar: bool = False, per_rank: bool = True
    ) -> None:
        super().__init__(every_n_steps)
        self.prog_bar = prog_bar
        self.per_rank = per_rank
        self.last_stats: list[BubbleStats] = []

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        if not self._due(trainer):
            return
        step = self._gather(trainer)
        if step is None:
            return
        pp = step.records[0].schedule.pp
        stats = []
        for line in split_pipelines(step.records, pp):
            stats.append(
                bubble_stats([step.records[i] for i in line], [step.offsets[i] for i in line])
            )
        self.last_stats = stats
        n = len(stats)
        metrics = {
            "pp/bubble_fraction": sum(s.bubble for s in stats) / n,
            "pp/bubble_expected": sum(s.expected_bubble for s in stats) / n,
            "pp/step_time_s": sum(s.span for s in stats) / n,
            "pp/step_time_expected_s": sum(s.expected_makespan for s in stats) / n,
            "pp/comm_wait_s": sum(sum(s.comm_wait) / len(s.comm_wait) for s in stats) / n,
            "pp/start_skew_s": sum(s.start_skew for s in stats) / n,
            "pp/step_tail_s": sum(s.tail for s in stats) / n,
            "pp/p2p_latency_s": sum(s.latency for s in stats) / n,
            "pp/recv_overhead_s": sum(s.recv_overhead for s in stats) / n,
        }
        if self.per_rank:
            for line, s in zip(split_pipelines(step.records, pp), stats):
                for p, i in enumerate(line):
                    r = step.records[i].rank
                    metrics[f"pp/rank{r}/compute_s"] = s.compute[p]
                    metrics[f"pp/rank{r}/comm_wait_s"] = s.comm_wait[p]
                    metrics[f"pp/rank{r}/idle_fraction"] = s.idle_fraction[p]
        shown = {"pp/bubble_fraction", "pp/bubble_expected"} if self.prog_bar else set()
        self._log(trainer, pl_module, metrics, shown)
