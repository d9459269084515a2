"""Schedule generators: GPipe, 1F1B, Megatron's interleaved 1F1B and the zero-bubble ZB-H1 and
ZB-V, as per-rank action lists.

Every generator returns a :class:`Schedule`; invalid shapes raise ``ValueError`` naming the
numbers involved, before anything runs.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable

from .actions import Action, Op, Schedule


def check_positive(error: type[Exception] = ValueError, **values: object) -> None:
    """Raise ``error`` naming the first of ``values`` that is not a positive int (bools too).

    The one place for this check: schedules, partition, topology, the plan and the strategy
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


def zb_h1(pp: int, microbatches: int, vpp: int = 1) -> Schedule:
    """ZB-H1, the handcrafted zero-bubble schedule of Qi et al., "Zero Bubble Pipeline
    Parallelism" (ICLR 2024), Section 3.1 and Figure 3 (top).

    The forwards and input gradients (``I``) run exactly 1F1B's order: rank r runs
    ``min(pp - r - 1, m)`` warmup forwards, then forward ``warmup + k`` and ``I`` of microbatch
    ``k`` for k = 0 .. m-1 (no forward once all m have run). The weight gradients (``W``) lag
    the ``I``'s by ``r`` on rank r: ``W(k - r)`` follows ``I(k)``, and the last ``r`` W's close
    the step. Why: the cooldown gradient chain from the last rank back to rank 0 now carries only
    ``I``'s (each rank forwards the gradient as soon as its ``I`` is done), and the W's a rank
    deferred fill the time it would otherwise wait for the next gradient. Rank 0 (no lag) keeps
    1F1B's F-I-W rhythm and is never the one that waits for deferred work.

    Cost: each rank idles ``(p - 1) * (t_f + t_i - t_w)`` instead of 1F1B's
    ``(p - 1) * (t_f + t_b)`` (see docs/schedules.md for the exact conditions). Memory: the
    microbatches whose ``I`` has not run are 1F1B's ``p - r``; counting until ``W`` (the saved
    inputs W needs) every rank holds ``min(p, m)``, which is 1F1B's peak (rank 0's) on every rank.

    Compared with torch's ``ScheduleInterleavedZeroBubble._calculate_single_rank_operations``
    (torch 2.13, v=1, which delays W's by ``num_1f1b_microbatches = rank``): the same order
    for ``v = 1``; written here from the paper's figure as one loop.

    Example:
        >>> s = zb_h1(2, 3)
        >>> " ".join(str(a) for a in s.ranks[0])
        'F0 F1 I0 W0 F2 I1 W1 I2 W2'
        >>> " ".join(str(a) for a in s.ranks[1])
        'F0 I0 F1 I1 W0 F2 I2 W1 W2'
    """
    check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    if vpp != 1:
        raise ValueError(
            f"schedule 'zb-h1' runs one chunk per rank but vpp={vpp}; use schedule='zbv' for "
            f"two chunks per rank (or set vpp=1)"
        )
    m = microbatches
    ranks = []
    for r in range(pp):
        warmup = min(pp - r - 1, m)
        order = [Action(Op.F, i) for i in range(warmup)]
        for k in range(m):
            if warmup + k < m:
                order.append(Action(Op.F, warmup + k))
            order.append(Action(Op.I, k))
            if k >= r:
                order.append(Action(Op.W, k - r))
        order += [Action(Op.W, j) for j in range(max(m - r, 0), m)]
        ranks.append(tuple(order))
    return Schedule("zb-h1", pp, 1, m, tuple(ranks))


