"""Present a search: the top-k table, and the chosen candidate as a run file for ``fit``;
present a plan's memory: per pipeline rank, and per data-parallel sharding.

Example::

    print(format_table(result.ranked[:5], tokens=True))
    data = chosen_config(cfg.data, result.best, world=4)   # a RunConfig tree
    print(format_memory_table(plan_memory(plan, tensors, costs, states, sharding).ranks))
    print(format_sharding_table(compare_shardings(plan, tensors, costs, states), limit=80 << 30))
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..layout.recompute_spec import format_bytes
from .memory import RankMemory
from .plan_memory import ShardingMemory
from .search import Prediction

__all__ = [
    "chosen_config",
    "format_memory_table",
    "format_sharding_table",
    "format_table",
    "format_tp_table",
]


def _grid(rows: Sequence[Sequence[str]], right: set[int]) -> str:
    """Rows of cells as aligned columns (``right``: the right-aligned column indices), a rule
    of dashes under the first row."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def format_table(predictions: Sequence[Prediction], *, first_rank: int = 1) -> str:
    """One row per prediction: rank, shape ``dp x pp x vpp``, microbatches, schedule, split,
    recompute, data-parallel sharding (``-``, ``zero=1``, ``fsdp``), predicted step time,
    throughput (tokens/s when the profile knows the tokens per sample, else samples/s), bubble
    (idle / compute) and the heaviest pipeline rank's memory."""
    tokens = bool(predictions) and predictions[0].tokens_per_s is not None
    head = (
        "#",
        "dp x pp x vpp",
        "m",
        "schedule",
        "split",
        "recompute",
        "sharding",
        "step ms",
        "tokens/s" if tokens else "samples/s",
        "bubble",
        "peak mem (rank)",
    )
    rows = [head]
    for i, p in enumerate(predictions, start=first_rank):
        c = p.candidate
        rate = p.tokens_per_s if tokens else p.samples_per_s
        rows.append(
            (
                str(i),
                c.shape,
                str(c.microbatches),
                c.schedule,
                f"{c.split} {'/'.join(map(str, c.counts))}",
                c.recompute or "-",
                "-" if c.sharding_label == "none" else c.sharding_label,
                f"{p.step_s * 1e3:.1f}",
                f"{rate:,.0f}",
                f"{100 * p.bubble:.1f}%",
                f"{format_bytes(p.peak_bytes)} ({p.heaviest.rank})",
            )
        )
    return _grid(rows, {0, 2, 7, 8, 9})


def _state_cells(m: RankMemory, activations: bool) -> list[str]:
    """params, grads, master, optimizer, activations (``n/a``: not measured), peak total."""
    cells = [format_bytes(x) for x in (m.params, m.grads, m.master, m.optimizer)]
    cells.append(format_bytes(m.activations) if activations else "n/a")
    return [*cells, format_bytes(m.total)]


def format_memory_table(ranks: Sequence[RankMemory], *, activations: bool = True) -> str:
    """One row per pipeline rank: its predicted peak by part (one data-parallel replica), and
    when it peaks: in forward/backward (``fwd/bwd``, the parts' sum) or at the optimizer step
    (``opt step``: the training states there, see :attr:`RankMemory.total`).

    Example:
        >>> m = RankMemory(0, params=2**30, grads=2**30, optimizer=2**31, activations=0,
        ...                buffers=0)
        >>> print(format_memory_table([m], activations=False))
        rank    params     grads  master  optimizer  activations  buffers     total  peak at
        ----  --------  --------  ------  ---------  -----------  -------  --------  -------
           0  1.00 GiB  1.00 GiB     0 B   2.00 GiB          n/a      0 B  4.00 GiB  fwd/bwd
    """
    head = ("rank", "params", "grads", "master", "optimizer", "activations", "buffers", "total")
    rows: list[tuple[str, ...]] = [(*head, "peak at")]
    for m in ranks:
        cells = _state_cells(m, activations)
        when = "opt step" if m.at_optimizer_step > m.forward_backward else "fwd/bwd"
        rows.append((str(m.rank), *cells[:5], format_bytes(m.buffers), cells[5], when))
    return _grid(rows, set(range(len(head))))


