"""Present a search: the top-k table, and the chosen candidate as a run file for ``fit``.

Example::

    print(format_table(result.ranked[:5], tokens=True))
    data = chosen_config(cfg.data, result.best, world=4)   # a RunConfig tree
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

from ..layout.recompute_spec import format_bytes
from .search import Prediction

__all__ = ["chosen_config", "format_table"]


def format_table(predictions: Sequence[Prediction], *, first_rank: int = 1) -> str:
    """One row per prediction: rank, shape ``dp x pp x vpp``, microbatches, schedule, split,
    recompute, predicted step time, throughput (tokens/s when the profile knows the tokens per
    sample, else samples/s), bubble (idle / compute) and the heaviest pipeline rank's memory."""
    tokens = bool(predictions) and predictions[0].tokens_per_s is not None
    head = (
        "#",
        "dp x pp x vpp",
        "m",
        "schedule",
        "split",
        "recompute",
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
                f"{p.step_s * 1e3:.1f}",
                f"{rate:,.0f}",
                f"{100 * p.bubble:.1f}%",
                f"{format_bytes(p.peak_bytes)} ({p.heaviest.rank})",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    right = {0, 2, 6, 7, 8}
    lines = []
    for r in rows:
        cells = [
            v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(r, widths))
        ]
        lines.append("  ".join(cells).rstrip())
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def chosen_config(data: dict[str, Any], chosen: Prediction, *, world: int) -> dict[str, Any]:
    """A copy of a run config tree (``RunConfig.data``) set to ``chosen``'s shape: the strategy
    section (pp, vpp, microbatches, schedule, explicit per-stage layer counts, recompute), the
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