def zbv(pp: int, microbatches: int, vpp: int = 2) -> Schedule:
    """ZB-V of Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), Section 6 and its
    Figure 8: two chunks per rank in V placement (rank r holds virtual stages ``r`` and
    ``2p - 1 - r``), so rank 0 holds both the first and the last stage.

    Rank r, with chunk 0 the way down and chunk 1 the way back up (each step costs one unit
    when t_f = t_i = t_w):

    1. ``2(p - r) - 1`` forwards of chunk 0: microbatch 0 needs that long to go down the
       remaining ranks and come back up to this rank's chunk 1;
    2. ``r`` pairs (F chunk 1, F chunk 0): the first gradient is still on its way back;
    3. ``p - r`` triples (F, I, W of chunk 1): chunk 1's gradients arrive one per triple;
    4. steady: (F, I, W of chunk 0) then (F, I, W of chunk 1) until all forwards ran and
       chunk 1 has caught up with chunk 0;
    5. cooldown: ``r`` pairs (I chunk 0, I chunk 1), then ``p - r`` pairs (I chunk 0, W chunk
       0): the I's forward the gradient at once, the W's fill the waits;
    6. the remaining W's, chunk 1's first, then chunk 0's.

    Every rank then holds at most ``2p`` microbatch-chunks until their ``W`` (``p`` stages'
    worth, 1F1B's peak, on every rank).

    The phases need ``m >= 2p - 1`` microbatches to fill the V. For fewer, the order for
    ``2p - 1`` is built and the microbatches ``>= m`` are dropped from every rank: dependencies
    never cross microbatches and each rank keeps its relative order, so the restriction of a
    valid schedule is valid. Any ``m >= 1`` is accepted, and any ``pp >= 1``.

    Compared with torch's ``ScheduleZBVZeroBubble._calculate_single_rank_operations``
    (torch 2.13): the same phases, which torch also pads to ``2p - 1`` microbatches; written
    here from the paper's figure.

    Example:
        >>> s = zbv(2, 4)
        >>> s.placement, s.stages_of(0), s.stages_of(1)
        ('v', (0, 3), (1, 2))
        >>> " ".join(a.short(show_chunk=True) for a in s.ranks[1][:12])
        'F0.0 F0.1 F1.0 F1.1 I0.1 W0.1 F2.0 I0.0 W0.0 F2.1 I1.1 W1.1'
        >>> " ".join(a.short(show_chunk=True) for a in s.ranks[1][12:])
        'F3.0 I1.0 W1.0 F3.1 I2.1 W2.1 I2.0 I3.1 I3.0 W2.0 W3.1 W3.0'
    """
    check_positive(pp=pp, vpp=vpp, microbatches=microbatches)
    if vpp != 2:
        raise ValueError(
            f"schedule 'zbv' runs exactly 2 chunks per rank (V placement) but vpp={vpp} was "
            f"given; set vpp=2 or leave vpp unset (zbv's own 2 chunks), or use schedule="
            f"'zb-h1' for vpp=1"
        )
    n = max(microbatches, 2 * pp - 1)
    ranks = (tuple(a for a in _zbv_rank(pp, r, n) if a.mb < microbatches) for r in range(pp))
    return Schedule("zbv", pp, 2, microbatches, tuple(ranks), placement="v")


def _zbv_rank(p: int, r: int, n: int) -> list[Action]:
    """Rank ``r``'s ZB-V order for ``n >= 2p - 1`` microbatches (phases as in :func:`zbv`)."""
    steps: list[Action] = []
    nxt = {op: [0, 0] for op in (Op.F, Op.I, Op.W)}  # next microbatch per (op, chunk)

    def run(op: Op, c: int) -> None:
        steps.append(Action(op, nxt[op][c], c))
        nxt[op][c] += 1

    f = nxt[Op.F]
    for _ in range(2 * (p - r) - 1):
        run(Op.F, 0)
    for _ in range(r):
        run(Op.F, 1)
        run(Op.F, 0)
    for _ in range(p - r):
        for op in (Op.F, Op.I, Op.W):
            run(op, 1)
    while f[0] < n or f[1] < f[0]:
        if f[0] < n:
            run(Op.F, 0)
        run(Op.I, 0)
        run(Op.W, 0)
        for op in (Op.F, Op.I, Op.W):
            run(op, 1)
    for _ in range(r):
        run(Op.I, 0)
        run(Op.I, 1)
    for _ in range(p - r):
        run(Op.I, 0)
        run(Op.W, 0)
    for c in (1, 0):
        while nxt[Op.W][c] < n:
            run(Op.W, c)
    return steps