def format_sharding_table(
    rows: Sequence[ShardingMemory],
    *,
    limit: int | None = None,
    current: str | None = None,
    activations: bool = True,
) -> str:
    """One row per sharding: the heaviest pipeline rank's peak by part, the states it holds at
    the optimizer step, and whether the peak fits in ``limit`` bytes (``current``: the
    sharding the config runs, marked ``*``)."""
    head = ["sharding", "rank", "params", "grads", "master", "optimizer", "activations"]
    head += ["peak", "states at step"]
    if limit is not None:
        head.append(f"fits {format_bytes(limit)}")
    out = [tuple(head)]
    for row in rows:
        m = row.heaviest
        label = row.label + (" *" if row.label == current else "")
        cells = [label, str(m.rank), *_state_cells(m, activations)]
        cells.append(format_bytes(m.state.total_at_step) if m.state is not None else "?")
        if limit is not None:
            cells.append("yes" if row.fits(limit) else "NO")
        out.append(tuple(cells))
    return _grid(out, set(range(1, 9)))


def format_tp_table(
    rows: Sequence[tuple[int, int, ShardingMemory | str]],
    *,
    limit: int | None = None,
    current: int | None = None,
    activations: bool = True,
) -> str:
    """One row per tensor-parallel size ``(tp, dp, memory or why not)``: the heaviest pipeline
    rank's peak by part on one tp rank, its sharding, and whether it fits in ``limit`` bytes
    (``current``: the config's tp, marked ``*``).

    Example:
        >>> print(format_tp_table([(8, 0, "heads=12")], limit=80 << 30))
        tp  dp  sharding  rank  params  grads  master  optimizer  activations  peak  fits 80.00 GiB
        --  --  --------  ----  ------  -----  ------  ---------  -----------  ----  --------------
         8   -  -            -       -      -       -          -            -     -  heads=12
    """
    head = ["tp", "dp", "sharding", "rank", "params", "grads", "master", "optimizer"]
    head += ["activations", "peak", f"fits {format_bytes(limit)}" if limit is not None else ""]
    out = [tuple(head)]
    for tp, dp, row in rows:
        mark = f"{tp} *" if tp == current else str(tp)
        if isinstance(row, str):
            out.append((mark, str(dp) if dp else "-", *["-"] * 8, row))
            continue
        m = row.heaviest
        fits = "" if limit is None else ("yes" if row.fits(limit) else "NO")
        out.append((mark, str(dp), row.label, str(m.rank), *_state_cells(m, activations), fits))
    return _grid(out, {0, 1, 3, 4, 5, 6, 7, 8, 9})


def chosen_config(data: dict[str, Any], chosen: Prediction, *, world: int) -> dict[str, Any]:
    """A copy of a run config tree (``RunConfig.data``) set to ``chosen``'s shape: the strategy
    section (pp, vpp, microbatches, schedule, explicit per-stage layer counts, recompute,
    zero, fsdp), the
    per-replica batch size and ``trainer.devices`` (``world / num_nodes``)."""
    out = copy.deepcopy(data)
    c = chosen.candidate
    strategy = out.get("strategy")
    if not isinstance(strategy, dict):
        strategy = {}
    strategy.pop("activation_budget", None)  # only meaningful with recompute="auto"
    strategy.update(c.strategy_settings())
    out["strategy"] = strategy
    trainer = out.setdefault("trainer", {})
    nodes = trainer.get("num_nodes", 1) or 1
    if world % nodes:
        raise ValueError(f"world size {world} does not split over trainer.num_nodes={nodes}")
    trainer["devices"] = world // nodes
    data_section = out.get("data")
    if isinstance(data_section, dict):
        args = data_section.get("init_args") if "class_path" in data_section else data_section
        if isinstance(args, dict):
            args["batch_size"] = c.batch_size
    return out
