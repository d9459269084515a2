"""Schedule generators: GPipe, 1F1B and Megatron's interleaved 1F1B, as per-rank action lists.

Every generator returns a :class:`Schedule`; invalid shapes raise ``ValueError`` naming the
numbers involved, before anything runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from .actions import Action, Op, Schedule


def check_positive(error: type[Exception] = ValueError, **values: object) -> None:
    """Raise ``error`` naming the first of ``values`` that is not a positive int (bools too).

    The one place for this check: schedules, partition, topology, preflight and the strategy
    all report it in the same words.
    """
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise error(f"{name} must be a positive integer, got {value!r}")


def gpipe(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """All forwards, then all backwards (FIFO: microbatch 0 goes backward first).

    With ``vpp > 1`` chunks run breadth-first (all microbatches through chunk 0, then chunk 1, ...)
    and backwards in reverse chunk order: the looped-BFS variant of GPipe. Megatron-core has no
    GPipe; this is the reference schedule (every rank holds all ``m * vpp`` activations).
    """
    check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    m = microbatches
    ranks = []
    for _ in range(pp):
        fwd = [Action(Op.F, i, c) for c in range(vpp) for i in range(m)]
        bwd = [Action(Op.B, i, c) for c in reversed(range(vpp)) for i in range(m)]
        ranks.append(tuple(fwd + bwd))
    return Schedule("gpipe", pp, vpp, m, tuple(ranks))


def one_f_one_b(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """Megatron-core's non-interleaved 1F1B (PipeDream-flush), action for action.

    Follows ``forward_backward_pipelining_without_interleaving``: warmup
    ``min(pp - r - 1, m)`` (so ``m < pp`` is accepted, as in Megatron), steady pairs
    (forward ``warmup + i``, backward ``i``), cooldown backwards.

    Rank r runs ``min(pp - r - 1, m)`` warmup forwards: the later a stage, the sooner its first
    backward arrives, so the last stage needs none. Then it alternates one forward and one
    backward, which caps its in-flight microbatches at ``pp - r`` whatever ``m`` is; the
    remaining backwards drain in the cooldown.
    """
    check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
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

    Microbatches are taken in consecutive groups of ``group_size``; each group goes through
    chunk 0, then chunk 1, ... The final group is simply shorter when ``m`` is not a multiple of
    the group size (``m % N`` microbatches), exactly as in Megatron-core.

    Example:
        >>> interleaved_table(5, 2, 3)  # Megatron's own example: PP2 N3 M5 VP2
        [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (3, 1), (4, 1)]
    """
    table: list[tuple[int, int]] = []
    for start in range(0, microbatches, group_size):
        stop = min(start + group_size, microbatches)
        table += [(mb, c) for c in range(vpp) for mb in range(start, stop)]
    return table


def interleaved_warmup(pp: int, rank: int, microbatches: int, vpp: int, group_size: int) -> int:
    """Forward steps rank ``rank`` runs before its first backward (Megatron-core's rule).

    ``2 * (pp - rank - 1)``: the first forward must cross every later rank and its gradient must
    cross them back before this rank can run a backward; ``(vpp - 1) * N``: the first group's
    forwards through the other chunks come first in the table. Capped at ``m * vpp``, in which case
    the whole step is forward-then-backward (Megatron's ``are_all_microbatches_in_warmup``).
    """
    return min(2 * (pp - rank - 1) + (vpp - 1) * group_size, microbatches * vpp)


def check_interleaved(pp: int, microbatches: int, vpp: int, group_size: int | None) -> int:
    """Reject every shape Megatron-core's interleaved schedule rejects; return the group size N.

    Rules (Megatron-core ``forward_backward_pipelining_with_interleaving``):

    * it is only selected for ``pp > 1`` with a virtual pipeline, so ``pp >= 2`` and ``vpp >= 2``;
    * ``microbatch_group_size_per_vp_stage`` N must lie in ``[pp, m]`` (default N = pp, so this
      also requires ``m >= pp``);
    * the last group, ``m % N``, must be 0 or at least ``pp``: a shorter group leaves dependency
      bubbles (Megatron raises there too).
    """
    check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    m = microbatches
    n = pp if group_size is None else group_size
    check_positive(group_size=n)
    shape = f"(pp={pp}, vpp={vpp}, microbatches={m}, N={n})"
    if vpp < 2:
        raise ValueError(
            f"schedule 'interleaved' needs vpp >= 2 chunks per rank, got vpp={vpp} {shape}; "
            f"use schedule='1f1b' for vpp=1"
        )
    if pp < 2:
        raise ValueError(
            f"schedule 'interleaved' needs pp >= 2 ranks, got pp={pp} {shape}; with a single "
            f"rank there is no pipeline to interleave: use schedule='gpipe'"
        )
    if m < pp:
        raise ValueError(
            f"interleaved schedule needs microbatches >= pp: got microbatches={m} < pp={pp} "
            f"{shape}; raise microbatches to at least {pp}"
        )
    if not pp <= n <= m:
        raise ValueError(
            f"interleaved group size N must satisfy pp <= N <= microbatches: got N={n}, "
            f"pp={pp}, microbatches={m} {shape}"
        )
    if 0 < m % n < pp:
        raise ValueError(
            f"interleaved: the last microbatch group would hold microbatches % N = {m} % {n} = "
            f"{m % n} < pp={pp} microbatches, which stalls the pipeline {shape}; choose N "
            f"dividing microbatches={m} (e.g. N={m}) or leaving a remainder >= pp"
        )
    return n


def interleaved(
    pp: int, microbatches: int, vpp: int = 2, group_size: int | None = None
) -> Schedule:
    """Megatron-core's interleaved 1F1B, action for action.

    Chunk c of rank r is virtual stage ``c * pp + r``. Rank r walks the virtual microbatches
    k = 0 .. m*vpp-1 of :func:`interleaved_table`: ``W`` warmup forwards
    (:func:`interleaved_warmup`), then steady pairs (forward ``W + k``, backward ``k``), then the
    cooldown backwards. Backward k runs chunk ``vpp - 1 - c`` of table entry k: gradients flow
    through the chunks in reverse. Its microbatch is the oldest forward of that chunk not yet
    backwarded (Megatron pops its stashes FIFO), which is the table's microbatch. ``N``
    (``group_size``) defaults to ``pp``; see :func:`check_interleaved` for the accepted shapes.

    Megatron-core dropped the old "``m == pp`` means all warmup" special case when it introduced
    the group table: all-warmup now happens exactly when the warmup count reaches ``m * vpp``.
    We follow the current rule.
    """
    n = check_interleaved(pp, microbatches, vpp, group_size)
    m = microbatches
    table = interleaved_table(m, vpp, n)
    total = m * vpp
    fwd = [Action(Op.F, mb, c) for mb, c in table]
    bwd = [Action(Op.B, mb, vpp - 1 - c) for mb, c in table]
    ranks = []
    for r in range(pp):
        warmup = interleaved_warmup(pp, r, m, vpp, n)
        order = fwd[:warmup]
        for k in range(total - warmup):
            order += [fwd[warmup + k], bwd[k]]
        order += bwd[total - warmup :]
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