#: every schedule by name; ``"zb-auto"`` (:func:`lightning_pp.schedules.auto.zb_auto`) is
#: entered by its own module, which builds on the generators here (the package imports it)
SCHEDULES: dict[str, Callable[..., Schedule]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved,
    "zb-h1": zb_h1,
    "zbv": zbv,
}

#: chunks per rank a schedule runs when the caller leaves ``vpp`` unset (zb-auto: 2, in V
#: placement, the layout where a computed order has the most room; vpp=1 gives loop placement)
DEFAULT_VPP: dict[str, int] = {"zbv": 2, "zb-auto": 2}


def chunks_per_rank(name: str, vpp: int | None = None) -> int:
    """``vpp`` when given, else schedule ``name``'s own chunk count (2 for ``zbv``, else 1).

    The one place "unset" is resolved: the strategy, the CLI's checks and
    :func:`build_schedule` all read it here.

    >>> chunks_per_rank("zbv"), chunks_per_rank("1f1b"), chunks_per_rank("interleaved", 3)
    (2, 1, 3)
    """
    return vpp if vpp is not None else DEFAULT_VPP.get(name, 1)


def check_schedule_name(name: str) -> str:
    """Return ``name`` if it is a known schedule, else raise with a did-you-mean."""
    if name in SCHEDULES:
        return name
    close = difflib.get_close_matches(str(name), list(SCHEDULES), n=1)
    hint = f" Did you mean '{close[0]}'?" if close else ""
    raise ValueError(f"unknown schedule {name!r}; choose one of {sorted(SCHEDULES)}.{hint}")


def build_schedule(
    name: str,
    pp: int,
    microbatches: int,
    vpp: int | None = None,
    group_size: int | None = None,
    costs: object | None = None,
    memory: object | None = None,
) -> Schedule:
    """Build a schedule by name.

    ``costs`` (a :class:`~lightning_pp.schedules.simulate.Costs`) and ``memory`` (see
    :func:`~lightning_pp.schedules.auto.memory_limits`) are what ``zb-auto`` is built from
    (unset: ``t_f = t_i = t_w`` and 1F1B's peak memory); the other schedules take neither.

    ``vpp=None`` (unset, every front end's default) means the schedule's own chunk count:
    2 for ``zbv``, else 1. A given ``vpp`` is taken as given: one the schedule cannot run
    (``zbv`` with anything but 2, ``1f1b``/``zb-h1`` with more than 1, ``interleaved`` with 1)
    is an error naming it, never replaced. The returned ``schedule.vpp`` is what to partition
    by.

    Example:
        >>> s = build_schedule("interleaved", pp=4, vpp=2, microbatches=8)
        >>> (s.pp, s.vpp, len(s.ranks[0]))
        (4, 2, 32)
        >>> build_schedule("zbv", pp=4, microbatches=8).vpp
        2
        >>> build_schedule("zbv", pp=4, microbatches=8, vpp=1)
        Traceback (most recent call last):
        ...
        ValueError: schedule 'zbv' runs exactly 2 chunks per rank (V placement) but vpp=1 was ...
    """
    check_schedule_name(name)
    vpp = chunks_per_rank(name, vpp)
    if name == "interleaved":
        return interleaved(pp, microbatches, vpp=vpp, group_size=group_size)
    if group_size is not None:
        raise ValueError(f"group_size applies only to the interleaved schedule, not {name!r}")
    if name == "zb-auto":
        extra = {"costs": costs, "memory": memory if memory is not None else "1p"}
        return SCHEDULES[name](pp, microbatches, vpp=vpp, **extra)
    if costs is not None or memory is not None:
        raise ValueError(
            f"costs and memory are what schedule 'zb-auto' is built from; {name!r} is a fixed "
            f"order (simulate it under costs instead)"
        )
    return SCHEDULES[name](pp, microbatches, vpp=vpp)
