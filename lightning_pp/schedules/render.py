"""Draw a schedule: a text grid for terminals and logs, a PNG Gantt chart for reports.

Both draw *time*, not list positions, so bubbles are visible. :func:`render_gantt` takes a plain
per-rank timeline, so a measured timeline (from the engine's step record) draws the same way as
a simulated one.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from .actions import Action, Op, Schedule
from .simulate import Costs, SimResult, simulate

TimelineLike = Sequence[Sequence[tuple[Action, float, float]]]


def _unit(result: SimResult) -> float:
    """Width of one grid cell: the shortest step, so every step spans a whole number of cells
    when costs are commensurate (the default: F one cell, B two)."""
    durations = [end - start for steps in result.timeline for _, start, end in steps]
    positive = [d for d in durations if d > 0]
    return min(positive) if positive else 1.0


def render_grid(
    obj: Schedule | SimResult,
    costs: Costs | None = None,
    metrics: bool = True,
) -> str:
    """Seed-style text grid: one row per rank, time flowing right.

    Each cell is one time unit (the shortest step's duration): a step prints its label (``F3``,
    ``B3``, ``I3``, ``W3``, or ``F3.1`` with the chunk when ``vpp > 1``) in its first cell and
    ``--`` in the cells it continues over; ``.`` is idle. At the default costs (t_b = 2·t_f,
    t_i = t_w = t_f) a fused backward spans two cells and ``I`` / ``W`` one each. Times that
    are not multiples of the unit (custom costs, latency) are rounded to the nearest cell.
    ``metrics`` appends the bubble ratio, makespan and peak in-flight lines.

    Example:
        >>> from lightning_pp.schedules import build_schedule
        >>> print(render_grid(build_schedule("1f1b", pp=2, microbatches=3), metrics=False))
        rank 0 | F0 F1 .  .  B0 -- F2 B1 -- .  B2 --
        rank 1 | .  F0 B0 -- F1 B1 -- F2 B2 -- .  .
    """
    result = obj if isinstance(obj, SimResult) else simulate(obj, costs)
    schedule = result.schedule
    show_chunk = schedule.vpp > 1
    unit = _unit(result)
    cells_total = max(1, round(result.makespan / unit))
    width = max([2] + [len(a.short(show_chunk)) for steps in result.timeline for a, _, _ in steps])
    lines = []
    for r, steps in enumerate(result.timeline):
        row = ["."] * cells_total
        for a, start, end in steps:
            first, last = round(start / unit), max(round(end / unit), round(start / unit) + 1)
            row[first] = a.short(show_chunk)
            for i in range(first + 1, min(last, cells_total)):
                row[i] = "-" * width
        lines.append(f"rank {r} | " + " ".join(c.ljust(width) for c in row).rstrip())
    if metrics:
        lines += metric_lines(result)
    return "\n".join(lines)


def metric_lines(result: SimResult) -> list[str]:
    """The metrics printed under the grid."""
    c = result.costs
    per = "per stage, each chunk t/vpp" if result.schedule.vpp > 1 else "per stage"
    latency = f", latency={c.latency:g}" if c.latency else ""
    backward = (
        f"t_i={c.t_i:g}, t_w={c.t_w:g}" if result.schedule.split_backward else f"t_b={c.t_b:g}"
    )
    return [
        f"bubble ratio:   {result.bubble_ratio:.4f}  "
        f"(idle {result.total_idle:g} / compute {result.total_compute:g})",
        f"makespan:       {result.makespan:g}  (t_f={c.t_f:g}, {backward} {per}{latency})",
        "peak in-flight: " + " ".join(f"r{r}={n}" for r, n in enumerate(result.peak_inflight)),
    ]


#: How each op is drawn in the Gantt chart: (alpha, hatch, hatch/edge colour, legend label).
#: The fill stays the microbatch's colour; the hatch and its colour tell the op apart.
OP_STYLE: dict[Op, tuple[float, str | None, str, str]] = {
    Op.F: (1.0, None, "black", "forward (F)"),
    Op.B: (0.55, "//", "black", "backward (B)"),
    Op.I: (0.55, "\\\\", "tab:blue", "input grad (I)"),
    Op.W: (0.35, "xx", "tab:red", "weight grad (W)"),
}


def render_gantt(
    timeline: TimelineLike | SimResult,
    path: str | Path,
    title: str | None = None,
    show_chunk: bool | None = None,
    time_label: str = "time",
) -> Path:
    """Write a PNG Gantt chart of a per-rank timeline ``[[(action, start, end), ...], ...]``.

    One row per rank (rank 0 on top), one bar per step, coloured by microbatch; forwards are
    solid, fused backwards lighter and hatched in black, input-gradient steps (``I``) hatched
    the other way in blue, weight-gradient steps (``W``) palest and cross-hatched in red
    (:data:`OP_STYLE`); the legend lists the ops present. Each bar is labelled (``F3`` or
    ``F3.1`` with the chunk) when it is wide enough. The timeline may come from
    :func:`simulate` or be measured. Needs matplotlib (``pip install 'lightning-pp[plot]'``).

    Example:
        >>> from lightning_pp.schedules import build_schedule, simulate
        >>> r = simulate(build_schedule("1f1b", pp=4, microbatches=8))
        >>> render_gantt(r.timeline, "/tmp/1f1b.png", title="1F1B")  # doctest: +SKIP
    """
    if isinstance(timeline, SimResult):
        timeline = timeline.timeline
    try:
        import matplotlib

        matplotlib.use("Agg", force=False)
        import matplotlib.pyplot as plt
        from matplotlib.patches import Patch
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "render_gantt needs matplotlib: install the plot extra, "
            "`pip install 'lightning-pp[plot]'`"
        ) from exc

    steps = [s for row in timeline for s in row]
    if show_chunk is None:
        show_chunk = any(a.chunk != 0 for a, _, _ in steps)
    n_ranks = len(timeline)
    t0 = min((start for _, start, _ in steps), default=0.0)
    t1 = max((end for _, _, end in steps), default=1.0)
    span = max(t1 - t0, 1e-12)
    mbs = sorted({a.mb for a, _, _ in steps})
    cmap = plt.get_cmap("tab20" if len(mbs) > 10 else "tab10")
    colour = {mb: cmap(i % cmap.N) for i, mb in enumerate(mbs)}

    # Size the figure so the shortest step gets ~0.33 in: wide enough for its label.
    shortest = min((e - s for _, s, e in steps if e > s), default=span)
    axes_w = min(max(6.0, 0.33 * span / shortest), 28.0)
    fig_w = axes_w + 2.5  # room for rank labels and the legend
    fig, ax = plt.subplots(figsize=(fig_w, 0.6 * n_ranks + 1.6))
    for r, row in enumerate(timeline):
        y = n_ranks - 1 - r
        for a, start, end in row:
            alpha, hatch, edge, _ = OP_STYLE[a.op]
            ax.barh(
                y,
                end - start,
                left=start - t0,
                height=0.8,
                color=colour[a.mb],
                alpha=alpha,
                hatch=hatch,
                edgecolor=edge,
                linewidth=0.5,
            )
            label = a.short(show_chunk)
            # Only label bars wide enough for the text (~0.065 in per character at 7 pt).
            if (end - start) / span * axes_w >= 0.065 * len(label) + 0.02:
                ax.text(
                    (start + end) / 2 - t0,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=7,
                )
    ax.set_yticks(range(n_ranks))
    ax.set_yticklabels([f"rank {r}" for r in reversed(range(n_ranks))])
    ax.set_xlim(0, t1 - t0)
    ax.set_xlabel(time_label)
    if title:
        ax.set_title(title)
    present = {a.op for a, _, _ in steps} | {Op.F}
    legend = [
        Patch(facecolor="lightgray", edgecolor=edge, hatch=hatch, alpha=alpha, label=label)
        for op, (alpha, hatch, edge, label) in OP_STYLE.items()
        if op in present or (op is Op.B and present == {Op.F})
    ]
    ax.legend(handles=legend, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8)
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
