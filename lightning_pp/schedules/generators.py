"""Schedule generators: GPipe, 1F1B and Megatron's interleaved 1F1B, as per-rank action lists.

Every generator returns a :class:`Schedule`; invalid shapes raise ``ValueError`` naming the
numbers involved, before anything runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from .actions import Action, Op, Schedule


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def gpipe(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """All forwards, then all backwards (FIFO: microbatch 0 goes backward first).

    With ``vpp > 1`` chunks run breadth-first (all microbatches through chunk 0, then chunk 1, ...)
    and backwards in reverse chunk order: the looped-BFS variant of GPipe.
    """
    _check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    m = microbatches
    ranks = []
    for _ in range(pp):
        fwd = [Action(Op.F, i, c) for c in range(vpp) for i in range(m)]
        bwd = [Action(Op.B, i, c) for c in reversed(range(vpp)) for i in range(m)]
        ranks.append(tuple(fwd + bwd))
    return Schedule("gpipe", pp, vpp, m, tuple(ranks))


def one_f_one_b(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Megatron's non-interleaved 1F1B (PipeDream-flush).

    Rank r runs ``min(pp - r - 1, m)`` warmup forwards: the later a stage, the sooner its first
    backward arrives, so the last stage needs none. Then it alternates one forward and one
    backward, which caps its in-flight microbatches at ``pp - r`` whatever ``m`` is; the
    remaining backwards drain in the cooldown.
    """
    _check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    if vpp != 1:
        raise ValueError(
            f"schedule '1f1b' runs one chunk per rank but vpp={vpp}; "
            f"use schedule='interleaved' for vpp > 1 (or set vpp=1)"
        )
    m = microbatches
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        remaining = m - warmup
        order = [Action(Op.F, i) for i in range(warmup)]
        for i in range(remaining):
            order.append(Action(Op.F, warmup + i))
            order.append(Action(Op.B, i))
        order += [Action(Op.B, i) for i in range(remaining, m)]
        ranks.append(tuple(order))
    return Schedule("1f1b", pp, 1, m, tuple(ranks))


def interleaved_table(microbatches: int, vpp: int, group_size: int) -> list[tuple[int, int]]:
    """Megatron's ``get_schedule_table``: virtual microbatch k -> (microbatch, forward chunk).

    Microbatches are taken in groups of ``group_size``; each group goes through chunk 0, then
    chunk 1, ... The last group absorbs the remainder when ``m`` is not a multiple of the group.
    """
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group_size):
        stop = microbatches if start + group_size >= microbatches else start + group_size
        table += [(mb, c) for c in range(vpp) for mb in range(start, stop)]
        if stop == microbatches:
            break
    return table


def interleaved(pp: int, microbatches: int, vpp: int = 2, group_size: int | None = None) -> Schedule:
    """Megatron-core's interleaved 1F1B, action for action.

    Chunk c of rank r is virtual stage ``c * pp + r``. Warmup on rank r is
    ``2 * (pp - r - 1) + (vpp - 1) * N`` forwards, capped at ``m * vpp``: a forward must travel
    through all later ranks twice (down the pipeline and, for the backward, back) before rank r's
    first backward can start, and the other ``vpp - 1`` chunks of the first group of N
    microbatches are scheduled before it. When ``m == pp`` everything is warmup (Megatron's
    ``all_warmup_microbatches``). ``N`` (``group_size``) defaults to ``pp`` and must lie in
    ``[pp, m]``.
    """
    _check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    m = microbatches
    n = pp if group_size is None else group_size
    _check_positive(group_size=n)
    if vpp < 2:
        raise ValueError(
            f"schedule 'interleaved' needs vpp >= 2 chunks per rank, got vpp={vpp}; "
            f"use schedule='1f1b' for vpp=1"
        )
    if m < pp:
        raise ValueError(
            f"interleaved schedule needs microbatches >= pp: got microbatches={m} < pp={pp} "
            f"(raise microbatches to at least {pp})"
        )
    if not pp <= n <= m:
        raise ValueError(
            f"interleaved group_size N must satisfy pp <= N <= microbatches: "
            f"got N={n}, pp={pp}, microbatches={m}"
        )
    table = interleaved_table(m, vpp, n)
    total = m * vpp
    ranks = []
    for r in range(pp):
        if m == pp:
            warmup = total
        else:
            warmup = min(2 * (pp - r - 1) + (vpp - 1) * n, total)

        def fwd(k: int) -> Action:
            mb, c = table[k]
            return Action(Op.F, mb, c)

        def bwd(k: int) -> Action:
            mb, c = table[k]
            return Action(Op.B, mb, vpp - 1 - c)

        order = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            order.append(fwd(warmup + k))
            order.append(bwd(k))
        order += [bwd(k) for k in range(total - warmup, total)]
        ranks.append(tuple(order))
    return Schedule("interleaved", pp, vpp, m, tuple(ranks), group_size=n)


SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
}


def check_schedule_name(name: str) -> str:
    """Return ``name`` if it is a known schedule, else raise with a did-you-mean."""
    if name in SCHEDULES:
        return name
    close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}.{hint}")


def build_schedule(
    name: str, pp: int, microbatches: int, vpp: int = 1, group_size: int | None = None
) -> Schedule:
    """Build a schedule by name.

    Example:
        >>> s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
        >>> (s.pp, s.vpp, len(s.ranks[0]))
        (4, 2, 32)
    """
    check_schedule_name(name)
    if name == "interleaved":
        return interleaved(pp, microbatches, vpp=vpp, group_size=group_size)
    if group_size is not None:
        raise ValueError(f"group_size applies only to the interleaved schedule, not {name!r}")
    return SCHEDULES[name](pp, microbatches, vpp=vpp)
