"""What a run did, told at its end: the schedule run, bubble vs the simulator, memory, speed, loss.

:class:`RunSummary` is a Lightning callback. During training it keeps cheap per-step facts (the
loss, tokens and wall time of every step, this rank's engine record of the last few steps); on a
cadence (the Trainer's ``log_every_n_steps``) it joins the pipeline callbacks' one gather per
measured step and turns the window of steps since the last measurement into the *pipeline*
bubble, with :func:`~lightning_pp.callbacks.analysis.bubble_stats` (measured and simulated, over
every pipeline rank); at the end of ``fit`` global rank 0 prints a short summary and writes,
into the logger's directory:

* ``summary.txt`` (what was printed) and ``summary.json`` (the same numbers, machine-readable);
* ``loss_curve.png`` (train loss per step, validation loss at each validation);
* the timeline PNG of one measured step is :class:`~lightning_pp.callbacks.PipelineTimeline`'s
  own file; the summary names it.

Memory and the timeline are read from :class:`~lightning_pp.callbacks.ActivationMemoryMonitor`
and :class:`~lightning_pp.callbacks.PipelineTimeline` when they are among the trainer's callbacks
(``lightning-pp fit`` adds them); nothing here measures twice.

Example::

    from lightning_pp.callbacks import ActivationMemoryMonitor, PipelineTimeline
    from lightning_pp.callbacks.summary import RunSummary

    trainer = L.Trainer(devices=4, strategy=PipelineStrategy(pp=2, microbatches=4),
                        callbacks=[ActivationMemoryMonitor(), PipelineTimeline(every_n_steps=300),
                                   RunSummary()])
    trainer.fit(model, datamodule)      # rank 0 prints the summary; files in trainer.log_dir
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections import deque
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from ..runtime.records import StepRecord
from ..schedules import render_grid, simulate
from .analysis import BubbleStats, bubble_stats, split_pipelines
from .base import PipelineCallback
from .gather import register_extra, unregister_extra
from .run_facts import (
    BUBBLE_EXPECTED_KEY,
    BUBBLE_KEY,
    BUBBLE_STEPS_KEY,
    batch_tokens,
    data_parallel_size,
)

__all__ = [
    "BUBBLE_EXPECTED_KEY",
    "BUBBLE_KEY",
    "BUBBLE_STEPS_KEY",
    "LossHistory",
    "RunSummary",
    "WindowBubble",
    "format_summary",
    "window_bubble",
    "write_loss_curve",
]


_EXTRA = "run_summary_window"


@dataclasses.dataclass
class WindowBubble:
    """The pipeline bubble over several steps of every pipeline (times in seconds, sums).

    ``bubble = idle / compute`` and ``expected = expected_idle / expected_busy``, each summed over
    all steps and all pipelines before dividing (a ratio of sums, so a slow step weighs what it
    cost). Per global rank: ``compute``, ``comm_wait`` and ``idle`` summed over the steps.
    """

    steps: int = 0
    idle: float = 0.0
    compute: float = 0.0
    expected_idle: float = 0.0
    expected_busy: float = 0.0
    span: float = 0.0
    tail: float = 0.0
    rank_compute: dict[int, float] = dataclasses.field(default_factory=dict)
    rank_wait: dict[int, float] = dataclasses.field(default_factory=dict)
    rank_idle: dict[int, float] = dataclasses.field(default_factory=dict)
    rank_engine: dict[int, float] = dataclasses.field(default_factory=dict)
    pipelines: int = 1

    @property
    def bubble(self) -> float:
        return self.idle / self.compute if self.compute > 0 else 0.0

    @property
    def expected(self) -> float:
        return self.expected_idle / self.expected_busy if self.expected_busy > 0 else 0.0

    def add(self, other: WindowBubble) -> None:
        """Accumulate ``other`` (a later window) into this one."""
        for name in ("steps", "idle", "compute", "expected_idle", "expected_busy", "span", "tail"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("rank_compute", "rank_wait", "rank_idle", "rank_engine"):
            mine = getattr(self, name)
            for r, v in getattr(other, name).items():
                mine[r] = mine.get(r, 0.0) + v
        self.pipelines = other.pipelines


class LossHistory:
    """The train loss of every step for the loss curve, in bounded memory: plain floats, at most
    ``max_points`` of them however long the run.

    A step's loss arrives as a tensor (the logged metric). Keeping that tensor (as the summary
    once did, one per step on global rank 0) grew the process by a tensor per step for the whole
    run, on CUDA a device allocation each. Here at most ``flush_every`` of them wait, to be read
    in one transfer (no device sync per step), and become floats. When ``max_points`` is
    exceeded every other point is dropped and only every ``stride``-th later step is kept, so
    the points stay evenly spread over the whole run; the latest step is always kept.

    Example:
        >>> h = LossHistory(max_points=4, flush_every=2)
        >>> for step in range(1, 11):
        ...     h.add(step, float(step))
        >>> h.points()
        [(1, 1.0), (5, 5.0), (9, 9.0), (10, 10.0)]
    """

    def __init__(self, max_points: int = 4096, flush_every: int = 64) -> None:
        if max_points < 2 or flush_every < 1:
            raise ValueError(
                f"LossHistory needs max_points >= 2 and flush_every >= 1, got {max_points} "
                f"and {flush_every}"
            )
        self.max_points = max_points
        self.flush_every = flush_every
        self.stride = 1
        self._points: list[tuple[int, float]] = []
        self._pending: list[tuple[int, Any]] = []
        self._seen = 0
        self._last: tuple[int, float] | None = None

    def __len__(self) -> int:
        return len(self._points) + len(self._pending)

    def add(self, step: int, value: Any) -> None:
        """Record ``value`` (a scalar tensor or a number) for ``step``."""
        if isinstance(value, torch.Tensor) and value.requires_grad:
            value = value.detach()
        self._pending.append((step, value))
        if len(self._pending) >= self.flush_every:
            self._flush()

    def points(self) -> list[tuple[int, float]]:
        """``(step, loss)`` in step order: the kept points and the latest step."""
        self._flush()
        last = self._last
        return self._points + ([last] if last is not None and self._points[-1] != last else [])

    def _flush(self) -> None:
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        tensors = [v for _, v in pending if isinstance(v, torch.Tensor)]
        read = iter(
            torch.stack([t.float().reshape(()) for t in tensors]).tolist() if tensors else []
        )
        for step, v in pending:
            value = next(read) if isinstance(v, torch.Tensor) else float(v)
            self._last = (step, value)
            if self._seen % self.stride == 0:
                self._points.append(self._last)
            self._seen += 1
            if len(self._points) > self.max_points:
                self._points = self._points[::2]
                self.stride *= 2


def _stats_add(out: WindowBubble, stats: BubbleStats, ranks: list[int]) -> None:
    compute = sum(stats.compute)
    out.idle += stats.bubble * compute
    out.compute += compute
    out.expected_busy += compute
    out.expected_idle += stats.expected_bubble * compute
    out.span += stats.span
    out.tail += stats.tail
    for p, r in enumerate(ranks):
        out.rank_compute[r] = out.rank_compute.get(r, 0.0) + stats.compute[p]
        out.rank_wait[r] = out.rank_wait.get(r, 0.0) + stats.comm_wait[p]
        out.rank_idle[r] = out.rank_idle.get(r, 0.0) + stats.idle[p]


def window_bubble(
    windows: list[list[tuple[int, StepRecord]]], offsets: list[float]
) -> WindowBubble:
    """The pipeline bubble over the steps every rank recorded, from each rank's window of records.

    ``windows[g]``: global rank g's ``(step, record)`` pairs; ``offsets[g]``: its clock reference
    from the gather (one per rank: a process's clock is the same for every step of the window).
    Each step of each pipeline goes through :func:`bubble_stats` (measured over all the
    pipeline's ranks, and the simulator fed with that step's measured costs); the results are
    summed (:class:`WindowBubble`). The expectation is weighted by the measured compute, so
    ``expected`` compares with ``bubble`` step for step.

    Example:
        >>> from lightning_pp.runtime.records import StepEvent
        >>> from lightning_pp.schedules import build_schedule
        >>> s = build_schedule("1f1b", pp=2, microbatches=4)
        >>> sim = simulate(s)                     # a perfect "measurement" at t_f=1, t_b=2
        >>> recs = [StepRecord(r, r, s, t0=0.0, t1=sim.makespan,
        ...                    events=[StepEvent(a, t0, t1) for a, t0, t1 in sim.timeline[r]])
        ...         for r in range(2)]
        >>> w = window_bubble([[(1, recs[0]), (2, recs[0])], [(1, recs[1]), (2, recs[1])]],
        ...                   [0.0, 0.0])
        >>> w.steps, round(w.bubble, 4), round(w.expected, 4)
        (2, 0.25, 0.25)
    """
    out = WindowBubble()
    if not windows or not all(windows):
        return out
    by_rank = [dict(w) for w in windows]
    steps = sorted(set.intersection(*(set(d) for d in by_rank)))
    pp = next(iter(by_rank[0].values())).schedule.pp
    for step in steps:
        records = [d[step] for d in by_rank]
        lines = split_pipelines(records, pp)
        out.pipelines = len(lines)
        for line in lines:
            recs = [records[i] for i in line]
            stats = bubble_stats(recs, [offsets[i] for i in line])
            _stats_add(out, stats, [recs[p].rank for p in range(len(recs))])
        for rec in records:
            out.rank_engine[rec.rank] = out.rank_engine.get(rec.rank, 0.0) + (rec.t1 - rec.t0)
        out.steps += 1
    return out


def _strip(record: StepRecord) -> StepRecord:
    # Every rank holds the same schedule: send the record without it and re-attach on arrival.
    return dataclasses.replace(record, schedule=None)  # type: ignore[arg-type]


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


def _fmt_time(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s" if m else f"{seconds:.1f}s"


class RunSummary(PipelineCallback):
    """Collects, on a cadence, what the end-of-fit summary shows; rank 0 prints and writes it.

    Args:
        every_n_steps: measure the pipeline bubble every n-th batch over the steps since the last
            measurement (default: the Trainer's ``log_every_n_steps``). Measured steps are the
            ones :class:`~lightning_pp.callbacks.PipelineBubbleMonitor` also measures by
            default, so the callbacks share one gather.
        dirpath: where the files go (default: ``trainer.log_dir``, next to the logs).
        max_window: at most this many steps of records are kept and sent per measurement.
        print_summary: print the summary on global rank 0 at the end of ``fit``.
        loss_name / val_loss_name: the logged metrics drawn in ``loss_curve.png``.

    Logged at each measurement (every rank holds the same value): ``pp/bubble_window`` (idle /
    compute over every pipeline rank and every step of the window, the simulator's definition)
    and ``pp/bubble_window_expected`` (the simulator fed each step's measured costs and
    latencies). The progress bars of :mod:`lightning_pp.callbacks.progress` show both.

    Example:
        >>> cb = RunSummary(every_n_steps=10)
        >>> cb.every_n_steps, cb.max_window
        (10, 32)

    After ``fit``: ``summary`` (a dict, the content of ``summary.json``) and ``written`` (paths)
    on global rank 0.
    """

    def __init__(
        self,
        every_n_steps: int | None = None,
        dirpath: str | Path | None = None,
        max_window: int = 32,
        print_summary: bool = True,
        loss_name: str = "train_loss",
        val_loss_name: str = "val_loss",
    ) -> None:
        super().__init__(every_n_steps)
        if max_window < 1:
            raise ValueError(f"max_window must be a positive integer, got {max_window!r}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.max_window = max_window
        self.print_summary = print_summary
        self.loss_name = loss_name
        self.val_loss_name = val_loss_name
        self.summary: dict[str, Any] = {}
        self.written: list[Path] = []
        self.text = ""
        self._default_dir: Path | None = None
        self._reset()

    def _reset(self) -> None:
        self._window: deque[tuple[int, StepRecord]] = deque(maxlen=self.max_window)
        self._total = WindowBubble()
        self._last_window: WindowBubble | None = None
        self._losses = LossHistory()
        self._val: list[tuple[int, float]] = []
        self._t_fit = 0.0
        self._t_train = 0.0  # seconds spent in training batches (validation excluded)
        self._t_last: float | None = None
        self._train_steps = 0
        self._tokens = 0
        self._batch_tokens = 0
        self._first_val_step: int | None = None
        self._schedule: Any = None

    # -- collection -------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            self._reset()
            # trainer.log_dir is a collective (a broadcast from rank 0): resolve it on every
            # rank here; on_fit_end writes on rank 0 alone.
            if self.dirpath is None:
                self._default_dir = Path(trainer.log_dir or trainer.default_root_dir)
            # Whichever pipeline callback gathers first on a measured step sends this rank's
            # window along (one collective per measured step for all of them).
            register_extra(_EXTRA, lambda: self._payload(trainer))

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            unregister_extra(_EXTRA)

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_fit = time.perf_counter()

    @override
    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._batch_tokens = batch_tokens(batch) * data_parallel_size(trainer)
        if self._t_last is None:
            self._t_last = time.perf_counter()

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self._t_last is not None:
            self._t_train += now - self._t_last
        self._t_last = now
        self._train_steps += 1
        self._tokens += self._batch_tokens
        step = trainer.global_step
        loss = trainer.callback_metrics.get(self.loss_name)
        if loss is not None and trainer.is_global_zero:
            self._losses.add(step, loss)
        self._keep(trainer)
        if not self._due(trainer):
            return
        gathered = self._gather(trainer)
        if gathered is None:
            return
        schedule = gathered.records[0].schedule
        windows = [
            [(s, dataclasses.replace(r, schedule=schedule)) for s, r in x.get(_EXTRA, [])]
            for x in gathered.extras
        ]
        window = window_bubble(windows, gathered.offsets)
        self._window.clear()
        if window.steps == 0:
            return
        self._last_window = window
        self._total.add(window)
        metrics = {
            BUBBLE_KEY: window.bubble,
            BUBBLE_EXPECTED_KEY: window.expected,
            BUBBLE_STEPS_KEY: window.steps,
        }
        self._log(trainer, pl_module, metrics)
        # Rank 0 computed while the others waited: the next step starts level again.
        self._t_last = time.perf_counter()

    def _keep(self, trainer: pl.Trainer) -> None:
        """Add this step's record to the window (once)."""
        record = self._record(trainer)
        if record is not None and not (self._window and self._window[-1][1] is record):
            self._window.append((trainer.global_step, record))
            self._schedule = record.schedule  # the training schedule (eval records differ)

    def _payload(self, trainer: pl.Trainer) -> list[tuple[int, StepRecord]]:
        # Called inside the gather, possibly by another callback before this one's
        # on_train_batch_end: the current step's record must be in the window already.
        self._keep(trainer)
        return [(s, _strip(r)) for s, r in self._window]

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_last = None  # validation time is not training time

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._t_last = None
        if trainer.sanity_checking:
            return
        value = trainer.callback_metrics.get(self.val_loss_name)
        if value is not None:
            self._val.append((trainer.global_step, float(value)))

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.is_global_zero:
            return
        try:
            self.summary = self._build(trainer)
            self.text = format_summary(self.summary)
            self._write(trainer)
        except Exception as err:  # a report must not turn a finished training into a failure
            rank_zero_warn(
                f"rank 0: could not build the run summary after step {trainer.global_step} "
                f"({type(err).__name__}: {err}); training itself finished normally"
            )
            return
        if self.print_summary:
            print(self.text, flush=True)

    # -- the summary ------------------------------------------------------------------------
    def _memory(self, trainer: pl.Trainer) -> list[dict[str, Any]]:
        from . import ActivationMemoryMonitor

        for cb in trainer.callbacks:
            if isinstance(cb, ActivationMemoryMonitor) and cb.last_stats:
                return [dataclasses.asdict(s) for s in cb.last_stats]
        return []

    def _timeline(self, trainer: pl.Trainer) -> dict[str, str]:
        from . import PipelineTimeline

        out: dict[str, str] = {}
        for cb in trainer.callbacks:
            if isinstance(cb, PipelineTimeline):
                for path in cb.written:
                    out[path.suffix.lstrip(".")] = str(path)
        return out

    def _build(self, trainer: pl.Trainer) -> dict[str, Any]:
        schedule = self._schedule
        losses = self._losses.points()
        steps = self._train_steps
        wall = time.perf_counter() - self._t_fit if self._t_fit else 0.0
        out: dict[str, Any] = {
            "steps": trainer.global_step,
            "world_size": trainer.world_size,
            "fit_seconds": wall,
            "train_seconds": self._t_train,
            "tokens": self._tokens,
            "tokens_per_s": self._tokens / self._t_train if self._t_train > 0 else None,
            "step_seconds": self._t_train / steps if steps else None,
            "train_loss": losses,
            "val_loss": self._val,
        }
        if schedule is not None:
            # The schedule the engine ran (from its record, not from the config), drawn with
            # the simulator's default costs: the order of work, compact.
            ideal = simulate(schedule)
            grid = render_grid(ideal, metrics=False)
            if schedule.pp <= 8 and len(grid.splitlines()[0]) > 160:
                grid = "\n".join(line[:157] + "..." for line in grid.splitlines())
            out["schedule"] = {
                "name": schedule.name,
                "pp": schedule.pp,
                "vpp": schedule.vpp,
                "microbatches": schedule.microbatches,
                "dp": trainer.world_size // schedule.pp,
                "grid": grid,
                "ideal_bubble": ideal.bubble_ratio,
                "inflight_bound": ideal.peak_inflight,
            }
        total = self._total
        if total.steps:
            n = total.steps
            per_pipeline = n * total.pipelines
            out["bubble"] = {
                "measured": total.bubble,
                "expected": total.expected,
                "measured_steps": n,
                "last_window": (
                    {"measured": self._last_window.bubble, "expected": self._last_window.expected}
                    if self._last_window is not None
                    else None
                ),
                "ranks": {
                    str(r): {
                        "compute_s": total.rank_compute[r] / n,
                        "comm_wait_s": total.rank_wait.get(r, 0.0) / n,
                        "idle_s": total.rank_idle.get(r, 0.0) / n,
                        "engine_s": total.rank_engine.get(r, 0.0) / n,
                    }
                    for r in sorted(total.rank_compute)
                },
                "span_s": total.span / per_pipeline,
                "tail_s": total.tail / per_pipeline,
            }
        memory = self._memory(trainer)
        if memory:
            out["memory"] = memory
        files = self._timeline(trainer)
        if files:
            out["timeline"] = files
        return out

    def _dir(self, trainer: pl.Trainer) -> Path:
        if self.dirpath is not None:
            return self.dirpath
        return self._default_dir or Path(trainer.default_root_dir)

    def _write(self, trainer: pl.Trainer) -> None:
        out = self._dir(trainer)
        out.mkdir(parents=True, exist_ok=True)
        self.written = []
        png = write_loss_curve(
            self.summary.get("train_loss", []),
            self.summary.get("val_loss", []),
            out / "loss_curve.png",
        )
        if png is not None:
            self.summary["loss_curve"] = str(png)
        self.summary["summary_txt"] = str(out / "summary.txt")
        self.summary["summary_json"] = str(out / "summary.json")
        self.text = format_summary(self.summary)
        (out / "summary.txt").write_text(self.text + "\n")
        (out / "summary.json").write_text(json.dumps(self.summary, indent=1) + "\n")
        self.written = [out / "summary.txt", out / "summary.json"] + ([png] if png else [])

    def add_sample(self, prompt: str, text: str, caption: str) -> None:
        """Append the generated sample to the summary and rewrite its files (global rank 0)."""
        if not self.summary:
            return
        self.summary["sample"] = {"prompt": prompt, "text": text, "caption": caption}
        self.text = format_summary(self.summary)
        txt, js = self.summary.get("summary_txt"), self.summary.get("summary_json")
        if txt and js:
            Path(txt).write_text(self.text + "\n")
            Path(js).write_text(json.dumps(self.summary, indent=1) + "\n")


# --------------------------------------------------------------------------------------------
# Rendering (plain functions of the summary dict)
# --------------------------------------------------------------------------------------------


def write_loss_curve(
    train: list[tuple[int, float]], val: list[tuple[int, float]], path: Path
) -> Path | None:
    """Train loss per step (raw and smoothed) and validation loss, as a PNG; ``None`` without
    matplotlib or without any loss."""
    if not train and not val:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7.5, 4.0), dpi=100)
    if train:
        xs, ys = zip(*train)
        ax.plot(xs, ys, color="tab:blue", alpha=0.3, linewidth=1, label="train loss (per step)")
        smooth, ema = [], ys[0]
        for y in ys:  # exponential moving average, ~20 steps
            ema = 0.9 * ema + 0.1 * y
            smooth.append(ema)
        ax.plot(xs, smooth, color="tab:blue", linewidth=2, label="train loss (smoothed)")
    if val:
        xs, ys = zip(*val)
        ax.plot(xs, ys, "o-", color="tab:orange", linewidth=2, label="validation loss")
        ax.annotate(f"{ys[-1]:.3f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(4, 6))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("cross-entropy (nats per token)")
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title("loss")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def _rank_table(bubble: dict[str, Any]) -> list[str]:
    lines = ["  rank  compute/step  recv wait  idle (of the schedule window)"]
    span = bubble["span_s"]
    for r, v in bubble["ranks"].items():
        share = v["idle_s"] / span if span > 0 else 0.0
        lines.append(
            f"  {r:>4}  {v['compute_s'] * 1e3:9.1f} ms  {v['comm_wait_s'] * 1e3:6.1f} ms  "
            f"{v['idle_s'] * 1e3:6.1f} ms ({share:.0%})"
        )
    return lines


def format_summary(s: dict[str, Any]) -> str:
    """The printed summary (also ``summary.txt``) from the :class:`RunSummary` dict."""
    lines = ["", "=" * 30 + " lightning-pp: run summary " + "=" * 30]
    sched = s.get("schedule")
    shape = ""
    if sched:
        shape = (
            f", pp={sched['pp']} x dp={sched['dp']}"
            + (f" x vpp={sched['vpp']}" if sched["vpp"] > 1 else "")
            + f", {sched['name']} with {sched['microbatches']} microbatches"
        )
    lines.append(
        f"run        {s['steps']} steps in {_fmt_time(s['fit_seconds'])} "
        f"(training {_fmt_time(s['train_seconds'])}), {s['world_size']} processes{shape}"
    )
    train, val = s.get("train_loss") or [], s.get("val_loss") or []
    if train:
        loss = f"train {train[0][1]:.3f} (step {train[0][0]}) -> {train[-1][1]:.3f}"
        loss += f" (step {train[-1][0]})"
        if val:
            loss += f"; validation {val[-1][1]:.3f} at step {val[-1][0]}"
            loss += " (final validation)" if val[-1][0] == s["steps"] else ""
        lines.append(f"loss       {loss}")
    if s.get("tokens_per_s"):
        lines.append(
            f"speed      {s['tokens_per_s']:,.0f} tokens/s over all replicas (training time "
            f"only), {s['step_seconds'] * 1e3:.0f} ms per step"
        )
    bubble = s.get("bubble")
    if bubble and s.get("step_seconds"):
        step_ms = s["step_seconds"] * 1e3
        engine = sum(v["engine_s"] for v in bubble["ranks"].values()) / len(bubble["ranks"])
        span, tail = bubble["span_s"] * 1e3, bubble["tail_s"] * 1e3
        comp = [v["compute_s"] for v in bubble["ranks"].values()]
        wait = [v["comm_wait_s"] for v in bubble["ranks"].values()]
        lines.append(
            f"step time  {step_ms:.0f} ms = schedule window {span:.0f} ms (per rank: compute "
            f"{1e3 * sum(comp) / len(comp):.0f}, blocked on receives "
            f"{1e3 * sum(wait) / len(wait):.0f}, rest idle) + after the last action "
            f"{tail:.0f} ms (last sends, loss broadcast) + outside the engine "
            f"{max(step_ms - engine * 1e3, 0.0):.0f} ms (optimizer, gradient sync, data, "
            f"Lightning, measuring)"
        )
    if sched:
        lines.append(
            f"schedule   {sched['name']} as run by the engine (cells at the default costs "
            f"t_b = 2 t_f; '.' idle):"
        )
        lines += ["  " + line for line in sched["grid"].splitlines()]
    if bubble:
        last = bubble.get("last_window") or {}
        lines.append(
            f"bubble     measured {bubble['measured']:.1%} vs simulator {bubble['expected']:.1%} "
            f"(idle / compute over all pipeline ranks, {bubble['measured_steps']} measured "
            f"steps; the simulator runs the same schedule on each step's measured costs)"
        )
        extra = f"last window {last['measured']:.1%} vs {last['expected']:.1%}; " if last else ""
        lines.append(
            f"           {extra}textbook (p-1)/m at t_b = 2 t_f: {sched['ideal_bubble']:.1%}"
            if sched
            else f"           {extra}".rstrip()
        )
        lines += _rank_table(bubble)
    memory = s.get("memory")
    if memory:
        lines.append("memory     peak activation bytes saved for backward (last measured step):")
        for m in memory:
            per_mb = m["saved_bytes"] / m["inflight"] if m["inflight"] else 0.0
            lines.append(
                f"  rank {m['rank']} (stage {m['pp_rank']}): {_fmt_bytes(m['saved_bytes'])} "
                f"with {m['inflight']} microbatches in flight; schedule bound "
                f"{m['inflight_bound']} (= {_fmt_bytes(per_mb * m['inflight_bound'])})"
            )
    files = []
    if s.get("loss_curve"):
        files.append(f"  loss curve        {s['loss_curve']}")
    timeline = s.get("timeline") or {}
    if "png" in timeline:
        files.append(f"  timeline (1 step) {timeline['png']}")
    if "json" in timeline:
        files.append(f"  Perfetto trace    {timeline['json']}")
    if s.get("summary_json"):
        files.append(f"  this summary      {s['summary_txt']} and {s['summary_json']}")
    if files:
        lines.append("files")
        lines += files
    sample = s.get("sample")
    if sample:
        lines.append(f"sample     {sample['caption']}")
        lines.append(sample["prompt"] + sample["text"])
    lines.append("=" * 87)
    return "\n".join(lines)


def bits_per_char(nats: float) -> float:
    """Cross-entropy in nats per character -> bits per character."""
    return nats / math.log(2)
